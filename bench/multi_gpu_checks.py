"""The checks of bench/multi_gpu.py, as pure functions of what the ranks gathered.

Each returns a dict with ``pass`` (bool), a one-line ``summary`` and the numbers it
judged, so the JSON shows why a check passed or failed. They are apart from the run so
that tests can show each one failing on data that must fail it.
"""

from __future__ import annotations

import math

# bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-8 of itself.
BF16_UNIT_ROUNDOFF = 2.0**-8
# The loss is computed in fp32 from bf16 logits, so a few roundings of the logits are
# the least two equally exact bf16 runs can differ by.
LOSS_FLOOR_ROUNDINGS = 4
# Two runs that compute the same patch embedding with a different summation order (the
# rewrite against torch) drift apart step by step; the converted model may drift at
# most this many times as far.
NOISE_MULTIPLE = 2.0
# A rank that waited for another rank's finds besides its own would add a whole find
# to its first step; the allowance stays well below one find.
FIND_SLACK_FRACTION = 0.25
FIND_SLACK_STEADY_STEPS = 2


def same_solvers(decisions_per_rank: list[list[dict]]) -> dict:
    """Every rank ends with the same solver for every problem any rank decided.

    ``decisions_per_rank[r]`` lists rank r's decisions as logged by gemmconv.selection.dispatch,
    each ``{"problem", "mode", "solver", "source", "during"}``, choices adopted by
    gemmconv.sync_choices() included; a problem's last decision on a rank is the one it
    runs. Before a sync, ranks that found on their own may differ: that is allowed."""
    finals = [{(d["problem"], d["mode"]): d for d in ranks} for ranks in decisions_per_rank]
    keys = list(dict.fromkeys(k for final in finals for k in final))
    rows, differing = [], set()
    for key in keys:
        per_rank = [final.get(key) for final in finals]
        solvers = [None if d is None else d["solver"] for d in per_rank]
        if len(set(solvers)) != 1:
            differing.update(r for r, s in enumerate(solvers) if s != solvers[0])
        first = next(d for d in per_rank if d is not None)
        rows.append(
            {
                "problem": first["problem"],
                "mode": first["mode"],
                "during": first["during"],
                "solvers": solvers,
                "sources": [None if d is None else d["source"] for d in per_rank],
            }
        )
    if not finals[0]:
        summary = "no gemmconv decision was logged on rank 0 (no converted variant ran?)"
    elif differing:
        summary = (
            f"rank(s) {sorted(differing)} end with other solvers than rank 0 "
            f"({[len(f) for f in finals]} problems per rank)"
        )
    else:
        summary = (
            f"{len(keys)} problems, the same solver on all {len(finals)} ranks "
            f"({sum(len(r) for r in decisions_per_rank)} decisions logged)"
        )
    return {
        "pass": bool(finals[0]) and not differing,
        "summary": summary,
        "decisions_per_rank": [len(r) for r in decisions_per_rank],
        "decisions": rows,
    }


def params_equal(digests: dict[str, list[str]], after_steps: int) -> dict:
    """Under DDP every rank holds bitwise the same parameters after ``after_steps``.

    ``digests`` maps a run ("ddp/torch", ...) to each rank's hash of its parameters."""
    unequal = [run for run, per_rank in digests.items() if len(set(per_rank)) != 1]
    if not digests:
        summary = "no DDP run to compare"
    elif unequal:
        summary = f"parameters differ across ranks after {after_steps} steps in {unequal}"
    else:
        summary = f"bitwise equal on every rank after {after_steps} steps in {len(digests)} runs"
    return {
        "pass": bool(digests) and not unequal,
        "summary": summary,
        "after_steps": after_steps,
        "sha256_per_rank": digests,
    }


def loss_curves(curves: dict[str, dict[str, list[float]]], converted: list[str]) -> dict:
    """Each converted variant's loss follows torch's within bf16 noise, per wrapper.

    ``curves[wrapper][variant]`` is the loss per step (mean over ranks). The noise is
    measured in the same run: the reshape + linear rewrite ("linear") computes the same
    patch embedding with another summation order, so its largest distance from torch's
    curve is how far two equally exact bf16 runs drift apart from this start. At every
    step the converted curve may be ``NOISE_MULTIPLE`` times that far from torch's, and
    never needs to be closer than ``LOSS_FLOOR_ROUNDINGS`` bf16 roundings of the loss."""
    comparisons = []
    for wrapper, by_variant in curves.items():
        reference = by_variant.get("torch")
        if reference is None:
            continue
        linear = by_variant.get("linear")
        noise = max(abs(a - b) for a, b in zip(linear, reference)) if linear is not None else 0.0
        for variant in converted:
            curve = by_variant.get(variant)
            if curve is None:
                continue
            comparisons.append(_compare_curve(wrapper, variant, curve, reference, noise))
    failed = [f"{c['wrapper']}/{c['variant']}" for c in comparisons if not c["pass"]]
    if not comparisons:
        summary = "no converted variant has a torch curve to compare with"
    elif failed:
        summary = f"outside bf16 noise: {failed}"
    else:
        worst = max(comparisons, key=lambda c: c["worst_ratio"])
        summary = (
            f"{len(comparisons)} curve(s) within bf16 noise; closest to the limit "
            f"{worst['wrapper']}/{worst['variant']} at {worst['worst_ratio']:.2f} of it"
        )
    return {
        "pass": bool(comparisons) and not failed,
        "summary": summary,
        "tolerance": (
            f"per step: max({NOISE_MULTIPLE:g} x the largest |linear - torch| over the "
            f"curve, {LOSS_FLOOR_ROUNDINGS} x 2^-8 x |torch loss|)"
        ),
        "comparisons": comparisons,
    }


def _compare_curve(
    wrapper: str, variant: str, curve: list[float], reference: list[float], noise: float
) -> dict:
    floor = LOSS_FLOOR_ROUNDINGS * BF16_UNIT_ROUNDOFF
    diffs = [abs(a - b) for a, b in zip(curve, reference)]
    allowed = [max(NOISE_MULTIPLE * noise, floor * abs(t)) for t in reference]
    ratios = [d / a if a > 0 else math.inf for d, a in zip(diffs, allowed)]
    finite = all(math.isfinite(v) for v in (*curve, *reference))
    worst = max(range(len(ratios)), key=ratios.__getitem__) if ratios else 0
    ok = finite and len(curve) == len(reference) > 0 and all(d <= a for d, a in zip(diffs, allowed))
    return {
        "wrapper": wrapper,
        "variant": variant,
        "pass": ok,
        "steps": len(curve),
        "max_abs_diff": max(diffs) if diffs else None,
        "linear_max_abs_diff": noise,
        "worst_step": worst + 1,
        "worst_ratio": ratios[worst] if ratios else math.inf,
        "allowed_at_worst_step": allowed[worst] if allowed else None,
    }


def find_not_blocking(first_steps: list[dict]) -> dict:
    """With find on and an empty database, every rank finds for itself (no convolution
    waits for another rank), no rank's first step outlasts the cheapest rank's by more
    than a fraction of a find, and once the finds are stored the ranks, reading one
    shared database, run the same solvers.

    ``first_steps[r]`` holds rank r's phases, each ``{"seconds", "sources", "solvers"}``:
    "find" (empty database, choice cache cleared), "database" (cache cleared again,
    every rank's results now stored) and "steady" (nothing cleared). A rank's find cost
    is its "find" step minus its "database" step."""
    extra = [r["find"]["seconds"] - r["database"]["seconds"] for r in first_steps]
    steady = max(r["steady"]["seconds"] for r in first_steps)
    cheapest = max(min(extra), 0.0)
    slack = FIND_SLACK_FRACTION * cheapest + FIND_SLACK_STEADY_STEPS * steady
    problems = []
    for rank, phases in enumerate(first_steps):
        sources = phases["find"]["sources"]
        if not sources or any(s != "find" for s in sources):
            problems.append(f"rank {rank}'s decisions came from {sources}, expected a find each")
        stored = phases["database"]["sources"]
        if not stored or any(s != "database" for s in stored):
            problems.append(f"rank {rank} took {stored} after the finds, expected the database")
    solvers = [r["database"].get("solvers") for r in first_steps]
    if any(s != solvers[0] for s in solvers):
        problems.append(f"the ranks read different solvers from the shared database: {solvers}")
    late = [r for r, e in enumerate(extra) if e > cheapest + slack]
    if late:
        problems.append(
            f"rank(s) {late} paid more than the cheapest rank's find ({cheapest:.3f} s) "
            f"+ {slack:.3f} s"
        )
    times = " / ".join(f"{r['find']['seconds']:.3f}" for r in first_steps)
    if problems:
        summary = "; ".join(problems)
    else:
        summary = (
            f"time to first step per rank {times} s; every rank ran its own "
            f"{len(first_steps[0]['find']['sources'])} find(s), costing "
            f"{min(extra):.3f}-{max(extra):.3f} s (bound {cheapest + slack:.3f} s), and "
            "then read the same solvers from the shared database"
        )
    return {
        "pass": not problems,
        "summary": summary,
        "first_step_s": {
            phase: [r[phase]["seconds"] for r in first_steps]
            for phase in ("find", "database", "steady")
        },
        "sources": {
            phase: [r[phase]["sources"] for r in first_steps] for phase in ("find", "database")
        },
        "find_cost_s": extra,
        "bound_s": cheapest + slack,
        "bound": (
            f"each rank's find cost <= the cheapest rank's x {1 + FIND_SLACK_FRACTION:g} + "
            f"{FIND_SLACK_STEADY_STEPS} x the slowest steady step"
        ),
    }
