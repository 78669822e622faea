"""The suite's fp8 rows: a patch embed's forward+backward through the public call in fp8,
beside gemmconv's bf16, torch's convolution (cuDNN) and the reshape + linear rewrite.

Per case (Qwen2-VL's Conv3d embed at 8192 patches, ViT-B/16 at batch 256; their tiny
shapes with --quick), channels-first input, bf16: four modules with the same weights
(torch's ``nn.Conv*d``, the rewrite, ``gemmconv.nn`` and ``gemmconv.nn`` with
``set_fp8()``), each called as a training step calls a patch embed (the module on x,
then the gradients of x and the weight for one dY), timed back to back in one
interleaved run (measuring.timing, as the suite's public-call columns are). Where fp8
does not apply (the CPU, a GPU before compute capability 8.9) the row says why and
times nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from gemmconv.bench.linear_patch_embed import LinearPatchEmbed
from gemmconv.core.float8 import Float8Config

# The target: fp8's forward+backward at least this much faster than bf16's.
FP8_TARGET = 1.3
CASES = ("qwen2vl", "vit_b16")
VARIANTS = ("gemmconv fp8", "gemmconv bf16", "torch", "linear")


def _modules(shape, dims: int, device: torch.device) -> dict[str, torch.nn.Module]:
    """The four variants, one set of bf16 weights."""
    import gemmconv

    kernel = tuple(shape.kernel)
    conv = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[dims]
    generator = torch.Generator().manual_seed(0)
    weight = (
        torch.randn(shape.k, shape.c, *kernel, generator=generator)
        / (shape.c * math.prod(kernel)) ** 0.5
    )

    def made() -> torch.nn.Module:
        module = conv(shape.c, shape.k, kernel, stride=kernel, bias=False)
        with torch.no_grad():
            module.weight.copy_(weight)
        return module.to(device, torch.bfloat16)

    fp8, bf16 = made(), made()
    gemmconv.convert(fp8, fp8=Float8Config())
    gemmconv.convert(bf16)
    return {"gemmconv fp8": fp8, "gemmconv bf16": bf16, "torch": made(),
            "linear": LinearPatchEmbed(made())}  # fmt: skip


def _step(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], object]:
    weight = next(module.parameters())
    return lambda: torch.autograd.grad(module(x), (x, weight), dy)


def fp8_row(case, device: torch.device, quick: bool, reps: int, block_ms: float | None) -> dict:
    """One case's fp8 row: per variant the median ms of its forward+backward call and
    fp8's speed-up over gemmconv bf16; or, where fp8 does not apply, why."""
    from gemmconv.bench.call_timing import _interleaved_twice

    shape = case.tiny if quick else case.full
    dims = len(shape.kernel)
    modules = _modules(shape, dims, device)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape.n, shape.c, *shape.spatial, generator=generator)
    x = x.to(device, torch.bfloat16).requires_grad_()
    notes = modules["gemmconv fp8"].solvers(x).notes
    fp8_note = next((n for n in notes if n.startswith("fp8")), "")
    row = {"case": case.name, "title": case.title, "shape": _shape_text(shape), "note": fp8_note}
    if "runs all three directions" not in fp8_note:
        return {**row, "applies": False}
    with torch.no_grad():
        dy = torch.randn_like(modules["torch"](x))
    calls = {name: [_step(m, x, dy)] for name, m in modules.items()}
    times = _interleaved_twice(calls, device, reps, 2, block_ms, {})
    ms = {name: times[name].median_ms for name in VARIANTS}
    return {**row, "applies": True, "ms": ms,
            "fp8_speedup": ms["gemmconv bf16"] / ms["gemmconv fp8"]}  # fmt: skip


def _shape_text(shape) -> str:
    spatial = "x".join(map(str, shape.spatial))
    kernel = "x".join(map(str, shape.kernel))
    return f"{shape.n}x{shape.c}x{spatial} -> {shape.k}, kernel = stride = {kernel}"


def fp8_rows(
    cases: Sequence, device: torch.device, quick: bool, reps: int, block_ms: float | None,
    log: Callable[[str], None] = print,
) -> list[dict]:  # fmt: skip
    """The fp8 row of each of CASES among ``cases`` (a failing one is reported, not
    raised: it must not cost the suite its other results)."""
    rows = []
    for case in (c for c in cases if c.name in CASES):
        try:
            row = fp8_row(case, device, quick, reps, block_ms)
        except Exception as exc:
            row = {"case": case.name, "applies": False, "note": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        if row.get("applies"):
            ms = row["ms"]
            log(f"fp8 {case.name}: " + ", ".join(f"{n} {ms[n]:.4f}" for n in VARIANTS)
                + f" ms; fp8 x{row['fp8_speedup']:.2f} over bf16")  # fmt: skip
        else:
            log(f"fp8 {case.name}: not run: {row['note']}")
    return rows


def fp8_section(results: dict) -> list[str]:
    """The report's section on the fp8 rows (markdown lines; none where there are none)."""
    rows = results.get("fp8_rows") or []
    if not rows:
        return []
    lines = [
        "## fp8 patch embeds (forward+backward, the public call)",
        "",
        "Each variant's module called as a training step calls a patch embed (the module, "
        "then the gradients of x and the weight), back to back in one interleaved run, "
        "median ms per call; 'x bf16' is gemmconv bf16's time over fp8's (target "
        f">= {FP8_TARGET}).",
        "",
        "| case | shape | gemmconv fp8 | gemmconv bf16 | torch | linear | x bf16 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r.get("applies"):
            lines.append(f"| {r['case']} | {r.get('shape', '')} | not run: {r['note']} | | | | |")
            continue
        ms = r["ms"]
        lines.append(
            f"| {r['case']} | {r['shape']} | "
            + " | ".join(f"{ms[n]:.4f}" for n in VARIANTS)
            + f" | {r['fp8_speedup']:.2f} |"
        )
    return [*lines, ""]


def under_target(results: dict) -> list[str]:
    """The fp8 rows that ran and are less than FP8_TARGET x faster than bf16."""
    return [
        r["case"]
        for r in results.get("fp8_rows") or []
        if r.get("applies") and r["fp8_speedup"] < FP8_TARGET
    ]


__all__ = ["CASES", "FP8_TARGET", "fp8_row", "fp8_rows", "fp8_section", "under_target"]
