"""linear_cross_entropy: lm_head matmul + cross-entropy without materialising the ``tokens x vocab`` logits.

Op signature::

    loss = linear_cross_entropy(hidden [N, H], weight [V, H], labels [N], ignore_index=-100, num_items_in_batch=None)

The loss is the sum over the tokens whose label is not ``ignore_index``, divided by ``num_items_in_batch``
when given (the Trainer's gradient-accumulation normaliser) and by their count otherwise: transformers'
``ForCausalLMLoss`` after its label shift. With no label to count it is NaN (0 / 0), as transformers' mean over
no tokens is, and every gradient is 0 (the ignored rows' gradients are zeros, never 0 times 1 / 0).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fusepatch.backends.fla import CROSS_ENTROPY, check_signatures
from fusepatch.base.op import Candidate, Op, SelfTest
from fusepatch.base.options import DEFAULT_LOGITS_MIB, positive_whole
from fusepatch.base.requirements import InputRule, TorchVersion
from fusepatch.ops.common import fla_candidate, on_device, own_triton_candidate, rand
from fusepatch.ops.linear_cross_entropy.reference import (
    _denominator,
    _upcast,
    check_rows,
    linear_cross_entropy_reference,
)

CHUNK_ELEMENTS = 2**27  # logits per chunk: 128 M fp32 values (512 MiB) whatever the vocabulary


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients chunk by chunk in the forward pass (the logits of one chunk live at a time);
    the backward pass only scales the stored gradients by the incoming one."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, denominator, chunk):
        # each gradient only when asked for: a frozen lm_head (LoRA) takes no weight GEMM and no vocab x hidden buffer
        wants_hidden, wants_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        needs_grad = wants_hidden or wants_weight
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=accumulate) if wants_weight else None
        total = torch.zeros((), device=hidden.device, dtype=torch.promote_types(hidden.dtype, torch.float32))
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            y = labels[start : start + chunk]
            logits = _upcast(h @ weight.t())
            lse = torch.logsumexp(logits, dim=-1)
            valid = y != ignore_index
            column = y.masked_fill(~valid, 0)  # an ignored label, whatever ignore_index is, read as 0
            target = logits.gather(1, column[:, None]).squeeze(1)
            total += torch.where(valid, lse - target, 0.0).sum()
            if needs_grad:
                probs = torch.exp(logits - lse[:, None])
                probs[torch.arange(len(y), device=y.device), column] -= 1.0
                # ignored rows: 0, not 0 / 0 when no label counts (the loss is NaN then, its gradients 0)
                probs *= torch.where(valid, denominator.to(probs.dtype).reciprocal(), 0.0)[:, None]
                g = probs.to(hidden.dtype)
                if wants_hidden:
                    grad_hidden[start : start + chunk] = g @ weight
                if wants_weight:
                    grad_weight += (g.t() @ h).to(accumulate)
                del probs, g
            del logits  # before the next chunk's logits are made: one chunk's at a time
        if needs_grad:
            ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return total / denominator

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            None if grad_hidden is None else grad_hidden * grad_output.to(grad_hidden.dtype),
            None if grad_weight is None else grad_weight * grad_output.to(grad_weight.dtype),
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy_chunked(hidden, weight, labels, ignore_index: int = -100, num_items_in_batch=None):
    check_rows(hidden, labels)
    chunk = max(1, min(hidden.shape[0], CHUNK_ELEMENTS // weight.shape[0]))
    denominator = _denominator(labels, ignore_index, num_items_in_batch)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, denominator, chunk)


def fla_chunk_budget() -> int:
    """``FUSEPATCH_CE_LOGITS_MIB`` (default 1024): the most memory one chunk's logits may take in the fused loss's
    chunk loop (one chunk's logits live at a time). fla's own function splits the tokens into 8 chunks whatever
    their number (512 tokens at seq 4096): each chunk re-reads and re-writes the whole lm_head weight gradient (2.5
    GB at Qwen3.5's 248k x 5120 in bf16) and runs GEMMs with a 512-long inner dimension. Fewer, larger chunks trade
    logits memory for both, and the loss alone runs faster with a budget than with fla's 8 chunks
    (benchmarks/studies/loss_bench.py). Why 1024 and not 2048: the loss holds the step's peak since the delta rule keeps
    its chunk states for the backward, and there one 4096-token chunk's logits (1.9 GiB at Qwen3.5's vocabulary)
    sit on top of every activation; 1024 lowers the peak by about a GiB at the 27B shape, its step time within the
    run-to-run spread. At long rows a budget also bounds the logits where fla's fixed 8 chunks would grow."""
    return positive_whole("FUSEPATCH_CE_LOGITS_MIB", DEFAULT_LOGITS_MIB, "MiB") * 2**20


def fla_chunk_tokens(vocab: int, element_size: int, budget_bytes: int) -> int:
    """Tokens per chunk of the fla loss loop: the largest power of two whose ``chunk x vocab`` logits fit in
    ``budget_bytes`` (at least 1). At the 27B shape (vocab 248,320, bf16) the 1024 MiB default gives 2048: two
    chunks of a 4096-token row."""
    chunk = max(1, budget_bytes // (vocab * element_size))
    return 1 << (chunk.bit_length() - 1)


def fla_num_chunks(tokens: int, vocab: int, element_size: int, budget_bytes: int) -> int:
    """How many chunks ``tokens`` make at ``fla_chunk_tokens``."""
    return max(1, -(-tokens // fla_chunk_tokens(vocab, element_size, budget_bytes)))


LOOP_SKIP = "linear_cross_entropy/fla,linear_cross_entropy/triton"  # every candidate that runs the loop


class LossCall(NamedTuple):
    """What one call of the chunk loop gives its GEMMs (``Gemms``): the inputs, which gradients are wanted, and the
    loss's denominator's inverse (``[1]``, fp32)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    ignore_index: int
    wants_hidden: bool
    wants_weight: bool
    inverse: torch.Tensor


class Gemms:
    """The chunk loop's three GEMMs in the inputs' dtype (tensor cores for bf16, fp32 accumulation inside each GEMM;
    fla's own default accumulates the weight gradient in fp32 SIMT GEMMs: 222 ms of a 430 ms 27B step). Another
    precision's loss op gives the loop its own GEMMs with the same three calls."""

    # the FUSEPATCH_SKIP value that leaves a loss with these GEMMs no candidate running the loop (a second backward)
    skip = LOOP_SKIP

    # True: the cross-entropy kernel writes the logits' gradient undivided (``inverse`` 1) and the two gradient GEMMs
    # divide by the loss's denominator (``LossCall.inverse``) themselves
    SCALES_GRADIENT = False

    def __init__(self, call: LossCall) -> None:
        self.hidden, self.weight = call.hidden, call.weight

    def logits(self, start: int, end: int) -> torch.Tensor:
        """The logits of tokens ``start:end`` (a new tensor, its rows contiguous: the kernel writes over them)."""
        return torch.mm(self.hidden[start:end], self.weight.t())

    def grad_hidden(self, grad: torch.Tensor, start: int, end: int, out: torch.Tensor) -> None:
        """``out = grad @ weight``: the hidden-state gradient of tokens ``start:end``, written into their rows."""
        torch.mm(grad, self.weight, out=out)

    def grad_weight(self, grad: torch.Tensor, start: int, end: int, total: torch.Tensor | None) -> torch.Tensor:
        """``grad.t() @ hidden[start:end]`` added to ``total`` (the first chunk's GEMM writes it)."""
        h = self.hidden[start:end]
        return torch.mm(grad.t(), h) if total is None else total.addmm_(grad.t(), h)


class _LinearCrossEntropyLoop(torch.autograd.Function):
    """fusepatch's chunk loop around a cross-entropy kernel. Per chunk of tokens: the logits (one GEMM), the
    kernel's per-token losses with the logits' gradient written over them, every token's gradient already divided
    by the loss's denominator, then the hidden-state gradient (a GEMM into its rows) and the weight gradient (the
    first chunk's GEMM writes it, later chunks add to it). ``ce(logits, target, inverse, ignore_index, grad)``
    is the kernel: fla's two functions (``_load_fla``) or fusepatch's (kernels/cross_entropy.py); ``gemms`` makes
    the GEMMs (``Gemms``: in the inputs' dtype; GEMMs that divide by the denominator themselves get the kernel's
    gradient undivided, ``Gemms.SCALES_GRADIENT``).

    Why not fla's ``fused_linear_cross_entropy_fwd``: it zero-fills the weight gradient (2.5 GB at the 27B
    shape) and then adds every chunk into it, the first included (a fill plus a GEMM that reads the zeros back,
    every step); it divides only by its own token count, so the Trainer's
    ``num_items_in_batch`` needed a pass over both gradients afterwards; and its backward compiles a kernel per
    token count (in packed SFT, about one build a step). Here the backward only scales the stored
    gradients by the incoming one, and skips that when it is 1 (plain training)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, denominator, ignore_index: int, chunk: int, ce, grad_wanted: bool, gemms):
        # under no_grad (evaluation) needs_input_grad still says True: the caller says whether a backward can come
        # each gradient only when asked for: a frozen lm_head (LoRA) takes no weight GEMM (a vocab x hidden x tokens
        # GEMM per step, 14 ms at the 27B shape) and no vocab x hidden buffer
        wants_hidden = grad_wanted and ctx.needs_input_grad[0]
        wants_weight = grad_wanted and ctx.needs_input_grad[1]
        needs_grad = wants_hidden or wants_weight
        with on_device(hidden.device):
            hidden, weight, labels = hidden.contiguous(), weight.contiguous(), labels.contiguous()
            tokens = hidden.shape[0]
            losses = hidden.new_empty(tokens, dtype=torch.float32)
            inverse = denominator.float().reciprocal().reshape(1)
            grad_hidden = torch.empty_like(hidden) if wants_hidden else None
            grad_weight = None
            made = gemms(LossCall(hidden, weight, labels, ignore_index, wants_hidden, wants_weight, inverse))
            written = torch.ones_like(inverse) if gemms.SCALES_GRADIENT else inverse  # the kernel's gradient's factor
            for start in range(0, tokens, chunk):
                end = min(start + chunk, tokens)
                logits = made.logits(start, end)
                losses[start:end] = ce(logits, labels[start:end], written, ignore_index, needs_grad)
                if wants_hidden:  # the logits now hold their gradient
                    made.grad_hidden(logits, start, end, grad_hidden[start:end])
                if wants_weight:
                    grad_weight = made.grad_weight(logits, start, end, grad_weight)
                # freed before the next chunk's GEMM allocates its logits, else two chunks' logits live at once
                # (fla's loop has that peak: a chunk's logits more than needed)
                del logits
            del made  # its operands (another precision's copies) before the gradients are kept
            if wants_weight and grad_weight is None:  # no tokens at all
                grad_weight = torch.zeros_like(weight)
            total = losses.sum() / denominator
        if needs_grad:
            ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.done, ctx.skip = False, gemms.skip
        return total

    @staticmethod
    def backward(ctx, grad_output):
        from fusepatch.kernels.scale import scale_unless_one_

        if ctx.done:  # the stored gradients were scaled in place by the first backward
            raise RuntimeError(
                "fusepatch's fused linear cross-entropy supports one backward per forward (the first scales its "
                "stored gradients in place); for a second backward through the same graph set "
                f"FUSEPATCH_SKIP={ctx.skip} (the torch-chunked loss keeps them)"
            )
        ctx.done = True
        factor = grad_output.detach().float()
        grads = [None if g is None else scale_unless_one_(g, factor) for g in ctx.saved_tensors]
        return *grads, None, None, None, None, None, None, None


def loop(ce, gemms: type[Gemms] = Gemms):
    """The op function: the chunk loop around ``ce`` with ``gemms``' GEMMs (chunk length from
    FUSEPATCH_CE_LOGITS_MIB, read once)."""
    budget = fla_chunk_budget()

    def linear_cross_entropy_loop(hidden, weight, labels, ignore_index: int = -100, num_items_in_batch=None):
        check_rows(hidden, labels)
        chunk = fla_chunk_tokens(weight.shape[0], hidden.element_size(), budget)
        denominator = _denominator(labels, ignore_index, num_items_in_batch)
        grad_wanted = torch.is_grad_enabled()
        return _LinearCrossEntropyLoop.apply(
            hidden, weight, labels, denominator, ignore_index, chunk, ce, grad_wanted, gemms
        )

    return linear_cross_entropy_loop


def _load_fla():
    from fla.modules.fused_cross_entropy import ops

    check_signatures(ops, CROSS_ENTROPY, "linear_cross_entropy/fla")
    ce_forward, ce_backward = ops.cross_entropy_fwd, ops.cross_entropy_bwd

    def fla_ce(logits, target, inverse, ignore_index: int, grad: bool):
        loss, _, lse, classes, first_class = ce_forward(logits=logits, target=target, ignore_index=ignore_index)
        if grad:
            ce_backward(
                logits=logits,
                target=target,
                lse=lse,
                dloss=inverse.expand(logits.shape[0]),
                ignore_index=ignore_index,
                total_classes=classes,
                class_start_idx=first_class,
                inplace_backward=True,
            )
        return loss

    return loop(fla_ce)


def _load_triton():
    from fusepatch.kernels.cross_entropy import cross_entropy_

    return loop(cross_entropy_)


def loss_inputs(device, dtype, generator, packed=False, dims=None, vocab: int = 1000):
    """The self-test's call: 257 tokens, a seventh of the labels ignored, and the Trainer's count over a larger
    batch; the layer's hidden size (``dims``) and ``vocab``."""
    dims = dims or {}
    tokens, hidden_size = 257, dims.get("hidden", 128)
    hidden = rand((tokens, hidden_size), device, dtype, generator)
    weight = rand((vocab, hidden_size), device, dtype, generator, scale=hidden_size**-0.5)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::7] = -100
    # the Trainer's count over the whole accumulated batch, not this call's: a kernel that ignores it is refused
    num_items = int((labels != -100).sum()) + 37
    return (hidden, weight, labels.to(device)), {"num_items_in_batch": num_items}


def hidden_dims(module) -> dict[str, int]:
    return {"hidden": module.config.get_text_config().hidden_size}


LINEAR_CROSS_ENTROPY = Op(
    name="linear_cross_entropy",
    summary="lm_head + cross-entropy without materialising the tokens x vocab logits",
    reference=linear_cross_entropy_reference,
    candidates=(
        fla_candidate(
            "fla",
            "fla.modules.fused_cross_entropy",
            _load_fla,
            "fla's fused linear cross-entropy",
            "fla.modules.fused_cross_entropy.ops.cross_entropy_fwd/_bwd in fusepatch's chunk loop",
        ),
        # fusepatch's own kernels: as fast as fla's at the 27B shape (benchmarks/studies/loss_bench.py --kernels) and
        # as exact; after fla, which is the one measured in the training step, and before torch-chunked (no fla
        # needed: Qwen2/Qwen3 installs without fla get the same loop)
        own_triton_candidate(
            _load_triton,
            "fusepatch's fused linear cross-entropy",
            "fusepatch.kernels.cross_entropy (a loss kernel and an in-place gradient kernel) in fusepatch's chunk loop",
        ),
        Candidate(
            name="torch-chunked",
            source="pip",
            requirements=(TorchVersion(">=2.7"),),
            load=lambda: linear_cross_entropy_chunked,
            inputs=InputRule(devices=("cuda",), kernel="fusepatch's chunked linear cross-entropy"),
            provides="fusepatch.ops.linear_cross_entropy.linear_cross_entropy_chunked (logits one chunk at a time)",
            distribution="torch",
        ),
    ),
    selftest=SelfTest(loss_inputs, {"bfloat16": 8e-3, "float16": 2e-3, "float32": 1e-4}, hidden_dims),
)
