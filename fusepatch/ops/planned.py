"""Ops the registry already names, whose fused wiring comes in a later release.

Each has a real eager reference (the ground truth a fused candidate will be tested against) and lists the
upstream candidates, so ``doctor`` can say today what is installed and what is still missing.
"""

from __future__ import annotations

import torch

from fusepatch.ops._common import fla_requirements, planned
from fusepatch.ops.base import Candidate, Op
from fusepatch.requirements import NotImplementedYet


def add_rms_norm_reference(x, residual, weight, eps):
    """Residual add followed by RMSNorm: returns (normed, new_residual)."""
    h = x + residual
    normed = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(h.dtype)), h


def _never():
    raise RuntimeError("planned candidate: not loadable in this release")


def _planned(name, source, what, requirements=(), provides=""):
    requirements = tuple(requirements)
    if not any(isinstance(r, NotImplementedYet) for r in requirements):
        requirements += planned(what)
    return Candidate(name=name, source=source, requirements=requirements, load=_never, provides=provides)


ADD_RMS_NORM = Op(
    name="add_rms_norm",
    summary="residual add fused into the following RMSNorm (decoder layer)",
    reference=add_rms_norm_reference,
    candidates=(
        _planned(
            "fla",
            "pip",
            (
                "fused residual + norm: planned. transformers adds the residual inline in each decoder layer's "
                "forward, so fusing it means re-implementing that forward per family and per transformers release, "
                "for one elementwise pass per layer (no elementwise kernel is among the 15 largest of the 27B step)"
            ),
            fla_requirements("fla.modules.norm.layernorm"),
            "rms_norm(residual=...)",
        ),
    ),
)
