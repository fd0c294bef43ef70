"""DeepSpeed ZeRO-3: a parameter a patched forward reads outside its own module's forward, gathered as DeepSpeed
gathers it.

ZeRO-3 keeps each parameter as a shard and an empty placeholder (``ds_status`` NOT_AVAILABLE), and gathers a
module's own parameters in a hook before the module's forward (and its backward) and frees them after it. The
fused paths read some parameters of other modules without calling them: the fused loss reads ``lm_head.weight``
(after transformers' forward called ``lm_head`` for no position, whose hook freed it again), the fused residual add
and norm the post-attention norm's weight, the Gated DeltaNet its ``conv1d``'s and its output norm's. Each such read
goes through :func:`gather`, which does what DeepSpeed's own attribute getter does for a read of another module's
parameter inside the engine's forward (``ZeROOrderedDict.__getitem__``, deepspeed/runtime/zero/parameter_offload.py):
it registers the parameter as an external parameter of the module whose forward reads it
(``deepspeed.zero.register_external_parameter``), and gathers it if it is not there. From then on DeepSpeed gathers
it with that module, forward and backward (the fused ops' autograd functions keep the weight for the backward), and
frees it after that module, as it frees the module's own; the read holds it no longer than the module's forward.

``GatheredParameters`` is not used: it frees the parameter when its block ends, before the backward that needs it,
and the module's hooks know nothing of it.

The projections' shared-input and residual GEMMs and the fused LoRA GEMMs read their modules' weights too, but they
run only for modules without hooks (``layers/support/hooks.hooked``): ZeRO-3 hooks every module, so under it those
modules are called, and gathered by their own hooks.

DeepSpeed is never imported here: a parameter carries ``ds_id`` only when ZeRO-3 partitioned it, by when DeepSpeed
is imported. ZeRO-1 and ZeRO-2 leave parameters whole (they partition gradients and optimizer state): nothing to do.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

from fusepatch.base.private_names import PrivateNames

PARTITION = "deepspeed.runtime.zero.partition_parameters"  # deepspeed.zero's functions are this module's

NAMES = PrivateNames(
    distribution="deepspeed",
    checked=("0.19.8",),
    # and the attributes ZeRO-3 gives each parameter it partitions: ds_id, ds_status, all_gather()
    names={PARTITION: ("register_external_parameter", "ZeroParamStatus")},
    fix='pip install "deepspeed>=0.19,<0.20"',
)


def partitioned(param: torch.Tensor | None) -> bool:
    """Whether ZeRO-3 partitions ``param`` (it carries DeepSpeed's parameter id)."""
    return param is not None and hasattr(param, "ds_id")


def full_shape(param: torch.Tensor) -> torch.Size:
    """``param``'s shape as the model defines it: under ZeRO-3 the partitioned parameter's own (``ds_shape``; the
    placeholder in its place is empty), else the tensor's."""
    return torch.Size(param.ds_shape) if partitioned(param) else param.shape


def gather(owner: torch.nn.Module, *params: torch.Tensor | None) -> None:
    """Make each of ``params`` whole for ``owner``'s forward, and for its backward, under ZeRO-3: an external
    parameter of ``owner``, gathered now if it is not. Nothing for a parameter ZeRO-3 does not partition (the
    usual case: one attribute lookup each)."""
    for param in params:
        if not partitioned(param):
            continue
        zero = _partition_module()
        zero.register_external_parameter(owner, param)  # a dict entry by id: again and again costs nothing
        if param.ds_status == zero.ZeroParamStatus.NOT_AVAILABLE:
            param.all_gather()


def _partition_module():
    """DeepSpeed's module of ZeRO-3's partitioned parameters (imported: it partitioned the parameter in hand), with
    the names :func:`gather` calls; an error naming the fix where this DeepSpeed lacks one: the fused path cannot
    compute on an empty placeholder."""
    zero = sys.modules[PARTITION]
    if not all(hasattr(zero, name) for name in NAMES.names[PARTITION]):
        missing = NAMES.missing()  # said once as drift
        raise RuntimeError(
            f"fusepatch: DeepSpeed {NAMES.installed()} lacks {', '.join(missing)}, which fusepatch's fused layers "
            f"need to gather a ZeRO-3 parameter they read outside its module; fix: {NAMES.fix} "
            f"(checked: {', '.join(NAMES.checked)}), or fusepatch.revert(model)"
        )
    return zero


def describe(model: torch.nn.Module) -> tuple[str, ...]:
    """What the report says of ZeRO-3 for ``model``: nothing when it is not partitioned; else that it is, how
    the fused paths read other modules' parameters under it, and which parameters patched modules have gathered
    so far as external parameters (their first forward registers them), per layer class."""
    names = {id(p): n for n, p in model.named_parameters()}
    if not any(partitioned(p) for p in model.parameters()):
        return ()
    lines = [
        "DeepSpeed ZeRO-3 partitions the parameters: a fused path that reads another module's parameter (the "
        "fused loss: lm_head's weight; the fused add + norm: the post-attention norm's; the Gated DeltaNet: its "
        "conv1d's and its norm's) registers it as an external parameter of its own module, which DeepSpeed gathers "
        "and frees with that module; the shared-input projections, the residual GEMM and the fused LoRA GEMMs "
        "call their modules instead (ZeRO-3 hooks every module)"
    ]
    gathered: dict[str, set[str]] = defaultdict(set)
    counts: dict[str, int] = defaultdict(int)
    prefix = {id(m): f"{n}." if n else "" for n, m in model.named_modules()}
    for module in model.modules():
        # DeepSpeed's registry of a module's external parameters (id -> parameter), set by register_external_parameter
        external = getattr(module, "_external_params", None)
        if "_fusepatch" not in module.__dict__ or not external:
            continue
        layer = type(module).__name__
        counts[layer] += 1
        for param in external.values():
            name = names.get(id(param), "?")
            gathered[layer].add(name.removeprefix(prefix.get(id(module), "")))
    for layer, params in gathered.items():
        lines.append(f"DeepSpeed ZeRO-3: {layer} x{counts[layer]} gathers {', '.join(sorted(params))}")
    return tuple(lines)
