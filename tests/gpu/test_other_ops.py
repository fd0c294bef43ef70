"""Norms, SwiGLU, the attention output gate and the fused linear cross-entropy on a real GPU, against an fp64 reference on fresh inputs.

Tolerances (relative error of the output and of every input gradient): bf16 2e-2, fp32 1e-3 (Triton's tf32
dots in fla's fused cross-entropy); the norms and SwiGLU are elementwise, far inside them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import compare, kernel

from fusepatch.ops import OPS

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def _compare(fn, reference, args, dtype, extra=(), **kwargs):
    compare(fn, reference, args, dtype, TOL[dtype], extra, **kwargs)


@DTYPES
@pytest.mark.parametrize("name", ["triton", "fla"])
@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_zero_centered"])
@pytest.mark.parametrize("shape", [(3, 1001, 2048), (2, 777, 24, 256), (5, 131, 5)], ids=["wide", "per-head", "odd"])
def test_rms_norms(shape, op, name, dtype):
    """The decoder's width, the per-head q/k norms (rows = tokens x heads), an odd width."""
    fn = kernel(op, name, dtype)
    x = torch.randn(*shape, device="cuda")
    w = 0.1 * torch.randn(shape[-1], device="cuda") + (1.0 if op == "rms_norm" else 0.0)
    _compare(fn, OPS[op].reference, [x, w], dtype, extra=(1e-6,))


@DTYPES
@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_zero_centered"])
def test_triton_rms_norm_reads_the_query_half_in_place(op, dtype):
    """Qwen3.5's q_norm input: the query half of ``q_proj``'s output per head, rows ``2 * head_dim`` apart. The
    kernel reads that view where it lies (no strided copy first), and output and gradients stay exact."""
    from fusepatch.kernels.rows import as_rows

    fn = kernel(op, "triton", dtype)
    heads, dim = 3, 256

    def query_half(norm):
        return lambda full, w, eps: norm(torch.chunk(full.view(2, 77, heads, 2 * dim), 2, dim=-1)[0], w, eps)

    full = torch.randn(2, 77, heads * 2 * dim, device="cuda")
    view = torch.chunk(full.view(2, 77, heads, 2 * dim), 2, dim=-1)[0]
    assert as_rows(view, dim).data_ptr() == full.data_ptr() and as_rows(view, dim).stride(0) == 2 * dim
    w = 0.1 * torch.randn(dim, device="cuda") + (1.0 if op == "rms_norm" else 0.0)
    _compare(query_half(fn), query_half(OPS[op].reference), [full, w], dtype, extra=(1e-6,))


def _variants(jit_function) -> int:
    """How many variants of a Triton kernel this process has compiled for the current GPU."""
    return len(jit_function.device_caches[torch.cuda.current_device()][0])


def _norm_steps(fn, rows_per_token: int, dim: int, tokens: tuple[int, ...]) -> None:
    """Forward and backward at several packed-row lengths, as training steps of varying length call it."""
    w = torch.randn(dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for t in tokens:
        x = torch.randn(t, rows_per_token, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fn(x, w, 1e-6).sum().backward()


LENGTHS = (4001, 4097, 4203, 4311, 4420)  # packed rows a few hundred tokens apart


def test_triton_rms_norm_compiles_once_for_every_row_count():
    """The reason fusepatch's own RMSNorm comes first: the q/k norms' rows (tokens x heads) change with every
    packed step, and this kernel compiles one variant per feature size and dtype, whatever the row count."""
    from fusepatch.kernels import rms_norm as module

    fn = kernel("rms_norm_zero_centered", "triton", torch.bfloat16)
    gated = kernel("gated_rms_norm", "triton", torch.bfloat16)

    def gated_steps(tokens):  # the Gated DeltaNet output norm: rows = tokens x 48 value heads of 128
        _norm_steps(lambda x, w, eps: gated(x, torch.randn_like(x), w, eps), 48, 128, tokens)

    _norm_steps(fn, 24, 256, LENGTHS[:1])
    gated_steps(LENGTHS[:1])
    before = _variants(module._rms_norm_fwd), _variants(module._rms_norm_bwd)
    _norm_steps(fn, 24, 256, LENGTHS[1:])
    gated_steps(LENGTHS[1:])
    assert (_variants(module._rms_norm_fwd), _variants(module._rms_norm_bwd)) == before


def test_fla_rms_norm_autotunes_again_for_new_row_buckets():
    """The measured reason fla's RMSNorm is second (H200 run of 2026-11-29): at feature sizes <= 512
    its kernels autotune (and compile) per row-count bucket cdiv(rows, 2048). When this fails, fla no longer
    does that, and the candidate order in fusepatch/ops/rms_norm/__init__.py can be revisited."""
    from fla.modules.norm import layernorm

    fn = kernel("rms_norm_zero_centered", "fla", torch.bfloat16)
    _norm_steps(fn, 24, 256, LENGTHS[:1])
    before = len(layernorm.layer_norm_fwd_kernel.cache)
    _norm_steps(fn, 24, 256, LENGTHS[1:])
    assert len(layernorm.layer_norm_fwd_kernel.cache) >= before + 3


@DTYPES
@pytest.mark.parametrize("name", ["triton", "fla"])
@pytest.mark.parametrize("op", ["add_rms_norm", "add_rms_norm_zero_centered"])
@pytest.mark.parametrize("dim", [5120, 2048, 1000])
def test_add_rms_norms(dim, op, name, dtype):
    """Both outputs (the normed sum and the sum, the next residual) and the gradients of x, the residual and
    the weight, with a cotangent on each output (the sum's gradient is what the backward adds in); the
    27B and 2B model widths and an odd one."""
    fn = kernel(op, name, dtype)

    def flat(impl):
        return lambda x, residual, w, eps: torch.cat([t.reshape(-1) for t in impl(x, residual, w, eps)])

    x = torch.randn(2, 777, dim, device="cuda")
    residual = 4 * torch.randn(2, 777, dim, device="cuda")
    w = 0.1 * torch.randn(dim, device="cuda") + (1.0 if op == "add_rms_norm" else 0.0)
    _compare(flat(fn), flat(OPS[op].reference), [x, residual, w], dtype, extra=(1e-6,))


def test_triton_add_rms_norm_compiles_once_for_every_row_count():
    """fla's residual-add backward at the model width compiles again per rows-per-program count; ours keeps
    one variant per width and dtype over packed steps of varying length."""
    from fusepatch.kernels import rms_norm as module

    fn = kernel("add_rms_norm_zero_centered", "triton", torch.bfloat16)
    w = torch.randn(5120, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def steps(tokens):
        for t in tokens:
            x, residual = (
                torch.randn(t, 5120, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)
            )
            out, h = fn(x, residual, w, 1e-6)
            (out.sum() + h.sum()).backward()

    steps(LENGTHS[:1])
    before = _variants(module._rms_norm_fwd), _variants(module._rms_norm_bwd)
    steps(LENGTHS[1:])
    assert (_variants(module._rms_norm_fwd), _variants(module._rms_norm_bwd)) == before


@DTYPES
@pytest.mark.parametrize("name", ["triton", "fla"])
def test_swiglu(name, dtype):
    fn = kernel("swiglu", name, dtype)
    _compare(
        fn,
        OPS["swiglu"].reference,
        [torch.randn(4, 333, 1536, device="cuda"), torch.randn(4, 333, 1536, device="cuda")],
        dtype,
    )


@DTYPES
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_recomputed_down_projection(residual, dtype):
    """``FUSEPATCH_MLP_RECOMPUTE=1``'s down projection (layers/mlp_recompute.py) through the Triton SwiGLU kernel:
    ``[residual +] swiglu(gate, up) @ W.t()`` with the product recomputed in the backward, output and the
    gradients of gate, up, W and the residual against fp64."""
    from fusepatch.layers.mlp_recompute import _RecomputedDown

    swiglu = kernel("swiglu", "triton", dtype)
    reference = OPS["swiglu"].reference

    def fn(gate, up, weight, *res):
        return _RecomputedDown.apply(gate, up, weight, res[0] if res else None, swiglu)

    def ref(gate, up, weight, *res):
        out = reference(gate, up) @ weight.t()
        return out + res[0] if res else out

    args = [torch.randn(3, 333, 1536, device="cuda"), torch.randn(3, 333, 1536, device="cuda")]
    args.append(torch.randn(640, 1536, device="cuda") / 40)
    if residual:
        args.append(torch.randn(3, 333, 640, device="cuda"))
    _compare(fn, ref, args, dtype)


@DTYPES
@pytest.mark.parametrize("heads, dim", [(24, 256), (16, 128), (3, 80)], ids=["27b", "next", "odd"])
def test_attention_gate_reads_the_gate_half_in_place(heads, dim, dtype):
    """Qwen3.5 / Qwen3-Next's output gate: the gate half of ``q_proj``'s output per head, rows ``2 * head_dim``
    apart, read where it lies (no copy); the query half gets a zero gradient from it."""
    from fusepatch.kernels.rows import as_rows

    fn = kernel("attention_gate", "triton", dtype)

    def gate_half(op):
        return lambda attn, joint: op(attn, torch.chunk(joint.view(2, 333, heads, 2 * dim), 2, dim=-1)[1])

    joint = 2 * torch.randn(2, 333, heads * 2 * dim, device="cuda")
    view = torch.chunk(joint.view(2, 333, heads, 2 * dim), 2, dim=-1)[1]
    assert as_rows(view, dim).data_ptr() == view.data_ptr() and as_rows(view, dim).stride(0) == 2 * dim
    attn = torch.randn(2, 333, heads * dim, device="cuda")
    _compare(gate_half(fn), gate_half(OPS["attention_gate"].reference), [attn, joint], dtype)


@DTYPES
@pytest.mark.parametrize("name", ["triton", "fla", "torch-chunked"])
@pytest.mark.parametrize("tokens, hidden, vocab", [(2049, 1024, 32003), (300, 512, 248320)], ids=["32k", "qwen3_5"])
def test_linear_cross_entropy(name, dtype, tokens, hidden, vocab):
    fn = kernel("linear_cross_entropy", name, dtype)
    h = torch.randn(tokens, hidden, device="cuda")
    w = torch.randn(vocab, hidden, device="cuda") * hidden**-0.5
    y = torch.randint(0, vocab, (tokens,), device="cuda")
    y[::9] = -100
    items = torch.tensor(1500, device="cuda")
    _compare(fn, OPS["linear_cross_entropy"].reference, [h, w, y], dtype, num_items_in_batch=items)


@pytest.mark.parametrize("name", ["triton", "fla", "torch-chunked"])
def test_linear_cross_entropy_with_nothing_labelled(name):
    """No label to predict (every label -100): the loss is NaN as transformers' mean over no tokens is, and every
    gradient 0 (the kernels zero the ignored rows' gradients instead of scaling them by 1 / 0); with the
    Trainer's ``num_items_in_batch`` the loss is 0."""
    fn = kernel("linear_cross_entropy", name, torch.bfloat16)
    h = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32003, 512, device="cuda") * 512**-0.5).to(torch.bfloat16).requires_grad_(True)
    y = torch.full((300,), -100, device="cuda")
    loss = fn(h, w, y)
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert loss.isnan() and not gh.any() and not gw.any(), (loss, gh.abs().max(), gw.abs().max())
    assert fn(h, w, y, num_items_in_batch=torch.tensor(7, device="cuda")).item() == 0.0


@pytest.mark.parametrize("name", ["triton", "fla"])
def test_fused_loss_compiles_nothing_new_for_new_lengths(name):
    """fla's own fused-loss backward compiles a kernel per token count (tokens x hidden is a constexpr);
    fusepatch's loop must not, around fla's cross-entropy kernels or its own: over packed lengths a few hundred
    tokens apart (one chunk each, and a loss gradient other than 1 so the scaling runs), neither fusepatch's
    scaling kernel nor the cross-entropy kernels get a new variant after the first length."""
    from fusepatch.kernels import cross_entropy, scale

    fn = kernel("linear_cross_entropy", name, torch.bfloat16)
    if name == "fla":
        from fla.modules.fused_cross_entropy import ops as fla_ops

        watched = [scale._scale_unless_one, fla_ops.cross_entropy_fwd_kernel, fla_ops.cross_entropy_bwd_kernel]
    else:
        watched = [scale._scale_unless_one, cross_entropy._loss, cross_entropy._gradient]
    w = (torch.randn(32003, 1024, device="cuda") * 1024**-0.5).to(torch.bfloat16).requires_grad_(True)

    def steps(lengths):
        for t in lengths:
            h = torch.randn(t, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            y = torch.randint(0, 32003, (t,), device="cuda")
            (fn(h, w, y) * 0.5).backward()  # a loss gradient other than 1: the scaling runs

    def variants():
        return [len(k.device_caches[torch.cuda.current_device()][0]) for k in watched]

    steps(LENGTHS[:1])
    before = variants()
    steps(LENGTHS[1:])
    assert variants() == before


MOE_CANDIDATES = pytest.mark.parametrize("candidate", ["grouped-mm-triton", "torch-grouped-mm"])


@DTYPES
@MOE_CANDIDATES
def test_moe_experts_grouped(dtype, candidate):
    fn = kernel("moe_experts", candidate, dtype)
    tokens, experts, hidden, inter, top_k = 1031, 16, 1024, 512, 4
    h = torch.randn(tokens, hidden, device="cuda")
    index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).cuda()
    index[3, 0] = experts  # a dropped slot (expert parallelism's mark): no output, no gradient
    index[5] = experts  # every slot of token 5 dropped, and its row not finite: it reaches no expert
    h[5] = float("nan")
    weights = torch.rand(tokens, top_k, device="cuda").softmax(-1)
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda") * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device="cuda") * inter**-0.5
    _compare(fn, OPS["moe_experts"].reference, [h, index, weights, gate_up, down], dtype)


@MOE_CANDIDATES
def test_moe_experts_grouped_repeats_itself_bit_for_bit(candidate):
    """bf16, tokens in 8 experts each: the output and every gradient the same on a second run (each token's
    slots are summed by ``sum``, rows moved by permutations; an accumulating scatter's atomics made the order of
    the bf16 adds vary; the Triton activation sums each routing weight's gradient in one program)."""
    fn = kernel("moe_experts", candidate, torch.bfloat16)
    tokens, experts, hidden, inter, top_k = 2048, 64, 512, 256, 8
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).cuda()
    weights = torch.rand(tokens, top_k, device="cuda").softmax(-1).bfloat16().requires_grad_(True)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") * hidden**-0.5).bfloat16().requires_grad_(True)
    down = (torch.randn(experts, hidden, inter, device="cuda") * inter**-0.5).bfloat16().requires_grad_(True)
    cot = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)

    def run():
        out = fn(h, index, weights, gate_up, down)
        return out, *torch.autograd.grad(out, (h, weights, gate_up, down), cot)

    first, second = run(), run()
    for name, a, b in zip(("out", "dh", "dweights", "dgate_up", "ddown"), first, second):
        assert torch.equal(a, b), name


@DTYPES
@pytest.mark.parametrize(
    "batch, hq, hk, tokens, dim, rot",
    [(1, 24, 4, 1000, 256, 64), (2, 8, 2, 333, 128, 128)],
    ids=["qwen3_5-27b-partial", "qwen3-full"],
)
def test_rotary(dtype, batch, hq, hk, tokens, dim, rot):
    """q and k as the attention makes them (transposed views), per-token angles with a packed restart."""
    from conftest import record

    from fusepatch.ops.common import relative_error

    fn = kernel("rotary", "triton", dtype)
    q = torch.randn(batch, tokens, hq, dim, device="cuda").to(dtype).transpose(1, 2).requires_grad_(True)
    k = torch.randn(batch, tokens, hk, dim, device="cuda").to(dtype).transpose(1, 2).requires_grad_(True)
    positions = torch.cat([torch.arange(tokens // 3), torch.arange(tokens - tokens // 3)]).cuda()
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rot, 2, device="cuda") / rot))
    angles = (positions[:, None] * inv_freq[None]).repeat(1, 2)[None].expand(batch, tokens, rot)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    out = fn(q, k, cos, sin)
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k)]
    ref = OPS["rotary"].reference(leaves[0], leaves[1], cos.double(), sin.double())
    cots = [torch.randn_like(r) for r in ref]
    grads = torch.autograd.grad(out, (q, k), [c.to(dtype) for c in cots])
    ref_grads = torch.autograd.grad(ref, leaves, cots)
    errors = {"q": relative_error(out[0], ref[0]), "k": relative_error(out[1], ref[1])}
    errors |= {"dq": relative_error(grads[0], ref_grads[0]), "dk": relative_error(grads[1], ref_grads[1])}
    record(f"rotary {dtype} {batch}x{hq}/{hk}x{tokens}x{dim}/{rot}", errors)
    bad = {name: e for name, e in errors.items() if not e <= TOL[dtype]}
    assert not bad, errors
