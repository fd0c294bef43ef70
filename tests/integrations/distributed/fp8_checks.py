"""What the FP8 cases of ``fsdp2_cases.py`` must show (FSDP2 keeping LoRA's FP8 bases sharded), shared by the CPU
launch (tests/integrations/test_fsdp2.py) and the two-GPU one (tests/gpu/test_fp8_fsdp2.py)."""

from __future__ import annotations

# FP8 against unpatched, this tiny bf16 model's two SGD steps: the loss (measured 9.2e-4) and every LoRA gradient
# as one vector (measured 0.111, 0.074), relative
FP8_LOSS, FP8_GRADS = 1e-2, 0.2


def fp8_problems(name: str, world: int, case: dict, exact: bool = True) -> list[str]:
    """FSDP2 keeping FP8 bases sharded (world size 2): each rank's loss and every LoRA gradient, both steps, are the
    unsharded model's patched alike, bit for bit (the per-row arithmetic is the same, and the reduction adds the
    same two terms), and the unpatched model's within FP8's error (``keep``); rewrites of the bases seen (``keep``)
    or refused (``drop``); the report says so; each rank holds its rows' FP8 copies between steps (a 1/world share
    of the whole copies, exactly) and at every FP8 call at most that plus one decoder layer's gathered copies; and
    ``revert`` gives the bases back as the unsharded model's revert does. Not ``exact`` (the GPU's kernels, whose
    run-to-run order may differ): the losses within ``1e-3`` and the gradients within ``2e-2``, relative."""
    problems = []
    sharded, patched = case["losses"]["sharded"], case["losses"]["patched"]
    for step in range(2):
        off = max(abs(a - b) / abs(b) for a, b in zip(sharded[step], patched[step]))
        if sharded[step] != patched[step] if exact else off > 1e-3:
            problems.append(f"{name}: step {step} losses {sharded[step]} != unsharded patched {patched[step]}")
        grads = case["grads"]["patched"][step]
        if not ((grads["equal"] if exact else grads["total"] < 2e-2) and grads["count"] > 0):
            problems.append(f"{name}: step {step} gradients differ from the unsharded patched model's: {grads}")
        if "unpatched" not in case["grads"]:
            continue
        plain, unpatched = case["losses"]["unpatched"][step], case["grads"]["unpatched"][step]
        off = max(abs(a - b) / abs(b) for a, b in zip(sharded[step], plain))
        if not (off < FP8_LOSS and unpatched["total"] < FP8_GRADS and unpatched["count"] == grads["count"]):
            problems.append(f"{name}: step {step} off the unpatched model by more than FP8's: {off:.3g}, {unpatched}")
    bases = case["bases"]
    if case["rewrites_refused"] != (2 * bases if name.endswith("drop") else 0):
        problems.append(f"{name}: {case['rewrites_refused']} of {bases} x 2 rewrites of the bases refused")
    if "dora" in name:
        said, said_kept = f"FSDP2: {bases} frozen FP8 projections quantize the weight FSDP2 gathered", "are DoRA"
    else:
        said = f"FSDP2: {bases} frozen FP8 projections keep their FP8 copy sharded"
        said_kept = f"{bases} so far, {bases if name.endswith('drop') else 0} of them without their bf16 rows"
    if not any(said in line and said_kept in line for line in case["sharding"]):
        problems.append(f"{name}: the report does not say {said!r} ... {said_kept!r}: {case['sharding']}")
    if not (case["reverted_equal"] and (case["reverted_loss_equal"] or not exact)):
        problems.append(f"{name}: reverted, the bases or the loss differ from the unsharded model's reverted")
    share = 0 if "dora" in name else case["whole"] // world  # DoRA's bases: nothing kept
    for rank, held in enumerate(case["ranks"]):
        for step, between in enumerate(held["between"]):
            if between != {"kept": share, "gathered": 0}:
                problems.append(f"{name}: rank {rank} holds {between} after step {step}, not {share} bytes kept")
        if not (held["calls"] > 0 and held["peak"] <= share + (0 if "dora" in name else case["layer_most"])):
            problems.append(
                f"{name}: rank {rank} held {held['peak']} bytes of FP8 copies at an FP8 call, more than its share "
                f"{share} of {case['whole']} plus one layer's {case['layer_most']} ({held['calls']} calls)"
            )
    return problems
