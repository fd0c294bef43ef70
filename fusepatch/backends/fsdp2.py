"""FSDP2 (torch's ``fully_shard``): a frozen weight kept between steps only as each rank's rows of what a kernel
prepared of it (a low-precision projection's quantized rows and their scales), and all-gathered as that.

FSDP2 splits each parameter along its rows, keeps each rank's rows (the local shard of a DTensor), and gathers the
whole parameter before its unit's forward and backward, freeing it after (reshard). torch's extension for
low-precision gathers (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, "all-gather extensions") lets the local
shard be a tensor with ``fsdp_pre_all_gather`` (what to gather from it) and ``fsdp_post_all_gather`` (the unsharded
parameter from what was gathered). :func:`keep_sharded` makes a frozen weight's local shard such a tensor
(:class:`PreparedShard`): it gathers the handle its rows were prepared into (every tensor of it running along the
weight's rows, as rowwise quantization does: the rows of the whole weight prepared are the rows prepared, bit for
bit), and the unsharded parameter (:class:`GatheredWeight`) holds the gathered handle and no values, as a dropped
weight does (``carry`` marks it for the dispatcher). FSDP2 frees and refills those buffers as it does a bf16
weight's: a backward reads the same storage its forward saved.

The local shard either keeps its values (it is them: the weight can still be read, written, saved) and its handle
is checked against them before every gather (``current``: the dispatcher's fingerprint rule), or the handle is all
that is left (``drop``: :class:`DroppedShard`, which refuses every read and write of values, as a dropped weight
does).

What is read here is torch's, not promised to stay: the table below, and of ``FSDPParam`` the attributes
``sharded_param``, ``_sharded_param_data``, ``fsdp_placement``, ``post_forward_mesh_info``, ``mesh_info``,
``offload_to_cpu``, ``is_dtensor``, ``padded_sharded_param_size``, ``all_gather_outputs``, ``_unsharded_param``,
``_unsharded_inner_tensors``, ``_module_info`` and the methods ``METHODS``; of an FSDP2 state
``_fsdp_param_groups`` and their ``fsdp_params``. Checked on torch 2.13 (whose one-rank path gathers only one tensor
a parameter: nothing is kept sharded at one rank). A torch without the table's names keeps nothing sharded: each
call quantizes the weight FSDP2 gathered (said once as drift).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fusepatch.base.private_names import PrivateNames

STATES = "torch.distributed._composable_state"
PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"

NAMES = PrivateNames(
    distribution="torch",
    checked=("2.13.0",),
    names={STATES: ("_module_state_mapping",), PARAM: ("FSDPParam", "ShardedState")},
    fix='pip install "torch==2.13.*"',
)

# why a frozen weight FSDP2 shards is quantized at each call instead of kept sharded (checked in this order)
NOT_KEPT = {
    "single": "one rank: nothing is sharded (and torch's path for one rank gathers one tensor a parameter)",
    "placement": "sharded along another dimension than its rows (shard_placement_fn)",
    "uneven": "its rows do not split evenly over the ranks (torch's extension gathers only even shards)",
    "post_forward": "reshard_after_forward is a number of ranks (torch's extension does not reshard to one)",
    "offload": "CPU offload (CPUOffloadPolicy)",
    "dtensor": "a DTensor before sharding (tensor parallel)",
    "torch": "this torch lacks what fusepatch reads of FSDP2",
}


def _param_groups(state: Any) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    return list(groups) if groups else []


_index: dict[int, tuple[weakref.ref, Any]] = {}  # id(module) -> (the module, its weight's FSDPParam)
_indexed: list[int] = [0]  # the module states the index was built from (a hash of their ids)


def param_of(module: torch.nn.Module, name: str = "weight") -> Any | None:
    """The ``FSDPParam`` that shards ``module``'s parameter ``name``; None where FSDP2 shards nothing of it. One
    dictionary lookup where no module of the process is sharded, or where this one is; else a look at the states'
    ids (tens), and the index built again where they changed (a model sharded since)."""
    states = sys.modules.get(STATES)
    mapping = getattr(states, "_module_state_mapping", None)
    if not mapping:
        return None
    found = _index.get(id(module))
    if found is None or found[0]() is not module:
        built = hash(tuple(id(key) for key in list(mapping.keys())))
        if built != _indexed[0] or found is not None:  # states changed, or this module's entry is a freed one's
            _rebuild(mapping)
            _indexed[0] = built
            found = _index.get(id(module))
    if found is None or found[0]() is not module:
        return None
    param = found[1]
    return param if getattr(param, "_module_info", None) is not None and param._module_info.param_name == name else None


def _rebuild(mapping) -> None:
    _index.clear()
    for ref in list(mapping.values()):
        state = ref()
        for group in _param_groups(state):
            for param in group.fsdp_params:
                module = param._module_info.module
                if param._module_info.param_name == "weight":
                    _index[id(module)] = (weakref.ref(module), param)


METHODS = ("_init_extensions", "_setattr_on_modules")  # of FSDPParam


def _torch_lacks() -> bool:
    """Whether this torch lacks a name read here (said once as drift). Asked at a projection's first prepared call
    (and by the report): a few attribute lookups."""
    gone = NAMES.missing()
    fsdp_param = getattr(sys.modules.get(PARAM), "FSDPParam", None)
    for name in METHODS:
        if fsdp_param is not None and not hasattr(fsdp_param, name):
            NAMES.drift(f"{PARAM}.FSDPParam.{name} is missing", NOT_KEPT_FALLBACK)
            gone.append(name)
    return bool(gone)


NOT_KEPT_FALLBACK = "frozen projections prepare the weight FSDP2 gathered at each call, keeping no copy"


def why_not_kept(param: Any) -> str | None:
    """None where :func:`keep_sharded` can keep ``param`` sharded as its prepared rows, else the key of
    ``NOT_KEPT`` that says why not."""
    if getattr(param.mesh_info, "shard_mesh_size", 1) == 1:
        return "single"
    if _torch_lacks():
        return "torch"
    placement = getattr(param, "fsdp_placement", None)
    if getattr(placement, "dim", 0) != 0:
        return "placement"
    local = param.sharded_param._local_tensor
    if tuple(local.shape) != tuple(param.padded_sharded_param_size):
        return "uneven"
    if param.post_forward_mesh_info not in (None, param.mesh_info):  # reshards to fewer ranks after the forward
        return "post_forward"
    if param.offload_to_cpu:
        return "offload"
    if param.is_dtensor:
        return "dtensor"
    return None


class PreparedShard(torch.Tensor):
    """A frozen weight's local shard (its rows, values kept) that FSDP2 gathers as the handle its rows were
    prepared into: ``current()`` gives that handle holding the values now (the dispatcher's check), ``carry``
    marks the unsharded weight built from the gathered handle."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # everything else: a plain tensor of its values

    current: Callable[[], tuple]
    carry: Callable[[torch.Tensor, tuple], None]
    restore: Callable[[tuple], torch.Tensor]  # the weight's rows from the handle (rounded), for ``revert``

    def handle(self) -> tuple:
        return self.current()

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return tuple(self.handle()), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if out is not None:  # the unsharded weight made before holds views of these same buffers
            return None
        handle = type(self.handle())(*outputs)
        gathered = GatheredWeight.of(handle, param_dtype or self.dtype)
        self.carry(gathered, handle)
        return gathered, ()


class DroppedShard(PreparedShard):
    """A dropped frozen weight's local shard (``drop_frozen_weights=True``): its rows' handle and no values (a meta
    tensor of the shard's shape and dtype). Reading or writing values raises ``refusal``; ``detach`` (``state_dict``,
    ``.data``) gives another of its kind."""

    kept: tuple
    refusal: str

    def handle(self) -> tuple:
        return self.kept

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return args[0]._like()
        raise RuntimeError(args[0].refusal if args and isinstance(args[0], DroppedShard) else _REFUSED)

    def _like(self) -> DroppedShard:
        twin = _meta_subclass(DroppedShard, self)
        twin.kept, twin.refusal, twin.carry, twin.restore = self.kept, self.refusal, self.carry, self.restore
        return twin

    def __reduce_ex__(self, protocol):
        raise RuntimeError(self.refusal)


_REFUSED = "fusepatch: this weight is kept by FSDP2 as its prepared rows only; fix: fusepatch.revert(model)"


def _meta_subclass(cls: type, like: torch.Tensor) -> torch.Tensor:
    meta = torch.empty(tuple(like.shape), dtype=like.dtype, device="meta")
    return torch.Tensor._make_subclass(cls, meta)


class GatheredWeight(torch.Tensor):
    """The unsharded weight FSDP2 builds from a :class:`PreparedShard`'s gathered handle: the weight's shape, dtype
    and device, no values; its handle (``handle``, views of FSDP2's gather buffers, freed and refilled with them) is
    what the kernel computes with. Reading it for values raises ``REFUSED_GATHERED``."""

    handle: tuple

    @staticmethod
    def of(handle: tuple, dtype: torch.dtype) -> GatheredWeight:
        first = handle[0]
        shape = (first.shape[0], first.shape[1])
        made = torch.Tensor._make_wrapper_subclass(
            GatheredWeight, shape, dtype=dtype, device=first.device, requires_grad=False
        )
        made.handle = handle
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        source = args[0] if args else None
        if isinstance(source, GatheredWeight) and func in _SAME:
            if func is torch.ops.aten.as_strided.default and tuple(args[1]) != tuple(source.shape):
                raise RuntimeError(REFUSED_GATHERED)
            twin = GatheredWeight.of(source.handle, source.dtype)
            twin.__dict__.update({k: v for k, v in source.__dict__.items() if k != "handle"})
            return twin
        raise RuntimeError(REFUSED_GATHERED)

    def __repr__(self, **kwargs) -> str:
        return f"GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}: gathered by FSDP2 as its prepared rows)"


_SAME = (torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.as_strided.default)
REFUSED_GATHERED = (
    "fusepatch: under FSDP2 with apply(precision=...) a frozen projection's weight is gathered as its copy in that "
    "precision only (each rank keeps its rows so), which its own forward computes with; code that reads its values "
    "inside the forward cannot; fix: for peft's DoRA (or another LoRA variant), call get_peft_model before "
    "fusepatch.apply (their bases are then gathered with their values); else fusepatch.revert(model)"
)


def keep_sharded(
    param: Any,
    whole: tuple,
    shard: tuple | None,
    *,
    carry: Callable[[torch.Tensor, tuple], None],
    current: Callable[[PreparedShard], tuple] | None,
    restore: Callable[[tuple], torch.Tensor],
    refusal: str,
) -> torch.Tensor:
    """Make FSDP2 keep ``param`` (a frozen weight, unsharded now: inside its unit's forward) as ``shard``, its
    local rows prepared, and gather that from now on; returns the unsharded weight for this call, holding ``whole``
    (the gathered weight prepared now, the same bits the gathers will bring: rows are prepared alone).

    ``current``: the handle of the shard's values now (they are kept); None: drop the values (``shard``, the local
    rows prepared, is all that is left). Call only where :func:`why_not_kept` is None."""
    local = param.sharded_param._local_tensor
    if current is None:
        kept = _meta_subclass(DroppedShard, local)
        kept.kept, kept.refusal = shard, refusal
        param._sharded_param_data = local.new_empty(0)  # the padded bf16 shard FSDP2 gathers by default: gone
    else:
        kept = torch.Tensor._make_subclass(PreparedShard, local)
        kept.current = lambda: current(kept)
    kept.carry, kept.restore = carry, restore
    param.sharded_param._local_tensor = kept
    param._init_extensions()
    # the buffers FSDP2 gathers into from now on, filled now from ``whole``: this call computes with views of them,
    # FSDP2 frees them at the reshard and refills them for the backward
    outputs = [tensor.reshape(-1).clone() for tensor in whole]
    handle = type(whole)(*(buffer.view(tensor.shape) for buffer, tensor in zip(outputs, whole)))
    param.all_gather_outputs = outputs
    param._unsharded_inner_tensors = []
    gathered = torch.nn.Parameter(GatheredWeight.of(handle, param._unsharded_param.dtype), requires_grad=False)
    carry(gathered, handle)
    param._unsharded_param = gathered
    param._setattr_on_modules(gathered)  # the bf16 weight gathered for this call goes with this forward
    return gathered


def kept_shard(param: Any) -> PreparedShard | None:
    """``param``'s local shard where :func:`keep_sharded` made it one."""
    local = getattr(getattr(param, "sharded_param", None), "_local_tensor", None)
    return local if isinstance(local, PreparedShard) else None


def release(param: Any, values: torch.Tensor) -> None:
    """``revert``: ``param`` (sharded now: between steps) keeps ``values`` as its local shard again and gathers them
    as FSDP2 does by default."""
    local = values.detach().contiguous()
    param.sharded_param._local_tensor = local
    param._sharded_param_data = local.view(-1)
    param._init_extensions()
    if hasattr(param, "_extensions_data"):
        del param._extensions_data
    param.all_gather_outputs = []
    param._unsharded_inner_tensors = []
    if hasattr(param, "_unsharded_param"):
        del param._unsharded_param  # made again from the next gather
