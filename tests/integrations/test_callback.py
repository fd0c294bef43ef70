"""FusePatchCallback inside a real transformers Trainer on a tiny model (CPU)."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from helpers import RandomTokens, cpu_trainer
from transformers import TrainerCallback

import fusepatch
from fusepatch import FusePatchCallback, attach
from fusepatch.base.state import current as process_state
from fusepatch.diagnostics.profile import flops_per_token, matmul_parameters, peak_tflops_for
from fusepatch.tools.tiny import tiny_model

pytest.importorskip("accelerate")


def test_callback_applies_logs_the_report_and_profiles_a_step(tmp_path, caplog):
    callback = FusePatchCallback(profile_step=2, trace_dir=str(tmp_path / "traces"), time_steps=True)
    trainer = cpu_trainer(tmp_path, [callback])
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        trainer.train()
    assert callback.report is not None and callback.report.patched > 0
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "Qwen3_5GatedDeltaNet x3" in messages  # the report table
    assert "fusepatch: eager for " in messages and "gated_delta_rule" in messages  # the fallbacks, with reasons
    assert messages.count("why not fused") == 1  # the table once
    assert "fusepatch profile of step 2" in messages
    merged = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    assert merged["fusepatch/cpu_ops_per_step"] > 100
    assert merged["fusepatch/gpu_kernels_per_step"] == 0  # CPU run
    assert merged["fusepatch/tokens_per_s"] > 0
    assert 0 < merged["fusepatch/step_time_s"] < 60
    assert merged["fusepatch/fallbacks"] >= 1 and "fusepatch/fused_ops" in merged
    assert 0 < merged["fusepatch/first_step_s"] < 60
    assert "fusepatch/gpu_busy_fraction" not in merged  # no CUDA: not claimed
    profile = callback.last_profile
    assert profile.tokens == 2 * 48 and profile.step == 2
    assert dict(profile.ops_by_layer).get("Qwen3_5GatedDeltaNet", 0) > 0
    assert list((tmp_path / "traces").glob("fusepatch-step2.json"))
    steady = callback.steady_state()  # steps 3 and 4, less the profiled step 2: step 3 and 4
    assert steady["steps"] == 2 and 0 < steady["median_step_s"] < 60 and steady["median_tokens_per_s"] > 0
    assert "steady steps, median" in messages
    # patched forwards stay after training (the callback does not revert)
    assert "_fusepatch" in trainer.model.model.layers[0].linear_attn.__dict__


def test_mixed_precision_survives_patching_after_the_trainer_wrapped_the_model(tmp_path, monkeypatch):
    """Trainer(bf16=True) on fp32 weights: accelerate wraps model.forward in autocast before the callback patches
    the model. Patching must keep that autocast (it replaced the wrapper: the model ran in fp32), choose kernels
    for bf16, and hand the fused loss bf16 hidden states and weight. A CPU stand-in plays the fused loss."""
    import dataclasses

    from fusepatch.base.requirements import InputRule
    from fusepatch.engine import selftest
    from fusepatch.ops import OPS

    op = OPS["linear_cross_entropy"]
    chunked = next(c for c in op.candidates if c.name == "torch-chunked")
    seen_by_loss = []
    real = chunked.load

    def load():
        fn = real()

        def loss(hidden, weight, *args, **kwargs):
            seen_by_loss.append((hidden.dtype, weight.dtype, torch.is_autocast_enabled("cpu")))
            return fn(hidden, weight, *args, **kwargs)

        return loss

    standin = dataclasses.replace(chunked, load=load, inputs=InputRule(devices=("cpu",), kernel="stand-in"))
    monkeypatch.setitem(OPS, "linear_cross_entropy", dataclasses.replace(op, candidates=(standin,)))
    selftest.clear_cache()
    callback = FusePatchCallback(profile=False)
    trainer = cpu_trainer(tmp_path, [callback], max_steps=2, bf16=True)
    layer_autocast = []
    trainer.model.model.layers[0].register_forward_hook(
        lambda module, args, out: layer_autocast.append(torch.is_autocast_enabled("cpu"))
    )
    trainer.train()
    assert callback.report.dtype == "bfloat16", callback.report.dtype
    assert layer_autocast and all(layer_autocast), layer_autocast
    assert seen_by_loss and all(s == (torch.bfloat16, torch.bfloat16, False) for s in seen_by_loss), seen_by_loss
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


class PaddedTokens(RandomTokens):
    """Rows of 48 tokens whose last 8 are padding (attention_mask 0)."""

    def __getitem__(self, i):
        mask = torch.ones(48, dtype=torch.long)
        mask[40:] = 0
        return {**super().__getitem__(i), "attention_mask": mask}


@pytest.mark.parametrize("kwargs, synced", [({}, []), ({"profile_step": 3}, [3, 3])])
def test_steps_not_profiled_neither_sync_nor_read_tensors_back(tmp_path, monkeypatch, kwargs, synced):
    """A step that is not profiled runs as it would without the callback: no device sync (each one empties the GPU's
    queue) and no tensor read back to the host by the token count. Profiling is opt-in and takes one step, synced
    at both ends; it counts the tokens that are not padding."""
    from transformers import TrainerCallback

    step, syncs, reads, inside = [0], [], [], []

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            step[0] = state.global_step + 1

    monkeypatch.setattr(FusePatchCallback, "_sync", lambda self: syncs.append(step[0]))
    counting = FusePatchCallback._count_tokens

    def watched_count(self, *args, **kw):
        inside.append(1)
        try:
            return counting(self, *args, **kw)
        finally:
            inside.pop()

    monkeypatch.setattr(FusePatchCallback, "_count_tokens", watched_count)
    for name in ("__int__", "__index__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda t, *a, _real=real, _name=name: (inside and reads.append(_name)) or _real(t, *a)
        )
    callback = FusePatchCallback(**kwargs)
    trainer = cpu_trainer(tmp_path, [Steps(), callback])
    trainer.train_dataset = PaddedTokens()
    trainer.train()
    assert syncs == synced and reads == []
    assert (callback.last_profile is None) == (not kwargs)
    if kwargs:
        assert callback.last_profile.step == 3 and callback.last_profile.tokens == 2 * 40
    keys = {k for entry in trainer.state.log_history for k in entry}
    assert "fusepatch/first_step_s" in keys and ("fusepatch/cpu_ops_per_step" in keys) == bool(kwargs)


def test_first_steps_are_timed_on_the_gpu_without_waiting_for_it(monkeypatch):
    """On CUDA the first two steps are timed with events, read once the GPU has passed them (a stand-in plays the
    events here): nothing waits for the GPU until training is over."""
    from fusepatch.integrations import trainer as integration

    class Event:
        made: list = []

        def __init__(self, enable_timing=False):
            self.at, self.done, self.waited = None, False, False
            Event.made.append(self)

        def record(self):  # one second of GPU time between records
            self.at = float(sum(e.at is not None for e in Event.made))

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True

        def elapsed_time(self, end):
            assert self.at is not None and end.at is not None and end.done
            return (end.at - self.at) * 1000.0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    watch = integration._Stopwatch()
    assert watch.seconds() is None and watch.seconds(wait=True) is None  # not stopped: nothing to read
    watch.stop()
    assert watch.seconds() is None  # the GPU has not reached the stop
    Event.made[1].done = True
    assert watch.seconds() == 1.0 and not Event.made[1].waited
    late = integration._Stopwatch()
    late.stop()
    assert late.seconds(wait=True) == 1.0 and Event.made[3].waited


def test_profiling_off(tmp_path):
    trainer = cpu_trainer(tmp_path, [FusePatchCallback(profile=False)], max_steps=2)
    trainer.train()
    keys = {k for entry in trainer.state.log_history for k in entry}
    assert "fusepatch/fused_ops" in keys and "fusepatch/cpu_ops_per_step" not in keys


def test_attach_puts_the_callback_first(tmp_path):
    trainer = cpu_trainer(tmp_path, None, max_steps=1)
    callback = attach(trainer, FusePatchCallback(profile_step=1))
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()
    assert callback.last_profile is not None


def test_profile_step_must_count_from_one():
    with pytest.raises(ValueError, match="from 1"):
        FusePatchCallback(profile_step=0)


def test_cpu_bound_summary_names_layers():
    from fusepatch.diagnostics.profile import StepProfile

    profile = StepProfile(
        step=5,
        step_time_s=0.5,
        cpu_ops=38000,
        gpu_kernels=20000,
        gpu_busy_fraction=0.4,
        tokens=4096,
        peak_memory_gib=60.0,
        mfu=0.2,
        ops_by_layer=[("Qwen3_5GatedDeltaNet", 30000)],
    )
    text = profile.summary()
    assert "CPU-bound" in text and "idle 60%" in text and "Qwen3_5GatedDeltaNet (30,000 ops)" in text
    assert profile.metrics()["fusepatch/gpu_busy_fraction"] == 0.4


@pytest.mark.parametrize(
    "apply_kwargs, said",
    [
        ({}, 'FusePatchCallback(apply_kwargs={"cuda_graphs": True})'),
        ({"cuda_graphs": True}, "CUDA graphs are on, but no step was captured"),
    ],
)
def test_a_cpu_bound_step_says_what_cuda_graphs_would_do(tmp_path, caplog, monkeypatch, apply_kwargs, said):
    """A profiled step whose GPU waited for the host (a trace with GPU busy 40%, as a small model's) names the
    layer graphs as the fix, or, when they are on, why they did not take the step (here: graphs capture on a GPU
    only)."""
    from fusepatch.diagnostics import profile as profiling

    def waiting(events, **kwargs):
        return profiling.StepProfile(
            step=kwargs["step"], step_time_s=0.2, cpu_ops=9000, gpu_kernels=2000, gpu_busy_fraction=0.4,
            tokens=kwargs["tokens"], peak_memory_gib=None, mfu=None,
        )  # fmt: skip

    monkeypatch.setattr(profiling, "summarize", waiting)
    callback = FusePatchCallback(profile_step=2, apply_kwargs=apply_kwargs)
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        cpu_trainer(tmp_path, [callback], max_steps=3).train()
    profiled = [r.getMessage() for r in caplog.records if "fusepatch profile of step 2" in r.getMessage()]
    assert len(profiled) == 1 and "CPU-bound" in profiled[0] and said in profiled[0], profiled


def test_no_graphs_advice_where_they_cannot_help(monkeypatch):
    """Activation checkpointing (graphs would keep what it drops), FSDP2 shards and models without a patched
    dense decoder stack get no advice about CUDA graphs."""
    from fusepatch.integrations.trainer import graphs_advice
    from fusepatch.layers import layer_graphs

    model = tiny_model("qwen3_5_text")
    assert graphs_advice(model) == ""  # not patched
    fusepatch.apply(model, verbose=False)
    assert "cuda_graphs" in graphs_advice(model)
    with monkeypatch.context() as patched:
        patched.setattr(layer_graphs, "sharded", lambda params: True)
        assert graphs_advice(model) == ""
    model.gradient_checkpointing_enable()
    assert graphs_advice(model) == ""


def test_flop_count_and_peaks():
    model = tiny_model("qwen3_5_text")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_parameters(model) == linear
    assert flops_per_token(model, 128) > 6 * linear
    moe = tiny_model("qwen3_moe")
    experts = sum(p.numel() for n, p in moe.named_parameters() if ".experts." in n)
    dense = sum(m.weight.numel() for m in moe.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_parameters(moe) == pytest.approx(dense + experts * 2 / 4)
    assert peak_tflops_for("NVIDIA H200") == 989.0 and peak_tflops_for("NVIDIA GH200 480GB") == 989.0
    assert peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0  # SXM
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756.0  # not SXM's number
    assert peak_tflops_for("NVIDIA H100 NVL") == 835.0 and peak_tflops_for("NVIDIA H200 NVL") == 835.0
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0 and peak_tflops_for("NVIDIA A10G") == 70.0
    assert peak_tflops_for("Some CPU") is None


def test_flops_per_token_is_what_torchs_flop_counter_counts():
    """The MFU's FLOPs per token against ``torch.utils.flop_counter`` on a real training step of a dense model:
    the GEMMs exactly, and causal attention as half of what the counter counts (it counts the masked half too)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_model("qwen3").train()
    tokens = 64
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    counted = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    gemms = 6 * matmul_parameters(model)
    assert counted["aten.mm"] == tokens * gemms
    assert counted["aten.bmm"] == 2 * tokens * (flops_per_token(model, tokens) - gemms)


def test_frozen_weights_count_no_weight_gradient():
    """A frozen weight (LoRA's base layers, a frozen lm_head) costs its forward and input-gradient GEMMs, 4 FLOPs
    per parameter and token, not 6: counted as trained, a LoRA step's MFU read over 100% on an H200."""
    peft = pytest.importorskip("peft")
    model = tiny_model("qwen3_5_text")
    linear = matmul_parameters(model)
    trained = flops_per_token(model, 128)
    model.requires_grad_(False)
    assert trained - flops_per_token(model, 128) == pytest.approx(2 * linear)
    lora = peft.get_peft_model(
        tiny_model("qwen3_5_text"), peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"])
    )
    adapters = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)
    assert adapters > 0
    assert flops_per_token(lora, 128) == pytest.approx(trained - 2 * linear + 6 * adapters)


def test_a_slow_first_step_is_explained(caplog):
    callback = FusePatchCallback(profile=False)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        callback._report_first_step(95.0, 0.25)
    assert "first step took 95 s, 380x the second" in caplog.text and "fusepatch warmup" in caplog.text
    assert callback._pending["fusepatch/first_step_s"] == 95.0


def event(name, start, end, device=None, annotation=False):
    """A stand-in for one torch.profiler event (a GPU kernel unless ``device`` says otherwise), times in us."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    return SimpleNamespace(
        name=name,
        device_type=DeviceType.CUDA if device is None else device,
        time_range=SimpleNamespace(start=start, end=end),
        is_user_annotation=annotation,
        cpu_parent=None,
    )


def test_gpu_annotations_are_not_kernels_and_not_busy_time():
    """On the GPU timeline record_function ranges (layer labels, Optimizer.step) appear beside the kernels; they
    span the idle gaps between their kernels, so counting them would report a busy GPU that is not."""
    from torch.autograd import DeviceType

    from fusepatch.diagnostics.profile import summarize

    events = [
        event("aten::mm", 0, 5, device=DeviceType.CPU),
        event("gemm_kernel", 0, 100),
        event("gemm_kernel", 900, 1000),
        event("fusepatch::Qwen3MLP", 0, 1000, annotation=True),
        event("Optimizer.step#AdamW.step", 0, 1000, annotation=True),
    ]
    profile = summarize(events, step=3, wall_s=1e-3, tokens=10, flops=None, peak_tflops=None)
    assert profile.gpu_kernels == 2 and profile.cpu_ops == 1
    assert profile.gpu_busy_fraction == 0.2  # 200 us of kernels in a 1 ms step, not the annotations' 1 ms
    assert [name for name, _ in profile.top_kernels] == ["gemm_kernel"]


def test_host_waits_are_counted_and_named_with_their_ops():
    """A ``.item()`` in the loss logging (a device-to-host copy that waits inside ``cudaMemcpyAsync``) and a
    synchronize: the profile lists each with the ops that made it, most waiting first, and the summary names the
    largest once the step spent at least HOST_WAIT_MS in them."""
    from torch.autograd import DeviceType

    from fusepatch.diagnostics.profile import HOST_WAIT_MS, summarize

    cpu = DeviceType.CPU
    item = event("aten::item", 100, 2100, device=cpu)
    dense = event("aten::_local_scalar_dense", 100, 2100, device=cpu)
    dense.cpu_parent = item
    copy = event("cudaMemcpyAsync", 110, 2000, device=cpu)
    copy.cpu_parent = dense
    sync = event("cudaStreamSynchronize", 2500, 2600, device=cpu)
    events = [item, dense, copy, sync, event("gemm_kernel", 0, 1900), event("gemm_kernel", 2050, 3000)]
    profile = summarize(events, step=2, wall_s=3e-3, tokens=10, flops=None, peak_tflops=None)
    assert profile.host_waits == [
        ["cudaMemcpyAsync < aten::_local_scalar_dense < aten::item", 1, 1.89],
        ["cudaStreamSynchronize < -", 1, 0.1],
    ]
    assert 1.99 >= HOST_WAIT_MS
    assert "The CPU waited for the GPU 2 times (2.0 ms), most in cudaMemcpyAsync < aten::_local_scalar_dense" in (
        profile.summary()
    )
    quiet = summarize(events[:3] + events[4:], step=2, wall_s=3e-3, tokens=10, flops=None, peak_tflops=None)
    quiet.host_waits = [["cudaStreamSynchronize < -", 1, 0.1]]
    assert "waited" not in quiet.summary()


def _triton_builds(name: str):
    """What Triton does after building a kernel variant: call the post-compile hook, as ``JITFunction._call_hook``
    calls it (a CPU machine cannot build a GPU kernel, so the test makes the call itself)."""
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    hook = knobs.runtime.jit_post_compile_hook
    if hook is not None:
        hook(
            key=(),
            repr=name,
            fn=JitFunctionInfo("tests", name, None),
            compile={},
            is_manual_warmup=False,
            already_compiled=False,
        )


def test_kernel_builds_after_the_warm_up_steps_are_named(tmp_path, caplog):
    """A kernel that specializes on a size changing every step rebuilds each step (the H200 SFT run of 2026-11-29):
    the callback names it in the profiled step, in a warning at the first such step, and at the end."""
    knobs = pytest.importorskip("triton.knobs")
    before = knobs.runtime.jit_post_compile_hook
    calls = []

    def earlier_hook(**kwargs):  # someone else's hook: still called, and put back afterwards
        calls.append(kwargs["fn"].name)

    knobs.runtime.jit_post_compile_hook = earlier_hook
    try:
        callback = FusePatchCallback(profile_step=4)
        trainer = cpu_trainer(tmp_path, [callback], max_steps=5)
        steps = []
        trainer.model.register_forward_pre_hook(lambda module, args: steps.append(1))
        # every forward builds "warm_up_kernel" during steps 1-2 and "size_specialized_kernel" afterwards
        trainer.model.register_forward_pre_hook(
            lambda module, args: _triton_builds("warm_up_kernel" if len(steps) <= 2 else "size_specialized_kernel")
        )
        with caplog.at_level(logging.INFO, logger="fusepatch"):
            trainer.train()
        assert knobs.runtime.jit_post_compile_hook is earlier_hook
    finally:
        knobs.runtime.jit_post_compile_hook = before
    assert calls.count("warm_up_kernel") == 2 and calls.count("size_specialized_kernel") == 3
    assert dict(callback.late_builds) == {"size_specialized_kernel": 3}
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "step 3 made 1 Triton kernel build (size_specialized_kernel 1) after the warm-up steps" in messages
    assert "During this step: 1 Triton kernel build (size_specialized_kernel 1)." in messages
    assert "3 Triton kernel builds (size_specialized_kernel 3) in 3 steps after the first two" in messages
    merged = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    assert merged["fusepatch/triton_builds"] == 1


def test_no_kernel_builds_no_warning(tmp_path, caplog):
    pytest.importorskip("triton.knobs")
    callback = FusePatchCallback(profile_step=3)
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        cpu_trainer(tmp_path, [callback], max_steps=4).train()
    assert not callback.late_builds
    assert "Triton kernel build" not in "\n".join(r.getMessage() for r in caplog.records)


def test_long_gpu_idle_stretches_name_the_op_the_cpu_was_in():
    """What found the cuDNN plan builds in the two-GPU trace: the longest gaps between kernels, each with the
    innermost aten op running across it (any thread), in the profile line; gaps under 5 ms are not listed."""
    from torch.autograd import DeviceType

    from fusepatch.diagnostics.profile import summarize

    cpu = DeviceType.CPU
    events = [
        event("gemm", 0, 1_000),
        event("aten::scaled_dot_product_attention", 1_000, 61_500, device=cpu),
        event("aten::_cudnn_attention_forward", 1_100, 61_400, device=cpu),  # innermost: named
        event("flash_fwd", 61_000, 62_000),
        event("gemm", 62_500, 63_000),  # a 0.5 ms launch gap: not listed
        event("aten::item", 63_000, 71_000, device=cpu),
        event("gemm", 71_000, 72_000),
        event("gemm", 90_000, 100_000),  # 18 ms with no aten op open
    ]
    profile = summarize(events, step=8, wall_s=0.1, tokens=4096, flops=None, peak_tflops=None)
    assert profile.idle_gaps == [(60.0, "aten::_cudnn_attention_forward"), (18.0, "Python code"), (8.0, "aten::item")]
    assert (
        "Longest GPU idle stretches: 60 ms in aten::_cudnn_attention_forward, 18 ms in Python code" in profile.summary()
    )


@pytest.mark.slow
def test_trainer_torch_compile_trains_the_patched_model_as_uncompiled(tmp_path, chunked_on_cpu, caplog):
    """``TrainingArguments(torch_compile=True)``: accelerate compiles the model, the callback patches it at the
    start of training, and a model whose ops run fused kernels (the chunked loss, let onto the CPU) runs outside
    dynamo: the Trainer's losses are the uncompiled run's, and the first compiled step says why once."""
    from torch._dynamo.utils import counters

    losses = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        process_state().said.reset()  # the note about dynamo is said again
        torch.manual_seed(0)
        extra = {"torch_compile": True, "torch_compile_backend": "eager"} if compiled else {}
        trainer = cpu_trainer(tmp_path / str(compiled), [FusePatchCallback(profile=False)], max_steps=3, **extra)
        with caplog.at_level(logging.INFO, logger="fusepatch"):
            trainer.train()
        losses[compiled] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule) == compiled
        said = [r.getMessage() for r in caplog.records if "outside dynamo" in r.getMessage()]
        caplog.clear()
        assert len(said) == (1 if compiled else 0), said
    assert len(losses[True]) == 3
    assert losses[True] == losses[False]


def test_layer_labels_leave_a_compiled_model_as_dynamo_traced_it():
    """The profiled step's layer labels are forward hooks; on a compiled module they fail dynamo's guards and the
    next call is traced again (188 ms of a profiled 2B-like step on the H200, which then read as CPU-bound). A
    compiled model, or one the Trainer compiles (``torch_compile=True``), is profiled without them."""
    from fusepatch.diagnostics.profile import label_layers

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.compile(backend="eager")
    x = torch.randn(4, 8)
    model(x).sum().backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        with label_layers(model, {"Linear", "Sequential"}) as labelled:
            model(x).sum().backward()
    assert labelled is False
    plain = torch.nn.Sequential(torch.nn.Linear(8, 2))
    with label_layers(plain, {"Linear"}) as labelled:
        assert labelled is True and plain[0]._forward_hooks
    with label_layers(plain, {"Linear"}, compiled=True) as labelled:
        assert labelled is False and not plain[0]._forward_hooks


def test_the_callback_adds_a_precision_the_patched_model_lacks(tmp_path, caplog):
    """A model patched before training (``from_pretrained``, an earlier ``apply``) and a callback asking for
    ``precision="fp8"``: the FP8 rows are added; other apply_kwargs are said to be unused, with the fix."""
    import types

    model = tiny_model("qwen3", hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    fusepatch.apply(model, verbose=False)
    callback = fusepatch.FusePatchCallback(profile=False, apply_kwargs={"precision": "fp8"})
    args = types.SimpleNamespace(bf16=False, fp16=False)
    callback.on_train_begin(args, None, None, model=model)
    assert any(c.op == "fp8_linear" for layer in callback.report.layers for c in layer.choices)
    assert any(
        "forward" in m.__dict__ and m.__dict__["_fusepatch"].row.precision == "fp8"
        for m in model.modules()
        if "_fusepatch" in m.__dict__
    )
    callback.on_train_end(args, None, None, model=model)
    other = fusepatch.FusePatchCallback(profile=False, apply_kwargs={"exclude": "swiglu"})
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        other.on_train_begin(args, None, None, model=model)
    assert any("exclude" in r.getMessage() and "fix:" in r.getMessage() for r in caplog.records)
    other.on_train_end(args, None, None, model=model)


BAD_APPLY_KWARGS = (
    {"strict": "no"},
    {"cuda_graphs": 1},
    {"compute_dtype": "int8"},
    {"precision": "fp4"},
    {"exclude": ["no_such_op"]},
    {"prefer": "conda"},
    {"drop_frozen_weights": True},
    {"op": ["swiglu"]},
    {"model": None},
)


@pytest.mark.parametrize("kwargs", BAD_APPLY_KWARGS, ids=lambda kwargs: next(iter(kwargs)))
def test_apply_kwargs_are_checked_when_the_callback_is_made(kwargs, tmp_path):
    """A name or value ``apply`` refuses raises when the callback is made (and in ``from_pretrained`` before it
    loads anything), with apply's own error, not at the first training step."""
    model = tiny_model("qwen3", num_hidden_layers=1)
    with pytest.raises((TypeError, ValueError)) as from_apply:
        fusepatch.apply(model, **kwargs)
    with pytest.raises(from_apply.type) as from_callback:
        FusePatchCallback(apply_kwargs=kwargs)
    with pytest.raises(from_apply.type) as from_loader:
        fusepatch.from_pretrained(str(tmp_path / "nothing here"), apply_kwargs=kwargs)  # no such checkpoint
    if "model" not in kwargs:  # apply(model, model=None) is Python's "multiple values": the callback says why
        assert str(from_apply.value) in str(from_callback.value)
    assert str(from_callback.value) == str(from_loader.value)
    assert not model.__dict__.get("_fusepatch")


def test_the_callback_checks_the_variables_apply_reads(monkeypatch):
    """A FUSEPATCH_* value apply refuses raises when the callback is made; a callback that applies nothing
    (``apply_patches=False``) checks nothing for apply."""
    monkeypatch.setenv("FUSEPATCH_DISABLE", "maybe")
    with pytest.raises(ValueError, match="FUSEPATCH_DISABLE='maybe' is not a switch value"):
        FusePatchCallback()
    FusePatchCallback(apply_patches=False, apply_kwargs={"compute_dtype": "bf16"})


class _FreezeWatch(TrainerCallback):
    """What ``gc.get_freeze_count()`` is as each optimizer step begins (1-based)."""

    def __init__(self):
        self.at = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.at[state.global_step + 1] = gc.get_freeze_count()


@pytest.mark.parametrize("freeze_gc", [True, False])
def test_long_lived_objects_leave_the_collectors_walks_after_step_2(tmp_path, caplog, freeze_gc):
    """A full collection walks every object alive (376 to 507 ms every 8 steps at 27B's full depth): after the two
    compiling steps the callback freezes what is alive then, until training ends, and says what the collections
    cost."""
    gc.unfreeze()
    watch = _FreezeWatch()
    trainer = cpu_trainer(tmp_path, [FusePatchCallback(freeze_gc=freeze_gc), watch], max_steps=4)
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        trainer.train()
    frozen = watch.at[3] if freeze_gc else 0
    assert watch.at == {1: 0, 2: 0, 3: frozen, 4: watch.at[4]} and gc.get_freeze_count() == 0
    if freeze_gc:
        assert 0 < watch.at[4] <= frozen and frozen > 10_000  # the model, torch, transformers
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert ("out of the garbage collector's walks after the second step" in messages) is freeze_gc
    assert "Python's garbage collections during training: " in messages


def test_objects_frozen_before_training_stay_frozen(tmp_path):
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        cpu_trainer(tmp_path, [FusePatchCallback()], max_steps=3).train()
        assert gc.get_freeze_count() >= before > 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("freeze_gc", [True, False])
def test_the_profiled_step_says_what_the_collector_took(tmp_path, caplog, freeze_gc):
    """A collection shows in a trace only as a gap without ops: the profiled step's summary names it, with its
    generation, and ``fusepatch/gc_ms`` carries its time."""
    gc.unfreeze()
    trainer = cpu_trainer(tmp_path, [FusePatchCallback(profile_step=3, freeze_gc=freeze_gc)], max_steps=3)
    calls = []

    def full_collection(module, args):  # a generation-2 collection in the forward of step 3
        calls.append(1)
        if len(calls) == 3:
            alive = [[] for _ in range(200_000)]  # made in this step: walked whether or not step 2 froze the rest
            gc.collect()
            del alive

    trainer.model.register_forward_pre_hook(full_collection)
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        trainer.train()
    summary = next(r.getMessage() for r in caplog.records if "profile of step 3" in r.getMessage())
    assert "Python's garbage collector paused the host" in summary and "of generation 2" in summary, summary
    assert ("freeze_gc=True keeps" in summary) is not freeze_gc
    merged = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    assert merged["fusepatch/gc_ms"] >= 1.0


@pytest.fixture
def no_automatic_full_collections():
    """Only the collections a test makes are of generation 2 (none set off by allocations), and nothing frozen."""
    thresholds = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(thresholds[0], thresholds[1], 1_000_000_000)
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()


def test_the_freeze_is_no_part_of_a_profiled_second_step(tmp_path, caplog, no_automatic_full_collections):
    """``profile_step=2``: the freeze after step 2 collects the whole heap, which is the callback's work, not the
    step's: neither the step's wall time nor the collections its summary names hold it."""
    callback = FusePatchCallback(profile_step=2)
    trainer = cpu_trainer(tmp_path, [callback], max_steps=3)
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        trainer.train()
    summary = next(r.getMessage() for r in caplog.records if "profile of step 2" in r.getMessage())
    assert "of generation 2" not in summary, summary
    assert callback.gc_pauses.counts[2] == 0  # the freeze's own collection is said by its own line
    assert "walks after the second step" in caplog.text


def test_a_resumed_run_freezes_after_its_own_second_step(tmp_path, no_automatic_full_collections):
    """A run resumed from a checkpoint starts past step 2: it freezes after the second step it runs."""
    first = cpu_trainer(tmp_path, [FusePatchCallback(freeze_gc=False)], max_steps=3)
    first.train()
    first._save_checkpoint(first.model, trial=None)
    watch = _FreezeWatch()
    resumed = cpu_trainer(tmp_path, [FusePatchCallback(), watch], max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert watch.at[4] == watch.at[5] == 0 and watch.at[6] > 10_000 and gc.get_freeze_count() == 0


class _Interrupt(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise KeyboardInterrupt


def test_a_training_that_raised_leaves_nothing_frozen_past_the_next(tmp_path, caplog, no_automatic_full_collections):
    """A training interrupted after step 2 never reaches ``on_train_end``: what it froze stays frozen (a model
    dropped then is never collected). The next training unfreezes it as it begins, and thaws its own freeze."""
    interrupted = cpu_trainer(tmp_path, [FusePatchCallback(), _Interrupt()], max_steps=5)
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    assert gc.get_freeze_count() > 10_000
    watch = _FreezeWatch()
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        cpu_trainer(tmp_path, [FusePatchCallback(), watch], max_steps=3).train()
    assert watch.at[1] == 0 and gc.get_freeze_count() == 0
    assert "a training that ended without on_train_end" in caplog.text


def test_each_training_says_its_own_collections(tmp_path, caplog, no_automatic_full_collections):
    """Two ``train()`` calls with one callback: each end of training names the collections of that training."""
    callback = FusePatchCallback()
    trainer = cpu_trainer(tmp_path, [callback], max_steps=3)
    trainer.train()

    def full_collection(module, args):  # one in each step's forward
        gc.collect()

    trainer.model.register_forward_pre_hook(full_collection)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        trainer.train()
    said = next(r.getMessage() for r in caplog.records if "collections during training" in r.getMessage())
    assert "3 of generation 2" in said, said
