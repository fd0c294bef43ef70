"""Gated DeltaNet ops on a real GPU: every fused candidate against an fp32 reference, fresh random inputs.

Tolerances (relative error ||x - ref|| / ||ref|| of the output and of every input gradient):
bf16 inputs 2e-2 (bf16 carries 8 mantissa bits: a single rounding is 4e-3, chunked kernels accumulate a few);
fp32 inputs 5e-3 (Triton runs fp32 dots as tf32, ~1e-3 per product). The decay parameters' gradients at bf16:
DECAY_TOL (see test_gated_delta_rule). fla's delta rule at fp32 misses these bounds on the H200 and the checker
refuses it (see _fp32_is_refused_and_still_off).
"""

from __future__ import annotations

import pytest
import torch
from conftest import compare, kernel, require

from fusepatch.base.env import capture
from fusepatch.engine import selftest
from fusepatch.engine.resolve import static_verdict
from fusepatch.ops import OPS

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 2e-2, torch.float32: 5e-3}
DECAY_TOL = 0.25
# The gate input's gradient (d3) is the decay gradient per token: the same cancellation, without the sum over
# tokens. fla's in-kernel gate (fla-saved-states, T257 packed, bf16) measured 2.09% on the H200 on 2026-12-03.
GATE_TOL = 4e-2


def _gdn_inputs(length, hk, hv, dk, dv):
    q = torch.randn(1, length, hk, dk, device="cuda")
    k = torch.randn(1, length, hk, dk, device="cuda")
    v = torch.randn(1, length, hv, dv, device="cuda")
    a = torch.randn(1, length, hv, device="cuda")
    b = torch.randn(1, length, hv, device="cuda")
    A_log = torch.empty(hv, device="cuda").uniform_(1, 16).log()
    dt_bias = torch.randn(hv, device="cuda")
    return [q, k, v, a, b, A_log, dt_bias]


# Every distinct (heads, head size, dtype, varlen) combination makes Triton compile and autotune fla's kernels
# and TileLang compile its backward kernel anew (a minute or more each on a cold machine), so the shapes share
# head sizes with the mini models (Hk 2, Hv 4, D 64) and vary what matters: lengths that are not multiples of
# 64, packing, and the grouped-value ratio (1 and 3 once each).
GDN_SHAPES = [  # T, Hk, Hv, Dk, Dv, packed boundaries, dtypes
    (100, 2, 4, 64, 64, None, (torch.bfloat16,)),
    (301, 2, 4, 64, 64, [0, 17, 150, 301], (torch.bfloat16, torch.float32)),
    (700, 2, 4, 64, 64, [0, 64, 65, 400, 700], (torch.bfloat16,)),
    (257, 2, 2, 64, 64, [0, 100, 257], (torch.bfloat16,)),
    (257, 2, 6, 64, 64, [0, 100, 257], (torch.bfloat16,)),
]
GDN_CASES = [
    pytest.param(
        shape[:6], dtype, id=f"T{shape[0]}-gva{shape[2] // shape[1]}{'-packed' if shape[5] else ''}-{str(dtype)[6:]}"
    )
    for shape in GDN_SHAPES
    for dtype in shape[6]
]


@pytest.mark.parametrize("name", ["fla-saved-states", "fla-saved-states-grouped", "fla", "fla-gate-outside"])
@pytest.mark.parametrize("shape, dtype", GDN_CASES)
def test_gated_delta_rule(name, shape, dtype):
    length, hk, hv, dk, dv, bounds = shape
    inputs = _gdn_inputs(length, hk, hv, dk, dv)
    kwargs = {"cu_seqlens": torch.tensor(bounds, device="cuda", dtype=torch.int32)} if bounds else {}
    if dtype == torch.float32:
        _fp32_is_refused_and_still_off(name, inputs, kwargs)
        return
    fn = kernel("gated_delta_rule", name, dtype)

    # bf16: the A_log and dt_bias gradients (d5, d6) sum the decay gradient over every token with heavy
    # cancellation, which amplifies bf16 rounding (measured on the H200: 5-16% in the mini model where the
    # fp32-recurrence eager path has 0.2-2%); they are held to DECAY_TOL there, the gate input's to GATE_TOL.
    looser = {"d3": GATE_TOL, "d5": DECAY_TOL, "d6": DECAY_TOL} if dtype == torch.bfloat16 else None
    # every input, A_log and dt_bias too, in the dtype under test: a bf16 model holds its parameters in bf16
    compare(fn, OPS["gated_delta_rule"].reference, inputs, dtype, TOL[dtype], looser=looser, **kwargs)


def test_fla_with_fusepatch_chunk_table_equals_fla_building_its_own():
    """Boundaries found from ``position_ids`` carry their host values, and the fla candidate hands fla the chunk
    table built from them (no wait for the GPU). That table must equal fla's own (``prepare_chunk_indices``),
    and the delta rule's output and every gradient must be what fla gives building it itself: the same bits,
    or where fla's own two runs differ (atomic sums in its backward), no further off than they are."""
    from fla.ops.utils.index import prepare_chunk_indices

    from fusepatch.layers.support.packing import cu_seqlens_from_position_ids
    from fusepatch.ops.boundaries import host_values
    from fusepatch.ops.gated_delta_rule.fla import chunk_table

    fn = kernel("gated_delta_rule", "fla", torch.bfloat16)
    lengths = [64, 1, 335, 300]
    position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    cu = cu_seqlens_from_position_ids(position_ids)
    plain = cu.clone()  # the same boundaries without host values: fla builds its table
    assert host_values(cu) == (0, 64, 65, 400, 700) and host_values(plain) is None
    assert torch.equal(chunk_table(cu), prepare_chunk_indices(plain, 64))

    inputs = [t.to(torch.bfloat16) for t in _gdn_inputs(700, 2, 4, 64, 64)]  # A_log, dt_bias too, as compare()
    grad = torch.randn(1, 700, 4, 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for bounds in (cu, plain, plain):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves, cu_seqlens=bounds)
        out.backward(grad)
        results.append([out.detach().float(), *(t.grad.float() for t in leaves)])
    names = ["out", "dq", "dk", "dv", "da", "db", "dA_log", "ddt_bias"]
    for name, with_table, own, again in zip(names, *results):
        noise = (own - again).abs().max()
        assert (with_table - own).abs().max() <= 2 * noise, (name, noise)


@pytest.mark.parametrize(
    "batch, length, bounds",
    [(1, 301, None), (3, 200, None), (1, 700, [0, 64, 65, 400, 700])],
    ids=["1x301", "3x200", "packed"],
)
@pytest.mark.parametrize("name", ["fla-saved-states", "fla-saved-states-grouped"])
def test_saved_states_equal_fla(name, batch, length, bounds):
    """fla-saved-states runs fla's kernels in fla's order on the same inputs and keeps the forward's WY keys, chunk
    states and corrected values instead of recomputing them in the backward (the same kernels on the same inputs):
    the output and every gradient must be fla's bit for bit, or where fla's own two runs differ (atomic sums in
    its backward), no further off than they are. q, k and v are views of one conv output, as the layer without
    the Triton split passes them; packed rows include a one-token document. The fp64 reference check is
    test_gated_delta_rule[...fla-saved-states]. The grouped variant sums the q/k gradients' groups in fp32 in its
    own kernel where fla sums them in bf16 tensors, and computes the per-token inputs in its own kernels: its
    output within 4e-3 of fla's, its q/k/v, a and b gradients within 1e-2."""
    from fusepatch.ops.common import relative_error

    saved = kernel("gated_delta_rule", name, torch.bfloat16)
    plain = kernel("gated_delta_rule", "fla", torch.bfloat16)
    hk, hv, d = 2, 4, 64
    mixed = torch.randn(batch, length, (2 * hk + hv) * d, device="cuda")
    a, b = torch.randn(batch, length, hv, device="cuda"), torch.randn(batch, length, hv, device="cuda")
    A_log, dt_bias = torch.empty(hv, device="cuda").uniform_(1, 16).log(), torch.randn(hv, device="cuda")
    leaves = [t.to(torch.bfloat16) for t in (mixed, a, b, A_log, dt_bias)]
    kwargs = {"cu_seqlens": torch.tensor(bounds, device="cuda", dtype=torch.int32)} if bounds else {}
    cot = torch.randn(batch, length, hv, d, device="cuda", dtype=torch.bfloat16)

    def run(fn):
        x = [t.detach().clone().requires_grad_(True) for t in leaves]
        q, k, v = torch.split(x[0], [hk * d, hk * d, hv * d], dim=-1)
        shape = (batch, length)
        out = fn(q.reshape(*shape, hk, d), k.reshape(*shape, hk, d), v.reshape(*shape, hv, d), *x[1:], **kwargs)
        return [out.detach().float(), *(g.float() for g in torch.autograd.grad(out, x, cot))]

    names = ["out", "d_mixed", "da", "db", "dA_log", "ddt_bias"]
    for what, got, own, again in zip(names, run(saved), run(plain), run(plain)):
        noise = (own - again).abs().max()
        if name.endswith("grouped"):
            # its own input kernels (test_delta_rule_inputs_equal_fla) round as fla's to fp32 rounding: the output
            # within a bf16 rounding (2^-8) of fla's; fla's kernels at Hk == Hv may tile differently; the decay
            # parameters' token sums (which amplify rounding) are held to the fp64 reference in
            # test_gated_delta_rule instead
            bound = {"out": 4e-3, "d_mixed": 1e-2, "da": 1e-2, "db": 1e-2}.get(what)
            if bound is not None:
                assert relative_error(got, own) <= bound, (what, relative_error(got, own))
            continue
        assert (got - own).abs().max() <= 2 * noise, (what, (got - own).abs().max().item(), noise.item())


@pytest.mark.parametrize(
    "batch, length, hk, groups, dim, bounds",
    [(1, 4096, 16, 3, 128, None), (2, 301, 2, 2, 64, None), (1, 700, 2, 2, 64, [0, 64, 65, 400, 700]),
     (1, 77, 3, 1, 40, None)],
    ids=["27b", "mini", "packed", "odd"],
)  # fmt: skip
def test_delta_rule_inputs_equal_fla(batch, length, hk, groups, dim, bounds):
    """fusepatch's delta-rule input kernels (fla-saved-states-grouped's default), compiled, against the fla
    functions they replace, called as fla's own delta rule calls them, on bf16 inputs as the layer has them:
    forward ``l2norm_fwd`` for q and k, ``fused_beta_sigmoid``, ``gdn_gate_chunk_cumsum`` in log2 space; backward
    the sum of the two decay gradients, the reverse ``chunk_local_cumsum``, ``gdn_gate_bwd`` and
    ``fused_beta_sigmoid_bwd``. The normalised q/k and the bf16 gradients within a bf16 rounding (2^-8, relative),
    rstd, beta and g (fp32) within 1e-5: the same formulas, a hand-written softplus in fla's."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.gate import fused_beta_sigmoid_bwd, fused_beta_sigmoid_fwd
    from fla.ops.gated_delta_rule.gate import gdn_gate_bwd, gdn_gate_chunk_cumsum
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.index import prepare_chunk_indices

    from fusepatch.kernels.delta_rule_inputs import delta_rule_inputs, delta_rule_inputs_bwd
    from fusepatch.ops.common import relative_error

    hv = hk * groups
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k = torch.randn(batch, length, hk, dim, **bf16), torch.randn(batch, length, hk, dim, **bf16) * 3
    a, b = torch.randn(batch, length, hv, **bf16) * 4, torch.randn(batch, length, hv, **bf16) * 3
    A_log, dt_bias = torch.empty(hv, device="cuda").uniform_(1, 16).log().bfloat16(), torch.randn(hv, **bf16)
    places = {}
    if bounds:
        cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
        places = dict(cu_seqlens=cu, chunk_indices=prepare_chunk_indices(cu, 64))
    got = delta_rule_inputs(q, k, a, b, A_log, dt_bias, scale=RCP_LN2, **places)
    want = (
        *l2norm_fwd(q), *l2norm_fwd(k), fused_beta_sigmoid_fwd(b, 1.0),
        gdn_gate_chunk_cumsum(g=a, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=64, **places),
    )  # fmt: skip
    names = ["q_n", "q_rstd", "k_n", "k_rstd", "beta", "g"]
    for name, mine, theirs in zip(names, got, want):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, name
        bound = 4e-3 if mine.dtype == torch.bfloat16 else 1e-5
        assert relative_error(mine, theirs) <= bound, (name, relative_error(mine, theirs))

    fp32 = dict(device="cuda", dtype=torch.float32)
    dg, dg2, dbeta = (torch.randn(batch, length, hv, **fp32) for _ in range(3))
    got = delta_rule_inputs_bwd(a, b, A_log, dt_bias, dg, dg2, dbeta, hk, **places)
    dyg = chunk_local_cumsum(dg + dg2, chunk_size=64, reverse=True, **places)
    da, dA_log, ddt_bias = gdn_gate_bwd(g=a, A_log=A_log, dt_bias=dt_bias, dyg=dyg)
    want = (da, fused_beta_sigmoid_bwd(b, dbeta, 1.0), dA_log, ddt_bias)
    for name, mine, theirs in zip(["da", "db", "dA_log", "ddt_bias"], got, want):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, name
        assert relative_error(mine, theirs) <= 4e-3, (name, relative_error(mine, theirs))


@pytest.mark.parametrize(
    "shape", [(1, 4096, 16, 3, 128), (2, 301, 2, 2, 64), (1, 77, 3, 1, 40)], ids=["27b", "mini", "odd"]
)
def test_grouped_l2norm_backward(shape):
    """fusepatch's L2-norm backward with the group sum folded in (fla-saved-states-grouped), compiled, against
    autograd through the L2 norm in fp64: bf16 inputs as the layer has them, within 2e-2."""
    from fusepatch.kernels.l2norm import l2norm_bwd_grouped
    from fusepatch.ops.common import relative_error

    b, t, hk, g, k = shape
    x = torch.randn(b, t, hk, k, device="cuda", dtype=torch.float64, requires_grad=True)
    y = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    rstd = torch.rsqrt((x.detach() ** 2).sum(-1) + 1e-6).float()
    grad, extra = (torch.randn(b, t, hk * g, k, device="cuda", dtype=torch.float64) for _ in range(2))
    (want,) = torch.autograd.grad(y, x, (grad + extra).view(b, t, hk, g, k).sum(3))
    got = l2norm_bwd_grouped(y.detach().bfloat16(), rstd, grad.bfloat16(), extra.bfloat16())
    assert relative_error(got, want) <= 2e-2, relative_error(got, want)


@pytest.mark.parametrize(
    "shape, groups",
    [((1, 4096, 16, 128), 3), ((4096, 4, 256), 6), ((2, 77, 3, 40), 5)],
    ids=["27b-qk", "27b-kv", "odd"],
)
def test_repeat_heads_equals_repeat_interleave(shape, groups):
    """The grouped delta rule's q/k expansion (kernels/heads.py), compiled: bit for bit torch's
    ``repeat_interleave`` (a copy), bf16 and fp32, at the 27B shapes and odd ones."""
    from fusepatch.kernels.heads import repeat_heads

    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(shape, device="cuda", dtype=dtype)
        assert torch.equal(repeat_heads(x, groups), x.repeat_interleave(groups, dim=-2))


def _fp32_is_refused_and_still_off(name, inputs, kwargs):
    """The checker refuses fla's delta rule at fp32 (H200 run of 2026-11-29 on the H200: gate gradient 4-6%, A_log/dt_bias
    19-30% off the fp32 reference). Both halves are checked here: the refusal, and that the kernel still misses
    TOL at fp32, so the rule is lifted (this test fails) once a fla release computes fp32 to fp32 precision."""
    from fusepatch.base.requirements import Inputs

    candidate = next(c for c in OPS["gated_delta_rule"].candidates if c.name == name)
    refusal = candidate.inputs.check(Inputs("cuda", "float32"))
    assert not refusal.ok and "further off an fp32 reference than at bf16" in refusal.reason, refusal
    verdict, _ = static_verdict(candidate, capture(refresh=True))
    require(verdict, f"gated_delta_rule/{name}")
    fn = candidate.load()
    with pytest.raises(AssertionError, match="errors over"):
        compare(fn, OPS["gated_delta_rule"].reference, inputs, torch.float32, TOL[torch.float32], **kwargs)


@pytest.mark.parametrize("name", ["causal-conv1d", "fla-conv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_causal_conv1d(name, dtype, packed):
    fn = kernel("causal_conv1d", name, dtype)
    if name == "causal-conv1d" and dtype == torch.float32:
        # A build compiled for bf16 only (such as the ready wheel for the H200) must be refused by the checker.
        selftest.clear_cache()
        candidate = next(c for c in OPS["causal_conv1d"].candidates if c.name == name)
        verdict = selftest.run(OPS["causal_conv1d"], candidate, fn, "cuda", "float32")
        if not verdict.ok:
            assert "bf16-only" in verdict.reason, verdict.reason
            return
    length, dim = 333, 2 * 2 * 64 + 4 * 64  # the mini models' conv width: q, k (2 heads of 64) and v (4 of 64)
    x = torch.randn(1, length, dim, device="cuda")
    w = torch.randn(dim, 4, device="cuda") * 0.5
    kwargs = {"activation": "silu"}
    if packed:
        kwargs["cu_seqlens"] = torch.tensor([0, 1, 100, 101, 333], device="cuda", dtype=torch.int32)

    compare(fn, OPS["causal_conv1d"].reference, [x, w], dtype, TOL[dtype], extra=(None,), **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", ["triton", "fla"])
@pytest.mark.parametrize("dim", [64, 128])
def test_gated_rms_norm(dim, name, dtype):
    fn = kernel("gated_rms_norm", name, dtype)
    x, z = torch.randn(3001, dim, device="cuda"), torch.randn(3001, dim, device="cuda")
    w = 1 + 0.1 * torch.randn(dim, device="cuda")

    compare(fn, OPS["gated_rms_norm"].reference, [x, z, w], dtype, TOL[dtype], extra=(1e-6,))


def test_selftests_pass_for_every_installed_gdn_candidate():
    """The self-test apply() runs is what keeps a broken kernel out; on this machine it must accept them."""
    env = capture(refresh=True)
    accepted = []
    for op in ("gated_delta_rule", "causal_conv1d", "gated_rms_norm"):
        for candidate in OPS[op].candidates:
            verdict, _ = static_verdict(candidate, env)
            if not verdict.ok:
                continue
            try:
                fn = candidate.load()
            except Exception as exc:  # noqa: BLE001
                # a Kernel Hub kernel not in the local cache (no network here) is not installed; a pip one is
                assert candidate.source == "hub", f"{op}/{candidate.name} failed to load: {exc}"
                continue
            result = selftest.run(OPS[op], candidate, fn, "cuda", "bfloat16")
            assert result.ok, f"{op}/{candidate.name}: {result.reason}"
            accepted.append(f"{op}/{candidate.name}")
    require(type("V", (), {"ok": bool(accepted), "reason": "no GDN candidate installed"})(), "self-tests")


@pytest.mark.parametrize("sizes", [(2048, 2048, 6144), (256, 256, 512), (3, 300, 5)], ids=["27b", "mini", "odd"])
def test_triton_split_of_the_conv_output(sizes):
    """q/k/v out of the conv output (fusepatch's Triton split, which replaced torch's ``split_with_sizes_copy``
    on CUDA): each part contiguous and equal to torch's view, rows a wider stride apart too; the layer's autograd
    function gives ``cat`` of the gradients."""
    from fusepatch.layers.gated_deltanet import _SplitCopy

    for dtype in (torch.bfloat16, torch.float32):
        wide = torch.randn(2, 777, sum(sizes) + 64, device="cuda", dtype=dtype)
        for x in (wide[..., : sum(sizes)].contiguous(), wide[..., 32 : 32 + sum(sizes)]):
            parts = _SplitCopy.apply(x, list(sizes))
            for part, want in zip(parts, torch.split(x, list(sizes), dim=-1)):
                assert part.is_contiguous() and torch.equal(part, want)
    x = torch.randn(1, 300, sum(sizes), device="cuda", requires_grad=True)
    cotangents = [torch.randn(1, 300, n, device="cuda") for n in sizes]
    (grad,) = torch.autograd.grad(sum((p * c).sum() for p, c in zip(_SplitCopy.apply(x, list(sizes)), cotangents)), x)
    assert torch.equal(grad, torch.cat(cotangents, dim=-1))
