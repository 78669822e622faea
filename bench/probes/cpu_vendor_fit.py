"""Fit the CPU entry's vendor factors to find's call times here.

For each problem of a set, layout and direction, find times every applicable
solver's call as a user makes it, the times find ranks by. Two sets: ``small_patch``
(released models' patchifies of fewer than 16 taps, at sizes a CPU runs) and
``general`` (1x1, strided 1x1 and the convolutions no patch rule takes: ResNet's,
a depthwise 7x7, a VAE's 3x3, 1-D audio front ends, a 3-D 3x3x3); ``half`` takes one
problem of each class for a dtype's scale on every factor (``--dtype bf16``). In fp32
each row implies the vendor factor at which the
cost model prices torch's convolution against the fastest GEMM solver as the calls
do. The CPU entry's rates are conservative (0.1 TFLOP/s and 10 GB/s, where this
2-core machine measured 0.2 and 48), so the vendor is priced at the same ratio of
estimate to call time as that GEMM solver, and a factor can exceed 1.

Per factor it prints the implied values and the value chosen: their median, moved to
the nearest value at which immediate mode's pick (dispatch.decide) runs within 10% of
the fastest call on as many of the factor's rows as any value does. With --out, a
JSON line per row (the tests' copies: tests/data/cpu_small_patch_calls.jsonl and
tests/data/cpu_general_calls.jsonl).

    PYTHONPATH=src python bench/probes/cpu_vendor_fit.py --set general --out rows.jsonl
    PYTHONPATH=src python bench/probes/cpu_vendor_fit.py --rows rows.jsonl  # refit only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import tempfile
from collections import defaultdict

import torch

import gemmconv
from gemmconv.bench.suite import DIRECTION_NAMES, LAYOUT_NAMES
from gemmconv.core.device_rates import CPU, DeviceRates
from gemmconv.core.problem import ConvProblem
from gemmconv.selection import dispatch
from gemmconv.solvers import get_solver
from gemmconv.solvers.vendor import vendor_factor

CPU_DEVICE = torch.device("cpu")
DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


@dataclasses.dataclass(frozen=True)
class Conv:
    """A problem's sizes and arguments; stride None means stride == kernel (a patch)."""

    n: int
    c: int
    k: int
    spatial: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...] | None = None
    padding: tuple[int, ...] | None = None
    groups: int = 1


# fp32.
PROBLEM_SETS = {
    "small_patch": {
        # diffusers' SD3 PatchEmbed (16 latent channels, 2x2, 1536 wide) at a 512px image.
        "sd3_512": Conv(1, 16, 1536, (64, 64), (2, 2)),
        # DiT-XL/2 (4 latent channels, 2x2, 1152 wide) at 256px, batch 8.
        "dit_xl2_b8": Conv(8, 4, 1152, (32, 32), (2, 2)),
        # ConvNeXt's 2x2 downsample (192 -> 384 at 56x56, as the suite's), batch 4.
        "convnext_down_b4": Conv(4, 192, 384, (56, 56), (2, 2)),
        # Wan 2.1 1.3B's (1, 2, 2) latent patchify (16 channels -> 1536), a short clip.
        "wan21_1_3b": Conv(1, 16, 1536, (5, 30, 52), (1, 2, 2)),
    },
    "general": {
        # ResNet-50's bottleneck 1x1s at batch 4: reduce, expand, and a strided downsample.
        "resnet50_reduce_b4": Conv(4, 256, 64, (56, 56), (1, 1), (1, 1), (0, 0)),
        "resnet50_expand_b4": Conv(4, 64, 256, (56, 56), (1, 1), (1, 1), (0, 0)),
        "resnet_down_1x1_b4": Conv(4, 128, 256, (28, 28), (1, 1), (2, 2), (0, 0)),
        # ResNet's 7x7 stem and 3x3s, stride 1 and 2, batch 4.
        "resnet_stem_b4": Conv(4, 3, 64, (224, 224), (7, 7), (2, 2), (3, 3)),
        "resnet_3x3_b4": Conv(4, 64, 64, (56, 56), (3, 3), (1, 1), (1, 1)),
        "resnet_3x3_s2_b4": Conv(4, 128, 256, (28, 28), (3, 3), (2, 2), (1, 1)),
        # ConvNeXt's depthwise 7x7 (96 channels at 56x56), batch 4.
        "convnext_dw7_b4": Conv(4, 96, 96, (56, 56), (7, 7), (1, 1), (3, 3), groups=96),
        # A VAE decoder's 3x3 (128 channels at 64x64), batch 1.
        "vae_3x3": Conv(1, 128, 128, (64, 64), (3, 3), (1, 1), (1, 1)),
        # Whisper-tiny's second 1-D convolution (384 -> 384, k3 s2) over 30 s of audio.
        "whisper_conv2": Conv(1, 384, 384, (3000,), (3,), (2,), (1,)),
        # A video UNet's 3x3x3 (64 channels, 8 frames of 32x32), batch 1.
        "video_3x3x3": Conv(1, 64, 64, (8, 32, 32), (3, 3, 3), (1, 1, 1), (1, 1, 1)),
    },
}
# For half precision, whose scale on every class's factor is fitted at once: the CPU
# table's large patches (ViT-B/16 at batch 8, a point patch per sample) and one problem
# of each other class.
PROBLEM_SETS["half"] = {
    "vit_b16_b8": Conv(8, 3, 768, (224, 224), (16, 16)),
    "point_950": Conv(950, 3, 1280, (14, 14), (14, 14)),
    **{name: PROBLEM_SETS["small_patch"][name] for name in ("sd3_512", "convnext_down_b4")},
    **{name: PROBLEM_SETS["general"][name]
       for name in ("resnet50_reduce_b4", "resnet_down_1x1_b4", "resnet_3x3_b4", "whisper_conv2")},
}  # fmt: skip
# A pick within this fraction of the fastest call counts as right.
TOLERANCE = 0.10
# The values tried: two significant digits from 0.10 to 9.9.
GRID = [m * 10.0**e for e in (-2, -1) for m in range(10, 100)]


def conv_of(shape: dict) -> Conv:
    """A row's "shape" as a Conv (rows of the small-patch set carry no stride)."""
    tuples = {f: tuple(shape[f]) for f in ("spatial", "kernel", "stride", "padding")
              if shape.get(f) is not None}  # fmt: skip
    return Conv(shape["n"], shape["c"], shape["k"], **tuples, groups=shape.get("groups", 1))


def problem_of(row: dict) -> ConvProblem:
    """A row's problem (the tests rebuild rows the same way)."""
    conv = conv_of(row["shape"])
    return ConvProblem.from_sizes(
        n=conv.n, c=conv.c, k=conv.k, spatial=conv.spatial, kernel=conv.kernel,
        stride=conv.stride or conv.kernel, padding=conv.padding or 0, groups=conv.groups,
        layout=LAYOUT_NAMES[row["layout"]], dtype=DTYPES[row["dtype"]], device_type="cpu",
        direction=DIRECTION_NAMES[row["direction"]],
    )  # fmt: skip


def measure_row(name: str, conv: Conv, layout_name: str, direction_name: str,
                dtype_name: str = "fp32") -> dict:  # fmt: skip
    """Find's call time of every applicable solver on one problem, layout and direction."""
    x = torch.randn(conv.n, conv.c, *conv.spatial, dtype=DTYPES[dtype_name])
    w = torch.randn(conv.k, conv.c // conv.groups, *conv.kernel, dtype=DTYPES[dtype_name])
    if layout_name == "cl":
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
        if fmt is None:  # 1-D: channels-last is a transposed [N, L, C] view
            x, w = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x, w))
        else:
            x, w = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)
    direction = DIRECTION_NAMES[direction_name]
    with gemmconv.find_mode("find"):
        choices = gemmconv.explain(x, w, stride=conv.stride or conv.kernel,
                                   padding=conv.padding or 0, groups=conv.groups)  # fmt: skip
    choice = choices[direction.value]
    return {
        "problem": name, "shape": dataclasses.asdict(conv), "layout": layout_name,
        "direction": direction_name, "dtype": dtype_name,
        "calls_ms": {s: round(v, 4) for s, v in choice.times_ms.items()},
    }  # fmt: skip


def implied_factor(row: dict, rates: DeviceRates = CPU) -> float:
    """The factor at which the vendor's estimated call stands to the fastest GEMM
    solver's estimate as their call times stand."""
    p, calls = problem_of(row), row["calls_ms"]
    gemm = min((s for s in calls if s != "vendor"), key=calls.get)
    vendor, current = get_solver("vendor"), rates.factor(vendor_factor(p))
    floor = vendor.work_ms(p, rates) * current
    fixed = vendor.call_ms(p, rates) - vendor.work_ms(p, rates)
    scale = get_solver(gemm).call_ms(p, rates) / calls[gemm]
    return floor / (calls["vendor"] * scale - fixed)


def pick(row: dict, rates: DeviceRates) -> str:
    """Immediate mode's pick among the row's measured solvers."""
    solvers = [get_solver(s) for s in row["calls_ms"]]
    return dispatch.decide(problem_of(row), solvers, rates).solver


def _right_under(rows: list[dict], rates: DeviceRates) -> int:
    """How many rows pick within TOLERANCE of their fastest call with ``rates``."""
    return sum(
        r["calls_ms"][pick(r, rates)] <= (1 + TOLERANCE) * min(r["calls_ms"].values()) for r in rows
    )


def right_picks(rows: list[dict], name: str, value: float) -> int:
    """How many rows pick within TOLERANCE of their fastest call with ``name`` at
    ``value``."""
    return _right_under(rows, dataclasses.replace(CPU, factors={**CPU.factors, name: value}))


def right_picks_scaled(rows: list[dict], dtype_name: str, scale: float) -> int:
    """How many rows pick within TOLERANCE of their fastest call with every vendor
    factor scaled by ``scale`` for ``dtype_name``."""
    scales = {**CPU.vendor_dtype_scale, dtype_name: scale}
    return _right_under(rows, dataclasses.replace(CPU, vendor_dtype_scale=scales))


def chosen_scale(rows: list[dict], dtype_name: str) -> tuple[float, int]:
    """The scale of GRID whose fewest right picks within 10% of it are the most (a
    scale is known to no better than that: bf16's 47 at 0.52 fell to 43 at 0.56),
    nearest 1 among ties; and its own count."""
    counts = {v: right_picks_scaled(rows, dtype_name, v) for v in GRID}
    worst = {v: min(c for u, c in counts.items() if abs(u / v - 1) <= 0.1) for v in GRID}
    top = max(worst.values())
    best = min((v for v in GRID if worst[v] == top), key=lambda v: abs(math.log(v)))
    return best, counts[best]


def chosen_value(rows: list[dict], name: str) -> tuple[float, int]:
    """The median implied factor, moved to the nearest value of GRID with the most
    right picks; and that count."""
    median = statistics.median(implied_factor(r) for r in rows)
    counts = {v: right_picks(rows, name, v) for v in GRID}
    top = max(counts.values())
    if right_picks(rows, name, median) == top:
        return float(f"{median:.2g}"), top
    return min((v for v in GRID if counts[v] == top), key=lambda v: abs(v - median)), top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="a JSON line per measured row")
    parser.add_argument("--rows", help="refit to these rows (a file --out wrote) instead")
    parser.add_argument("--set", choices=sorted(PROBLEM_SETS), default="small_patch")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if args.rows:
        with open(args.rows) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        rows = []
        if args.out:
            open(args.out, "w").close()  # each row is appended as it is measured
        with tempfile.TemporaryDirectory() as folder:
            os.environ["GEMMCONV_DB"] = os.path.join(folder, "find.sqlite")
            for name, conv in PROBLEM_SETS[args.set].items():
                for layout_name in ("cf", "cl"):
                    for direction_name in DIRECTION_NAMES:
                        row = measure_row(name, conv, layout_name, direction_name, args.dtype)
                        rows.append(row)
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps(rows[-1]) + "\n")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    half = {r["dtype"] for r in rows} - {"fp32"}
    if half:
        (dtype_name,) = half
        scale, right = chosen_scale(rows, dtype_name)
        now = CPU.vendor_dtype_scale.get(dtype_name, 1.0)
        for row in rows:
            calls = " ".join(f"{s} {v:.3f}" for s, v in row["calls_ms"].items())
            print(f"{row['problem']} {row['layout']} {row['direction']}: {calls} ms; "
                  f"picks {pick(row, CPU)}")  # fmt: skip
        print(f"{dtype_name} scale on every vendor factor: now {now} "
              f"({right_picks_scaled(rows, dtype_name, now)} of {len(rows)} right); "
              f"chosen {scale} ({right} right)")  # fmt: skip
        return
    by_factor = defaultdict(list)
    for row in rows:
        by_factor[vendor_factor(problem_of(row))].append(row)
        calls = " ".join(f"{s} {v:.3f}" for s, v in row["calls_ms"].items())
        print(f"{row['problem']} {row['layout']} {row['direction']}: {calls} ms; "
              f"picks {pick(row, CPU)}; implied {implied_factor(row):.3g}")  # fmt: skip
    for name, rows_of in sorted(by_factor.items()):
        implied = ", ".join(f"{implied_factor(r):.3g}" for r in rows_of)
        value, right = chosen_value(rows_of, name)
        now = CPU.factor(name)
        print(f"{name}: now {now} ({right_picks(rows_of, name, now)} of {len(rows_of)} "
              f"right), implied {implied}; chosen {value} ({right} right)")  # fmt: skip


if __name__ == "__main__":
    main()
