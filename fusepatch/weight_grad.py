"""How fusepatch's own weight-gradient GEMMs (``dy.t() @ x``: the fused loss's lm_head gradient, the shared-input
projections') hand their operands to cuBLAS.

Both operands have the tokens, the GEMM's inner dimension, as their strided dimension, so cuBLAS reads both
MN-major, where its forward GEMMs read both K-major. ``FUSEPATCH_WEIGHT_GRAD`` picks:

- ``strided`` (default): the operands as they lie, as autograd's own ``nn.Linear`` backward passes them;
- ``input-copied``: the layer input ``x`` copied token-minor first (``[tokens, in_features]``: 40 MB at 4096
  tokens of a 5120-wide model; one copy serves every projection of that input);
- ``both-copied``: the output gradient ``dy`` too (``[tokens, out_features]``: the logits' size for the loss).

``benchmarks/gemm_bench.py`` times the layouts alone at a shape's sizes; ``benchmarks/RESULTS.md`` has what
the training step measured.
"""

from __future__ import annotations

import os

import torch

FORMS = ("strided", "input-copied", "both-copied")


def weight_grad_form() -> str:
    """The layout ``FUSEPATCH_WEIGHT_GRAD`` names (``strided`` when unset); a typo names the choices."""
    value = os.environ.get("FUSEPATCH_WEIGHT_GRAD", "").strip() or FORMS[0]
    if value not in FORMS:
        raise ValueError(f"FUSEPATCH_WEIGHT_GRAD={value!r}: expected one of {', '.join(FORMS)}")
    return value


def token_minor(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[tokens, features]``) with the tokens contiguous: the same matrix, copied once."""
    return x.t().contiguous().t()


def weight_grad_operands(dy: torch.Tensor, x: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` with ``a @ b == dy.t() @ x`` (both 2-D, tokens first), laid out as ``form`` says. ``x`` may
    already be token-minor (a caller copying it once for several projections)."""
    a = dy.t().contiguous() if form == "both-copied" else dy.t()
    b = x if form == "strided" or x.stride(0) == 1 else token_minor(x)
    return a, b
