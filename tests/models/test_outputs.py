"""Every field of a patched model's output equals transformers' own, for every family in the registry.

Each test runs twice (``kernels``). "cpu": the ops a CPU chooses (eager: what a CPU user gets), with the fused
causal-LM loss (``chunked_on_cpu``) and the fused decoder forward (``calls``) on CPU candidates where a test asks
for them, in fp32. "stand-ins": every op through a CPU candidate running its reference (``stand_ins``), so that
every layer takes the code it runs with GPU kernels, in fp64 where transformers' model of the family takes it (its
MoE experts' grouped GEMM takes no fp64: fp32 there). What differs between the two models is fusepatch's forwards
alone, so the bounds are the rounding of reordered sums. Each call is made as users make it: training with labels
(MoE: with the router's logits and its load-balancing loss), evaluation under ``no_grad``, ``return_dict=False``,
the Trainer's ``num_items_in_batch``, ``shift_labels``, batches with nothing to predict, a cache filled and
continued, and greedy ``generate``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import MOE

import fusepatch
from fusepatch.tools.tiny import FAMILIES, tiny_model

FAMILY_TYPES = sorted(FAMILIES)
MOE_TYPES = MOE
TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


@pytest.fixture(params=["cpu", "stand-ins"])
def kernels(request) -> str:
    """How the patched model's ops run (the module docstring). A test lists it after ``chunked_on_cpu`` and
    ``calls``: the stand-ins then go ahead of their candidates."""
    if request.param == "stand-ins":
        request.getfixturevalue("stand_ins")
    return request.param


def _pair(model_type: str, kernels: str = "cpu", *, left_padded: bool = False, **overrides):
    """(transformers' model, the same weights patched): fp32, or fp64 under the stand-ins where the family allows;
    under the stand-ins every op of every patched layer runs its stand-in. fp32 for left-padded batches too:
    transformers' own fp64 model gives NaN in a left-padded row from its first layer on (its eager attention over
    the fully masked padded positions; sdpa does not; transformers 5.25), so there is nothing to compare."""
    wide = kernels == "stand-ins" and model_type not in MOE_TYPES and not left_padded
    reference = tiny_model(model_type, dtype=torch.float64 if wide else torch.float32, **overrides)
    patched = copy.deepcopy(reference)
    report = fusepatch.apply(patched)
    if kernels == "stand-ins":
        chosen = {(layer.layer, c.op): c.chosen for layer in report.layers for c in layer.choices}
        assert set(chosen.values()) == {"cpu-standin"}, chosen
    return reference, patched


def _grads_equal(reference, patched) -> None:
    for (name, p), q in zip(reference.named_parameters(), patched.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        torch.testing.assert_close(q.grad, p.grad, **GRAD_TOL, msg=name)


def _same(a, b, path: str = "output") -> None:
    """Equal structure and values (tensors within ``TOL``; caches compared through their tensors)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        torch.testing.assert_close(b, a, **TOL, msg=path)
    elif _is_cache(a):
        assert _is_cache(b), path
        _same(_cache_tensors(a), _cache_tensors(b), path)
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(b).__name__} of {len(b)} != {len(a)}"
        for index, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{index}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: {sorted(b)} != {sorted(a)}"
        for key in a:
            _same(a[key], b[key], f"{path}.{key}")
    else:
        assert a == b, f"{path}: {b!r} != {a!r}"


def _fields(output) -> dict:
    """The fields a ``ModelOutput`` holds (not None), the cache as its tensors."""
    return {name: _cache_tensors(value) if _is_cache(value) else value for name, value in output.items()}


def _is_cache(value) -> bool:
    from transformers.cache_utils import Cache

    return isinstance(value, Cache)


def _cache_tensors(cache) -> list:
    found = []
    for layer in getattr(cache, "layers", []):
        for name in sorted(vars(layer)):
            value = getattr(layer, name)
            if isinstance(value, torch.Tensor) and value.numel():
                found.append(value)
    for name in ("key_cache", "value_cache", "conv_states", "recurrent_states"):
        for value in getattr(cache, name, None) or []:
            if isinstance(value, torch.Tensor) and value.numel():
                found.append(value)
    assert found, f"{type(cache).__name__}: no tensors found to compare"
    return found


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_training_output_and_gradients(model_type, chunked_on_cpu, calls, kernels):
    """A training call: loss (with an MoE's load-balancing loss, fp32 as transformers' whatever the model's dtype),
    aux_loss, router_logits, hidden_states and every parameter's gradient as transformers'; logits are None (the
    fused loss), kept at their place among the keys, and equal when asked for."""
    reference, patched = _pair(model_type, kernels)
    reference.train(), patched.train()
    ids = torch.randint(0, reference.config.vocab_size, (2, 13))
    extra = {"output_router_logits": True} if model_type in MOE_TYPES else {}
    ref = reference(input_ids=ids, labels=ids, output_hidden_states=True, use_cache=False, **extra)
    got = patched(input_ids=ids, labels=ids, output_hidden_states=True, use_cache=False, **extra)
    assert got.logits is None  # the fused loss never makes the logits in training unless asked
    assert list(got.keys()) == list(ref.keys()), "the keys (and so integer indexing) as transformers orders them"
    assert calls or kernels == "stand-ins", "the fused decoder forward did not run"
    ref_fields, got_fields = _fields(ref), _fields(got)
    ref_fields.pop("logits"), got_fields.pop("logits")
    _same(ref_fields, got_fields)
    if model_type in MOE_TYPES:
        assert got.aux_loss is not None and got.router_logits is not None
    ref.loss.backward(), got.loss.backward()
    _grads_equal(reference, patched)
    asked = patched(input_ids=ids, labels=ids, use_cache=False, return_logits=True, **extra)
    torch.testing.assert_close(asked.logits, ref.logits, **TOL)
    torch.testing.assert_close(asked.loss, ref.loss, **TOL)


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_router_aux_loss_counted_in_the_loss(model_type, chunked_on_cpu, kernels):
    """The load-balancing loss reaches the fused loss (it was dropped: MoE fine-tunes trained without it)."""
    reference, patched = _pair(model_type, kernels, router_aux_loss_coef=0.5)
    patched.train(), reference.train()
    ids = torch.randint(0, reference.config.vocab_size, (2, 11))
    ref = reference(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    got = patched(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    without = patched(input_ids=ids, labels=ids, output_router_logits=False, use_cache=False)
    torch.testing.assert_close(got.loss, ref.loss, **TOL)
    torch.testing.assert_close(got.loss - without.loss, 0.5 * ref.aux_loss, **TOL)


def _loss_calls(ids: torch.Tensor) -> dict[str, dict]:
    """The loss arguments users pass, by name: the Trainer's ``num_items_in_batch`` (an int or a tensor; the
    count over the whole accumulated batch), ``shift_labels`` (labels already shifted, as context-parallel
    training gives them), and batches with nothing to predict: every label -100, or one token (after the shift
    it predicts nothing). transformers' loss is NaN there (a mean over no tokens), 0 with ``num_items_in_batch``."""
    labels = ids.clone()
    labels[:, :4] = -100
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    shifted[0, -3:] = -100
    ignored = torch.full_like(ids, -100)
    return {
        "labels": dict(input_ids=ids, labels=labels),
        "num_items_int": dict(input_ids=ids, labels=labels, num_items_in_batch=57),
        "num_items_tensor": dict(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(57)),
        "shift_labels": dict(input_ids=ids, labels=labels, shift_labels=shifted),
        "all_ignored": dict(input_ids=ids, labels=ignored),
        "all_ignored_num_items": dict(input_ids=ids, labels=ignored, num_items_in_batch=torch.tensor(9)),
        "one_token": dict(input_ids=ids[:1, :1], labels=ids[:1, :1]),
    }


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_loss_arguments_and_empty_batches(model_type, chunked_on_cpu, calls, kernels):
    """Every loss argument transformers takes gives transformers' loss (NaN where it gives NaN), dtype and every
    gradient (none from a loss over no tokens but the router's)."""
    reference, patched = _pair(model_type, kernels)
    reference.train(), patched.train()
    extra = {"output_router_logits": True} if model_type in MOE_TYPES else {}
    for name, batch in _loss_calls(torch.randint(0, reference.config.vocab_size, (2, 9))).items():
        reference.zero_grad(), patched.zero_grad()
        ref = reference(**batch, use_cache=False, **extra)
        got = patched(**batch, use_cache=False, **extra)
        assert got.loss.dtype == ref.loss.dtype == torch.float32, name
        torch.testing.assert_close(got.loss, ref.loss, **TOL, equal_nan=True, msg=name)
        ref.loss.backward(), got.loss.backward()
        _grads_equal(reference, patched)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, "autocast"])
def test_loss_dtype_is_transformers(dtype, chunked_on_cpu):
    """transformers' causal-LM loss is fp32 for any model dtype (``ForCausalLMLoss`` upcasts the logits with
    ``.float()``): an fp64 model's too, and a bf16 model's, and under bf16 autocast over fp32 weights."""
    wide = torch.float32 if dtype == "autocast" else dtype
    reference = tiny_model("qwen3", dtype=wide).train()
    patched = copy.deepcopy(reference)
    fusepatch.apply(patched)
    ids = torch.randint(0, reference.config.vocab_size, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
        ref = reference(input_ids=ids, labels=ids, use_cache=False)
        got = patched(input_ids=ids, labels=ids, use_cache=False)
    assert got.logits is None, "the fused loss ran"
    assert ref.loss.dtype == torch.float32 and got.loss.dtype == ref.loss.dtype
    precise = dtype in (torch.float64, torch.float32)
    torch.testing.assert_close(got.loss, ref.loss, **(TOL if precise else dict(rtol=2e-2, atol=2e-2)))


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_evaluation_and_tuple_outputs(model_type, chunked_on_cpu, calls, kernels):
    """Evaluation (``no_grad``, eval mode, labels): every field, logits included. ``return_dict=False`` in
    training gives transformers' tuple: every field at the position transformers puts it (``to_tuple``: the fields
    that are set, in order), the logits' place held by None (the fused loss makes none), or the logits when asked
    for (``return_logits=True``). An MoE's tuple with its router's outputs: (loss, aux_loss, None, cache, router
    logits)."""
    reference, patched = _pair(model_type, kernels)
    reference.eval(), patched.eval()
    ids = torch.randint(0, reference.config.vocab_size, (2, 9))
    with torch.no_grad():
        _same(_fields(reference(input_ids=ids, labels=ids)), _fields(patched(input_ids=ids, labels=ids)))
    reference.train(), patched.train()
    calls_made = [dict(use_cache=False), dict(use_cache=True)]
    if model_type in MOE_TYPES:
        calls_made.append(dict(use_cache=True, output_router_logits=True))
    for extra in calls_made:
        ref = reference(input_ids=ids, labels=ids, return_dict=False, **extra)
        got = patched(input_ids=ids, labels=ids, return_dict=False, **extra)
        assert isinstance(got, tuple) and len(got) == len(ref), (extra, len(got), len(ref))
        at = 2 if extra.get("output_router_logits") else 1  # transformers': loss, [aux_loss], logits, ...
        assert got[at] is None and ref[at].shape == (*ids.shape, reference.config.vocab_size), extra
        _same(ref[:at] + (None,) + ref[at + 1 :], got, f"tuple {extra}")
        asked = patched(input_ids=ids, labels=ids, return_dict=False, return_logits=True, **extra)
        _same(ref, asked, f"tuple with logits {extra}")


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_cache_continuation(model_type, grad, kernels):
    """A prefill with ``use_cache=True`` leaves the cache transformers leaves, so the next token's logits are
    transformers'. With grad enabled too: inference code without ``no_grad`` does this (the linear-attention
    layers' cache was left empty, and the continuation was 0.08-0.10 off)."""
    reference, patched = _pair(model_type, kernels)
    reference.eval(), patched.eval()
    ids = torch.randint(0, reference.config.vocab_size, (2, 10))
    with torch.set_grad_enabled(grad):
        ref = reference(input_ids=ids[:, :8], use_cache=True)
        got = patched(input_ids=ids[:, :8], use_cache=True)
        _same(_fields(ref), _fields(got))
        ref_next = reference(input_ids=ids[:, 8:], past_key_values=ref.past_key_values, use_cache=True)
        got_next = patched(input_ids=ids[:, 8:], past_key_values=got.past_key_values, use_cache=True)
    torch.testing.assert_close(got_next.logits, ref_next.logits, **TOL)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_generate_matches(model_type, kernels):
    """Greedy generation with a cache, left-padded batch included: the same tokens and scores."""
    reference, patched = _pair(model_type, kernels, left_padded=True)
    reference.eval(), patched.eval()
    ids = torch.randint(1, reference.config.vocab_size, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is shorter: left padding, as a tokenizer with padding_side="left" makes
    ids[1, :3] = 0
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ref = reference.generate(input_ids=ids, attention_mask=mask, **settings)
    got = patched.generate(input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(got.sequences, ref.sequences)
    _same(tuple(ref.scores), tuple(got.scores), "scores")


def _padded_batch(vocab: int, zero_positions: bool):
    """Two rows, the second right-padded by 4 tokens; position_ids as RL collators give them (padding at 0) or
    as transformers counts them (the padding continuing)."""
    ids = torch.randint(0, vocab, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    positions = torch.arange(12).expand(2, 12).clone()
    if zero_positions:
        positions = positions * mask
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_right_padded_rows_are_not_packed(model_type, chunked_on_cpu, calls, kernels):
    """Padding whose positions are 0 (RL collators) is padding, not a run of one-token documents: the batch runs
    as transformers runs it (it was refused as a packed batch whose mask crosses documents)."""
    reference, patched = _pair(model_type, kernels)
    reference.train(), patched.train()
    batch = _padded_batch(reference.config.vocab_size, zero_positions=True)
    ref = reference(**batch, use_cache=False)
    got = patched(**batch, use_cache=False)
    torch.testing.assert_close(got.loss, ref.loss, **TOL)
    ref.loss.backward(), got.loss.backward()
    _grads_equal(reference, patched)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_left_padded_prefill_is_not_packed(model_type, kernels):
    """Generation's left padding as ``generate`` writes its positions (``[1, 1, 1, 0, 1, ...]``: padded positions
    filled with 1) is a padded batch: the prefill and the cache it leaves are transformers' (it was refused as a
    packed batch)."""
    reference, patched = _pair(model_type, kernels, left_padded=True)
    reference.eval(), patched.eval()
    ids = torch.randint(1, reference.config.vocab_size, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        ref = reference(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        got = patched(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    _same(_fields(ref), _fields(got))
