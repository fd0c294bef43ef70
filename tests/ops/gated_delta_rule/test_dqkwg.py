"""ops/gated_delta_rule/dqkwg.py: fla's TileLang q/k/w/g-gradient kernel built with one 128-wide K block, wired as fla's own
wrapper wires it (outputs per value head, group sums, varlen arguments), and fla's own call wherever the tiling
or fla's TileLang backend does not apply. The kernel itself runs on the GPU only (tests/gpu/test_gdn_ops.py: the
saved-states candidates against fla's function and the fp64 reference)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from fusepatch.ops.gated_delta_rule import dqkwg


class Backend:
    """fla's ``CommonTileLangBackend``, as far as the wrapper asks it."""

    available, enabled, accepts = True, True, True

    def is_available(self):
        return self.available

    def is_enabled(self):
        return self.enabled

    def verify(self, name, *args, **kwargs):
        assert name == "chunk_bwd_dqkwg"
        return self.accepts, None if self.accepts else "rejected"


def _fake_kernel_outputs(q, k, v, do, dv, g, heads, value_heads):
    """What the fake kernel writes per value head (q/k expanded as the TileLang kernel reads them: value head i
    reads key head i // G), so that a wrong group sum or head order shows."""
    groups = value_heads // heads
    qe, ke = q.repeat_interleave(groups, 2), k.repeat_interleave(groups, 2)
    scale_per_head = torch.arange(1, value_heads + 1, dtype=q.dtype)[None, None, :, None]
    return qe * scale_per_head + do.sum(-1, keepdim=True), ke * scale_per_head, dv * 2, g * 3


@pytest.fixture
def fake_fla(monkeypatch):
    builds, fla_calls = [], []
    backend = Backend()

    def build(B, H, HV, K, V, BT, BK, BV, NK, hD1, hD2, dtype_str, USE_G, USE_DW, STATE_V_FIRST, IS_VARLEN=False,
              num_warps=4):  # fmt: skip
        builds.append(dict(H=H, HV=HV, K=K, BK=BK, BV=BV, NK=NK, IS_VARLEN=IS_VARLEN, num_warps=num_warps))

        def kernel(q, k, v, g, h, do, dh, dq, dk, dw, dv, dg, *rest):
            assert h.ndim == 3 and dh.shape == h.shape  # flattened states
            if IS_VARLEN:
                cu, indices, _ = rest
                assert cu.dtype == indices.dtype == torch.int32
            outs = _fake_kernel_outputs(q, k, v, do, dv, g, H, HV)
            for out, value in zip((dq, dk, dw, dg[0]), outs):
                out.copy_(value)

        return kernel

    def fla_chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, dv=None, scale=None, **kwargs):
        """fla's call: the same kernel, then the group sums (fla's wrapper)."""
        fla_calls.append(kwargs)
        heads, value_heads = k.shape[2], v.shape[2]
        dq, dk, dw, dg = _fake_kernel_outputs(q, k, v, do, dv, g, heads, value_heads)
        groups = value_heads // heads
        dq, dk = (t.view(*t.shape[:2], heads, groups, t.shape[-1]).sum(3) for t in (dq, dk))
        return dq, dk, dw, dg

    chunk_bwd = types.SimpleNamespace(_build_chunk_bwd_dqkwg_kernel=build)
    modules = {
        "fla.ops.common.backends": types.SimpleNamespace(CommonTileLangBackend=lambda: backend),
        "fla.ops.common.backends.tilelang": types.SimpleNamespace(chunk_bwd=chunk_bwd),
        "fla.ops.common.backends.tilelang.chunk_bwd": chunk_bwd,
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    found = importlib.util.find_spec  # fla runs its TileLang kernel only where tilelang is installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "tilelang" else found(n, *a))
    return types.SimpleNamespace(builds=builds, fla_calls=fla_calls, backend=backend, fla=fla_chunk_bwd_dqkwg)


def _inputs(heads=2, value_heads=6, dim=128, tokens=64):
    torch.manual_seed(0)
    q, k = (torch.randn(1, tokens, heads, dim) for _ in range(2))
    v, do, dv, w = (torch.randn(1, tokens, value_heads, dim) for _ in range(4))
    h, dh = (torch.randn(1, tokens // 64, value_heads, dim, dim) for _ in range(2))
    g = torch.randn(1, tokens, value_heads)
    return dict(q=q, k=k, v=v, w=w, g=g, h=h, dv=dv, do=do, dh=dh, scale=0.1, chunk_size=64)


@pytest.mark.parametrize("heads", [2, 6])  # grouped (H < HV) and q/k already expanded (H = HV)
def test_wide_tiling_matches_fla_wiring(fake_fla, heads):
    call = dqkwg.load(fake_fla.fla)
    assert call is not fake_fla.fla
    x = _inputs(heads=heads)
    ours = call(**x)
    theirs = fake_fla.fla(**x)
    assert fake_fla.builds == [dict(H=heads, HV=6, K=128, BK=128, BV=64, NK=1, IS_VARLEN=False, num_warps=8)]
    assert len(fake_fla.fla_calls) == 1  # only the reference call above: the wrapper did not fall back
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)
    packed = dict(cu_seqlens=torch.tensor([0, 30, 64]), chunk_indices=torch.tensor([[0, 0], [1, 0]]))
    call(**x, **packed)
    assert fake_fla.builds[-1]["IS_VARLEN"] is True


@pytest.mark.parametrize(
    "change",
    [
        "wide heads",
        "backend off",
        "backend rejects",
        "no w",
        "v not in 64-wide blocks",
        "packed, no table",
    ],
)
def test_falls_back_to_fla_where_the_tiling_does_not_apply(fake_fla, monkeypatch, change):
    x = _inputs()
    if change == "wide heads":
        x = _inputs(dim=256)
    elif change == "backend off":
        fake_fla.backend.enabled = False
    elif change == "backend rejects":
        fake_fla.backend.accepts = False
    elif change == "no w":
        x["w"] = None
    elif change == "v not in 64-wide blocks":
        x["v"] = x["v"][..., :96]
    elif change == "packed, no table":
        x["cu_seqlens"] = torch.tensor([0, 30, 64])
    dqkwg.load(fake_fla.fla)(**x)
    assert fake_fla.builds == [] and len(fake_fla.fla_calls) == 1


def test_without_fla_or_with_a_changed_builder_fla_is_called(fake_fla, monkeypatch):
    def changed(B, H, HV, K, V, BT, BK, BV, hD1, hD2, dtype_str, USE_G, USE_DW):  # no NK, no num_warps
        raise AssertionError("not called")

    monkeypatch.setattr(
        sys.modules["fla.ops.common.backends.tilelang.chunk_bwd"], "_build_chunk_bwd_dqkwg_kernel", changed
    )
    assert dqkwg.load(fake_fla.fla) is fake_fla.fla
    monkeypatch.setitem(sys.modules, "fla.ops.common.backends.tilelang.chunk_bwd", None)  # no TileLang: no module
    assert dqkwg.load(fake_fla.fla) is fake_fla.fla
