"""The patched Gated DeltaNet forward dispatches the same number of aten ops at any sequence length.

The story's trace: the reference delta rule is a Python loop of small ops per 64-token chunk, so the CPU
cannot keep up. On the GPU each fused op is one kernel call; what fusepatch adds around the kernels (projections,
reshapes, packing boundaries, gate inputs) must not grow with the sequence either. Here, on CPU, stand-in kernels
(the eager references behind a marker) take the place of fla/causal-conv1d, and a dispatch mode counts every
aten op the layer forward dispatches outside them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusepatch
from fusepatch.base.op import Candidate
from fusepatch.base.requirements import InputRule
from fusepatch.engine import selftest
from fusepatch.ops import OPS
from fusepatch.tools.tiny import tiny_model

KERNEL_OPS = ("causal_conv1d", "gated_delta_rule", "gated_rms_norm")
_inside_kernel = [0]


class _CountOutsideKernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.active = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active and not _inside_kernel[0]:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _opaque(reference):
    def kernel(*args, **kwargs):
        _inside_kernel[0] += 1
        try:
            return reference(*args, **kwargs)
        finally:
            _inside_kernel[0] -= 1

    return kernel


@pytest.fixture
def stand_in_kernels(monkeypatch):
    cpu = InputRule(devices=("cpu",), dtypes=("float32",), kernel="stand-in")
    for name in KERNEL_OPS:
        op = OPS[name]
        fake = Candidate(f"stand-in-{name}", "pip", (), (lambda ref=op.reference: _opaque(ref)), inputs=cpu)
        monkeypatch.setitem(OPS, name, dataclasses.replace(op, candidates=(fake,)))
    selftest.clear_cache()
    yield
    selftest.clear_cache()


def _gdn_forward_ops(model, length: int, packed: bool) -> int:
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    mode = _CountOutsideKernels()

    def start(*_):
        mode.active = True

    def stop(*_):
        mode.active = False

    handles = [layer.register_forward_pre_hook(start), layer.register_forward_hook(stop)]
    ids = torch.randint(0, 512, (1, length))
    kwargs = {}
    if packed:  # three documents in the row
        cuts = [length // 3, length // 3, length - 2 * (length // 3)]
        kwargs["position_ids"] = torch.cat([torch.arange(n) for n in cuts])[None]
    with torch.no_grad(), mode:
        model(input_ids=ids, use_cache=False, **kwargs)
    for handle in handles:
        handle.remove()
    return mode.count


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_patched_gdn_layer_ops_do_not_grow_with_the_sequence(stand_in_kernels, model_type, packed):
    model = tiny_model(model_type)
    report = fusepatch.apply(model)
    chosen = {c.op: c.chosen for layer in report.layers for c in layer.choices}
    assert all(chosen[name] == f"stand-in-{name}" for name in KERNEL_OPS), chosen
    _gdn_forward_ops(model, 96, packed)  # a first packed call self-tests the packed kernels: not counted
    short, long = (_gdn_forward_ops(model, n, packed) for n in (96, 960))
    assert short == long, (short, long)

    eager = tiny_model(model_type)  # the reference paths, for contrast: a loop over 64-token chunks
    fusepatch.apply(eager, exclude=list(OPS))
    eager_short, eager_long = (_gdn_forward_ops(eager, n, packed) for n in (96, 960))
    assert eager_long > eager_short + 50 and short < eager_short, (short, eager_short, eager_long)
