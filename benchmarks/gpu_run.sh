#!/usr/bin/env bash
# The GPU tests and benchmarks of docs/benchmarks.md, in phases, for a Linux machine with NVIDIA GPUs that may
# have no network. Dependencies come from wheel folders in the working tree (pip --no-index) and go into folders
# under /tmp, which PYTHONPATH puts after the working tree: /tmp/site-tl (tilelang), /tmp/site-fla (fla,
# causal-conv1d, kernels, liger-kernel), /tmp/site-ex (the SFT example's datasets and its dependencies). Every
# phase writes its logs and results under $OUT (default /tmp/out); compile caches are kept under /tmp/cache.
#   bash benchmarks/gpu_run.sh tilelang            # install tilelang (.whl-tl1/); with a causal-conv1d sdist in
#                                                      #   .src/, build it in the background (fusepatch build)
#   bash benchmarks/gpu_run.sh tests               # needs .whl-tl2/ and .whl/: deps, fla, all GPU tests, doctor
#                                                      #   (TESTS=files, K=filter, TAG=log name suffix, DOCTOR=0: no doctor,
#                                                      #   DIST=loadgroup: xdist's grouping)
#   bash benchmarks/gpu_run.sh built               # the built causal-conv1d wheel: install it, test it, doctor
#   bash benchmarks/gpu_run.sh bench 27b [layers]  # the benchmark table for one shape (benchmarks/run_all.py)
#   CONFIGS=fusepatch bash benchmarks/gpu_run.sh probe 27b  # where a synced step's forward waits for the host
#   bash benchmarks/gpu_run.sh loss 27b            # the loss alone (benchmarks/studies/loss_bench.py)
#   bash benchmarks/gpu_run.sh tracecheck          # which patched forward dynamo's trace gets wrong (trace_check.py)
#   bash benchmarks/gpu_run.sh fidelity 27b        # gradients against fp32 eager (benchmarks/studies/fidelity.py)
#   bash benchmarks/gpu_run.sh depthfit 27b         # the deepest full fine-tuning that fits one GPU, per configuration
#                                                      #   (benchmarks/studies/depth_fit.py; CONFIGS, LORA=R as bench;
#                                                      #   LOW, HIGH: the depths bisected, static_memory.py's estimate)
#   bash benchmarks/gpu_run.sh warmstart 27b       # `fusepatch warmup` on fresh caches, then a new process's first step
#   bash benchmarks/gpu_run.sh curves              # needs .whl-ex/: SFT loss curves, two seeds (loss_curves.py)
#   bash benchmarks/gpu_run.sh textcurves          # bf16 vs fp8 on unrepeated text, two seeds (text_curves.py;
#                                                      #   FAST_ACCUM=1: and fp8 with fast accumulation)
#   bash benchmarks/gpu_run.sh norm                # the RMSNorm candidates alone (benchmarks/studies/norm_bench.py)
#   bash benchmarks/gpu_run.sh moe                 # the MoE experts op alone, per candidate (benchmarks/studies/moe_bench.py;
#                                                      #   FP8=1: its GEMMs bf16 against FP8)
#   COMMIT=<hash> bash benchmarks/gpu_run.sh selftestcost  # what the self-test costs each op (selftest_cost.py)
#   COMMIT=<hash> bash benchmarks/gpu_run.sh selftestsweep  # clean self-tests over many seeds (selftest_sweep.py)
#   bash benchmarks/gpu_run.sh dqkwg               # fla's TileLang dqkwg kernel at other tilings (dqkwg_bench.py)
#   bash benchmarks/gpu_run.sh gemm 27b            # the step's GEMMs alone, each layout (benchmarks/studies/gemm_bench.py;
#                                                      #   FP8=1: the FP8 projections' GEMMs)
#   bash benchmarks/gpu_run.sh sft                 # needs .whl/ and .whl-ex/: the SFT example, FSDP2 world size 1
#                                                      #   (NPROC=all STEPS=30 LAYERS=N: every GPU)
#   bash benchmarks/gpu_run.sh start [STEPS...]    # needs .whl-tl2/, .whl/, .whl-ex/: run STEPS (default: bench-27b
#                                                      #   tests bench-2b sft) one after another in the background
#   bash benchmarks/gpu_run.sh poll SECONDS        # wait (at most SECONDS) and print what is done so far
# start/poll: a sequence of steps runs detached from the shell that started it, with no idle gap between them
# (a `+` waits for every lane of the stage before it, a `/` splits a stage into lanes: see `start`); `poll`
# prints its progress and each step's last log lines, and packs /tmp/seq (progress, a log per step, out/) into
# $OUT. Run `tilelang` first: the other phases need it on the same machine (all but norm, moe and gemm).
# Wheel folders: .whl-tl1/ (tilelang), .whl-tl2/ (more wheels for /tmp/site-tl), .whl/ (fla-core,
# flash-linear-attention, causal-conv1d, kernels, liger-kernel), .whl-ex/ (datasets, dill, multiprocess), .whl-pa/
# (a newer pyarrow, where the image's is older than 24); .src/ holds a causal-conv1d sdist. Fill them with
# `pip download` for the GPU machine's Python and platform.
set -uo pipefail
phase=${1:?phase}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site-fla /tmp/site-tl
# Inside a started sequence everything is installed once by `start`: steps running side by side must not
# reinstall into the folders the other lane is importing from.
pipi() { [ "${SEQ_INSTALLED:-0}" = 1 ] && return 0; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${@:2}"; }
# One compile cache for every phase and process on the machine: later phases reuse what earlier ones compiled.
export FLA_FLASH_QLA=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/cache/triton TILELANG_CACHE_DIR=/tmp/cache/tilelang
export FUSEPATCH_CACHE=/tmp/cache/fusepatch
export HF_HUB_OFFLINE=1  # the machine may have no network: Hub candidates look in the local cache only, at once
need_tilelang() { [ -d /tmp/site-tl/tilelang ] || { echo "tilelang missing: run the tilelang phase first"; exit 3; }; }
case "$phase" in
  tilelang)
    pipi /tmp/site-tl .whl-tl1/*.whl && ls /tmp/site-tl | head -3
    python3 -c "import pyarrow; print('pyarrow', pyarrow.__version__, '(datasets 5.2 needs >= 24: else carry .whl-pa)')"
    if ls .src/causal_conv1d-*.tar.gz >/dev/null 2>&1; then
      # The source build runs beside the next phases (CPU only, niced), on its own copy of fusepatch, so that
      # the working tree may change meanwhile.
      sdist=$(ls .src/causal_conv1d-*.tar.gz | head -1)
      rm -rf /tmp/build && mkdir -p /tmp/build && cp -r fusepatch "$sdist" /tmp/build/
      (cd /tmp/build && setsid nohup bash -c "s=\$(date +%s); PYTHONPATH=/tmp/build nice -n 10 python3 -m fusepatch build \
        causal-conv1d --sdist /tmp/build/$(basename "$sdist") --jobs 8 --no-install; \
        echo \"exit \$? after \$((\$(date +%s) - s)) s\"") > /tmp/build/build.log 2>&1 < /dev/null &
      echo "causal-conv1d build started in the background (log /tmp/build/build.log)"
    fi ;;
  tests)
    need_tilelang
    pipi /tmp/site-tl .whl-tl2/*.whl
    pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl .whl/kernels-*.whl
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    ls .whl-ex/*.whl >/dev/null 2>&1 && pipi /tmp/site-ex .whl-ex/*.whl
    export PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl:/tmp/site-ex"
    # The tests compile into a cache of their own, with Triton's autotuning results on disk: a worker reuses what
    # another one timed (the delta rule's kernels autotune for minutes). Apart from the benchmarks' cache, since
    # fla keeps its autotuning results there too: a benchmark autotunes for itself, not from timings made under the
    # tests' compile load.
    export TRITON_CACHE_DIR=/tmp/cache/triton-tests TRITON_CACHE_AUTOTUNING=1
    # What the tests write (errors, stage-fault rows, failures), a folder per TAG, emptied first: a second tests
    # step on the same machine, or a lane beside it, keeps its own (lanes side by side need different TAGs)
    errors=/tmp/errors/${TAG:-run}; rm -rf "$errors"; mkdir -p "$errors"
    # pytest-xdist: the tests are dominated by Triton/TileLang compiling (CPU), so workers compile in parallel.
    # The op files first: they fill the compile caches (same head sizes) that the model files then reuse.
    # -v, a log per group and the errors each test measured: partial results survive a group cut off at its limit.
    # TESTS replaces the groups (one group), K adds a -k filter.
    # (a step's own TESTS may separate files with commas: a step's environment cannot hold spaces)
    groups=${TESTS:-"tests/gpu/test_gdn_ops.py tests/gpu/test_other_ops.py tests/gpu/test_attention.py|tests/gpu/test_gdn_models.py tests/gpu/test_models.py tests/gpu/test_trainer.py"}
    groups=${groups//,/ }
    # a step's K may list names with commas: K=saved_states,cross_entropy is -k "saved_states or cross_entropy"
    # (its environment splits on ':', so test ids with '::' cannot go in a step's TESTS)
    K=${K:+${K//,/ or }}
    i=0; IFS='|' read -ra parts <<< "$groups"
    for files in "${parts[@]}"; do
      i=$((i + 1))
      # NICE=10: the compiling workers yield the CPU to a benchmark running in the other lane
      # setsid: the group in a session of its own, killed whole afterwards. A group cut off at its limit (pytest
      # hung after its last test, say) can leave workers or compilers behind, which slow the benchmarks after
      # it; nothing of a finished group may outlive it. (Without setsid the group runs as before, and the kill
      # below finds nothing.)
      FUSEPATCH_GPU_REQUIRE=1 FUSEPATCH_GPU_REPORT_DIR="$errors" $(command -v setsid) timeout ${TEST_TIMEOUT:-230} nice -n ${NICE:-0} python3 -m pytest \
        $files ${K:+-k "$K"} -n ${WORKERS:-8} ${DIST:+--dist $DIST} -v -rfE --tb=short --durations=20 --timeout ${PER_TEST:-220} -p no:cacheprovider \
        > "$OUT/gpu-tests${TAG:+-$TAG}-$i.log" 2>&1 &
      sid=$!; wait $sid; echo "exit $? (TEST_TIMEOUT=${TEST_TIMEOUT:-230}: 124 is the group cut off)" >> "$OUT/gpu-tests${TAG:+-$TAG}-$i.log"
      left=$(ps -o stat= -s $sid 2>/dev/null | grep -vc '^Z')  # live ones: a dead child waits for its reaper as Z
      [ "$left" -gt 0 ] && echo "killing $left processes the group left behind" | tee -a "$OUT/gpu-tests${TAG:+-$TAG}-$i.log"
      pkill -9 -s $sid 2>/dev/null
      grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu-tests${TAG:+-$TAG}-$i.log" | grep -v "^tests/" | sed 's/^\[gw[0-9]*\] //' | tail -45
    done
    # IEEE=1: fp32 through fla is tf32 on this GPU by default; the same fp32 cases with full-precision dots tell a
    # precision limit (passes here) from a wrong kernel (fails here too).
    if [ "${IEEE:-0}" = 1 ]; then
      TRITON_F32_DEFAULT=ieee FUSEPATCH_GPU_REQUIRE=1 FUSEPATCH_GPU_REPORT_DIR="$errors" timeout ${IEEE_TIMEOUT:-150} \
        python3 -m pytest tests/gpu/test_gdn_ops.py -k "float32" -n 2 -v --tb=short --timeout 140 -p no:cacheprovider \
        > "$OUT/gpu-tests-ieee.log" 2>&1
      grep -E "PASSED|FAILED|passed|failed" "$OUT/gpu-tests-ieee.log" | grep -v "^tests/" | sed 's/^/[ieee] /' | tail -6
    fi
    ERRORS="$errors" MERGED="$OUT/model-errors${TAG:+-$TAG}.json" python3 - <<'EOF'
import glob, json, os
merged = {}
for path in glob.glob(os.path.join(os.environ["ERRORS"], "model-errors-*.json")):
    merged.update(json.load(open(path)))
json.dump(merged, open(os.environ["MERGED"], "w"), indent=1)
EOF
    # every failure's traceback, and every test's outcome and seconds (the suite's record rows), written as each test
    # ended (tests/gpu/conftest.py): a group cut off keeps them
    cat "$errors"/failures-*.txt > "$OUT/gpu-failures${TAG:+-$TAG}.txt" 2>/dev/null || rm -f "$OUT/gpu-failures${TAG:+-$TAG}.txt"
    cat "$errors"/outcomes-*.jsonl > "$OUT/gpu-outcomes${TAG:+-$TAG}.jsonl" 2>/dev/null || rm -f "$OUT/gpu-outcomes${TAG:+-$TAG}.jsonl"
    # test_gpu_stage_faults.py's rows (a file per worker): every stage, fault, error and bound, for the record
    cat "$errors"/stage-faults-*.jsonl > "$OUT/stage-faults${TAG:+-$TAG}.jsonl" 2>/dev/null || rm -f "$OUT/stage-faults${TAG:+-$TAG}.jsonl"
    # DOCTOR=0: the tests alone (the doctor self-tests every op, TileLang's compile included: about two minutes)
    [ "${DOCTOR:-1}" = 1 ] && timeout ${DOCTOR_TIMEOUT:-120} python3 -m fusepatch -v doctor --model-type qwen3_5 > "$OUT/doctor.txt" 2>&1
    # the stack where fla's guard bites: no tilelang importable
    [ "${NO_TL_DOCTOR:-0}" = 1 ] && PYTHONPATH="$PWD:/tmp/site-fla" timeout ${DOCTOR_TIMEOUT:-60} python3 -m fusepatch -v doctor --model-type qwen3_5 > "$OUT/doctor-no-tilelang.txt" 2>&1
    grep -A3 "gated_delta_rule:" "$OUT/doctor-no-tilelang.txt" 2>/dev/null; tail -4 "$OUT/doctor.txt" 2>/dev/null
    [ -f /tmp/build/build.log ] && tail -3 /tmp/build/build.log
    if grep -q "^exit 0" /tmp/build/build.log 2>/dev/null && [ ! -d /tmp/site-built ]; then bash "$0" built; fi ;;
  built)
    # The wheel `fusepatch build` made: full dtype set (the ready wheel in .whl is bf16-only), sm_90 only.
    need_tilelang
    cp /tmp/build/build.log "$OUT/build.log" 2>/dev/null; tail -3 /tmp/build/build.log
    wheel=$(ls /tmp/cache/fusepatch/wheels/*/causal_conv1d-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || { echo "no built wheel (yet)"; exit 4; }
    ls -la "$wheel"; rm -rf /tmp/site-built; pipi /tmp/site-built "$wheel"
    export PYTHONPATH="$PWD:/tmp/site-built:/tmp/site-fla:/tmp/site-tl"
    python3 -c "import causal_conv1d, causal_conv1d_cuda; print('loaded', causal_conv1d.__file__)"
    FUSEPATCH_GPU_REQUIRE=1 timeout 200 python3 -m pytest tests/gpu/test_gdn_ops.py -k causal_conv1d -v -p no:cacheprovider 2>&1 | grep -E "PASSED|FAILED|passed|failed|^E " | tail -12
    python3 -m fusepatch doctor --model-type qwen3_5 > "$OUT/doctor-built.txt" 2>&1; grep -B1 -A4 "causal_conv1d:" "$OUT/doctor-built.txt" | head -20 ;;
  bench)
    need_tilelang
    shape=${2:-27b}; layers=${3:-${BENCH_LAYERS:-}}  # a step gives the depth as BENCH_LAYERS (bench-27b@BENCH_LAYERS=16)
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl .whl/liger_kernel-*.whl 2>/dev/null
    # VARY=F: every timed step its own length in [seq*(1-F), seq] (train_step.py --vary-seq), its own files;
    # DOCS=K: K documents packed in every row (--packed-docs: transformers' block mask, fusepatch's varlen route)
    # PROMPT=F: the first F of every row's labels -100 (--prompt: chat SFT's masked prompt)
    # SFT=1: packed chat-SFT rows (--sft, DOC_TOKENS mean document length); LORA=R: peft LoRA of rank R (--lora);
    # CKPT=1: activation checkpointing on every configuration (--checkpointing); COMMIT: the code's commit, which
    # the record rows ($OUT/$name.record.jsonl, for benchmarks/records/) name (a copied tree has no git: unset, "unknown")
    name=bench-$shape${layers:+-layers$layers}${VARY:+-vary$VARY}${DOCS:+-docs$DOCS}${PROMPT:+-prompt$PROMPT}${SFT:+-sft}${LORA:+-lora$LORA}${TAG:+-$TAG}  # TAG: a second table of one shape in a sequence
    # what else runs on the host as the benchmark starts (each row also records its own host_load)
    { echo "host at start: $(cut -d' ' -f1-3 /proc/loadavg) (load 1/5/15 min, $(nproc) cores)"; ps -eo pcpu,etimes,args --sort=-pcpu | head -6 | cut -c1-150; } > "$OUT/$name-host.txt" 2>&1
    timeout ${RUN_TIMEOUT:-3000} python3 benchmarks/run_all.py --shape "$shape" ${layers:+--layers $layers} --site-fla /tmp/site-fla --site-tl /tmp/site-tl \
      --workdir "/tmp/$name" --out "$OUT/$name.json" --record "$OUT/$name.record.jsonl" ${COMMIT:+--commit "$COMMIT"} \
      --timeout ${BENCH_TIMEOUT:-400} ${VARY:+--vary-seq $VARY} ${DOCS:+--packed-docs $DOCS} ${PROMPT:+--prompt $PROMPT} \
      ${SFT:+--sft --doc-tokens ${DOC_TOKENS:-1024}} ${LORA:+--lora $LORA} ${CKPT:+--checkpointing} \
      --configs "${CONFIGS:-hf-fast,fusepatch,liger,eager,fusepatch-no-tilelang,hf-fast-no-tilelang}" 2>&1 | tee "$OUT/$name.md"
    tar czf "$OUT/$name-logs.tgz" -C /tmp "$name" ;;
  depthfit)
    need_tilelang
    shape=${2:-27b}; name=depthfit-$shape${LORA:+-lora$LORA}
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl 2>/dev/null
    mkdir -p "/tmp/$name"
    timeout ${RUN_TIMEOUT:-3000} python3 benchmarks/studies/depth_fit.py --shape "$shape" --checkpointing --site-fla /tmp/site-fla \
      --site-tl /tmp/site-tl --workdir "/tmp/$name" --out "$OUT/$name.jsonl" \
      ${LORA:+--lora $LORA} ${LOW:+--low $LOW} ${HIGH:+--high $HIGH} --configs "${CONFIGS:-hf-fast,fusepatch,fusepatch+fp8}" 2>&1 | tee "$OUT/$name.log"
    tar czf "$OUT/$name-logs.tgz" -C /tmp "$name" ;;
  warmstart)
    # A warm first step: fresh compile caches, `python -m fusepatch warmup` for the shape (a container build's
    # step), then a new process's first training step (train_step.py: apply_s, first_step_s, first_step_builds).
    need_tilelang
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl 2>/dev/null
    shape=${2:-27b}; warm=/tmp/cache-warm-$shape
    rm -rf "$warm"; mkdir -p "$warm"
    export TRITON_CACHE_DIR=$warm/triton TILELANG_CACHE_DIR=$warm/tilelang FUSEPATCH_CACHE=$warm/fusepatch
    export PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl"
    read -r seq batch < <(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from shapes import SHAPES, build_config; \
      build_config('$shape').save_pretrained('$warm/config'); print(SHAPES['$shape']['seq'], SHAPES['$shape']['batch'])")
    s=$(date +%s)
    timeout ${WARM_TIMEOUT:-400} python3 -m fusepatch warmup "$warm/config" --seq-len "$seq" --micro-batch "$batch" ${PACKED:+--packed} \
      > "$OUT/warmstart-$shape-warmup.log" 2>&1
    echo "warmup: exit $? after $(($(date +%s) - s)) s (seq $seq, micro-batch $batch)"; tail -5 "$OUT/warmstart-$shape-warmup.log"
    timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/train_step.py --config fusepatch --shape "$shape" --warmup 1 --steps 3 \
      --label fusepatch-after-warmup --json-out "$OUT/warmstart-$shape.json" > "$OUT/warmstart-$shape.log" 2>&1
    python3 -c "import json; r = json.load(open('$OUT/warmstart-$shape.json')); \
      print({k: r.get(k) for k in ('config', 'error', 'apply_s', 'first_step_s', 'first_step_builds', 'median_step_ms', 'tokens_per_s')})" ;;
  fidelity)
    # one step's loss and every gradient against fp32 eager, for hf-fast, liger and fusepatch (benchmarks/studies/fidelity.py)
    need_tilelang
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl .whl/liger_kernel-*.whl 2>/dev/null
    shape=${2:-27b}
    # (FIDELITY_CONFIGS=hf-fast,fusepatch,fusepatch-fp8: other configurations than the script's default three)
    timeout ${FIDELITY_TIMEOUT:-900} python3 benchmarks/studies/fidelity.py --shape "$shape" ${LAYERS:+--layers $LAYERS} \
      ${FIDELITY_CONFIGS:+--configs $FIDELITY_CONFIGS} \
      --site-fla /tmp/site-fla --site-tl /tmp/site-tl --workdir /tmp/fidelity-$shape --out "$OUT/fidelity.jsonl" 2>&1 | tee "$OUT/fidelity-$shape.md"
    rm -rf /tmp/fidelity-$shape/reference.pt ;;
  curves)
    # the SFT example's loss curve, hf-fast and fusepatch, two seeds each (benchmarks/studies/loss_curves.py)
    need_tilelang
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl 2>/dev/null
    pipi /tmp/site-ex .whl-ex/*.whl 2>/dev/null
    export PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl:/tmp/site-ex"
    steps=${STEPS:-300}; runs=()
    for seed in 0 1; do
      for config in hf-fast fusepatch; do
        flag=$([ "$config" = hf-fast ] && echo --no-fusepatch)
        log="$OUT/curve-$config-$seed.log"
        timeout ${CURVE_TIMEOUT:-300} python3 examples/sft_ultrachat.py --config examples/configs/qwen3_5_small_text.json \
          --max-length 2048 --batch-size ${BATCH:-8} --repeat $(( steps * ${BATCH:-8} / 24 + 1 )) --max-steps "$steps" \
          --learning-rate ${LR:-3e-4} --seed "$seed" --profile-step 5 --output-dir /tmp/curve-$config-$seed $flag > "$log" 2>&1
        echo "== $config seed $seed: exit $?"; runs+=("$config:$seed=$log")
      done
    done
    python3 benchmarks/studies/loss_curves.py "${runs[@]}" --out "$OUT/loss_curves.jsonl" \
      --command "STEPS=$steps bash benchmarks/gpu_run.sh curves" | tee "$OUT/loss-curves.md" ;;
  textcurves)
    # bf16 against fp8 projections on the standard library's code, read once (no memorising), two seeds each,
    # with a held-out eval loss (benchmarks/studies/text_curves.py; no datasets); BATCH, LR: text_curves.py's defaults
    need_tilelang
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl 2>/dev/null
    export PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl"
    # FAST_ACCUM=1: another configuration, fp8 with fast accumulation (text_curves.py --fast-accum), against bf16 too;
    # HEAD=1: fp8 with the LM head in FP8 too (--fp8-lm-head)
    steps=${STEPS:-300}; runs=()
    for seed in 0 1; do
      for precision in bf16 fp8 ${FAST_ACCUM:+fp8-fastaccum} ${HEAD:+fp8-head}; do
        log="$OUT/text-curve-$precision-$seed.log"
        timeout ${CURVE_TIMEOUT:-240} python3 benchmarks/studies/text_curves.py --precision "${precision%-*}" \
          $([ "$precision" = fp8-fastaccum ] && echo --fast-accum) $([ "$precision" = fp8-head ] && echo --fp8-lm-head) \
          --seed "$seed" --steps "$steps" \
          ${BATCH:+--batch $BATCH} ${LR:+--lr $LR} --json-out "$OUT/text-curve-$precision-$seed.json" > "$log" 2>&1
        echo "== $precision seed $seed: exit $?"; grep -E "^(data|tokens/s|eval):" "$log" | cut -c1-300; runs+=("$precision:$seed=$log")
      done
    done
    # each candidate against bf16 with only its own runs beside bf16's: one short run cuts no other comparison
    for candidate in fp8 ${FAST_ACCUM:+fp8-fastaccum} ${HEAD:+fp8-head}; do
      pair=(); for run in "${runs[@]}"; do case "$run" in bf16:*|"$candidate":*) pair+=("$run");; esac; done
      python3 benchmarks/studies/loss_curves.py "${pair[@]}" --baseline bf16 --candidate "$candidate" --out "$OUT/text_curves-$candidate.jsonl" \
        --command "STEPS=$steps ${FAST_ACCUM:+FAST_ACCUM=1 }${HEAD:+HEAD=1 }bash benchmarks/gpu_run.sh textcurves" | tee "$OUT/text-curves-$candidate.md"
    done ;;
  probe)
    # where the GPU waits for the host in a synced step's forward (benchmarks/studies/step_start.py), per CONFIGS
    need_tilelang
    shape=${2:-27b}
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl 2>/dev/null
    configs=${CONFIGS:-fusepatch}
    for config in ${configs//,/ }; do
      PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl" timeout ${PROBE_TIMEOUT:-300} python3 benchmarks/studies/step_start.py --shape "$shape" \
        --config "$config" --json-out "$OUT/start-$shape-$config.json" 2>&1 | tee "$OUT/start-$shape-$config.md" | tail -${PROBE_TAIL:-60}
    done ;;
  tracecheck)
    # which patched forward goes wrong when dynamo traces it on the GPU (benchmarks/studies/trace_check.py)
    need_tilelang
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl 2>/dev/null
    PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl" timeout ${TRACE_TIMEOUT:-400} python3 benchmarks/studies/trace_check.py --device cuda \
      --json-out "$OUT/trace-check.json" 2>&1 | tee "$OUT/trace-check.md" | tail -20 ;;
  loss)
    # the loss alone at a shape's real sizes: eager logits vs the fused candidates vs Liger
    need_tilelang
    pipi /tmp/site-fla .whl/fla_core-*.whl .whl/liger_kernel-*.whl 2>/dev/null
    PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl" timeout ${LOSS_TIMEOUT:-150} python3 benchmarks/studies/loss_bench.py --shape "${2:-27b}" --kernels \
      --json-out "$OUT/loss-${2:-27b}.json" 2>&1 | tee "$OUT/loss-${2:-27b}.md" ;;
  norm)
    # the RMSNorm candidates alone, fixed and varying row counts (benchmarks/studies/norm_bench.py); `norm sweep`:
    # fusepatch's norm kernels at other launch configurations (benchmarks/studies/norm_sweep.py)
    pipi /tmp/site-fla .whl/fla_core-*.whl 2>/dev/null
    if [ "${2:-}" = sweep ]; then
      PYTHONPATH="$PWD" timeout ${NORM_TIMEOUT:-240} python3 benchmarks/studies/norm_sweep.py --json-out "$OUT/norm-sweep.json" 2>&1 | tee "$OUT/norm-sweep.md"
      exit 0
    fi
    PYTHONPATH="$PWD:/tmp/site-fla" timeout ${NORM_TIMEOUT:-240} python3 benchmarks/studies/norm_bench.py \
      --json-out "$OUT/norm.json" 2>&1 | tee "$OUT/norm.md" ;;
  moe)
    # the MoE experts op alone, forward and backward, per candidate at Qwen3.5-MoE's sizes (benchmarks/studies/moe_bench.py)
    # (FP8=1: the expert GEMMs bf16 against FP8, and the quantization FP8 adds)
    PYTHONPATH="$PWD" timeout ${MOE_TIMEOUT:-150} python3 benchmarks/studies/moe_bench.py ${FP8:+--fp8} \
      --json-out "$OUT/moe-op${TAG:+-$TAG}.json" 2>&1 | tee "$OUT/moe-op${TAG:+-$TAG}.md" ;;
  selftestcost)
    # what the self-test costs each op (benchmarks/studies/selftest_cost.py); COMMIT: the code's commit
    need_tilelang
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl 2>/dev/null
    PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl" timeout ${COST_TIMEOUT:-300} python3 benchmarks/studies/selftest_cost.py \
      --commit "${COMMIT:-unknown}" --out "$OUT/selftest-cost.jsonl" 2>&1 | tee "$OUT/selftest-cost.md" ;;
  selftestsweep)
    # unfaulted kernels' self-test errors over many seeds, packed and not (benchmarks/studies/selftest_sweep.py):
    # what the floors are set from; SEEDS (default 16), OP (default gated_delta_rule)
    need_tilelang
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl 2>/dev/null
    PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl" timeout ${SWEEP_TIMEOUT:-900} python3 benchmarks/studies/selftest_sweep.py \
      --op "${OP:-gated_delta_rule}" --seeds "${SEEDS:-16}" --dims --commit "${COMMIT:-unknown}" \
      --out "$OUT/selftest-sweep.jsonl" > "$OUT/selftest-sweep.log" 2>&1
    grep -c REFUSED "$OUT/selftest-sweep.log"; tail -3 "$OUT/selftest-sweep.log" ;;
  dqkwg)
    # fla's TileLang q/k/w/g-gradient kernel at other tilings, alone at the 27B shape (benchmarks/studies/dqkwg_bench.py)
    need_tilelang
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl 2>/dev/null
    PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl" timeout ${DQKWG_TIMEOUT:-300} python3 benchmarks/studies/dqkwg_bench.py \
      --json-out "$OUT/dqkwg.json" 2>&1 | tee "$OUT/dqkwg.md" ;;
  gemm)
    # every GEMM of the step alone, in each formulation (benchmarks/studies/gemm_bench.py): which layouts cuBLAS runs slowly
    # FP8=1: the FP8 projections' GEMMs (the op's call and fast accumulation, bf16 beside them)
    name=gemm${FP8:+-fp8}-${2:-27b}
    PYTHONPATH="$PWD" timeout ${GEMM_TIMEOUT:-200} python3 benchmarks/studies/gemm_bench.py --shape "${2:-27b}" \
      ${FP8:+--fp8} --json-out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.md" ;;
  sft)
    # The SFT example at the 27B layer shapes (LAYERS deep), packed ultrachat-format data, FSDP2 world size 1
    # (fully_shard + its activation checkpointing) under torchrun; hf-fast (no fusepatch) then fusepatch.
    # Needs .whl and .whl-ex (datasets, dill, multiprocess, where the image lacks them).
    need_tilelang
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl 2>/dev/null
    pipi /tmp/site-ex .whl-ex/*.whl
    # datasets needs pyarrow >= 24; if the image's is older, put a newer pyarrow wheel in .whl-pa
    ls .whl-pa/*.whl >/dev/null 2>&1 && pipi /tmp/site-ex .whl-pa/*.whl
    python3 -c "import sys; sys.path[:0] = ['/tmp/site-ex']; import datasets, pyarrow; print('datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)"
    # OMP_NUM_THREADS: torchrun sets 1 otherwise, and whatever the example computes on the CPU runs on one
    # thread
    export PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl:/tmp/site-ex" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=8
    # NPROC: processes (= GPUs) for torchrun, "all" for every GPU of the machine (a multi-GPU run:
    # NPROC=all STEPS=30 LAYERS=<deepest that fits>); the table goes to $OUT/sft-table.md.
    nproc=${NPROC:-1}; [ "$nproc" = all ] && nproc=$(nvidia-smi -L | wc -l)
    [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ "$nproc" -gt 1 ] && nproc=$(echo "$CUDA_VISIBLE_DEVICES" | tr , '\n' | wc -l)
    # BATCH conversations per GPU and step, packed into one row (the shipped 24 hold 1,984 tokens: 48 ~ 4k tokens),
    # the sample repeated so that every rank gets full batches for every step
    batch=${BATCH:-48}; steps=${STEPS:-12}; repeat=$(( (steps * batch * nproc + 23) / 24 ))
    # SFT_CONFIGS: which configurations, in which order (comma-separated; the table always compares to hf-fast)
    # LR: the learning rate (default 1e-3, the example's; at 24 layers of random 27B-shaped weights it can give
    # loss spikes, which make two curves hard to compare)
    # LAYERS may list depths, deepest first (LAYERS=24,16): a depth whose run runs out of GPU memory is given
    # up for the next one, every configuration again, so the table compares one depth (the deepest
    # that fits)
    for layers in $(echo "${LAYERS:-4}" | tr , ' '); do
      oom=0
      for config in $(echo "${SFT_CONFIGS:-hf-fast,fusepatch}" | tr , ' '); do
        flag=$([ "$config" = hf-fast ] && echo --no-fusepatch)
        log="$OUT/sft-${nproc}gpu-$config.log"
        timeout ${SFT_TIMEOUT:-420} python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" examples/sft_ultrachat.py --fsdp $flag \
          --config examples/configs/qwen3_5_27b_text.json --layers "$layers" --max-length 4096 --batch-size "$batch" \
          --repeat "$repeat" --max-steps "$steps" --learning-rate ${LR:-1e-3} --profile-step ${PROFILE_STEP:-8} --output-dir /tmp/sft-$nproc-$config \
          ${TRACE:+--trace-dir /tmp/trace-$nproc-$config} > "$log" 2>&1
        rc=$?
        # TRACE=1: the profiled step's Chrome trace (rank 0's file, gzipped) comes back too
        [ -n "${TRACE:-}" ] && gzip -c "$(ls /tmp/trace-$nproc-$config/*rank0.json /tmp/trace-$nproc-$config/*.json 2>/dev/null | head -1)" > "$OUT/trace-${nproc}gpu-$config.json.gz" 2>/dev/null
        echo "== $config, $layers layers (exit $rc)"; grep -E "conversations|world size|losses|fusepatch metrics|steady state|profile of step|CPU-bound|top kernels|kernel builds" "$log" | cut -c1-400
        if grep -q "OutOfMemoryError" "$log"; then oom=1; cp "$log" "$OUT/sft-${nproc}gpu-$config-${layers}layers-oom.log"; echo "out of memory at $layers layers"; break; fi
      done
      [ "$oom" = 0 ] && break
    done
    python3 benchmarks/studies/sft_table.py --gpus "$nproc" "$OUT/sft-${nproc}gpu-hf-fast.log" "$OUT/sft-${nproc}gpu-fusepatch.log" | tee "$OUT/sft-table-${nproc}gpu.md"
    echo "layers: $layers" >> "$OUT/sft-table-${nproc}gpu.md" ;;
  start)
    need_tilelang
    pipi /tmp/site-tl .whl-tl2/*.whl; pipi /tmp/site-fla .whl/*.whl; ls .whl-ex/*.whl >/dev/null 2>&1 && pipi /tmp/site-ex .whl-ex/*.whl
    python3 -c "import pyarrow; print('pyarrow', pyarrow.__version__)"
    nvidia-smi -L
    rm -rf /tmp/seq && mkdir -p /tmp/seq/out && cp -r . /tmp/seq/tree  # a copy: the working tree may change while the sequence runs
    : > /tmp/seq/progress  # before the runner starts: `poll` tells a started sequence from none by this file
    steps=${*:2}; steps=${steps:-bench-27b tests bench-2b sft}
    env | grep -E "^(CONFIGS|BENCH_TIMEOUT|TEST_TIMEOUT|PER_TEST|DIST|CKPT|LORA|DOCTOR|TAG|K|NICE|IEEE|LAYERS|STEPS|WORKERS|SFT_TIMEOUT|SFT_CONFIGS|BATCH|TESTS|TRACE|LR|VARY|DOCS|PROMPT|FIDELITY_TIMEOUT|CURVE_TIMEOUT|FAST_ACCUM|HEAD|BENCH_LAYERS|COMMIT|SEEDS|OP|LOW|HIGH)=" > /tmp/seq/env || true
    # Lanes: "A B / C D + E" runs A then B on GPU 0 beside C then D on GPU 1 (CUDA_VISIBLE_DEVICES), then E on
    # every GPU once both lanes are done ("+ F / G": a next stage with lanes again). A step is
    # PHASE[-ARG][@K=V:K=V]: its own environment (sft@NPROC=all:LAYERS=24).
    cat > /tmp/seq/run.sh <<'RUN'
set -f  # steps are split on spaces only: a '*' in FUSEPATCH_SKIP=*/triton is not a file pattern
set -a; . /tmp/seq/env; set +a; export SEQ_INSTALLED=1
step() {  # step LANE STEP: its log is named by lane and step, so a step in two lanes keeps both logs
  local name=${2%%@*} extra=${2#*@} s=$(date +%s) log=/tmp/seq/$1-$(echo "$2" | tr -c 'A-Za-z0-9.\n-' _ | cut -c1-150).log
  # (cut: a step with several test ids would make a name over the file system's 255 bytes, and not run)
  [ "$extra" = "$2" ] && extra=
  echo "== [$1] $2 started $(date +%T)" >> /tmp/seq/progress
  env ${extra//:/ } OUT=/tmp/seq/out bash benchmarks/gpu_run.sh ${name%%-*} $(echo "$name" | sed -n 's/^[a-z]*-//p') > "$log" 2>&1
  echo "== [$1] $2 exit $? after $(($(date +%s) - s)) s" >> /tmp/seq/progress
}
# Stages: "A / B + C / D + E": each "+" waits for every lane of the stage before it; within a stage, "/"
# separates lanes (one GPU each), and a stage without "/" runs on every GPU. Only a word that is exactly "/" or
# "+" separates: a "+" inside a step (fusepatch+FUSEPATCH_SKIP=...) does not.
stages=() stage=
for word in $STEPS_ARG; do
  if [ "$word" = "+" ]; then stages+=("$stage"); stage=; else stage="$stage $word"; fi
done
stages+=("$stage")
for st in "${stages[@]}"; do
  lanes=() lane=
  for word in $st; do
    if [ "$word" = "/" ]; then lanes+=("$lane"); lane=; else lane="$lane $word"; fi
  done
  lanes+=("$lane")
  if [ ${#lanes[@]} -gt 1 ]; then
    gpus=$(nvidia-smi -L | wc -l)  # more lanes than GPUs: lanes share them (a compile-bound lane beside a GPU-bound one)
    for i in "${!lanes[@]}"; do
      ( export CUDA_VISIBLE_DEVICES=$((i % gpus)); for w in ${lanes[$i]}; do step "gpu$i" "$w"; done ) &
    done
    wait
  else
    for w in ${lanes[0]}; do step all "$w"; done
  fi
done
echo done >> /tmp/seq/progress
RUN
    # The redirections close the whole background job's hold on the caller's output: with them on the runner
    # alone, the backgrounded `cd && ...` list would keep the caller's pipe open until the sequence ended, so
    # `start ... | tail -1 && poll N` would wait for the whole sequence.
    (cd /tmp/seq/tree && STEPS_ARG="$steps" setsid nohup bash /tmp/seq/run.sh) > /tmp/seq/runner.log 2>&1 < /dev/null &
    echo "started: $steps" ;;
  poll)
    # No sequence here: a machine where `start` never ran, or a `start` that failed behind `| tail -1` (its
    # exit status is the pipe's). Waiting would spend the whole limit on nothing.
    [ -f /tmp/seq/progress ] || { echo "poll: no sequence on this machine (fresh machine, or start failed): nothing to wait for"; exit 4; }
    deadline=$(($(date +%s) + ${2:-560}))
    while [ "$(date +%s)" -lt "$deadline" ] && ! grep -q "^done" /tmp/seq/progress 2>/dev/null; do sleep 5; done
    cat /tmp/seq/progress 2>/dev/null
    for f in /tmp/seq/*.log; do echo "--- $(basename "$f") (last lines)"; tail -${TAIL:-25} "$f" | cut -c1-300; done
    tar czf "$OUT/seq-$(date +%H%M%S).tgz" -C /tmp/seq --exclude tree . 2>/dev/null; ls -la "$OUT" ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
