"""Writing a benchmark run: the JSON record, markdown tables with the ratios, a plot.

The summary checks the suite's targets on the rows themselves, so the committed table
says which are met and by how much the others are missed: on what users pay (the
public call, ``api_ms``) and on device time (a diagnostic).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from gemmconv.bench.fp8_rows import FP8_TARGET, fp8_section, under_target
from gemmconv.bench.host_probe import host_lines
from gemmconv.bench.invariance_cost import invariance_section
from gemmconv.bench.kernel_count import MAX_KERNELS, launches

# Targets on what users pay: every row's public call at least this fast as cuDNN's and
# as the rewrite's (the run-to-run noise), and the rewrite's and cuDNN's times over
# gemmconv's at least API_LINEAR_GEOMEAN and API_VENDOR_GEOMEAN in geometric mean.
API_NOT_SLOWER = 0.97
API_LINEAR_GEOMEAN = 1.6
API_VENDOR_GEOMEAN = 5.0
# Find mode's public call (find_api_ms) at most this much slower than the default
# selection's (api_ms): find decides on the call, so its pick never loses beyond noise.
FIND_NOT_SLOWER = 1.05
# Targets on device time, in ms for the absolute ones.
NOT_SLOWER = 0.95
FLOOR_GEOMEAN = 0.7
FLOOR_MIN = 0.4
IMMEDIATE_GAP = 0.10
ABSOLUTE_TARGETS = {
    ("point2d", "cf", "fwd", "bf16"): 0.035,
    ("point2d", "cf", "bwd_data", "bf16"): 0.035,
    ("point2d", "cf", "bwd_weights", "bf16"): 0.040,
    ("vit_b16", "cf", "fwd", "bf16"): 0.12,
}


def default_stem(device_name: str) -> str:
    """'h200' for an NVIDIA H200, else the device name in lower case, dashed."""
    match = re.search(r"\b([AHBL]\d{2,3})\b", device_name)
    if match:
        return match.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "device"


def rate_text(tflops: float) -> str:
    """A matrix rate in the unit that shows it: TFLOP/s on a GPU, GFLOP/s on a CPU
    (where one decimal of a TFLOP/s would read 0.0)."""
    if tflops >= 1.0:
        return f"{tflops:.1f} TFLOP/s"
    return f"{tflops * 1e3:.3g} GFLOP/s"


def on_cpu(results: dict) -> bool:
    return results["device"] == "cpu"


def vendor_name(results: dict) -> str:
    """What the vendor column ran: cuDNN through aten on a GPU, aten's own CPU kernels."""
    return "aten CPU" if on_cpu(results) else "cuDNN"


def _versions_text(results: dict) -> str:
    if on_cpu(results):
        return (
            f"torch {results['torch']} (CPU), triton {results['triton']}, "
            f"gemmconv {results['gemmconv']}"
        )
    return (
        f"torch {results['torch']}, cuDNN {results['cudnn']}, CUDA {results['cuda']}, "
        f"triton {results['triton']}, gemmconv {results['gemmconv']}"
        f"{native_node_text(results)}"
    )


def native_node_text(results: dict) -> str:
    """The clause on gemmconv's C++ autograd node (empty for results from before it)."""
    status = results.get("native_node")
    return f" (C++ autograd node {status})" if status else ""


def _timing_text(results: dict) -> str:
    how = "time.perf_counter, no cache flush" if on_cpu(results) else "CUDA events, L2 flushed"
    timing = results["timing"]
    return f"Times are medians in ms ({how}, warm-up {timing['warmup']}, {timing['reps']} reps)."


def _no_rows_reason(results: dict) -> str:
    if results.get("truncated"):
        return "the time budget was spent before the first row"
    if results.get("errors"):
        return "every row failed (ROW FAILED below)"
    return "the selection holds no row"


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def api_ratios(r: dict) -> tuple[float | None, float | None]:
    """(vendor, linear) public-call time over gemmconv's; None where not measured."""
    api = r.get("api_ms")
    if api is None:
        return None, None
    vendor, linear = r.get("vendor_api_ms"), r.get("linear_api_ms")
    return (
        None if vendor is None else vendor / api,
        None if linear is None else linear / api,
    )


def summary(results: dict) -> dict:
    rows = results["rows"]
    ratios = [r["floor_ratio"] for r in rows]
    geomean = _geomean(ratios)
    api = [(r, *api_ratios(r)) for r in rows if r.get("api_ms") is not None]
    api_slower = [
        _label(r)
        for r, vendor, linear in api
        if vendor < API_NOT_SLOWER or (linear is not None and linear < API_NOT_SLOWER)
    ]
    find_slower = [
        _label(r)
        for r in rows
        if r.get("find_api_ms") is not None
        and r.get("api_ms") is not None
        and r["find_api_ms"] > FIND_NOT_SLOWER * r["api_ms"]
    ]
    slower = [
        _label(r)
        for r in rows
        if r["speedup_vs_vendor"] < NOT_SLOWER or r["speedup_vs_linear"] < NOT_SLOWER
    ]
    below = [_label(r) for r in rows if r["floor_ratio"] < FLOOR_MIN]
    gaps = [
        _label(r) for r in rows if r["immediate_gap"] is None or r["immediate_gap"] > IMMEDIATE_GAP
    ]
    memory = [_label(r) for r in rows if r["memory_ok"] is False]
    counted = [r for r in rows if r.get("api_kernels") is not None]
    over_launches = [r for r in counted if _launches(r) > MAX_KERNELS]
    absolute = {}
    for r in rows:
        key = (r["case"], r["layout"], r["direction"], r["dtype"])
        if key in ABSOLUTE_TARGETS and not results.get("quick"):
            absolute[_label(r)] = {
                "target_ms": ABSOLUTE_TARGETS[key],
                "gemmconv_ms": r["gemmconv_ms"],
                "met": r["gemmconv_ms"] <= ABSOLUTE_TARGETS[key],
            }
    return {
        "rows": len(rows),
        "api_rows": len(api),
        "api_linear_geomean": _geomean([linear for _, _, linear in api if linear is not None]),
        "api_vendor_geomean": _geomean([vendor for _, vendor, _ in api]),
        "api_slower_than_vendor_or_linear": api_slower,
        "find_rows": sum(r.get("find_api_ms") is not None for r in rows),
        "find_slower_than_default": find_slower,
        "floor_ratio_geomean": geomean,
        "floor_ratio_min": min(ratios) if ratios else None,
        "slower_than_vendor_or_linear": slower,
        "below_floor_min": below,
        "immediate_gap_over_10pct": gaps,
        "memory_over_one_operand": memory,
        "kernels_counted": len(counted),
        "api_over_max_kernels": [_label(r) for r in over_launches],
        "api_over_max_kernel_names": {
            _label(r): r["api_kernel_names"] for r in over_launches if r.get("api_kernel_names")
        },
        "absolute": absolute,
        "fp8_rows_run": sum(bool(r.get("applies")) for r in results.get("fp8_rows") or []),
        "fp8_under_target": under_target(results),
    }


def unmet_targets(stats: dict) -> tuple[int, list[str]]:
    """How many of the suite's targets the run's rows let it check (those of the
    Targets section), and a short text for each one not met."""
    checked, unmet = 0, []

    def check(met: bool, text: str) -> None:
        nonlocal checked
        checked += 1
        if not met:
            unmet.append(text)

    def rows_text(labels: list[str], what: str) -> str:
        return f"{len(labels)} row(s) {what}"

    if stats["api_rows"]:
        linear = stats["api_linear_geomean"]
        if linear is not None:
            check(
                linear >= API_LINEAR_GEOMEAN,
                f"api linear/gemmconv geomean {linear:.3f} < {API_LINEAR_GEOMEAN}",
            )
        vendor = stats["api_vendor_geomean"]
        if vendor is not None:
            check(
                vendor >= API_VENDOR_GEOMEAN,
                f"api vendor/gemmconv geomean {vendor:.3f} < {API_VENDOR_GEOMEAN}",
            )
        slower = stats["api_slower_than_vendor_or_linear"]
        check(not slower, rows_text(slower, f"under {API_NOT_SLOWER} x vendor or x linear (api)"))
    if stats.get("kernels_counted"):
        over = stats["api_over_max_kernels"]
        check(not over, rows_text(over, f"launching more than {MAX_KERNELS} kernels"))
    geomean = stats["floor_ratio_geomean"]
    if geomean is not None:
        check(geomean >= FLOOR_GEOMEAN, f"floor/gemmconv geomean {geomean:.3f} < {FLOOR_GEOMEAN}")
        least = stats["floor_ratio_min"]
        check(least >= FLOOR_MIN, f"floor/gemmconv minimum {least:.3f} < {FLOOR_MIN}")
        for key, what in (
            ("slower_than_vendor_or_linear", f"under {NOT_SLOWER} x vendor or x linear (device)"),
            ("immediate_gap_over_10pct", "with immediate mode over 10% off the fastest"),
            ("memory_over_one_operand", "using more than one largest operand of extra memory"),
        ):
            check(not stats[key], rows_text(stats[key], what))
    for label, a in stats["absolute"].items():
        check(a["met"], f"{label} {a['gemmconv_ms']:.4f} ms > {a['target_ms']} ms")
    if stats.get("fp8_rows_run"):
        slow = stats["fp8_under_target"]
        check(not slow, rows_text(slow, f"with fp8 under {FP8_TARGET} x gemmconv bf16"))
    return checked, unmet


def targets_line(checked: int, unmet: list[str], quick: bool) -> str:
    """The last line of a benchmark run: whether its targets are met, and which are
    not; a quick run says its numbers are no measurement."""
    note = " (a quick run: tiny sizes, not a measurement)" if quick else ""
    if not checked:
        return f"targets: none checked (no rows ran){note}"
    if not unmet:
        return f"targets: all {checked} met{note}"
    return f"targets: {len(unmet)} of {checked} NOT met{note}: {'; '.join(unmet)}"


def check_status(checked: int, unmet: list[str]) -> int:
    """``--check``'s exit status: 1 when a target is not met or none could be checked."""
    return 1 if unmet or not checked else 0


def _kernels_lines(stats: dict) -> list[str]:
    """The Targets line on launches a public call makes (kernel_count), and under it
    what each row over the target launched."""
    what = (
        f"- what users pay: rows whose public call launches more than {MAX_KERNELS} kernels "
        "(cuBLAS's memset and split-K sum counted with their GEMM)"
    )
    if not stats.get("kernels_counted"):
        return [f"{what}: not counted (no device profile: the CPU, or a run before the count)"]
    over = stats["api_over_max_kernels"]
    lines = [
        f"{what}: {len(over)} of {stats['kernels_counted']} counted"
        + (f" ({', '.join(over)})" if over else "")
    ]
    for label, names in stats.get("api_over_max_kernel_names", {}).items():
        lines.append(f"  - {label}: {'; '.join(short_kernel_name(n) for n in names)}")
    return lines


def _launches(row: dict) -> int:
    """A row's launches (kernel_count.launches) where its kernels are named, else its
    kernel count (a run before the names were kept)."""
    names = row.get("api_kernel_names")
    return row["api_kernels"] if names is None else launches(names)


def short_kernel_name(name: str) -> str:
    """A kernel's name without its return type, template arguments and parameters
    (cuBLAS's and CUTLASS's run to hundreds of characters)."""
    name = name.removeprefix("void ")
    for cut in "<(":
        name = name.split(cut, 1)[0]
    return name.strip() or "?"


def _label(r: dict) -> str:
    return f"{r['case']}/{r['layout']}/{r['direction']}/{r['dtype']}"


def markdown(results: dict, stats: dict) -> str:
    lines = [
        f"# gemmconv benchmark: {results['device']}",
        "",
        _versions_text(results)
        + (" — QUICK (tiny shapes, not a measurement)" if results.get("quick") else "")
        + (" — TRUNCATED (time budget spent; rows missing)" if results.get("truncated") else ""),
        "",
        *host_lines(results),
        *_api_table(results),
        "## Device time (a diagnostic: the kernels alone, the host hidden)",
        "",
        "Measured in the same run: "
        + ", ".join(f"{k} {rate_text(v)}" for k, v in results["rates"]["matrix_tflops"].items())
        + f"; device copy {results['rates']['bandwidth_gbs']:.0f} GB/s (read + write). "
        + _timing_text(results)
        + f" vendor = {vendor_name(results)}; "
        "floor = max(flops / matrix rate, bytes / bandwidth); 'x vendor' and 'x linear' are "
        "speed-ups of gemmconv (the fastest verified solver); 'floor/g' is floor / gemmconv "
        "time.",
        "",
        "| case | layout | dir | dtype | solver | vendor | linear | gemmconv | floor "
        "| x vendor | x linear | floor/g | immediate (gap) | extra/largest MB | rms |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results["rows"]:
        extra = "n/a" if r["extra_bytes"] is None else f"{r['extra_bytes'] / 2**20:.1f}"
        gap = "failed" if r["immediate_gap"] is None else f"{100 * r['immediate_gap']:+.0f}%"
        lines.append(
            f"| {r['case']} | {r['layout']} | {r['direction']} | {r['dtype']} | {r['solver']} "
            f"| {r['vendor_ms']:.4f} | {r['linear_ms']:.4f} | {r['gemmconv_ms']:.4f} "
            f"| {r['floor_ms']:.4f} | {r['speedup_vs_vendor']:.2f} | {r['speedup_vs_linear']:.2f} "
            f"| {r['floor_ratio']:.2f} | {r['immediate_solver']} ({gap}) "
            f"| {extra}/{r['largest_operand_bytes'] / 2**20:.1f} | {r['rms_error']:.2e} |"
        )
    gathers = [r for r in results["rows"] if r.get("gather")]
    if gathers:
        lines += [
            "",
            "Patch gather alone (x -> padded column buffer; TB/s counts bytes read + written):",
            "",
            "| case | layout | torch ms | torch TB/s | triton ms | triton TB/s |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in gathers:
            g = r["gather"]
            lines.append(
                f"| {r['case']} | {r['layout']} | {g['torch_ms']:.4f} | {g['torch_tbs']:.2f} "
                f"| {g['triton_ms']:.4f} | {g['triton_tbs']:.2f} |"
            )
    lines += ["", *invariance_section(results)]
    lines += fp8_section(results)
    lines += ["## Targets", ""]
    g = stats["floor_ratio_geomean"]
    if g is None:
        lines.append(f"- no rows were run: {_no_rows_reason(results)}")
    if stats["api_rows"]:
        linear, vendor = stats["api_linear_geomean"], stats["api_vendor_geomean"]
        lines.append(
            "- what users pay (api_ms): geometric mean of linear/gemmconv "
            + ("n/a" if linear is None else f"{linear:.3f}")
            + f" (target >= {API_LINEAR_GEOMEAN}), of cuDNN/gemmconv "
            + ("n/a" if vendor is None else f"{vendor:.3f}")
            + f" (target >= {API_VENDOR_GEOMEAN})"
        )
        slower = stats["api_slower_than_vendor_or_linear"]
        lines.append(
            f"- what users pay (api_ms): rows under {API_NOT_SLOWER} x vendor or x linear: "
            f"{len(slower)}" + (f" ({', '.join(slower)})" if slower else "")
        )
        if stats.get("find_rows"):
            late = stats["find_slower_than_default"]
            lines.append(
                f"- find mode (find_api_ms): rows over {FIND_NOT_SLOWER} x the default "
                f"selection's call: {len(late)}" + (f" ({', '.join(late)})" if late else "")
            )
        lines.extend(_kernels_lines(stats))
    if g is not None:
        lines.append(
            f"- device time: geometric mean of floor/gemmconv: {g:.3f} (target >= "
            f"{FLOOR_GEOMEAN}); minimum {stats['floor_ratio_min']:.3f} (target >= {FLOOR_MIN})"
        )
    for key, what in (
        (
            "slower_than_vendor_or_linear",
            f"device time: rows under {NOT_SLOWER} x vendor or x linear",
        ),
        ("below_floor_min", f"device time: rows with floor/gemmconv under {FLOOR_MIN}"),
        (
            "immediate_gap_over_10pct",
            "device time: rows where immediate mode is over 10% off the fastest",
        ),
        ("memory_over_one_operand", "rows using more than one largest operand of extra memory"),
    ):
        items = stats[key]
        lines.append(f"- {what}: {len(items)}" + (f" ({', '.join(items)})" if items else ""))
    for error in results.get("errors", []):
        lines.append(f"- ROW FAILED: {error}")
    for r in results["rows"]:
        for sid, c in r["candidates"].items():
            if not c["ok"]:
                why = c["error"] or f"verification failed (rms {c['rms_error']:.3g})"
                lines.append(f"- candidate {sid} on {_label(r)}: {why}")
    for label, a in stats["absolute"].items():
        lines.append(
            f"- device time {label}: {a['gemmconv_ms']:.4f} ms (target <= {a['target_ms']}) "
            + ("met" if a["met"] else "NOT met")
        )
    return "\n".join(lines) + "\n"


def _api_table(results: dict) -> list[str]:
    """The public-call table, where the rows carry api_ms (runs before it had none)."""
    rows = [r for r in results["rows"] if r.get("api_ms") is not None]
    if not rows:
        return []
    lines = [
        "## What users pay per call (api_ms)",
        "",
        "The public call (gemmconv with its default selection, torch's F.conv*, the "
        "reshape + F.linear rewrite; a gradient through autograd), back-to-back calls with "
        "nothing hiding the host, median ms per call; 'x vendor' and 'x linear' are their "
        "times over gemmconv's; 'kernels' is what one gemmconv call runs on the device "
        "(torch.profiler; — where not counted), with the launches in brackets where cuBLAS "
        "ran its memset or split-K sum beside a GEMM; 'find' is gemmconv's call in find "
        "mode after find has run (find_api_ms; — where not measured), with find's pick.",
        "",
        "| case | layout | dir | dtype | gemmconv | vendor | linear | x vendor | x linear "
        "| find | find's pick | kernels |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        vendor, linear = api_ratios(r)
        linear_ms, find_ms = r.get("linear_api_ms"), r.get("find_api_ms")
        lines.append(
            f"| {r['case']} | {r['layout']} | {r['direction']} | {r['dtype']} "
            f"| {r['api_ms']:.4f} | {r['vendor_api_ms']:.4f} "
            f"| {'n/a' if linear_ms is None else f'{linear_ms:.4f}'} | {vendor:.2f} "
            f"| {'n/a' if linear is None else f'{linear:.2f}'} "
            f"| {'—' if find_ms is None else f'{find_ms:.4f}'} "
            f"| {r.get('find_api_solver') or '—'} | {_kernels_cell(r)} |"
        )
    return [*lines, ""]


def _kernels_cell(row: dict) -> str:
    kernels = row.get("api_kernels")
    if kernels is None:
        return "—"
    launched = _launches(row)
    return str(kernels) if launched == kernels else f"{kernels} ({launched})"


def plot(results: dict, path: Path) -> bool:
    """Speed-up over vendor per row, with the floor (vendor / floor) marked; False when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = speedup_figure(results)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def speedup_figure(results: dict):
    """The plot's matplotlib Figure. The legend sits below the axes, outside them, so
    it can cover no bar whatever the speed-ups are."""
    import matplotlib.pyplot as plt

    rows = results["rows"]
    labels = [_label(r) for r in rows]
    ys = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 0.22 * len(rows) + 2.0), layout="constrained")
    ax.barh(ys, [r["speedup_vs_vendor"] for r in rows], color="tab:blue", label="gemmconv")
    ax.scatter([r["vendor_ms"] / r["linear_ms"] for r in rows], ys, marker="o", s=12,
               color="tab:orange", label="reshape + linear", zorder=3)  # fmt: skip
    ax.scatter([r["vendor_ms"] / r["floor_ms"] for r in rows], ys, marker="|", s=80,
               color="black", label="floor", zorder=3)  # fmt: skip
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel(f"speed-up over vendor ({vendor_name(results)}), log scale")
    ax.set_title(f"gemmconv on {results['device']}")
    fig.legend(loc="outside lower center", ncols=3, fontsize=7)
    return fig


def write_results(results: dict, out_dir: str | Path, stem: str, plot_it: bool = True) -> list:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats = summary(results)
    results = {**results, "summary": stats}
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(markdown(results, stats))
    if plot_it and results["rows"] and plot(results, out / f"{stem}.png"):
        paths.append(out / f"{stem}.png")
    return paths


__all__ = [
    "api_ratios",
    "check_status",
    "default_stem",
    "markdown",
    "rate_text",
    "speedup_figure",
    "summary",
    "targets_line",
    "unmet_targets",
    "vendor_name",
    "write_results",
]
