"""Every option fusepatch takes, checked in one place: ``apply``'s arguments and the ``FUSEPATCH_*`` variables.

A value outside an option's documented values is an error naming the option, the value and what it takes, never
read as some default: ``apply(model, strict="no")`` ran strict (a non-empty string is true), and
``FUSEPATCH_DISABLE=maybe`` read as "off" patched a model its user meant to leave alone. docs/env-vars.md lists the
same values; ``check_environment`` runs at every ``apply``. Plain values and functions: nothing of fusepatch above
the log is imported here (the op and candidate names come in as arguments), and torch only where a dtype is read.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from fusepatch.base.log import LEVELS

if TYPE_CHECKING:
    import torch

SWITCH_ON: tuple[str, ...] = ("1", "true", "yes", "on")
SWITCH_OFF: tuple[str, ...] = ("0", "false", "no", "off")

SWITCHES: tuple[str, ...] = ("FUSEPATCH_DISABLE", "FUSEPATCH_MLP_RECOMPUTE")
# variables fusepatch no longer reads -> what a user who still sets one gets instead (said at apply)
RETIRED: dict[str, str] = {
    "FUSEPATCH_CUDA_GRAPHS": (
        "the graphed delta-rule candidate it switched on is gone (slower than fla's own kernels); "
        "whole decoder layers are graphed by apply(model, cuda_graphs=True)"
    ),
}
# every variable check_environment reads (FUSEPATCH_CACHE, a folder ``python -m fusepatch build`` creates, takes any path)
VARIABLES: tuple[str, ...] = (
    *SWITCHES,
    "FUSEPATCH_VERBOSITY",
    "FUSEPATCH_PREFER",
    "FUSEPATCH_SKIP",
    "FUSEPATCH_CE_LOGITS_MIB",
    "FUSEPATCH_TRUST_KERNELS",
    "FUSEPATCH_KERNELS_LOCK",
)

DEFAULT_LOGITS_MIB = 1024  # FUSEPATCH_CE_LOGITS_MIB's default: why 1024, ops/linear_cross_entropy's fla_chunk_budget
TRUST_ALL: tuple[str, ...] = ("1", "true", "yes", "on", "all", "*")
# a Hub publisher (``kernels-community``) or one repository (``org/name``), as the Hub spells them
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")

# compute_dtype by name, as transformers takes ``dtype="bfloat16"``: torch's names and the short ones
COMPUTE_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32", "float64")
DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}


def _raw(variable: str) -> str:
    return os.environ.get(variable, "")


def switch(variable: str) -> bool:
    """A switch variable: on for 1/true/yes/on, off for 0/false/no/off or unset (any case, spaces ignored)."""
    text = _raw(variable).strip().lower()
    if text in SWITCH_ON:
        return True
    if not text or text in SWITCH_OFF:
        return False
    raise ValueError(
        f"{variable}={_raw(variable)!r} is not a switch value; fix: set it to one of {', '.join(SWITCH_ON)} (on) "
        f"or {', '.join(SWITCH_OFF)} (off), any case, or unset it"
    )


def boolean(value: object, argument: str) -> bool:
    """``apply``'s switches take True or False only: a string such as ``"no"`` is true to Python."""
    if isinstance(value, bool):
        return value
    raise TypeError(
        f"{argument} expects True or False, got {value!r} ({type(value).__name__}){_bool_fix(value, argument)}"
    )


PRECISIONS: tuple[str, ...] = ("fp8",)


def _one_precision(value: object, argument: str, fix: str) -> str | None:
    """None or one of PRECISIONS (any case), else the error naming them and ``fix``."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in PRECISIONS:
        return value.strip().lower()
    raise ValueError(
        f"{argument} expects None or one of {', '.join(repr(p) for p in PRECISIONS)}, got {value!r}; fix: {fix}"
    )


def precision(value: object) -> str | None:
    """``apply(precision=...)``: None (the model's own GEMM precision) or one of PRECISIONS (any case)."""
    fix = 'precision="fp8" trains the decoder\'s projections with FP8 GEMMs, None leaves them as they are'
    return _one_precision(value, "precision", fix)


def drop_frozen_weights(value: object, precision: str | None) -> bool:
    """``apply(drop_frozen_weights=...)``: True or False, and True only with a ``precision`` (whose copy of a frozen
    weight is what the projection keeps)."""
    value = boolean(value, "drop_frozen_weights")
    if value and precision is None:
        raise ValueError(
            'drop_frozen_weights=True keeps frozen projections in FP8 only; fix: pass precision="fp8" with it'
        )
    return value


def lm_head_precision(value: object) -> str | None:
    """``apply(lm_head_precision=...)``: None (the LM head's GEMMs in the model's own precision) or one of PRECISIONS
    (any case), for the causal LM's fused loss."""
    fix = "name one of those to run the LM head's GEMMs in it, or None to leave them as they are"
    return _one_precision(value, "lm_head_precision", fix)


def row_precisions(precision: str | None, lm_head: str | None) -> tuple[str, ...]:
    """The ``Row.precision`` values an ``apply`` call selects: its ``precision``'s projections, and the heads whose
    loss runs in ``lm_head_precision`` (``head_rows``)."""
    return tuple(filter(None, (precision, lm_head and head_rows(lm_head))))


def head_rows(precision: str) -> str:
    """The ``Row.precision`` of the heads whose loss runs its GEMMs in ``precision``."""
    return f"{precision}-lm-head"


def optional_boolean(value: object, argument: str) -> bool | None:
    """True, False or None (``verbose``: None is its own level)."""
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(
        f"{argument} expects True, False or None, got {value!r} ({type(value).__name__}){_bool_fix(value, argument)}"
    )


def _bool_fix(value: object, argument: str) -> str:
    text = str(value).strip().lower()
    if text in SWITCH_ON:
        return f"; fix: {argument}=True"
    if text in SWITCH_OFF:
        return f"; fix: {argument}=False"
    return ""


def compute_dtype(value: object) -> torch.dtype | None:
    """``compute_dtype``: None, a torch floating dtype, or its name (``"bfloat16"``, ``"torch.bfloat16"``,
    ``"bf16"``; fp16, fp32, fp64 likewise), the dtype the layers compute in."""
    import torch

    allowed = ", ".join(f"torch.{name}" for name in COMPUTE_DTYPES)
    names = ", ".join(repr(name) for name in (*COMPUTE_DTYPES, "bf16", "fp16", "fp32"))
    if value is None:
        return None
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        name = DTYPE_ALIASES.get(name, name)
        if name in COMPUTE_DTYPES:
            return getattr(torch, name)
    elif isinstance(value, torch.dtype):
        if str(value).removeprefix("torch.") in COMPUTE_DTYPES:
            return value
    else:
        raise TypeError(
            f"compute_dtype expects a torch floating dtype or its name, got {value!r} ({type(value).__name__}); "
            f"fix: one of {allowed}"
        )
    raise ValueError(
        f"compute_dtype={value!r}: the layers compute in a floating dtype; fix: one of {allowed} (or by name: {names})"
    )


def names(value: str | Iterable[str], argument: str) -> list[str]:
    """A list of names from a list, a tuple or one string (``"hub"`` or ``"pip,hub"``), never a string's
    characters; anything else is a TypeError naming the argument."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{argument} expects a list of names or one string, got {type(value).__name__}") from None
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"{argument} expects names (str), got {item!r} ({type(item).__name__})")
    return items


def sources(value: str | Iterable[str], argument: str, known: Iterable[str]) -> tuple[str, ...]:
    """Kernel source names (``prefer``, ``FUSEPATCH_PREFER``), each one of ``known``."""
    known = tuple(known)
    chosen = tuple(names(value, argument))
    unknown = [p for p in chosen if p not in known]
    if unknown:
        where = f"{argument}={value!r}" if argument.startswith("FUSEPATCH_") else f"{argument}"
        choices = ", ".join(repr(k) for k in known)
        raise ValueError(f"{where}: unknown kernel source(s) {unknown}; fix: choose from {choices} (comma-separated)")
    return chosen


def verbosity() -> str:
    """``FUSEPATCH_VERBOSITY``'s level name (default ``info``)."""
    text = _raw("FUSEPATCH_VERBOSITY").strip().lower() or "info"
    if text not in LEVELS:
        raise ValueError(
            f"FUSEPATCH_VERBOSITY={_raw('FUSEPATCH_VERBOSITY')!r} is not a level; "
            f"fix: one of {', '.join(LEVELS)} (any case), or unset it (info)"
        )
    return text


def skip_pairs(text: str, candidates: Mapping[str, Iterable[str]]) -> set[tuple[str, str]]:
    """``FUSEPATCH_SKIP``'s ``op/candidate`` pairs (commas or semicolons between them; ``*`` for every op), each
    naming an op of ``candidates`` (op -> its candidates' names) and one of its candidates."""
    pairs = set()
    where = f"FUSEPATCH_SKIP={text!r}"
    for item in re.split(r"[,;]", text):
        item = item.strip()
        if not item:
            continue
        op, sep, name = item.partition("/")  # a Hub candidate's own name holds a '/': the op ends at the first
        if not sep or not op or not name:
            raise ValueError(f"{where}: expected op/candidate (e.g. rms_norm/triton), got {item!r}")
        if op == "*":
            every = sorted({c for names_ in candidates.values() for c in names_})
            if name not in every:
                raise ValueError(f"{where}: no op has a candidate {name!r}; candidates: {', '.join(every)}")
        elif op not in candidates:
            raise ValueError(
                f"{where}: no op {op!r}; ops: {', '.join(sorted(candidates))}, or * for every op's candidate of that name"
            )
        elif name not in tuple(candidates[op]):
            raise ValueError(f"{where}: {op} has no candidate {name!r}; its candidates: {', '.join(candidates[op])}")
        pairs.add((op, name))
    return pairs


def positive_whole(variable: str, default: int, unit: str) -> int:
    """A positive whole number of ``unit`` (``FUSEPATCH_CE_LOGITS_MIB``: MiB), ``default`` when unset."""
    value = _raw(variable).strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{variable}={value!r}: expected a whole number of {unit}, e.g. {default}") from None
    if number <= 0:
        raise ValueError(f"{variable}={value!r}: expected a positive number of {unit}, e.g. {default}")
    return number


def trusted_kernels() -> tuple[str, ...]:
    """``FUSEPATCH_TRUST_KERNELS``: Hub publishers or ``org/repo`` ids (comma list) to load besides the trusted
    ones; ``("*",)`` for 1/true/yes/on/all/``*``, none for 0/false/no/off or unset."""
    text = _raw("FUSEPATCH_TRUST_KERNELS").strip()
    if text.lower() in TRUST_ALL:
        return ("*",)
    if not text or text.lower() in SWITCH_OFF:
        return ()
    entries = tuple(entry.strip() for entry in text.split(",") if entry.strip())
    for entry in entries:
        if not _HUB_NAME.fullmatch(entry):
            raise ValueError(
                f"FUSEPATCH_TRUST_KERNELS={text!r}: {entry!r} is not a Hub publisher or org/repo id; fix: a comma "
                "list such as 'my-org,other-org/swiglu', or 1/all to trust every publisher"
            )
    return entries


def kernels_lock() -> str | None:
    """``FUSEPATCH_KERNELS_LOCK``: the path of an existing ``kernels`` lock file, None when unset."""
    path = _raw("FUSEPATCH_KERNELS_LOCK").strip()
    if not path:
        return None
    if not os.path.isfile(path):
        raise ValueError(
            f"FUSEPATCH_KERNELS_LOCK={path!r}: no such file; fix: the path of a lock file written by "
            "`kernels lock`, or unset it"
        )
    return path


def given() -> dict[str, str]:
    """The ``FUSEPATCH_*`` variables set in this process, read or retired, with their values."""
    return {name: os.environ[name] for name in (*VARIABLES, "FUSEPATCH_CACHE", *RETIRED) if name in os.environ}


def environment_problems(
    candidates: Mapping[str, Iterable[str]], source_names: Iterable[str] = ("pip", "hub")
) -> dict[str, str]:
    """Each ``FUSEPATCH_*`` variable whose value is outside its values -> the message naming what it takes.
    ``candidates``: op -> its candidates' names (``FUSEPATCH_SKIP``)."""
    checks = {variable: (lambda v=variable: switch(v)) for variable in SWITCHES}
    checks["FUSEPATCH_VERBOSITY"] = verbosity
    checks["FUSEPATCH_TRUST_KERNELS"] = trusted_kernels
    checks["FUSEPATCH_KERNELS_LOCK"] = kernels_lock
    checks["FUSEPATCH_SKIP"] = lambda: skip_pairs(_raw("FUSEPATCH_SKIP"), candidates)
    checks["FUSEPATCH_CE_LOGITS_MIB"] = lambda: positive_whole("FUSEPATCH_CE_LOGITS_MIB", DEFAULT_LOGITS_MIB, "MiB")
    checks["FUSEPATCH_PREFER"] = lambda: sources(_raw("FUSEPATCH_PREFER"), "FUSEPATCH_PREFER", source_names)
    problems = {}
    for variable, check in checks.items():
        try:
            check()
        except ValueError as exc:
            problems[variable] = str(exc)
    return problems


def check_environment(candidates: Mapping[str, Iterable[str]], source_names: Iterable[str] = ("pip", "hub")) -> None:
    """Read every ``FUSEPATCH_*`` variable now (``apply`` calls this first), so a value it does not take fails here,
    all of them in one error, and not later or never: a variable read only on the GPU or when a loss runs is checked
    on every machine. ``candidates``: op -> its candidates' names (``FUSEPATCH_SKIP``)."""
    for variable, instead in RETIRED.items():
        if _raw(variable):
            logging.getLogger("fusepatch").warning("%s is no longer read: %s; fix: unset it", variable, instead)
    problems = list(environment_problems(candidates, source_names).values())
    if len(problems) == 1:
        raise ValueError(f"fusepatch: {problems[0]}")
    if problems:
        raise ValueError("fusepatch: environment variables outside their values:\n  " + "\n  ".join(problems))
