"""A GEMM over pixel rows whose one side is a channels-first tensor, read or written in place.

The patch solvers' GEMMs have one row per output pixel. A channels-first y or dY
[N, K, P] holds those rows transposed, sample by sample: element (m, k) of the row
matrix sits at n * sN + k * sK + p, with m = n * P + p. The rows path
(solvers/patch/rows_path.py) otherwise moves it to or from real rows with the
transpose kernel around cuBLAS's GEMM: on an H100, 75 us of ViT-B/16's 222 us forward,
and a second buffer of y's size. Here the GEMM reads A or writes C through that map:

- forward: C = y [N, K, P] = col [M, Kred] @ W[K, Kred]^T (+ bias), stored in place;
- backward-data: C = dcol [M, Kred] = dY [N, K, P] as A [M, K] @ W [K, Kred];
- backward-weights: dW rows [K, Kred] = dY as rows, transposed, @ col: the reduction
  over M is cut into slices, each an fp32 partial, summed in fp32 in a fixed order
  and rounded once (as cuBLAS's one fp32-accumulated GEMM is), so no run depends on
  scheduling.

Pixels are contiguous, so a channels-first side is read and written in runs along M.
Triton cannot see runs through the division by P, so the kernel states them: with
``RUN`` a power of two dividing P and the sample and channel strides, every aligned
group of RUN rows is RUN consecutive elements starting at a multiple of RUN, which
lets those accesses be vectorised and coalesced (without it each element is its own
2-byte access). Rows past M are read as rows of the start (m mod M, which keeps the
runs, M being a multiple of RUN) and never stored, so loads need no row mask; columns
past N are masked (N is specialised on, so the mask does not stop vectorising).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmconv.kernels.launch import LaunchCache, PreparedLaunch, TensorSlot

# The operand checks, launch keys and dot precision of the patch GEMMs hold here too.
from gemmconv.kernels.patch_gemm import (
    _check,
    _meta,
    _precision,
    reduction_slices,
)
from gemmconv.kernels.patch_index import DeviceHelper
from gemmconv.kernels.program_order import grouped_tile
from gemmconv.kernels.tiles import TileConfig

# Tiles per dtype: for half precision the fastest of six on an H100 for ViT-B/16's rows
# at batch 256 (bench/probes/pixel_rows_bench.py: forward 1.45x cuBLAS's GEMM, against
# 1.60-1.79x for the others), fp32's half as deep.
TILES = {
    torch.float16: TileConfig(128, 256, 64, 8, 3),
    torch.bfloat16: TileConfig(128, 256, 64, 8, 3),
    torch.float32: TileConfig(128, 64, 32, 8, 3),
}
# The weight gradient's tiles: block_m is the slice of M one step reduces, block_n
# the output channels and block_k the column-matrix columns of one program.
WGRAD_TILES = {
    torch.float16: TileConfig(64, 128, 128, 8, 3),
    torch.bfloat16: TileConfig(64, 128, 128, 8, 3),
    torch.float32: TileConfig(32, 64, 64, 8, 3),
}
# Elements one program of the partial sum adds up.
_SUM_BLOCK = 1024
# The widest access the run claim is made for: one 16-byte vector.
_VECTOR_BYTES = 16
# The rows and the pixel count are not specialised on (a new batch or image size would
# recompile); strides, N and the reduction are: their divisibility proves the
# alignment that vector loads and stores of a row-major side need, masks included.
_NOT_SPECIALISED = ("M", "PIXELS")
_WGRAD_NOT_SPECIALISED = ("M", "PIXELS", "M_PER_SPLIT")


def _pixel_rows_gemm_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr,
    M, N, KRED, PIXELS,
    A_SM, A_SK, B_SN, B_SK, C_SM, C_SN, BS,
    A_CHANNELS_FIRST: tl.constexpr,
    C_CHANNELS_FIRST: tl.constexpr,
    RUN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """C[M, N] = A[M, KRED] @ B[KRED, N] (+ bias[N]). A row-major side's element
    (m, j) is at m * S_M + j * S_J; a channels-first side's at
    (m // PIXELS) * S_M + j * S_J + m % PIXELS (S_M the sample stride, S_J the
    channel stride). B's element (j, n) is at n * B_SN + j * B_SK."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    m0 = pid_m * BLOCK_M
    m = m0 + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_read = (m % M).to(tl.int64)
    n_ok = n < N
    n64 = n.to(tl.int64)
    if A_CHANNELS_FIRST:
        a_rows = (m_read // PIXELS) * A_SM + m_read % PIXELS
        if RUN > 1:
            a_rows = tl.max_contiguous(tl.multiple_of(a_rows, RUN), RUN)
    else:
        a_rows = m_read * A_SM

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, KRED, BLOCK_K):
        j = k0 + tl.arange(0, BLOCK_K)
        j_ok = j < KRED
        a_cols = j.to(tl.int64) * A_SK
        if A_CHANNELS_FIRST and RUN > 1:
            a_cols = tl.multiple_of(a_cols, RUN)
        a = tl.load(a_ptr + a_rows[:, None] + a_cols[None, :], mask=j_ok[None, :], other=0.0)
        b = tl.load(b_ptr + n64[None, :] * B_SN + j[:, None].to(tl.int64) * B_SK,
                    mask=j_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + n * BS, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(c_ptr.dtype.element_ty)
    m64 = m.to(tl.int64)
    c_cols = n64 * C_SN
    if C_CHANNELS_FIRST:
        c_rows = (m64 // PIXELS) * C_SM + m64 % PIXELS
        if RUN > 1:
            c_rows = tl.max_contiguous(tl.multiple_of(c_rows, RUN), RUN)
            c_cols = tl.multiple_of(c_cols, RUN)
    else:
        c_rows = m64 * C_SM
    c = c_ptr + c_rows[:, None] + c_cols[None, :]
    if m0 + BLOCK_M <= M:
        tl.store(c, out, mask=n_ok[None, :])  # whole rows: no row mask to stop vectorising
    else:
        tl.store(c, out, mask=(m < M)[:, None] & n_ok[None, :])


def _wgrad_step_operands(
    dy_ptr, col_ptr, m0, m_end, PIXELS, DY_SN, COL_SM, dy_cols, col_cols, n_ok, j_ok,
    RUN: tl.constexpr, BLOCK_M: tl.constexpr, PART: tl.constexpr,
):  # fmt: skip
    """One step's dY tile [channels, rows m0..m0+BLOCK_M) and column tile [rows,
    columns]; in a part step (PART) the rows from m_end on are masked to zero."""
    m = m0 + tl.arange(0, BLOCK_M)
    # The division runs in 32 bits (M fits): in 64 it is a long software routine.
    sample = m // PIXELS
    dy_rows = sample.to(tl.int64) * DY_SN + (m - sample * PIXELS)
    if RUN > 1:
        dy_rows = tl.max_contiguous(tl.multiple_of(dy_rows, RUN), RUN)
    col_rows = m.to(tl.int64) * COL_SM
    if PART:
        m_ok = m < m_end
        a = tl.load(dy_ptr + dy_cols[:, None] + dy_rows[None, :],
                    mask=n_ok[:, None] & m_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(col_ptr + col_rows[:, None] + col_cols[None, :],
                    mask=m_ok[:, None] & j_ok[None, :], other=0.0)  # fmt: skip
    else:
        a = tl.load(dy_ptr + dy_cols[:, None] + dy_rows[None, :], mask=n_ok[:, None], other=0.0)
        b = tl.load(col_ptr + col_rows[:, None] + col_cols[None, :], mask=j_ok[None, :],
                    other=0.0)  # fmt: skip
    return a, b


wgrad_step_operands = DeviceHelper(_wgrad_step_operands)


def _pixel_rows_wgrad_kernel(
    dy_ptr, col_ptr, out_ptr,
    M, KOUT, KRED, PIXELS, M_PER_SPLIT,
    DY_SN, DY_SK, COL_SM, COL_SK, OUT_SS, OUT_SN, OUT_SK,
    RUN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[split, n, j] = sum over the split's rows m of dY(m, n) * col(m, j), dY
    channels-first [N, KOUT, P] (element (m, n) at (m // PIXELS) * DY_SN + n * DY_SK +
    m % PIXELS), col row-major; accumulated in fp32 and stored as out's dtype."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    split = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = n < KOUT
    j_ok = j < KRED
    dy_cols = n.to(tl.int64) * DY_SK
    if RUN > 1:
        dy_cols = tl.multiple_of(dy_cols, RUN)
    col_cols = j.to(tl.int64) * COL_SK

    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, dtype=tl.float32)
    m_start = split * M_PER_SPLIT
    m_end = tl.where(m_start + M_PER_SPLIT < M, m_start + M_PER_SPLIT, M)
    # Whole steps first, with no mask along dY's runs: a load whose value is changed
    # before the dot (a select) or masked along the runs stops Triton from pipelining
    # it. Slices are whole steps long, so only the last one ends in a part step.
    whole_end = m_start + (m_end - m_start) // BLOCK_M * BLOCK_M
    for m0 in range(m_start, whole_end, BLOCK_M):
        a, b = wgrad_step_operands(dy_ptr, col_ptr, m0, m_end, PIXELS, DY_SN, COL_SM,
                                    dy_cols, col_cols, n_ok, j_ok, RUN, BLOCK_M, False)  # fmt: skip
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    if whole_end < m_end:
        a, b = wgrad_step_operands(dy_ptr, col_ptr, whole_end, m_end, PIXELS, DY_SN, COL_SM,
                                    dy_cols, col_cols, n_ok, j_ok, RUN, BLOCK_M, True)  # fmt: skip
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    out = out_ptr + split.to(tl.int64) * OUT_SS
    out += n[:, None].to(tl.int64) * OUT_SN + j[None, :].to(tl.int64) * OUT_SK
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & j_ok[None, :])


def _sum_splits_kernel(
    part_ptr, out_ptr, SPLITS, KRED, NUMEL, OUT_SN, OUT_SK, BLOCK: tl.constexpr
):  # fmt: skip
    """out[n, j] = sum over s of part[s, n, j] (part fp32, dense), in split order, in
    fp32, stored as out's dtype through out's strides."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < NUMEL
    total = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    for s in range(0, SPLITS):
        total += tl.load(part_ptr + s * NUMEL + i, mask=ok, other=0.0)
    row, column = i // KRED, i % KRED
    tl.store(out_ptr + row.to(tl.int64) * OUT_SN + column.to(tl.int64) * OUT_SK,
             total.to(out_ptr.dtype.element_ty), mask=ok)  # fmt: skip


def _run_length(pixels: int, strides: tuple[int, ...], element_size: int, block_m: int) -> int:
    """The largest power of two, up to one 16-byte vector and one tile of rows, that
    divides the pixel count and every given stride: the runs the kernel may claim."""
    run = 1
    while (
        run * 2 * element_size <= _VECTOR_BYTES
        and run * 2 <= block_m
        and pixels % (run * 2) == 0
        and all(s % (run * 2) == 0 for s in strides)
    ):
        run *= 2
    return run


def _channels_first_strides(t: torch.Tensor, name: str) -> tuple[int, int, int]:
    """(pixels, sample stride, channel stride) of a channels-first [N, K, P] tensor
    whose pixels are contiguous."""
    if t.dim() != 3 or (t.shape[2] > 1 and t.stride(2) != 1):
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()}: expected "
            "[N, K, P] with contiguous pixels"
        )
    return t.shape[2], t.stride(0), t.stride(1)


_launches = LaunchCache()


def rows_into_channels_first(
    col: torch.Tensor,
    weight_rows: torch.Tensor,
    bias: torch.Tensor | None,
    y3: torch.Tensor,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """y3 [N, K, P] (channels-first, contiguous pixels) = rows of ``col`` [N*P, Kred] @
    ``weight_rows`` [K, Kred]^T (+ bias [K]), every element of y3 written; ``col``
    and ``weight_rows`` of any strides. Returns y3."""
    key = ("forward", _meta(col), _meta(weight_rows), _meta(bias), _meta(y3), allow_tf32)

    def prepare() -> PreparedLaunch | None:
        pixels, sample_stride, channel_stride = _channels_first_strides(y3, "y3")
        n, k = y3.shape[:2]
        reduction = col.shape[1]
        _check("col", col, (n * pixels, reduction), y3)
        _check("weight_rows", weight_rows, (k, reduction), y3)
        if bias is not None:
            _check("bias", bias, (k,), y3)
        cfg = TILES[y3.dtype]
        run = _run_length(pixels, (sample_stride, channel_stride), y3.element_size(), cfg.block_m)
        # A missing bias is never read (HAS_BIAS); the weight stands in for the pointer.
        bias_slot = TensorSlot(2) if bias is not None else TensorSlot(1)
        args = (
            TensorSlot(0), TensorSlot(1), bias_slot, TensorSlot(3),
            n * pixels, k, reduction, pixels,
            *col.stride(), *weight_rows.stride(), sample_stride, channel_stride,
            1 if bias is None else bias.stride(0),
        )  # fmt: skip
        return _prepared(n * pixels, k, args, False, True, run, bias is not None, cfg,
                         y3, allow_tf32)  # fmt: skip

    _launches.launch(key, prepare, col, weight_rows, bias, y3)
    return y3


def channels_first_into_rows(
    dy3: torch.Tensor,
    weight_rows: torch.Tensor,
    dcol: torch.Tensor,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """dcol [N*P, Kred] = channels-first ``dy3`` [N, K, P] (contiguous pixels) read as
    rows [N*P, K], @ ``weight_rows`` [K, Kred], every element of dcol written;
    ``weight_rows`` and ``dcol`` of any strides. Returns dcol."""
    key = ("backward_data", _meta(dy3), _meta(weight_rows), _meta(dcol), allow_tf32)

    def prepare() -> PreparedLaunch | None:
        pixels, sample_stride, channel_stride = _channels_first_strides(dy3, "dy3")
        n, k = dy3.shape[:2]
        reduction = weight_rows.shape[1]
        _check("weight_rows", weight_rows, (k, reduction), dy3)
        _check("dcol", dcol, (n * pixels, reduction), dy3)
        cfg = TILES[dy3.dtype]
        run = _run_length(pixels, (sample_stride, channel_stride), dy3.element_size(),
                          cfg.block_m)  # fmt: skip
        # C = A @ B with B = weight_rows [K, Kred]: its element (j, n) is weight_rows[j, n].
        args = (
            TensorSlot(0), TensorSlot(1), TensorSlot(1), TensorSlot(2),
            n * pixels, reduction, k, pixels, sample_stride, channel_stride,
            weight_rows.stride(1), weight_rows.stride(0), *dcol.stride(), 1,
        )  # fmt: skip
        return _prepared(n * pixels, reduction, args, True, False, run, False, cfg,
                         dy3, allow_tf32)  # fmt: skip

    _launches.launch(key, prepare, dy3, weight_rows, dcol)
    return dcol


def weight_gradient_splits(rows: int, kout: int, reduction: int, dtype: torch.dtype,
                           programs: int) -> int:  # fmt: skip
    """How many slices channels_first_weight_gradient cuts the reduction over ``rows``
    into (patch_gemm.reduction_slices)."""
    return reduction_slices(rows, kout, reduction, WGRAD_TILES[dtype], programs)


def channels_first_weight_gradient(
    dy3: torch.Tensor,
    col: torch.Tensor,
    out: torch.Tensor,
    splits: int,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """out [K, Kred] = channels-first ``dy3`` [N, K, P] (contiguous pixels) read as
    rows [N*P, K], transposed, @ ``col`` [N*P, Kred], the reduction cut into at most
    ``splits`` slices (weight_gradient_splits); ``col`` and ``out`` of any strides,
    ``out`` of dy3's dtype or fp32, every element written. Returns out."""
    if splits < 1:
        raise ValueError(f"splits={splits}: expected at least 1")
    key = ("weight_gradient", _meta(dy3), _meta(col), _meta(out), splits, allow_tf32)

    def prepare() -> tuple[PreparedLaunch | None, PreparedLaunch | None, int]:
        pixels, sample_stride, channel_stride = _channels_first_strides(dy3, "dy3")
        n, k = dy3.shape[:2]
        reduction = col.shape[1]
        _check("col", col, (n * pixels, reduction), dy3)
        if tuple(out.shape) != (k, reduction):
            raise ValueError(f"out of shape {tuple(out.shape)}: expected {(k, reduction)}")
        if out.dtype not in (dy3.dtype, torch.float32) or out.device != dy3.device:
            raise ValueError(f"out is {out.dtype} on {out.device}; expected {dy3.dtype} or "
                             f"torch.float32 on {dy3.device}")  # fmt: skip
        strides = (sample_stride, channel_stride)
        return _prepared_weight_gradient(dy3, col, out, n * pixels, k, reduction, pixels,
                                         strides, splits, allow_tf32)  # fmt: skip

    product, total, parts = _launches.get(key, prepare)
    if product is None:
        return out.zero_()  # nothing to reduce (no rows), or nothing to write
    if total is None:
        product(dy3, col, out)
        return out
    partials = torch.empty(parts, *out.shape, dtype=torch.float32, device=out.device)
    product(dy3, col, partials)
    total(partials, out)
    return out


def _prepared_weight_gradient(dy3, col, out, m, k, reduction, pixels, dy_strides, splits,
                              allow_tf32):  # fmt: skip
    """The product's launch, the partial sum's (None for one slice) and the slice
    count, for channels_first_weight_gradient."""
    cfg = WGRAD_TILES[dy3.dtype]
    per_split = triton.cdiv(triton.cdiv(max(m, 1), splits), cfg.block_m) * cfg.block_m
    parts = triton.cdiv(max(m, 1), per_split)
    if m == 0 or k == 0 or reduction == 0:
        return None, None, parts
    run = _run_length(pixels, dy_strides, dy3.element_size(), cfg.block_m)
    grid = (triton.cdiv(k, cfg.block_n), triton.cdiv(reduction, cfg.block_k), parts)
    # One slice stores the product straight into out; several store dense fp32
    # partials [parts, K, Kred] for the sum.
    out_strides = (0, *out.stride()) if parts == 1 else (k * reduction, reduction, 1)
    args = (
        TensorSlot(0), TensorSlot(1), TensorSlot(2),
        m, k, reduction, pixels, per_split, *dy_strides, *col.stride(), *out_strides,
    )  # fmt: skip
    constants = {
        "RUN": run,
        "INPUT_PRECISION": _precision(dy3.dtype, allow_tf32),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
    }
    product = PreparedLaunch(_pixel_rows_wgrad_kernel, grid, args, constants,
                             cfg.launch_options(), dy3.device,
                             {"do_not_specialize": _WGRAD_NOT_SPECIALISED})  # fmt: skip
    if parts == 1:
        return product, None, parts
    numel = k * reduction
    total = PreparedLaunch(_sum_splits_kernel, (triton.cdiv(numel, _SUM_BLOCK),),
                           (TensorSlot(0), TensorSlot(1), parts, reduction, numel,
                            *out.stride()),
                           {"BLOCK": _SUM_BLOCK}, {"num_warps": 4}, dy3.device)  # fmt: skip
    return product, total, parts


def _prepared(
    m: int,
    n: int,
    args: tuple,
    a_channels_first: bool,
    c_channels_first: bool,
    run: int,
    has_bias: bool,
    cfg: TileConfig,
    like: torch.Tensor,
    allow_tf32: bool,
) -> PreparedLaunch | None:
    if m == 0 or n == 0:
        return None
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    constants = {
        "A_CHANNELS_FIRST": a_channels_first,
        "C_CHANNELS_FIRST": c_channels_first,
        "RUN": run,
        "HAS_BIAS": has_bias,
        "INPUT_PRECISION": _precision(like.dtype, allow_tf32),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "GROUP_M": 8,
    }
    return PreparedLaunch(_pixel_rows_gemm_kernel, grid, args, constants, cfg.launch_options(),
                          like.device, {"do_not_specialize": _NOT_SPECIALISED})  # fmt: skip


__all__ = [
    "WGRAD_TILES",
    "channels_first_into_rows",
    "channels_first_weight_gradient",
    "rows_into_channels_first",
    "weight_gradient_splits",
]
