"""Shared test helpers: hand-built environments and gradient collection."""

from __future__ import annotations

import pathlib
import sys

import torch

from fusepatch.base.env import GPU, Environment
from fusepatch.tools import tiny

H200 = GPU("NVIDIA H200", (9, 0))
A100 = GPU("NVIDIA A100-SXM4-80GB", (8, 0))
T4 = GPU("Tesla T4", (7, 5))

# ops that read a GPU tensor's value on the host, so wait for the GPU (``item`` reads through ``_local_scalar_dense``):
# the CPU stand-ins of tests/gpu's sync-debug tests look for them in a profile
HOST_READS = ("aten::nonzero", "aten::is_nonzero", "aten::all", "aten::any", "aten::_local_scalar_dense")

# tiny_model overrides for a Qwen3.5 stack of one layer of each attention kind: what the torch.compile traces need
# (the AOTAutograd trace of tests/layers/test_decoder.py: 19 s against 25 s for the default four layers on CPU)
HYBRID_PAIR = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])

# mini-model sizes shared by the GPU tests (and benchmarks/studies/trace_check.py), so fla's kernels compile once for
# all of them
# The model families: the one table of tiny configs (fusepatch/tools/tiny.py), so a family added there is in every
# family-wide test. HYBRID: Gated DeltaNet layers beside gated attention; MOE: routed experts.
FAMILIES: tuple[str, ...] = tuple(tiny.FAMILIES)
HYBRID = tuple(f for f, c in tiny.FAMILIES.items() if "linear_attention" in c.get("layer_types", ()))
MOE = tuple(f for f, c in tiny.FAMILIES.items() if "num_experts" in c)
NOT_HYBRID = tuple(f for f in FAMILIES if f not in HYBRID)
# one family of each kind (hybrid, hybrid MoE, dense, MoE), for tests that cost seconds a family
ONE_OF_EACH = tuple(
    next(f for f in FAMILIES if (f in HYBRID, f in MOE) == kind)
    for kind in ((True, False), (True, True), (False, False), (False, True))
)

TESTS = pathlib.Path(__file__).resolve().parent  # the tests' root: helpers.py, faults.py, conftest.py
REPO = TESTS.parent

MINI = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
)

# the residual-add norms: conftest's ``calls`` fixture gives them CPU stand-ins, so the fused decoder forward runs
ADD_OPS = ("add_rms_norm", "add_rms_norm_zero_centered")


def gpu_env(gpu: GPU = H200, **overrides) -> Environment:
    """The H200 test machine's stack by default: torch 2.11 / CUDA 13, Triton 3.6, fla 0.6, causal-conv1d 1.7."""
    distributions = {
        "torch": "2.11.0",
        "triton": "3.6.0",
        "transformers": "5.17.0",
        "fla-core": "0.6.0",
        "flash-linear-attention": "0.6.0",
        "causal-conv1d": "1.7.0",
    }
    distributions.update(overrides.pop("distributions", {}))
    imports = {
        "fla.ops.gated_delta_rule": None,
        "causal_conv1d": None,
        "tilelang": "ModuleNotFoundError: No module named 'tilelang'",
    }
    imports.update(overrides.pop("imports", {}))
    base = dict(
        torch="2.11.0",
        torch_cuda="13.0",
        cuda_available=True,
        gpus=(gpu,),
        distributions=distributions,
        imports=imports,
    )
    base.update(overrides)
    return Environment(**base)


def cpu_env(**overrides) -> Environment:
    base = dict(
        torch="2.13.0",
        torch_cuda=None,
        cuda_available=False,
        distributions={"torch": "2.13.0", "transformers": "5.17.0"},
    )
    base.update(overrides)
    return Environment(**base)


def lm_batch(model, batch: int = 2, length: int = 29) -> dict:
    """Random token ids of ``model``'s vocabulary as both input and labels, called as the Trainer calls a model in
    training (``use_cache=False``: it sets ``config.use_cache`` from ``TrainingArguments.use_cache``, off)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, length))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_and_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), grads(model)


def step_loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step's loss and gradients (by name, peft's prefix left out). Not ``loss_and_grads``: the fused loss
    returns no logits in training."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n.removeprefix("base_model.model."): p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same_step(expected, got) -> None:
    """Two ``step_loss_and_grads`` results: the loss within 1e-5, every gradient within 1e-4 (fp32, relative)."""
    (loss, grads), (got_loss, got_grads) = expected, got
    torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(got_grads[key], grad, rtol=1e-4, atol=1e-5, msg=key)


def training_model(model_type: str, checkpointing: bool = False, **kwargs):
    """A tiny model of ``model_type`` in training mode, with transformers' non-reentrant activation checkpointing
    when ``checkpointing`` (the fused paths must also hold under the backward's recompute)."""
    from fusepatch.tools.tiny import tiny_model

    model = tiny_model(model_type, **kwargs).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def assert_same_training(a, b, exact: bool = False):
    """Two ``loss_and_grads`` results: bit for bit (``exact``) or within the CPU tolerances of the fused paths'
    tests (loss 1e-5, logits 1e-4, every gradient 1e-3 relative)."""
    (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys()
    if exact:
        assert torch.equal(loss_a, loss_b) and torch.equal(logits_a, logits_b)
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), name
        return
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits_b, logits_a, rtol=1e-4, atol=1e-5)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-3, atol=1e-5, msg=name)


def free_port() -> int:
    """A TCP port nobody listens on, for a torchrun rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One training step of a tiny Qwen3.5 with ``apply(precision="fp8")`` under FSDP2 (world size 1) against the same
# model unsharded: argv[1] the JSON result, argv[2] the tests folder, argv[3] "cpu" (gloo; the FP8 function as the
# op's kernel through ``cpu_candidates``, its PyTorch twins quantizing) or "cuda" (NCCL; the op's own kernel).
FP8_FSDP2_WORKER = """
import copy, json, sys, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, sys.argv[2])
import pytest
from helpers import MINI, counted_fp8_gemms, cpu_candidates
import fusepatch
from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear
from fusepatch.tools.tiny import tiny_model

device = sys.argv[3]
if device == "cpu":
    cpu_candidates(pytest.MonkeyPatch(), {"fp8_linear": fp8_linear})
calls = counted_fp8_gemms(pytest.MonkeyPatch())
dist.init_process_group("gloo" if device == "cpu" else "nccl")
if device == "cuda":
    torch.cuda.set_device(0)
mesh = init_device_mesh(device, (1,))
sizes = dict(hidden_size=128, intermediate_size=256) if device == "cpu" else MINI
base = tiny_model("qwen3_5_text", seed=0, **sizes).to(device, torch.bfloat16)
reference = copy.deepcopy(base)
fusepatch.apply(reference, precision="fp8", verbose=False)
model = copy.deepcopy(base)
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
report = fusepatch.apply(model, precision="fp8", verbose=False)
tokens = 32 if device == "cpu" else 256
ids = torch.randint(0, base.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(0)).to(device)
calls.clear()
loss = model(input_ids=ids, labels=ids, use_cache=False).loss
loss.backward()
sharded_calls = len(calls)
ref_loss = reference(input_ids=ids, labels=ids, use_cache=False).loss
ref_loss.backward()
ref = dict(reference.named_parameters())
errors = {}
for name, p in model.named_parameters():
    if "proj.weight" in name and p.grad is not None:
        g, r = p.grad.full_tensor().float(), ref[name].grad.float()
        errors[name] = float((g - r).norm() / r.norm())
chosen = {c.op: c.chosen for layer in report.layers for c in layer.choices}
result = {"loss": float(loss), "ref_loss": float(ref_loss), "errors": errors, "calls": sharded_calls,
          "chosen": chosen.get("fp8_linear")}
json.dump(result, open(sys.argv[1], "w"))
dist.barrier()
time.sleep(0.2)
dist.destroy_process_group()
"""


def counted_fp8_gemms(monkeypatch) -> list:
    """A list that gets one entry per FP8 GEMM fusepatch's FP8 function runs from now on (``_scaled_mm``)."""
    from fusepatch.ops.fp8_linear import scaled_mm

    calls: list = []
    scaled = scaled_mm.fp8_mm
    monkeypatch.setattr(scaled_mm, "fp8_mm", lambda *args: calls.append(1) or scaled(*args))
    return calls


def in_process(argv: list[str]) -> tuple[int, str, str]:
    """``python -m fusepatch ARGV`` run through ``cli.main`` in this process: its exit code, stdout and stderr as a
    new process would give them. The root logger's handlers (pytest's) are set aside for the call, so that the
    command's own ``logging.basicConfig`` writes its log to the captured stderr, as it does in a process; a
    ``SystemExit`` (argparse's) gives its code, a message exit code 1 with the message on stderr."""
    import contextlib
    import io
    import logging

    from fusepatch.tools import cli

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(argv))
            except SystemExit as exit:  # argparse: --help, --version, a bad argument
                code = exit.code
                if not isinstance(code, int):
                    if code is not None:
                        print(code, file=sys.stderr)
                    code = 0 if code is None else 1
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return code, out.getvalue(), err.getvalue()


def torchrun(script: str, *args: str, processes: int = 2, timeout: int = 240, **env: str):
    """Run ``script`` under torchrun with ``processes`` ranks (one rank: by itself, with the environment torchrun
    gives it), on the CPU unless ``env`` names a GPU (``CUDA_VISIBLE_DEVICES``); returns the CompletedProcess.
    ``timeout``: seconds before the ranks are killed."""
    import os
    import subprocess
    import sys

    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port", port]
    cmd += [script, *args]
    full_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **env}  # env may name a GPU
    if processes == 1:  # the one rank without the launcher's own process: the variables torchrun gives a rank
        cmd = [sys.executable, script, *args]
        full_env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        full_env.update(MASTER_PORT=port, GROUP_RANK="0", ROLE_RANK="0", ROLE_WORLD_SIZE="1")
    # A hang (a collective waiting on a dead rank) fails in 4 minutes: each of these runs takes 10-20 s on two
    # loaded cores, and CI has 20 minutes in all. The ranks are torchrun's children: the whole process group is
    # killed, so none is left behind holding a core.
    import signal

    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            raise AssertionError(
                f"torchrun {script} did not finish in {timeout} s; its stderr:\n{stderr[-3000:]}"
            ) from None
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def errors_against_fp64(fn, reference, args, dtype, extra=(), **kwargs) -> dict[str, float]:
    """``fn`` on ``args`` cast to ``dtype`` against ``reference`` on fp64 copies, under one random cotangent: the
    relative error of the output (``out``) and of every float input's gradient (``d<index>``). Integer arguments
    (labels, expert indices) pass through."""
    from fusepatch.ops.common import relative_error

    floats = [i for i, a in enumerate(args) if a.is_floating_point()]
    leaves = {i: args[i].detach().clone().requires_grad_(True) for i in floats}
    ref_leaves = {i: args[i].detach().double().requires_grad_(True) for i in floats}
    out = fn(*[leaves[i].to(dtype) if i in leaves else a for i, a in enumerate(args)], *extra, **kwargs)
    ref = reference(*[ref_leaves.get(i, a) for i, a in enumerate(args)], *extra, **kwargs)
    cot = torch.randn_like(ref)
    grads = torch.autograd.grad(out, list(leaves.values()), cot.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, list(ref_leaves.values()), cot)
    errors = {"out": relative_error(out, ref)}
    errors |= {f"d{i}": relative_error(g, r) for i, g, r in zip(floats, grads, ref_grads)}
    return errors


def transformers_own(module, name: str):
    """``module.name`` as transformers defines it, also while a patched model holds a binding of it
    (fusepatch/layers/support/bindings.py)."""
    from fusepatch.base.state import current

    installed = current().bindings.get((module.__name__, name))
    return installed.original if installed is not None else getattr(module, name)


def assert_released(module, name: str, original) -> None:
    """After the test's models are reverted: transformers' object is back, and the ledger no longer lists it."""
    from fusepatch.base.state import current

    assert (module.__name__, name) not in current().bindings
    assert getattr(module, name) is original


def sft_sample(conversations: int | None = None):
    """The shipped ultrachat-format sample as a ``datasets.Dataset`` of ``messages`` (the first ``conversations``),
    and the example's offline tokenizer trained on the whole sample (512 tokens): what the TRL tests train on."""
    import importlib.util
    import os

    import datasets

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "sft_ultrachat.py")
    spec = importlib.util.spec_from_file_location("sft_ultrachat", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = example.load_conversations(example.DEFAULT_DATA, "train")
    tokenizer = example.build_tokenizer(rows, vocab_size=512)  # trained on every conversation
    kept = rows if conversations is None else rows.select(range(conversations))
    return datasets.Dataset.from_list([{"messages": r["messages"]} for r in kept]), tokenizer


def fallback_reasons(*models: torch.nn.Module) -> dict[str, str]:
    """Every reason (with its fix) a patched layer of ``models`` fell back for, over every device, dtype and
    packing its ops were chosen for."""
    found: dict[str, str] = {}
    for model in models:
        for module in model.modules():
            state = module.__dict__.get("_fusepatch")
            for dispatch in state.ops.values() if state is not None else ():
                for choice in dispatch.seen():
                    for rejection in choice.rejected if not choice.fused else ():
                        for reason, fix in rejection.reasons():
                            found.setdefault(reason, fix)
    return found


def assert_each_reason_once(messages: list[str], reasons: dict[str, str]) -> None:
    """Each reason occurs once in ``messages``, in a line that carries its fix (a reason contained in a longer one is
    left to that one)."""
    assert reasons
    for reason, fix in reasons.items():
        if any(reason != other and reason in other for other in reasons):
            continue
        said = [m for m in messages if reason in m]
        assert sum(m.count(reason) for m in messages) == 1, (reason, said)
        assert all(one in said[0] for one in fix.split(" && ") if one), (reason, fix, said)


ALL_DTYPES = ("bfloat16", "float16", "float32", "float64")  # fp64: the output-field tests compare at fp64 rounding


def cpu_candidates(monkeypatch, kernels: dict, *, name: str = "cpu-standin") -> list[tuple]:
    """Each op named in ``kernels`` gets one more candidate, first in its list: ``name``, accepting CPU tensors of
    every dtype and running ``kernels[op]`` (a torch function with the op's signature). The dispatcher then picks
    a non-eager candidate on the CPU, so the layers take the paths they take with a GPU kernel; it prepares weights
    as the op's first candidate that prepares them does (``Candidate.prepare``: an FP8 kernel's frozen copies). Returns
    the list each call appends ``(op, dtype, shape)`` of its first tensor argument to (the self-test's calls
    included)."""
    import dataclasses
    import functools

    from fusepatch.base.op import Candidate
    from fusepatch.base.requirements import InputRule
    from fusepatch.engine import selftest
    from fusepatch.ops import OPS

    seen: list[tuple] = []
    for op_name, kernel in kernels.items():
        op = OPS[op_name]

        def load(kernel=kernel, op_name=op_name):
            @functools.wraps(kernel)
            def standin(*args, **kwargs):
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                seen.append((op_name, getattr(first, "dtype", None), tuple(getattr(first, "shape", ()))))
                return kernel(*args, **kwargs)

            return standin

        rule = InputRule(devices=("cpu",), dtypes=ALL_DTYPES, kernel=f"{name} ({op_name})")
        candidate = Candidate(name, "pip", (), load, inputs=rule, provides=f"{kernel.__module__}.{kernel.__qualname__}")
        preparing = next((c for c in op.candidates if c.prepare is not None), None)
        if preparing is not None:
            candidate = dataclasses.replace(
                candidate, prepare=preparing.prepare, refresh=preparing.refresh, restore=preparing.restore
            )
        monkeypatch.setitem(OPS, op_name, dataclasses.replace(op, candidates=(candidate, *op.candidates)))
    selftest.clear_cache()
    return seen


class RandomTokens(torch.utils.data.Dataset):
    """Rows of random tokens, labelled with themselves."""

    def __init__(self, n=16, length=48, vocab=512):
        self.rows = [torch.randint(0, vocab, (length,)) for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def cpu_trainer(tmp_path, callbacks, max_steps=4, **extra):
    """A transformers Trainer on the CPU over a tiny Qwen3.5 and random tokens, with ``callbacks``."""
    from transformers import Trainer, TrainingArguments

    from fusepatch.tools.tiny import tiny_model

    settings = dict(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-3,
    )
    args = TrainingArguments(**(settings | extra))
    return Trainer(model=tiny_model("qwen3_5_text"), args=args, train_dataset=RandomTokens(), callbacks=callbacks)


# The server of ``run_in_interpreter``: reads one JSON line per script, runs it in a namespace of its own with its
# output captured, answers with one JSON line (the output, and the traceback if it raised).
_INTERPRETER_SERVER = """
import contextlib, io, json, sys, traceback
answer = sys.stdout
for line in sys.stdin:
    script, out = json.loads(line), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(script, "<interpreted script>", "exec"), {"__name__": "__interpreted__"})
        error = None
    except BaseException:
        error = traceback.format_exc()
    answer.write(json.dumps({"stdout": out.getvalue(), "error": error}) + "\\n")
    answer.flush()
"""
_interpreter: list = []  # this test process's server, started at its first script


def run_in_interpreter(script: str, timeout: float = 300) -> str:
    """Run ``script`` under Triton's CPU interpreter (``TRITON_INTERPRET=1``, fixed at a process's first Triton
    import) and return what it printed; fail the test with its traceback if it raised. The scripts of one test
    process share one interpreter process (each in a namespace of its own, seeding what it draws), so that the
    imports (torch, Triton, the kernels) are paid once, not once a script. It imports ``tests/helpers.py`` as the
    tests do (``from helpers import ...``)."""
    import atexit
    import json
    import os
    import selectors
    import subprocess
    import sys
    import tempfile

    if not _interpreter or _interpreter[0].poll() is not None:
        _interpreter.clear()
        path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
        errors = tempfile.TemporaryFile(mode="w+")  # its stderr: read back if it dies
        process = subprocess.Popen(
            [sys.executable, "-u", "-c", _INTERPRETER_SERVER],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
        atexit.register(process.kill)
        _interpreter.extend([process, errors])
    process, errors = _interpreter
    process.stdin.write(json.dumps(script) + "\n")
    process.stdin.flush()
    with selectors.DefaultSelector() as ready:
        ready.register(process.stdout, selectors.EVENT_READ)
        if not ready.select(timeout):
            process.kill()
            raise AssertionError(f"the interpreted script ran past {timeout} s")
    line = process.stdout.readline()
    if not line:  # the process died (a crash in a kernel's emulation)
        errors.seek(0)
        raise AssertionError(f"the interpreter process died: {errors.read()[-3000:]}")
    answer = json.loads(line)
    assert answer["error"] is None, answer["error"][-3000:]
    return answer["stdout"]
