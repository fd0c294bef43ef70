"""Which patched forward goes wrong when dynamo traces it: one Qwen3.5 mini model, every op eager, compiled with
each patched module class in turn kept outside dynamo (the rest traced: a class kept out runs its whole call,
inner modules included, eagerly), and with every class traced under each backend (``eager``: dynamo alone;
``aot_eager``: plus AOTAutograd; ``inductor``).

On the CPU, ``aot_eager`` fails in the backward (``view size is not compatible with input tensor's size and
stride``) for transformers' own Qwen3.5 model too: AOTAutograd's recorded strides for ``softplus_backward`` of
the decay gate differ from the ones the CPU kernel gives (torch 2.13).

On the H200 the whole traced model was 0.127 off in its logits against the fp32 model, where the uncompiled one
is 0.016 off (tests/gpu/test_models.py, 2026-12-03); on the CPU the same trace matches. ``apply`` therefore lets
dynamo trace patched forwards on the CPU only (``TRACED_DEVICES``). This names the class and the stage where the
result changes, so the trace can be allowed where it is right. Its run on the H200 (docs/benchmarks.md,
2026-12-03): transformers' own model traced is as wrong, and its rotary embedding alone, compiled by inductor,
gives tables up to 2 off; every other class traced matches.

    python benchmarks/studies/trace_check.py --device cuda --json-out trace.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))  # this file is benchmarks/studies/trace_check.py
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]


def outputs(model, ids, patched: bool = True) -> dict[str, torch.Tensor]:
    """Logits and every parameter gradient (fp32 copies) of one training call, named without dynamo's prefix."""
    model.zero_grad(set_to_none=True)
    extra = {"return_logits": True} if patched else {}  # fusepatch's loss returns logits only when asked
    out = model(input_ids=ids, labels=ids, use_cache=False, **extra)
    out.loss.backward()
    found = {"logits": out.logits.float()}
    for name, param in model.named_parameters():
        if param.grad is not None:
            found[name.removeprefix("_orig_mod.")] = param.grad.float()
    return found


def errors(got: dict, want: dict) -> dict[str, float]:
    from fusepatch.ops.common import relative_error

    return {name: relative_error(got[name], value) for name, value in want.items() if name in got}


def rotary_alone(base, ids, device: str) -> str:
    """transformers' rotary embedding of the model (not patched) alone, eager against inductor, given the position
    ids its text model gives it (2-D positions expanded to the three mrope sections)."""
    rotary = copy.deepcopy(base.model.rotary_emb).to(device)
    x = torch.zeros(1, device=device, dtype=torch.bfloat16)
    plain = torch.arange(ids.shape[1], device=device).view(1, 1, -1).expand(4, ids.shape[0], -1)[1:]
    torch._dynamo.reset()
    want = rotary(x, plain)
    got = torch.compile(rotary, backend="inductor")(x, plain)
    offs = [(g.float() - w.float()).abs().max().item() for g, w in zip(got, want)]
    return f"rotary embedding alone ({device}, bf16 tables), inductor against eager: cos {offs[0]:.3g}, sin {offs[1]:.3g} (largest absolute difference)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq", type=int, default=301)
    parser.add_argument("--json-out")
    args = parser.parse_args()

    from helpers import MINI  # the GPU tests' mini model, so that fla's kernels compile for the same sizes

    import fusepatch
    from fusepatch.ops import OPS
    from fusepatch.tools.tiny import tiny_model

    torch.manual_seed(0)
    base = tiny_model("qwen3_5_text", **MINI)
    ids = torch.randint(0, base.config.vocab_size, (2, args.seq), device=args.device)
    reference = copy.deepcopy(base).to(args.device)
    fusepatch.apply(reference, exclude=list(OPS), verbose=False)
    want = outputs(reference, ids)
    model = copy.deepcopy(base).to(args.device, torch.bfloat16)
    fusepatch.apply(model, exclude=list(OPS), verbose=False)
    plain = errors(outputs(model, ids), want)
    states = {m: m._fusepatch for m in model.modules() if hasattr(m, "_fusepatch")}
    classes = sorted({type(m).__name__ for m in states})

    def traced(backend: str, kept_out: str | None) -> dict[str, float] | str:
        """The errors of one traced training call, or why it failed (a trace may raise where another is wrong)."""
        torch._dynamo.reset()
        for module, state in states.items():
            state.traceable_on = None if type(module).__name__ == kept_out else args.device
        try:
            return errors(outputs(torch.compile(model, backend=backend), ids), want)
        except Exception as exc:  # reported in its row: the other rows still tell where the result changes
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        finally:
            for state in states.values():
                state.traceable_on = None

    rows = {"uncompiled": plain}
    # transformers' own model, not patched: whether its trace is right on this device
    unpatched = copy.deepcopy(base).to(args.device, torch.bfloat16)
    rows["transformers' model (not patched), uncompiled"] = errors(outputs(unpatched, ids, patched=False), want)
    torch._dynamo.reset()
    try:
        found = errors(outputs(torch.compile(unpatched, backend="inductor"), ids, patched=False), want)
    except Exception as exc:
        found = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    rows["transformers' model (not patched), inductor"] = found
    rotary = rotary_alone(base, ids, args.device)
    print(rotary)
    for backend in ("eager", "aot_eager", "inductor"):
        rows[f"all classes, {backend}"] = traced(backend, None)
    for name in classes:
        rows[f"all but {name}, inductor"] = traced("inductor", name)
    keys = ["logits"] + sorted(k for k in want if k != "logits")
    print(f"relative error against the fp32 model ({args.device}, bf16, every op eager); worst parameter gradient")
    print("| traced | logits | worst gradient | its parameter | > 1.25x uncompiled + 1e-3 |")
    print("|---|---:|---:|---|---:|")
    for label, found in rows.items():
        if isinstance(found, str):
            print(f"| {label} | fails: {found} | | | |")
            continue
        worst = max((k for k in keys[1:]), key=lambda k: found[k] / max(plain[k], 1e-6))
        beyond = sum(found[k] > 1.25 * plain[k] + 1e-3 for k in keys)
        print(f"| {label} | {found['logits']:.4f} | {found[worst]:.4f} | {worst} | {beyond} |")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(
                {"device": args.device, "torch": torch.__version__, "rotary_alone": rotary, "rows": rows}, fh, indent=1
            )


if __name__ == "__main__":
    main()
