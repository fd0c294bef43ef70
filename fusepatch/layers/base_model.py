"""The base (text) model's forward: the call's padding noted before its decoder layers look for packed documents.

The decoder layers find document boundaries where ``position_ids`` restart at 0, and tell a padded row (positions
padded with 0 by a collator, or left padding) from a packed one by the caller's 2D ``attention_mask``, which they
do not see (``packing.note_padding`` keeps it on the positions). Every head transformers has for these families
(causal LM, sequence and token classification, question answering, the image-text wrapper's text model) and a bare
``model.model`` call go through the base model's forward, so the padding is noted here, once per call, whatever
the head. Without it a classifier's or reward model's padded batch was refused as a packed one.
"""

from __future__ import annotations

from fusepatch.layers.support.packing import note_padding
from fusepatch.layers.support.signature import forward_parameters


def base_model_forward(self, *args, **kwargs):
    """transformers' own forward, unchanged, after noting the call's 2D ``attention_mask`` on its
    ``position_ids`` (a call without one clears an earlier call's note)."""
    named = dict(zip(forward_parameters(type(self)), args))
    position_ids = kwargs.get("position_ids", named.get("position_ids"))
    attention_mask = kwargs.get("attention_mask", named.get("attention_mask"))
    note_padding(position_ids, attention_mask)
    return self._fusepatch.original(*args, **kwargs)
