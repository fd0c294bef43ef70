"""Plain positions (layers/support/positions.py): a batch without positions, mask or cache gets no read of the GPU to
find out that it is not packed, and the same loss and gradients as before."""

from __future__ import annotations

import pytest
import torch
import transformers.masking_utils as masking
from helpers import HOST_READS, HYBRID, ONE_OF_EACH, grads

import fusepatch
from fusepatch.layers.support import packing
from fusepatch.layers.support.positions import is_plain, plain_positions, skip_plain
from fusepatch.tools.tiny import tiny_model


def test_plain_positions_and_their_views_are_plain_until_changed():
    made = plain_positions(3, 7, torch.device("cpu"))
    assert made.shape == (3, 7) and made.tolist() == [list(range(7))] * 3
    assert is_plain(made)
    # the views transformers takes: Qwen3.5's four rows of mrope positions and their text row, an expand
    assert is_plain(made[None].expand(4, 3, -1)[0]) and is_plain(made[:1].expand(3, -1))
    assert is_plain(made[:, 2:])  # a tail of 0..T-1 starts no document either
    assert not is_plain(made[:, ::2])  # every other position: 0, 2, 4 is not what the checks would call plain
    assert not is_plain(made.clone())  # a copy may be changed: checked as any tensor
    assert not is_plain(torch.arange(7)[None])  # the caller's own positions
    assert not is_plain(None)
    made[0, 1] = 5  # changed in place through a view (shared version counter): checked again
    assert not is_plain(made) and not is_plain(made[None][0])


def test_packed_check_skips_plain_positions_only():
    original = masking.find_packed_sequence_indices
    check = skip_plain(original)
    assert check(plain_positions(2, 5, torch.device("cpu"))) is None
    packed = torch.tensor([[0, 1, 2, 0, 1]])
    assert check(packed).tolist() == original(packed).tolist() == [[0, 0, 0, 1, 1]]
    assert check(torch.arange(5)[None]) is None  # the original's own answer


@pytest.mark.parametrize("model_type", ONE_OF_EACH)
def test_forward_without_positions_reads_nothing_back_and_matches_transformers(chunked_on_cpu, monkeypatch, model_type):
    """The patched forward with labels and nothing else: neither transformers' packed check nor fusepatch's
    boundary search runs (each reads the GPU), and the loss and every gradient equal the unpatched model's."""
    torch.manual_seed(0)
    reference = tiny_model(model_type)
    model = tiny_model(model_type)
    model.load_state_dict(reference.state_dict())
    reads = {"packed": 0, "boundaries": 0}
    original_check = masking.find_packed_sequence_indices
    real_boundaries = packing.cu_seqlens_from_position_ids

    def packed_check(position_ids):
        reads["packed"] += 1
        return original_check(position_ids)

    def boundaries(*args):
        reads["boundaries"] += 1
        return real_boundaries(*args)

    # transformers' check as apply finds it (it binds its own around it)
    monkeypatch.setattr(masking, "find_packed_sequence_indices", packed_check)
    monkeypatch.setattr(packing, "cu_seqlens_from_position_ids", boundaries)
    fusepatch.apply(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 19))
    expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
    expected.backward()
    reads.update(packed=0, boundaries=0)  # the unpatched reference's calls checked as transformers does
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert reads == {"packed": 0, "boundaries": 0}, reads
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    ours, theirs = grads(model), grads(reference)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5, msg=name)
    # the caller's own positions are checked as before
    model(input_ids=ids, labels=ids, position_ids=torch.arange(19)[None].expand(2, -1).clone(), use_cache=False)
    assert reads["packed"] > 0, reads  # transformers' check, once per mask kind of the family
    if model_type in HYBRID:  # hybrid layers look for boundaries (on CPU too)
        assert reads["boundaries"] == 1, reads
    fusepatch.revert(model)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3"])
def test_forward_of_a_plain_batch_runs_no_op_that_reads_the_gpu(chunked_on_cpu, model_type):
    """The CPU stand-in for tests/gpu's sync-debug test: in the patched forward of a plain batch (sdpa attention,
    labels only) no op runs that would wait for a GPU (``nonzero``, ``all``/``any`` read back, ``item``), except
    the one scalar read of the labelled-rows count, which reads pinned host memory behind an event on a GPU
    (layers/support/labelled_rows.py). The caller's own positions bring transformers' packed-rows check back."""
    model = tiny_model(model_type, attn_implementation="sdpa")
    fusepatch.apply(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 19))
    model(input_ids=ids, labels=ids, use_cache=False)

    def host_reads(**extra) -> list[str]:
        with torch.profiler.profile() as prof:
            model(input_ids=ids, labels=ids, use_cache=False, **extra)
        return [e.name for e in prof.events() if e.name in HOST_READS]

    assert host_reads() == ["aten::_local_scalar_dense"]
    own = host_reads(position_ids=torch.arange(19)[None].expand(2, -1).clone())
    assert "aten::is_nonzero" in own and "aten::all" in own, own
