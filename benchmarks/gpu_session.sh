#!/usr/bin/env bash
# Everything the H200 run needs, in phases (the device tool's calls are short; tilelang must travel alone):
#   bash benchmarks/gpu_session.sh tilelang            # call 1, carry .whl-tl1: install tilelang
#   bash benchmarks/gpu_session.sh tests               # call 2, carry .whl-tl2 .whl: deps, fla, GPU tests
#   bash benchmarks/gpu_session.sh bench 27b [layers]  # call 3+: the benchmark table for one shape
# Wheels: bash ../shared/gpu/wheels.sh, plus the causal-conv1d wheel copied into .whl.
set -uo pipefail
phase=${1:?phase}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site-fla /tmp/site-tl
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${@:2}"; }
export FLA_FLASH_QLA=0 PYTHONUNBUFFERED=1
case "$phase" in
  tilelang)
    pipi /tmp/site-tl .whl-tl1/*.whl && ls /tmp/site-tl | head ;;
  tests)
    [ -d /tmp/site-tl/tilelang ] || { echo "tilelang missing: run the tilelang phase first"; exit 3; }
    pipi /tmp/site-tl .whl-tl2/*.whl
    pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl .whl/kernels-*.whl
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    export PYTHONPATH="$PWD:/tmp/site-fla:/tmp/site-tl"
    # -v and a JUnit file per test file: partial results survive a cut-off call. TESTS picks files or -k filters.
    for file in ${TESTS:-tests/gpu/test_gdn_ops.py tests/gpu/test_other_ops.py tests/gpu/test_gdn_models.py}; do
      name=$(basename "$file" .py)
      FUSEPATCH_GPU_REQUIRE=1 FUSEPATCH_GPU_REPORT_DIR="$OUT" timeout ${TEST_TIMEOUT:-450} python3 -m pytest "$file" -v -rfE \
        --timeout 400 -p no:cacheprovider --junitxml "$OUT/$name.xml" 2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E " | tail -40
    done
    python3 -m fusepatch doctor --model-type qwen3_5 > "$OUT/doctor.txt" 2>&1
    # the stack where fla's guard bites: no tilelang importable
    PYTHONPATH="$PWD:/tmp/site-fla" python3 -m fusepatch doctor --model-type qwen3_5 > "$OUT/doctor-no-tilelang.txt" 2>&1
    grep -A3 "gated_delta_rule:" "$OUT/doctor-no-tilelang.txt" ;;
  bench)
    shape=${2:-27b}; layers=${3:-}
    pipi /tmp/site-tl .whl-tl2/*.whl 2>/dev/null; pipi /tmp/site-fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl .whl/liger_kernel-*.whl 2>/dev/null
    timeout ${RUN_TIMEOUT:-3000} python3 benchmarks/run_all.py --shape "$shape" ${layers:+--layers $layers} --site-fla /tmp/site-fla --site-tl /tmp/site-tl \
      --workdir "/tmp/bench-$shape" --out "$OUT/bench-$shape.json" --timeout ${BENCH_TIMEOUT:-400} \
      --configs "${CONFIGS:-eager,hf-fast,fusepatch,hf-fast-no-tilelang,fusepatch-no-tilelang}" 2>&1 | tee "$OUT/bench-$shape.md"
    tar czf "$OUT/bench-$shape-logs.tgz" -C /tmp "bench-$shape" ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
