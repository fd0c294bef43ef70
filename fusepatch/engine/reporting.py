"""PatchReport: what runs fused, what fell back and why, as a table, a dict and log lines."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from fusepatch.engine.resolve import Choice, reasons_and_fixes


@dataclass(frozen=True)
class LayerReport:
    """One layer class of the model: how many instances, and the choice for each op."""

    layer: str
    count: int
    patched: bool
    choices: tuple[Choice, ...]
    note: str = ""

    def fallbacks(self) -> list[Choice]:
        return [c for c in self.choices if not c.fused]

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "count": self.count,
            "patched": self.patched,
            "ops": [c.to_dict() for c in self.choices],
            "note": self.note,
        }


@dataclass(frozen=True)
class PatchReport:
    """The outcome of ``fusepatch.apply`` (or ``fusepatch.report``) for one model.

    ``str(report)`` is a short aligned table; ``report.to_dict()`` is JSON-serialisable;
    ``report.log_lines()`` gives one line per fallback.
    """

    model: str
    model_types: tuple[str, ...]
    device: str
    dtype: str
    layers: tuple[LayerReport, ...] = ()
    message: str = ""  # why nothing was patched (unknown model, disabled), or that nothing changed
    newly_patched: int = 0
    already_patched: int = 0
    environment: dict = field(default_factory=dict)
    drift: tuple[str, ...] = ()  # a foreign package lacking a name fusepatch uses, and what ran instead
    lora: dict = field(default_factory=dict)  # peft LoRA linears: count, fusable, the others by reason
    # calls a patched layer handed to transformers' own forward, and why: "Qwen3_5GatedDeltaNet: 2 calls: <reason>"
    transformers_calls: tuple[str, ...] = ()
    # frozen projections whose weight apply(drop_frozen_weights=True) dropped (only the precision's copy left)
    dropped_weights: int = 0
    # what a feature of apply says of the model beyond the kernels (``Feature.report``), one line each
    notes: tuple[str, ...] = ()
    # how the fused paths meet a sharding engine: DeepSpeed ZeRO-3 detected, and what its patched modules gather;
    # where a feature keeps what it prepared of sharded weights
    sharding: tuple[str, ...] = ()

    @property
    def patched(self) -> int:
        return self.newly_patched + self.already_patched

    @property
    def fused_ops(self) -> list[tuple[str, Choice]]:
        return [(layer.layer, c) for layer in self.layers for c in layer.choices if c.fused]

    def fallbacks(self) -> list[tuple[LayerReport, Choice]]:
        return [(layer, c) for layer in self.layers for c in layer.fallbacks()]

    def log_lines(self) -> list[str]:
        """``fusepatch: Qwen3_5GatedDeltaNet x3: gated_delta_rule -> eager (fla: ...; fix: ...)``"""
        lines = []
        for layer, choice in self.fallbacks():
            fixes = "; ".join(choice.fixes())
            fix = f"; fix: {fixes}" if fixes else ""
            lines.append(f"fusepatch: {layer.layer} x{layer.count}: {choice.op} -> eager ({choice.reason_text()}{fix})")
        return lines

    def totals(self) -> str:
        """``fusepatch: Qwen3_5ForCausalLM on cuda/bfloat16: 64 modules patched, 12 ops fused, 2 fell back``"""
        where = f"{self.model} on {self.device}/{self.dtype}"
        if self.message and not self.layers:
            return f"fusepatch: {where}: {self.message}"
        ops = sum(len(layer.choices) for layer in self.layers)
        text = f"fusepatch: {where}: {self.patched} modules patched, {len(self.fused_ops)} of {ops} ops fused"
        falls = len(self.fallbacks())
        text += f", {falls} fell back to eager" if falls else ""
        return text + (f" ({self.message})" if self.message else "")

    def lora_lines(self) -> list[str]:
        """``fusepatch: 112 of 112 peft LoRA linears fusable ...``; each reason others are not, with its count."""
        if not self.lora.get("linears"):
            return []
        lines = [
            f"fusepatch: {self.lora['fusable']} of {self.lora['linears']} peft LoRA linears can run fused with "
            "their base GEMM where fusepatch's layers call them"
        ]
        lines += [f"fusepatch: x{count}: {line}" for line, count in self.lora.get("unfused", {}).items()]
        return lines

    def fallback_reasons(self) -> list[tuple[str, str]]:
        """(reason, its line) for each distinct reason: the line names the ops it keeps on eager and its fix (a CPU
        machine's one reason is one line, not one per op and candidate)."""
        lines = []
        for reason, (ops, fixes) in reasons_and_fixes(c for _, c in self.fallbacks()).items():
            fix = f"; fix: {'; '.join(fixes)}" if fixes else ""
            lines.append((reason, f"fusepatch: eager for {', '.join(ops)}: {reason}{fix}"))
        return lines

    def grouped_fallbacks(self) -> list[str]:
        """Each distinct reason's line (:meth:`fallback_reasons`)."""
        return [line for _, line in self.fallback_reasons()]

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "model_types": list(self.model_types),
            "device": self.device,
            "dtype": self.dtype,
            "message": self.message,
            "patched_modules": self.patched,
            "newly_patched": self.newly_patched,
            "already_patched": self.already_patched,
            "layers": [layer.to_dict() for layer in self.layers],
            "fallbacks": self.log_lines(),
            "drift": list(self.drift),
            "lora": self.lora,
            "transformers_calls": list(self.transformers_calls),
            "dropped_weights": self.dropped_weights,
            "sharding": list(self.sharding),
            "environment": self.environment,
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        head = f"fusepatch: {self.model} ({', '.join(self.model_types) or '?'}) on {self.device}/{self.dtype}"
        lines = [head]
        if self.message:
            lines.append(f"  {self.message}")
        rows = []
        for layer in self.layers:
            label = f"{layer.layer} x{layer.count}"
            for choice in layer.choices:
                kernel = f"{choice.chosen} ({choice.origin or choice.source})" if choice.fused else "eager"
                if choice.fused and choice.compiled:
                    kernel += f" [compiled {choice.ready_s:.0f} s]"
                why = ""
                if not choice.fused and choice.rejected:
                    first = choice.primary_rejection()
                    why = f"{first.candidate}: {first.reason}"
                rows.append((label, choice.op, kernel, why))
                label = ""
            if label and layer.patched:  # a forward with no kernel op (the rotary tables): say what it does
                rows.append((label, "-", "patched", layer.note))
        if rows:
            widths = [max(len(r[i]) for r in rows + [("layer", "op", "kernel", "")]) for i in range(3)]
            lines.append(
                "  " + "  ".join(h.ljust(w) for h, w in zip(("layer", "op", "kernel"), widths)) + "  why not fused"
            )
            for r in rows:
                lines.append(
                    "  " + "  ".join(v.ljust(w) for v, w in zip(r[:3], widths)) + ("  " + r[3] if r[3] else "")
                )
        fused = len(self.fused_ops)
        falls = len(self.fallbacks())
        lines.append(f"  {self.patched} modules patched, {fused} ops fused, {falls} fell back to eager")
        fixes: list[str] = []
        for _, choice in self.fallbacks():
            fixes += [f for f in choice.fixes() if f not in fixes]
        for fix in fixes:  # every distinct fix: a dropped one would leave an op on eager with no way out shown
            lines.append(f"  fix: {fix}")
        for line in self.drift:
            lines.append(f"  drift: {line}")
        for line in self.transformers_calls:
            lines.append(f"  transformers' forward: {line}")
        for line in self.sharding:
            lines.append(f"  {line}")
        for line in self.notes:
            lines.append(f"  {line}")
        compiled = sum(c.ready_s for _, c in self.fused_ops if c.compiled)
        if compiled:
            lines.append(
                f"  {compiled:.0f} s went into compiling/autotuning kernels on first use; `python -m fusepatch warmup` "
                "fills those caches ahead (e.g. when a container image is built)"
            )
        return "\n".join(lines)
