"""FP8 rows carried from their producer to the FP8 projections (``kernels/fp8_rows``), on the CPU: the FP8 function
as the op's kernel (``cpu_candidates``, its PyTorch twins quantizing), the producers (RMSNorm, add-RMSNorm, SwiGLU)
as stand-ins that write the rows as the Triton kernels do (``quantize_rows_reference`` of their rounded output,
tests/kernels checks the kernels' bits). The model's logits, loss and every gradient are the same bits as the FP8
path that quantizes every input itself, with fewer quantizations; a tensor written in place after its rows were
made is quantized afresh."""

from __future__ import annotations

import pytest
import torch
from helpers import cpu_candidates

import fusepatch
from fusepatch.kernels import fp8_rows
from fusepatch.ops import OPS
from fusepatch.ops.fp8_linear import scaled_mm
from fusepatch.tools.tiny import tiny_model

QUANTIZE_ROWS = scaled_mm.quantize_rows_reference  # the producers' (not counted: the projections' are)
PRODUCERS = ("rms_norm", "rms_norm_zero_centered", "add_rms_norm", "add_rms_norm_zero_centered", "swiglu")


EMIT = {"rows": False}  # whether the producers' stand-ins write rows where a frame asks (switched between steps)


def _emitting(reference):
    """``reference`` writing the FP8 rows of its (first) output where a frame asks, as the Triton kernels do."""

    def producer(*args):
        out = reference(*args)
        y = out[0] if isinstance(out, tuple) else out
        if EMIT["rows"] and fp8_rows.emitting() and y.dtype == torch.bfloat16 and y.shape[-1] % 16 == 0:
            fp8_rows.record(y, QUANTIZE_ROWS(y.detach().reshape(-1, y.shape[-1])))
        return out

    return producer


class _SwiGLU(torch.autograd.Function):
    """The SwiGLU reference, its backward writing both gradients' rows where the forward's frame asked, as the
    Triton kernel does (``record_gradient``)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        ctx.rows = EMIT["rows"] and fp8_rows.emitting_gradients()
        with torch.no_grad():
            return OPS["swiglu"].reference(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(True) for t in (gate, up)]
            grads = torch.autograd.grad(OPS["swiglu"].reference(*inputs), inputs, grad)
        if ctx.rows:
            for each in grads:
                fp8_rows.record_gradient(each, QUANTIZE_ROWS(each.reshape(-1, each.shape[-1])))
        return grads


class _AddNorm(torch.autograd.Function):
    """An add-RMSNorm reference, its backward writing the rows of the summand's gradient (the mixer's output
    projection's output gradient) where the forward's frame asked, as the Triton kernel does."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, reference):
        ctx.save_for_backward(x, residual, weight)
        ctx.eps, ctx.reference = eps, reference
        ctx.rows = EMIT["rows"] and fp8_rows.emitting_gradients()
        with torch.no_grad():
            return reference(x, residual, weight, eps)

    @staticmethod
    def backward(ctx, grad, grad_h):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
            outs = ctx.reference(*inputs[:2], inputs[2], ctx.eps)
            pairs = [(o, g) for o, g in zip(outs, (grad, grad_h)) if g is not None]
            grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs])
        if ctx.rows:
            fp8_rows.record_gradient(grads[0], QUANTIZE_ROWS(grads[0].reshape(-1, grads[0].shape[-1])))
        return *grads, None, None


def _add_norm(reference):
    return lambda x, residual, weight, eps: _AddNorm.apply(x, residual, weight, eps, reference)


def _fp8_model(model_type: str, monkeypatch, **sizes):
    """A tiny bf16 model with FP8 projections, its producers' stand-ins able to write rows; the batch; the list of
    the shapes of every by-rows quantization of an activation from now on."""
    cpu_candidates(monkeypatch, {"fp8_linear": scaled_mm.fp8_linear})
    producers = {name: _emitting(OPS[name].reference) for name in PRODUCERS}
    producers["swiglu"] = _emitting(_SwiGLU.apply)
    for name in ("add_rms_norm", "add_rms_norm_zero_centered"):
        producers[name] = _emitting(_add_norm(OPS[name].reference))
    cpu_candidates(monkeypatch, producers, name="emitting")
    model = tiny_model(model_type, hidden_size=64, intermediate_size=128, **sizes).to(torch.bfloat16).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    fusepatch.apply(model, precision="fp8", verbose=False)
    seen: list = []
    rows = scaled_mm.quantize_rows_reference

    def counted(x, factor=None):
        seen.append(tuple(x.shape))
        return rows(x, factor)

    monkeypatch.setattr(scaled_mm, "quantize_rows_reference", counted)
    return model, ids, seen


def _step(model, ids, monkeypatch, seen: list, *, rows: bool, sharing: bool = True):
    """One step's logits, loss and gradients, and how many activations it quantized by rows."""
    EMIT["rows"] = rows
    seen.clear()
    with monkeypatch.context() as patch:
        if not sharing:  # each projection quantizes its input itself, as without frames
            patch.setattr(fp8_rows, "sharing", lambda: False)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, use_cache=False)
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
    EMIT["rows"] = False
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (out.logits.detach(), loss.detach(), grads), len(seen)


def _same(a, b) -> None:
    (logits, loss, grads), (logits_b, loss_b, grads_b) = a, b
    assert torch.equal(logits, logits_b) and torch.equal(loss, loss_b)
    assert grads.keys() == grads_b.keys()
    assert all(torch.equal(grads[n], grads_b[n]) for n in grads), [
        n for n in grads if not torch.equal(grads[n], grads_b[n])
    ]


SIZES = {  # a Gated DeltaNet layer and an attention layer
    "qwen3": {"num_hidden_layers": 1},
    "qwen3_5_text": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
}


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_carried_rows_give_the_bits_of_quantizing_every_input(model_type, stand_ins, monkeypatch):
    model, ids, seen = _fp8_model(model_type, monkeypatch, **SIZES[model_type])
    alone, each = _step(model, ids, monkeypatch, seen, rows=False, sharing=False)
    shared, once = _step(model, ids, monkeypatch, seen, rows=False)
    fused, fewer = _step(model, ids, monkeypatch, seen, rows=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    recomputed, _ = _step(model, ids, monkeypatch, seen, rows=True)
    _same(alone, shared)
    _same(alone, fused)
    _same(alone, recomputed)
    # one input, several projections: q/k/v (or the Gated DeltaNet's in_proj_qkv/z) and gate/up quantize it once
    assert once < each, (once, each)
    # the norms' and the SwiGLU's rows: the mixer's inputs, gate/up and down_proj are not quantized at all, nor
    # gate_proj's, up_proj's and the mixer's output projection's output gradients for their input gradients
    assert fewer <= once - 6 * model.config.num_hidden_layers, (fewer, once)


def test_an_activation_written_after_its_rows_were_made_is_quantized_again(stand_ins, monkeypatch):
    """A forward hook on the input norm writes its output in place (after the producer made its FP8 rows): the
    projections must not read the stale rows. The same hook over the path without carried rows gives the same bits."""
    model, ids, seen = _fp8_model("qwen3", monkeypatch, num_hidden_layers=1)
    model.model.layers[0].input_layernorm.register_forward_hook(lambda module, args, out: out.mul_(1.5))
    alone, _ = _step(model, ids, monkeypatch, seen, rows=False, sharing=False)
    fused, _ = _step(model, ids, monkeypatch, seen, rows=True)
    _same(alone, fused)


def test_a_record_names_one_tensor_in_one_state():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    rows = scaled_mm.quantize_rows_reference(x)
    assert fp8_rows.carried(x) is None
    with fp8_rows.frame() as frame:
        fp8_rows.record(x, rows)  # outside ``emitting``: the record is the caller's to make
        assert fp8_rows.carried(x).rows.q is rows[0]
        assert fp8_rows.carried(x.view(4, 32)) is None  # another tensor object, even over the same storage
        x.view(-1)[0] = 3.0  # a write through a view: the version counter is shared
        assert fp8_rows.carried(x) is None
        with frame.emitting():
            assert fp8_rows.emitting() and not fp8_rows.sharing()
            with fp8_rows.frame(share=True):
                assert fp8_rows.sharing() and not fp8_rows.emitting()
        assert not fp8_rows.emitting()
    y = torch.randn(4, 32, dtype=torch.bfloat16)
    with fp8_rows.frame():
        fp8_rows.record(y, rows)
    assert fp8_rows.carried(y) is None  # gone with its frame


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_decoder_frames_are_opened_only_where_an_fp8_projection_reads_them(model_type, stand_ins, monkeypatch):
    """A frame costs the host microseconds a layer: a bf16 model's decoder layers open none, an FP8 model's two each
    forward (the input norm's, the MLP's)."""
    opened: list[bool] = []
    real = fp8_rows.frame

    def counted(share: bool = False):
        opened.append(share)
        return real(share)

    monkeypatch.setattr(fp8_rows, "frame", counted)
    model = tiny_model(model_type, hidden_size=64, intermediate_size=128, **SIZES[model_type]).to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    report = fusepatch.apply(model, verbose=False)
    assert any(layer.patched for layer in report.layers)
    model(input_ids=ids, use_cache=False).logits.float().sum().backward()
    assert opened.count(False) == 0
    model, ids, seen = _fp8_model(model_type, monkeypatch, **SIZES[model_type])
    opened.clear()
    _step(model, ids, monkeypatch, seen, rows=True)
    assert opened.count(False) == 2 * model.config.num_hidden_layers
