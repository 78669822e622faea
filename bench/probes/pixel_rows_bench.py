"""Device time (a diagnostic) of the channels-first rows path, with and without the GEMM
that reads or writes the channels-first side in place, per tile configuration.

For each case: the gather, cuBLAS's GEMM on rows and the transpose kernel (the path
before kernels/pixel_rows_gemm.py) against the gather and the in-place GEMM, for the
forward; the transpose, cuBLAS's GEMM and the scatter against the in-place GEMM and
the scatter, for backward-data; the transpose of dY and cuBLAS's GEMM on the columns
against the in-place weight-gradient kernel with its slice sum (dW from a forward's
kept columns), per tile configuration and slice count; and each GEMM alone (the
in-place kernel against torch.mm on rows: rows_path.IN_PLACE_GEMM_SLOWDOWN). Times
are triton.testing.do_bench medians in ms (L2 flushed between repetitions). One line
per row, flushed as it is written. Run on a GPU machine from the repository root:
    PYTHONPATH=src python3 bench/probes/pixel_rows_bench.py [--configs all|default]
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton.testing

from gemmconv.core.problem import ConvProblem
from gemmconv.kernels import pixel_rows_gemm, split_programs
from gemmconv.kernels.strided_copy import strided_copy
from gemmconv.kernels.tiles import TileConfig
from gemmconv.solvers.patch.columns import TRITON_COPY_COLUMNS

# (name, batch, channels in, image side, patch side, channels out): ViT-B/16 and the
# 8-byte pixel runs it was tuned on, ViT-B/32's one-element runs, and three suite cases
# whose 16-byte runs (4096, 256 and 784 pixels a sample) the first runs never timed.
CASES = [
    ("vit_b16", 256, 3, 224, 16, 768),
    ("vit_b32", 256, 3, 224, 32, 768),
    ("vit_b16_b64", 64, 3, 224, 16, 768),
    ("sam_vit_h", 8, 3, 1024, 16, 1280),
    ("dit_xl2", 256, 4, 32, 2, 1152),
    ("convnext_down", 128, 192, 56, 2, 384),
]
CONFIGS = [
    TileConfig(128, 128, 64, 8, 3),
    TileConfig(128, 128, 64, 8, 4),
    TileConfig(128, 128, 64, 4, 4),
    TileConfig(128, 256, 64, 8, 3),
    TileConfig(64, 128, 64, 4, 4),
    TileConfig(256, 128, 64, 8, 3),
]

# The weight gradient's: block_m is the slice of M one step reduces.
WGRAD_CONFIGS = [
    TileConfig(64, 128, 128, 8, 3),
    TileConfig(64, 128, 128, 4, 4),
    TileConfig(32, 128, 128, 4, 4),
    TileConfig(64, 128, 64, 4, 4),
    TileConfig(64, 256, 128, 8, 3),
]


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def _case(name, n, c, side, patch, k, dtype, configs) -> None:
    device = torch.device("cuda")
    x = torch.randn(n, c, side, side, device=device, dtype=dtype)
    w = torch.randn(k, c, patch, patch, device=device, dtype=dtype)
    p = ConvProblem.from_sizes(n, c, k, (side, side), (patch, patch), (patch, patch),
                               dtype=dtype, device_type="cuda")  # fmt: skip
    ld, pixels = p.gemm_k, (side // patch) ** 2
    wm = w.view(k, -1)
    col = TRITON_COPY_COLUMNS.gather(x, p, ld)
    y_rows = torch.empty(n * pixels, k, device=device, dtype=dtype)
    y3 = torch.empty(n, k, pixels, device=device, dtype=dtype)
    dy3 = torch.randn(n, k, pixels, device=device, dtype=dtype)
    dy_rows = torch.empty(n * pixels, k, device=device, dtype=dtype)
    dcol = torch.empty(n * pixels, ld, device=device, dtype=dtype)
    dx = torch.empty_like(x)

    def old_forward():
        c = TRITON_COPY_COLUMNS.gather(x, p, ld, out=col)
        torch.mm(c, wm.t(), out=y_rows)
        strided_copy(y3.transpose(1, 2), y_rows.view(n, pixels, k))

    def old_backward_data():
        strided_copy(dy_rows.view(n, pixels, k), dy3.transpose(1, 2))
        torch.mm(dy_rows, wm, out=dcol)
        TRITON_COPY_COLUMNS.scatter(dcol, p, dx)

    base = {
        "gather": _ms(lambda: TRITON_COPY_COLUMNS.gather(x, p, ld, out=col)),
        "mm_rows": _ms(lambda: torch.mm(col, wm.t(), out=y_rows)),
        "transpose": _ms(lambda: strided_copy(y3.transpose(1, 2), y_rows.view(n, pixels, k))),
        "old_forward": _ms(old_forward),
        "mm_dgrad": _ms(lambda: torch.mm(dy_rows, wm, out=dcol)),
        "old_backward_data": _ms(old_backward_data),
        "mm_wgrad": _ms(lambda: torch.mm(dy_rows.t(), col)),
        "old_weight_gradient": _ms(lambda: torch.mm(_rows(dy3, dy_rows).t(), col)),
    }
    print(f"{name} {str(dtype)[6:]} n={n} P={pixels} Kred={ld}: "
          + " ".join(f"{key}={v:.4f}" for key, v in base.items()), flush=True)  # fmt: skip
    for cfg in configs:
        pixel_rows_gemm.TILES[dtype] = cfg
        pixel_rows_gemm._launches.clear()
        try:
            fwd_gemm = _ms(lambda: pixel_rows_gemm.rows_into_channels_first(col, wm, None, y3))
            dgrad_gemm = _ms(lambda: pixel_rows_gemm.channels_first_into_rows(dy3, wm, dcol))

            def new_forward():
                c = TRITON_COPY_COLUMNS.gather(x, p, ld, out=col)
                pixel_rows_gemm.rows_into_channels_first(c, wm, None, y3)

            def new_backward_data():
                pixel_rows_gemm.channels_first_into_rows(dy3, wm, dcol)
                TRITON_COPY_COLUMNS.scatter(dcol, p, dx)

            new_fwd, new_bwd = _ms(new_forward), _ms(new_backward_data)
            want = (col.float() @ wm.float().t()).view(n, pixels, k).transpose(1, 2)
            pixel_rows_gemm.rows_into_channels_first(col, wm, None, y3)
            err = (y3.float() - want).abs().max().item()
        except Exception as exc:  # a configuration that does not compile: say so, go on
            _failed("", cfg, exc)
            continue
        print(f"  {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}: "
              f"fwd_gemm={fwd_gemm:.4f} ({fwd_gemm / base['mm_rows']:.2f}x mm) "
              f"dgrad_gemm={dgrad_gemm:.4f} ({dgrad_gemm / base['mm_dgrad']:.2f}x mm) "
              f"forward={new_fwd:.4f} (old {base['old_forward']:.4f}) "
              f"backward_data={new_bwd:.4f} (old {base['old_backward_data']:.4f}) "
              f"max_err={err:.3g}", flush=True)  # fmt: skip
    _weight_gradient(dy3, col, base, configs)


def _failed(label: str, cfg: TileConfig, exc: Exception) -> None:
    print(f"  {label}{cfg}: failed {type(exc).__name__}: {exc}"[:300], flush=True)


def _rows(dy3: torch.Tensor, dy_rows: torch.Tensor) -> torch.Tensor:
    n, k, pixels = dy3.shape
    strided_copy(dy_rows.view(n, pixels, k), dy3.transpose(1, 2))
    return dy_rows


def _weight_gradient(dy3, col, base, configs) -> None:
    """The in-place weight gradient per tile configuration (the first of configs is
    WGRAD_TILES's when configs is the default list) and slice count."""
    n, k, pixels = dy3.shape
    dtype, ld = dy3.dtype, col.shape[1]
    out = torch.empty(k, ld, device=dy3.device, dtype=dtype)
    want = dy3.float().transpose(1, 2).reshape(n * pixels, k).t() @ col.float()
    default = pixel_rows_gemm.WGRAD_TILES[dtype]
    for cfg in WGRAD_CONFIGS if len(configs) > 1 else [default]:
        pixel_rows_gemm.WGRAD_TILES[dtype] = cfg
        chosen = pixel_rows_gemm.weight_gradient_splits(n * pixels, k, ld, dtype,
                                                        split_programs(dy3.device))  # fmt: skip
        for splits in sorted({1, max(1, chosen // 2), chosen, 2 * chosen}):
            pixel_rows_gemm._launches.clear()
            try:
                run = functools.partial(pixel_rows_gemm.channels_first_weight_gradient,
                                        dy3, col, out, splits)  # fmt: skip
                ms = _ms(run)
                err = (out.float() - want).abs().max().item()
            except Exception as exc:  # a configuration that does not compile: say so, go on
                _failed("wgrad ", cfg, exc)
                break
            print(f"  wgrad {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} "
                  f"s{cfg.num_stages} splits={splits}{' (chosen)' if splits == chosen else ''}: "
                  f"{ms:.4f} ({ms / base['mm_wgrad']:.2f}x mm; transpose + mm "
                  f"{base['old_weight_gradient']:.4f}) max_err={err:.3g}", flush=True)  # fmt: skip
    pixel_rows_gemm.WGRAD_TILES[dtype] = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", choices=["all", "default"], default="all")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton",
          triton.__version__, flush=True)  # fmt: skip
    for dtype in (torch.bfloat16, torch.float16):
        default = pixel_rows_gemm.TILES[dtype]
        configs = CONFIGS if args.configs == "all" else [default]
        for case in CASES:
            _case(*case, dtype, configs if dtype == torch.bfloat16 else [default])
        pixel_rows_gemm.TILES[dtype] = default


if __name__ == "__main__":
    main()
