"""Stacks known to give wrong results or to crash, as data: doctor prints this table as it is.

Each row says which package versions, on which Triton and GPU architecture, misbehave, and what makes the
stack safe again (``unless_importable``: a module whose presence routes around the bug).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fusepatch.base.env import Environment
from fusepatch.base.versions import version_in


@dataclass(frozen=True)
class KnownIssue:
    package: str  # distribution name the issue is about
    package_spec: str  # its affected versions
    triton_spec: str  # affected Triton versions ("" = any)
    capability_major: int | None  # affected GPU family (9 = Hopper), None = any GPU (never the CPU)
    what: str  # what goes wrong
    link: str
    fix: str
    unless_importable: str | None = None  # a module that, when importable, makes the stack safe

    def matches(self, env: Environment) -> bool:
        version = env.version(self.package)
        if version is None or not version_in(version, self.package_spec):
            return False
        if self.triton_spec and (env.triton is None or not version_in(env.triton, self.triton_spec)):
            return False
        if env.capability is None or (self.capability_major is not None and env.capability[0] != self.capability_major):
            return False
        if self.unless_importable and env.imported(self.unless_importable):
            return False
        return True

    def summary(self, env: Environment) -> str:
        gpu = env.gpus[0].arch if env.gpus else "this GPU"
        return f"{self.package} {env.version(self.package)} + triton {env.triton} on {gpu}: {self.what} ({self.link})"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        package="fla-core",
        package_spec=">=0.4",
        triton_spec=">=3.4.0,<3.7.1",
        capability_major=9,
        what=(
            "the gated chunk_bwd_dqkwg kernel is miscompiled on Hopper (a transposed matrix-unit accumulator), "
            "giving wrong dg/dbeta; fla refuses the backward pass unless its TileLang backend is available"
        ),
        link="https://github.com/fla-org/flash-linear-attention/issues/640",
        fix="pip install tilelang   (or a torch whose Triton is >= 3.7.1)",
        unless_importable="tilelang",
    ),
    KnownIssue(
        package="transformers",
        package_spec=">=5.17",
        triton_spec=">=3.5",
        capability_major=None,
        what=(
            "torch.compile (inductor) of Qwen3.5's rotary embedding gives wrong cos/sin tables on the GPU (likely Triton "
            "miscompiling its stride-3 mrope slices), so transformers' own Qwen3.5, compiled, trains on wrong logits"
        ),
        link="https://github.com/vllm-project/vllm/pull/40680",
        fix="fusepatch.apply(model) before compiling (a patched model runs outside dynamo on a GPU), or train "
        "Qwen3.5 without torch.compile",
    ),
)


def matching_issues(package: str, env: Environment) -> list[KnownIssue]:
    return [issue for issue in KNOWN_ISSUES if issue.package == package and issue.matches(env)]
