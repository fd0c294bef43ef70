"""fusepatch's own Triton kernels, run by Triton's CPU interpreter (TRITON_INTERPRET=1) against the fp64
reference: output and every input gradient, odd sizes, fp32 and bf16. The interpreter runs the kernel's own
code (loads, masks, math, stores) on the CPU; the GPU run (tests/gpu) checks the compiled kernel."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from helpers import run_in_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _run_in_interpreter(script: str) -> None:
    """Run ``script`` under Triton's CPU interpreter (``helpers.run_in_interpreter``: one process for this worker's
    scripts); it prints "ok" when its checks pass."""
    assert "ok" in run_in_interpreter(script)


SCRIPT = textwrap.dedent(
    """
    import torch
    from fusepatch.kernels.swiglu import swiglu
    from fusepatch.ops.common import relative_error
    from fusepatch.ops.swiglu.reference import swiglu_reference
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        for shape in ((3, 77, 301), (4097,), (1, 1, 5)):
            gate = torch.randn(shape).to(dtype).requires_grad_(True)
            up = torch.randn(shape).to(dtype).requires_grad_(True)
            out = swiglu(gate, up)
            g64, u64 = (t.detach().double().requires_grad_(True) for t in (gate, up))
            ref = swiglu_reference(g64, u64)
            cot = torch.randn_like(ref)
            grads = torch.autograd.grad(out, (gate, up), cot.to(dtype))
            ref_grads = torch.autograd.grad(ref, (g64, u64), cot)
            errors = [relative_error(out, ref)] + [relative_error(a, b) for a, b in zip(grads, ref_grads)]
            assert out.dtype == dtype and out.shape == gate.shape
            assert max(errors) < tol, (dtype, shape, errors)
    # a non-contiguous input (a chunk of a wider projection) gives the same result as its contiguous copy
    both = torch.randn(2, 9, 2 * 33)
    gate, up = both.chunk(2, dim=-1)
    assert torch.equal(swiglu(gate, up), swiglu(gate.contiguous(), up.contiguous()))
    print("ok")
    """
)


def test_swiglu_kernel_matches_the_reference_in_the_interpreter():
    _run_in_interpreter(SCRIPT)


ROTARY_SCRIPT = textwrap.dedent(
    """
    import torch
    from fusepatch.kernels.rotary import rotary
    from fusepatch.ops.common import relative_error
    from fusepatch.ops.rotary.reference import rotary_reference
    torch.manual_seed(0)
    # (batch, q heads, k heads, tokens, head dim, rotary dim, cos batch): full and partial rotary, odd sizes,
    # cos shared over the batch (1) or per row
    cases = [(2, 4, 2, 13, 64, 64, 2), (1, 3, 1, 5, 256, 64, 1), (2, 2, 2, 9, 40, 24, 2)]
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        for b, hq, hk, t, d, r, cb in cases:
            # q as the attention makes it: [b, t, h, d] viewed as [b, h, t, d] (non-contiguous)
            q = torch.randn(b, t, hq, d).to(dtype).transpose(1, 2).requires_grad_(True)
            k = torch.randn(b, t, hk, d).to(dtype).transpose(1, 2).requires_grad_(True)
            angles = torch.randn(cb, t, r // 2).repeat(1, 1, 2) * 3
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            qo, ko = rotary(q, k, cos, sin)
            leaves = [x.detach().double().requires_grad_(True) for x in (q, k)]
            rq, rk = rotary_reference(leaves[0], leaves[1], cos.double(), sin.double())
            cq, ck = torch.randn_like(rq), torch.randn_like(rk)
            grads = torch.autograd.grad((qo, ko), (q, k), (cq.to(dtype), ck.to(dtype)))
            ref_grads = torch.autograd.grad((rq, rk), leaves, (cq, ck))
            errors = [relative_error(qo, rq), relative_error(ko, rk)]
            errors += [relative_error(a, e) for a, e in zip(grads, ref_grads)]
            assert qo.dtype == dtype and qo.shape == q.shape and qo.is_contiguous()
            assert max(errors) < tol, (dtype, (b, hq, hk, t, d, r, cb), errors)
            if r < d:  # the channels past the rotary ones are copied exactly
                assert torch.equal(qo[..., r:], q[..., r:])
    print("ok")
    """
)


def test_rotary_kernel_matches_the_reference_in_the_interpreter():
    _run_in_interpreter(ROTARY_SCRIPT)


RMS_NORM_SCRIPT = textwrap.dedent(
    """
    import torch
    from fusepatch.kernels.rms_norm import rms_norm, rms_norm_zero_centered
    from fusepatch.ops.common import relative_error
    from fusepatch.ops.rms_norm.reference import rms_norm_reference, rms_norm_zero_centered_reference
    torch.manual_seed(0)
    forms = ((rms_norm, rms_norm_reference, 1.0), (rms_norm_zero_centered, rms_norm_zero_centered_reference, 0.0))
    # (x dtype, weight dtype, bound): the weight in fp32 under the activation dtype is autocast's case. The
    # interpreter truncates fp32 -> bf16 where a GPU rounds to nearest (checked: half of all casts differ), so
    # bf16 errors here are about twice the GPU's (gated bf16: 8.9e-3 here, eager bf16 2.9e-3); the GPU tests
    # hold the compiled kernel to the GPU's own bounds.
    dtypes = ((torch.float32, torch.float32, 1e-6), (torch.bfloat16, torch.bfloat16, 1.5e-2),
              (torch.bfloat16, torch.float32, 1.5e-2))
    # odd feature sizes; one row; more rows than one backward program takes (partial weight gradients summed);
    # per-head rows as the attention's q/k norms see them
    shapes = ((3, 7, 200), (1000, 5), (1, 1300), (2, 31, 4, 64))
    for fn, reference, shift in forms:
        for x_dtype, w_dtype, tol in dtypes:
            for shape in shapes:
                x = torch.randn(shape).to(x_dtype).requires_grad_(True)
                w = (0.1 * torch.randn(shape[-1]) + shift).to(w_dtype).requires_grad_(True)
                out = fn(x, w, 1e-6)
                expected = reference(x.detach(), w.detach(), 1e-6)  # the eager result's dtype and shape
                assert out.dtype == expected.dtype and out.shape == expected.shape, (out.dtype, expected.dtype)
                x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, w))
                ref = reference(x64, w64, 1e-6)
                cot = torch.randn_like(ref)
                grads = torch.autograd.grad(out, (x, w), cot.to(out.dtype))
                ref_grads = torch.autograd.grad(ref, (x64, w64), cot)
                assert grads[0].dtype == x_dtype and grads[1].dtype == w_dtype
                errors = [relative_error(out, ref)] + [relative_error(a, b) for a, b in zip(grads, ref_grads)]
                assert max(errors) < tol, (fn.__name__, x_dtype, w_dtype, shape, errors)
    # the gated form (Gated DeltaNet's output norm): output, x, gate and weight gradients
    from fusepatch.kernels.rms_norm import gated_rms_norm
    from fusepatch.ops.rms_norm.reference import gated_rms_norm_reference
    for x_dtype, w_dtype, tol in dtypes:
        for shape in ((61, 128), (1000, 5), (2, 7, 3, 64)):
            x = torch.randn(shape).to(x_dtype).requires_grad_(True)
            z = torch.randn(shape).to(x_dtype).requires_grad_(True)
            w = (1 + 0.1 * torch.randn(shape[-1])).to(w_dtype).requires_grad_(True)
            out = gated_rms_norm(x, z, w, 1e-6)
            expected = gated_rms_norm_reference(x.detach(), z.detach(), w.detach(), 1e-6)
            assert out.dtype == expected.dtype == x_dtype and out.shape == expected.shape
            leaves = [t.detach().double().requires_grad_(True) for t in (x, z, w)]
            ref = gated_rms_norm_reference(leaves[0], leaves[1], leaves[2], 1e-6)
            cot = torch.randn_like(ref)
            grads = torch.autograd.grad(out, (x, z, w), cot.to(out.dtype))
            ref_grads = torch.autograd.grad(ref, leaves, cot)
            errors = [relative_error(out, ref)] + [relative_error(a, b) for a, b in zip(grads, ref_grads)]
            assert max(errors) < tol, ("gated", x_dtype, w_dtype, shape, errors)
    # the residual add fused in (decoder layer): both outputs (normed sum, sum) and the x, residual and weight
    # gradients, with a cotangent on each output (the sum is the next residual); x and residual in the
    # activation dtype, or a bf16 x on an fp32 residual stream (the sum is fp32 then)
    from fusepatch.kernels.rms_norm import add_rms_norm, add_rms_norm_zero_centered
    from fusepatch.ops.rms_norm.reference import add_rms_norm_reference, add_rms_norm_zero_centered_reference
    add_forms = ((add_rms_norm, add_rms_norm_reference, 1.0),
                 (add_rms_norm_zero_centered, add_rms_norm_zero_centered_reference, 0.0))
    add_dtypes = ((torch.float32, torch.float32, torch.float32, 1e-6),
                  (torch.bfloat16, torch.bfloat16, torch.bfloat16, 1.5e-2),
                  (torch.bfloat16, torch.float32, torch.float32, 1.5e-2))
    for fn, reference, shift in add_forms:
        for x_dtype, r_dtype, w_dtype, tol in add_dtypes:
            for shape in ((3, 37, 200), (1000, 5), (1, 1300)):
                x = torch.randn(shape).to(x_dtype).requires_grad_(True)
                res = (4 * torch.randn(shape)).to(r_dtype).requires_grad_(True)
                w = (0.1 * torch.randn(shape[-1]) + shift).to(w_dtype).requires_grad_(True)
                out, h = fn(x, res, w, 1e-6)
                expected, expected_h = reference(x.detach(), res.detach(), w.detach(), 1e-6)
                assert (out.dtype, h.dtype) == (expected.dtype, expected_h.dtype) and out.shape == expected.shape
                if expected_h.dtype == torch.float32:  # the sum is exact where no bf16 rounding is involved
                    assert torch.equal(h, expected_h)
                leaves = [t.detach().double().requires_grad_(True) for t in (x, res, w)]
                ref, ref_h = reference(*leaves, 1e-6)
                cot, cot_h = torch.randn_like(ref), torch.randn_like(ref_h)
                grads = torch.autograd.grad((out, h), (x, res, w), (cot.to(out.dtype), cot_h.to(h.dtype)))
                ref_grads = torch.autograd.grad((ref, ref_h), leaves, (cot, cot_h))
                assert [g.dtype for g in grads] == [x_dtype, r_dtype, w_dtype]
                errors = [relative_error(out, ref), relative_error(h, ref_h)]
                errors += [relative_error(a, b) for a, b in zip(grads, ref_grads)]
                # bf16 weight gradient: the interpreter's truncating casts round the sum, the normed row and
                # the cotangent all toward zero, and the bias adds up over rows; emulated in torch over 200
                # seeds at (1000, 5) it reaches 1.9e-2 truncating against 1.0e-2 rounding as a GPU does
                bounds = [tol] * 4 + [2 * tol if w_dtype == torch.bfloat16 else tol]
                assert all(e < b for e, b in zip(errors, bounds)), (fn.__name__, x_dtype, shape, errors)
            # only the normed output used: the sum's gradient is absent, not zeros
            x = torch.randn(4, 33, requires_grad=True)
            res = torch.randn(4, 33, requires_grad=True)
            w = torch.randn(33, requires_grad=True)
            out, _ = fn(x, res, w, 1e-6)
            ref_out, _ = reference(x, res, w, 1e-6)
            got = torch.autograd.grad(out.sum(), (x, res, w))
            want = torch.autograd.grad(ref_out.sum(), (x, res, w))
            assert max(relative_error(a, b) for a, b in zip(got, want)) < 1e-5
    # a non-contiguous input (q viewed per head, then transposed) gives its contiguous copy's result
    q = torch.randn(2, 7, 3, 64).transpose(1, 2)
    w = torch.randn(64)
    assert torch.equal(rms_norm(q, w, 1e-6), rms_norm(q.contiguous(), w, 1e-6))
    # Qwen3.5's q_norm input: the query half of q_proj's output per head (rows 2 x head_dim apart) is read where
    # it lies, not copied; output and gradients as its contiguous copy's, and nothing reaches the gate half
    from fusepatch.kernels.rows import as_rows

    for fn, reference, shift in forms:
        full = torch.randn(2, 5, 3, 2 * 48, requires_grad=True)
        w = (torch.randn(48) * 0.1 + shift).requires_grad_(True)
        query = torch.chunk(full, 2, dim=-1)[0]
        assert as_rows(query, 48).data_ptr() == full.data_ptr() and as_rows(query, 48).stride(0) == 96
        out = fn(query, w, 1e-6)
        leaves = [query.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)]
        ref = reference(leaves[0], leaves[1], 1e-6)
        cot = torch.randn_like(ref)
        dfull, dw = torch.autograd.grad(out, (full, w), cot.float())
        ref_dq, ref_dw = torch.autograd.grad(ref, leaves, cot)
        dq, dgate = torch.chunk(dfull, 2, dim=-1)
        errors = [relative_error(out, ref), relative_error(dq, ref_dq), relative_error(dw, ref_dw)]
        assert max(errors) < 1e-5 and not dgate.any(), errors
    # the normed output written in place afterwards (a forward hook's ``out.mul_(1.5)``), as transformers' output
    # can be: no autograd error, and the gradients of the edited output (the add forms' sum is saved for the
    # backward, and stays unwritten)
    z, res = torch.randn(3, 5, 64), torch.randn(3, 5, 64)
    edited = {
        "plain": (rms_norm, rms_norm_reference),
        "zero-centered": (rms_norm_zero_centered, rms_norm_zero_centered_reference),
        "gated": (lambda x, w, e: gated_rms_norm(x, z, w, e), lambda x, w, e: gated_rms_norm_reference(x, z, w, e)),
        "add": (lambda x, w, e: add_rms_norm(x, res, w, e)[0], lambda x, w, e: add_rms_norm_reference(x, res, w, e)[0]),
        "add, zero-centered": (
            lambda x, w, e: add_rms_norm_zero_centered(x, res, w, e)[0],
            lambda x, w, e: add_rms_norm_zero_centered_reference(x, res, w, e)[0],
        ),
    }
    for form, (fn, reference) in edited.items():
        x = torch.randn(3, 5, 64, requires_grad=True)
        w = (1 + 0.1 * torch.randn(64)).requires_grad_(True)
        out = fn(x, w, 1e-6)
        assert not out._is_view()
        out.mul_(1.5)
        got = torch.autograd.grad(out.square().sum(), (x, w))
        ref = reference(x, w, 1e-6)
        ref.mul_(1.5)
        want = torch.autograd.grad(ref.square().sum(), (x, w))
        assert max(relative_error(a, b) for a, b in zip(got, want)) < 1e-5, form
    print("ok")
    """
)


def test_rms_norm_kernel_matches_the_reference_in_the_interpreter():
    _run_in_interpreter(RMS_NORM_SCRIPT)


LOSS_BACKWARD_SCRIPT = textwrap.dedent(
    """
    import pytest
    import torch
    from fusepatch.kernels.scale import scale_unless_one_
    from fusepatch.kernels.cross_entropy import cross_entropy_
    from fusepatch.ops.linear_cross_entropy import Gemms, _LinearCrossEntropyLoop
    from fusepatch.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
    # the kernel: scales in place by a device scalar, leaves the tensor alone when it is 1, any length
    for n in (1, 4095, 4097, 10001, 40961):  # 40961: more blocks than programs, each program strides
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(n).to(dtype)
            expected = (x.float() * 2.5).to(dtype)
            scaled = scale_unless_one_(x, torch.tensor(2.5))
            if dtype == torch.float32:
                assert torch.equal(scaled, expected)
            else:  # the interpreter's fp32 -> bf16 cast truncates where the GPU (and torch) round
                torch.testing.assert_close(scaled, expected, rtol=8e-3, atol=0)
            before = x.clone()
            assert torch.equal(scale_unless_one_(x, torch.tensor(1.0)), before)

    # fusepatch's chunk loop (3 chunks of 16 tokens) around its own cross-entropy kernel
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    labels[::5] = -100
    count = (labels != -100).sum().float()

    def loss_fn():
        return _LinearCrossEntropyLoop.apply(hidden, weight, labels, count, -100, 16, cross_entropy_, True, Gemms)

    for scale in (1.0, 3.0):  # the loss's gradient 1 (plain training: skipped) or not (averaged, scaled)
        loss = loss_fn()
        got = torch.autograd.grad(loss * scale, (hidden, weight))
        ref = linear_cross_entropy_reference(hidden, weight, labels)
        want = torch.autograd.grad(ref * scale, (hidden, weight))
        torch.testing.assert_close(loss, ref.detach())
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    # nothing labelled: the loss 0 / 0 = NaN as transformers' mean over no tokens, every gradient 0 (the kernel
    # zeroes the ignored rows' gradients, never multiplies them by 1 / 0)
    ignored = torch.full_like(labels, -100)
    none = (ignored != -100).sum().float()
    empty = _LinearCrossEntropyLoop.apply(hidden, weight, ignored, none, -100, 16, cross_entropy_, True, Gemms)
    gh, gw = torch.autograd.grad(empty, (hidden, weight))
    assert empty.isnan() and not gh.any() and not gw.any()
    loss = loss_fn()
    torch.autograd.grad(loss * 2, (hidden, weight), retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        torch.autograd.grad(loss * 2, (hidden, weight))
    print("ok")
    """
)


def test_fused_loss_backward_scales_the_stored_gradients_in_the_interpreter():
    _run_in_interpreter(LOSS_BACKWARD_SCRIPT)


CROSS_ENTROPY_SCRIPT = textwrap.dedent(
    """
    import torch
    from fusepatch.kernels.cross_entropy import BLOCK, cross_entropy_
    from fusepatch.ops.common import relative_error

    torch.manual_seed(0)
    # vocabularies under one block, one past a block, several blocks with a ragged last one; rows of ignored
    # labels; logits with a large offset (the running maximum must keep exp in range); fp32 and bf16
    for vocab in (50, BLOCK + 1, 2 * BLOCK + 777):
        # fp32: the log-sum-exp of logits near 200 carries fp32 rounding (~1e-5) into every probability
        for dtype, tol in ((torch.float32, 3e-5), (torch.bfloat16, 1e-2)):
            logits = (torch.randn(7, vocab) * 4 + torch.arange(7)[:, None] * 30.0).to(dtype)
            target = torch.randint(0, vocab, (7,))
            target[2] = -100
            target[4] = vocab - 1  # the last column, in the ragged block
            wide = logits.double()
            lse = wide.logsumexp(-1)
            picked = wide.gather(1, target.clamp_min(0)[:, None]).squeeze(1)
            valid = target != -100
            want_loss = torch.where(valid, lse - picked, 0.0)
            inverse = torch.tensor([1 / 6])
            want_grad = (wide - lse[:, None]).exp()
            want_grad[torch.arange(7), target.clamp_min(0)] -= 1.0
            want_grad *= torch.where(valid, 1 / 6, 0.0)[:, None]
            loss = cross_entropy_(logits.clone(), target, inverse, -100, False)
            assert loss.dtype == torch.float32 and relative_error(loss, want_loss) < 1e-6, (vocab, dtype)
            grad = logits.clone()
            loss = cross_entropy_(grad, target, inverse, -100, True)
            assert relative_error(loss, want_loss) < 1e-6, (vocab, dtype)
            assert grad.dtype == dtype and relative_error(grad, want_grad) < tol, (vocab, dtype)
            assert grad[2].abs().sum() == 0  # an ignored row: zero gradient
    print("ok")
    """
)


def test_cross_entropy_kernel_matches_the_reference_in_the_interpreter():
    _run_in_interpreter(CROSS_ENTROPY_SCRIPT)


SPLIT_SCRIPT = textwrap.dedent(
    """
    import pytest
    import torch
    from fusepatch.kernels.split import split3

    torch.manual_seed(0)
    # (leading shape, sizes): the Gated DeltaNet's q/k/v widths, odd widths that straddle column blocks, one row
    for lead, sizes in (((2, 37), (256, 256, 512)), ((1, 9), (3, 300, 5)), ((1,), (1, 1, 1)), ((3, 5), (0, 7, 9))):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(*lead, sum(sizes)).to(dtype)
            got = split3(x, list(sizes))
            for part, want in zip(got, torch.split(x, list(sizes), dim=-1)):
                assert part.is_contiguous() and torch.equal(part, want)
    # rows any stride apart (a column slice of a wider tensor), columns contiguous
    wide = torch.randn(4, 6, 40)
    for part, want in zip(split3(wide[..., 5:35], [10, 10, 10]), torch.split(wide[..., 5:35], [10, 10, 10], dim=-1)):
        assert torch.equal(part, want)
    with pytest.raises(ValueError, match="three sizes"):
        split3(wide, [10, 10])
    print("ok")
    """
)


def test_split3_copies_each_part_contiguous_in_the_interpreter():
    _run_in_interpreter(SPLIT_SCRIPT)


L2NORM_SCRIPT = textwrap.dedent(
    """
    import torch
    from fusepatch.kernels.l2norm import l2norm_bwd_grouped
    from fusepatch.ops.common import relative_error

    torch.manual_seed(0)
    # (batch, tokens, key heads, value heads per key head, head size): grouped 3, none, odd sizes
    for b, t, hk, g, k in ((1, 37, 2, 3, 64), (2, 5, 3, 1, 40), (1, 3, 1, 2, 7)):
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
            x = torch.randn(b, t, hk, k, dtype=torch.float64, requires_grad=True)
            y = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
            rstd = torch.rsqrt((x.detach() ** 2).sum(-1) + 1e-6).float()
            grad, extra = torch.randn(b, t, hk * g, k, dtype=torch.float64), torch.randn(b, t, hk * g, k, dtype=torch.float64)
            for second in (None, extra):
                total = grad if second is None else grad + second
                want, = torch.autograd.grad(y, x, total.view(b, t, hk, g, k).sum(3), retain_graph=True)
                got = l2norm_bwd_grouped(y.detach().to(dtype), rstd, grad.to(dtype), None if second is None else second.to(dtype))
                assert got.dtype == dtype and got.shape == x.shape
                assert relative_error(got, want) < tol, (b, t, hk, g, k, dtype, relative_error(got, want))
    try:
        l2norm_bwd_grouped(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3), torch.zeros(1, 2, 4, 8))
    except ValueError as exc:
        assert "does not group" in str(exc)
    else:
        raise AssertionError("4 value heads onto 3 key heads was accepted")
    print("ok")
    """
)


def test_grouped_l2norm_backward_matches_autograd_in_the_interpreter():
    """The Gated DeltaNet's q/k L2-norm backward with the sum over grouped value heads (and a second gradient)
    folded in, against autograd through the L2 norm in fp64."""
    _run_in_interpreter(L2NORM_SCRIPT)


DELTA_INPUTS_SCRIPT = textwrap.dedent(
    """
    import math
    import torch
    import torch.nn.functional as F
    from fusepatch.kernels.delta_rule_inputs import delta_rule_inputs, delta_rule_inputs_bwd
    from fusepatch.ops.common import relative_error

    torch.manual_seed(0)

    def table(bounds):
        rows = [(n, c) for n in range(len(bounds) - 1) for c in range(math.ceil((bounds[n + 1] - bounds[n]) / 64))]
        return torch.tensor(rows, dtype=torch.int32)

    def chunk_cumsum(x, bounds):  # [B, T, H]: summed within 64-token chunks of each document
        out = torch.empty_like(x)
        for start, end in zip(bounds[:-1], bounds[1:]):
            for c in range(start, end, 64):
                out[:, c:min(c + 64, end)] = x[:, c:min(c + 64, end)].cumsum(1)
        return out

    def reference(q, k, a, b, A_log, dt_bias, bounds, scale):
        norm = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        gate = -A_log.exp() * F.softplus(a + dt_bias)
        return norm(q), norm(k), torch.sigmoid(b), chunk_cumsum(gate, bounds) * scale

    # (batch, tokens, key heads, value heads a key head, head dim, packed boundaries)
    cases = [(2, 77, 2, 3, 40, None), (1, 150, 1, 2, 32, [0, 1, 65, 150]), (1, 64, 3, 1, 16, None)]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for batch, length, hk, groups, dim, bounds in cases:
            hv = hk * groups
            q, k = torch.randn(batch, length, hk, dim), torch.randn(batch, length, hk, dim) * 3
            a, b = torch.randn(batch, length, hv) * 4, torch.randn(batch, length, hv) * 3
            a[..., 0] += 30  # the softplus above its threshold
            A_log, dt_bias = torch.empty(hv).uniform_(1, 16).log(), torch.randn(hv)
            x = [t.to(dtype) for t in (q, k, a, b, A_log, dt_bias)]
            places = {}
            if bounds:
                places = dict(cu_seqlens=torch.tensor(bounds, dtype=torch.int32), chunk_indices=table(bounds))
            q_n, q_rstd, k_n, k_rstd, beta, g = delta_rule_inputs(*x, scale=1.4426950216, **places)
            x64 = [t.double().requires_grad_(True) for t in x]
            want = reference(*x64, bounds or [0, length], 1.4426950216)
            for got, ref in zip((q_n, k_n, beta, g), want):
                assert relative_error(got, ref) < tol, (dtype, batch, length, relative_error(got, ref))
            assert q_n.dtype == dtype and q_rstd.dtype == beta.dtype == g.dtype == torch.float32
            for rstd, t in ((q_rstd, x64[0]), (k_rstd, x64[1])):
                assert relative_error(rstd, torch.rsqrt((t.detach() ** 2).sum(-1) + 1e-6)) < 1e-5

            # backward: fla's kernels give g's gradient unscaled, as two parts, and beta's
            dg, dg2, dbeta = (torch.randn(batch, length, hv) for _ in range(3))
            da, db, dA_log, ddt_bias = delta_rule_inputs_bwd(
                x[2], x[3], x[4], x[5], dg, dg2, dbeta, hk, **places
            )
            gate = -x64[4].exp() * F.softplus(x64[2] + x64[5])
            loss = (chunk_cumsum(gate, bounds or [0, length]) * (dg + dg2).double()).sum()
            loss = loss + (torch.sigmoid(x64[3]) * dbeta.double()).sum()
            refs = torch.autograd.grad(loss, x64[2:])
            for name, got, ref in zip(("da", "db", "dA_log", "ddt_bias"), (da, db, dA_log, ddt_bias), refs):
                assert got.dtype == dtype and got.shape == ref.shape, name
                assert relative_error(got, ref) < tol, (name, dtype, batch, length, relative_error(got, ref))
    print("ok")
    """
)


def test_delta_rule_inputs_match_the_reference_in_the_interpreter():
    """The Gated DeltaNet's per-token inputs in one kernel each way (q/k L2 norms with rstd, beta, the chunk-summed
    decay; and their gradients) against fp64 torch: dense rows with odd sizes and grouped value heads, packed rows
    with a one-token document, one value head a key head, the softplus above its threshold."""
    _run_in_interpreter(DELTA_INPUTS_SCRIPT)


REPEAT_HEADS_SCRIPT = textwrap.dedent(
    """
    import torch
    from fusepatch.kernels.heads import repeat_heads

    torch.manual_seed(0)
    # (shape, groups): the 27B delta rule's q/k heads (16 -> 48), attention's k/v (4 -> 24), odd sizes, a head
    # dim that is no power of two, one group (a plain copy), a non-contiguous input
    cases = [((2, 5, 4, 128), 3), ((7, 4, 256), 6), ((3, 1, 2, 40), 5), ((1, 3, 2, 8), 1), ((1,1), 4)]
    for dtype in (torch.float32, torch.bfloat16):
        for shape, groups in cases:
            x = torch.randn(shape).to(dtype)
            out = repeat_heads(x, groups)
            assert out.is_contiguous() and out.dtype == dtype
            assert torch.equal(out, x.repeat_interleave(groups, dim=-2)), (shape, groups)
    x = torch.randn(6, 5, 3, 16).transpose(0, 1)
    assert torch.equal(repeat_heads(x, 2), x.repeat_interleave(2, dim=-2))
    assert repeat_heads(torch.randn(0, 2, 8), 3).shape == (0, 6, 8)
    for bad, groups in ((torch.randn(4), 2), (torch.randn(2, 3), 0)):
        try:
            repeat_heads(bad, groups)
        except ValueError as err:
            assert "repeat_heads" in str(err)
        else:
            raise AssertionError(f"no error for {tuple(bad.shape)}, groups {groups}")
    print("ok")
    """
)


def test_repeat_heads_equals_repeat_interleave_in_the_interpreter():
    _run_in_interpreter(REPEAT_HEADS_SCRIPT)


GATE_SCRIPT = textwrap.dedent(
    """
    import torch
    from fusepatch.kernels.gate import sigmoid_gate
    from fusepatch.ops.common import relative_error
    from fusepatch.ops.attention_gate.reference import attention_gate_reference
    torch.manual_seed(0)
    # (batch, tokens, heads, head dim): a power-of-two head dim, an odd one, one token
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        for b, t, h, d in ((2, 37, 3, 64), (1, 5, 4, 40), (1, 1, 2, 256)):
            # the gate as the attention makes it: the second half of each head's [2 x head dim] projection
            joint = (torch.randn(b, t, h, 2 * d) * 2).to(dtype).requires_grad_(True)
            query, gate = torch.chunk(joint, 2, dim=-1)
            assert not gate.is_contiguous()
            attn = torch.randn(b, t, h * d).to(dtype).requires_grad_(True)
            out = sigmoid_gate(attn, gate)
            j64, a64 = (x.detach().double().requires_grad_(True) for x in (joint, attn))
            ref = attention_gate_reference(a64, torch.chunk(j64, 2, dim=-1)[1])
            cot = torch.randn_like(ref)
            grads = torch.autograd.grad(out, (attn, joint), cot.to(dtype))
            ref_grads = torch.autograd.grad(ref, (a64, j64), cot)
            errors = [relative_error(out, ref)] + [relative_error(x, y) for x, y in zip(grads, ref_grads)]
            assert out.dtype == dtype and out.shape == attn.shape
            assert max(errors) < tol, (dtype, (b, t, h, d), errors)
            # the query half gets no gradient from the gate
            assert grads[1][..., :d].abs().max() == 0
            # a contiguous gate gives the same result as the strided one
            assert torch.equal(sigmoid_gate(attn, gate.contiguous()), out)
    try:
        sigmoid_gate(torch.randn(2, 3, 8), torch.randn(2, 3, 2, 4).bfloat16())
    except ValueError as exc:
        assert "do not pair" in str(exc)
    else:
        raise AssertionError("mixed dtypes were accepted")
    print("ok")
    """
)


def test_attention_gate_kernel_matches_the_reference_in_the_interpreter():
    _run_in_interpreter(GATE_SCRIPT)


MOE_SWIGLU_SCRIPT = textwrap.dedent(
    """
    import torch
    from helpers import errors_against_fp64

    from fusepatch.kernels.moe_swiglu import weighted_swiglu
    from fusepatch.ops.common import relative_error
    from fusepatch.ops.moe_experts import _load_triton
    from fusepatch.ops.moe_experts.reference import moe_experts_reference, weighted_swiglu_reference
    torch.manual_seed(0)
    # odd widths; 4100 columns take two steps of the kernel's column loop
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        for rows, inter in ((37, 33), (5, 4100), (1, 1)):
            gate_up = torch.randn(rows, 2 * inter).to(dtype).requires_grad_(True)
            weight = torch.rand(rows).to(dtype).requires_grad_(True)
            out = weighted_swiglu(gate_up, weight)
            leaves = [t.detach().double().requires_grad_(True) for t in (gate_up, weight)]
            ref = weighted_swiglu_reference(*leaves)
            cot = torch.randn_like(ref)
            grads = torch.autograd.grad(out, (gate_up, weight), cot.to(dtype))
            ref_grads = torch.autograd.grad(ref, leaves, cot)
            errors = [relative_error(out, ref)] + [relative_error(a, b) for a, b in zip(grads, ref_grads)]
            assert out.dtype == dtype and out.shape == (rows, inter) and grads[1].dtype == dtype
            assert grads[0].is_contiguous() and grads[0].shape == gate_up.shape
            assert max(errors) < tol, (dtype, rows, inter, errors)
            again = torch.autograd.grad(weighted_swiglu(gate_up, weight), (gate_up, weight), cot.to(dtype))
            assert all(torch.equal(a, b) for a, b in zip(grads, again))  # no atomics: the same bits
    # the whole op through the kernel (torch's CPU grouped_mm), a dropped slot and a token whose every slot is
    # dropped with a NaN row among them, against the loop over experts
    experts, tokens, hidden, inter = 6, 41, 24, 16
    h = torch.randn(tokens, hidden)
    index = torch.stack([torch.randperm(experts)[:2] for _ in range(tokens)])
    index[3, 0] = experts
    index[5] = experts
    h[5] = float("nan")
    args = [h, index, torch.rand(tokens, 2).softmax(-1), torch.randn(experts, 2 * inter, hidden) * hidden**-0.5,
            torch.randn(experts, hidden, inter) * inter**-0.5]
    errors = errors_against_fp64(_load_triton(), moe_experts_reference, args, torch.float32)
    assert max(errors.values()) < 1e-5, errors
    print("ok")
    """
)


def test_moe_weighted_swiglu_kernel_matches_the_reference_in_the_interpreter():
    _run_in_interpreter(MOE_SWIGLU_SCRIPT)


FP8_SCRIPT = textwrap.dedent(
    """
    import torch
    from fusepatch.kernels.fp8 import quantize_columns, quantize_rows, transpose
    from fusepatch.ops.fp8_linear.scaled_mm import (
        quantize_columns_reference, quantize_rows_reference, transpose_reference)
    torch.manual_seed(0)

    def same_scales(a, b):  # NaN and infinity where the twin has them, every other scale equal
        return torch.equal(a.nan_to_num(nan=-1.0, posinf=-2.0), b.nan_to_num(nan=-1.0, posinf=-2.0))

    def same_bits(a, b):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def exact(rows, columns, dtype):
        # values FP8 holds exactly at any power-of-two scale here (3 mantissa bits, exponents within 2^7 of each
        # other): the interpreter's own cast to FP8 rounds otherwise than the GPU's, so only values that need no
        # rounding compare bit for bit, and they check the layout, the padding and the scaling
        mantissa = torch.randint(8, 16, (rows, columns)) / 8
        sign = torch.randint(0, 2, (rows, columns)) * 2 - 1
        return (sign * mantissa * 2.0 ** torch.randint(-3, 4, (rows, columns))).to(dtype)

    for dtype in (torch.float32, torch.bfloat16):
        x = exact(150, 130, dtype)
        for multiple in (1, 16):
            q, inverse = quantize_columns(x, multiple)
            qr, inverse_r = quantize_columns_reference(x, multiple)
            assert q.shape == qr.shape and same_bits(q, qr) and torch.equal(inverse, inverse_r), (dtype, multiple)
        strided = exact(300, 200, dtype)[:, 10:140]  # a view of a wider tensor
        q, inverse = quantize_columns(strided, 16)
        qr, inverse_r = quantize_columns_reference(strided, 16)
        assert same_bits(q, qr) and torch.equal(inverse, inverse_r), dtype
        q, inverse = quantize_rows(x)
        qr, inverse_r = quantize_rows_reference(x)
        assert same_bits(q, qr) and torch.equal(inverse, inverse_r), dtype
        # scales of any values: a NaN of either sign in any row tile, infinities, signed zeros, wide magnitudes
        y = (torch.randn(150, 130) * torch.logspace(-3, 3, 130)).to(dtype)
        y[7, 3], y[100, 129] = float("nan"), -float("nan")
        y[0, 64], y[149, 65] = float("inf"), -float("inf")
        y[:, 5], y[:, 6] = -0.0, 0.0
        assert same_scales(quantize_columns(y, 16)[1], quantize_columns_reference(y, 16)[1]), dtype
        assert same_scales(quantize_rows(y.t().contiguous())[1], quantize_rows_reference(y.t().contiguous())[1])
    q, _ = quantize_rows_reference(torch.randn(70, 150))
    assert same_bits(transpose(q), transpose_reference(q))
    q, inverse = quantize_columns(torch.randn(0, 70), 16)  # no tokens: no values, finite scales
    assert q.shape == (70, 0) and bool(inverse.isfinite().all())
    print("ok")
    """
)


def test_fp8_quantization_kernels_give_the_twins_results_in_the_interpreter():
    """The FP8 kernels (rows, columns transposed and padded, the FP8 transpose) against their PyTorch twins: the
    same bits on values FP8 holds exactly, and on any values the same scales (a NaN of either sign in any row tile
    makes its column's scale NaN, as in the twin). tests/gpu/test_fp8.py checks the GPU's bits on any values."""
    _run_in_interpreter(FP8_SCRIPT)


FP8_CHECK_SCRIPT = textwrap.dedent(
    """
    import torch
    from fusepatch.kernels.fingerprint import fingerprint
    from fusepatch.kernels.fingerprint_spec import DONE, HELD, STALE, STATE_WORDS, SUMS
    from fusepatch.kernels.fp8 import quantize_rows, requantize_rows
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_rows_reference
    from fusepatch.kernels.fingerprint_spec import fingerprint_reference
    torch.manual_seed(0)

    def held(state):  # the fingerprint the state holds, as the twin gives it
        return state[HELD : HELD + 2].to(torch.int64) & 0xFFFFFFFF

    def left_clean(state):  # the sums and the count zeroed for the next call (and for a graph's next replay)
        return bool((state[SUMS : DONE + 1] == 0).all())

    # one program, several, and the last one partial; bf16 (two values a word) and fp32
    for dtype, shape in ((torch.bfloat16, (48, 80)), (torch.float32, (33, 64)), (torch.float32, (2056, 16))):
        x = torch.randn(shape).to(dtype)
        state = torch.zeros(STATE_WORDS, dtype=torch.int32)
        fingerprint(x, state)
        assert torch.equal(held(state), fingerprint_reference(x)) and left_clean(state), (dtype, shape)
        fingerprint(x, state)
        assert state[STALE] == 0 and torch.equal(held(state), fingerprint_reference(x)), (dtype, shape)
        changed = x.clone()
        changed.view(-1)[-1] += 1  # one value, in the last word
        fingerprint(changed, state)
        assert state[STALE] == 1 and torch.equal(held(state), fingerprint_reference(changed)), (dtype, shape)
        assert left_clean(state)
    swapped = x.clone()
    swapped[0, 0], swapped[5, 7] = x[5, 7], x[0, 0]
    assert not torch.equal(fingerprint_reference(swapped), fingerprint_reference(x))  # positions count
    # the kept copy's write: nothing while the check found the weight as it was, its quantization once it changed
    x = torch.randn(40, 96).to(torch.bfloat16)
    q, inverse = quantize_rows(x)
    before = q.clone(), inverse.clone()
    state = torch.zeros(STATE_WORDS, dtype=torch.int32)
    fingerprint(x, state)
    fingerprint(x, state)
    requantize_rows(x * 4, q, inverse, state[STALE:])  # (the check did not see x * 4: nothing written)
    assert torch.equal(q.view(torch.uint8), before[0].view(torch.uint8)) and torch.equal(inverse, before[1])
    fingerprint(x * 4, state)
    requantize_rows(x * 4, q, inverse, state[STALE:])
    fresh, fresh_inverse = quantize_rows(x * 4)  # (the interpreter rounds to FP8 its own way: its kernel's bits)
    assert torch.equal(inverse, fresh_inverse) and torch.equal(q.view(torch.uint8), fresh.view(torch.uint8))
    assert torch.equal(inverse, quantize_rows_reference(x * 4)[1])
    print("ok")
    """
)


def test_fp8_copy_check_gives_the_twins_fingerprint_and_writes_only_when_stale_in_the_interpreter():
    """A kept FP8 copy's check (``fingerprint``: every word, positions mixed in, compared on the device) gives the
    fingerprint of its PyTorch twin, flags exactly a changed weight and leaves its state ready for the next call;
    ``requantize_rows`` writes the copy only when flagged. tests/gpu/test_fp8.py checks the compiled kernels."""
    _run_in_interpreter(FP8_CHECK_SCRIPT)
