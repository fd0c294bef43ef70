"""A trainer's own fused head (TRL's, Liger's) computes the loss: fusepatch leaves the model's head (``Row.role``
"head") to it and says so, rather than running a second fused loss beside it."""

from __future__ import annotations

import torch

from fusepatch.base.row import Row
from fusepatch.engine.features.base import Feature
from fusepatch.engine.resolve import Choice
from fusepatch.layers.causal_lm import trainer_head


def stepped_aside(op: str, owner: str) -> Choice:
    return Choice(op, owner, "trainer", f"{owner} computes the loss; fusepatch leaves the model's head to it")


class TrainerHead(Feature):
    name = "trainer_head"

    def owners(self, found: dict[Row, list[torch.nn.Module]]) -> dict[Row, tuple[Choice, ...]]:
        """The head rows whose loss a trainer's own fused head computes, each op's choice naming it."""
        owners = {}
        for row, modules in found.items():
            if row.role == "head" and (owner := trainer_head(modules[0])) is not None:
                owners[row] = tuple(stepped_aside(op, owner) for op in row.ops)
        return owners


FEATURE = TrainerHead()
