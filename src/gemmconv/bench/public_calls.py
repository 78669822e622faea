"""The public-call table (`gemmconv bench --api`): what a user pays per call, same run.

For each problem and kind of call (forward, forward+backward, weight-gradient only),
torch's F.conv*, the reshape + F.linear rewrite and gemmconv's public call are timed
side by side as gemmconv.bench.call_timing describes (back-to-back calls, no head start,
interleaved, median), with gemmconv's default selection. Ratios are torch_ms /
gemmconv_ms and linear_ms / gemmconv_ms: above 1 gemmconv is faster. The default
selection is the CPU table (ViT-B/16 at batch 8, the point problem at 950,
Qwen2-VL's Conv3d at 2048 patches, a ResNet 1x1, SD3's latent patchify at 512px,
ConvNeXt's downsample at batch 4); ``--quick`` runs tiny versions of the same problems
for the tests.

    gemmconv bench --api --device cpu     # writes gemmconv-bench/cpu.json and cpu.md
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gemmconv.bench.call_timing import (
    CALL_KINDS,
    find_selection,
    linear_applies,
    public_calls,
    solvers_of,
)
from gemmconv.bench.host_probe import cpu_model, host_fields, host_lines
from gemmconv.bench.invariance_cost import quiet_batch_invariant
from gemmconv.bench.report import check_status, default_stem, targets_line
from gemmconv.bench.suite import (
    DTYPES,
    LAYOUT_NAMES,
    Shape,
    bench_device,
    environment,
    make_problem,
    quick_name,
    select_named,
)
from gemmconv.core.problem import Direction
from gemmconv.measuring.measure import operand_sets
from gemmconv.measuring.timing import time_interleaved
from gemmconv.measuring.verify import rms_range, tolerance
from gemmconv.terminal.usage import Parser, UsageError, int64, reports_usage_errors

KIND_TITLES = {
    "fwd": "forward",
    "bwd_data": "input-gradient only",
    "bwd_weights": "weight-gradient only",
    "fwd_bwd": "forward+backward",
    "fwd_wgrad": "forward+weight-gradient",
}
DEFAULT_KINDS = ("fwd", "fwd_bwd", "bwd_weights")
# The CPU target: every row at least this fast as torch and as the rewrite.
NOT_SLOWER = 0.95
# Implementations agree when their results are within this many of the dtype's
# tolerances of torch's (each differs from the exact result by up to one tolerance).
AGREEMENT = 2.0


@dataclasses.dataclass(frozen=True)
class ApiCase:
    name: str
    title: str
    full: Shape
    tiny: Shape
    bias: bool

    def shown_name(self, quick: bool) -> str:
        """The name its rows carry: in a quick run, the tiny batch it runs (tiny_...)."""
        return quick_name(self.name, self.full.n, self.tiny.n) if quick else self.name


def shape_text(shape: Shape) -> str:
    """'8x3x224x224 -> 768, k=s=16' (stride == kernel in every case)."""
    sizes = "x".join(str(v) for v in (shape.n, shape.c, *shape.spatial))
    kernel = shape.kernel if len(set(shape.kernel)) > 1 else shape.kernel[:1]
    return f"{sizes} -> {shape.k}, k=s={'x'.join(str(r) for r in kernel)}"


API_CASES: tuple[ApiCase, ...] = (
    ApiCase("vit_b16_b8", "ViT-B/16 patch embed",
            Shape(8, 3, 768, (224, 224), (16, 16)), Shape(2, 3, 16, (32, 32), (16, 16)), True),
    ApiCase("point2d_950", "point (one patch per sample)",
            Shape(950, 3, 1280, (14, 14), (14, 14)), Shape(8, 3, 16, (14, 14), (14, 14)), False),
    ApiCase("qwen2vl_2048", "Qwen2-VL Conv3d",
            Shape(2048, 3, 1280, (2, 14, 14), (2, 14, 14)),
            Shape(8, 3, 16, (2, 14, 14), (2, 14, 14)), False),
    ApiCase("resnet_1x1_b8", "ResNet 1x1",
            Shape(8, 256, 64, (56, 56), (1, 1)), Shape(2, 16, 8, (6, 5), (1, 1)), False),
    # Patches of fewer than 16 taps, where the CPU's oneDNN beats the GEMM with its
    # gather: SD3's latent patchify at a 512px image, ConvNeXt's downsample at batch 4.
    ApiCase("sd3_512", "SD3 latent patchify",
            Shape(1, 16, 1536, (64, 64), (2, 2)), Shape(1, 16, 8, (4, 4), (2, 2)), True),
    ApiCase("convnext_down_b4", "ConvNeXt downsample",
            Shape(4, 192, 384, (56, 56), (2, 2)), Shape(1, 8, 8, (4, 4), (2, 2)), True),
)  # fmt: skip


def api_cases(names: Sequence[str] | None = None, quick: bool = False) -> list[ApiCase]:
    """The cases called ``names``; a quick run knows each by its quick name too."""
    if quick and names:
        full = {c.shown_name(True): c.name for c in API_CASES}
        names = [full.get(n, n) for n in names]
    return select_named(API_CASES, names, "cases")


def run_row(
    case: ApiCase,
    layout_name: str,
    kind: str,
    dtype_key: str,
    device: torch.device,
    quick: bool,
    reps: int,
    seed: int,
) -> dict:
    shape = case.tiny if quick else case.full
    p = make_problem(shape, LAYOUT_NAMES[layout_name], DTYPES[dtype_key], device, Direction.FORWARD)
    p = dataclasses.replace(p, has_bias=case.bias)
    operands = operand_sets(p, device, seed, every_operand=True)
    calls = public_calls(p, kind, operands)
    disagreement = disagreement_with_torch(calls)
    # gemmconv in find mode beside its default selection, its finds in a database of
    # their own (call_timing.find_selection): the call after find has run.
    with tempfile.TemporaryDirectory(prefix="gemmconv-find-") as folder:
        path = os.path.join(folder, "find.sqlite")

        def finding():
            return find_selection(path)

        with finding():
            calls["gemmconv_find"] = public_calls(p, kind, operands)["gemmconv"]
        settings = {"gemmconv_find": finding}
        if kind == "fwd":
            # The switch changes the forward only: its cost beside the default call.
            with quiet_batch_invariant():
                calls["gemmconv_invariant"] = public_calls(p, kind, operands)["gemmconv"]
            settings["gemmconv_invariant"] = quiet_batch_invariant
        times = time_interleaved(calls, device, reps=reps, settings=settings)
    invariant_ms = times["gemmconv_invariant"].median_ms if kind == "fwd" else None
    row = {
        "case": case.shown_name(quick),
        "title": case.title,
        "kind": kind,
        "layout": layout_name,
        "dtype": dtype_key,
        "shape": dataclasses.asdict(shape),
        "bias": case.bias,
        "torch_ms": times["torch"].median_ms,
        "linear_ms": times["linear"].median_ms if "linear" in times else None,
        "gemmconv_ms": times["gemmconv"].median_ms,
        "find_ms": times["gemmconv_find"].median_ms,
        "invariant_ms": invariant_ms,
        "invariance_cost": None
        if invariant_ms is None
        else invariant_ms / times["gemmconv"].median_ms,
        "reps": reps,
        "solvers": solvers_of(p, operands[0]),
        "rms_vs_torch": disagreement,
        "agrees": all(
            e <= AGREEMENT * tolerance(p.dtype, device.type) for e in disagreement.values()
        ),
    }
    row["speedup_vs_torch"] = row["torch_ms"] / row["gemmconv_ms"]
    row["speedup_vs_linear"] = row["linear_ms"] / row["gemmconv_ms"] if linear_applies(p) else None
    return row


def disagreement_with_torch(calls: dict[str, Sequence[Callable[[], object]]]) -> dict[str, float]:
    """Per implementation other than torch, the largest rms_range between each result
    of its first call and torch's (a check that every timed call computes the same
    thing, not a verification: the suite and the tests verify against float64)."""
    results = {name: _tensors(fns[0]()) for name, fns in calls.items()}
    expected = results.pop("torch")
    return {
        name: max(rms_range(got, want) for got, want in zip(tensors, expected, strict=True))
        for name, tensors in results.items()
    }


def _tensors(result: object) -> tuple[torch.Tensor, ...]:
    return (result,) if isinstance(result, torch.Tensor) else tuple(result)


def run(
    cases: Sequence[ApiCase],
    kinds: Sequence[str],
    layouts: Sequence[str],
    dtype_key: str,
    device: torch.device,
    quick: bool,
    reps: int,
    machine: str,
    log: Callable[[str], None] = print,
    on_row: Callable[[dict], None] | None = None,
) -> dict:
    started = time.time()
    results = {
        **environment(device),
        **host_fields(device, quick),
        "machine": machine,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "quick": quick,
        "timing": "back-to-back public calls, no head start, implementations interleaved, "
        f"median of {reps} repetitions",
        "rows": [],
        "errors": [],
    }
    seed = 0
    for case in cases:
        for layout_name in layouts:
            for kind in kinds:
                seed += 100
                label = f"{case.shown_name(quick)}/{layout_name}/{kind}"
                try:
                    row = run_row(case, layout_name, kind, dtype_key, device, quick, reps, seed)
                except Exception as exc:  # one failing row must not lose the others
                    results["errors"].append(f"{label}: {type(exc).__name__}: {exc}"[:500])
                    log(f"{label}: FAILED: {type(exc).__name__}: {exc}")
                    continue
                results["rows"].append(row)
                results["seconds"] = time.time() - started
                log(_row_line(row))
                if on_row is not None:
                    on_row(results)
    results["seconds"] = time.time() - started
    return results


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _cost(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _row_line(r: dict) -> str:
    return (
        f"{r['case']:>14} {r['layout']} {r['kind']:<11} torch {_ms(r['torch_ms'])} "
        f"linear {_ms(r['linear_ms'])} gemmconv {_ms(r['gemmconv_ms'])} "
        f"x torch {_ratio(r['speedup_vs_torch'])} x linear {_ratio(r['speedup_vs_linear'])}"
    )


def _solver_text(r: dict) -> str:
    s = r["solvers"]
    if r["kind"] == "fwd":
        return s["forward"]
    if r["kind"] == "bwd_weights":
        return s["backward_weights"]
    if r["kind"] == "bwd_data":
        return s["backward_data"]
    if r["kind"] == "fwd_wgrad":
        return f"{s['forward']} / {s['backward_weights']}"
    return f"{s['forward']} / {s['backward_data']} / {s['backward_weights']}"


def slower_rows(results: dict) -> list[str]:
    """Rows under NOT_SLOWER x torch or x the rewrite (the CPU target)."""
    return [
        f"{r['case']}/{r['layout']}/{r['kind']}"
        for r in results["rows"]
        if r["speedup_vs_torch"] < NOT_SLOWER
        or (r["speedup_vs_linear"] is not None and r["speedup_vs_linear"] < NOT_SLOWER)
    ]


def markdown(results: dict) -> str:
    quick = " — QUICK (tiny shapes, not a measurement)" if results["quick"] else ""
    lines = [
        f"# What users pay per call: {results['device']} ({results['machine']}){quick}",
        "",
        f"torch {results['torch']}, triton {results['triton']}, gemmconv "
        f"{results['gemmconv']}"
        + (f", {results['threads']} threads" if results["threads"] else ""),
        "",
        *host_lines(results),
        f"Wall clock of the public call in ms ({results['timing']}): torch's F.conv*, the "
        "reshape + F.linear rewrite (gradients through autograd) and gemmconv.conv*, "
        "default selection. 'x torch' = torch ms / gemmconv ms and 'x linear' = linear ms / "
        "gemmconv ms: above 1 gemmconv is faster. Solver: forward / backward-data / "
        "backward-weights as they apply to the row. 'find ms': gemmconv's call in find "
        "mode, after find has run. 'invariant': a forward's call under "
        "gemmconv.batch_invariant() over the default call (— for other calls).",
        "",
        "| problem | layout | call | torch ms | linear ms | gemmconv ms | x torch | x linear "
        "| solver | find ms | invariant |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['title']}, {shape_text(Shape(**r['shape']))} | {r['layout']} "
            f"| {KIND_TITLES[r['kind']]} | {_ms(r['torch_ms'])} "
            f"| {_ms(r['linear_ms'])} | {_ms(r['gemmconv_ms'])} "
            f"| {_ratio(r['speedup_vs_torch'])} | {_ratio(r['speedup_vs_linear'])} "
            f"| {_solver_text(r)} | {_ms(r.get('find_ms'))} "
            f"| {_cost(r.get('invariance_cost'))} |"
        )
    slower = slower_rows(results)
    lines += [
        "",
        f"Target: every row >= {NOT_SLOWER} x torch and >= {NOT_SLOWER} x linear. "
        f"Rows below it: {len(slower)} of {len(results['rows'])}"
        + (f" ({', '.join(slower)})" if slower else ""),
    ]
    disagree = [
        f"{r['case']}/{r['layout']}/{r['kind']}" for r in results["rows"] if not r["agrees"]
    ]
    if disagree:
        lines.append(f"- RESULTS DISAGREE with torch's: {', '.join(disagree)}")
    lines += [f"- ROW FAILED: {e}" for e in results["errors"]]
    return "\n".join(lines) + "\n"


def write(results: dict, out_dir: str | Path, stem: str) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(markdown(results))
    return paths


def machine_label(device: torch.device) -> str:
    """'2-core CPU, <model name>' on the CPU, the GPU's name on CUDA."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()}-core CPU, {cpu_model()}"


def _parser() -> Parser:
    ap = Parser(prog="gemmconv bench --api", description=__doc__.split("\n")[0])
    ap.add_argument("--api", action="store_true", help="this table (how `gemmconv bench` routes)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--quick", action="store_true", help="tiny problems (the tests run this)")
    ap.add_argument("--check", action="store_true", help="exit status 1 when a target is not met")
    ap.add_argument(
        "--cases", default="", help=f"comma list of {','.join(c.name for c in API_CASES)}"
    )
    ap.add_argument(
        "--kinds", default=",".join(DEFAULT_KINDS), help=f"comma list of {','.join(CALL_KINDS)}"
    )
    ap.add_argument("--layouts", default="cf", help="comma list of cf, cl")
    ap.add_argument(
        "--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on the CPU)"
    )
    # 15 on the CPU too: with 5, single rows of the shared 2-core machine's table moved
    # by 10% between runs (the ResNet 1x1 weight gradient read 0.86-0.93x torch; with
    # 15, 0.97x).
    ap.add_argument("--reps", type=int64, default=15, help="repetitions (default 15)")
    ap.add_argument(
        "--out",
        default="gemmconv-bench",
        help="directory for the result files (the committed ones: bench/results)",
    )
    ap.add_argument("--name", default=None, help="file stem (default: cpu, or <gpu>_api)")
    ap.add_argument("--label", default=None, help="machine description for the heading")
    return ap


def _checked_list(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise UsageError(f"--{flag} {text}: expected a comma list of {', '.join(allowed)}")
    return values


@reports_usage_errors("gemmconv bench --api")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = bench_device(args.device)
    kinds = _checked_list(args.kinds, CALL_KINDS, "kinds")
    layouts = _checked_list(args.layouts, list(LAYOUT_NAMES), "layouts")
    dtype_key = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    _checked_list(dtype_key, list(DTYPES), "dtype")
    try:
        cases = api_cases([c for c in args.cases.split(",") if c], quick=args.quick)
    except ValueError as e:
        raise UsageError(f"--cases: {e}") from None
    if args.reps < 1:
        raise UsageError(f"--reps {args.reps}: expected a value >= 1")
    machine = args.label or machine_label(device)
    stem = args.name or (
        "cpu" if device.type == "cpu" else default_stem(environment(device)["device"]) + "_api"
    )

    def save(partial: dict) -> None:
        write(partial, args.out, stem)

    results = run(
        cases, kinds, layouts, dtype_key, device, args.quick, args.reps, machine, on_row=save
    )
    for path in write(results, args.out, stem):
        print(f"wrote {path}")
    print(markdown(results).split("\n\n")[-1], end="")
    # One target per row: at least NOT_SLOWER x torch and x the rewrite.
    slower = slower_rows(results)
    unmet = [f"{label} under {NOT_SLOWER} x torch or x linear" for label in slower]
    print(targets_line(len(results["rows"]), unmet, args.quick))
    if results["errors"] or not all(r["agrees"] for r in results["rows"]):
        return 1
    return check_status(len(results["rows"]), unmet) if args.check else 0


__all__ = ["API_CASES", "ApiCase", "api_cases", "main", "markdown", "run", "slower_rows"]

if __name__ == "__main__":
    raise SystemExit(main())
