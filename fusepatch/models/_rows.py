"""The parts every Qwen family is made of, and the one table that names a family's classes after them.

A family file (``qwen2.py``, ...) says which families of transformers it covers and what kind of decoder each has;
:func:`family` gives its rows, one per class, in the order of the table below (the order ``fusepatch list`` shows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from fusepatch.base import options
from fusepatch.base.row import Binding, Row
from fusepatch.layers.attention import attention_forward, attn_names, gated_attention_forward
from fusepatch.layers.base_model import base_model_forward
from fusepatch.layers.causal_lm import PACKED_CHECK, causal_lm_forward, conditional_generation_forward
from fusepatch.layers.decoder import decoder_layer_forward, hybrid_decoder_layer_forward
from fusepatch.layers.fp8 import PROJECTIONS, aligned, fp8_linear_forward
from fusepatch.layers.gated_deltanet import gated_deltanet_forward
from fusepatch.layers.rotary_embedding import rotary_embedding_forward
from fusepatch.layers.simple import (
    experts_forward,
    rms_norm_forward,
    rms_norm_zero_centered_forward,
    swiglu_mlp_forward,
)
from fusepatch.layers.support.dispatch_guard import guards

ROPE_TABLES = "cos/sin of plain positions computed once and reused across steps; no kernel"
# the base model every head calls: padded rows told apart from packed ones for every head, not the causal LM's alone
PADDING = "the call's attention_mask noted, so padded rows are not taken for packed ones; no kernel"
RESIDUAL_NORM = "residual add fused into the post-attention norm; packed boundaries to linear attention"


@dataclass(frozen=True)
class Part:
    """What a row of one kind of layer holds besides its class: the ops its forward calls, the forward, its role
    (``Row.role``), its note, and the foreign names it needs replaced (``Row.bindings``) as a function of the
    family's modeling module."""

    ops: tuple[str, ...]
    forward: object
    role: str
    note: str = ""
    bindings: Callable[[str], tuple[Binding, ...]] | None = None


NORM = Part(("rms_norm",), rms_norm_forward, "norm")
NORM_ZERO_CENTERED = Part(("rms_norm_zero_centered",), rms_norm_zero_centered_forward, "norm")
GDN_OPS = ("causal_conv1d", "gated_delta_rule", "gated_rms_norm")
GATED_DELTANET = Part(GDN_OPS, gated_deltanet_forward, "linear_attention", "linear attention", guards)
DECODER = Part(("add_rms_norm",), decoder_layer_forward, "decoder")
HYBRID_DECODER = Part(("add_rms_norm_zero_centered",), hybrid_decoder_layer_forward, "decoder", RESIDUAL_NORM)
MLP = Part(("swiglu",), swiglu_mlp_forward, "mlp")
EXPERTS = Part(("moe_experts",), experts_forward, "experts")
ROTARY = Part((), rotary_embedding_forward, "rotary", ROPE_TABLES)
ATTENTION = Part(("rotary", "varlen_attention"), attention_forward, "attention", bindings=attn_names)
GATED_ATTENTION = Part(
    ("rotary", "attention_gate", "varlen_attention"),
    gated_attention_forward,
    "attention",
    "gated full attention",
    attn_names,
)
BASE_MODEL = Part((), base_model_forward, "base_model", PADDING)
HEAD = Part(("linear_cross_entropy",), causal_lm_forward, "head", bindings=lambda module: PACKED_CHECK)
IMAGE_TEXT_HEAD = Part(
    ("linear_cross_entropy",),
    conditional_generation_forward,
    "head",
    "image-text wrapper: text loss only",
    lambda module: PACKED_CHECK,
)

PARTS = (
    NORM,
    NORM_ZERO_CENTERED,
    GATED_DELTANET,
    DECODER,
    HYBRID_DECODER,
    MLP,
    EXPERTS,
    ROTARY,
    ATTENTION,
    GATED_ATTENTION,
    BASE_MODEL,
    HEAD,
    IMAGE_TEXT_HEAD,
)


def completed(row: Row) -> Row:
    """A row added with ``register`` whose forward is one of fusepatch's own, with what that forward's part
    declares where the row leaves it out: its role (the trainer's head, the CUDA graphs and the MLP recompute act
    by role) and the foreign names it needs (for the row's own modeling module). A row that sets either keeps its
    own; a forward of the user's own is left as it is."""
    part = next((part for part in PARTS if part.forward is row.forward), None)
    if part is None:
        return row
    bindings = row.bindings or (part.bindings(row.module) if part.bindings else ())
    return dataclasses.replace(row, role=row.role or part.role, bindings=bindings)


def family(
    model_type: str, prefix: str, *, hybrid: bool = False, moe: bool = False, image_text: bool = False, mlp: str = ""
) -> list[Row]:
    """The rows of one transformers family (``transformers.models.<model_type>``), whose classes are ``prefix``
    followed by the part's name.

    Args:
        hybrid: Gated DeltaNet layers beside gated full attention, zero-centered norms (Qwen3.5, Qwen3-Next);
            else full attention and plain RMSNorm (Qwen2, Qwen3).
        moe: the MLPs are mixture-of-experts (an ``Experts`` class).
        image_text: the family also has a text-only model type (``<model_type>_text``, ``Text`` classes) and an
            image-text wrapper (``ForConditionalGeneration``).
        mlp: the MLP row's note (which MLPs the class serves).
    """
    text = "Text" if image_text else ""
    table = [  # (class after the prefix, its part), in the order the rows are listed; None: not in this family
        ("GatedDeltaNet", GATED_DELTANET) if hybrid else None,
        ("DecoderLayer", HYBRID_DECODER) if hybrid else None,
        ("RMSNorm", NORM_ZERO_CENTERED if hybrid else NORM),
        ("MLP", Part(MLP.ops, MLP.forward, MLP.role, mlp)),
        ("Experts", EXPERTS) if moe else None,
        None if hybrid else ("DecoderLayer", DECODER),
        (f"{text}RotaryEmbedding", ROTARY),
        ("Attention", GATED_ATTENTION if hybrid else ATTENTION),
        (f"{text}Model", BASE_MODEL),
        ("ForCausalLM", HEAD),
        ("ForConditionalGeneration", IMAGE_TEXT_HEAD) if image_text else None,
    ]
    types = (model_type, f"{model_type}_text") if image_text else (model_type,)
    module = f"transformers.models.{model_type}.modeling_{model_type}"
    rows = []
    for name, part in filter(None, table):
        if part.role == "head":  # its FP8 loss row first: under lm_head_precision="fp8" it matches the head first
            rows.append(_row(types, module, prefix + name, fp8_head(part), precision=FP8_HEAD_PRECISION))
        rows.append(_row(types, module, prefix + name, part))
    return rows


def _row(types: tuple[str, ...], module: str, layer: str, part: Part, precision: str | None = None) -> Row:
    bindings = part.bindings(module) if part.bindings else ()
    return Row(types, module, layer, part.ops, part.forward, note=part.note, bindings=bindings, role=part.role,
               precision=precision)  # fmt: skip


# ``apply(lm_head_precision="fp8")``: the head's row with both loss ops; its forward runs the FP8 one where that op
# and the head's shape allow, else the model's own precision's (``layers/causal_lm.py``)
FP8_HEAD_PRECISION = options.head_rows("fp8")


def fp8_head(part: Part) -> Part:
    """A head part whose loss may run the LM head's GEMMs in FP8."""
    note = "; ".join(filter(None, (part.note, "LM head GEMMs in FP8 (lm_head_precision='fp8')")))
    return dataclasses.replace(part, ops=(*part.ops, "fp8_linear_cross_entropy"), note=note)


# the decoder's projections under ``apply(model, precision=...)``, one part per precision: plain ``nn.Linear`` held
# as one of the names listed (a subclass, such as a layer torchao already converted or a peft LoRA wrapper, is left
# as it is), where ``fits`` says the precision's GEMMs can compute it (the others are named)
PRECISION_PROJECTIONS = {
    "fp8": (
        Part(("fp8_linear",), fp8_linear_forward, "projection", "decoder projections with FP8 GEMMs: "),
        PROJECTIONS,
        aligned,
    ),
}


def projections(model_types: tuple[str, ...]) -> list[Row]:
    """The decoder's projections of these model types, one row per precision ``apply`` takes."""
    return [
        Row(
            model_types,
            "torch.nn.modules.linear",
            "Linear",
            part.ops,
            part.forward,
            note=part.note + ", ".join(names),
            names=names,
            precision=precision,
            fits=fits,
            role=part.role,
        )
        for precision, (part, names, fits) in PRECISION_PROJECTIONS.items()
    ]
