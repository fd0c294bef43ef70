"""What an op and a kernel candidate are."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fusepatch.base.requirements import InputRule, Requirement

SOURCES = ("pip", "hub", "eager")  # pip: an installed package (a wheel fusepatch built included); hub: the Kernel Hub


@dataclass(frozen=True)
class Candidate:
    """One kernel that implements an op, from one source.

    ``load`` returns a callable with the op's signature (the adapter to the upstream API lives in the op's
    module). It is only called after every requirement passed, so it may import freely.

    A candidate may prepare a weight once for many calls (a low-precision kernel's quantized copy of a frozen weight):
    ``prepare(weight) -> handle``. The op names which argument (``Op.prepares``); the dispatcher keeps one handle
    per weight that takes no gradient, checks it against the weight's contents at every call (the one owner of
    that rule: ``ops/prepared.py``) and passes it to the callable as ``prepared=handle``; a weight that trains is
    passed as it is. ``refresh(weight, handle, stale)`` prepares the weight again into the handle's own buffers
    where ``stale`` (int32 ``[1]`` on the weight's device, 1: changed) says so, without the host (a CUDA graph that
    captured it refreshes at every replay); without it a changed weight gets a new handle. ``restore(handle)`` gives
    the weight's values back (rounded as the handle holds them): only a candidate with it lets a weight be dropped
    once prepared (``apply(drop_frozen_weights=True)``).
    """

    name: str
    source: str  # one of SOURCES
    requirements: tuple[Requirement, ...]
    load: Callable[[], Callable[..., Any]]
    inputs: InputRule = field(default_factory=InputRule)
    provides: str = ""  # the upstream function, for the report ("fla.ops.gated_delta_rule.chunk_gated_delta_rule")
    distribution: str | None = None  # the distribution loaded, for "which copy was loaded"
    varlen: bool = True  # honours cu_seqlens (packed documents); a candidate that cannot is skipped for them
    where: Callable[[], str] | None = None  # where it loads from, asked at choice time (Hub: local dir, lock, pin)
    prepare: Callable[[Any], Any] | None = None  # weight -> handle, made once per weight (see above)
    refresh: Callable[[Any, Any, Any], None] | None = None  # (weight, handle, stale): the handle again, in place
    restore: Callable[[Any], Any] | None = None  # handle -> the weight's values (rounded)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"unknown source {self.source!r}; expected one of {SOURCES}")


@dataclass(frozen=True)
class Case:
    """One call of a self-test. A composite kernel runs several stages (fla's delta rule: eleven, forward and
    backward), and on one call the other stages' terms can dilute one stage's error below the bound; cases that
    switch terms off (no start state, a zero output gradient, a single chunk) leave each stage dominant somewhere.

    ``options`` go to ``make_inputs`` as keywords; ``cotangents`` weigh each compared output's random gradient
    (0 switches that output's backward path off, so the rest is seen alone); ``name`` prefixes its quantities.
    ``along``: each output's gradient is the fp32 reference output itself (times its weight), not random: the loss
    is then half the squared norm, and a gradient that sums many tokens' terms (a decay parameter's) sums terms
    of one sign instead of random ones that cancel to a small, noisy total. ``floors``: per dtype, this case's own
    floor of a quantity (``{"bfloat16": {"grad[5]": 8e-3}}``), in place of the op's (or its ``looser`` one), where
    its inputs were measured to make that quantity more exact, or noisier, than the op's floor. ``only``: the
    quantities this case compares (``"grad[5]"``; empty: all), where its inputs, chosen for those, leave the others
    noisier than the op's floors."""

    name: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    cotangents: tuple[float, ...] | None = None
    along: bool = False
    floors: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    only: tuple[str, ...] = ()


# How each quantity is compared, besides its relative error (norm of the difference over the reference's norm):
# "tile", the largest error of one block of 64 rows x 64 columns over what a block of the reference holds on
# average, sees a wrong or zeroed tile of a kernel's output that the whole tensor's norm dilutes; "scale", the
# difference's component along the reference (<a - r, r> / <r, r>), sees a stage off by a factor (x1.02) under
# rounding noise several times larger, which has no such component. Each multiplies the quantity's floor.
STATISTICS: dict[str, float] = {"tile": 2.0, "scale": 0.25}


@dataclass(frozen=True)
class SelfTest:
    """How to check a candidate against the reference on tiny fresh random inputs.

    ``make_inputs(device, dtype, generator, packed, dims, **case.options)`` returns ``(args, kwargs)``; float tensors that
    require grad get gradients compared too. ``packed`` asks for a packed (varlen) call and ``dims`` for the
    layer's own feature sizes (from ``dims_from(module)``): the self-test then compiles and autotunes the very
    kernel variants training will use, instead of a second set.

    Bounds come from measured error (``selftest.bounds``): the candidate's relative error (norm of the
    difference over norm of the fp32 reference; for a packed call also per document) may be at most ``ratio``
    times the error of the reference itself run in the same dtype on the same inputs, plus a floor:
    ``tolerance`` maps dtype name -> floor, for the output and every gradient. The floors are set from the
    errors of the real kernels measured on the H200 (docs/kernels.md), below the 2% a wrong kernel shows.
    """

    make_inputs: Callable[..., tuple[tuple, dict]]
    tolerance: dict[str, float]
    dims_from: Callable[[Any], dict[str, int]] | None = None
    # Per dtype, quantities with their own floor, e.g. {"bfloat16": {"grad[5]": 0.25}}: gradients that sum over
    # every token with cancellation amplify rounding (see the op's module for the measurement).
    looser: dict[str, dict[str, float]] = field(default_factory=dict)
    ratio: float = 2.0
    # How many leading outputs to compare (and backpropagate through) when the op returns a tuple: rotary
    # returns (q, k) and both count; other ops' extra outputs (states, caches) do not.
    outputs: int = 1
    # The calls made (``Case``): one plain call unless the op's stages need more to be seen.
    cases: tuple[Case, ...] = (Case(),)
    # The floor multiplier of each statistic (``STATISTICS``), where an op measured its own.
    statistics: Mapping[str, float] = field(default_factory=lambda: dict(STATISTICS))


@dataclass(frozen=True)
class Op:
    """One computation with an eager reference and fused candidates in priority order."""

    name: str
    summary: str
    reference: Callable[..., Any]
    candidates: tuple[Candidate, ...]
    selftest: SelfTest | None = None
    # the position of the argument (a weight) its candidates may prepare (``Candidate.prepare``); None: none
    prepares: int | None = None
    # the shapes its kernels take, where some they cannot: ``fits(shape of the argument at position 1) -> why not or
    # None``, asked by a layer that has another op for the same call (a head's loss in another precision)
    fits: Callable[[tuple[int, ...]], str | None] | None = None

    @property
    def eager(self) -> Candidate:
        return Candidate(
            name="eager",
            source="eager",
            requirements=(),
            load=lambda: self.reference,
            inputs=InputRule(
                devices=("cpu", "cuda", "mps", "xpu", "meta"), dtypes=("bfloat16", "float16", "float32", "float64")
            ),
            provides=f"{self.reference.__module__}.{self.reference.__qualname__}",
        )


class OpDispatch(Protocol):
    """What a layer calls an op through (the engine's ``Dispatch`` is one): the op for the call's tensors (a weight
    passed with the handle its candidate prepared), the choice it makes for a device, dtype and packing, the
    prepared handle of a weight, and the generation of the handles it keeps (a new one each time one is made anew or
    let go: a CUDA graph reads the memory of those it captured)."""

    disabled_reason: str | None

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def choice(self, device: str, dtype: str, packed: bool = False) -> Any: ...

    def implementation(self, device: str, dtype: str, packed: bool = False) -> Callable[..., Any]: ...

    def prepared(self, weight: Any, device: str, dtype: str, *, once: bool = False) -> Any: ...

    @property
    def generation(self) -> int: ...
