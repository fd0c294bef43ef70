"""Choose, for one op, the first candidate that passes every check; remember why the others did not."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

from fusepatch.base.dtypes import dtype_name
from fusepatch.base.env import Environment, capture
from fusepatch.base.op import SOURCES, Candidate, Op
from fusepatch.base.options import skip_pairs, sources
from fusepatch.base.requirements import (
    OK,
    CudaDevice,
    DistributionVersion,
    Importable,
    Inputs,
    MinCapability,
    Verdict,
    reject,
)
from fusepatch.base.state import current as process_state
from fusepatch.engine import selftest
from fusepatch.engine.registry import all_ops, op_with_user_candidates
from fusepatch.ops.prepared import Held, PreparedWeights

logger = logging.getLogger("fusepatch")

# Installed packages first: a Hub candidate downloads code at apply time, so it is reached only when no
# installed kernel passes its checks (or when the user puts "hub" first).
DEFAULT_PREFER: tuple[str, ...] = ("pip", "hub")


@dataclass(frozen=True)
class Rejection:
    candidate: str
    source: str
    reason: str
    fix: str = ""
    parts: tuple[tuple[str, str], ...] = ()  # (reason, fix) of each failed check; empty: (reason, fix) itself

    def reasons(self) -> tuple[tuple[str, str], ...]:
        """Each failed check's reason and fix (what the report groups across ops)."""
        return self.parts or ((self.reason, self.fix),)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "parts"}


@dataclass(frozen=True)
class Choice:
    """What runs an op for one (device, dtype): the chosen candidate and every rejection before it."""

    op: str
    chosen: str
    source: str
    provides: str = ""
    rejected: tuple[Rejection, ...] = ()
    device: str = ""
    dtype: str = ""
    origin: str = ""  # which installed copy was loaded: "fla-core 0.6.0 at /path/to/fla"
    # Seconds spent getting the chosen kernel ready here (load + self-test). Its first call compiles and
    # autotunes (Triton, TileLang) unless the on-disk caches already hold it: a large value means "compiled".
    ready_s: float = 0.0

    @property
    def compiled(self) -> bool:
        """Whether getting ready took compile time (rather than coming from the on-disk caches)."""
        return self.ready_s >= selftest.COMPILED_S

    @property
    def fused(self) -> bool:
        return self.source != "eager"

    def primary_rejection(self) -> Rejection:
        """The rejection worth showing first: the first candidate's."""
        return self.rejected[0]

    def reason_text(self) -> str:
        """``fla: <reason>; causal-conv1d: <reason>`` for log lines."""
        return "; ".join(f"{r.candidate}: {r.reason}" for r in self.rejected)

    def fixes(self) -> list[str]:
        seen: list[str] = []
        for r in self.rejected:
            if r.fix and r.fix not in seen:
                seen.append(r.fix)
        return seen

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "chosen": self.chosen,
            "source": self.source,
            "fused": self.fused,
            "provides": self.provides,
            "device": self.device,
            "dtype": self.dtype,
            "rejected": [r.to_dict() for r in self.rejected],
            "origin": self.origin,
            "ready_s": round(self.ready_s, 2),
        }


# kernel sources a user may prefer (eager is the fallback, always last)
PREFERABLE: tuple[str, ...] = tuple(s for s in SOURCES if s != "eager")


def preferred_sources(prefer: str | Iterable[str] | None = None) -> tuple[str, ...]:
    """Source priority: the argument, else ``FUSEPATCH_PREFER`` (comma list), else pip, hub."""
    if prefer is None:
        return sources(os.environ.get("FUSEPATCH_PREFER", ""), "FUSEPATCH_PREFER", PREFERABLE) or DEFAULT_PREFER
    return sources(prefer, "prefer", PREFERABLE)


def candidate_names(op: Op | None = None) -> dict[str, tuple[str, ...]]:
    """Every op's candidates' names (``op``: one being resolved, which may differ from the registry's)."""
    found = {name: tuple(c.name for c in each.candidates) for name, each in all_ops().items()}
    if op is not None:
        found[op.name] = tuple(c.name for c in op.candidates)
    return found


def skipped_candidates(op: Op | None = None) -> set[tuple[str, str]]:
    """``FUSEPATCH_SKIP``: ``op/candidate`` pairs separated by commas or semicolons (``*`` for every op) to refuse
    without trying, e.g. ``rms_norm_zero_centered/triton`` to run fla's norm instead of fusepatch's, or to step
    around a kernel that misbehaves on your stack. A skipped candidate is reported with that reason, never
    dropped silently; a pair naming no op or candidate is an error (``options.skip_pairs``)."""
    return skip_pairs(os.environ.get("FUSEPATCH_SKIP", ""), candidate_names(op))


def first_verdict(op: Op, candidate: Candidate, env: Environment) -> tuple[Verdict, Environment]:
    """``static_verdict``, unless ``FUSEPATCH_SKIP`` names the candidate (then refused with that reason)."""
    skip = skipped_candidates(op)
    if (op.name, candidate.name) in skip or ("*", candidate.name) in skip:
        return (
            reject(
                f"skipped by FUSEPATCH_SKIP={os.environ.get('FUSEPATCH_SKIP', '')}",
                f"remove {op.name}/{candidate.name} from FUSEPATCH_SKIP to try it",
            ),
            env,
        )
    return static_verdict(candidate, env)


def ordered(op: Op, prefer: tuple[str, ...]) -> list[Candidate]:
    """The op's candidates by source priority (stable within a source); sources not preferred are dropped."""
    rank = {source: i for i, source in enumerate(prefer)}
    return sorted((c for c in op.candidates if c.source in rank), key=lambda c: rank[c.source])


def not_preferred(candidate: Candidate, prefer: tuple[str, ...]) -> Verdict:
    """Why a candidate whose source ``prefer`` leaves out was not tried, and how to let it be."""
    wanted = ",".join((*prefer, candidate.source))
    return Verdict(
        False,
        f"source {candidate.source!r} not in prefer={list(prefer)}",
        f"apply(prefer={wanted!r}) or FUSEPATCH_PREFER={wanted}",
    )


def static_verdict(candidate: Candidate, env: Environment) -> tuple[Verdict, Environment]:
    """Check every requirement and report all that fail (one reason each), so a CPU machine still learns
    which packages are missing. Import probes run only when a GPU is there and the package is installed:
    an import that cannot succeed (or would initialise CUDA on a machine without it) is not attempted."""
    failures: list[Verdict] = []
    failed_kinds: set[str] = set()
    for requirement in candidate.requirements:
        if isinstance(requirement, Importable) and (
            "cuda" in failed_kinds or f"dist:{requirement.distribution}" in failed_kinds
        ):
            continue
        if isinstance(requirement, MinCapability) and "cuda" in failed_kinds:
            continue
        if "cuda" not in failed_kinds:  # no import of GPU packages on a machine without a GPU
            env = env.with_imports(getattr(requirement, "probes", ()))
        if isinstance(requirement, DistributionVersion):
            env = env.with_distributions([requirement.distribution])
        verdict = requirement.check(env)
        if verdict.ok:
            continue
        failures.append(verdict)
        if isinstance(requirement, CudaDevice):
            failed_kinds.add("cuda")
        if isinstance(requirement, DistributionVersion):
            failed_kinds.add(f"dist:{requirement.distribution}")
    if not failures:
        return OK, env
    reason = "; ".join(v.reason for v in failures)
    fix = " && ".join(dict.fromkeys(v.fix for v in failures if v.fix))
    parts = tuple((v.reason, v.fix) for v in failures)
    return Verdict(False, reason, fix, parts=parts), env


def evaluate(
    op: Op,
    candidate: Candidate,
    static: Verdict,
    device: str,
    dtype: str,
    packed: bool = False,
    dims: dict[str, int] | None = None,
    checks_only: bool = False,
) -> tuple[Verdict, Callable[..., Any] | None]:
    """After the static checks: the call's device/dtype, varlen support, loading, then the self-test
    (``checks_only``: stop before loading anything)."""
    verdict = static
    if verdict.ok:
        verdict = candidate.inputs.check(Inputs(device, dtype))
    if verdict.ok and packed and not candidate.varlen:
        verdict = Verdict(False, "cannot honour packed-document boundaries (no varlen support)", "")
    fn = None
    if verdict.ok and not checks_only:
        try:
            fn = candidate.load()
        except Exception as exc:  # noqa: BLE001 - a broken install must not break training
            fix = getattr(exc, "fix", "") or candidate_fix(candidate)
            verdict = Verdict(False, f"loading failed: {type(exc).__name__}: {exc}", fix)
    if verdict.ok and not checks_only:
        verdict = selftest.run(op, candidate, fn, device, dtype, packed=packed, dims=dims)
    return verdict, fn


def origin(candidate: Candidate) -> str:
    """Version and location of the copy a candidate loaded: a shadowed copy (an old install earlier on the path,
    a source checkout) is a known trap, so the report names the file actually imported."""
    if candidate.where is not None:
        return candidate.where()
    if candidate.distribution is None:
        return ""
    try:
        version = importlib.metadata.version(candidate.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    where = ""
    for requirement in candidate.requirements:
        if isinstance(requirement, Importable):
            module = sys.modules.get(requirement.module)
            path = getattr(module, "__file__", None)
            if path:
                where = f" at {os.path.dirname(path)}"
            break
    return f"{candidate.distribution} {version}{where}"


def reasons_and_fixes(choices: Iterable[Choice]) -> dict[str, tuple[list[str], list[str]]]:
    """Each distinct reason the choices fell back for -> (the ops it keeps on eager, its fixes): a CPU machine's one
    reason is one line, not one per op and candidate."""
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for choice in choices:
        if choice.fused:
            continue
        for rejection in choice.rejected:
            for reason, fix in rejection.reasons():
                ops, fixes = groups.setdefault(reason, ([], []))
                if choice.op not in ops:
                    ops.append(choice.op)
                for one in filter(None, fix.split(" && ")):
                    if one not in fixes:
                        fixes.append(one)
    return groups


def candidate_fix(candidate: Candidate) -> str:
    for requirement in candidate.requirements:
        fix = getattr(requirement, "fix", "")
        if fix and isinstance(requirement, Importable):
            return fix
    return ""


class Dispatch:
    """Per-op dispatcher shared by every patched instance of one layer class.

    The choice is made per (device type, dtype, packed) of the call, so a model that moves between CPU and
    GPU after ``apply`` keeps working; each new fallback is logged once. Where the chosen candidate prepares a
    weight (``Candidate.prepare``), the dispatcher keeps its handle per weight (``ops/prepared.py``, which owns when
    a handle is made anew) and passes it to the candidate: the layers pass the weight.
    """

    def __init__(
        self,
        op: Op,
        *,
        env: Environment,
        prefer: tuple[str, ...],
        label: str,
        disabled_reason: str | None = None,
        dims: dict[str, int] | None = None,
    ) -> None:
        self.op = op
        self.dims = dims  # the layer's feature sizes, so self-tests compile what training will run
        self.label = label
        self.disabled_reason = disabled_reason
        self._env = env
        self._static: list[tuple[Candidate, Verdict]] = []
        if disabled_reason is None:
            for candidate in ordered(op, prefer):
                verdict, self._env = first_verdict(op, candidate, self._env)
                self._static.append((candidate, verdict))
            for candidate in op.candidates:  # left out by prefer: reported, so no fallback lacks its reason
                if candidate.source not in prefer:
                    self._static.append((candidate, not_preferred(candidate, prefer)))
        self._choices: dict[tuple[str, str, bool], tuple[Choice, Callable[..., Any]]] = {}
        self._chosen: dict[tuple[str, str, bool], Candidate] = {}  # the candidate behind each choice
        self._prepared = PreparedWeights()
        self._lock = threading.RLock()  # re-entry from the same thread is detected and reported, not deadlocked
        self._resolving: set[tuple[str, str, bool]] = set()
        self.announce = False  # set by apply once its report is logged: later new choices log themselves
        self._prefer = prefer

    def __deepcopy__(self, memo) -> Dispatch:
        """Shared by a model's copies: it holds choices and kernels, and the prepared handles of every weight it has
        served (each by the weight's identity, let go with it), the copies' among them."""
        return self

    def __reduce__(self):
        """Pickled as what made it; loading chooses (and self-tests) again on the machine that loads it."""
        return (_restored_dispatch, (self.op.name, self._prefer, self.label, self.disabled_reason, self.dims))

    def choice(self, device: str, dtype: str, packed: bool = False) -> Choice:
        found = self._choices.get((device, dtype, packed))  # made once: read without the lock (torch.compile
        return found[0] if found is not None else self._resolve(device, dtype, packed)[0]  # cannot trace one)

    def implementation(self, device: str, dtype: str, packed: bool = False) -> Callable[..., Any]:
        key = (device, dtype, packed)
        found = self._choices.get(key)
        return found[1] if found is not None else self._resolve(device, dtype, packed)[1]

    def __call__(self, *args, **kwargs):
        first = next(a for a in args if hasattr(a, "device"))
        key = (first.device.type, dtype_name(first.dtype), kwargs.get("cu_seqlens") is not None)
        fn = self.implementation(*key)
        where = self.op.prepares
        if where is not None and where < len(args):
            handle = self._prepared.handle(self._chosen[key], args[where])
            if handle is not None:
                return fn(*args, prepared=handle, **kwargs)
        return fn(*args, **kwargs)

    def prepared(self, weight: Any, device: str, dtype: str, *, once: bool = False) -> Held | None:
        """The handle the candidate chosen for ``device`` and ``dtype`` prepared of ``weight`` (made now if need
        be), with what made it; None where it prepares nothing (the eager fallback among them) or keeps nothing now
        (a weight that trains, ``torch.compile``, ``inference_mode``). ``once``: the weight is dropped right after,
        the handle all that is left of it: made, not kept."""
        self.implementation(device, dtype)
        return self._prepared.held(self._chosen[(device, dtype, False)], weight, once=once)

    def kept(self, weight: Any) -> Held | None:
        """The handle held for ``weight`` as the last call left it (nothing made or checked; None: none)."""
        return self._prepared.kept(weight)

    def all_held(self) -> list[Held]:
        """Every handle this dispatcher keeps for a live weight (a dropped weight carries its own)."""
        return self._prepared.all_held()

    def generation_of(self, weight: Any) -> int:
        """The generation of the handle kept for ``weight`` (0: none), new each time it is made anew."""
        return self._prepared.generation_of(weight)

    def _resolve(self, device: str, dtype: str, packed: bool) -> tuple[Choice, Callable[..., Any]]:
        key = (device, dtype, packed)
        with self._lock:
            if key in self._choices:
                return self._choices[key]
            if key in self._resolving:  # a self-test called back into this layer (never a silent deadlock)
                raise RuntimeError(
                    f"fusepatch: {self.label}: {self.op.name} was called again while its kernel for {key} was being "
                    "chosen (a hook around the self-test re-ran the layer); please report this with the traceback"
                )
            self._resolving.add(key)
            try:
                return self._resolve_locked(key)
            finally:
                self._resolving.discard(key)

    def _resolve_locked(self, key: tuple[str, str, bool]) -> tuple[Choice, Callable[..., Any]]:
        """Check, load and self-test the candidates in order for one (device, dtype, packed); log a new choice."""
        device, dtype, packed = key
        rejected: list[Rejection] = []
        if self.disabled_reason is not None:
            rejected.append(Rejection("*", "-", self.disabled_reason, ""))
        chosen: tuple[Candidate, Callable[..., Any]] | None = None
        ready = 0.0
        for candidate, verdict in self._static:
            start = time.perf_counter()
            verdict, fn = evaluate(self.op, candidate, verdict, device, dtype, packed, self.dims)
            if verdict.ok:
                chosen, ready = (candidate, fn), time.perf_counter() - start
                break
            rejected.append(
                Rejection(
                    candidate.name,
                    candidate.source,
                    verdict.reason,
                    verdict.fix,
                    verdict.parts,
                )
            )
        if chosen is None:
            eager = self.op.eager
            chosen = (eager, self.op.reference)
        candidate, fn = chosen
        choice = Choice(
            self.op.name,
            candidate.name,
            candidate.source,
            candidate.provides,
            tuple(rejected),
            device,
            dtype,
            origin(candidate),
            ready,
        )
        self._chosen[key] = candidate  # before the choice, which calls read without the lock
        self._choices[key] = (choice, fn)
        if self.announce:
            where = f"{device}/{dtype}{' packed' if packed else ''}"
            if choice.fused:
                compiled = f" (compiled on first use: {choice.ready_s:.0f} s)" if choice.compiled else ""
                logger.info("fusepatch: %s: %s on %s -> %s%s", self.label, self.op.name, where, choice.chosen, compiled)
            else:  # each reason new to this process, with its fix; the whole choice at DEBUG
                for reason, (_, fixes) in reasons_and_fixes([choice]).items():
                    fix = f"; fix: {'; '.join(fixes)}" if fixes else ""
                    process_state().said.warn(
                        reason, "fusepatch: %s: %s on %s -> eager: %s%s", self.label, self.op.name, where, reason, fix
                    )
                logger.debug(
                    "fusepatch: %s: %s on %s -> eager (%s)", self.label, self.op.name, where, choice.reason_text()
                )
        return choice, fn

    def seen(self) -> list[Choice]:
        """Every choice made so far (one per device/dtype/packed combination called)."""
        return [c for c, _ in self._choices.values()]


def make_dispatch(
    name: str,
    *,
    env: Environment,
    prefer: tuple[str, ...],
    label: str,
    ops: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    module: Any = None,
) -> Dispatch:
    """The dispatcher of op ``name`` for one layer class (``module``: an instance, for the self-test's sizes)."""
    disabled = None
    if ops is not None and name not in set(ops):
        disabled = f"not selected (apply(ops={sorted(set(ops))!r}))"
    elif name in set(exclude):
        disabled = "excluded by apply(exclude=...)"
    op = op_with_user_candidates(name)
    dims = None
    if module is not None and op.selftest is not None and op.selftest.dims_from is not None:
        try:
            dims = op.selftest.dims_from(module)
        except AttributeError:
            dims = None
    return Dispatch(op, env=env, prefer=prefer, label=label, disabled_reason=disabled, dims=dims)


def _restored_dispatch(
    op: str, prefer: tuple[str, ...], label: str, disabled_reason: str | None, dims: dict[str, int] | None
) -> Dispatch:
    dispatch = Dispatch(
        op_with_user_candidates(op),
        env=capture(),
        prefer=prefer,
        label=label,
        disabled_reason=disabled_reason,
        dims=dims,
    )
    dispatch.announce = True
    return dispatch
