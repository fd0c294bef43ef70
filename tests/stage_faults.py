"""A fault inside one stage of a composite kernel: the stages each candidate calls, and a wrapper that calls a stage
and then spoils one of its outputs. Shared by tests/gpu/test_gpu_stage_faults.py (the real kernels on a GPU) and
tests/stage_faults_interpreter.py (the delta rule's Triton kernels on the CPU, in Triton's interpreter)."""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass

import torch

FAULTS = ("x1.02", "x0.98", "nan", "zero_tile")
SWEEP = ("x1.01",)  # recorded, not asserted: whether a stage's fault is refused at half the factor
GDN = "fla.ops.gated_delta_rule.chunk"


@dataclass(frozen=True)
class Stage:
    """A function a candidate calls, found by its module and name at call time.

    ``writes``: the arguments (positions or keyword names) it writes its results into, in place; its return value
    counts too where ``returns``; ``loader``: ``name`` returns the stage function (``dqkwg.load``), which is then
    wrapped."""

    module: str
    name: str
    writes: tuple[int | str, ...] = ()
    returns: bool = False
    loader: bool = False

    @property
    def label(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.name}"


FLA_DELTA_RULE = tuple(
    Stage(GDN, name)
    for name in (
        *("gdn_gate_chunk_cumsum", "chunk_local_cumsum", "fused_beta_sigmoid", "l2norm_fwd"),
        *("chunk_gated_delta_rule_fwd_intra", "recompute_w_u_fwd", "chunk_gated_delta_rule_fwd_h", "chunk_fwd_o"),
        *("chunk_bwd_dv_local", "chunk_gated_delta_rule_bwd_dhu", "chunk_bwd_dqkwg", "prepare_wy_repr_bwd"),
        *("gdn_gate_bwd", "fused_beta_sigmoid_bwd", "l2norm_bwd"),
    )
)
# fusepatch's delta rule calls fla's stages one by one, its TileLang dqkwg through ops/gated_delta_rule/dqkwg.py,
# and its own input kernels
SAVED_STATES = (
    *(stage for stage in FLA_DELTA_RULE if stage.name != "chunk_bwd_dqkwg"),
    Stage("fusepatch.ops.gated_delta_rule.dqkwg", "load", loader=True),
    Stage("fusepatch.kernels.delta_rule_inputs", "delta_rule_inputs"),
    Stage("fusepatch.kernels.delta_rule_inputs", "delta_rule_inputs_bwd"),
    Stage("fusepatch.kernels.l2norm", "l2norm_bwd_grouped"),
    Stage("fusepatch.kernels.heads", "repeat_heads"),
)
FP8 = (
    Stage("fusepatch.kernels.fp8", "quantize_rows"),
    Stage("fusepatch.kernels.fp8", "quantize_columns"),
    Stage("fusepatch.kernels.fp8", "transpose"),
    Stage("torch", "_scaled_mm"),
)
# (op, candidate) -> the stages it may call; a stage a call does not reach is recorded as such
COMPOSITES: dict[tuple[str, str], tuple[Stage, ...]] = {
    ("gated_delta_rule", "fla-saved-states-grouped"): SAVED_STATES,
    ("gated_delta_rule", "fla-saved-states"): SAVED_STATES,
    ("gated_delta_rule", "fla"): FLA_DELTA_RULE,
    ("gated_delta_rule", "fla-gate-outside"): FLA_DELTA_RULE,
    ("causal_conv1d", "causal-conv1d"): (
        Stage("causal_conv1d_cuda", "causal_conv1d_fwd", writes=(5,)),
        Stage("causal_conv1d_cuda", "causal_conv1d_bwd", writes=(7, 8, 9)),
    ),
    ("causal_conv1d", "fla-conv"): (
        Stage("fla.modules.causal_conv1d.ops", "causal_conv1d_fwd"),
        Stage("fla.modules.causal_conv1d.ops", "causal_conv1d_bwd"),
    ),
    ("linear_cross_entropy", "fla"): (
        Stage("fla.modules.fused_cross_entropy.ops", "cross_entropy_fwd"),
        # the gradient is written into the logits (inplace_backward=True)
        Stage("fla.modules.fused_cross_entropy.ops", "cross_entropy_bwd", writes=("logits",)),
    ),
    # the loss returned, the gradient written into the logits
    ("linear_cross_entropy", "triton"): (Stage("fusepatch.kernels.cross_entropy", "cross_entropy_", (0,), True),),
    ("fp8_linear", "scaled-mm"): FP8,
}
PACKED = ("gated_delta_rule", "causal_conv1d")


def spoil(tensor: torch.Tensor, fault: str, in_place: bool) -> torch.Tensor:
    """``tensor`` with ``fault``: a factor, one NaN, or a zeroed tile of 64 rows x 64 columns (rows: the tensor
    flattened over its last dimension) in its middle."""
    if fault.startswith("x"):
        changed = tensor.float() * float(fault[1:])
    else:
        changed = tensor.float().clone()
        flat = changed.reshape(-1, changed.shape[-1]) if changed.ndim else changed.reshape(1, 1)
        middle = flat.shape[0] // 2 // 64 * 64
        if fault == "nan":
            flat[flat.shape[0] // 2, flat.shape[1] // 2] = float("nan")
        else:
            flat[middle : middle + 64, :64] = 0
    changed = changed.to(tensor.dtype)
    if in_place:
        tensor.copy_(changed)
        return tensor
    return changed


def spoilable(value, fault: str) -> bool:
    """A float tensor with elements; an FP8 tensor takes no factor (x1.02 rounds back to the same FP8 value)."""
    if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0):
        return False
    return not (fault.startswith("x") and value.element_size() == 1)


class Wrapper:
    """Calls the stage, then spoils its output ``index`` with ``fault``: the outputs are the tensors it returns,
    then the arguments it writes (``Stage.writes``: positions or keyword names). Counts calls, so a stage that a
    call never reaches is told from one whose fault passed."""

    def __init__(self, stage: Stage, fault: str | None, index: int):
        self.stage, self.fault, self.index = stage, fault, index
        self.calls = 0
        self.outputs = 0
        self.applied = False  # the fault took (an FP8 output takes no factor; a None output nothing)

    def _written(self, args, kwargs) -> list:
        return [kwargs.get(w) if isinstance(w, str) else args[w] if w < len(args) else None for w in self.stage.writes]

    def wrap(self, fn):
        @functools.wraps(fn)
        def stage(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.calls += 1
            outs = out if isinstance(out, tuple) else (out,)
            written = self._written(args, kwargs)
            returned = () if self.stage.writes and not self.stage.returns else outs
            self.outputs = len(returned) + len(written)
            if self.fault is None or self.index >= self.outputs:
                return out
            if self.index >= len(returned):
                target = written[self.index - len(returned)]
                if spoilable(target, self.fault):
                    spoil(target, self.fault, in_place=True)
                    self.applied = True
                return out
            if spoilable(outs[self.index], self.fault):
                outs = (*outs[: self.index], spoil(outs[self.index], self.fault, False), *outs[self.index + 1 :])
                self.applied = True
            return outs if isinstance(out, tuple) else outs[0]

        return stage


@contextlib.contextmanager
def injected(stage: Stage, fault: str | None, index: int = 0):
    module = importlib.import_module(stage.module)
    original = getattr(module, stage.name)
    wrapper = Wrapper(stage, fault, index)
    if stage.loader:
        replacement = functools.wraps(original)(lambda *a, **k: wrapper.wrap(original(*a, **k)))
    else:
        replacement = wrapper.wrap(original)
    setattr(module, stage.name, replacement)
    try:
        yield wrapper
    finally:
        setattr(module, stage.name, original)


def same(errors: dict[str, float], clean: dict[str, float]) -> bool:
    return errors.keys() == clean.keys() and all(abs(errors[q] - clean[q]) <= 0.05 * clean[q] + 1e-6 for q in clean)
