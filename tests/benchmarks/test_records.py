"""The figures the README and the docs state come from the benchmark records (``benchmarks/records/*.jsonl``):
every grouped number (tokens/s, counts: ``19,080``) and every decimal with a unit (``90.9 GiB``, ``0.44 s``) in
the README and the docs is a value some record holds, rounded to the decimals it is written with.

A figure derived from recorded values is written with its derivation, ``146.8 + 33.6 + 24.4 = 204.8 ms`` or
``290.3 / 1.7 = 170.8 ms`` (a recorded value over a target ratio): its terms are recorded (or derived before it in
the same document), a divisor is the target stated beside it, and the result agrees with the arithmetic within the
rounding its figures are written with."""

from __future__ import annotations

import json
import re

from helpers import REPO

GROUPED = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+)(?![\w,])")
UNIT = r" ?(?:GiB|ms|s)\b"
WITH_UNIT = re.compile(rf"(?<![\w.,])(\d+\.\d+){UNIT}")
TERM = r"\d+(?:\.\d+)?"
DERIVED = re.compile(rf"(?<![\w.,])((?:{TERM} [-+/] )+{TERM}) = (\d+\.\d+){UNIT}")


def _decimals(figure: str) -> int:
    return len(figure.partition(".")[2])


def _recorded() -> dict[int, set[float]]:
    """Every number of every record, rounded to 0-3 decimals (by the decimals)."""
    values: dict[int, set[float]] = {digits: set() for digits in range(4)}

    def walk(value) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            for digits, rounded in values.items():
                rounded.add(round(float(value), digits))

    for path in sorted((REPO / "benchmarks" / "records").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                walk(json.loads(line))
    return values


def _holds(terms: str, result: str, known) -> bool:
    """Whether ``terms = result`` holds for known terms, each figure standing for any value it rounds from."""
    words = terms.split()
    if not known(words[0]):
        return False
    half = 0.5 * 10 ** -_decimals(words[0])
    low, high = float(words[0]) - half, float(words[0]) + half
    for op, term in zip(words[1::2], words[2::2], strict=True):
        value = float(term)
        if op == "/":  # a target ratio: exact
            if value <= 0:
                return False
            low, high = low / value, high / value
            continue
        if not known(term):
            return False
        half = 0.5 * 10 ** -_decimals(term)
        if op == "+":
            low, high = low + value - half, high + value + half
        else:
            low, high = low - value - half, high - value + half
    half = 0.5 * 10 ** -_decimals(result) + 1e-9
    return low <= float(result) + half and high >= float(result) - half


def _untraced(doc: str, text: str, recorded: dict[int, set[float]]) -> list[str]:
    derived: set[str] = set()

    def known(figure: str) -> bool:
        return figure in derived or float(figure) in recorded.get(_decimals(figure), ())

    missing = [f"{doc}: {n}" for n in GROUPED.findall(text) if float(n.replace(",", "")) not in recorded[0]]
    for terms, result in DERIVED.findall(text):
        if _holds(terms, result, known):
            derived.add(result)
        else:
            missing.append(f"{doc}: {terms} = {result}")
    missing += [f"{doc}: {n}" for n in WITH_UNIT.findall(text) if not known(n)]
    return missing


def _docs() -> list[str]:
    return ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]


def test_stated_figures_are_recorded():
    recorded = _recorded()
    missing = [m for doc in _docs() for m in _untraced(doc, (REPO / doc).read_text(), recorded)]
    assert not missing, "figures without a record: " + ", ".join(missing)


def test_a_derived_figure_is_traced_only_when_its_arithmetic_holds():
    recorded = {0: set(), 1: {290.3, 146.8, 33.6, 24.4, 211.1}, 2: set(), 3: set()}
    assert _untraced("doc", "a step of 290.3 / 1.7 = 170.8 ms", recorded) == []
    assert _untraced("doc", "146.8 + 33.6 + 24.4 = 204.8 ms; idle 211.1 - 204.8 = 6.3 ms", recorded) == []
    assert _untraced("doc", "146.8 + 33.6 + 24.4 = 205.2 ms", recorded) == [
        "doc: 146.8 + 33.6 + 24.4 = 205.2",
        "doc: 205.2",
    ]
    assert _untraced("doc", "146.8 + 33.7 = 180.2 ms", recorded) == ["doc: 146.8 + 33.7 = 180.2", "doc: 180.2"]
    assert _untraced("doc", "a 204.8 ms step", recorded) == ["doc: 204.8"]
