"""Find's trial of a candidate against the call find then decides, a diagnostic.

The suite's ``find_api_ms`` ran 1.16-1.31x immediate mode's call on rows where find,
timing its candidates inside the public call (roads/in_call.py), took another pick
(Qwen3-VL's backward-data: ``patch_implicit``, 0.136 ms a call against immediate's
0.104 with ``point_output``; H100 at a17f7c4). The suite records its candidates'
prepared runs called from a node, not find's trials, so what find timed is not known.
For each row this times, side by side in one interleaved run:

- ``immediate``: the public call in immediate mode;
- ``decided``: the public call in find mode once find has run (the suite's column);
- ``trial:<solver>``: each candidate's public call inside its trial, built as find
  builds it (in_call.public_calls), in find mode, in a second interleaved run (an open
  trial gives its solver to every call of the problem);

and lists the kernels one call of each launches and the dispatch log of find's run.
Where ``decided`` and the trial of its pick differ, their kernels say what the two
graphs run differently.

    PYTHONPATH=src python3 bench/probes/find_trial_gap.py [--rows qwen3vl:cf:bwd_data,...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import os
import tempfile

import torch

from gemmconv.bench.call_timing import DIRECTION_KINDS, find_selection, public_calls
from gemmconv.bench.kernel_count import launched_kernels
from gemmconv.bench.suite import DIRECTION_NAMES, LAYOUT_NAMES, SUITE, make_problem
from gemmconv.measuring.measure import operand_sets
from gemmconv.measuring.timing import time_interleaved
from gemmconv.roads import in_call
from gemmconv.selection import dispatch
from gemmconv.solvers import SOLVERS

# Backward-data rows whose public call in the suite ran 1.3-5.4x its solver's device
# time, where find's pick ran 1.3x immediate's call (Qwen3-VL) or its call ran well
# above the prepared run from a node (H100 at a17f7c4: SD3 cf `patch_implicit` 164 us
# against 116, DiT-XL/2 cf 189 against 109), and a weight gradient where find's pick
# ran 1.18x immediate's call.
ROWS = (
    "qwen3vl:cf:bwd_data",
    "sd3_patchify:cf:bwd_data",
    "dit_xl2:cf:bwd_data",
    "vit_b16:cf:bwd_weights",
)


def _captured_log() -> tuple[io.StringIO, logging.Handler]:
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    for name in ("gemmconv.find", "gemmconv.dispatch"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
    return text, handler


def _stacked(*makers):
    @contextlib.contextmanager
    def entered():
        with contextlib.ExitStack() as stack:
            for make in makers:
                stack.enter_context(make())
            yield

    return entered


def _timed(calls: dict, settings: dict, device: torch.device, reps: int) -> tuple[dict, dict]:
    """Median ms a call per name, interleaved (one round thrown away first, as the
    suite's columns do), and the kernels one call of each launches."""
    time_interleaved(calls, device, reps=1, warmup=2, settings=settings)
    timed = time_interleaved(calls, device, reps=reps, warmup=0, settings=settings)
    kernels = {}
    for name, made in calls.items():
        with settings.get(name, contextlib.nullcontext)():
            kernels[name] = launched_kernels(made[0], device)
    return {name: t.median_ms for name, t in timed.items()}, kernels


def probe_row(row: str, device: torch.device, reps: int, n: int | None = None) -> dict:
    case_name, layout_name, direction_name = row.split(":")
    case = next(c for c in SUITE if c.name == case_name)
    shape = case.full if n is None else dataclasses.replace(case.full, n=n)
    direction = DIRECTION_NAMES[direction_name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    p = make_problem(shape, LAYOUT_NAMES[layout_name], dtype, device, direction)
    kind = DIRECTION_KINDS[direction]
    operands = operand_sets(p, device, 0, every_operand=True)
    calls = {"immediate": public_calls(p, kind, operands)["gemmconv"]}
    settings = {}
    log_text, handler = _captured_log()
    with tempfile.TemporaryDirectory(prefix="gemmconv-find-") as folder:
        path = os.path.join(folder, "find.sqlite")

        def finding():
            return find_selection(path)

        with finding():
            for call in public_calls(p, kind, operands)["gemmconv"]:
                call()  # find runs here, as in the suite's column
            calls["decided"] = public_calls(p, kind, operands)["gemmconv"]
            picked = dispatch.decided(p)
        settings["decided"] = finding
        for logger in ("gemmconv.find", "gemmconv.dispatch"):
            logging.getLogger(logger).removeHandler(handler)
        # An open trial gives its solver to every call of the problem, so the trials
        # are timed in a run of their own, as find times them, after the two calls.
        times, kernels = _timed(calls, settings, device, reps)
        trial_calls, trial_settings = {}, {}
        with contextlib.ExitStack() as trials:
            tried = in_call.public_calls(p)
            for solver in SOLVERS:
                if tried is None or not solver.is_applicable(p):
                    continue
                try:
                    with finding():
                        made = trials.enter_context(tried(solver))
                except Exception as e:  # noqa: BLE001 - a candidate failing is a row
                    print(f"{row} trial:{solver.id} failed: {type(e).__name__}: {e}")
                    continue
                if made is not None:
                    name = f"trial:{solver.id}"
                    trial_calls[name] = made.calls
                    trial_settings[name] = _stacked(finding, made.resumed)
            trial_times, trial_kernels = _timed(trial_calls, trial_settings, device, reps)
    times.update(trial_times)
    kernels.update(trial_kernels)
    return {
        "row": row,
        "picked": None if picked is None else picked.solver,
        "ms": times,
        "kernels": kernels,
        "find_log": log_text.getvalue().splitlines(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--n", type=int, default=None, help="samples (default: the suite's)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="a JSON-lines file, one line a row")
    args = parser.parse_args()
    device = torch.device(args.device)
    for row in args.rows.split(","):
        result = probe_row(row, device, args.reps, args.n)
        print(f"== {row}: find picked {result['picked']}")
        for name, ms in sorted(result["ms"].items(), key=lambda item: item[1]):
            print(f"  {name:24s} {ms * 1000:8.1f} us  {result['kernels'].get(name)}")
        for line in result["find_log"]:
            print("  log:", line)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
