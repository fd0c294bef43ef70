"""The registry's rows say each layer's role (``Row.role``), which the engine's features act on."""

from __future__ import annotations

from fusepatch.models import BUILTIN_ROWS

ROLES = {"head", "decoder", "mlp", "projection", "norm", "attention", "linear_attention", "experts", "rotary"}
ROLES |= {"base_model"}
ENDINGS = {"head": ("ForCausalLM", "ForConditionalGeneration"), "decoder": ("DecoderLayer",), "mlp": ("MLP",)}


def test_every_row_says_its_role():
    for row in BUILTIN_ROWS:
        assert row.role in ROLES, row
        assert row.layer.endswith(ENDINGS.get(row.role, ("",))), row
        assert row.to_dict()["role"] == row.role


def test_the_roles_features_act_on_are_where_the_forwards_are():
    """The head, decoder and MLP rows are exactly those whose forward is the causal-LM head's, a decoder layer's
    or the SwiGLU MLP's (the engine compared forwards before rows said their role)."""
    for row in BUILTIN_ROWS:
        name = row.forward.__name__
        assert (row.role == "head") == (name in ("causal_lm_forward", "conditional_generation_forward")), row
        assert (row.role == "decoder") == (name in ("decoder_layer_forward", "hybrid_decoder_layer_forward")), row
        assert (row.role == "mlp") == (name == "swiglu_mlp_forward"), row
