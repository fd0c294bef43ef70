"""CUDA-graph replay (fusepatch/ops/graphs.py), on the CPU with a stand-in for torch.cuda's graphs.

The stand-in keeps a graph's contract: a replay reads the static inputs captured by address and writes the
static outputs it returned at capture time, in place. What these tests check is fusepatch's bookkeeping around
that contract (every call loads its own inputs, results are cloned out, forward and backward calls of
different layers interleave, signatures, fallbacks); tests/gpu/test_gdn_ops.py checks real graphs.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fusepatch.ops import graphs
from fusepatch.ops.graphs import GraphedOp, Split, recompute


class StandInGraphs:
    """Capture = run once and remember how; replay = run again and write into the captured outputs."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.captures = 0
        self.replays = 0
        self.fail = fail

    def warm_up(self, device, run) -> None:
        run()

    def capture(self, device, run):
        if self.fail is not None:
            raise self.fail
        self.captures += 1
        result = run()
        return (run, result), result

    def replay(self, graph) -> None:
        self.replays += 1
        run, static = graph
        fresh = run()
        for out, new in zip(_tensors(static), _tensors(fresh)):
            out.copy_(new)

    @staticmethod
    def capturing() -> bool:
        return False


def _tensors(value):
    """The tensors of a (possibly nested) tuple, in order: a graph's static outputs."""
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return [value]


def op_fn(x, w, b):
    """A stand-in op with several inputs of different shapes, one output."""
    return torch.tanh(x @ w + b).sin() * 2


def _inputs(seed: int, rows: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    return x, w, b


def _grads(out, inputs, seed):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


def test_replayed_calls_match_the_op_and_interleave_like_layers():
    """Two 'layers' share the graphs: forward 1, forward 2, backward 2, backward 1 (as autograd runs them)."""
    backend = StandInGraphs()
    graphed = GraphedOp(recompute(op_fn), "toy", backend)
    first, second = _inputs(1), _inputs(2)
    out1, out2 = graphed(*first), graphed(*second)
    assert backend.captures == 2  # one forward graph and one backward graph, for one signature
    torch.testing.assert_close(out1, op_fn(*first), rtol=0, atol=0)
    torch.testing.assert_close(out2, op_fn(*second), rtol=0, atol=0)
    grads2 = _grads(out2, second, 7)
    grads1 = _grads(out1, first, 8)
    for got, want in zip(grads1 + grads2, _grads(op_fn(*first), first, 8) + _grads(op_fn(*second), second, 7)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert backend.captures == 2 and backend.replays == 4
    # results are the caller's own, not the static outputs the next replay overwrites
    kept = out1.clone()
    graphed(*_inputs(3))
    torch.testing.assert_close(out1, kept, rtol=0, atol=0)


def test_inputs_without_gradients_and_no_grad_calls():
    backend = StandInGraphs()
    graphed = GraphedOp(recompute(op_fn), "toy", backend)
    x, w, b = _inputs(4)
    frozen_w = w.detach()
    out = graphed(x, frozen_w, b)
    gx, gb = _grads(out, (x, b), 3)
    ex, eb = _grads(op_fn(x, frozen_w, b), (x, b), 3)
    torch.testing.assert_close(gx, ex, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gb, eb, rtol=1e-12, atol=1e-12)
    captures = backend.captures
    with torch.no_grad():
        plain = graphed(x, w, b)
    assert not plain.requires_grad
    assert backend.captures == captures + 1  # a forward graph only: nothing to differentiate
    torch.testing.assert_close(plain, op_fn(x, w, b).detach(), rtol=0, atol=0)


def test_a_new_shape_is_a_new_signature_up_to_the_cap(monkeypatch, caplog):
    monkeypatch.setattr(graphs, "MAX_SIGNATURES", 2)
    backend = StandInGraphs()
    graphed = GraphedOp(recompute(op_fn), "toy", backend)
    for rows in (5, 6, 5):
        graphed(*_inputs(rows, rows))
    assert len(graphed.entries) == 2 and backend.captures == 4
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        inputs = _inputs(9, rows=7)
        out = graphed(*inputs)
        graphed(*_inputs(10, rows=8))
    assert len(graphed.entries) == 2  # beyond the cap: the op itself, said once
    assert sum("new shapes run without graphs" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(out, op_fn(*inputs), rtol=0, atol=0)


def test_a_failed_capture_runs_the_op_and_says_why(caplog):
    backend = StandInGraphs(fail=RuntimeError("operation not permitted when stream is capturing"))
    graphed = GraphedOp(recompute(op_fn), "gated_delta_rule/fla-graphed", backend)
    inputs = _inputs(5)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        out = graphed(*inputs)
        graphed(*inputs)
    assert graphed.disabled.startswith("RuntimeError: operation not permitted")
    warnings = [r.getMessage() for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(warnings) == 1 and "FUSEPATCH_SKIP=gated_delta_rule/fla-graphed" in warnings[0]
    torch.testing.assert_close(out, op_fn(*inputs), rtol=0, atol=0)
    for got, want in zip(_grads(out, inputs, 1), _grads(op_fn(*inputs), inputs, 1)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_calls_that_cannot_be_graphed_run_the_op():
    backend = StandInGraphs()
    graphed = GraphedOp(recompute(op_fn), "toy", backend)
    inputs = _inputs(6)
    with torch.inference_mode():
        graphed(*inputs)
    graphed(inputs[0].to(torch.float32), inputs[1].to("meta"), inputs[2])  # mixed devices
    assert backend.captures == 0


def test_inside_activation_checkpointing():
    """Non-reentrant checkpointing: the first call (capture) happens inside the checkpointed forward and the
    backward recomputes it (another replay); the gradients are the op's."""
    from torch.utils.checkpoint import checkpoint

    backend = StandInGraphs()
    graphed = GraphedOp(recompute(op_fn), "toy", backend)
    inputs = _inputs(11)
    out = checkpoint(lambda *t: graphed(*t) * 3, *inputs, use_reentrant=False)
    want = op_fn(*inputs) * 3
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for got, expected in zip(_grads(out, inputs, 2), _grads(want, inputs, 2)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_a_split_with_saved_tensors_interleaves_like_layers():
    """A split that saves intermediates (as fla's does): each call's saved tensors are cloned out of the static
    buffers after its forward replay and copied back before its backward replay."""

    def forward(x, w):
        pre = x @ w
        return torch.tanh(pre), (pre,)

    def backward(inputs, saved, grad_output, needs_grad):
        (x, w), (pre,) = inputs, saved
        dpre = grad_output * (1 - torch.tanh(pre) ** 2)
        grads = (dpre @ w.t(), x.t() @ dpre)
        return tuple(g for g, n in zip(grads, needs_grad) if n)

    backend = StandInGraphs()
    graphed = GraphedOp(Split(forward, backward), "toy", backend)

    def data(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((6, 4), (4, 5))]

    first, second = data(1), data(2)
    out1, out2 = graphed(*first), graphed(*second)
    grads2, grads1 = _grads(out2, second, 3), _grads(out1, first, 4)
    for inputs, got, seed in ((first, grads1, 4), (second, grads2, 3)):
        want = _grads(torch.tanh(inputs[0] @ inputs[1]), inputs, seed)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert backend.captures == 2
    # without graphs (a capture that failed) the same split runs directly, still differentiable
    direct = Split(forward, backward).run(*first)
    for g, w in zip(_grads(direct, first, 5), _grads(torch.tanh(first[0] @ first[1]), first, 5)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("graphed", [True, False], ids=["replayed", "direct"])
def test_only_the_inputs_the_backward_reads_are_kept(graphed):
    """``backward_inputs``: a split whose backward reads its second input only (the first reaches it through
    ``saved``, as fla's split passes v) keeps that input and its saved tensors, nothing else, and still
    differentiates both inputs; without graphs the unkept input reaches the backward as None."""
    seen = []

    def forward(x, w):
        return torch.tanh(x * w), (x.contiguous(),)

    def backward(inputs, saved, grad_output, needs_grad):
        seen.append(inputs[0] is None)
        (x,), w = saved, inputs[1]
        d = grad_output * (1 - torch.tanh(x * w) ** 2)
        return tuple(g for g, n in zip((d * w, (d * x).sum(0)), needs_grad) if n)

    split = Split(forward, backward, backward_inputs=(1,))
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    if graphed:
        out = GraphedOp(split, "toy", StandInGraphs())(x, w)
    else:
        out = split.run(x, w)
    assert len(out.grad_fn.saved_tensors) == 2  # w, and the saved copy of x
    for got, want in zip(_grads(out, (x, w), 6), _grads(torch.tanh(x * w), (x, w), 6)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert seen[-1] is (not graphed)


def test_the_graphed_candidate_is_opt_in_and_leaves_packed_rows_to_fla(monkeypatch):
    """fla-graphed comes first but only runs with FUSEPATCH_CUDA_GRAPHS=1 (the graphs' copies cost more GPU time
    than the launches they save unless the CPU holds the step back); refused, it says how to turn it on."""
    from fusepatch.base.env import Environment
    from fusepatch.ops import OPS

    candidates = OPS["gated_delta_rule"].candidates
    assert [c.name for c in candidates[:4]] == ["fla-graphed", "fla-saved-states-grouped", "fla-saved-states", "fla"]
    assert candidates[0].varlen is False and all(c.varlen for c in candidates[1:4])
    switch = candidates[0].requirements[-1]
    env = Environment(python="3.12", platform="linux", torch="2.11.0", torch_cuda="13.0", cuda_available=True)
    monkeypatch.delenv("FUSEPATCH_CUDA_GRAPHS", raising=False)
    verdict = switch.check(env)
    assert (
        not verdict and "FUSEPATCH_CUDA_GRAPHS=1" in verdict.reason and verdict.fix == "export FUSEPATCH_CUDA_GRAPHS=1"
    )
    monkeypatch.setenv("FUSEPATCH_CUDA_GRAPHS", "1")
    assert switch.check(env)


@pytest.mark.parametrize("packed", [False, True])
def test_the_graphed_candidate_routes_packed_calls_around_the_graphs(monkeypatch, packed):
    """The loaded function: equal-length calls go through GraphedOp, packed ones to fla's function directly."""
    from fusepatch.ops.gated_delta_rule import fla as gdr

    calls = []

    def fake_fla(*tensors, cu_seqlens=None):
        calls.append(cu_seqlens is not None)
        return tensors[2] * 1.0

    monkeypatch.setattr(gdr, "load_fla", lambda gate_in_kernel: fake_fla)
    monkeypatch.setattr(gdr, "fla_split", lambda: Split(lambda *t: (t[2] * 1.0, ()), None))
    fn = gdr.load_fla_graphed()
    fn.graphed.backend = StandInGraphs()
    t = torch.randn(1, 8, 2, 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32) if packed else None
    out = fn(t, t, t, t[..., 0], t[..., 0], t[0, 0, :, 0], t[0, 0, :, 0], cu_seqlens=cu)
    torch.testing.assert_close(out, t)
    assert calls == ([True] if packed else [])  # fla's own function only for the packed call
    assert len(fn.graphed.entries) == (0 if packed else 1)
