"""CausalLM forward with the loss as a fused linear cross-entropy: with ``labels`` the full ``tokens x vocab``
logits are never materialised (4 GB in fp32 per 4096 tokens at Qwen3.5's 248k vocabulary, plus their
gradient). The output's ``logits`` are then None (in their place among the fields, and in the ``return_dict=False``
tuple) unless the call asks for them with ``return_logits=True``; every other field, the loss's value and its fp32
dtype are transformers'. Without labels, with ``logits_to_keep`` or when the op falls back to eager, transformers'
own forward runs unchanged.
"""

from __future__ import annotations

import functools

import torch

from fusepatch.backends import deepspeed
from fusepatch.base.dtypes import autocast_dtype, dtype_name, fsdp_compute_dtype
from fusepatch.base.row import Binding
from fusepatch.layers.support import bindings
from fusepatch.layers.support.hooks import may_bypass
from fusepatch.layers.support.labelled_rows import LabelledRows, check_fit
from fusepatch.layers.support.packing import note_padding, traced_plain_call
from fusepatch.layers.support.positions import FIND_PACKED, MASKING, plain_positions, skip_plain, wants_plain_positions

PLAIN_SLOT = "plain_positions"  # the context's slot (``bindings.inside``): the call gave transformers plain positions


def _skipping_plain(original):
    """transformers' packed-rows check, answering the plain positions of a patched causal LM's call without a read
    (``positions.skip_plain``); any other call's is transformers' own."""
    skipping = skip_plain(original)

    @functools.wraps(original)
    def find_packed_sequence_indices(*args, **kwargs):
        return (skipping if bindings.active(PLAIN_SLOT) else original)(*args, **kwargs)

    return find_packed_sequence_indices


# the names the causal-LM rows declare (``Row.bindings``): transformers' packed-rows check
PACKED_CHECK = (Binding(MASKING, FIND_PACKED, _skipping_plain),)


def causal_lm_forward(self, *args, labels=None, logits_to_keep=0, **kwargs):
    """The causal LM's (or the image-text wrapper's) own forward with the loss taken out of it.

    The original forward runs as transformers ships it, asked for no logits (an empty ``logits_to_keep`` index) and
    no loss; a forward hook on ``self.model`` keeps the last hidden state, and the loss is computed from it by the
    fused op. Every other field of the output (``past_key_values``/``cache``, ``hidden_states``, ``attentions``,
    ``aux_loss``, ``router_logits``, rope deltas) is transformers' own, and an MoE model's load-balancing loss is
    added to the loss as transformers adds it (``router_aux_loss_coef * aux_loss``).

    The fused loss runs for a training call (``labels`` given, the model in training mode, every position's
    logits asked for); logits are then None, as Liger and TRL's own fused heads return them, unless the call
    passes ``return_logits=True``: None in the logits' place, so that ``return_dict=False``'s tuple and integer
    indexing give every field at transformers' position (``_with_loss``). ``return_logits=False`` asks for the
    fused loss outside training too. Any other call, and any call the op falls back for, is transformers' forward
    unchanged.

    Traced by torch.compile, a call given no positions, mask, cache or varlen boundaries tells the layers that
    its rows hold one document each (``packing.traced_plain_call``), as the positions' marks tell them in eager
    mode, so that no layer looks for document starts in the data (a graph break in every layer)."""
    if not torch.compiler.is_compiling():
        return _causal_lm_forward(self, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    reference, cache = _reference_and_cache(args, kwargs)
    plain = len(args) <= 1 and wants_plain_positions(
        kwargs.get("position_ids"), kwargs.get("attention_mask"), cache, kwargs, reference, marked=False
    )
    previous = traced_plain_call(plain)
    try:
        return _causal_lm_forward(self, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    finally:
        traced_plain_call(previous)


def _reference_and_cache(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, object | None]:
    """A causal-LM call's token ids (or embeddings), whose shape the positions take, and its cache, if any."""
    reference = kwargs.get("input_ids", args[0] if args else None)
    reference = reference if reference is not None else kwargs.get("inputs_embeds")
    cache = next((kwargs[name] for name in ("past_key_values", "cache") if kwargs.get(name) is not None), None)
    return reference, cache


def _causal_lm_forward(self, *args, labels=None, logits_to_keep=0, **kwargs):
    state = self._fusepatch
    note_padding(kwargs.get("position_ids"), kwargs.get("attention_mask"))  # padded rows are not packed ones
    return_logits = kwargs.pop("return_logits", None)
    weight = self.lm_head.weight
    wanted = self.training if return_logits is None else True
    dispatch = _fused_loss_op(self, state.ops, labels, logits_to_keep) if wanted else None
    if dispatch is None:
        return state.original(*args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    reference, cache = _reference_and_cache(args, kwargs)
    shift_labels = kwargs.pop("shift_labels", None)
    if reference is not None:  # none: transformers' forward raises for the missing input
        given = "labels" if shift_labels is None else "shift_labels"
        check_fit(labels if shift_labels is None else shift_labels, reference, name=given)
    plain = (
        not torch.compiler.is_compiling()
        and len(args) <= 1
        and wants_plain_positions(kwargs.get("position_ids"), kwargs.get("attention_mask"), cache, kwargs, reference)
    )
    if plain:
        # the positions transformers would build, known to hold one document a row: no read of the GPU to find out
        kwargs["position_ids"] = plain_positions(reference.shape[0], reference.shape[1], reference.device)
    rows = _labelled_rows(labels, shift_labels, start=False)
    # counted once the text stack's first layer is queued (an image-text wrapper runs its vision tower before it)
    counting = _count_after_first_layer(getattr(self.model, "language_model", self.model), rows)
    captured = []

    def keep(module, inputs, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = self.model.register_forward_hook(keep)
    try:
        no_logits = torch.empty(0, dtype=torch.long, device=weight.device)
        with bindings.inside({PLAIN_SLOT: plain}):  # transformers' packed-rows check reads plain positions neither
            outputs = state.original(*args, labels=None, logits_to_keep=no_logits, return_dict=True, **kwargs)
    finally:
        handle.remove()
        if counting is not None:
            counting.remove()
    hidden = captured[-1]
    # read after transformers' forward: its call of lm_head (for no position) has ZeRO-3 free lm_head's weight
    weight = self.lm_head.weight
    deepspeed.gather(self, weight)
    loss = _fused_loss(dispatch, hidden, weight, rows, kwargs.get("num_items_in_batch"))
    aux_loss = getattr(outputs, "aux_loss", None)
    if aux_loss is not None:  # transformers adds the router's load-balancing loss whenever labels are given
        # in place there (``loss += ...``): the loss keeps its fp32
        loss = loss + (_router_aux_loss_coef(self) * aux_loss.to(loss.device)).to(loss.dtype)
    outputs = _with_loss(outputs, loss, self.lm_head(hidden) if return_logits else None)
    return outputs if return_dict else outputs.to_tuple()


def _with_loss(outputs, loss: torch.Tensor, logits: torch.Tensor | None):
    """transformers' output with the fused loss: the same class, its keys in transformers' order (loss first), the
    logits' key kept even when they are None. A ``ModelOutput`` drops its None fields from its keys, its integer
    indexing and ``to_tuple`` (the ``return_dict=False`` tuple); a dropped logits would move every later field one
    place up (an MoE's ``out[2]`` the cache instead of the logits). Kept as None, every field sits where
    transformers puts it, and ``out.logits``, ``out["logits"]`` and ``out[1]`` (``out[2]`` after an MoE's
    ``aux_loss``) are all None: the fused loss made no logits."""
    # a placeholder, so that the constructor keeps the logits' key in its place among the fields
    rebuilt = type(outputs)(**{**dict(outputs.items()), "loss": loss, "logits": ()})
    rebuilt["logits"] = logits  # ModelOutput.__setitem__: the key stays where it is, the attribute follows
    return rebuilt


conditional_generation_forward = causal_lm_forward


def _router_aux_loss_coef(self) -> float:
    """The coefficient transformers' MoE causal LMs weigh the load-balancing loss with (on the model up to now,
    on the text config for the image-text wrappers)."""
    coef = getattr(self, "router_aux_loss_coef", None)
    if coef is None:
        coef = getattr(self.config.get_text_config(), "router_aux_loss_coef", 0.0)
    return coef


def _loss_dtype(weight: torch.Tensor, model: torch.nn.Module | None = None) -> torch.dtype:
    """The dtype transformers' ``lm_head`` matmul would run in: autocast's when it is on (the Trainer's
    ``bf16=True`` over fp32 weights), else the weight's as the matmul will see it. Under FSDP2 the weight is
    still a sharded fp32 DTensor when the forward starts (accelerate shards ``[final norm, lm_head]`` as one
    unit, gathered and cast to the policy's ``param_dtype`` only when the final norm runs), so there the
    policy's dtype is the one the loss will get (the H200's FSDP2 run self-tested and chose an fp32 loss)."""
    auto = autocast_dtype(weight.device.type)
    if auto is not None:
        return auto
    if model is not None and _is_sharded(weight):
        return fsdp_compute_dtype(model) or weight.dtype
    return weight.dtype


def _is_sharded(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return False
    return isinstance(tensor, DTensor)


def _fused_loss_op(self, ops: dict, labels, logits_to_keep):
    """The op this call's loss goes through, or None for transformers' own forward.

    The fused loss takes the call where labels are given, every position's logits are asked for (an int
    ``logits_to_keep`` of 0), and the lm_head is a plain linear map of its ``weight`` (``_linear_head``) without
    bias, hooks or a forward set on it (the fused loss never calls it). Under ``lm_head_precision`` (the row's second
    loss op) that precision's op runs where it has a fused kernel for the device and dtype and its GEMMs take the
    head's shape (``Op.fits``; ``apply`` said where not), else the fused loss in the model's own precision where it
    has one."""
    if not (
        labels is not None
        and isinstance(logits_to_keep, int)
        and logits_to_keep == 0
        and getattr(self.lm_head, "bias", None) is None
        and may_bypass(self.lm_head, gathering=True)
        and _linear_head(self.lm_head)
    ):
        return None
    weight = self.lm_head.weight  # a real device here: a head another library loads per call was refused above
    device, dtype = weight.device.type, dtype_name(_loss_dtype(weight, self))
    shape = tuple(deepspeed.full_shape(weight))  # ZeRO-3: a placeholder until gathered
    plain = ops["linear_cross_entropy"]
    for dispatch in [d for d in ops.values() if d is not plain] + [plain]:
        fits = dispatch.op.fits is None or dispatch.op.fits(shape) is None
        if fits and dispatch.choice(device, dtype).fused:
            return dispatch
    return None


def _linear_head(head: torch.nn.Module) -> bool:
    """Whether ``head(hidden)`` is ``F.linear(hidden, head.weight)``, what the fused loss computes in its stead: an
    ``nn.Linear`` whose forward is Linear's, or peft's ``ModulesToSaveWrapper`` whose forward calls such a module
    holding the ``weight`` the wrapper gives (the active trainable copy, or the original). Not peft's LoRA ``Linear``
    (its forward adds the adapters' product) nor any other class: the head is then called, as transformers calls
    it."""
    if type(head).forward is torch.nn.Linear.forward:
        return True
    if type(head).__name__ != "ModulesToSaveWrapper" or not type(head).__module__.startswith("peft."):
        return False
    active = list(head.active_adapters)
    trained = getattr(head, "_adapters", None)  # peft's own attribute: where a peft lacks it, the head is called
    if trained is None:
        return False
    # the module the wrapper's forward calls (peft's AuxiliaryTrainingWrapper.forward and _forward_wrapped)
    if head.disable_adapters or not active or any(name not in trained for name in active):
        inner = head.original_module
    else:
        inner = head.modules_to_save[active[0]] if active[0] in head.modules_to_save else None
    return (
        inner is not None
        and type(inner).forward is torch.nn.Linear.forward
        and may_bypass(inner, gathering=True)
        and inner.weight is head.weight
    )


def _labelled_rows(labels: torch.Tensor, shift_labels: torch.Tensor | None, start: bool = True) -> LabelledRows:
    """The label each position predicts: token t+1 at position t, nothing (-100) at the last; or the caller's."""
    if shift_labels is None:
        return LabelledRows(labels, shift=True, start=start)
    return LabelledRows(shift_labels, start=start)


def _count_after_first_layer(model: torch.nn.Module, rows: LabelledRows):
    """Queue the labelled-row count once the first decoder layer's forward is queued; returns the hook's handle
    (None: counted now, for a model without a ``layers`` list).

    A synced step starts on an empty GPU queue, so until the host has queued the first long kernels every host
    microsecond is one of the step's: in a 27B-shaped step (benchmarks/studies/step_start.py shows where) the GPU
    waits for the host through layer 0 up to its MLP, and from layer 0's end on the queued work is ahead of the host.
    The count's three launches and its event would cost the step their host time before layer 0; after it they
    cost the step nothing. The loss reads the count after the whole forward is queued, by when
    the GPU has passed layer 0 (if not, it waits only until it has, with the later layers still queued)."""
    layers = getattr(model, "layers", None)
    if (
        torch.compiler.is_compiling()  # no hooks registered inside a traced forward (the count is off there)
        or not isinstance(layers, torch.nn.ModuleList)
        or len(layers) == 0
    ):
        rows.start()
        return None

    def count(module, args, output) -> None:
        # a compiled layer (``layer.compile()``) runs its hooks traced, where the count is off: leave it to the
        # loss, which counts outside the trace, rather than give up the labelled-rows loss
        if not torch.compiler.is_compiling():
            rows.start()

    return layers[0].register_forward_hook(count)


def _fused_loss(dispatch, hidden, weight, rows: LabelledRows, num_items_in_batch):
    """transformers' causal-LM loss (labels shifted by one, -100 ignored, summed over ``num_items_in_batch``
    when the Trainer gives it) through the fused linear cross-entropy, over the labelled rows only where many are
    ignored (layers/support/labelled_rows.py). Under autocast the hidden states and the weight are cast to autocast's
    dtype first (differentiably, as autocast casts them for ``lm_head``) and the kernel runs with autocast off: it
    gets exactly the dtype it was chosen and self-tested for. The loss is fp32 whatever that dtype, as
    transformers' is (``ForCausalLMLoss`` upcasts the logits with ``.float()``, an fp64 model's too); NaN when no
    label counts, as transformers' mean over no tokens is."""
    flat, labels = rows.select(hidden.reshape(-1, hidden.shape[-1]))
    dtype = _loss_dtype(weight)
    with torch.autocast(weight.device.type, enabled=False):
        loss = dispatch(
            flat.to(dtype), weight.to(dtype), labels, ignore_index=-100, num_items_in_batch=num_items_in_batch
        )
    return loss.float()


def trainer_head(module: torch.nn.Module) -> str | None:
    """Who else computes this model's loss in a fused head, or None.

    TRL's trainers install a fused LM head as the model's forward (``add_fused_lm_head``: called with
    ``fused_lm_head=True``, it runs the backbone and its own chunked log-probabilities); Liger's
    ``fused_linear_cross_entropy`` replaces the class's or the instance's forward. Either computes the loss
    itself: fusepatch leaves the head to it (and says so), rather than running a second fused loss beside it or
    answering TRL's call with outputs it does not expect."""
    for function in _forwards_within(module):
        code = function.__code__
        parameters = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        # the package of the module that defined it (its globals: ``functools.wraps`` copies the wrapped forward's
        # ``__module__``), not its file's folders: a checkout may sit in a folder named ``trl`` or ``liger_kernel``
        package = str(getattr(function, "__globals__", {}).get("__name__", "")).split(".")[0]
        if "fused_lm_head" in parameters:
            return "TRL's fused LM head" if package == "trl" else "a fused LM head (fused_lm_head)"
        if package == "liger_kernel":
            return "Liger's fused linear cross-entropy"
    return None


def _forwards_within(module: torch.nn.Module, depth: int = 8) -> list:
    """Every function reachable from the module's forward through the wrappers around it: the instance's forward,
    what accelerate kept as ``_original_forward`` before wrapping it in autocast (the Trainer's mixed precision),
    ``__wrapped__``/``__func__`` chains and accelerate's fp32-output wrapper, and the class's forward."""
    found, seen = [], set()
    pending = [(module.__dict__.get("forward"), 0), (module.__dict__.get("_original_forward"), 0)]
    pending.append((type(module).forward, 0))
    while pending:
        item, level = pending.pop(0)
        if item is None or id(item) in seen or level > depth:
            continue
        seen.add(id(item))
        if getattr(item, "__code__", None) is not None:
            found.append(item)
        for name in ("__func__", "__wrapped__", "model_forward"):
            inner = getattr(item, name, None)
            if inner is not None:
                pending.append((inner, level + 1))
    return found
