"""Causal attention within each packed document, in plain PyTorch."""

from __future__ import annotations

import torch.nn.functional as F

from fusepatch.ops.boundaries import block_causal_rows, document_ids


def varlen_attention_reference(q, k, v, cu_seqlens, max_seqlen, scale=None):
    """sdpa over the flattened tokens with a mask that is causal within each document and closed across them."""
    total = q.shape[0]
    allowed = block_causal_rows(document_ids(cu_seqlens.to(q.device), total), 0, total)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=allowed, scale=scale
    )
    return out[0].transpose(0, 1)
