"""The whole-sample rows forward with both operands loaded by TMA boxes.

Where every patch is a whole sample whose memory is dense in the column order (one patch
a sample: Qwen2-VL's and Qwen3-VL's [2, 14, 14] and [2, 16, 16] video patches, point
3D), the column matrix is x itself as [M, Kred] rows, and y [M, K] = x_rows @ W^T (+ b).
patch_gemm's forward loads those rows through pointers; with rows of 16-byte multiples
the tensor memory accelerator loads them, and the weight's, as plain 2-D boxes. On an
H100 at a17f7c4 (bench/probes/results/boxed_gemm_h100.txt, device time) this ran
Qwen2-VL's forward (8192 x 1176 -> 1280) in 69 us against 111 for the pointer kernel
and 42 for cuBLAS, point 3D's in 73 against 120 and 51, Qwen3-VL's (1536 -> 1152) in 60
against 67 and 44, with the same bits as the pointer kernel: both sum the reduction in
the same 16-wide matrix-instruction steps, in order, into fp32.

Its tiles depend on the output width alone and it has no split-K, so a sample's row
is summed the same way in any batch. TMA arrived with compute capability 9.0; its
descriptors need 16-byte aligned bases. No solver runs it yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmconv.kernels import compiled
from gemmconv.kernels.program_order import grouped_tile
from gemmconv.kernels.tiles import TileConfig

# TMA's rule for a box's global memory: the base and every stride but the innermost
# 16-byte aligned.
TMA_ALIGNMENT = 16


def _rows_kernel(
    x_desc, w_desc, b_ptr, y_ptr,
    M, KOUT, KRED, YSM, YSC, BS,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """y[m, k] = sum over r of x[m, r] * w[k, r] (+ b[k]); rows past M and reduction
    columns past KRED read as zeros (TMA's bounds)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, KOUT, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    k0 = pid_n * BLOCK_N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for r0 in range(0, KRED, BLOCK_K):
        acc = tl.dot(x_desc.load([m0, r0]), w_desc.load([k0, r0]).T, acc)
    m = m0 + tl.arange(0, BLOCK_M)
    kout = k0 + tl.arange(0, BLOCK_N)
    k_ok = kout < KOUT
    if HAS_BIAS:
        acc += tl.load(b_ptr + kout * BS, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    offsets = m[:, None].to(tl.int64) * YSM + kout[None, :].to(tl.int64) * YSC
    tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & k_ok[None, :])  # fmt: skip


# 256 output channels a tile where they divide the width: Qwen2-VL's 1280 ran 69 us with
# them against 74-79 with 128 (point 3D 73 against 88); Qwen3-VL's 1152 ran 71 with them
# against 60 with NARROW_TILES (the H100 run above).
WIDE_TILES = TileConfig(128, 256, 64, 8, 3)
NARROW_TILES = TileConfig(128, 128, 64, 4, 4)


def rows_tiles(kout: int) -> TileConfig:
    """The tiles for an output ``kout`` channels wide (never the row count's)."""
    return WIDE_TILES if kout % WIDE_TILES.block_n == 0 else NARROW_TILES


def rows_apply(x_rows: torch.Tensor, weight_rows: torch.Tensor) -> list[str]:
    """Why TMA cannot box these [M, Kred] rows and [K, Kred] weight rows (empty: it
    can): unit column strides and row strides of 16-byte multiples. The bases'
    alignment is each call's (``bases_aligned``)."""
    reasons = []
    for name, t in (("x_rows", x_rows), ("weight_rows", weight_rows)):
        if t.dim() != 2 or t.stride(1) != 1:
            reasons.append(f"{name} {tuple(t.shape)} with strides {t.stride()}: expected rows "
                           "with unit column stride")  # fmt: skip
        elif (t.stride(0) * t.element_size()) % TMA_ALIGNMENT:
            reasons.append(f"{name}'s rows of stride {t.stride(0)} are not 16-byte aligned")
    return reasons


def bases_aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % TMA_ALIGNMENT == 0 for t in tensors)


def boxed_rows_forward(
    x_rows: torch.Tensor,
    weight_rows: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """out[M, K] (any strides) = x_rows @ weight_rows^T (+ bias), both read by TMA boxes
    (``rows_apply``; 16-byte aligned bases). Returns out. The tiles are for half
    precision; fp32 operands (the CPU tests') multiply in TF32 on a GPU, tl.dot's
    default."""
    reasons = rows_apply(x_rows, weight_rows)
    if not bases_aligned(x_rows, weight_rows):
        reasons.append("x_rows or weight_rows does not start 16-byte aligned")
    if reasons:
        raise ValueError("; ".join(reasons))
    m, reduction = x_rows.shape
    kout = weight_rows.shape[0]
    if weight_rows.shape[1] != reduction:
        raise ValueError(f"weight_rows {tuple(weight_rows.shape)}: expected [{kout}, {reduction}]")
    if tuple(out.shape) != (m, kout):
        raise ValueError(f"out {tuple(out.shape)}: expected [{m}, {kout}]")
    if bias is not None and bias.shape != (kout,):
        raise ValueError(f"bias {tuple(bias.shape)}: expected [{kout}]")
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = rows_tiles(kout)
    x_desc = TensorDescriptor(x_rows, [m, reduction], [x_rows.stride(0), 1],
                              [cfg.block_m, cfg.block_k])  # fmt: skip
    w_desc = TensorDescriptor(weight_rows, [kout, reduction], [weight_rows.stride(0), 1],
                              [cfg.block_n, cfg.block_k])  # fmt: skip
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(kout, cfg.block_n),)
    compiled(_rows_kernel, x_rows.device)[grid](
        x_desc, w_desc, out if bias is None else bias, out,
        m, kout, reduction, out.stride(0), out.stride(1), 1 if bias is None else bias.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=8, **cfg.launch_options(),
    )  # fmt: skip
    return out


__all__ = [
    "NARROW_TILES",
    "TMA_ALIGNMENT",
    "WIDE_TILES",
    "bases_aligned",
    "boxed_rows_forward",
    "rows_apply",
    "rows_tiles",
]
