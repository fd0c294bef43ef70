"""fla-saved-states calls fla's delta-rule pieces by keyword: the checked table must cover every call, an fla
release that changed a piece must fail the load with the fix, and the grouped variant must wire its head expansion
and group sums as fla does (the kernels themselves: tests/gpu/test_gdn_ops.py)."""

from __future__ import annotations

import ast
import inspect
import os
import sys
import types

import pytest

from fusepatch.ops.gated_delta_rule import saved_states as fla_saved_states


def _fla_calls() -> dict[str, set[str]]:
    """Every ``fla.<function>(...)`` call in the module, with the keywords it passes (``**places``: the
    boundaries and the chunk table)."""
    calls: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(inspect.getsource(fla_saved_states))):
        if not isinstance(node, ast.Call):
            continue
        func, name = node.func, None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "fla":
            name = func.attr
        elif isinstance(func, ast.Name) and func.id in fla_saved_states.NEEDS:
            name = func.id  # a local stand-in that passes the keywords on to fla's (ops/gated_delta_rule/dqkwg.py)
        if name is not None:
            names = {k.arg for k in node.keywords if k.arg} | (
                {"cu_seqlens", "chunk_indices"} if any(k.arg is None for k in node.keywords) else set()
            )
            calls.setdefault(name, set()).update(names)
    return calls


def test_every_fla_call_is_in_the_checked_table():
    calls = _fla_calls()
    assert set(calls) == set(fla_saved_states.NEEDS)
    for name, keywords in calls.items():
        assert keywords <= fla_saved_states.NEEDS[name], (name, keywords - fla_saved_states.NEEDS[name])


def test_an_fla_without_a_piece_fails_the_load_with_the_fix(monkeypatch):
    """An fla-core whose chunk module lost a function (or a parameter fusepatch passes) is refused at load, so
    the resolver moves on to fla's own function; the message names the versions that work and the skip."""
    chunk = types.ModuleType("fla.ops.gated_delta_rule.chunk")
    for name in fla_saved_states.NEEDS:
        if name != "chunk_gated_delta_rule_fwd_h":
            params = ", ".join(sorted(fla_saved_states.NEEDS[name]) + ["*args"])
            exec(f"def {name}({params}): pass", chunk.__dict__)
    modules = {
        "fla": types.ModuleType("fla"),
        "fla.ops": types.ModuleType("fla.ops"),
        "fla.ops.gated_delta_rule": types.ModuleType("fla.ops.gated_delta_rule"),
        "fla.ops.gated_delta_rule.chunk": chunk,
        "fla.ops.utils": types.ModuleType("fla.ops.utils"),
        "fla.ops.utils.constant": types.SimpleNamespace(RCP_LN2=1.4426950408889634),
        "fla.ops.utils.index": types.SimpleNamespace(prepare_chunk_indices=None),
    }
    modules["fla.ops.gated_delta_rule"].chunk = chunk
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(ImportError) as caught:
        fla_saved_states.load()
    message = str(caught.value)
    assert "chunk_gated_delta_rule_fwd_h" in message and "flash-linear-attention[cuda]>=0.6,<0.7" in message
    assert "FUSEPATCH_SKIP=gated_delta_rule/fla-saved-states" in message


STAND_IN_SCRIPT = """
import sys, types
import torch
import torch.nn.functional as F

K = 8  # head size (q/k and v alike here)
T = 70  # tokens: two chunks of 64


def expand(x, heads):  # key heads onto value heads, fla's grouping: value head i belongs to key head i // G
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def per_head(x, heads, scale):  # a gradient that differs per value head, so a wrong grouping shows
    return expand(x, heads) * (torch.arange(heads, dtype=x.dtype) + scale)[:, None]


def summed(x, key_heads):  # what fla does with per-value-head q/k gradients: a torch sum over each group
    b, t, hv, k = x.shape
    return x.view(b, t, key_heads, hv // key_heads, k).sum(3)


def l2norm_fwd(x, eps=1e-6, output_dtype=None):
    rstd = torch.rsqrt((x * x).sum(-1) + eps)
    return x * rstd[..., None], rstd


def l2norm_bwd(y, rstd, dy, eps=1e-6):
    return (dy - (dy * y).sum(-1, keepdim=True) * y) * rstd[..., None]


def fused_beta_sigmoid(x, scale=1.0):
    return x.sigmoid()


def fused_beta_sigmoid_bwd(x, dy, scale=1.0):
    return dy * x.sigmoid() * (1 - x.sigmoid())


def chunks(x, reverse=False):  # summed within each 64-token chunk (along dim 1), backwards where reverse
    parts = [p.flip(1) if reverse else p for p in x.split(64, dim=1)]
    return torch.cat([p.cumsum(1).flip(1) if reverse else p.cumsum(1) for p in parts], 1)


def gdn_gate_chunk_cumsum(g, A_log, chunk_size, scale, dt_bias, cu_seqlens=None, chunk_indices=None):
    return chunks(-A_log.float().exp() * F.softplus(g.float() + dt_bias.float())) * scale


def chunk_gated_delta_rule_fwd_intra(k, v, g, beta, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    return expand(k, v.shape[2]) * beta[..., None], v * 2, torch.zeros(*v.shape[:3], chunk_size)


def chunk_gated_delta_rule_fwd_h(k, w, u, g=None, initial_state=None, output_final_state=False, chunk_size=64,
                                 cu_seqlens=None, chunk_indices=None):
    return torch.zeros(u.shape[0], 1, u.shape[2], K, K), u + 1, None


def chunk_fwd_o(q, k, v, h, g, scale, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    return v * expand(q, v.shape[2])


def chunk_bwd_dv_local(q, k, g, do, scale, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    return do * 3


def chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dv, g=None, h0=None, dht=None, scale=None, chunk_size=64,
                                   cu_seqlens=None, chunk_indices=None):
    return torch.zeros(do.shape[0], 1, do.shape[2], K, K), None, dv + do


def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, dv=None, scale=None, chunk_size=64, cu_seqlens=None,
                    chunk_indices=None):
    heads = v.shape[2]
    dq = per_head(q, heads, 1.0) + do
    dk = per_head(k, heads, 0.5) - dv
    if q.shape[2] != heads:
        dq, dk = summed(dq, q.shape[2]), summed(dk, k.shape[2])
    return dq, dk, w * 0, do.sum(-1) + g  # the last: dg, per value head


def prepare_wy_repr_bwd(k, v, beta, A, dw, du, g=None, cu_seqlens=None, chunk_indices=None):
    heads = v.shape[2]
    dk = per_head(k, heads, 2.0) * beta[..., None] + du
    if k.shape[2] != heads:
        dk = summed(dk, k.shape[2])
    return dk, du * 2, du.sum(-1) * 0.5 + beta, g * 0.25 + 1  # dbeta, dg2


def chunk_local_cumsum(g, chunk_size, reverse=False, cu_seqlens=None, chunk_indices=None):
    return chunks(g, reverse)


def gdn_gate_bwd(g, A_log, dt_bias, dyg):
    x = g.float() + dt_bias.float()
    dg = -A_log.float().exp() * torch.sigmoid(x) * dyg
    dA = (dyg * -A_log.float().exp() * F.softplus(x)).flatten(0, 1).sum(0)
    return dg.to(g.dtype), dA.to(A_log.dtype), dg.flatten(0, 1).sum(0).to(dt_bias.dtype)


chunk = types.ModuleType("fla.ops.gated_delta_rule.chunk")
for name, value in list(globals().items()):
    if callable(value) and not name.startswith("_") and name not in ("expand", "per_head", "summed", "chunks"):
        setattr(chunk, name, value)
for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.utils"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["fla.ops.gated_delta_rule.chunk"] = chunk
sys.modules["fla.ops.gated_delta_rule"].chunk = chunk
sys.modules["fla.ops.utils.constant"] = types.SimpleNamespace(RCP_LN2=1.4426950408889634)
sys.modules["fla.ops.utils.index"] = types.SimpleNamespace(prepare_chunk_indices=None)

from fusepatch.ops.gated_delta_rule import saved_states as fla_saved_states
torch.manual_seed(0)
for key_heads, value_heads in ((2, 6), (3, 3)):
    inputs = [torch.randn(2, T, key_heads, K), torch.randn(2, T, key_heads, K), torch.randn(2, T, value_heads, K),
              torch.randn(2, T, value_heads), torch.randn(2, T, value_heads), torch.randn(value_heads),
              torch.randn(value_heads)]
    cot = torch.randn(2, T, value_heads, K)
    results = []
    # plain; grouped with fla's input functions; grouped with fusepatch's input kernels (the default)
    for grouped, fused in ((False, False), (True, False), (True, True)):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        out = fla_saved_states.load(grouped, fused_inputs=fused)(*leaves)
        results.append([out.detach(), *torch.autograd.grad(out, leaves, cot)])
    names = ["out", "dq", "dk", "dv", "da", "db", "dA_log", "ddt_bias"]
    for name, plain, grouped, fused in zip(names, *results):
        assert plain.abs().sum() > 0, name  # every gradient reaches the stand-ins and back
        for got, what in ((grouped, "grouped"), (fused, "fused inputs")):
            torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5, msg=f"{what}: {name} ({key_heads}/{value_heads})")
print("ok")
"""


def test_grouped_backward_equals_fla_summing_the_groups():
    """fla-saved-states-grouped hands fla's two per-value-head gradient kernels q and k expanded to the value heads
    and sums the groups (and adds the two k gradients) in fusepatch's L2-norm backward kernel, and by default runs
    the per-token inputs (q/k norms, beta, the chunk-summed decay) and their gradients in its own kernels. With
    stand-ins for fla's pieces whose q/k gradients differ per value head, which sum the groups in torch where they
    get key heads (as fla does), and whose input functions compute what fla's do, every output and gradient equals
    the plain path's, with fla's input functions and with fusepatch's: grouped value heads (2 key / 6 value heads)
    and none (3 / 3), two chunks of a batch of two. Run in Triton's CPU interpreter (the kernels are Triton)."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", STAND_IN_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
