"""The causal-conv1d candidate calls the package's compiled kernels past its custom ops (ops/causal_conv1d/).

A stand-in extension module with causal-conv1d 1.7's signatures (pybind11 signature lines in the docstrings) computes the
package's results with the eager reference, so that on CPU the test checks what fusepatch adds: the argument order
of both calls, the channel-last buffers, the fp32 weight/bias gradients cast back, the package's function under
torch.compile and wherever the extension's signatures are not the ones it knows.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from fusepatch.ops import causal_conv1d as conv
from fusepatch.ops.causal_conv1d import causal_conv1d_reference

FWD_DOC = (
    "causal_conv1d_fwd(arg0: torch.Tensor, arg1: torch.Tensor, arg2: Optional[torch.Tensor], arg3: "
    "Optional[torch.Tensor], arg4: Optional[torch.Tensor], arg5: torch.Tensor, arg6: Optional[torch.Tensor], "
    "arg7: bool) -> None\n"
)
BWD_DOC = "causal_conv1d_bwd(" + ", ".join(f"arg{i}: torch.Tensor" for i in range(12)) + ") -> None\n"


def _reference_bdt(x_bdt, weight, bias, seq_idx, silu):
    """The package's forward on [B, D, T] views, through the reference (seq_idx as document numbers)."""
    x = x_bdt.transpose(1, 2)
    cu = None
    if seq_idx is not None:
        docs = seq_idx[0].long()
        starts = torch.nonzero(torch.diff(docs, prepend=docs[:1] - 1)).flatten()
        cu = torch.cat([starts, torch.tensor([docs.numel()])])
    return causal_conv1d_reference(x, weight, bias, "silu" if silu else None, cu_seqlens=cu).transpose(1, 2)


def _extension(calls: list):
    ext = types.ModuleType("causal_conv1d_cuda")

    def fwd(x, weight, bias, seq_idx, initial_states, out, final_states_out, silu):
        calls.append(("fwd", x.stride(1) == 1, out.stride(1) == 1, initial_states, final_states_out))
        out.copy_(_reference_bdt(x, weight, bias, seq_idx, silu))

    def bwd(x, weight, bias, dout, seq_idx, initial_states, dfinal, dx, dweight, dbias, dinitial, silu):
        calls.append(("bwd", dweight.dtype, None if dbias is None else dbias.dtype, dinitial))
        with torch.enable_grad():  # a backward runs without grad mode
            leaves = [t.detach().requires_grad_(True) for t in (x, weight)]
            b = None if bias is None else bias.detach().requires_grad_(True)
            out = _reference_bdt(leaves[0], leaves[1], b, seq_idx, silu)
            grads = torch.autograd.grad(out, [*leaves, *([b] if b is not None else [])], dout)
        dx.copy_(grads[0])
        dweight.add_(grads[1])
        if dbias is not None:
            dbias.add_(grads[2])

    fwd.__doc__, bwd.__doc__ = FWD_DOC, BWD_DOC
    ext.causal_conv1d_fwd, ext.causal_conv1d_bwd = fwd, bwd
    return ext


@pytest.fixture
def package(monkeypatch):
    """Stand-ins for the package (its causal_conv1d_fn marks calls) and its extension."""
    calls: list = []
    pkg = types.ModuleType("causal_conv1d")

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None):
        calls.append(("package",))
        return _reference_bdt(x, weight, bias, seq_idx, activation in ("silu", "swish"))

    pkg.causal_conv1d_fn = causal_conv1d_fn
    monkeypatch.setitem(sys.modules, "causal_conv1d", pkg)
    monkeypatch.setitem(sys.modules, "causal_conv1d_cuda", _extension(calls))
    return calls


def _run(fn, packed: bool, bias: bool):
    torch.manual_seed(0)
    x = torch.randn(1, 23, 12, requires_grad=True)
    weight = torch.randn(12, 4, requires_grad=True)
    b = torch.randn(12, requires_grad=True) if bias else None
    cu = torch.tensor([0, 9, 10, 23], dtype=torch.int32) if packed else None
    out = fn(x, weight, b, activation="silu", cu_seqlens=cu)
    leaves = [x, weight, *([b] if bias else [])]
    cotangent = torch.randn(out.shape)  # not randn_like: the reference's output is a transposed view
    return [out.detach(), *torch.autograd.grad(out, leaves, cotangent)]


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_direct_path_equals_the_package(package, packed, bias):
    direct = conv._load_causal_conv1d()
    got = _run(direct, packed, bias)
    want = _run(conv.causal_conv1d_reference, packed, bias)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    kinds = [c[0] for c in package]
    assert kinds == ["fwd", "bwd"], kinds  # past the package's function, both ways
    _, x_channel_last, out_channel_last, initial, final = package[0]
    assert x_channel_last and out_channel_last and initial is None and final is None
    _, dweight_dtype, dbias_dtype, dinitial = package[1]
    assert dweight_dtype == torch.float32 and dbias_dtype == (torch.float32 if bias else None) and dinitial is None


def test_other_signatures_keep_the_package_function(package, monkeypatch):
    ext = sys.modules["causal_conv1d_cuda"]
    monkeypatch.setattr(ext.causal_conv1d_fwd, "__doc__", "causal_conv1d_fwd(arg0: torch.Tensor) -> torch.Tensor")
    _run(conv._load_causal_conv1d(), packed=False, bias=False)
    assert [c[0] for c in package] == ["package"]


def test_torch_compile_tracing_gets_the_package_function(package, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _run(conv._load_causal_conv1d(), packed=False, bias=False)
    assert [c[0] for c in package] == ["package"]
