"""Run a candidate once on tiny fresh random inputs and compare it, forward and backward, with the reference.

An import that works but crashes, returns NaN/Inf or disagrees is rejected with that reason, before the
training run ever calls it. Results are cached per process, keyed by op, candidate, device type, dtype,
packing and the layer sizes the inputs were drawn at; the inputs' seed is fixed per key, so a machine decides
the same way on every run.
"""

from __future__ import annotations

import logging
import math
import os
import time
import zlib
from collections.abc import Callable
from typing import Any

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
    weights: tuple[float, ...] | None = None,
    along: bool = False,
):
    """The first ``outputs`` outputs (each compared on its own, so a per-document check stays per document) and the
    inputs' gradients for one random cotangent per output (``along``: the output itself, ``Case.along``)."""
    out = fn(*args, **kwargs)
    outs = list(out[:outputs]) if isinstance(out, tuple) else [out]
    leaves = _leaves(args, kwargs)
    if cotangents is None:
        # from the self-test's own generator: the global one (CPU or CUDA) belongs to the user, and a self-test
        # drawing from it changed every random draw after `apply` (seeded data, dropout, LoRA init) from what
        # the same program gives without fusepatch
        if along:
            cotangents = [o.detach().float() for o in outs]
        else:
            cotangents = [torch.randn(o.shape, generator=generator, dtype=torch.float32).to(o.device) for o in outs]
        if weights is not None:  # a case that switches an output's backward path off (``Case.cotangents``)
            cotangents = [c * weight for c, weight in zip(cotangents, weights)]
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


TILE = 64  # rows and columns of the blocks the "tile" statistic compares (the kernels' common tile)


def tile_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest error of one ``TILE x TILE`` block (the tensor as rows of its last dimension) over the norm a
    block of ``expected`` holds on average: a wrong or zeroed tile shows as ~1, whatever the tensor's size."""
    a, e = actual.detach().double(), expected.detach().double()
    if e.ndim == 0 or e.numel() == 0:
        return 0.0
    a, e = (t.reshape(-1, t.shape[-1]) for t in (a, e))
    rows, columns = e.shape
    pad_rows, pad_columns = -rows % TILE, -columns % TILE
    diff = torch.nn.functional.pad((a - e).square(), (0, pad_columns, 0, pad_rows))
    per_block = diff.reshape((rows + pad_rows) // TILE, TILE, (columns + pad_columns) // TILE, TILE).sum((1, 3))
    typical = e.square().sum() * min(TILE, rows) * min(TILE, columns) / e.numel()  # what a block holds on average
    worst = per_block.max()
    return float((worst / typical).sqrt()) if typical > 0 else float(worst.sqrt())


def scale_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The difference's component along ``expected``, ``|<a - e, e>| / <e, e>``: a factor's error (x1.02 is 0.02),
    where rounding noise, which has no direction, averages out."""
    a, e = actual.detach().double().flatten(), expected.detach().double().flatten()
    norm = e.dot(e)
    return float((a - e).dot(e).abs() / norm) if norm > 0 else 0.0


def _quantity(out: torch.Tensor, ref: torch.Tensor, documents, name: str, errors: dict[str, float]) -> None:
    errors[name] = error(out, ref, documents)
    if errors[name] == float("inf") or not torch.isfinite(ref).all():  # the relative error says it all
        return
    errors[f"{name}:tile"] = tile_error(out, ref)
    errors[f"{name}:scale"] = scale_error(out, ref)


def _errors(outs, grads, ref_outs, ref_grads, documents, case: str = "") -> dict[str, float]:
    errors: dict[str, float] = {}
    prefix = f"{case}/" if case else ""
    for index, (out, ref_out) in enumerate(zip(outs, ref_outs)):
        _quantity(out, ref_out, documents, prefix + ("output" if index == 0 else f"output[{index}]"), errors)
    for index, (g, rg) in enumerate(zip(grads, ref_grads)):
        if rg is None:
            continue
        if g is None:
            errors[f"{prefix}grad[{index}]"] = float("inf")
            continue
        _quantity(g, rg, documents, f"{prefix}grad[{index}]", errors)
    return errors


def bounds(op: Op, dtype: str, reference_errors: dict[str, float]) -> dict[str, float]:
    """Each quantity's bound: ``ratio`` times the error the reference itself makes in ``dtype`` on the same inputs,
    plus the op's floor for that quantity (``SelfTest``), times the statistic's multiplier for a tile or scale
    error (``op.STATISTICS``; at least 1 for a quantity with a ``looser`` floor). A case's quantity
    (``case/grad[0]``) has its plain name's floor, or the case's own (``Case.floors``)."""
    spec = op.selftest
    floor = spec.tolerance.get(dtype, 1e-2)
    looser = spec.looser.get(dtype, {})
    cases = {case.name: case for case in spec.cases}
    limits = {}
    for name, ref in reference_errors.items():
        case, _, plain = name.rpartition("/")
        quantity, _, statistic = plain.partition(":")
        factor = spec.statistics.get(statistic, 1.0) if statistic else 1.0
        own = cases[case].floors.get(dtype, {}) if case in cases else {}
        if quantity in own:
            chosen = own[quantity]
        else:
            if quantity in looser:  # a quantity measured noisier: no statistic of it is held tighter than its floor
                factor = max(factor, 1.0)
            chosen = looser.get(quantity, floor)
        limits[name] = spec.ratio * ref + chosen * factor
    return limits


def measure(
    op: Op,
    fn: Callable,
    device: str,
    dtype: str,
    *,
    packed: bool = True,
    dims: dict[str, int] | None = None,
    seed: int | None = None,
) -> tuple[dict[str, float], dict[str, float]] | Verdict:
    """The errors of ``fn`` against ``op.reference`` run on fp32 (fp64 on the CPU for fp32) copies of the same
    fresh inputs, over every ``Case`` of the op, each quantity by its relative, tile and scale error, with their
    :func:`bounds`; or a rejection where an output has the wrong shape."""
    assert op.selftest is not None
    base = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    errors: dict[str, float] = {}
    limits: dict[str, float] = {}
    for case in op.selftest.cases:
        # each case draws from a generator of its own, seeded by the seed and its name (the unnamed case by the seed
        # itself): its inputs are the same whichever cases run before it, so what one case refuses alone, the
        # whole self-test refuses
        own = base if not case.name else zlib.crc32(f"{base}/{case.name}".encode())
        generator = torch.Generator().manual_seed(own)
        found = _compare_case(op, fn, device, dtype, case, generator, packed, dims)
        if isinstance(found, Verdict):
            return found
        errors.update(found[0])
        limits.update(found[1])
    return errors, limits


def worst(errors: dict[str, float], limits: dict[str, float]) -> str:
    """The quantity nearest to (or furthest past) its bound; a NaN or Inf error, or one without a bound, first."""

    def ratio(name: str) -> float:
        error = errors[name]
        if not math.isfinite(error) or not limits.get(name):
            return float("inf") if error or not math.isfinite(error) else 0.0
        return error / limits[name]

    return max(errors, key=ratio)


def compare(op: Op, fn: Callable, device: str, dtype: str, **inputs: Any) -> tuple[Verdict, dict[str, float]]:
    """``fn`` held to :func:`bounds` on :func:`measure`'s errors (``inputs``: its ``packed``, ``dims``, ``seed``): a
    multiple of the reference's own error in ``dtype`` plus a small floor, for every quantity."""
    found = measure(op, fn, device, dtype, **inputs)
    if isinstance(found, Verdict):
        return found, {}
    return judge(op, *found, device, dtype), found[0]


def judge(op: Op, errors: dict[str, float], limits: dict[str, float], device: str, dtype: str) -> Verdict:
    """OK where every quantity is within its bound; else a rejection naming the worst one. A NaN or Inf error is
    never within a bound; a statistic without a bound (the low-precision reference had no finite error there) is
    judged by its relative error alone."""
    failing = {q: e for q, e in errors.items() if not math.isfinite(e) or (q in limits and not e <= limits[q])}
    if not failing:
        return OK
    name = worst(failing, limits)
    if not math.isfinite(errors[name]):
        return reject(
            f"self-test on {device}/{dtype}: {name} has NaN/Inf or is missing",
            "report it upstream; fusepatch uses the next candidate",
        )
    return reject(
        f"self-test on {device}/{dtype}: {name} differs from the reference by {errors[name]:.2e} "
        f"(bound {limits[name]:.1e}: {op.selftest.ratio:g}x the reference's own {dtype} error + a floor)",
        "report it upstream with `python -m fusepatch doctor --json`; fusepatch uses the next candidate",
    )


def _compare_case(op, fn, device, dtype, case, generator, packed, dims):
    """One case's (errors, bounds), or a rejection where the candidate's outputs have the wrong shapes."""
    spec = op.selftest
    args, kwargs = spec.make_inputs(device, _dtype(dtype), generator, packed, dims, **case.options)
    documents = _documents(kwargs)
    ref_dtype = torch.float64 if dtype == "float32" and device == "cpu" else torch.float32
    ref_args = tuple(_upcast(a, ref_dtype) for a in args)
    ref_kwargs = {k: _upcast(v, ref_dtype) for k, v in kwargs.items()}
    count = spec.outputs
    ref_out, ref_grads, cotangent = _forward_backward(
        op.reference, ref_args, ref_kwargs, None, count, generator, case.cotangents, case.along
    )
    low_args = tuple(_detached(a) for a in args)
    low_kwargs = {k: _detached(v) for k, v in kwargs.items()}
    low_out, low_grads, _ = _forward_backward(op.reference, low_args, low_kwargs, cotangent, count)
    args = tuple(_detached(a) for a in args)
    kwargs = {k: _detached(v) for k, v in kwargs.items()}
    out, grads, _ = _forward_backward(fn, args, kwargs, cotangent, count)
    shapes, ref_shapes = [tuple(o.shape) for o in out], [tuple(o.shape) for o in ref_out]
    if shapes != ref_shapes:
        where = f" ({case.name})" if case.name else ""
        return reject(f"self-test{where}: output shapes {shapes} != reference {ref_shapes}")
    errors = _errors(out, grads, ref_out, ref_grads, documents, case.name)
    limits = bounds(op, dtype, _errors(low_out, low_grads, ref_out, ref_grads, documents, case.name))
    if case.only:  # a case for some quantities alone (``Case.only``)
        kept = {name for name in errors if name.rpartition("/")[2].partition(":")[0] in case.only}
        errors, limits = {n: e for n, e in errors.items() if n in kept}, {n: b for n, b in limits.items() if n in kept}
    return errors, limits


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
