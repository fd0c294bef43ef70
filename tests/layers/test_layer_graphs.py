"""``apply(model, cuda_graphs=True)`` (fusepatch/layers/layer_graphs.py): when the decoder layers are captured, what
replays them, what keeps them out of graphs and says so. A CUDA graph needs CUDA: here ``_Rerun`` stands in for it
(a replay runs the captured function again and copies its results into the tensors the capture returned), so the
capture's own logic runs (static buffers, the parameters' aliases, the replay's autograd function), and a model with
graphs must compute exactly what one without them does. tests/gpu/test_layer_graphs.py runs real graphs."""

from __future__ import annotations

import contextlib
import copy
import logging
import pickle

import pytest
import torch
from helpers import grads

import fusepatch
from fusepatch.layers import layer_graphs
from fusepatch.tools.tiny import tiny_model


class _Counted:
    def __init__(self, replayed, replays: list) -> None:
        self.replayed, self.replays = replayed, replays

    def __call__(self, *args):
        self.replays.append(1)
        return self.replayed(*args)


@pytest.fixture
def capture(monkeypatch, chunked_on_cpu):
    """Graphs on the CPU: ``made`` gets the number of layers of each capture, ``replays`` one entry per replayed
    layer call. The fused loss runs on the CPU too: its forward makes the plain positions that tell the layers a
    batch holds one document a row without reading it."""
    made, replays = [], []
    real = layer_graphs._capture_stack

    def counted(calls, samples, device):
        made.append(len(calls))
        return [_Counted(replayed, replays) for replayed in real(calls, samples, device)]

    monkeypatch.setattr(layer_graphs, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(layer_graphs, "GRAPH", layer_graphs._Rerun)
    monkeypatch.setattr(layer_graphs, "_capture_stack", counted)
    return made, replays


def _train(model, steps: int, ids: torch.Tensor, **kwargs) -> list[float]:
    """``steps`` AdamW steps on the same tokens; the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids, **{"use_cache": False, **kwargs}).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _pair(model_type: str = "qwen3_5_text"):
    base = tiny_model(model_type).train()
    plain, graphed = copy.deepcopy(base), copy.deepcopy(base)
    fusepatch.apply(plain, verbose=False)
    fusepatch.apply(graphed, cuda_graphs=True, verbose=False)
    return plain, graphed


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3"])
def test_layers_are_captured_after_steady_steps_and_replayed_with_the_same_results(capture, caplog, model_type):
    """Two steps of one shape run as usual (kernel choices, self-tests, autotuning), the third captures every
    layer once and replays it, as do the steps after; losses and parameters equal the model's without graphs."""
    made, replays = capture
    caplog.set_level(logging.INFO, logger="fusepatch")
    plain, graphed = _pair(model_type)
    layers = len(graphed.model.layers)
    ids = torch.randint(0, 512, (2, 24))
    want = _train(plain, 5, ids)
    got = _train(graphed, 5, ids)
    assert got == want
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(graphed.state_dict()[name], value, rtol=0, atol=0, msg=name)
    assert made == [layers]
    assert len(replays) == 1 + 3 * layers  # the check of the first layer at the capture, then steps 3-5
    assert any("decoder layers captured" in r.getMessage() for r in caplog.records)


def test_a_step_of_another_shape_runs_as_usual_and_the_steady_shape_replays_again(capture):
    """A shorter batch (the last of an epoch) runs without graphs; the steady shape's graphs serve again after."""
    made, replays = capture
    _, graphed = _pair()
    layers = len(graphed.model.layers)
    long, short = torch.randint(0, 512, (2, 24)), torch.randint(0, 512, (2, 16))
    _train(graphed, 3, long)
    assert made == [layers] and len(replays) == 1 + layers  # the capture's check, then step 3
    _train(graphed, 1, short)
    assert len(replays) == 1 + layers
    _train(graphed, 2, long)
    assert made == [layers]  # not captured again
    assert len(replays) == 1 + 2 * layers  # the step after the short one runs as usual, the next replays


@pytest.mark.parametrize(
    "setup, said",
    [
        ("checkpointing", "activation checkpointing"),
        ("hook", "has hooks"),
        ("packed", "packed, padded or cached"),
        ("mask", "packed, padded or cached"),
        ("cached", "use_cache=False"),
        ("autocast", "autocast casts parameters"),
    ],
)
def test_calls_graphs_cannot_take_run_as_usual_and_say_why_once(capture, caplog, setup, said):
    """Activation checkpointing, a hook on a layer's module, packed documents (``position_ids``), a padding mask,
    a cache to fill and autocast over fp32 weights: no capture, the same losses as without graphs, the reason and its fix said
    once."""
    made, _ = capture
    caplog.set_level(logging.WARNING, logger="fusepatch")
    plain, graphed = _pair()
    ids = torch.randint(0, 512, (1, 24))
    kwargs = {}
    if setup == "checkpointing":
        for model in (plain, graphed):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif setup == "hook":
        for model in (plain, graphed):
            model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    elif setup == "packed":
        kwargs["position_ids"] = torch.cat([torch.arange(10), torch.arange(14)])[None]
    elif setup == "cached":  # the config's default in a plain training loop
        kwargs["use_cache"] = True
    else:
        kwargs["attention_mask"] = torch.ones(1, 24, dtype=torch.long)
        kwargs["attention_mask"][0, :3] = 0
    region = torch.autocast("cpu", dtype=torch.bfloat16) if setup == "autocast" else contextlib.nullcontext()
    with region:
        want = _train(plain, 4, ids, **kwargs)
    with region:
        got = _train(graphed, 4, ids, **kwargs)
    assert got == want
    assert made == []
    messages = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    assert len(messages) == 1 and said in messages[0] and "Fix:" in messages[0], messages


def _said_when_the_capture_is(capture_stack, steps: int, monkeypatch, caplog) -> list[str]:
    """``steps`` training steps of a graphed model whose capture is ``capture_stack`` (over the CPU stand-in),
    against the same model without graphs: the losses must be equal; returns the capture failures said."""
    monkeypatch.setattr(layer_graphs, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(layer_graphs, "GRAPH", layer_graphs._Rerun)
    monkeypatch.setattr(layer_graphs, "_capture_stack", capture_stack)
    caplog.set_level(logging.WARNING, logger="fusepatch")
    plain, graphed = _pair()
    ids = torch.randint(0, 512, (2, 24))
    assert _train(graphed, steps, ids) == _train(plain, steps, ids)
    return [r.getMessage() for r in caplog.records if "capture of the decoder layers failed" in r.getMessage()]


def test_a_capture_that_fails_leaves_the_layers_as_they_were_and_says_why(monkeypatch, caplog, chunked_on_cpu):
    """A kernel that cannot be captured (here: the capture raises as CUDA does) turns the graphs off for the model,
    says why with the fix, and every step computes what it would without graphs."""

    def fails(calls, samples, device):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    said = _said_when_the_capture_is(fails, 5, monkeypatch, caplog)
    assert len(said) == 1 and "not permitted when stream is capturing" in said[0] and "Fix:" in said[0]


def test_a_replay_that_differs_from_the_layer_is_never_used(monkeypatch, caplog, chunked_on_cpu):
    """The capture's check: the first layer's replay against its own forward. A replay that computes something
    else (here: off by 10%) is refused before any step uses it."""
    real = layer_graphs._capture_stack

    def wrong(calls, samples, device):
        return [lambda *args, replayed=replayed: replayed(*args) * 1.1 for replayed in real(calls, samples, device)]

    said = _said_when_the_capture_is(wrong, 4, monkeypatch, caplog)
    assert len(said) == 1 and "differs from its forward" in said[0]


def test_gradients_accumulated_over_micro_batches_are_those_without_graphs(capture):
    """Two micro-batches a step (a Trainer's gradient accumulation): each replay's gradients are added to the
    parameters' ``.grad``, not left in the graph's buffers that the next replay rewrites."""
    made, _ = capture
    plain, graphed = _pair()
    first, second = torch.randint(0, 512, (2, 24)), torch.randint(0, 512, (2, 24))
    for model in (plain, graphed):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            for ids in (first, second):
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert made == [len(graphed.model.layers)]
    for name, grad in grads(plain).items():
        torch.testing.assert_close(grads(graphed)[name], grad, rtol=0, atol=0, msg=name)


def test_a_frozen_embedding_under_lora_gives_the_first_layer_no_input_gradient(capture):
    """peft LoRA: the base weights and the embedding are frozen, so the first layer's input needs no gradient and
    only the adapters get one; the graphed model's adapters get exactly the plain model's."""
    import peft

    made, replays = capture
    base = tiny_model("qwen3_5_text").train()
    plain, graphed = (
        peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, target_modules="all-linear")) for _ in range(2)
    )
    graphed.load_state_dict(plain.state_dict())
    fusepatch.apply(plain, verbose=False)
    fusepatch.apply(graphed, cuda_graphs=True, verbose=False)
    ids = torch.randint(0, 512, (2, 24))
    assert _train(graphed, 4, ids) == _train(plain, 4, ids)
    assert made == [4] and replays
    for name, grad in grads(plain).items():
        torch.testing.assert_close(grads(graphed)[name], grad, rtol=0, atol=0, msg=name)


def test_parameters_replaced_after_the_capture_drop_the_graphs(capture):
    """A graph reads the parameters' memory: parameters replaced (``load_state_dict(assign=True)``, a move) or
    frozen since the capture drop the graphs, and the layers are captured again once steady."""
    made, replays = capture
    _, graphed = _pair()
    layers = len(graphed.model.layers)
    ids = torch.randint(0, 512, (2, 24))
    _train(graphed, 3, ids)
    assert made == [layers]
    state = {k: v.clone() for k, v in graphed.state_dict().items()}
    graphed.load_state_dict(state, assign=True)
    before = len(replays)
    _train(graphed, 1, ids)
    assert len(replays) == before  # ran as usual
    _train(graphed, 3, ids)
    assert made == [layers, layers]


def test_a_layer_frozen_after_the_capture_runs_as_usual_from_there_and_is_captured_again(capture):
    """Parameters are checked layer by layer as a step replays: a weight of the last layer frozen after the capture
    leaves the layers before it replayed and runs it as usual, the step computing what the model without graphs
    does; the layers are captured again once steady."""
    made, replays = capture
    plain, graphed = _pair()
    layers = len(graphed.model.layers)
    ids = torch.randint(0, 512, (2, 24))
    losses = [_train(model, 3, ids) for model in (plain, graphed)]
    assert made == [layers]
    before = len(replays)
    for model in (plain, graphed):
        model.model.layers[-1].mlp.down_proj.weight.requires_grad_(False)
    losses += [_train(model, 4, ids) for model in (plain, graphed)]
    assert made == [layers, layers]
    # the step after the freeze replays every layer but the last; the next runs as usual (recording the calls);
    # the third captures (the check's replay) and replays, as does the fourth
    assert len(replays) == before + (layers - 1) + 1 + 2 * layers
    assert losses[0] == losses[1] and losses[2] == losses[3]
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(graphed.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_graphs_of_another_shape_are_not_replayed_over_replaced_parameters(capture):
    """One shape captured, the parameters replaced, then another shape captured: the first shape's graphs still
    read the replaced parameters' memory, so that capture drops them; they are never replayed."""
    made, _ = capture
    plain, graphed = _pair()
    layers = len(graphed.model.layers)
    long, short = torch.randint(0, 512, (2, 24)), torch.randint(0, 512, (2, 16))
    losses = [_train(model, 3, long) for model in (plain, graphed)]
    assert made == [layers]
    for model in (plain, graphed):
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    losses += [_train(model, 3, short) + _train(model, 3, long) for model in (plain, graphed)]
    assert made == [layers] * 3  # short captured, then long again (its first graphs dropped)
    assert losses[0] == losses[1] and losses[2] == losses[3]


def test_inference_calls_run_as_usual_and_leave_the_graphs_alone(capture):
    """``no_grad`` and eval calls (an evaluation loop inside training) run without graphs and do not count as
    steps; the training steps around them replay."""
    made, replays = capture
    _, graphed = _pair()
    layers = len(graphed.model.layers)
    ids = torch.randint(0, 512, (2, 24))
    _train(graphed, 3, ids)
    graphed.eval()
    with torch.no_grad():
        graphed(input_ids=ids, use_cache=False)
    graphed.train()
    count = len(replays)
    _train(graphed, 1, ids)
    assert made == [layers] and len(replays) == count + layers


def test_copies_and_pickles_start_without_graphs(capture):
    """An EMA copy or a pickled model shares no graphs (they hold the source's memory pool): it captures its own
    once steady, and computes what the source does."""
    made, _ = capture
    _, graphed = _pair()
    layers = len(graphed.model.layers)
    ids = torch.randint(0, 512, (2, 24))
    _train(graphed, 3, ids)
    for twin in (copy.deepcopy(graphed), pickle.loads(pickle.dumps(graphed))):
        holder, index = twin.model.layers[1].__dict__[layer_graphs.ATTRIBUTE]
        assert index == 1 and not holder.graphs and holder.layers[1] is twin.model.layers[1]
        twin.zero_grad(set_to_none=True)
        graphed.zero_grad(set_to_none=True)
        for model in (twin, graphed):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        for name, grad in grads(graphed).items():
            torch.testing.assert_close(grads(twin)[name], grad, rtol=0, atol=0, msg=name)
    assert made == [layers]


def test_revert_removes_the_graphs(capture):
    _, graphed = _pair()
    fusepatch.revert(graphed)
    assert not any(layer_graphs.ATTRIBUTE in m.__dict__ for m in graphed.modules())


def test_cuda_graphs_leave_mixture_of_experts_layers_out_and_say_so(capture, caplog):
    caplog.set_level(logging.WARNING, logger="fusepatch")
    model = tiny_model("qwen3_moe").train()
    fusepatch.apply(model, cuda_graphs=True, verbose=False)
    assert not any(layer_graphs.ATTRIBUTE in m.__dict__ for m in model.modules())
    assert any("mixture-of-experts" in r.getMessage() for r in caplog.records)


def test_the_trainer_callback_trains_with_graphs_as_without(capture, tmp_path):
    """``FusePatchCallback(apply_kwargs={"cuda_graphs": True})`` in a real Trainer, with gradient accumulation and
    the callback's profiled step (its layer labels are passive hooks, which graphs leave be): the same logged
    losses as without graphs, the layers captured once and replayed."""
    pytest.importorskip("accelerate")
    from helpers import cpu_trainer

    made, replays = capture
    losses = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        callback = fusepatch.FusePatchCallback(profile_step=5, apply_kwargs={"cuda_graphs": graphs})
        trainer = cpu_trainer(tmp_path / str(graphs), [callback], max_steps=6, gradient_accumulation_steps=2)
        trainer.train()
        losses[graphs] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses[True]) == 6 and losses[True] == losses[False]
    assert made == [4] and len(replays) > 4 * 8


def test_autocast_over_parameters_of_its_dtype_is_graphed(capture):
    """Autocast whose dtype the parameters already have (a bf16 model under ``Trainer(bf16=True)``) casts nothing,
    so the layers are captured (with autocast's cache off, as a graph needs) and compute what they do without."""
    made, _ = capture
    base = tiny_model("qwen3_5_text").to(torch.bfloat16).train()
    plain, graphed = copy.deepcopy(base), copy.deepcopy(base)
    fusepatch.apply(plain, verbose=False)
    fusepatch.apply(graphed, cuda_graphs=True, verbose=False)
    ids = torch.randint(0, 512, (2, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _train(plain, 4, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _train(graphed, 4, ids)
    assert got == want and made == [4]


def test_the_capture_leaves_the_random_streams_as_they_were(capture):
    """The capture's inputs and check draw from a generator of their own: a seeded run draws the same numbers
    after the capture as without graphs (dropout masks, data order)."""
    made, _ = capture
    plain, graphed = _pair()
    ids = torch.randint(0, 512, (2, 24))
    draws = {}
    for name, model in (("plain", plain), ("graphed", graphed)):
        torch.manual_seed(7)
        _train(model, 3, ids)
        draws[name] = torch.rand(4)
    assert made == [4]
    torch.testing.assert_close(draws["graphed"], draws["plain"], rtol=0, atol=0)


@pytest.mark.parametrize("lora", [False, True], ids=["trained", "lora-dropped"])
def test_fp8_projections_are_captured_and_replay_their_fp8_steps(capture, monkeypatch, lora):
    """``precision="fp8"`` with graphs: the FP8 projections (the real FP8 function on the CPU) are captured with
    their layers and replayed, every loss and gradient exactly those without graphs; under LoRA with the frozen
    bases dropped, the replays read the FP8 copies made before the capture."""
    from helpers import cpu_candidates

    from fusepatch.layers.support import projections
    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear

    made, replays = capture
    calls = cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    torch.manual_seed(0)
    base = tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256).to(torch.bfloat16).train()
    kwargs = {"precision": "fp8", "verbose": False}
    if lora:
        import peft

        config = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
        base = peft.get_peft_model(base, config, autocast_adapter_dtype=False)
        kwargs["drop_frozen_weights"] = True
    plain, graphed = copy.deepcopy(base), copy.deepcopy(base)
    fusepatch.apply(plain, **kwargs)
    fusepatch.apply(graphed, cuda_graphs=True, **kwargs)
    ids = torch.randint(0, 512, (2, 24))
    assert _train(graphed, 5, ids) == _train(plain, 5, ids)
    assert made == [4] and len(replays) == 1 + 3 * 4 and calls  # the FP8 function ran (as the capture did)
    fp8 = [m for m in graphed.modules() if "fp8_linear" in getattr(getattr(m, "_fusepatch", None), "ops", {})]
    assert fp8 and all(type(m.weight).__name__ == "DroppedWeight" for m in fp8 if lora)
    for name, grad in grads(plain).items():
        torch.testing.assert_close(grads(graphed)[name], grad, rtol=0, atol=0, msg=name)


@pytest.fixture
def reads_captured(capture, monkeypatch):
    """``capture``, with replays that read the FP8 copies of frozen weights the capture read, as a CUDA graph reads
    their memory, after the check each copy's capture recorded ran (the candidate's ``refresh``: it requantizes in
    place a copy whose weight changed), as the graph runs it. A copy made anew after the capture (other buffers)
    reaches a replay only if the graphs were dropped and captured again."""
    from fusepatch.ops.prepared import PreparedWeights

    real, held = PreparedWeights.handle, {"capturing": None, "replaying": None}

    def handle(self, candidate, weight):
        copy_ = real(self, candidate, weight)
        if held["replaying"] is not None and id(weight) in held["replaying"]:
            return held["replaying"][id(weight)]
        if held["capturing"] is not None and copy_ is not None:
            held["capturing"][id(weight)] = copy_
        return copy_

    class _Reads(layer_graphs._Rerun):
        def capture(self, fn, stream):
            held["capturing"] = self.read = {}
            try:
                return super().capture(fn, stream)
            finally:
                held["capturing"] = None

        def replay(self) -> None:
            held["replaying"] = self.read
            try:
                super().replay()
            finally:
                held["replaying"] = None

    monkeypatch.setattr(PreparedWeights, "handle", handle)
    monkeypatch.setattr(layer_graphs, "GRAPH", _Reads)
    return capture


def _lora_fp8_pair(monkeypatch):
    """A LoRA model over FP8 bases (the real FP8 function on the CPU), without graphs and with them."""
    import peft
    from helpers import cpu_candidates

    from fusepatch.layers.support import projections
    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear

    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    torch.manual_seed(0)
    base = tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256).to(torch.bfloat16).train()
    config = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    base = peft.get_peft_model(base, config, autocast_adapter_dtype=False)
    plain, graphed = copy.deepcopy(base), copy.deepcopy(base)
    fusepatch.apply(plain, precision="fp8", verbose=False)
    fusepatch.apply(graphed, cuda_graphs=True, precision="fp8", verbose=False)
    return plain, graphed


def test_a_merge_around_an_evaluation_keeps_the_graphs(reads_captured, monkeypatch):
    """A graph reads the memory of the FP8 copy of a frozen base it was captured with, and runs the copy's check:
    peft's merge for an evaluation and its unmerge write the bases through ``.data``, the check quantizes the copy
    again in its own buffers, and the graphs keep serving, the losses those of the model without graphs through the
    same sequence."""
    made, _ = reads_captured
    plain, graphed = _lora_fp8_pair(monkeypatch)
    ids = torch.randint(0, 512, (2, 24))
    losses = {}
    for name, model in (("plain", plain), ("graphed", graphed)):
        first = _train(model, 3, ids)
        model.merge_adapter()
        with torch.no_grad():
            evaluated = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
        model.unmerge_adapter()
        losses[name] = (first, evaluated, _train(model, 4, ids))
    assert losses["graphed"] == losses["plain"]
    assert made == [4]  # captured at the third step, and kept


@pytest.mark.parametrize("when", ["after the capture", "before the capture step"])
def test_frozen_bases_loaded_in_place_reach_the_graphs(reads_captured, monkeypatch, when):
    """``load_state_dict`` into the frozen bases (same storage, a new version): outside a graph the FP8 copy is
    made anew; the graphs see the version and are dropped, so every loss is the model's without graphs. Loaded
    just before the step that captures, the capture's own forward makes the copy, and one capture serves."""
    made, _ = reads_captured
    plain, graphed = _lora_fp8_pair(monkeypatch)
    ids = torch.randint(0, 512, (2, 24))
    halved = {k: v * 0.5 for k, v in plain.state_dict().items() if "base_layer.weight" in k}
    first = 3 if when == "after the capture" else 2
    losses = {}
    for name, model in (("plain", plain), ("graphed", graphed)):
        before = _train(model, first, ids)
        model.load_state_dict(halved, strict=False)
        losses[name] = (before, _train(model, 4, ids))
    assert losses["graphed"] == losses["plain"]
    assert made == ([4, 4] if when == "after the capture" else [4])


def test_training_off_the_gpu_says_graphs_need_one(caplog):
    """``cuda_graphs=True`` on a model that trains on the CPU: the layers run as usual, and that is said once with
    the fix (never a silent request); inference on the CPU says nothing."""
    _, graphed = _pair()
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        graphed.eval()(input_ids=ids, use_cache=False)
    assert not [r for r in caplog.records if "CUDA graphs" in r.getMessage()]
    _train(graphed.train(), 2, ids)
    said = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    assert len(said) == 1 and "model.to('cuda')" in said[0], said


def test_layers_patched_anew_after_the_capture_drop_the_graphs(capture):
    """A second apply that patches more of the layers (the FP8 projections) changes what a step runs: the graphs
    captured before are dropped and the layers captured again, never replaying the layers as they were."""
    made, _ = capture
    _, graphed = _pair()
    ids = torch.randint(0, 512, (2, 24))
    _train(graphed, 3, ids)
    assert made == [4]
    fusepatch.apply(graphed, precision="fp8", verbose=False)
    _train(graphed, 3, ids)
    assert made == [4, 4]


def test_a_copy_of_a_graphed_model_has_one_holder_for_its_layers(capture):
    """``copy.deepcopy`` of a model with graphs: its layers share one new holder, as the source's do, so the
    copy captures its own graphs."""
    made, _ = capture
    _, graphed = _pair()
    twin = copy.deepcopy(graphed)
    holders = {id(layer.__dict__[layer_graphs.ATTRIBUTE][0]) for layer in twin.model.layers}
    assert len(holders) == 1
    _train(twin, 3, torch.randint(0, 512, (2, 24)))
    assert made == [4]
