"""Padded batches through every entry point: the base model and every head class transformers has for the families.

The decoder layers find packed documents where ``position_ids`` restart at 0, and tell padding (positions padded
with 0, left padding) from packing by the call's 2D ``attention_mask``. Only the causal LM's head noted that mask,
so a classifier's, a reward model's or a bare base model's padded batch was refused as a packed one, with a fix
(no attention_mask) that would have broken its padding. Every class the families' modeling modules export in the
transformers under test is checked here against unpatched transformers on the same weights: outputs (every field)
and every parameter's gradient, in fp64 where transformers computes in it throughout (fp32 for the MoE and hybrid
families), with the fused decoder forward running on its CPU stand-in (conftest's ``calls``).
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from helpers import HYBRID_PAIR

import fusepatch
from fusepatch.layers.support.packing import PackedSequenceError
from fusepatch.tools.tiny import FAMILIES, tiny_config

# transformers' modeling module -> the tiny family of its text config
FAMILY_OF_MODULE = {
    "qwen2": "qwen2",
    "qwen2_moe": "qwen2_moe",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}
# fp64 where transformers computes in it throughout: its MoE experts take no fp64, and its Gated DeltaNet reference
# computes the delta rule in fp32 whatever the input (torch_chunk_gated_delta_rule)
FP64 = ("qwen2", "qwen3")
PAD = 0
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
VISION.update(spatial_merge_size=1, temporal_patch_size=1)
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=1e-5, atol=1e-6)}
# gradients of a random weighting of every output reach the hundreds: rounding of reordered sums is bounded
# relative to the largest gradient of the model (the atol below is a fraction of it)
GRAD_TOL = {torch.float64: dict(rtol=1e-8, atol=1e-12), torch.float32: dict(rtol=1e-4, atol=1e-6)}
# a packed row against its documents run one by one: the same sums in another order (test_packing.py's bounds)
PACKED_GRAD_TOL = {torch.float64: dict(rtol=1e-8, atol=1e-12), torch.float32: dict(rtol=1e-3, atol=1e-6)}


def _classes() -> list[tuple[str, str]]:
    """(module, class) of every base model and head each family's modeling module exports (vision towers and
    the pretrained base classes aside): what this transformers has, not a list that a new release outgrows."""
    found = []
    for module in FAMILY_OF_MODULE:
        names = importlib.import_module(f"transformers.models.{module}.modeling_{module}").__all__
        found += [
            (module, name)
            for name in names
            if (name.endswith("Model") or "For" in name) and "PreTrained" not in name and "Vision" not in name
        ]
    return found


CLASSES = _classes()


def _build(module: str, name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers' ``name`` on a tiny config, the same weights patched); two layers (hybrids: one of each)."""
    family = FAMILY_OF_MODULE[module]
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    layers = HYBRID_PAIR if "layer_types" in FAMILIES[family] else dict(num_hidden_layers=2)
    text = tiny_config(family, pad_token_id=PAD, classifier_dropout=0.0, **layers)
    config = text
    if not isinstance(text, cls.config_class):  # the image-text wrapper's config around the text one
        from transformers import AutoConfig

        text_config = {k: v for k, v in text.to_dict().items() if k != "tie_word_embeddings"}
        config = AutoConfig.for_model(
            cls.config_class.model_type,
            text_config=text_config,
            vision_config=VISION,
            tie_word_embeddings=False,
            classifier_dropout=0.0,  # a token head reads the wrapper's config
        )
    dtype = torch.float64 if family in FP64 else torch.float32
    torch.manual_seed(0)
    reference = cls._from_config(config, attn_implementation="sdpa", dtype=dtype).train()
    patched = copy.deepcopy(reference)
    fusepatch.apply(patched, verbose=False)
    return reference, patched


def _padded(vocab: int, side: str, positions: bool) -> dict:
    """Two rows, the second padded by 3 on ``side`` (pad tokens ``PAD``); ``positions``: position_ids as collators
    pad them, with 0 (``[0, 1, 2, 3, 0, 0, 0]``, ``[0, 0, 0, 0, 1, 2, 3]``)."""
    ids = torch.randint(1, vocab, (2, 7))
    mask = torch.ones_like(ids)
    if side == "right":
        mask[1, -3:] = 0
    else:
        mask[1, :3] = 0
    batch = dict(input_ids=ids.masked_fill(mask == 0, PAD), attention_mask=mask)
    if positions:
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0) * mask
    return batch


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor in an output (fields in order, tuples such as hidden_states flattened)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if hasattr(value, "items"):
        return [t for _, v in value.items() for t in _tensors(v)]
    return []


def _run(model: torch.nn.Module, batch: dict, weights: list[torch.Tensor] | None = None):
    """The model's output, its tensors, the weights of a scalar over them (drawn at the first call) and every
    parameter's gradient of that scalar."""
    model.zero_grad(set_to_none=True)
    output = model(**batch, use_cache=False, output_hidden_states=True)
    tensors = [t for t in _tensors(output) if t.is_floating_point()]
    if weights is None:
        weights = [torch.randn(t.shape, dtype=t.dtype) for t in tensors]
    sum(((t * w).sum() for t, w in zip(tensors, weights)), torch.zeros((), dtype=tensors[0].dtype)).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return output, tensors, weights, grads


def _same_as_transformers(reference, patched, batch: dict, label: str) -> None:
    expected, expected_tensors, weights, expected_grads = _run(reference, batch)
    got, got_tensors, _, got_grads = _run(patched, batch, weights)
    dtype = expected_tensors[0].dtype
    assert list(got.keys()) == list(expected.keys()), label
    assert len(got_tensors) == len(expected_tensors), label
    for index, (a, b) in enumerate(zip(expected_tensors, got_tensors)):
        torch.testing.assert_close(b, a, **TOL[dtype], msg=lambda m, i=index: f"{label}: output {i}: {m}")
    _same_gradients(got_grads, expected_grads, GRAD_TOL[dtype], label)


def _same_gradients(got: dict, expected: dict, tol: dict, label: str) -> None:
    assert got.keys() == expected.keys(), label
    atol = tol["atol"] * max(g.abs().max().item() for g in expected.values())
    for name, grad in expected.items():
        where = f"{label}: {name}"
        torch.testing.assert_close(got[name], grad, rtol=tol["rtol"], atol=atol, msg=lambda m, w=where: f"{w}: {m}")


@pytest.mark.parametrize("module, name", CLASSES, ids=[name for _, name in CLASSES])
def test_padded_batch_runs_as_transformers_runs_it(module, name, calls):
    """Right and left padding, with position_ids padded with 0 or not given, an attention_mask given: every
    output field and every gradient as transformers' own (padding was refused as packing outside the causal LM)."""
    reference, patched = _build(module, name)
    for side in ("right", "left"):
        for positions in (True, False):
            batch = _padded(reference.config.get_text_config().vocab_size, side, positions)
            _same_as_transformers(reference, patched, batch, f"{name}, {side} padding, position_ids={positions}")
    assert calls, "the fused decoder forward did not run"


def _packed(vocab: int) -> tuple[list[torch.Tensor], dict]:
    lengths = (3, 1, 5)
    docs = [torch.randint(1, vocab, (n,)) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return docs, dict(input_ids=torch.cat(docs)[None], position_ids=position_ids)


def _per_token(output) -> torch.Tensor:
    """A base model's last hidden state, or a token head's logits: one row per token."""
    return output.last_hidden_state if "last_hidden_state" in output else output.logits


PACKED = [c for c in CLASSES if c[1].endswith("Model") or c[1].endswith("TokenClassification")]


@pytest.mark.parametrize("module, name", PACKED, ids=[name for _, name in PACKED])
def test_packed_batch_is_still_packed(module, name, calls):
    """position_ids restarting at 0 with no attention_mask is a packed row, through the base model and a token head
    alike: each document's outputs and gradients are transformers' for the document alone."""
    reference, patched = _build(module, name)
    docs, batch = _packed(reference.config.get_text_config().vocab_size)
    patched.zero_grad(set_to_none=True)
    packed = _per_token(patched(**batch, use_cache=False))
    weights = torch.randn(packed.shape, dtype=packed.dtype)
    (packed * weights).sum().backward()
    got_grads = {n: p.grad for n, p in patched.named_parameters() if p.grad is not None}
    reference.zero_grad(set_to_none=True)
    start, alone = 0, []
    for doc in docs:
        out = _per_token(reference(input_ids=doc[None], use_cache=False))
        (out * weights[:, start : start + len(doc)]).sum().backward()
        alone.append(out)
        start += len(doc)
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), **TOL[packed.dtype])
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    _same_gradients(got_grads, expected, PACKED_GRAD_TOL[packed.dtype], name)


@pytest.mark.parametrize("module, name", [("qwen3_5", "Qwen3_5TextForSequenceClassification"), ("qwen3", "Qwen3Model")])
def test_packed_batch_with_a_mask_is_refused_with_a_fix_that_works(module, name):
    """Documents packed in a row and an all-ones attention_mask: transformers would let them attend to each other,
    so the call is refused; the fix the error names (no attention_mask, use_cache=False) gives the last document
    what transformers gives it alone (a classifier scores a row at its last token)."""
    reference, patched = _build(module, name)
    docs, batch = _packed(patched.config.get_text_config().vocab_size)
    with pytest.raises(PackedSequenceError, match="use_cache=False and no attention_mask"):
        patched(**batch, attention_mask=torch.ones_like(batch["input_ids"]), use_cache=False)
    got = patched(**batch, use_cache=False)
    alone = reference(input_ids=docs[-1][None], use_cache=False)
    if "logits" in got:
        torch.testing.assert_close(got.logits, alone.logits, **TOL[got.logits.dtype])
    else:
        last = got.last_hidden_state[:, -len(docs[-1]) :]
        torch.testing.assert_close(last, alone.last_hidden_state, **TOL[last.dtype])


def test_base_model_row_is_reported_and_reverted():
    """The base model's forward is a registry row like any layer's: in the report, and restored by revert (after
    which a padded batch is transformers' own call)."""
    reference, patched = _build("qwen3", "Qwen3ForSequenceClassification")
    report = fusepatch.report(patched)
    (row,) = [layer for layer in report.layers if layer.layer == "Qwen3Model"]
    assert row.patched and row.count == 1 and row.choices == () and "attention_mask" in row.note
    assert "forward" in patched.model.__dict__
    assert fusepatch.revert(patched) == report.patched
    assert "forward" not in patched.model.__dict__
    batch = _padded(reference.config.vocab_size, "right", True)
    torch.testing.assert_close(patched(**batch).logits, reference(**batch).logits, rtol=0, atol=0)
