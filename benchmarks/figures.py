"""Every measured figure of README.md, CHANGELOG.md and docs/*.md, tied to the record rows it comes from.

A figure is followed by a key, ``[r:KEY]``, in its paragraph, list item or table row; a figure after the last key of
its paragraph belongs to that key (one key in a table row's first cell covers the row). ``benchmarks/records/
index.toml`` resolves each key: the record file, the rows it reads by role (selected by their fields: ``config``,
``shape``, ``code``, ... or ``line``), and, in the order the figures are written, the statistic each one states: an
expression over the roles' fields, e.g. ``fp.tokens_per_s_synced``, ``fp.tokens_per_s_synced /
hf.tokens_per_s_synced`` (a ratio), ``1 - fp.peak_gib / hf.peak_gib`` (a percentage: the fraction, written x 100).

Runs: a role's rows fall into runs (a row's ``code``, and its place among that role's rows of the same code). A
statistic is computed in every run that holds all the roles it names, and the figure is the median over those runs,
so a figure of a configuration measured several times is its median, and a ratio is the median of each run's ratio
against the baseline of that same run. A key's ``pair`` keeps only the runs in which all those roles have a row, its
``runs`` only the runs of those codes; with ``codes = true`` the commits written beside its figures must be exactly
the codes of the runs they come from; with ``across = true`` runs are ignored and each role stands for the median of
its rows (a comparison across runs).

A figure matches when it is its statistic rounded to the decimals it is written with (after ``~`` or ``about`` a
whole number's trailing zeros are not digits: ``~700`` is 650 to 750). Needs no key, by rule:

- code: fenced and indented blocks, and code spans (literals, commands, labels, commits, quoted output);
- names, versions and dates: a number glued to a letter (``27B``, ``r16``, ``H200``), ``X.Y.Z``, a decimal after a
  distribution's name (``torch 2.11``, ``Triton < 3.7.1``, a support table's row), ``2026-12-04``, ``#640``,
  ``25-step``;
- targets and thresholds: a figure after a bound (``>=``, ``≤``, ``target``, ``beyond``, ``under``, ``meets``) or
  followed by ``needs``, ``aimed at`` or ``target``;
- arithmetic written out: in ``146.8 + 33.6 + 24.4 = 204.8 ms`` the terms are figures (keyed) and the result is
  checked against them (each term standing for any value it rounds from; a whole number or a target of the same
  paragraph is exact); the result restated later in its paragraph needs nothing either;
- a whole number without a unit (steps, layers, tokens of a setting). A measured count is keyed by a statistic
  written ``#...`` (``6 of 321 gradients``: ``#beyond(...)``, ``#len(...)``), and ``N of M`` always needs a key. In
  a keyed paragraph, a statistic ``- why`` marks a figure that is not a measurement (a setting).

    python benchmarks/figures.py                        # check every document; one line per failure
    python benchmarks/figures.py --show README.md       # each figure: its key, statistic and value
    python benchmarks/figures.py --draft docs/fp8.md    # statistics for the figures of keys whose list is empty
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import operator
import pathlib
import re
import statistics
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

REPO = pathlib.Path(__file__).resolve().parent.parent
RECORDS = REPO / "benchmarks" / "records"
INDEX = RECORDS / "index.toml"
DOCS = ("README.md", "CHANGELOG.md", "docs/*.md")  # the documents whose figures are checked

MARKER = re.compile(r"\[r:([A-Za-z0-9_.-]+)\]")
CODE_SPAN = re.compile(r"`[^`]+`")
LINK_TARGET = re.compile(r"\]\([^)\s]*\)|<?https?://[^\s)>]+>?")
HASH = re.compile(r"(?<![\w])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w])")
NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:e[-+]?\d+)?")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
LIST_ITEM = re.compile(r"\s*(?:[-*]|\d+\.) ")
UNIT = re.compile(r"\s*(GiB|MiB|GB|ms|s|minutes)\b")
RATIO_SUFFIX = re.compile(r"x(?![\w])")
# a bound just before a figure makes it a target or a threshold: only a few words between them
BOUND_BEFORE = re.compile(r"(?:[<>]=?|[≤≥]|\b(?:targets?|beyond|under|below|meets?)\b)[^\d|;()]{0,6}$")
BOUND_AFTER = re.compile(r"^\s+(?:needs|aimed at|target)\b")
APPROX = re.compile(r"(?:~|≈|\b(?:about|roughly|around|nearly))\s?$")
OPERATOR_GAP = re.compile(r"^\s[-+/*]\s$")
EQUALS_GAP = re.compile(r"^\s=\s$")
OF_GAP = re.compile(r"^\sof\s$")
# a decimal after a distribution's name (an operator between) is a version, and so is one after a version and
# ``to``, ``or``, ``,``; \x01 marks where a code span began or ended
VERSION_WORDS = {"python", "cuda", "capability", "version", "versions", "v"}
VERSION_BEFORE = re.compile(r"([A-Za-z][\w-]*)(\x01?)\s*(?:\(|(?:[<>]=?|==|~=|[≤≥]|up to|from)\s*)?$")
VERSION_LINK = re.compile(r"\d+(?:\.\d+)+\x01?(?:\s*\([^)]*\))?(?:\s*(?:to|or|and|,|/)\s*|-)$")
AS_CODE = {"kernels"}  # a distribution whose name is also a word of the prose: a version only after it as code


# --- documents: blocks, their numbers, written arithmetic --------------------------------------------------------


@dataclass
class Token:
    """One number as written; its kind decides how it is checked."""

    text: str
    value: float
    decimals: int
    kind: str  # ratio, percent, unit, grouped, decimal, count (a whole number without a unit)
    start: int
    end: int
    line: int
    approx: bool = False
    target: bool = False  # a target or threshold, or an exact term of written arithmetic
    derived: bool = False  # the result of written arithmetic, or one restated

    @property
    def measured(self) -> bool:
        return not (self.target or self.derived)


@dataclass
class Block:
    """A paragraph, list item, table row or heading: the scope of its keys."""

    doc: str
    line: int
    raw: str
    text: str = ""  # code spans, link targets and keys blanked out, positions kept
    plain: str = ""  # code spans' contents kept: a distribution named in code names a version
    markers: list[tuple[int, str]] = field(default_factory=list)
    hashes: list[tuple[int, str]] = field(default_factory=list)
    tokens: list[Token] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def line_of(self, offset: int) -> int:
        return self.line + self.raw.count("\n", 0, offset)


def blocks(doc: str, text: str) -> list[Block]:
    """The document's blocks outside code: table rows and headings alone, list items and paragraphs whole."""
    found: list[Block] = []
    current: Block | None = None
    fence = in_code = False
    previous_blank = True
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        starts = stripped.startswith("```") or not stripped or stripped[0] in "|#" or LIST_ITEM.match(line)
        if current is not None and (starts or fence or in_code):
            found.append(current)
            current = None
        if stripped.startswith("```"):
            fence = not fence
        elif fence:
            continue
        elif not stripped:
            previous_blank, in_code = True, False
            continue
        elif in_code or (previous_blank and line.startswith("    ") and not LIST_ITEM.match(line)):
            in_code = True
        elif stripped[0] in "|#":
            if not re.fullmatch(r"\|[\s:|-]*\|", stripped):
                found.append(Block(doc, number, line))
        elif current is None:
            current = Block(doc, number, line)
        else:
            current.raw += "\n" + line
        previous_blank = False
    if current is not None:
        found.append(current)
    for block in found:
        _clean(block)
    return found


def _blank(text: str, start: int, end: int) -> str:
    return text[:start] + " " * (end - start) + text[end:]


def _clean(block: Block) -> None:
    """Code spans, link targets and keys blanked out (positions kept); the keys and the commits noted."""
    text = plain = block.raw
    for match in CODE_SPAN.finditer(text):
        block.hashes += [(match.start(), h) for h in HASH.findall(match.group())]
        text = _blank(text, match.start(), match.end())
        plain = f"{plain[: match.start()]}\x01{match.group()[1:-1]}\x01{plain[match.end() :]}"
    for match in LINK_TARGET.finditer(text):
        text = _blank(text, match.start(), match.end())
    for match in MARKER.finditer(text):
        block.markers.append((match.start(), match.group(1)))
        text = _blank(text, match.start(), match.end())
    block.hashes += [(m.start(), m.group()) for m in HASH.finditer(text)]
    block.text, block.plain = text, plain


def _decimals(text: str) -> int:
    """The decimals a figure is written with (``7.00e-04``: six)."""
    mantissa, _, exponent = text.partition("e")
    return len(mantissa.partition(".")[2]) - int(exponent or 0)


@functools.cache
def version_names() -> frozenset[str]:
    """The distributions the project names: its version table's and those in the records' ``versions``."""
    names = set(VERSION_WORDS)
    table = (REPO / "fusepatch" / "base" / "versions.py").read_text()
    names.update(n.lower() for n in re.findall(r'Support\(\s*"([\w.-]+)"', table))
    names.update(n.lower() for n in re.findall(r'also=\("([\w.-]+)"', table))
    for records in load_records().values():
        for row in records:
            for key, value in (row.get("versions") or {}).items():
                names.update(k.lower() for k in (value if isinstance(value, dict) else {key: 0}))
    names.discard("fusepatch")  # the project's own name precedes its figures, not its version
    return frozenset(names)


def _is_version(plain: str, start: int, row_label: str) -> bool:
    names = version_names()
    if row_label in names:
        return True
    before = plain[max(0, start - 80) : start]
    while True:
        name = VERSION_BEFORE.search(before)
        if name and name.group(1).lower() in names and (name.group(1) not in AS_CODE or name.group(2)):
            return True
        link = VERSION_LINK.search(before)
        if not link:
            return False
        before = before[: link.start()]


def _kind(text: str, start: int, end: int) -> tuple[str | None, int]:
    """What follows a number says what it is (and where it ends); ``None``: part of a name."""
    after = text[end:]
    if RATIO_SUFFIX.match(after):
        return "ratio", end + 1
    if after.startswith("%"):
        return "percent", end + 1
    unit = UNIT.match(after)
    if unit:
        return "unit", end + unit.end()
    if re.match(r"[A-Za-z_]|-[A-Za-z]", after):
        return None, end
    number = text[start:end]
    if "," in number:
        return "grouped", end
    return ("decimal" if "." in number or "e" in number else "count"), end


def _token(block: Block, start: int, end: int, kind: str, suffix_end: int) -> Token:
    text = block.text
    before = text[max(0, start - 24) : start]
    return Token(
        text=text[start:end],
        value=float(text[start:end].replace(",", "")),
        decimals=_decimals(text[start:end]),
        kind=kind,
        start=start,
        end=suffix_end,
        line=block.line_of(start),
        approx=bool(APPROX.search(before)),
        target=bool(BOUND_BEFORE.search(before) or BOUND_AFTER.match(text[suffix_end:])),
    )


def tokenize(block: Block) -> None:
    """The block's numbers with their kinds; names, versions and dates left out."""
    text = block.text
    cells = text.split("|")
    # a table row about a distribution (its first cell the name, alone or with a note): its decimals are versions
    label = re.match(r"([\w-]*)(?:$|,| \()", cells[1].strip().lower()) if text.lstrip()[:1] == "|" else None
    row_label = label.group(1) if label and len(cells) > 2 else ""
    position = 0
    while match := NUMBER.search(text, position):
        start, end = match.span()
        position = end
        before, after = (text[start - 1] if start else " "), text[end:]
        if DATE.match(text, start):
            position = start + 10
            continue
        if re.match(r"\.\d", after):  # a version X.Y.Z
            position = end + re.match(r"[\w.]*", after).end()
            continue
        if re.match(r"[\w.#]", before):
            continue
        spans = [(start, end)]
        if re.match(r"[-–]\d", after):  # a range: the second number's suffix gives both their kind
            second = NUMBER.match(text, end + 1)
            if re.match(r"\.\d", text[second.end() :]):
                position = second.end()
                continue
            spans.append(second.span())
        kind, suffix_end = _kind(text, *spans[-1])
        if kind is None:
            position = spans[-1][1]
            continue
        if kind == "decimal" and len(spans) == 1 and _is_version(block.plain, start, row_label):
            continue
        for s, e in spans:
            token = _token(block, s, e, kind, suffix_end if (s, e) == spans[-1] else e)
            sign = text[s - 1] if s else " "
            if sign in "+-−" and (s < 2 or text[s - 2] in " (|"):
                token.text, token.value = sign + token.text, token.value * (1 if sign == "+" else -1)
            block.tokens.append(token)
        position = suffix_end


def _interval(token: Token, exact: bool) -> tuple[float, float]:
    half = 0 if exact else 0.5 * 10**-token.decimals
    return token.value - half, token.value + half


def _apply(op: str, low: float, high: float, a: float, b: float) -> tuple[float, float]:
    """Interval arithmetic: ``[low, high] op [a, b]``."""
    if op == "+":
        return low + a, high + b
    if op == "-":
        return low - b, high - a
    if op == "*":
        products = (low * a, low * b, high * a, high * b)
        return min(products), max(products)
    if a <= 0:
        return -math.inf, math.inf
    return low / b, high / a


def arithmetic(block: Block) -> None:
    """Written arithmetic ``a + b = c``: its result must follow from its terms, and is derived, not keyed."""
    tokens, text = block.tokens, block.text
    derived: set[str] = set()
    targets = {t.value for t in tokens if t.target}
    index = 0
    while index < len(tokens):
        end = index
        operators: list[str] = []
        while end + 1 < len(tokens) and OPERATOR_GAP.match(text[tokens[end].end : tokens[end + 1].start]):
            operators.append(text[tokens[end].end : tokens[end + 1].start].strip())
            end += 1
        if (
            not operators
            or end + 1 == len(tokens)
            or not EQUALS_GAP.match(text[tokens[end].end : tokens[end + 1].start])
        ):
            if tokens[index].text in derived and tokens[index].kind != "count":
                tokens[index].derived = True  # a result restated
            index += 1
            continue
        chain, result = tokens[index : end + 1], tokens[end + 1]
        low = high = 0.0
        for position, term in enumerate(chain):
            exact = term.kind == "count" or term.value in targets or term.target
            term.derived = term.text in derived
            term.target = exact and not term.derived
            a, b = _interval(term, exact)
            low, high = (a, b) if position == 0 else _apply(operators[position - 1], low, high, a, b)
        half = 0.5 * 10**-result.decimals + 1e-9
        if not low - half <= result.value <= high + half:
            written = " ".join(f"{t.text} {op}" for t, op in zip(chain, [*operators, "="], strict=True))
            block.errors.append(
                f"{block.doc}:{result.line}: {written} {result.text}: its terms give {low:.6g}-{high:.6g}"
            )
        result.derived = True
        derived.add(result.text)
        index = end + 2


def scan(doc: str, text: str) -> list[Block]:
    """A document's blocks, their numbers read and their arithmetic checked."""
    found = blocks(doc, text)
    for block in found:
        tokenize(block)
        arithmetic(block)
    return found


# --- the records and the index -----------------------------------------------------------------------------------


@functools.cache
def load_records() -> dict[str, list[dict]]:
    return {
        path.name: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for path in sorted(RECORDS.glob("*.jsonl"))
    }


def load_index(path: pathlib.Path = INDEX) -> dict:
    return tomllib.loads(path.read_text())


class IndexError_(Exception):
    """An index entry that does not resolve: its figures cannot be checked."""


Run = tuple[str, int]  # a code, and the place among the role's rows of that code
WORKLOAD = ("lora_rank", "sft")  # what the step trains: a selector that does not name them takes rows without


def _label(config: str) -> str:
    """``+quick`` only leaves the memory and host views out: the timing is the configuration's."""
    return "+".join(word for word in config.split("+") if word != "quick")


def _code(row: dict) -> str:
    """The commit a row ran, from its ``code`` or its note."""
    if row.get("code"):
        return row["code"]
    note = re.search(r"\bcode ([0-9a-f]{7})\b", str(row.get("record_note", "")))
    return note.group(1) if note else ""


def _selects(selector: dict, line: int, row: dict) -> bool:
    """Whether a row is the selector's: each named field has one of the values given (``true``: any)."""
    for name, wanted in selector.items():
        wanted = wanted if isinstance(wanted, list) else [wanted]
        if name == "record":
            continue
        if name == "line":
            found = line
        elif name == "config":
            found, wanted = _label(str(row.get("config", ""))), [_label(w) for w in wanted]
        elif name == "code":
            found = _code(row)
        else:
            found = row.get(name)
        if found not in wanted and not (wanted[0] is True and found):
            return False
    return "line" in selector or all(name in selector or not row.get(name) for name in WORKLOAD)


@dataclass
class Key:
    """An index entry: its roles' rows, each with its run, and its figures' statistics."""

    name: str
    roles: dict[str, list[tuple[Run, dict]]]
    figures: list[str]
    across: bool = False
    codes: bool = False


def resolve(name: str, index: dict) -> Key:
    entry = index.get(name)
    if name == "set" or not isinstance(entry, dict):
        raise IndexError_(f"no key {name!r} in {INDEX.relative_to(REPO)}")
    base = index.get("set", {}).get(entry["set"]) if "set" in entry else {}
    if base is None:
        raise IndexError_(f"no set {entry['set']!r}")
    record = entry.get("record", base.get("record"))
    selectors = {"r": {}, **base.get("roles", {}), **entry.get("roles", {})}  # r: every row of the record
    roles: dict[str, list[tuple[Run, dict]]] = {}
    for role, selector in selectors.items():
        file = selector.get("record", record)
        if file not in load_records():
            raise IndexError_(f"no record {file!r}")
        rows = [row for line, row in enumerate(load_records()[file], 1) if _selects(selector, line, row)]
        if "runs" in entry and "line" not in selector and "code" not in selector:
            rows = [row for row in rows if _code(row) in entry["runs"]]
        seen: dict[str, int] = {}
        roles[role] = []
        for row in rows:
            code = _code(row)
            roles[role].append(((code, seen.get(code, 0)), row))
            seen[code] = seen.get(code, 0) + 1
    if entry.get("pair"):
        kept = set.intersection(*({run for run, _ in roles[p]} for p in entry["pair"]))
        roles = {role: [(run, row) for run, row in rows if run in kept] for role, rows in roles.items()}
    return Key(name, roles, list(entry.get("figures", [])), entry.get("across", False), entry.get("codes", False))


# --- statistics: expressions over the roles' fields --------------------------------------------------------------


def _numbers(value: object) -> list[float]:
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, list):
        raise IndexError_(f"not a list of numbers: {str(value)[:60]}")
    return [float(v[1] if isinstance(v, list) else v) for v in value if not isinstance(v, (dict, str))]


def _pairs(a: dict, b: dict) -> Iterator[tuple[str, float, float]]:
    return ((name, float(x), float(b[name])) for name, x in a.items() if name in b)


def _windowed(row: dict) -> list[tuple[float, list[float]]]:
    """A loss-curve record's windows: the baseline's seed-to-seed spread, and the candidate's loss minus the
    baseline's at each seed."""
    base, cand, windows = row.get("baseline", "hf-fast"), row.get("candidate", "fusepatch"), row["windows"]
    seeds = sorted({k.split(":")[1] for k in windows})
    return [
        (
            abs(windows[f"{base}:{seeds[0]}"][i] - windows[f"{base}:{seeds[1]}"][i]),
            [windows[f"{cand}:{s}"][i] - windows[f"{base}:{s}"][i] for s in seeds],
        )
        for i in range(min(len(v) for v in windows.values()))
    ]


def _curve(row: dict) -> list[tuple[float, float]]:
    """A loss-curve record's windows: the baseline's seed-to-seed spread, and the candidate's largest distance from
    the baseline at the same seed."""
    return [(spread, max(abs(d) for d in differences)) for spread, differences in _windowed(row)]


def _worst(row: dict) -> dict[str, float]:
    """The window where the candidate is furthest outside the spread: spread, distance, the baseline's loss there,
    the step it starts after."""
    curve = _curve(row)
    i = max(range(len(curve)), key=lambda w: curve[w][1] - curve[w][0])
    base = row.get("baseline", "hf-fast")
    loss = statistics.mean(v[i] for k, v in row["windows"].items() if k.startswith(base + ":"))
    return {"spread": curve[i][0], "distance": curve[i][1], "loss": loss, "step": i * row["window"]}


def _shift(row: dict) -> float:
    """The largest window shift of the candidate's curve from the baseline's, either way: per window, the
    candidate's loss minus the baseline's at the same seed, averaged over the seeds."""
    return max(abs(statistics.mean(differences)) for _, differences in _windowed(row))


def _inside_of(row: dict, other: dict, config: str) -> int:
    """The windows where ``other``'s curves of ``config`` (each seed) are inside ``row``'s seed-to-seed spread of
    ``config``: one configuration's two runs against each other, what the same criterion gives with no change."""
    mine, theirs = row["windows"], other["windows"]
    seeds = sorted({k.split(":")[1] for k in mine if k.startswith(config + ":")})
    count = min(len(mine[f"{config}:{s}"]) for s in seeds)
    return sum(
        1
        for i in range(count)
        if max(abs(theirs[f"{config}:{s}"][i] - mine[f"{config}:{s}"][i]) for s in seeds)
        <= abs(mine[f"{config}:{seeds[0]}"][i] - mine[f"{config}:{seeds[1]}"][i])
    )


def _setting(row: dict, name: str) -> float:
    match = re.search(rf"\b{re.escape(name)}=(\d+(?:\.\d+)?)", str(row.get("command", "")))
    if not match:
        raise IndexError_(f"no {name}= in the row's command")
    return float(match.group(1))


def _most_off(found: dict, base: dict) -> float:
    """The parameter error furthest from the baseline's, in times its own (``benchmarks/studies/trace_check.py``)."""
    names = sorted(k for k in base if k != "logits")
    return found[max(names, key=lambda k: found[k] / max(base[k], 1e-6))]


FUNCTIONS: dict[str, Callable] = {
    "median": lambda x: statistics.median(_numbers(x)),
    "max": lambda *x: max(_numbers(x[0])) if len(x) == 1 else max(x),
    "min": lambda *x: min(_numbers(x[0])) if len(x) == 1 else min(x),
    "sum": lambda x: sum(_numbers(x)),
    "len": len,
    # fidelity records' ``errors``: how many are beyond factor x the baseline's, which (with their errors), each
    # one's ratio to the baseline's; a dict's values for some names, or without them
    "beyond": lambda a, b, factor: sum(1 for _, x, y in _pairs(a, b) if x > factor * y),
    "over": lambda a, b, factor: {n: x for n, x, y in _pairs(a, b) if x > factor * y},
    "ratios": lambda a, b: {n: x / y for n, x, y in _pairs(a, b) if y},
    "of": lambda values, names: {n: values[n] for n in names if n in values},
    "without": lambda values, names: {n: v for n, v in values.items() if n not in names},
    "most_off": _most_off,
    # loss-curve records: the windows, those where the candidate is inside the baseline's seed spread, the largest
    # excess over the spread, the window of that excess, the largest shift of the seeds' mean either way
    "windows": lambda row: len(_curve(row)),
    "inside": lambda row: sum(1 for spread, distance in _curve(row) if distance <= spread),
    "excess": lambda row: max(distance - spread for spread, distance in _curve(row)),
    "worst": _worst,
    "shift": _shift,
    "inside_of": _inside_of,
    "setting": _setting,  # a NAME=VALUE setting of the row's command (a time limit)
}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _field(value: object, name: object) -> object:
    """A field of a row: a dict's key, a list's index, or the value of a ``[name, value]`` pair in a list."""
    if isinstance(value, dict):
        if name not in value:
            raise IndexError_(f"no field {name!r} (fields: {', '.join(map(str, list(value)[:12]))}, ...)")
        return value[name]
    if isinstance(value, list):
        if isinstance(name, int):
            return value[name]
        for item in value:
            if isinstance(item, list) and item and item[0] == name:
                return item[1]
        raise IndexError_(f"no entry {name!r} in a list of {len(value)}")
    raise IndexError_(f"{name!r} of a {type(value).__name__}")


class _Rows(list):
    """A role's rows across runs: a number read from them is their median."""


def _reduce(value: object) -> object:
    if not isinstance(value, _Rows):
        return value
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return statistics.median(value)
    if len(value) == 1:
        return value[0]
    raise IndexError_("a role of several rows read as a whole: name a number")


def _evaluate(node: ast.AST, scope: dict[str, object]) -> object:
    if isinstance(node, ast.Expression):
        return _reduce(_evaluate(node.body, scope))
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_reduce(_evaluate(item, scope)) for item in node.elts]
    if isinstance(node, ast.Name) and node.id in scope:
        return scope[node.id]
    if isinstance(node, (ast.Attribute, ast.Subscript)):
        value = _evaluate(node.value, scope)
        name = node.attr if isinstance(node, ast.Attribute) else _evaluate(node.slice, scope)
        return _Rows(_field(v, name) for v in value) if isinstance(value, _Rows) else _field(value, name)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_reduce(_evaluate(node.operand, scope))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_reduce(_evaluate(node.left, scope)), _reduce(_evaluate(node.right, scope)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
        arguments = [_evaluate(a, scope) for a in node.args]  # a role's rows across runs: the list of their values
        arguments = [(a[0] if len(a) == 1 else list(a)) if isinstance(a, _Rows) else a for a in arguments]
        return FUNCTIONS[node.func.id](*arguments)
    raise IndexError_(f"not a statistic: {ast.unparse(node)[:60]}")


@dataclass
class Value:
    value: float
    runs: list[Run]


def statistic(key: Key, expression: str) -> Value:
    """The expression's median over the key's runs that hold every role it names."""
    try:
        tree = ast.parse(expression.lstrip("#"), mode="eval")
    except SyntaxError as error:
        raise IndexError_(f"not an expression: {error.msg}") from None
    named = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in FUNCTIONS})
    missing = [n for n in named if n not in key.roles]
    if missing:
        raise IndexError_(f"no role {', '.join(missing)} (roles: {', '.join(key.roles)})")
    empty = [n for n in named if not key.roles[n]]
    if empty:
        raise IndexError_(f"role {', '.join(empty)} selects no row")
    try:
        if key.across:
            value = _evaluate(tree, {role: _Rows(row for _, row in rows) for role, rows in key.roles.items()})
            return Value(float(value), sorted({run for n in named for run, _ in key.roles[n]}))
        by_run = {role: dict(rows) for role, rows in key.roles.items()}
        runs = sorted(set.intersection(*(set(by_run[n]) for n in named))) if named else []
        if not runs:
            raise IndexError_(f"no run holds all of {', '.join(named)} (across = true compares across runs)")
        return Value(statistics.median(float(_evaluate(tree, {n: by_run[n][r] for n in named})) for r in runs), runs)
    except (ArithmeticError, LookupError, TypeError, ValueError) as error:
        raise IndexError_(f"{type(error).__name__}: {error}") from None


def matches(token: Token, value: float) -> bool:
    """Whether the figure as written is the value, rounded to its decimals (a percentage: the value x 100)."""
    scaled = value * 100 if token.kind == "percent" else value
    unit = 10.0**-token.decimals
    if token.approx and token.decimals == 0:  # ~700: its trailing zeros are not digits
        digits = token.text.replace(",", "").lstrip("+-")
        unit = 10.0 ** (len(digits) - len(digits.rstrip("0")))
    return abs(token.value - scaled) <= 0.5 * unit + 1e-9 * max(1.0, abs(scaled))


# --- checking ----------------------------------------------------------------------------------------------------


@dataclass
class Bound:
    """A figure and the statistic it states (``None``: marked not a measurement)."""

    token: Token
    key: str
    expression: str
    value: float | None


def _scope_of(block: Block, offset: int) -> int:
    """The key a position belongs to: the first at or after it, or the paragraph's last."""
    following = [i for i, (o, _) in enumerate(block.markers) if o >= offset]
    return following[0] if following else len(block.markers) - 1


def _unkeyed(block: Block) -> list[str]:
    where = block.doc
    errors = [
        f"{where}:{t.line}: {t.text} ({t.kind}) has no key [r:...]"
        for t in block.tokens
        if t.measured and t.kind != "count"
    ]
    for a, b in zip(block.tokens, block.tokens[1:]):
        if a.kind == b.kind == "count" and OF_GAP.match(block.text[a.end : b.start]):
            errors.append(f"{where}:{a.line}: {a.text} of {b.text} (a count) has no key [r:...]")
    return errors


def _bind(block: Block, key: Key, tokens: list[Token], errors: list[str], bound: list[Bound]) -> set[Run]:
    """The key's statistics against its figures, in order: a whole number takes a ``#`` statistic it equals, any
    other figure the next statistic."""
    specs, position, runs = key.figures, 0, set()
    for token in (t for t in tokens if t.measured):
        spec = specs[position] if position < len(specs) else None
        where = f"{block.doc}:{token.line}: {token.text}: [r:{key.name}]"
        if token.kind == "count" and (spec is None or not spec.startswith("#")):
            continue  # a setting: steps, layers
        if spec is None:
            errors.append(f"{where} has no statistic for it")
            continue
        if spec.startswith("-"):
            position += 1
            bound.append(Bound(token, key.name, spec, None))
            continue
        if spec.startswith("#") and token.kind != "count":
            position += 1
            errors.append(f"{where} expected a count ({spec})")
            continue
        try:
            value = statistic(key, spec)
        except IndexError_ as error:
            position += 1
            errors.append(f"{where} {spec}: {error}")
            continue
        if token.kind == "count" and not matches(token, value.value):
            continue  # not this count: its statistic stays for the next one
        position += 1
        bound.append(Bound(token, key.name, spec, value.value))
        runs.update(value.runs)
        if not matches(token, value.value):
            shown = value.value * 100 if token.kind == "percent" else value.value
            errors.append(f"{where} {spec} is {shown:.6g}")
    errors += [f"{block.doc}:{block.line}: [r:{key.name}] {spec}: no figure states it" for spec in specs[position:]]
    return runs


def check_block(block: Block, index: dict, used: dict[str, str]) -> tuple[list[str], list[Bound]]:
    """A block's failures and bindings; ``used`` notes each key's place (a key has one scope)."""
    if not block.markers:
        return block.errors + _unkeyed(block), []
    errors, bound = list(block.errors), []
    scopes: dict[int, list[Token]] = {i: [] for i in range(len(block.markers))}
    for token in block.tokens:
        scopes[_scope_of(block, token.start)].append(token)
    for number, tokens in scopes.items():
        offset, name = block.markers[number]
        place = f"{block.doc}:{block.line_of(offset)}"
        where = f"{place}: [r:{name}]"
        if name in used:
            errors.append(f"{where} is used twice (also {used[name]}): a key has one place")
            continue
        used[name] = place
        try:
            key = resolve(name, index)
        except IndexError_ as error:
            errors.append(f"{where}: {error}")
            continue
        runs = _bind(block, key, tokens, errors, bound)
        if key.codes:
            written = {h for offset, h in block.hashes if _scope_of(block, offset) == number}
            codes = {code for code, _ in runs}
            if written != codes:
                errors.append(f"{where} names the commits {sorted(written)}; its figures are from {sorted(codes)}")
    return errors, bound


def documents() -> dict[str, str]:
    paths = [path for pattern in DOCS for path in sorted(REPO.glob(pattern))]
    return {path.relative_to(REPO).as_posix(): path.read_text() for path in paths}


def check(texts: dict[str, str] | None = None, index: dict | None = None, whole: bool = True):
    """The documents' figures against the index: the failures (none: every figure holds) and what each figure
    states. ``texts`` replaces the documents (an edited copy); ``whole``: every key must be used."""
    texts = documents() if texts is None else texts
    index = load_index() if index is None else index
    errors: list[str] = []
    bound: list[Bound] = []
    used: dict[str, str] = {}
    for doc, text in texts.items():
        for block in scan(doc, text):
            more, found = check_block(block, index, used)
            errors += more
            bound += found
    if whole:
        errors += [f"{INDEX.relative_to(REPO)}: [{k}] is in no document" for k in index if k not in ("set", *used)]
    return errors, bound


# --- helping an author ------------------------------------------------------------------------------------------


def _flatten(value: object, path: str = "") -> Iterator[tuple[str, float]]:
    if isinstance(value, dict):
        for name, item in value.items():
            step = f".{name}" if re.fullmatch(r"[A-Za-z_]\w*", str(name)) else f"[{json.dumps(name)}]"
            yield from _flatten(item, path + step)
    elif isinstance(value, list) and value and all(isinstance(v, list) and v and isinstance(v[0], str) for v in value):
        yield from ((f"{path}[{json.dumps(v[0])}]", float(v[1])) for v in value if isinstance(v[1], (int, float)))
    elif isinstance(value, list):
        for i, item in enumerate(value[:64]):
            yield from _flatten(item, f"{path}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, float(value)


NOISY = re.compile(r"\[\d+\]|^\.(?:gpu_idle|host_|gpu_clocks|forward_ops|gpu_ms_by_op|report|versions|steps)")
PLAIN = ("tokens_per_s_synced", "tokens_per_s", "tokens_per_s_back_to_back", "b2b_tokens_per_s", "median_step_ms")


def candidates(key: Key, token: Token) -> list[str]:
    """Statistics of the key's rows the figure is, plainest first: a field, or one field's ratio between two roles
    (as a percentage: its difference from 1)."""
    named = [role for role in key.roles if role != "r"] or ["r"]  # r, every row of the record: when nothing else
    fields = {role: dict(_flatten(key.roles[role][0][1])) for role in named if key.roles[role]}
    found: list[str] = []
    count = "#" if token.kind == "count" else ""
    for a, values in fields.items():
        for path, x in values.items():
            if token.kind not in ("ratio", "percent") or "ratio" in path:
                found += [f"{count}{a}{path}"] if matches(token, x) else []
            if token.kind not in ("ratio", "percent") or NOISY.search(path):
                continue
            for b, others in fields.items():
                y = others.get(path)
                if a != b and y:
                    options = [x / y] if token.kind == "ratio" else [x / y - 1]
                    found += [f"{a}{path} / {b}{path}" + ("" if token.kind == "ratio" else " - 1")] * any(
                        matches(token, v) for v in options
                    )
    rank = {name: i for i, name in enumerate(PLAIN)}

    def plainness(expression: str) -> tuple[int, int, int]:
        names = re.findall(r"\.(\w+)", expression)
        return (
            len(NOISY.findall(expression)),
            min((rank.get(n, len(rank)) for n in names), default=0),
            len(expression),
        )

    checked = []
    for expression in sorted(set(found), key=plainness):
        try:
            if matches(token, statistic(key, expression).value):
                checked.append(expression)
        except IndexError_:
            pass
    return checked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--show", metavar="DOC", help="each figure of DOC: its key, statistic and value")
    parser.add_argument("--draft", metavar="DOC", help="statistics for the figures of DOC's keys that have none yet")
    args = parser.parse_args(argv)
    index = load_index()
    if not (args.show or args.draft):
        errors, _ = check(index=index)
        print("\n".join(errors) or "every figure holds")
        return 1 if errors else 0
    doc = args.show or args.draft
    used: dict[str, str] = {}
    for block in scan(doc, (REPO / doc).read_text()):
        if args.show:
            errors, bound = check_block(block, index, used)
            for b in bound:
                value = "-" if b.value is None else f"{b.value:.6g}"
                print(f"{doc}:{b.token.line}: {b.token.text:>12} [r:{b.key}] {b.expression} = {value}")
            print("\n".join(errors), end="\n" if errors else "")
            continue
        for offset, name in block.markers:
            if index.get(name, {}).get("figures"):
                continue
            try:
                key = resolve(name, index)
            except IndexError_ as error:
                print(f"# [r:{name}]: {error}")
                continue
            print(f"[{name}]  # {doc}:{block.line}\nfigures = [")
            for token in block.tokens:
                if (
                    token.measured
                    and token.kind != "count"
                    and _scope_of(block, token.start) == block.markers.index((offset, name))
                ):
                    options = candidates(key, token) or ["?"]
                    print(f"  {json.dumps(options[0])},  # {token.text}" + "".join(f" | {o}" for o in options[1:3]))
            print("]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
