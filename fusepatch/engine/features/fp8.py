"""``apply(precision="fp8", drop_frozen_weights=True, lm_head_precision="fp8")``: what FP8 projections
(``layers/fp8.py``) keep beyond their forward, and the heads whose loss runs in FP8. A frozen projection keeps its
weight in FP8 only (the ``drop_frozen`` flag; DoRA's bases excepted, their adapters read the weight; the dropped
weight carries its FP8 copy, so it copies and pickles with the module), ``revert`` puts the weight back rounded and
says so, and ``report`` counts the dropped weights. On a model as narrow as those where FP8 measured slower than
bf16 without CUDA graphs, ``finish`` says so with the fix; a head FP8 GEMMs cannot take is said with its fix."""

from __future__ import annotations

import dataclasses

import torch

from fusepatch.backends import deepspeed
from fusepatch.base.log import logger
from fusepatch.engine.features.base import Feature, Patched
from fusepatch.engine.features.cuda_graphs import decoder_stacks, graphed
from fusepatch.engine.plan import Plan, Request, Resolved
from fusepatch.engine.reporting import PatchReport
from fusepatch.kernels.fp8_range import MULTIPLE
from fusepatch.layers.fp8 import is_dropped, keep_what_variants_read, restore_dropped, say_restored, sharding_lines
from fusepatch.ops.fp8_linear_cross_entropy import aligned

ROUNDED = "fusepatch.revert(model) puts back rounded copies"
# The widest hidden size at which FP8 projections measured slower than bf16 per synced step without CUDA graphs
# (the 2B-like shape; faster with graphs, and at 27B's 5120 faster without them: docs/fp8.md): a step of a model
# this narrow already waits for the host, and FP8 adds host work to every projection.
NARROW = 2048
NARROW_ADVICE = (
    "fusepatch: precision='fp8' on a narrow model (hidden size %d) without CUDA graphs: its training step waits for "
    "the host, and FP8 adds host work to every projection, so it can run slower than bf16. Fix: cuda_graphs=True "
    "beside precision='fp8' (in fusepatch.apply, or FusePatchCallback's apply_kwargs) where batches keep one shape "
    "(no activation checkpointing or FSDP2), else leave precision unset"
)


def _hidden_size(model: torch.nn.Module) -> int | None:
    """The decoder's width (a multimodal model's text config), which sets how much GPU work each launch carries."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    return hidden if isinstance(hidden, int) else None


UNALIGNED_HEAD = "fusepatch: lm_head_precision='fp8': %s, so the loss runs its GEMMs in the model's precision. Fix: %s"
PAD_VOCABULARY = "pad the vocabulary, model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=16)"
# a hidden size no padding of the vocabulary reaches: the option can only be left out
LEAVE_HEAD = "apply with lm_head_precision=None (the hidden size is the model's own)"


def _fp8_head(ops) -> bool:
    """Whether a head with these ops may run its loss in FP8 (its row under ``lm_head_precision="fp8"``)."""
    return "fp8_linear_cross_entropy" in ops


def _say_unaligned_heads(plan: Plan) -> None:
    """Each head patched for an FP8 loss whose weight FP8 GEMMs cannot take: why, with the fix (at WARNING). Not a
    head another library computes (``plan.owners``: a trainer's fused head), whose loss fusepatch does not run."""
    for row, modules in plan.found.items():
        if not _fp8_head(row.ops) or row in plan.owners:
            continue
        for module in modules:
            head = getattr(module, "lm_head", None)
            weight = getattr(head, "weight", None)
            shape = None if weight is None else tuple(deepspeed.full_shape(weight))
            why = None if shape is None else aligned(shape)
            if why is not None:
                hidden_fits = len(shape) == 2 and not shape[1] % MULTIPLE
                logger.warning(UNALIGNED_HEAD, why, PAD_VOCABULARY if hidden_fits else LEAVE_HEAD)


class Fp8(Feature):
    name = "fp8"
    # read by the projection's forward at its first FP8 call; weight_read: its LoRA variant reads the base weight
    under = {
        "fsdp2": (
            'precision="fp8": each frozen projection (LoRA\'s bases) keeps its FP8 copy sharded like its weight (each '
            "rank its own rows and their scales), gathered in FP8 for its unit's forward and backward and freed after; "
            "drop_frozen_weights=True drops the rank's bf16 rows of those weights; at one rank, or sharded unevenly "
            "(or another way torch's FP8 gather cannot take), each call quantizes the gathered weight, keeping no copy",
        ),
        "deepspeed": (
            'precision="fp8": a frozen projection quantizes the weight ZeRO-3 gathered at each call, forward and again '
            "for the backward, keeping no copy (one kept would be whole on every rank); drop_frozen_weights=True drops "
            "nothing (the partitions are DeepSpeed's)",
        ),
    }
    slots = {"drop_frozen": False, "weight_read": False}

    def bind(self, plan: Plan, request: Request, patched: Patched) -> str:
        for _, state in patched:
            state.drop_frozen = request.drop_frozen_weights and state.row.precision == "fp8"
        keep_what_variants_read(plan.model)
        return ""

    def kept(self, plan: Plan, request: Request, states: list) -> list[str]:
        other = dropping = 0
        for state in states:
            if state.row.precision is None or state.row.role != "projection":
                continue
            if state.row.precision != request.precision:
                other += 1
            elif state.drop_frozen != request.drop_frozen_weights:
                dropping += 1
        kept = [f"{other} FP8 projections keep their FP8 GEMMs (this call's precision={request.precision!r})"]
        kept = kept if other else []
        if dropping:
            kept.append(f"{dropping} FP8 projections keep drop_frozen_weights={not request.drop_frozen_weights}")
        wanted = request.lm_head_precision == "fp8"
        heads = [_fp8_head(state.ops) for state in states if state.row.role == "head"]
        if any(fp8 != wanted for fp8 in heads):
            kept.append(f"the LM head keeps lm_head_precision={'fp8' if not wanted else None!r}")
        return kept

    def finish(self, plan: Plan, resolved: Resolved, report: PatchReport, request: Request, newly: int) -> None:
        """An LM head whose shape FP8 GEMMs cannot take under ``lm_head_precision="fp8"``: said, with the fix. Where
        FP8 runs on a model as narrow as those it measured slower on without graphs: the fix. Not where the layers keep
        an earlier apply's graphs, nor where none can be graphed (mixture-of-experts layers): there the fix would
        not apply."""
        if request.lm_head_precision == "fp8" and newly:
            _say_unaligned_heads(plan)
        if request.precision != "fp8" or request.cuda_graphs or not newly:
            return
        if not any(choice.op == "fp8_linear" for _, choice in report.fused_ops):
            return
        hidden = _hidden_size(plan.model)
        if hidden is None or hidden > NARROW:
            return
        if not graphed(plan.model) and decoder_stacks(plan.model)[0]:  # the model walks last: only where it may say
            logger.warning(NARROW_ADVICE, hidden)

    def report(self, report: PatchReport, states: list) -> PatchReport:
        dropped = sum(is_dropped(s.owner) for s in states)
        sharding = report.sharding + sharding_lines(states)
        if not dropped:
            return dataclasses.replace(report, sharding=sharding)
        note = f"{dropped} frozen weights kept in FP8 only (drop_frozen_weights=True; {ROUNDED})"
        return dataclasses.replace(report, dropped_weights=dropped, notes=(*report.notes, note), sharding=sharding)

    def revert(self, model: torch.nn.Module, patched: Patched) -> None:
        rounded = sum(restore_dropped(module) for module, _ in patched)
        if rounded:
            say_restored(rounded)


FEATURE = Fp8()
