"""The figures the README and the docs state come from the benchmark records (``benchmarks/records/*.jsonl``):
every grouped number (tokens/s, counts: ``19,080``) in the README and the docs, and every decimal with a unit
(``90.9 GiB``, ``0.44 s``) in the README, is a value some record holds (rounded as written)."""

from __future__ import annotations

import json
import re

from helpers import REPO

GROUPED = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+)(?![\w,])")
WITH_UNIT = re.compile(r"(?<![\w.,])(\d+\.\d+) ?(?:GiB|ms|s)\b")


def _recorded() -> set[float]:
    values: set[float] = set()

    def walk(value) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            values.update(round(float(value), digits) for digits in range(4))

    for path in sorted((REPO / "benchmarks" / "records").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                walk(json.loads(line))
    return values


def test_stated_figures_are_recorded():
    recorded = _recorded()
    missing = []
    for doc in ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]:
        text = (REPO / doc).read_text()
        for number in GROUPED.findall(text):
            if float(number.replace(",", "")) not in recorded:
                missing.append(f"{doc}: {number}")
        if doc == "README.md":
            missing += [f"{doc}: {n}" for n in WITH_UNIT.findall(text) if float(n) not in recorded]
    assert not missing, "figures without a record: " + ", ".join(missing)
