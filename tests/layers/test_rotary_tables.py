"""The rotary tables of plain positions (layers/rotary_embedding.py), the reused ``arange`` of plain positions
(layers/support/positions.py) and the labels counted before the forward (layers/support/labelled_rows.py): the step-start work
fusepatch does once instead of every step, with everything else left to transformers."""

from __future__ import annotations

import pytest
import torch
from helpers import FAMILIES, grads

import fusepatch
from fusepatch.layers import rotary_embedding
from fusepatch.layers.support import positions
from fusepatch.layers.support.labelled_rows import LabelledRows
from fusepatch.layers.support.positions import is_whole_plain, plain_positions, wants_plain_positions
from fusepatch.tools.tiny import tiny_model


def _model_positions(model_type: str, made: torch.Tensor) -> torch.Tensor:
    """The view of ``made`` transformers hands the rotary module: Qwen3.5's three mrope rows, else the positions."""
    return made[None].expand(4, *made.shape)[1:] if model_type.startswith("qwen3_5") else made


def _patched_rotary(model_type: str):
    model = tiny_model(model_type)
    fusepatch.apply(model)
    rotary = model.model.rotary_emb
    assert getattr(rotary, "_fusepatch", None) is not None, model_type
    return model, rotary


@pytest.mark.parametrize("model_type", FAMILIES)
def test_plain_positions_get_transformers_tables_once(model_type):
    """Every family's rotary module: plain positions get exactly transformers' tables, computed on the first call
    and the same tensors after; a new batch size, length or dtype gets its own."""
    _, rotary = _patched_rotary(model_type)
    calls = []
    original = rotary._fusepatch.original

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return original(*args, **kwargs)

    rotary._fusepatch.original = counting  # the forward before apply, counted
    x = torch.randn(2, 11, 8, dtype=torch.bfloat16)
    made = _model_positions(model_type, plain_positions(2, 11, x.device))
    cos, sin = rotary(x, made)
    expected = original(x, made.clone())
    assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])
    again = rotary(x, _model_positions(model_type, plain_positions(2, 11, x.device)))
    assert again[0] is cos and again[1] is sin and len(calls) == 1
    other = rotary(x.float(), made)  # another dtype: its own tables, transformers' values
    assert other[0].dtype == torch.float32 and len(calls) == 2
    assert torch.equal(other[0], original(x.float(), made.clone())[0])
    longer = rotary(x, _model_positions(model_type, plain_positions(2, 12, x.device)))
    assert longer[0].shape[-2] == 12 and len(calls) == 3
    assert len(rotary.__dict__[rotary_embedding.TABLES]) == rotary_embedding.KEPT


def test_anything_but_whole_plain_positions_runs_transformers(monkeypatch):
    """Positions the caller gave, a tail view of plain ones, extra arguments, inference mode, a rope type that
    changes with the length, and the switch turned off: every call computes its tables."""
    _, rotary = _patched_rotary("qwen3")
    x = torch.randn(1, 9, 8)
    made = plain_positions(1, 9, x.device)

    def fresh(*args, **kwargs) -> bool:
        first = rotary(*args, **kwargs)
        return rotary(*args, **kwargs)[0] is not first[0]

    assert fresh(x, torch.arange(9)[None])
    tail = plain_positions(1, 12, x.device)[:, 3:]
    assert not is_whole_plain(tail) and fresh(x, tail)
    assert torch.equal(rotary(x, tail)[0], rotary._fusepatch.original(x, tail.clone())[0])  # positions 3..11
    with torch.inference_mode():
        assert fresh(x, made)
    monkeypatch.setattr(rotary, "rope_type", "dynamic")
    assert fresh(x, made)
    monkeypatch.setattr(rotary, "rope_type", "default")
    assert not fresh(x, made)


def test_changed_tables_or_frequencies_are_recomputed():
    """Tables changed in place since they were kept, and an ``inv_freq`` replaced (a model moved or cast) or
    changed in place, give transformers' tables again, never the stale ones."""
    _, rotary = _patched_rotary("qwen3_next")
    x = torch.randn(1, 7, 8)
    made = plain_positions(1, 7, x.device)
    cos, _ = rotary(x, made)
    cos.mul_(2)
    again, _ = rotary(x, made)
    assert again is not cos and torch.equal(again, rotary._fusepatch.original(x, made.clone())[0])
    rotary.inv_freq = rotary.inv_freq * 0.5
    halved, _ = rotary(x, made)
    assert torch.equal(halved, rotary._fusepatch.original(x, made.clone())[0]) and not torch.equal(halved, again)
    with torch.no_grad():
        rotary.inv_freq.mul_(2)
    doubled, _ = rotary(x, made)
    assert torch.equal(doubled, again)


def test_report_lists_the_rotary_row_as_patched_without_a_kernel():
    model = tiny_model("qwen3")
    text = str(fusepatch.apply(model))
    line = next(line for line in text.splitlines() if "Qwen3RotaryEmbedding x1" in line)
    assert " - " in line and "patched" in line and "no kernel" in line, line


def test_revert_drops_the_tables():
    model, rotary = _patched_rotary("qwen2")
    x = torch.randn(1, 5, 8)
    rotary(x, plain_positions(1, 5, x.device))
    assert rotary.__dict__.get(rotary_embedding.TABLES)
    fusepatch.revert(model)
    assert rotary_embedding.TABLES not in rotary.__dict__ and "forward" not in rotary.__dict__


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3"])
def test_steps_with_kept_tables_match_transformers(chunked_on_cpu, model_type):
    """Three training steps of the patched model, the later ones on kept tables and the kept ``arange``: the loss
    and every gradient equal the unpatched model's at each step."""
    torch.manual_seed(0)
    reference = tiny_model(model_type)
    model = tiny_model(model_type)
    model.load_state_dict(reference.state_dict())
    fusepatch.apply(model)
    for step in range(3):
        ids = torch.randint(0, model.config.vocab_size, (2, 17))
        labels = ids.clone()
        labels[:, :5] = -100  # a prompt: the loss runs on the labelled rows
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        expected = reference(input_ids=ids, labels=labels, use_cache=False).loss
        expected.backward()
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        ours, theirs = grads(model), grads(reference)
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5, msg=f"step {step} {name}")
    assert len(model.model.rotary_emb.__dict__[rotary_embedding.TABLES]) == 1


def test_plain_positions_reuse_one_arange_until_changed():
    first = plain_positions(2, 6, torch.device("cpu"))
    second = plain_positions(3, 6, torch.device("cpu"))
    assert second._base is first._base and second.shape == (3, 6) and is_whole_plain(second)
    second._base.add_(1)  # changed in place: a new one, right again
    third = plain_positions(2, 6, torch.device("cpu"))
    assert third._base is not first._base and third.tolist() == [list(range(6))] * 2
    for length in range(20, 20 + positions._KEPT + 2):
        plain_positions(1, length, torch.device("cpu"))
    assert len(positions._aranges) == positions._KEPT
    assert is_whole_plain(third[None].expand(4, 2, -1)[1:]) and not is_whole_plain(third[:, 1:])
    assert not is_whole_plain(third[:1, :-1])


def test_inference_mode_builds_no_plain_positions():
    """Inference tensors keep no version counter: in inference mode transformers builds its positions itself."""
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert wants_plain_positions(None, None, None, {}, ids)
    with torch.inference_mode():
        assert not wants_plain_positions(None, None, None, {}, ids)
        assert not positions.is_plain(torch.arange(4))


def test_inference_mode_loss_of_a_patched_model(chunked_on_cpu):
    """An evaluation loss under ``torch.inference_mode()`` (labels, no positions) runs and equals transformers'."""
    torch.manual_seed(0)
    reference = tiny_model("qwen3")
    model = tiny_model("qwen3")
    model.load_state_dict(reference.state_dict())
    fusepatch.apply(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.inference_mode():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_unshifted_labels_are_shifted_after_the_count():
    """``LabelledRows(labels, shift=True)`` counts and selects what the shifted labels would give."""
    labels = torch.randint(0, 50, (2, 40))
    labels[:, :9] = -100
    labels[1, 30:] = -100
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    hidden = torch.randn(80, 4)
    ours, theirs = LabelledRows(labels, shift=True), LabelledRows(shifted)
    assert ours.kept() == theirs.kept() == int((shifted != -100).sum())
    assert torch.equal(ours.labels, shifted.reshape(-1))
    for a, b in zip(ours.select(hidden), theirs.select(hidden)):
        assert torch.equal(a, b)
