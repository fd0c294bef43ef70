"""Run a candidate once on tiny fresh random inputs and compare it, forward and backward, with the reference.

An import that works but crashes, returns NaN/Inf or disagrees is rejected with that reason, before the
training run ever calls it. Results are cached per process, keyed by op, candidate, device type, dtype,
packing and the layer sizes the inputs were drawn at; the inputs' seed is fixed per key, so a machine decides
the same way on every run.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Callable

import torch

from fusepatch.base.op import Candidate, Op
from fusepatch.base.requirements import OK, Verdict, reject
from fusepatch.base.saved_tensors import own_saved_tensors
from fusepatch.base.state import current as process_state
from fusepatch.ops.common import relative_error

logger = logging.getLogger("fusepatch")

COMPILED_S = 5.0  # a kernel that needs this long to load and self-test was compiled/autotuned, not cached


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    values = list(args) + list(kwargs.values())
    return [t for t in values if isinstance(t, torch.Tensor) and t.requires_grad]


def _upcast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(dtype).requires_grad_(value.requires_grad)
    return value


def _detached(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


def _forward_backward(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    cotangents: list[torch.Tensor] | None,
    outputs: int = 1,
    generator: torch.Generator | None = None,
):
    """The first ``outputs`` outputs (each compared on its own, so a per-document check stays per document) and the
    inputs' gradients for one random cotangent per output."""
    out = fn(*args, **kwargs)
    outs = list(out[:outputs]) if isinstance(out, tuple) else [out]
    leaves = _leaves(args, kwargs)
    if cotangents is None:
        # from the self-test's own generator: the global one (CPU or CUDA) belongs to the user, and a self-test
        # drawing from it changed every random draw after `apply` (seeded data, dropout, LoRA init) from what
        # the same program gives without fusepatch
        cotangents = [torch.randn(o.shape, generator=generator, dtype=torch.float32).to(o.device) for o in outs]
    grads = ()
    if leaves:
        grads = torch.autograd.grad(outs, leaves, [c.to(o.dtype) for c, o in zip(cotangents, outs)], allow_unused=True)
    return [o.detach() for o in outs], grads, cotangents


def _documents(kwargs: dict) -> list[tuple[int, int]]:
    """The packed documents of a self-test call (``cu_seqlens``), as token ranges; none for an unpacked call."""
    cu = kwargs.get("cu_seqlens")
    if not isinstance(cu, torch.Tensor):
        return []
    bounds = [int(x) for x in cu.tolist()]
    return [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]


def error(actual: torch.Tensor, expected: torch.Tensor, documents: list[tuple[int, int]]) -> float:
    """``relative_error`` over the whole tensor and, for a per-token tensor of a packed call (``[1, T, ...]``), over
    each document alone: the largest. An error confined to a short document, or to the first token after each
    boundary, is then as visible as it is in that document, not diluted by the whole row."""
    worst = relative_error(actual, expected)
    if documents and actual.ndim >= 2 and actual.shape[0] == 1 and actual.shape[1] == documents[-1][1]:
        for start, end in documents:
            worst = max(worst, relative_error(actual[:, start:end], expected[:, start:end]))
    return worst


def _errors(outs, grads, ref_outs, ref_grads, documents) -> dict[str, float]:
    errors = {}
    for index, (out, ref_out) in enumerate(zip(outs, ref_outs)):
        errors["output" if index == 0 else f"output[{index}]"] = error(out, ref_out, documents)
    for index, (g, rg) in enumerate(zip(grads, ref_grads)):
        if rg is None:
            continue
        errors[f"grad[{index}]"] = float("inf") if g is None else error(g, rg, documents)
    return errors


def bounds(op: Op, dtype: str, reference_errors: dict[str, float]) -> dict[str, float]:
    """Each quantity's bound: ``ratio`` times the error the reference itself makes in ``dtype`` on the same inputs,
    plus the op's floor for that quantity (``SelfTest``)."""
    spec = op.selftest
    floor = spec.tolerance.get(dtype, 1e-2)
    return {
        name: spec.ratio * ref + spec.looser.get(dtype, {}).get(name, floor) for name, ref in reference_errors.items()
    }


def compare(
    op: Op,
    fn: Callable,
    device: str,
    dtype: str,
    *,
    packed: bool = True,
    dims: dict[str, int] | None = None,
    seed: int | None = None,
) -> tuple[Verdict, dict[str, float]]:
    """Errors of ``fn`` against ``op.reference`` run on fp32 (fp64 on the CPU for fp32) copies of the same fresh
    inputs, held to :func:`bounds`: a multiple of the reference's own error in ``dtype`` plus a small floor."""
    assert op.selftest is not None
    generator = torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    args, kwargs = op.selftest.make_inputs(device, _dtype(dtype), generator, packed, dims)
    documents = _documents(kwargs)
    ref_dtype = torch.float64 if dtype == "float32" and device == "cpu" else torch.float32
    ref_args = tuple(_upcast(a, ref_dtype) for a in args)
    ref_kwargs = {k: _upcast(v, ref_dtype) for k, v in kwargs.items()}
    count = op.selftest.outputs
    ref_out, ref_grads, cotangent = _forward_backward(op.reference, ref_args, ref_kwargs, None, count, generator)
    low_args = tuple(_detached(a) for a in args)
    low_kwargs = {k: _detached(v) for k, v in kwargs.items()}
    low_out, low_grads, _ = _forward_backward(op.reference, low_args, low_kwargs, cotangent, count)
    args = tuple(_detached(a) for a in args)
    kwargs = {k: _detached(v) for k, v in kwargs.items()}
    out, grads, _ = _forward_backward(fn, args, kwargs, cotangent, count)
    shapes, ref_shapes = [tuple(o.shape) for o in out], [tuple(o.shape) for o in ref_out]
    if shapes != ref_shapes:
        return reject(f"self-test: output shapes {shapes} != reference {ref_shapes}"), {}
    errors = _errors(out, grads, ref_out, ref_grads, documents)
    limits = bounds(op, dtype, _errors(low_out, low_grads, ref_out, ref_grads, documents))
    worst = max(errors, key=lambda name: errors[name] / limits[name])
    if errors[worst] == float("inf"):
        return reject(
            f"self-test on {device}/{dtype}: {worst} has NaN/Inf or is missing",
            "report it upstream; fusepatch uses the next candidate",
        ), errors
    if errors[worst] > limits[worst]:
        return reject(
            f"self-test on {device}/{dtype}: {worst} differs from the reference by {errors[worst]:.2e} "
            f"(bound {limits[worst]:.1e}: {op.selftest.ratio:g}x the reference's own {dtype} error + a floor)",
            "report it upstream with `python -m fusepatch doctor --json`; fusepatch uses the next candidate",
        ), errors
    return OK, errors


def run(
    op: Op,
    candidate: Candidate,
    fn: Callable,
    device: str,
    dtype: str,
    *,
    packed: bool = True,
    dims: dict[str, int] | None = None,
) -> Verdict:
    """Self-test ``candidate`` (cached per process). Exceptions become a rejection with the real error.

    ``packed`` and ``dims`` make the inputs look like the calls it guards (see ``SelfTest``)."""
    key = (op.name, candidate.name, device, dtype, packed, tuple(sorted((dims or {}).items())))
    results = process_state().selftests
    if key in results:
        return results[key]
    if op.selftest is None or candidate.source == "eager":
        results[key] = OK
        return OK
    start = time.perf_counter()
    if device != "cpu":  # on a GPU the first call compiles and autotunes: minutes on a fresh machine, so say so
        logger.info(
            "fusepatch: self-testing %s/%s on %s/%s%s (the first use of a kernel compiles it)",
            op.name,
            candidate.name,
            device,
            dtype,
            " packed" if packed else "",
        )
    # Inputs drawn from a seed fixed per key: the same machine makes the same decision on every run (a kernel
    # at the edge of its bound must not be accepted in one run and refused in the next).
    seed = zlib.crc32(repr(key).encode())
    try:
        # The first packed batch may arrive under no_grad or inference_mode (evaluation, generation): the
        # self-test checks gradients all the same, on tensors of its own. It may also arrive inside an
        # activation-checkpointed forward (non-reentrant checkpoint, FSDP's checkpoint_wrapper): the self-test's
        # own graph must keep its saved tensors, else its backward would ask the checkpoint to recompute the
        # layer, from inside that layer's forward (which deadlocked on the dispatcher's lock: H200, FSDP2 + AC).
        # It may arrive under the caller's autocast too: the fp32 reference must not run in autocast's dtype.
        autocast = torch.autocast(device if device in ("cuda", "cpu") else "cpu", enabled=False)
        with torch.inference_mode(False), torch.enable_grad(), own_saved_tensors(), autocast:
            verdict, errors = compare(op, fn, device, dtype, packed=packed, dims=dims, seed=seed)
    except Exception as exc:  # noqa: BLE001 - any failure of a kernel is a reason to refuse it
        first = (str(exc).strip().splitlines() or [""])[0]
        verdict, errors = reject(f"self-test on {device}/{dtype} raised {type(exc).__name__}: {first}"), {}
    elapsed = time.perf_counter() - start
    if device != "cpu" and elapsed >= COMPILED_S:
        outcome = "passed" if verdict.ok else f"refused ({verdict.reason})"
        logger.info("fusepatch: %s/%s self-test %s after %.0f s", op.name, candidate.name, outcome, elapsed)
    logger.debug(
        "self-test %s/%s on %s/%s: %s %s (%.1fs)", op.name, candidate.name, device, dtype, verdict, errors, elapsed
    )
    results[key] = verdict
    return verdict


def clear_cache() -> None:
    process_state().selftests.clear()
