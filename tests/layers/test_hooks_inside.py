"""A user's hook inside a patched layer, writing its tensor in place (``out.mul_(1.5)``), trains as in the unpatched
model: on a module whose work a fused path does itself (the post-attention norm, an MLP's ``act_fn``, the Gated
DeltaNet's output norm, ``lm_head`` under the fused loss) the path steps aside so that the hook runs; and the
outputs of fusepatch's own autograd functions (the MLP's recomputed down projection, fused LoRA, the narrow
projections' shared GEMM) are tensors a later hook may write in place. The fused paths run on the CPU with the ops'
references as candidates, as the GPU runs them with kernels."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_step, lm_batch, step_loss_and_grads

import fusepatch
from fusepatch.tools.tiny import FAMILIES, tiny_model


def _model(family: str, patched: bool, lora: bool):
    over = {"num_hidden_layers": 2}
    if "layer_types" in FAMILIES[family]:
        over["layer_types"] = ["linear_attention", "full_attention"]
    model = tiny_model(family, seed=0, **over)
    if lora:
        import peft

        torch.manual_seed(0)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model = peft.get_peft_model(model, config)
    if patched:
        fusepatch.apply(model, verbose=False)
    return model.train()


def _step(model, batch, name: str, pre: bool):
    """Loss, gradients and how often the hook ran, with ``mul_(1.5)`` on the module's output (or first input)."""
    calls = []

    def edit(tensors):
        first = next(t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point())
        calls.append(1)
        first.mul_(1.5)

    module = model.get_submodule(name)
    if pre:
        handle = module.register_forward_pre_hook(lambda m, args: edit(args))
    else:
        handle = module.register_forward_hook(lambda m, args, out: edit(out if isinstance(out, tuple) else (out,)))
    try:
        return (*step_loss_and_grads(model, batch), len(calls))
    finally:
        handle.remove()


CASES = [  # (family, LoRA, FUSEPATCH_MLP_RECOMPUTE, module, a pre-hook)
    ("qwen3", False, False, "model.layers.0.post_attention_layernorm", False),
    ("qwen3", False, False, "model.layers.0.mlp.act_fn", False),
    ("qwen3", False, False, "lm_head", False),
    ("qwen3_5_text", False, False, "model.layers.0.linear_attn.norm", False),
    ("qwen3", False, True, "model.layers.0", False),
    ("qwen3", False, True, "model.norm", True),
    ("qwen3_5_text", True, False, "model.layers.1.self_attn", False),
    ("qwen3_5_text", True, False, "model.layers.0.mlp", False),
    ("qwen3_5_text", False, False, "model.layers.1.self_attn.k_norm", True),
    ("qwen3_5_moe_text", False, False, "model.layers.0.mlp.gate", True),
]


@pytest.mark.parametrize(("family", "lora", "recompute", "name", "pre"), CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_a_hook_writing_in_place_inside_a_patched_layer_trains_as_unpatched(
    fused_on_cpu, monkeypatch, family, lora, recompute, name, pre
):
    if recompute:
        monkeypatch.setenv("FUSEPATCH_MLP_RECOMPUTE", "1")
    if family == "qwen3_5_moe_text":  # a frozen shared expert: its gate/up GEMM keeps no input
        frozen = "shared_expert."
    else:
        frozen = None
    results = []
    for patched in (False, True):
        model = _model(family, patched, lora)
        if frozen:
            for parameter_name, parameter in model.named_parameters():
                parameter.requires_grad_(frozen not in parameter_name)
        torch.manual_seed(1)
        batch = lm_batch(model, batch=2, length=13)
        prefix = "base_model.model." if lora else ""
        results.append(_step(model, batch, prefix + name, pre))
    (*expected, calls), (*got, got_calls) = results
    assert got_calls == calls == 1
    assert_same_step(expected, got)


def test_zero3s_own_hooks_do_not_turn_a_gathering_path_aside():
    """ZeRO-3 hooks every module to gather and free its parameters; a fused path that gathers them itself
    (``backends.deepspeed.gather``) asks ``hooked(..., gathering=True)``, which passes over DeepSpeed's hooks but
    not a user's."""
    from fusepatch.layers.support.hooks import hooked

    def gather_hook(module, args):  # stands for ZeRO-3's pre-forward hook (deepspeed.runtime.zero.parameter_offload)
        return None

    gather_hook.__module__ = "deepspeed.runtime.zero.parameter_offload"
    norm = torch.nn.LayerNorm(4)
    norm.register_forward_pre_hook(gather_hook)
    assert hooked(norm) and not hooked(norm, gathering=True)
    norm.register_forward_hook(lambda module, args, out: out.mul_(2))
    assert hooked(norm, gathering=True)


class _LayerNorm(torch.nn.Module):
    """Another norm than the model's, with the attributes an RMSNorm has (``weight``, ``variance_epsilon``)."""

    def __init__(self, size: int, gated: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((size,), 0.9))
        self.variance_epsilon = 1e-6
        self.gated = gated

    def forward(self, x, gate=None):
        out = torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, None, 1e-6)
        return out * torch.sigmoid(gate) if self.gated else out


def _wrap(module: torch.nn.Module) -> None:
    """A forward set on the instance: the module's own, scaled."""
    own = module.forward
    module.forward = lambda *args, **kwargs: own(*args, **kwargs) * 1.5


def _swap(path: str, make):
    def change(model):
        owner, _, name = path.rpartition(".")
        parent = model.get_submodule(owner)
        setattr(parent, name, make(getattr(parent, name)))

    return change


CHANGES = {  # (family, what is done to the model after apply)
    "post-norm forward": ("qwen3", lambda m: _wrap(m.model.layers[0].post_attention_layernorm)),
    "act_fn forward": ("qwen3", lambda m: _wrap(m.model.layers[0].mlp.act_fn)),
    "mlp forward": ("qwen3", lambda m: _wrap(m.model.layers[0].mlp)),
    "lm_head forward": ("qwen3", lambda m: _wrap(m.lm_head)),
    "DeltaNet norm forward": ("qwen3_5_text", lambda m: _wrap(m.model.layers[0].linear_attn.norm)),
    "act_fn GELU": ("qwen3", _swap("model.layers.0.mlp.act_fn", lambda old: torch.nn.GELU())),
    "experts act_fn GELU": ("qwen3_moe", _swap("model.layers.0.mlp.experts.act_fn", lambda old: torch.nn.GELU())),
    "post-norm LayerNorm": (
        "qwen3",
        _swap("model.layers.0.post_attention_layernorm", lambda old: _LayerNorm(old.weight.shape[0])),
    ),
    "post-norm Identity": ("qwen3", _swap("model.layers.0.post_attention_layernorm", lambda old: torch.nn.Identity())),
    "DeltaNet norm another": (
        "qwen3_5_text",
        _swap("model.layers.0.linear_attn.norm", lambda old: _LayerNorm(old.weight.shape[0], gated=True)),
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_module_changed_after_apply_is_computed_as_changed(fused_on_cpu, change):
    """A forward set on a module's instance, or a module swapped for another class, after ``apply``: where a fused
    path would do that module's work itself, it calls the module instead, so the model computes what it holds."""
    family, alter = CHANGES[change]
    results = []
    for patched in (False, True):
        model = _model(family, patched, lora=False)
        if patched and "experts" in change:
            assert model.model.layers[0].mlp.experts.__dict__.get("_fusepatch") is not None
        torch.manual_seed(0)  # the swapped-in modules' weights alike
        alter(model)
        torch.manual_seed(1)
        results.append(step_loss_and_grads(model, lm_batch(model, batch=2, length=13)))
    assert_same_step(*results)


def test_a_sharded_layers_own_norm_is_of_its_family():
    """FSDP2's ``fully_shard`` swaps a layer's class for one it makes (defined in torch, over the model's): the
    layer's own norm still counts as its family's, another class does not."""
    from fusepatch.layers.support.hooks import same_family

    layer = tiny_model("qwen3", seed=0, num_hidden_layers=1).model.layers[0]
    layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {"__module__": "torch.distributed.fsdp"})
    assert same_family(layer.post_attention_layernorm, layer)
    assert not same_family(torch.nn.Identity(), layer)


HEADS = {  # peft over lm_head: (target_modules, modules_to_save, whether the fused loss still computes the loss)
    "LoRA on lm_head and q_proj": (["q_proj", "lm_head"], None, False),
    "LoRA on lm_head only": (["lm_head"], None, False),
    "lm_head a module to save": (["q_proj"], ["lm_head"], True),
}


@pytest.mark.parametrize("case", list(HEADS))
def test_an_lm_head_peft_wraps_trains_as_unpatched(fused_on_cpu, monkeypatch, case):
    """The fused loss computes ``F.linear(hidden, lm_head.weight)``: over peft's LoRA on the head (whose forward
    adds the adapters' product) it calls the head instead, as transformers does; over peft's trainable copy of the
    head (``modules_to_save``) it still fuses, with the copy's weight."""
    import peft

    from fusepatch.layers import causal_lm

    targets, save, fuses = HEADS[case]
    fused = []
    plain_loss = causal_lm._fused_loss
    monkeypatch.setattr(causal_lm, "_fused_loss", lambda *args: fused.append(1) or plain_loss(*args))
    results = []
    for patched in (False, True):
        model = tiny_model("qwen3", seed=0, num_hidden_layers=2)
        torch.manual_seed(0)
        config = peft.LoraConfig(r=4, target_modules=targets, modules_to_save=save, init_lora_weights=False)
        model = peft.get_peft_model(model, config)
        if patched:
            fusepatch.apply(model, verbose=False)
        torch.manual_seed(1)
        results.append(step_loss_and_grads(model.train(), lm_batch(model, batch=2, length=13)))
    assert bool(fused) == fuses
    assert_same_step(*results)
