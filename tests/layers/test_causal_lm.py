"""The causal-LM head (layers/causal_lm.py): whose head computes the loss, and labels refused as transformers
refuses them.

transformers' ``ForCausalLMLoss`` flattens the labels against the logits' rows, so labels that are not one per
position raise (``Expected input batch_size (N) to match target batch_size (M)``). The fused loss selects the
labelled rows by the labels' positions: without a check, labels short by columns or rows trained on the wrong rows
whenever 1/32 of them were -100 (an SFT batch with a masked prompt), and more labels than positions indexed past
the hidden state. Each case runs on transformers' model first, and the patched model must raise what it raises.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import HYBRID, HYBRID_PAIR

import fusepatch
from fusepatch.tools.tiny import FAMILIES, tiny_model

LENGTH = 12


def _batches(vocab: int) -> dict[str, dict]:
    """A padded batch (2 rows, the second right-padded, its 2D mask) and a packed one (1 row of 3 documents)."""
    ids = torch.randint(0, vocab, (2, LENGTH))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    packed = torch.randint(0, vocab, (1, LENGTH))
    positions = torch.cat([torch.arange(5), torch.arange(4), torch.arange(3)])[None]
    return {
        "padded": {"input_ids": ids, "attention_mask": mask},
        "packed": {"input_ids": packed, "position_ids": positions},
    }


def _label_cases(ids: torch.Tensor) -> dict[str, dict]:
    """Labels as a masked-prompt SFT batch has them (the first 3 positions -100: the loss selects the labelled
    rows), cut or grown by columns or rows; shift_labels likewise; and the labels flattened, which transformers
    takes (one label per position all the same: packed rows are compared with the patched model's own loss, as
    transformers' Gated DeltaNet lets packed documents see each other)."""
    labels = ids.clone()
    labels[:, :3] = -100
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    return {
        "fewer_columns": {"labels": labels[:, :-4]},
        "more_columns": {"labels": torch.cat([labels, labels[:, :2]], dim=1)},
        "fewer_rows": {"labels": labels[:-1]},
        "more_rows": {"labels": torch.cat([labels, labels[:1]])},
        "shift_labels_short": {"labels": labels, "shift_labels": shifted[:, :-1].contiguous()},
        "flattened": {"labels": labels.reshape(-1)},
    }


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_labels_that_do_not_fit_raise_as_in_transformers(model_type, chunked_on_cpu):
    """Every family with the fused head, padded and packed, with and without ``num_items_in_batch``: what
    transformers raises (its type; a message naming both shapes), or, where it trains, its loss. The check reads
    shapes only (no wait for the GPU) and comes before the forward."""
    overrides = HYBRID_PAIR if model_type in HYBRID else {"num_hidden_layers": 1}
    reference = tiny_model(model_type, **overrides).train()
    patched = copy.deepcopy(reference)
    report = fusepatch.apply(patched, verbose=False)
    assert ("linear_cross_entropy", "torch-chunked") in {(c.op, c.chosen) for _, c in report.fused_ops}
    for batch_name, batch in _batches(reference.config.vocab_size).items():
        for case, labels in _label_cases(batch["input_ids"]).items():
            try:
                expected = reference(**batch, **labels, use_cache=False).loss
            except Exception as error:  # noqa: BLE001 - whatever transformers raises is what is expected
                expected = error
            for num_items in (None, 7):
                where = f"{batch_name}, {case}, num_items_in_batch={num_items}"
                call = {**batch, **labels, "use_cache": False, "num_items_in_batch": num_items}
                if not isinstance(expected, Exception):  # the same labels in the batch's shape: the same loss
                    got = patched(**call).loss
                    want = patched(**{**call, "labels": labels["labels"].reshape(batch["input_ids"].shape)}).loss
                    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)
                    continue
                with pytest.raises(type(expected)) as raised:
                    patched(**call)
                given = labels.get("shift_labels", labels["labels"])
                message = str(raised.value)
                assert str(tuple(given.shape)) in message, (where, message)
                assert str(tuple(batch["input_ids"].shape)) in message, (where, message)


def _forward_from(module: str, filename: str, fused_lm_head: bool):
    """A forward defined in ``module`` whose code says it came from ``filename``."""
    parameters = "self, *args, fused_lm_head=False, **kwargs" if fused_lm_head else "self, *args, **kwargs"
    namespace = {"__name__": module}
    exec(compile(f"def forward({parameters}):\n    return None\n", filename, "exec"), namespace)
    return namespace["forward"]


def test_a_trainer_head_is_told_by_its_module_not_by_its_folders():
    """TRL's and Liger's heads are known by the package that defines them; a fusepatch checkout in a folder named
    ``trl`` or ``liger_kernel`` is not taken for either."""
    import types

    from fusepatch.layers.causal_lm import trainer_head

    def head(module: str, filename: str, fused_lm_head: bool = False):
        holder = torch.nn.Module()
        holder.forward = types.MethodType(_forward_from(module, filename, fused_lm_head), holder)
        return trainer_head(holder)

    site = "/venv/lib/python3.12/site-packages"
    assert head("trl.trainer.utils", f"{site}/trl/trainer/utils.py", True) == "TRL's fused LM head"
    assert (
        head("liger_kernel.transformers.model.qwen3", f"{site}/liger_kernel/x.py")
        == "Liger's fused linear cross-entropy"
    )
    assert head("my_head", "/home/me/trl/my_head.py", True) == "a fused LM head (fused_lm_head)"
    assert head("fusepatch.layers.causal_lm", "/home/me/liger_kernel/fusepatch/layers/causal_lm.py") is None
