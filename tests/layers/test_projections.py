"""Projections the fused layers compute themselves (fusepatch.layers.support.projections), on the CPU.

The fused paths run on CUDA only (``DEVICES``); these tests add "cpu" so that they run here, in fp64 where the
arithmetic is compared with autograd's, and say when each path steps aside for the modules themselves.
"""

from __future__ import annotations

import pytest
import torch

from fusepatch.layers.support import projections


@pytest.fixture(params=[0, 6, 256], ids=["separate", "some-joined", "all-joined"])
def on_cpu(monkeypatch, request):
    """The fused path on the CPU, with none, some (those of at most 6 outputs) or all of the tests' bias-free
    projections (2-7 outputs) joined in one GEMM (``NARROW``)."""
    monkeypatch.setattr(projections, "NARROW", request.param)
    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    ran = []
    plain = projections._SharedInputLinears.apply
    monkeypatch.setattr(projections._SharedInputLinears, "apply", lambda *a: ran.append(a[1]) or plain(*a))
    return ran


def _linears(*sizes, bias=False, dtype=torch.float64):
    torch.manual_seed(0)
    return [torch.nn.Linear(6, n, bias=bias, dtype=dtype) for n in sizes]


def _reference(x, linears, cotangents):
    """Output, input gradient and parameter gradients of the modules called one by one."""
    x = x.detach().requires_grad_(x.requires_grad)
    outs = [linear(x) for linear in linears]
    loss = sum((o * c).sum() for o, c in zip(outs, cotangents) if c is not None)
    params = [p for linear in linears for p in linear.parameters() if p.requires_grad]
    inputs = ([x] if x.requires_grad else []) + params
    return outs, torch.autograd.grad(loss, inputs, allow_unused=True)


def _fused(x, linears, cotangents):
    x = x.detach().requires_grad_(x.requires_grad)
    outs = projections.project(x, *linears)
    loss = sum((o * c).sum() for o, c in zip(outs, cotangents) if c is not None)
    params = [p for linear in linears for p in linear.parameters() if p.requires_grad]
    inputs = ([x] if x.requires_grad else []) + params
    return outs, torch.autograd.grad(loss, inputs, allow_unused=True)


@pytest.mark.parametrize("bias", [False, True])
def test_project_equals_the_modules_with_one_accumulated_input_gradient(on_cpu, bias):
    linears = _linears(5, 7, 2, bias=bias)
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    cotangents = [torch.randn(3, 4, n, dtype=torch.float64) for n in (5, 7, 2)]
    want_out, want_grads = _reference(x, linears, cotangents)
    got_out, got_grads = _fused(x, linears, cotangents)
    assert on_cpu == [3], "the fused path must run"
    for got, want in zip(got_out, want_out):
        if projections.NARROW == 0:
            assert torch.equal(got, want)  # the same F.linear calls
        else:  # joined: columns of one wider GEMM, summed in their own order
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(got_grads) == len(want_grads)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears]
    torch.autograd.gradcheck(
        lambda t, *p: projections._SharedInputLinears.apply(
            t, 3, projections.narrow_group(linears), *p, *(biases if bias else [None] * 3)
        ),
        (x, *weights),
    )


def test_an_unused_output_and_a_frozen_weight(on_cpu):
    """An output that does not reach the loss adds nothing (its gradient stays None); a frozen weight gets no
    gradient computed; the input's gradient is the used outputs' only."""
    linears = _linears(5, 7, 2)
    linears[1].weight.requires_grad_(False)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    cotangents = [torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(2, 3, 7, dtype=torch.float64), None]
    want_out, want_grads = _reference(x, linears, cotangents)
    got_out, got_grads = _fused(x, linears, cotangents)
    assert on_cpu == [3]
    dx, dw0, dw2 = got_grads
    torch.testing.assert_close(dx, want_grads[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw0, want_grads[1], rtol=1e-12, atol=1e-12)
    assert dw2 is None and want_grads[2] is None
    assert linears[1].weight.grad is None


def test_input_without_gradient_still_trains_the_weights(on_cpu):
    linears = _linears(4, 3)
    x = torch.randn(5, 6, dtype=torch.float64)
    cotangents = [torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)]
    _, want = _reference(x, linears, cotangents)
    _, got = _fused(x, linears, cotangents)
    assert on_cpu == [2]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


class _Subclass(torch.nn.Linear):
    pass


@pytest.mark.parametrize("case", ["other device", "hook", "subclass", "dtype", "no grad", "one linear", "compile"])
def test_project_steps_aside_for_the_modules(monkeypatch, case):
    """Anything the plain GEMMs would not reproduce (hooks, LoRA-like subclasses, mixed dtypes) or where they
    would not pay (no gradient, one projection, torch.compile's own graph) calls the modules."""
    ran = []
    plain = projections._SharedInputLinears.apply
    monkeypatch.setattr(projections._SharedInputLinears, "apply", lambda *a: ran.append(1) or plain(*a))
    if case != "other device":
        monkeypatch.setattr(projections, "DEVICES", ("cpu",))
    linears = _linears(4, 3, dtype=torch.float32)
    x = torch.randn(2, 6, requires_grad=True)
    called = []
    if case == "hook":
        linears[0].register_forward_hook(lambda *a: called.append(1))
    if case == "subclass":
        linears[1] = _Subclass(6, 3)
    if case == "dtype":
        linears[1] = linears[1].double()
        x = x.double()
    if case == "one linear":
        linears = linears[:1]

    def run(t):
        return projections.project(t, *linears)

    if case == "no grad":
        with torch.no_grad():
            run(x)
    elif case == "compile":
        torch._dynamo.reset()
        torch.compile(run, backend="eager", fullgraph=True)(x)
    elif case == "dtype":
        with pytest.raises(RuntimeError):  # what the modules themselves do with mixed dtypes
            run(x)
    else:
        run(x)
    assert not ran
    assert case != "hook" or called


def test_linear_plus_is_the_residual_add_in_the_gemm(monkeypatch):
    monkeypatch.setattr(projections, "DEVICES", ("cpu",))
    (linear,) = _linears(5)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    residual = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    addmm = []
    real = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: addmm.append(1) or real(*a, **k))
    got = projections.linear_plus(linear, x, residual)
    assert addmm == [1]
    want = residual + linear(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.autograd.gradcheck(lambda r, t: projections.linear_plus(linear, t, r), (residual, x))
    with_bias = torch.nn.Linear(6, 5, dtype=torch.float64)
    addmm.clear()
    torch.testing.assert_close(projections.linear_plus(with_bias, x, residual), residual + with_bias(x))
    assert not addmm, "a bias: the plain sum"


@pytest.mark.parametrize("bias", [False, True])
def test_project_under_autocast_casts_as_autocast_does(on_cpu, bias):
    """The Trainer's bf16 over fp32 weights: input, weights and biases cast to bf16 as autocast casts them for
    ``F.linear``; the same bf16 outputs as the modules under autocast, fp32 gradients for the fp32 parameters
    (through the casts' backward) within bf16 rounding of the modules' own."""
    linears = _linears(5, 7, bias=bias, dtype=torch.float32)
    x = torch.randn(3, 4, 6, requires_grad=True)
    cotangents = [torch.randn(3, 4, n) for n in (5, 7)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_out, want_grads = _reference(x, linears, cotangents)
        got_out, got_grads = _fused(x, linears, cotangents)
    assert on_cpu == [2]
    for got, want in zip(got_out, want_out):
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(got_grads, want_grads):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_narrow_group_joins_the_narrow_bias_free_projections(monkeypatch):
    """Two or more bias-free projections of at most NARROW outputs share one GEMM (the Gated DeltaNet's
    in_proj_b / in_proj_a); one narrow projection alone, or one with a bias, keeps its own."""
    qkv, z, b, a = (torch.nn.Linear(64, n, bias=False) for n in (320, 300, 4, 4))
    assert projections.narrow_group((qkv, z, b, a)) == (2, 3)
    assert projections.narrow_group((qkv, b)) == ()
    assert projections.narrow_group((b, torch.nn.Linear(64, 4))) == ()
    monkeypatch.setattr(projections, "NARROW", 300)
    assert projections.narrow_group((qkv, z, b, a)) == (1, 2, 3)


def test_hooked_sees_own_and_global_hooks_but_not_passive_labels(monkeypatch):
    """The fast path (no hook anywhere) and the slow one agree: a module's own hook or a global one counts, a
    profiler label marked passive does not; a bias in another dtype than the input keeps the module's call."""
    from torch.nn.modules import module as torch_module

    from fusepatch.layers.support import projections

    linear = torch.nn.Linear(4, 3)
    assert not projections.hooked(linear)
    handle = torch_module.register_module_forward_hook(lambda *a: None)
    try:
        assert projections.hooked(linear)
    finally:
        handle.remove()

    def label(*args):
        return None

    label._fusepatch_passive = True
    own = linear.register_forward_pre_hook(label)
    assert not projections.hooked(linear)
    own.remove()
    monkeypatch.setattr(projections, "DEVICES", ("cpu",))
    x, other = torch.randn(2, 4), torch.nn.Linear(4, 2, bias=False)
    assert projections.plain_linears(x, (linear, other))
    linear.bias.data = linear.bias.data.double()
    assert not projections.plain_linears(x, (linear, other))
