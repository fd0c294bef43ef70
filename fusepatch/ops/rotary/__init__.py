"""rotary: the rotary position embedding of q and k in one kernel per tensor, partial rotary included.

Op signature (transformers' ``apply_rotary_pos_emb`` with ``unsqueeze_dim=1``)::

    q_embed, k_embed = rotary(q [B, Hq, T, D], k [B, Hk, T, D], cos [B or 1, T, R], sin [B or 1, T, R])

The first ``R`` channels of each head are rotated (``x * cos + rotate_half(x) * sin``), the rest pass through.
cos/sin arrive per token as the model computed them (Qwen3.5's mrope text positions, packed rows), so the
kernel makes no assumption about positions.
"""

from __future__ import annotations

import torch

from fusepatch.base.op import Op, SelfTest
from fusepatch.kernels.rotary_check import unsupported  # noqa: F401 - the layers ask it before calling the op
from fusepatch.ops.common import own_triton_candidate, rand
from fusepatch.ops.rotary.reference import rotary_reference


def _load_triton():
    from fusepatch.kernels.rotary import rotary

    return rotary


def _inputs(device, dtype, generator, packed=False, dims=None):
    dims = dims or {}
    hq, hk, dim, rot = (dims.get(n, d) for n, d in (("hq", 4), ("hk", 2), ("dim", 64), ("rot", 16)))
    tokens = 37
    q = rand((2, hq, tokens, dim), device, dtype, generator)
    k = rand((2, hk, tokens, dim), device, dtype, generator)
    # angles of real positions (packed: restarting at 0 mid-row), duplicated halves as transformers builds them
    positions = torch.cat([torch.arange(20), torch.arange(tokens - 20)]) if packed else torch.arange(tokens)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = (positions[:, None].float() * inv_freq[None]).repeat(1, 2)[None].expand(2, tokens, rot)
    cos = angles.cos().to(device=device, dtype=dtype)
    sin = angles.sin().to(device=device, dtype=dtype)
    return (q, k, cos, sin), {}


def _dims(module) -> dict[str, int]:
    config = module.config
    dim = getattr(module, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    factor = getattr(config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor", 1.0)
    return {
        "hq": config.num_attention_heads,
        "hk": config.num_key_value_heads,
        "dim": dim,
        "rot": int(dim * factor) // 2 * 2,
    }


ROTARY = Op(
    name="rotary",
    summary="rotary embedding of q and k, one kernel each, partial rotary and per-token (mrope, packed) angles",
    reference=rotary_reference,
    candidates=(own_triton_candidate(_load_triton, "fusepatch's Triton rotary", "fusepatch.kernels.rotary.rotary"),),
    selftest=SelfTest(_inputs, {"bfloat16": 8e-3, "float16": 2e-3, "float32": 1e-5}, _dims, outputs=2),
)
