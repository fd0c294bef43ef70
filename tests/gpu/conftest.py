import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def require(verdict, what: str):
    """Skip when a kernel package is absent, unless FUSEPATCH_GPU_REQUIRE=1 (the H200 run), where it fails."""
    if verdict.ok:
        return
    message = f"{what}: {verdict.reason}"
    if os.environ.get("FUSEPATCH_GPU_REQUIRE") == "1":
        pytest.fail(message)
    pytest.skip(message)


def kernel(op: str, name: str, dtype):
    """Load candidate ``name`` of ``op`` after its checks (skip, or fail under FUSEPATCH_GPU_REQUIRE=1, if refused)."""
    from fusepatch.env import capture
    from fusepatch.ops import OPS
    from fusepatch.requirements import Inputs
    from fusepatch.resolve import dtype_name, static_verdict

    candidate = next(c for c in OPS[op].candidates if c.name == name)
    verdict, _ = static_verdict(candidate, capture(refresh=True))
    require(verdict, f"{op}/{name}")
    require(candidate.inputs.check(Inputs("cuda", dtype_name(dtype))), f"{op}/{name}")
    return candidate.load()


def compare(fn, reference, args, dtype, tol: float, extra=(), looser=None, **kwargs):
    """``fn`` on ``args`` cast to ``dtype`` against ``reference`` on fp64 copies: the output and every float
    input's gradient (``d<index>``) within ``tol``, or ``looser[name]`` for the quantities named there. Integer
    arguments (labels, expert indices) pass through."""
    import torch

    from fusepatch.ops._common import relative_error

    looser = looser or {}
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
    bad = {k: v for k, v in errors.items() if not v <= looser.get(k, tol)}
    assert not bad, f"errors over {tol}: {bad} (all: {errors})"
    return errors
