"""The causal-LM head (layers/causal_lm.py): whose head computes the loss, and labels refused as transformers
refuses them."""

from __future__ import annotations

import torch


def _forward_from(module: str, filename: str, fused_lm_head: bool):
    """A forward defined in ``module`` whose code says it came from ``filename``."""
    parameters = "self, *args, fused_lm_head=False, **kwargs" if fused_lm_head else "self, *args, **kwargs"
    namespace = {"__name__": module}
    exec(compile(f"def forward({parameters}):\n    return None\n", filename, "exec"), namespace)
    return namespace["forward"]


def test_a_trainer_head_is_told_by_its_module_not_by_its_folders():
    """TRL's and Liger's heads are known by the package that defines them; a fusepatch checkout in a folder named
    ``trl`` or ``liger_kernel`` is not taken for either."""
    import types

    from fusepatch.layers.causal_lm import trainer_head

    def head(module: str, filename: str, fused_lm_head: bool = False):
        holder = torch.nn.Module()
        holder.forward = types.MethodType(_forward_from(module, filename, fused_lm_head), holder)
        return trainer_head(holder)

    site = "/venv/lib/python3.12/site-packages"
    assert head("trl.trainer.utils", f"{site}/trl/trainer/utils.py", True) == "TRL's fused LM head"
    assert (
        head("liger_kernel.transformers.model.qwen3", f"{site}/liger_kernel/x.py")
        == "Liger's fused linear cross-entropy"
    )
    assert head("my_head", "/home/me/trl/my_head.py", True) == "a fused LM head (fused_lm_head)"
    assert head("fusepatch.layers.causal_lm", "/home/me/liger_kernel/fusepatch/layers/causal_lm.py") is None
