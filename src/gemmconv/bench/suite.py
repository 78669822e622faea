"""The side-by-side benchmark suite: vendor, the reshape + F.linear rewrite, gemmconv, floor.

For every case x layout x direction, in one process on one device, two kinds of time:

What users pay (``api_ms``, ``vendor_api_ms``, ``linear_api_ms``, ``find_api_ms``): the
public call of gemmconv with its default selection, of torch's F.conv* and of the
reshape + F.linear rewrite, through autograd for a gradient, and gemmconv's in find
mode after find has run (``find_api_solver`` its pick), timed back to back with nothing
hiding the host (gemmconv.bench.call_timing.api_times).

Device time (a diagnostic: a spin kernel queued ahead of each repetition hides the
host, the L2 is flushed; time.perf_counter on the CPU):
- vendor:   aten convolution / convolution_backward (cuDNN on CUDA);
- linear:   what serving frameworks do instead of the convolution: unfold the patches
            with reshape/permute, then one F.linear (backward: the same matmuls);
- gemmconv: every applicable solver measured by gemmconv.measuring.measure, as find measures
            it (its result verified against a float64 reference, its device time and
            its call time), the fastest verified one by device time kept; find's own
            pick (by call time) and the cost model's (immediate) are recorded beside;
- floor:    max(flops / matrix rate, bytes / bandwidth), both rates measured in the
            same run (a large matmul in the row's math mode; a large device copy).

`gemmconv bench` and ``python -m gemmconv.bench.suite`` call main(); --quick runs tiny shapes (the
CPU test suite uses it), --cases/--layouts/--directions/--dtypes filter the rows.
Results go to ./gemmconv-bench unless --out names a folder (bench/results holds the
committed runs, written only when named).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from gemmconv.bench.host_probe import host_fields
from gemmconv.bench.linear_rewrite import rewrite_fn
from gemmconv.core.memory_format import Layout
from gemmconv.core.precision import conv_gemm_precision
from gemmconv.core.problem import ConvProblem, Direction, dtype_name
from gemmconv.measuring.measure import (
    Judge,
    Measurement,
    TimingPolicy,
    fastest,
    measure_solver,
    operand_sets,
    peak_rates,
    result_like,
)
from gemmconv.measuring.timing import time_ms
from gemmconv.selection import calibrate, dispatch
from gemmconv.solvers import SOLVERS, ConvTensors, get_solver
from gemmconv.terminal.long_run import Calls, cpu_seconds, long_run_warning
from gemmconv.terminal.progress import progress_bar
from gemmconv.terminal.usage import Parser, UsageError, int64, reports_usage_errors

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUT_NAMES = {"cf": Layout.CHANNELS_FIRST, "cl": Layout.CHANNELS_LAST}
DIRECTION_NAMES = {
    "fwd": Direction.FORWARD,
    "bwd_data": Direction.BACKWARD_DATA,
    "bwd_weights": Direction.BACKWARD_WEIGHTS,
}


# ---- the suite ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    n: int
    c: int
    k: int
    spatial: tuple[int, ...]
    kernel: tuple[int, ...]

    @property
    def stride(self) -> tuple[int, ...]:
        return self.kernel  # every suite case is stride == kernel (1x1 included)


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One convolution of the suite; ``tiny`` keeps its structure (C, kernel, dims) at
    sizes a CPU runs in milliseconds."""

    name: str
    title: str
    full: Shape
    tiny: Shape
    dtypes: tuple[str, ...] = ("bf16",)


def _tiny(full: Shape, outs: tuple[int, ...], n: int = 2, k: int = 16, c: int | None = None):
    return Shape(
        n=n,
        c=full.c if c is None else c,
        k=k,
        spatial=tuple(o * r for o, r in zip(outs, full.kernel)),
        kernel=full.kernel,
    )


def _case(name, title, n, c, k, spatial, kernel, dtypes=("bf16",), tiny_outs=None, tiny_c=None):
    full = Shape(n, c, k, tuple(spatial), tuple(kernel))
    outs = tiny_outs or tuple(1 if s == r else 2 for s, r in zip(spatial, kernel))
    return BenchCase(name, title, full, _tiny(full, outs, c=tiny_c), tuple(dtypes))


SUITE: tuple[BenchCase, ...] = (
    _case("point2d", "point 2D", 9500, 3, 1280, (14, 14), (14, 14), ("bf16", "fp16", "fp32")),
    _case("point3d", "point 3D (Qwen2.5-VL)", 9500, 3, 1280, (2, 14, 14), (2, 14, 14)),
    # Conv3d patch embeds with a temporal kernel of 2, one patch per sample (the batch is
    # the patch count), the rows where channels-last-3d backward calls lost to cuDNN.
    # Qwen2-VL: transformers' Qwen2VLVisionConfig, in_channels 3, patch_size 14,
    # temporal_patch_size 2, embed_dim 1280; 8192 patches (a 1792x1792 image at 14-pixel
    # patches, or a short video).
    _case("qwen2vl", "Qwen2-VL Conv3d", 8192, 3, 1280, (2, 14, 14), (2, 14, 14)),
    # Qwen3-VL: transformers' Qwen3VLVisionConfig, in_channels 3, patch_size 16,
    # temporal_patch_size 2, hidden_size 1152; 8192 patches.
    _case("qwen3vl", "Qwen3-VL Conv3d", 8192, 3, 1152, (2, 16, 16), (2, 16, 16)),
    # Wan 2.1's video-latent patchify: diffusers' WanTransformer3DModel, in_channels 16,
    # patch_size (1, 2, 2), inner dim 40 heads x 128 = 5120 (the 14B defaults; the 1.3B
    # model has 1536); one 81-frame 480x832 clip, whose VAE latent is 16x21x60x104.
    _case("wan21_patchify", "Wan 2.1 latent patchify", 1, 16, 5120, (21, 60, 104), (1, 2, 2)),
    # SD3's 2x2 latent patchify: diffusers' SD3Transformer2DModel PatchEmbed, in_channels
    # 16, patch_size 2, sample_size 128 (a 1024x1024 image); SD3-medium's released config
    # has 24 heads x 64 = 1536 (the class defaults, 18 heads, give 1152); batch 8.
    _case("sd3_patchify", "SD3 latent patchify", 8, 16, 1536, (128, 128), (2, 2)),
    _case("vit_b16", "ViT-B/16", 256, 3, 768, (224, 224), (16, 16)),
    _case("clip_l14_336", "CLIP ViT-L/14 336", 128, 3, 1024, (336, 336), (14, 14)),
    _case("sam_vit_h", "SAM ViT-H", 8, 3, 1280, (1024, 1024), (16, 16)),
    _case("videomae", "VideoMAE", 16, 3, 768, (16, 224, 224), (2, 16, 16)),
    _case("dit_xl2", "DiT-XL/2", 256, 4, 1152, (32, 32), (2, 2)),
    _case("convnext_down", "ConvNeXt downsample", 128, 192, 384, (56, 56), (2, 2), tiny_c=8),
    _case("resnet_1x1", "ResNet pointwise", 256, 256, 64, (56, 56), (1, 1), tiny_outs=(5, 3),
          tiny_c=16),
)  # fmt: skip


def suite_cases(names: Sequence[str] | None = None) -> list[BenchCase]:
    return select_named(SUITE, names, "cases")


def quick_name(name: str, batch: int, quick_batch: int) -> str:
    """What a quick run calls a case or scenario named for its full size: ``tiny_`` and
    the batch it runs where the name gives the full one (``vit_b16_train_b256`` at
    batch 2 -> ``tiny_vit_b16_train_b2``, ``point2d_950`` at 8 -> ``tiny_point2d_8``),
    the batch appended where the name gives none."""
    tokens = name.split("_")
    for i in reversed(range(len(tokens))):
        if tokens[i] in (f"b{batch}", str(batch)):
            tokens[i] = tokens[i].removesuffix(str(batch)) + str(quick_batch)
            break
    else:
        tokens.append(str(quick_batch))
    return "_".join(["tiny", *tokens])


def select_named(items: Sequence, names: Sequence[str] | None, argument: str) -> list:
    """The ``items`` called ``names`` (by their ``.name``), in that order; all of them
    when ``names`` is empty. An unknown name is a ValueError naming ``argument``."""
    if not names:
        return list(items)
    known = {item.name: item for item in items}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{argument}={unknown}: unknown; expected names from {', '.join(known)}")
    return [known[n] for n in names]


# ---- rates measured in the run -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeasuredRates:
    """The device's peak rates measured in the run (gemmconv.measuring.measure.peak_rates)."""

    matrix_tflops: dict[str, float]  # "bf16", "fp16", "fp32" (TF32 off)
    bandwidth_gbs: float

    def floor_ms(self, p: ConvProblem) -> tuple[float, float]:
        """(flop floor, byte floor) in ms."""
        flop_ms = p.flops() / (self.matrix_tflops[dtype_name(p.dtype)] * 1e9)
        byte_ms = p.min_bytes() / (self.bandwidth_gbs * 1e6)
        return flop_ms, byte_ms


@contextlib.contextmanager
def math_mode(dtype: torch.dtype, device_type: str) -> Iterator[None]:
    """The row's math mode: fp32 rows run with TF32 off in cuDNN and cuBLAS alike
    (conv_gemm_precision follows cudnn.allow_tf32), half rows accumulate in fp32."""
    saved = torch.backends.cudnn.allow_tf32
    if dtype == torch.float32:
        torch.backends.cudnn.allow_tf32 = False
    try:
        with conv_gemm_precision(dtype, device_type):
            yield
    finally:
        torch.backends.cudnn.allow_tf32 = saved


# ---- operands ----------------------------------------------------------------


def make_problem(shape: Shape, layout: Layout, dtype, device, direction) -> ConvProblem:
    return ConvProblem.from_sizes(
        n=shape.n,
        c=shape.c,
        k=shape.k,
        spatial=shape.spatial,
        kernel=shape.kernel,
        stride=shape.stride,
        layout=layout,
        dtype=dtype,
        device_type=device.type,
        direction=direction,
    )


# ---- one row -----------------------------------------------------------------


def run_row(
    case: BenchCase,
    shape: Shape,
    layout: Layout,
    dtype_key: str,
    direction: Direction,
    device: torch.device,
    rates: MeasuredRates,
    timing: dict,
    seed: int,
) -> dict:
    """One row: every applicable solver measured by gemmconv.measuring.measure (verified, extra
    memory, call time and device time), the rewrite, the floor, and the public calls of
    gemmconv (default selection), torch and the rewrite (gemmconv.bench.call_timing)."""
    from gemmconv.bench.call_timing import api_times
    from gemmconv.bench.invariance_cost import invariance_times

    dtype = DTYPES[dtype_key]
    p = make_problem(shape, layout, dtype, device, direction)
    api = timing["api"]
    policy = TimingPolicy(timing["warmup"], timing["reps"], api["reps"], api["block_ms"])
    sets = operand_sets(p, device, seed)
    t = sets[0]
    with math_mode(dtype, device.type):
        judge = Judge(p, t)
        linear = rewrite_fn(p, t)
        linear_error = judge(linear()).error
        linear_ms = time_ms(linear, device=device, warmup=policy.warmup, reps=policy.reps).median_ms
        out = result_like(p, t)
        applicable = [s for s in SOLVERS if s.is_applicable(p)]
        measured = [measure_solver(p, s, sets, out, policy, judge=judge, peak_memory=True)
                    for s in applicable]  # fmt: skip
        del out, sets
        immediate = dispatch.decide(p).solver
        gathers = measure_gathers(p, t, device, policy)
        public = api_times(
            p, device, reps=api["reps"], block_ms=api["block_ms"], seed=seed, find=True
        )
        invariance = invariance_times(p, device, reps=api["reps"], block_ms=api["block_ms"],
                                      seed=seed)  # fmt: skip
    del judge
    by_id = {m.solver: m for m in measured}
    if not by_id["vendor"].ok:
        raise RuntimeError(f"{p.key()}: the vendor failed: {by_id['vendor'].skipped}")
    best = fastest(measured, by="device_ms")
    if best is None:
        raise RuntimeError(f"{p.key()}: no solver verified: {[m.skipped for m in measured]}")
    vendor_ms = by_id["vendor"].device_ms
    imm = by_id[immediate]
    flop_ms, byte_ms = rates.floor_ms(p)
    floor_ms = max(flop_ms, byte_ms)
    largest_operand = p.largest_operand_bytes()
    return {
        "case": case.name,
        "title": case.title,
        "layout": "cf" if layout is Layout.CHANNELS_FIRST else "cl",
        "direction": _direction_name(direction),
        "dtype": dtype_key,
        "shape": dataclasses.asdict(shape),
        "solver": best.solver,
        "vendor_ms": vendor_ms,
        "linear_ms": linear_ms,
        "gemmconv_ms": best.device_ms,
        "floor_ms": floor_ms,
        "flop_floor_ms": flop_ms,
        "byte_floor_ms": byte_ms,
        "flops": p.flops(),
        "min_bytes": p.min_bytes(),
        "speedup_vs_vendor": vendor_ms / best.device_ms,
        "speedup_vs_linear": linear_ms / best.device_ms,
        "floor_ratio": floor_ms / best.device_ms,
        "rms_error": best.verdict.error,
        "linear_rms_error": linear_error,
        "verified": best.verdict.ok,
        "immediate_solver": immediate,
        "immediate_ms": imm.device_ms,
        "immediate_ok": imm.ok,
        "immediate_gap": (imm.device_ms / best.device_ms - 1.0) if imm.ok else None,
        "find_solver": fastest(measured).solver,
        "estimate_ms": {m.solver: get_solver(m.solver).estimate_ms(p) for m in measured},
        "extra_bytes": best.extra_bytes,
        "largest_operand_bytes": largest_operand,
        "memory_ok": None if best.extra_bytes is None else best.extra_bytes <= largest_operand,
        "candidates": {m.solver: _candidate_record(m) for m in measured},
        "gather": gathers,
        **public,
        **invariance,
        # Counted after every row's timings (run_suite), named so a row over the
        # target says which launch to remove.
        "api_kernels": None,
        "api_kernel_names": None,
    }


def _candidate_record(m: Measurement) -> dict:
    """A candidate in the results file: ``ms`` is its device time, ``call_ms`` the time
    of back-to-back calls."""
    return {
        "solver": m.solver,
        "ms": m.device_ms,
        "call_ms": m.call_ms,
        "rms_error": None if m.verdict is None else m.verdict.error,
        "ok": m.ok,
        "extra_bytes": m.extra_bytes,
        "error": None if m.ok else m.skipped[:500],
    }


def measure_gathers(p: ConvProblem, t: ConvTensors, device: torch.device, policy: TimingPolicy):
    """Lever 3 in isolation: the patch gather x -> padded column buffer, by torch's
    permuted-view copy and by the Triton kernel, in ms and TB/s (bytes read plus
    written). None where it does not apply (not a forward patch problem on CUDA)."""
    from gemmconv.solvers.patch import (
        PaddedPatchSolver,
        TritonPatchSolver,
        covered_extent,
        padded_reduction,
        patch_class_reasons,
    )

    triton = TritonPatchSolver()
    if (
        device.type != "cuda"
        or p.direction is not Direction.FORWARD
        or patch_class_reasons(p)
        or not triton.is_applicable(p)
    ):
        return None
    ld = padded_reduction(p)
    read = p.n * p.c * math.prod(covered_extent(p))
    moved = (read + p.gemm_m * ld) * p.element_size
    out = {"bytes": moved}
    for name, solver in (("torch", PaddedPatchSolver()), ("triton", triton)):
        gather = solver.columns.gather
        ms = time_ms(
            lambda g=gather: g(t.input, p, ld), device=device, warmup=policy.warmup,
            reps=policy.reps,
        ).median_ms  # fmt: skip
        out[f"{name}_ms"] = ms
        out[f"{name}_tbs"] = moved / (ms * 1e9)
    return out


def _direction_name(direction: Direction) -> str:
    return {v: k for k, v in DIRECTION_NAMES.items()}[direction]


# ---- the whole run -----------------------------------------------------------


def environment(device: torch.device) -> dict:
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    from gemmconv.core.version import __version__

    env["gemmconv"] = __version__
    env["native_node"] = native_node_before_timing(device)
    return env


def native_node_before_timing(device: torch.device) -> str:
    """gemmconv's C++ autograd node built (or loaded) before anything is timed, where
    its setting wants it on ``device``; what became of it. A process uses the Python
    node until the node's first build ends (seconds), and the benchmarks time the
    steady state after it."""
    from gemmconv.roads import native_node

    if not native_node.wanted_on(device.type):
        return f"off on {device.type} (${native_node.ENVIRONMENT}={native_node.setting()})"
    native_node.build()
    return native_node.status()


Plan = list[tuple[BenchCase, str, Layout, Direction]]


def suite_plan(
    cases: Sequence[BenchCase],
    layouts: Sequence[Layout],
    directions: Sequence[Direction],
    dtypes: Sequence[str] | None = None,
) -> Plan:
    """The rows to run, in order: (case, dtype, layout, direction); a case runs only
    the dtypes it lists, filtered by ``dtypes``."""
    return [
        (case, dtype_key, layout, direction)
        for case in cases
        for dtype_key in case.dtypes
        if dtypes is None or dtype_key in dtypes
        for layout in layouts
        for direction in directions
    ]


def run_suite(
    cases: Sequence[BenchCase],
    layouts: Sequence[Layout],
    directions: Sequence[Direction],
    device: torch.device,
    quick: bool,
    timing: dict,
    dtypes: Sequence[str] | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
    on_row: Callable[[dict], None] | None = None,
    time_budget_s: float | None = None,
    advance: Callable[[], None] | None = None,
) -> dict:
    """Every row of the suite; ``on_row`` sees the results so far after each row (so a
    run cut short still leaves them), ``advance`` is called once per row run or
    failed, and no new row starts once ``time_budget_s`` has passed (the results then
    say ``truncated``)."""
    from gemmconv.bench.call_timing import public_call_kernels
    from gemmconv.bench.report import rate_text

    started = time.time()
    plan = suite_plan(cases, layouts, directions, dtypes)
    row_dtypes = sorted({dtype_key for _, dtype_key, _, _ in plan}, key=list(DTYPES).index)
    tflops, bandwidth = peak_rates(
        device, row_dtypes, TimingPolicy(timing["warmup"], timing["reps"]), quick=quick
    )
    rates = MeasuredRates(matrix_tflops=tflops, bandwidth_gbs=bandwidth)
    log(
        "rates: "
        + ", ".join(f"{k} {rate_text(v)}" for k, v in rates.matrix_tflops.items())
        + f", copy {rates.bandwidth_gbs:.0f} GB/s"
    )
    results = {
        **environment(device),
        **host_fields(device, quick),
        "quick": quick,
        "timing": timing,
        "rates": dataclasses.asdict(rates),
        "seconds": 0.0,
        "truncated": False,
        "rows": [],
    }
    run = []  # (row, problem, seed) of every row run, for the kernel counts after them
    for case, dtype_key, layout, direction in plan:
        if time_budget_s is not None and time.time() - started > time_budget_s:
            results["truncated"] = True
            log(f"time budget of {time_budget_s} s spent: {len(plan) - len(results['rows'])} "
                "rows not run")  # fmt: skip
            break
        seed += 1
        shape = case.tiny if quick else case.full
        try:
            row = run_row(case, shape, layout, dtype_key, direction, device, rates, timing, seed)
        except Exception as exc:  # one broken row must not lose the others
            label = f"{case.name}/{layout.value}/{_direction_name(direction)}/{dtype_key}"
            results.setdefault("errors", []).append(f"{label}: {type(exc).__name__}: {exc}")
            log(f"{label}: FAILED: {type(exc).__name__}: {exc}")
            if advance is not None:
                advance()
            continue
        results["rows"].append(row)
        run.append((row, make_problem(shape, layout, DTYPES[dtype_key], device, direction), seed))
        results["seconds"] = time.time() - started
        log(_row_line(row))
        if advance is not None:
            advance()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if on_row is not None:
            on_row(results)
    if not results["truncated"]:
        from gemmconv.bench.fp8_rows import fp8_rows

        api = timing["api"]
        results["fp8_rows"] = fp8_rows(cases, device, quick, api["reps"], api["block_ms"], log)
    # After every timing: a profile can leave the device's instrumentation on and the
    # host slower for the rest of the process (bench/NOTES.md), which no timing may see.
    for row, p, row_seed in run:
        try:
            names = public_call_kernels(p, device, row_seed)
            if names is not None:
                row["api_kernels"], row["api_kernel_names"] = len(names), names
        except Exception as exc:  # a count is a report: it never costs the rows their times
            log(f"{p.key()}: no kernel count: {type(exc).__name__}: {exc}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if run and on_row is not None:
        on_row(results)
    results["seconds"] = time.time() - started
    return results


def _row_line(r: dict) -> str:
    failed = [s for s, c in r["candidates"].items() if not c["ok"]]
    return (
        f"{r['case']:>14} {r['layout']} {r['direction']:<11} {r['dtype']} "
        f"vendor {r['vendor_ms']:.4f} linear {r['linear_ms']:.4f} "
        f"gemmconv {r['gemmconv_ms']:.4f} ({r['solver']}) floor {r['floor_ms']:.4f} "
        f"imm {r['immediate_solver']} | a call: gemmconv {r['api_ms']:.4f} vendor "
        f"{r['vendor_api_ms']:.4f} linear {r['linear_api_ms']:.4f} find {r['find_api_ms']:.4f}"
        + (f" FAILED: {','.join(failed)}" if failed else "")
    )


# ---- command line ------------------------------------------------------------

DEFAULT_OUT = "gemmconv-bench"

_EPILOG = f"""\
Result files (STEM.json, STEM.md and, with matplotlib, STEM.png) go to
./{DEFAULT_OUT} in the working directory unless --out names another folder; the
committed runs in a checkout's bench/results are written only when --out names that
folder. The last line says whether the targets are met (and which are not). A bad
flag or value is one line on stderr and exit status 2; a row or a solver that fails
is exit status 1, and so is a target not met under --check.
"""


def _parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="gemmconv bench",
        description="The side-by-side benchmark suite: vendor, the reshape + F.linear "
        "rewrite, gemmconv and the roofline floor, per case, layout and direction.",
        epilog=_EPILOG,
    )
    other = ap.add_argument_group("the other benchmarks (each flag's --help lists its own flags)")
    other.add_argument(
        "--api",
        action="store_true",
        help="instead of the suite: the public-call table, what a user pays per call "
        "(gemmconv bench --api --help)",
    )
    other.add_argument(
        "--models",
        action="store_true",
        help="instead of the suite: whole timm and transformers models, torch against "
        "converted (gemmconv bench --models --help; the models extra)",
    )
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions")
    ap.add_argument("--check", action="store_true", help="exit status 1 when a target is not met")
    case_names = ",".join(c.name for c in SUITE)
    ap.add_argument("--cases", default="", help=f"comma list from {case_names} (default: all)")
    ap.add_argument("--layouts", default="cf,cl", help="comma list of cf, cl")
    ap.add_argument(
        "--directions", default="fwd,bwd_data,bwd_weights", help="comma list of directions"
    )
    ap.add_argument(
        "--dtypes", default="", help="comma list of bf16, fp16, fp32 (default: each case's own)"
    )
    ap.add_argument("--out", default=DEFAULT_OUT, help="folder for the result files")
    ap.add_argument("--name", default=None, help="file stem (default: from the device name)")
    ap.add_argument("--warmup", type=int64, default=None, help="untimed calls (default 3, quick 1)")
    ap.add_argument("--reps", type=int64, default=None, help="timed calls (default 20, quick 3)")
    ap.add_argument("--seed", type=int64, default=0, help="seed of the first row's operands")
    ap.add_argument("--no-plot", action="store_true", help="no png")
    ap.add_argument(
        "--time-budget", type=float, default=None, help="seconds after which no row starts"
    )
    return ap


def _pick(text: str, table: dict, what: str) -> list:
    names = [v for v in text.split(",") if v]
    bad = [v for v in names if v not in table]
    if bad:
        raise UsageError(
            f"--{what} {text}: unknown {', '.join(bad)}; expected a comma list of "
            + ", ".join(table)
        )
    return [table[v] for v in names]


def bench_device(name: str | None) -> torch.device:
    """The device a benchmark command runs on: ``name`` (``--device``), else CUDA when
    available; a UsageError for anything else."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: expected cpu or cuda (cuda:N for one GPU)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA device is available")
    return device


def _check_counts(args) -> None:
    for flag, value, least in (("--warmup", args.warmup, 0), ("--reps", args.reps, 1)):
        if value is not None and value < least:
            raise UsageError(f"{flag} {value}: expected a value >= {least}")
    if args.time_budget is not None and not args.time_budget >= 0:
        raise UsageError(f"--time-budget {args.time_budget}: expected seconds >= 0")


def _dtype_notes(cases: Sequence[BenchCase], dtypes: Sequence[str] | None) -> list[str]:
    """For each selected case that has none of the selected dtypes, why it runs no row."""
    if dtypes is None:
        return []
    return [
        f"{c.name} has no {'/'.join(dtypes)} rows (its dtypes: {', '.join(c.dtypes)})"
        for c in cases
        if not set(c.dtypes) & set(dtypes)
    ]


def _foreseen_cpu_seconds(plan: Plan, quick: bool, timing: dict) -> float:
    """The run's rows at the CPU rates of gemmconv.terminal.long_run: per row the reference,
    the vendor (checked, then timed), the rewrite, every applicable solver, and the
    public calls (a CPU call is longer than a block: one call per block)."""
    each = 1 + timing["warmup"] + timing["reps"]
    public = 2 + 2 + 1 + timing["api"]["reps"]  # warm-up, settling round, sizing, blocks
    cpu = torch.device("cpu")
    seconds = 0.0
    for case, dtype_key, layout, direction in plan:
        shape = case.tiny if quick else case.full
        p = make_problem(shape, layout, DTYPES[dtype_key], cpu, direction)
        gemm_solvers = sum(s.is_applicable(p) and s.id != "vendor" for s in SOLVERS)
        calls = Calls(
            gemm=each * (gemm_solvers + 1) + 1 + 2 * public,
            vendor=2 * each + public,
            reference=1,
        )
        seconds += cpu_seconds(p, calls)
    return seconds


@reports_usage_errors("gemmconv bench")
def main(argv: list[str] | None = None) -> int:
    from gemmconv.bench.report import (
        check_status,
        default_stem,
        summary,
        targets_line,
        unmet_targets,
        write_results,
    )

    args = _parser().parse_args(argv)
    for flag, given in (("--api", args.api), ("--models", args.models)):
        if given:  # `gemmconv bench` routes these before the suite parses its flags
            raise UsageError(f"{flag}: a benchmark of its own; run it as `gemmconv bench {flag}`")
    _check_counts(args)
    device = bench_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    calibrate.prepare(device.type)  # the immediate picks are estimated with its rates
    cases = _pick(args.cases, {c.name: c for c in SUITE}, "cases") or list(SUITE)
    layouts = _pick(args.layouts, LAYOUT_NAMES, "layouts")
    directions = _pick(args.directions, DIRECTION_NAMES, "directions")
    dtypes = [d for d in args.dtypes.split(",") if d] or None
    if dtypes:
        _pick(args.dtypes, DTYPES, "dtypes")
    plan = suite_plan(cases, layouts, directions, dtypes)
    notes = _dtype_notes(cases, dtypes)
    if not plan:
        why = "; ".join(notes) or "--layouts or --directions selects nothing"
        raise UsageError(f"no rows to run: {why}")
    for note in notes:
        print(f"note: {note}")
    timing = {
        "warmup": args.warmup if args.warmup is not None else (1 if args.quick else 3),
        "reps": args.reps if args.reps is not None else (3 if args.quick else 20),
        # Blocks of back-to-back calls: few and short, so that timing what users pay
        # adds a fraction to the suite's time rather than a multiple.
        "api": {"reps": 2 if args.quick else 15, "block_ms": 0.5 if args.quick else 2.0},
    }
    if device.type == "cpu":
        warning = long_run_warning(
            _foreseen_cpu_seconds(plan, args.quick, timing),
            "shorten it with --quick, fewer --cases, or --reps 3",
        )
        if warning is not None:
            print(f"gemmconv bench: {warning}", file=sys.stderr)
    stem = args.name or default_stem(environment(device)["device"])

    def save_so_far(partial: dict) -> None:
        write_results(partial, args.out, stem, plot_it=False)

    with progress_bar(len(plan), desc="bench", unit="row") as bar:
        results = run_suite(cases, layouts, directions, device, args.quick, timing, dtypes,
                            args.seed, log=bar.write, on_row=save_so_far,
                            time_budget_s=args.time_budget,
                            advance=bar.update)  # fmt: skip
    paths = write_results(results, args.out, stem, plot_it=not args.no_plot)
    for path in paths:
        print(f"wrote {path}")
    if not args.no_plot and results["rows"] and not any(p.suffix == ".png" for p in paths):
        print("no png: matplotlib is not installed (pip install 'gemmconv[bench]')")
    report = paths[1].read_text()
    print(report[report.index("## Targets") :], end="")
    bad = [r for r in results["rows"] for c in r["candidates"].values() if not c["ok"]]
    if bad:
        print(f"{len(bad)} solver result(s) failed verification or raised", file=sys.stderr)
    for error in results.get("errors", []):
        print(f"row failed: {error}", file=sys.stderr)
    sys.stderr.flush()  # before the targets line, so that it stays the last one
    checked, unmet = unmet_targets(summary(results))
    print(targets_line(checked, unmet, args.quick))
    if bad or results.get("errors"):
        return 1
    return check_status(checked, unmet) if args.check else 0


__all__ = ["SUITE", "BenchCase", "main", "quick_name", "run_suite", "suite_cases", "suite_plan"]

if __name__ == "__main__":
    raise SystemExit(main())
