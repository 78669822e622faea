"""What batch invariance costs: the suite's forward rows timed with
``gemmconv.batch_invariant()`` on beside the default public call.

For a forward row, the public call of gemmconv (the same call and operands as the
suite's ``api_ms``: gemmconv.bench.call_timing) is timed twice in one interleaved run,
once in the default selection and once under the switch. The row gets:

- ``invariant_api_ms``: the call with the switch on;
- ``invariant_default_api_ms``: the default call, timed in the same run;
- ``invariance_cost``: their ratio (1.1: the invariant call takes 10% longer);
- ``invariant_solver``: the forward's solver under the switch, and ``invariant``:
  whether that forward is batch-invariant (False where gemmconv cannot make it so
  and runs the default's choice, e.g. fp64 on the CPU).

Backward rows get None in each: the switch changes the forward only.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from gemmconv.bench.call_timing import _interleaved_twice, public_calls
from gemmconv.core.invariance import batch_invariant
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.measuring.measure import operand_sets
from gemmconv.selection import dispatch

# The invariant call at most this much slower than the default one, on every row.
INVARIANCE_TARGET = 1.10

COLUMNS = (
    "invariant_api_ms",
    "invariant_default_api_ms",
    "invariance_cost",
    "invariant_solver",
    "invariant",
)


@contextlib.contextmanager
def quiet_batch_invariant() -> Iterator[None]:
    """gemmconv.batch_invariant(), its warning for a forward it cannot make invariant
    silenced: a benchmark times the call as it runs either way."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with batch_invariant():
            yield


def invariance_times(
    p: ConvProblem,
    device: torch.device | str,
    *,
    reps: int = 15,
    warmup: int = 2,
    seed: int = 0,
    block_ms: float | None = None,
) -> dict[str, float | str | bool | None]:
    """The invariance columns (COLUMNS) of the suite row of ``p``, on operands made from
    ``seed`` as the row's api columns are; None in each for a backward direction."""
    if p.direction is not Direction.FORWARD:
        return dict.fromkeys(COLUMNS)
    device = torch.device(device)
    operands = operand_sets(p, device, seed, every_operand=True)
    # A forward that cannot be made invariant says so in the row (``invariant``).
    with quiet_batch_invariant():
        invariant = public_calls(p, "fwd", operands)["gemmconv"]
        choice = dispatch.choose(p)
    calls = {"gemmconv": public_calls(p, "fwd", operands)["gemmconv"],
             "gemmconv_invariant": invariant}  # fmt: skip
    settings = {"gemmconv_invariant": quiet_batch_invariant}
    times = _interleaved_twice(calls, device, reps, warmup, block_ms, settings)
    default_ms = times["gemmconv"].median_ms
    invariant_ms = times["gemmconv_invariant"].median_ms
    return {
        "invariant_api_ms": invariant_ms,
        "invariant_default_api_ms": default_ms,
        "invariance_cost": invariant_ms / default_ms,
        "invariant_solver": choice.solver,
        "invariant": "NOT batch-invariant" not in choice.reason,
    }


def over_target(rows: list[dict]) -> list[str]:
    """The rows whose invariant call costs more than INVARIANCE_TARGET x the default's."""
    return [
        f"{r['case']} {r['layout']} {r['dtype']}"
        for r in rows
        if r.get("invariance_cost") is not None and r["invariance_cost"] > INVARIANCE_TARGET
    ]


def invariance_section(results: dict) -> list[str]:
    """The report's section on the invariance columns (markdown lines; none where no
    row has them)."""
    rows = [r for r in results["rows"] if r.get("invariance_cost") is not None]
    if not rows:
        return []
    lines = [
        "## What batch invariance costs (forward, the public call)",
        "",
        "gemmconv's public call with gemmconv.batch_invariant() on against the default "
        "call, timed in one interleaved run on the api columns' operands; 'cost' is "
        "their ratio; 'invariant' says whether the forward is batch-invariant.",
        "",
        "| case | layout | dtype | default ms | invariant ms | cost | solver | invariant |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['layout']} | {r['dtype']} | {r['invariant_default_api_ms']:.4f} "
            f"| {r['invariant_api_ms']:.4f} | {r['invariance_cost']:.2f} "
            f"| {r['invariant_solver']} | {'yes' if r['invariant'] else 'NO'} |"
        )
    late = over_target(rows)
    lines += [
        "",
        f"- rows over {INVARIANCE_TARGET} x the default call: {len(late)}"
        + (f" ({', '.join(late)})" if late else ""),
        "",
    ]
    return lines


__all__ = [
    "COLUMNS",
    "INVARIANCE_TARGET",
    "invariance_section",
    "invariance_times",
    "over_target",
    "quiet_batch_invariant",
]
