"""The figures the README and the docs state come from the benchmark records (``benchmarks/records/*.jsonl``):
every grouped number (tokens/s, counts: ``19,080``) and every decimal with a unit (``90.9 GiB``, ``0.44 s``) in
the README and the docs is a value some record holds, rounded to the decimals it is written with.

A figure derived from recorded values is written with its derivation, ``146.8 + 33.6 + 24.4 = 204.8 ms`` or
``290.3 / 1.7 = 170.8 ms`` (a recorded value over a target ratio): its terms are recorded (or derived before it in
the same document), a divisor is the target stated beside it, and the result agrees with the arithmetic within the
rounding its figures are written with.

Every ratio (``1.20x``, ``0.995-0.998x``, ``43x``) is a quotient of one measure (tokens/s, step time, peak memory,
a fidelity row's loss or gradient error) between two rows of one record file with the same workload (shape,
layers, seq, batch, LoRA rank, SFT rows), either way round, or a value a record holds under a ratio's name, rounded
to the decimals it is written with. A ratio of two different measures is written with its derivation,
``290.3 / 180.2 = 1.61x``, its terms recorded or derived as above. A target is no measurement: a ratio just after a
bound (``>=``, ``≥``, ``<=``, ``≤``, ``>``, ``<``, beyond, under, target) or one the same document divides by in a
derived figure is not checked."""

from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

from helpers import REPO

GROUPED = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+)(?![\w,])")
UNIT = r" ?(?:GiB|ms|s)\b"
WITH_UNIT = re.compile(rf"(?<![\w.,])(\d+\.\d+){UNIT}")
TERM = r"\d+(?:\.\d+)?"
DERIVED = re.compile(rf"(?<![\w.,])((?:{TERM} [-+/] )+{TERM}) = (\d+\.\d+){UNIT}")
RATIO = re.compile(rf"(?<![\w.,-])({TERM})(?:-({TERM}))?x\b")
DERIVED_RATIO = re.compile(rf"(?<![\w.,])({TERM}) / ({TERM}) = ({TERM})x\b")
# A bound just before a ratio makes it a target: nothing but a few words between them.
BOUND = re.compile(r"(?:[<>]=?|[≤≥]|\b(?:targets?|beyond|under)\b)[^\d|;()]{0,6}$")
# What a ratio compares: the measures of a speed row and of each configuration of a fidelity row (its ``errors``
# too, one measure a parameter), never two different measures.
MEASURES = frozenset(
    {
        "tokens_per_s_synced",
        "tokens_per_s_back_to_back",
        "tokens_per_s_trainer_loop",
        "tokens_per_s",
        "b2b_tokens_per_s",
        "trainer_tokens_per_s",
        "median_step_ms",
        "b2b_median_step_ms",
        "trainer_median_step_ms",
        "peak_gib",
        "peak_mem_gib",
        "peak_reserved_gib",
        "loss_error",
    }
)
# Rows compare only at one workload: a LoRA or a packed-SFT row is not its shape's plain row.
WORKLOAD = ("shape", "layers", "seq", "batch", "lora_rank", "sft")
RATIO_FIELD = re.compile(r"ratio|speedup|(?<![a-z])vs(?![a-z])")


def _decimals(figure: str) -> int:
    return len(figure.partition(".")[2])


def _record_files() -> list[list[dict]]:
    """The records, one list a file: a ratio compares rows of one file only."""
    return [
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for path in sorted((REPO / "benchmarks" / "records").glob("*.jsonl"))
    ]


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        elif _number(value):
            for digits, rounded in values.items():
                rounded.add(round(float(value), digits))

    for records in _record_files():
        for record in records:
            walk(record)
    return values


def _measures(record: dict) -> Iterator[dict[str, float]]:
    """A record's rows of measures: the record itself, and each configuration's results in a fidelity record."""
    for row in (record, *record.get("results", {}).values()):
        measures = {key: float(value) for key, value in row.items() if key in MEASURES and _number(value)}
        errors = row.get("errors", {})
        measures.update((f"errors/{key}", float(value)) for key, value in errors.items() if _number(value))
        yield measures


def _ratio_fields(value: object, key: str = "") -> Iterator[float]:
    """The numbers a record holds under a ratio's name (``..._ratio``, ``speedup``, ``vs_hf_fast``)."""
    if isinstance(value, dict):
        for name, item in value.items():
            yield from _ratio_fields(item, name)
    elif isinstance(value, list):
        for item in value:
            yield from _ratio_fields(item, key)
    elif _number(value) and RATIO_FIELD.search(key):
        yield float(value)


def _ratios(files: list[list[dict]]) -> list[float]:
    """Every quotient of one measure between two rows (a row with itself: 1) of one file and one workload, both
    ways round, and every value held under a ratio's name; sorted for a lookup by rounding interval."""
    found: list[float] = []
    for records in files:
        by_measure: dict[tuple[str, str], list[float]] = defaultdict(list)
        for record in records:
            workload = json.dumps([record.get(key) for key in WORKLOAD], sort_keys=True)
            for row in _measures(record):
                for key, value in row.items():
                    by_measure[workload, key].append(value)
            found.extend(_ratio_fields(record))
        for values in by_measure.values():
            found.extend(a / b for a in values for b in values if b)
    return sorted(found)


def _is_ratio(figure: str, ratios: Sequence[float]) -> bool:
    """Whether some quotient rounds to ``figure`` at the decimals it is written with."""
    half = 0.5 * 10 ** -_decimals(figure) + 1e-9
    index = bisect.bisect_left(ratios, float(figure) - half)
    return index < len(ratios) and ratios[index] <= float(figure) + half


def _quotient_holds(numerator: str, denominator: str, result: str, known: Callable[[str], bool]) -> bool:
    """Whether ``numerator / denominator = result`` holds for known terms, each standing for any value it rounds
    from."""
    if not (known(numerator) and known(denominator)):
        return False
    top, bottom = (0.5 * 10 ** -_decimals(term) for term in (numerator, denominator))
    if float(denominator) <= bottom:
        return False
    low = (float(numerator) - top) / (float(denominator) + bottom)
    high = (float(numerator) + top) / (float(denominator) - bottom)
    half = 0.5 * 10 ** -_decimals(result) + 1e-9
    return low <= float(result) + half and high >= float(result) - half


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


def _untraced(doc: str, text: str, recorded: dict[int, set[float]], ratios: Sequence[float] = ()) -> list[str]:
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
    return missing + _untraced_ratios(doc, text, ratios, known)


def _untraced_ratios(doc: str, text: str, ratios: Sequence[float], known: Callable[[str], bool]) -> list[str]:
    """The measured ratios of ``text`` that are neither quotients of ``ratios`` nor derived from known figures."""
    targets: set[float] = set()
    for terms, _ in DERIVED.findall(text):
        words = terms.split()
        targets.update(float(term) for op, term in zip(words[1::2], words[2::2], strict=True) if op == "/")
    missing: list[str] = []
    quoted: set[int] = set()
    for match in DERIVED_RATIO.finditer(text):
        quoted.add(match.start(3))
        if not _quotient_holds(*match.groups(), known):
            missing.append(f"{doc}: {match.group(1)} / {match.group(2)} = {match.group(3)}x")
    for match in RATIO.finditer(text):
        if match.start() in quoted or BOUND.search(text[max(0, match.start() - 16) : match.start()]):
            continue
        figures = [figure for figure in match.groups() if figure and float(figure) not in targets]
        missing += [f"{doc}: {figure}x" for figure in figures if not _is_ratio(figure, ratios)]
    return missing


def _docs() -> list[str]:
    return ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]


def test_stated_figures_are_recorded():
    recorded, ratios = _recorded(), _ratios(_record_files())
    missing = [m for doc in _docs() for m in _untraced(doc, (REPO / doc).read_text(), recorded, ratios)]
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


def test_a_ratio_is_traced_only_to_one_measure_of_one_file_and_workload():
    """Swapped rows count, a made-up ratio, another file, workload or measure do not."""
    files = [
        [
            {"shape": "27b", "tokens_per_s_synced": 15900, "median_step_ms": 257.61},
            {"shape": "27b", "tokens_per_s_synced": 19108, "peak_gib": 42.84},
            {"shape": "27b", "lora_rank": 16, "tokens_per_s_synced": 30358},
            {"shape": "2b", "tokens_per_s_synced": 39334, "speedup_vs_hf_fast": 1.39},
        ],
        [{"shape": "27b", "tokens_per_s_synced": 14341}],
    ]
    ratios = _ratios(files)
    recorded = {0: set(), 1: {257.6, 180.2}, 2: set(), 3: set()}
    assert _untraced("doc", "fusepatch 1.20x, hf-fast 0.83x; 1.00x; 1.39x at 2B", recorded, ratios) == []
    assert _untraced("doc", "1.2x, 1.202x and 1.201x", recorded, ratios) == ["doc: 1.201x"]
    assert _untraced("doc", "a made-up 9.87x", recorded, ratios) == ["doc: 9.87x"]
    assert _untraced("doc", "1.33x against the other file", recorded, ratios) == ["doc: 1.33x"]
    assert _untraced("doc", "LoRA 1.91x, 2B 2.47x", recorded, ratios) == ["doc: 1.91x", "doc: 2.47x"]
    assert _untraced("doc", "74.2x tokens over ms", recorded, ratios) == ["doc: 74.2x"]
    assert _untraced("doc", "idle-free 257.6 / 180.2 = 1.43x", recorded, ratios) == []
    assert _untraced("doc", "idle-free 257.6 / 180.2 = 1.50x", recorded, ratios) == ["doc: 257.6 / 180.2 = 1.50x"]
    assert _untraced("doc", "0.998-9.87x", recorded, ratios) == ["doc: 0.998x", "doc: 9.87x"]

    real = _ratios(_record_files())
    assert _untraced("doc", "27B 1.20x, LoRA 1.35x", recorded, real) == []
    assert _untraced("doc", "27B 9.87x", recorded, real) == ["doc: 9.87x"]


def test_a_target_ratio_is_not_checked():
    """A goal is stated, not measured: after a bound, or divided by in a derived figure; a measured one beside it
    still counts."""
    recorded = {0: set(), 1: {290.3}, 2: set(), 3: set()}
    text = "2B >= 1.7x, SFT ≥ 1.5x, memory <= 0.7x (target 0.8x), params > 1.25x, beyond 1.3x, stays under 1.6x"
    assert _untraced("doc", text, recorded) == []
    assert _untraced("doc", "1.9x needs a step of 290.3 / 1.9 = 152.8 ms; it meets 1.9x", recorded) == []
    assert _untraced("doc", "27B >= 1.25x | 1.20x; 2B-like >= 1.7x synced, 1.39x", recorded) == [
        "doc: 1.20x",
        "doc: 1.39x",
    ]
