"""Implicit GEMMs for the patch class: the patches are gathered inside the GEMM's loads.

No column buffer exists: each program loads its [BLOCK_M, BLOCK_K] tile of the column
matrix straight from x through x's strides (the index map of patch_permute), masks
the reduction's unaligned tail, and multiplies on the tensor cores with fp32
accumulation. The kernels use only Triton's core builtins (no tl.cdiv, tl.zeros,
tl.minimum: those are jit helpers that the interpreter cannot call when Triton was
imported without TRITON_INTERPRET), so the CPU tests run the same code.

- forward: Y[M, K] = col(x) @ W^T (+ bias), each tile stored through y's strides, so
  the output lands in the requested layout with no copy and the bias costs no pass.
- backward-weights: dW[K, Kred] = dY^T @ col(x), dY read through its own strides
  (channels-first dY needs no transposed copy). The reduction over M is split
  across programs; each writes an fp32 partial and the partials are summed in fp32,
  so the long reduction never rounds to half precision and the result does not
  depend on scheduling (no atomics).

Where a patch is a whole sample whose memory is dense in the column order (one patch a
sample: point 2D), row m of the column matrix is x's memory at m * XSN and column k
is offset k, so the index map is skipped (``ROW_ALIGN`` > 0). ``ROW_ALIGN`` elements
then divide every row stride and the reduction, which the kernels tell Triton: with
C*R = 588 (1176 bytes a bf16 row, a multiple of 8 but not 16) its loads become 8-byte
vectors and can be pipelined, where the general map loads 2 bytes at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmconv.kernels.launch import LaunchCache, PreparedLaunch, TensorSlot
from gemmconv.kernels.patch_index import (
    below,
    column_offsets,
    gathered,
    pixel_tile,
    row_offsets,
)
from gemmconv.kernels.patch_permute import PatchGeometry, contiguous_run
from gemmconv.kernels.program_order import grouped_tile
from gemmconv.kernels.tiles import TileConfig, fits

# Hopper-sized tiles for half precision; fp32 tiles are half as deep (twice the bytes).
FORWARD_TILES = {
    torch.float16: TileConfig(128, 128, 64, 8, 3),
    torch.bfloat16: TileConfig(128, 128, 64, 8, 3),
    torch.float32: TileConfig(128, 64, 32, 8, 3),
}
DGRAD_TILES = FORWARD_TILES  # the same GEMM shape: [M, K] @ [K, Kred]
# The whole-row forward (ROW_ALIGN > 0) in half precision: point 2D bf16 ran 56 us with
# these against 63 with FORWARD_TILES on an H100 (bench/probes/whole_row_tiles.py,
# bench/results/whole_row_h100.txt; backward-data and the weight gradient gained
# under 10% from any tile there and keep theirs).
WHOLE_ROW_FORWARD_TILES = {
    torch.float16: TileConfig(128, 128, 32, 4, 3),
    torch.bfloat16: TileConfig(128, 128, 32, 4, 3),
}
# The general forward in half precision, by geometry (never the row count, which would
# break batch invariance): on an H100 (bench/probes/implicit_tiles.py,
# bench/probes/results/implicit_tiles_h100.txt) channels-first columns in runs of a
# multiple of 8 elements (16-byte vectors: ViT-B/16, SAM, VideoMAE) ran fastest with
# wide tiles (ViT-B/16 b256 170 us against 257 with FORWARD_TILES), and short runs or
# reductions of at most 64 (DiT-XL/2, SD3 and Wan 2.1's latents, ConvNeXt's
# channels-first downsample) with shallow ones (DiT-XL/2 cf 124 against 203); other
# runs (14 pixels: CLIP-L/14) kept FORWARD_TILES, the fastest for them.
WIDE_RUN_TILES = TileConfig(128, 256, 64, 8, 3)
SHALLOW_TILES = TileConfig(128, 128, 32, 4, 4)
SHALLOW_REDUCTION = 64
WGRAD_TILES = {
    torch.float16: TileConfig(64, 128, 128, 8, 3),  # block_m is the reduction chunk here
    torch.bfloat16: TileConfig(64, 128, 128, 8, 3),
    torch.float32: TileConfig(32, 64, 64, 8, 3),
}

# Index-only sizes are not specialised on; strides, KRED, KOUT and WLD are (their
# divisibility proves the alignment that vector loads and cp.async pipelining need).
_SIZES = ("M", "C", "O1", "O2", "O3", "R1", "R2", "R3")
_FORWARD_ARGS = _SIZES
_WGRAD_ARGS = (*_SIZES, "M_PER_SPLIT")


def _forward_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, KOUT, KRED, C, O1, O2, O3, R1, R2, R3,
    XSN, XSC, XS1, XS2, XS3,
    YSN, YSC, YS1, YS2, YS3,
    WLD, BS,
    W_ALIGN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CHANNELS_LAST_COLUMNS: tl.constexpr,
    RUN: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    GATHER_ALIGN: tl.constexpr,
    PIXEL_ALIGN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, KOUT, BLOCK_M, BLOCK_N, GROUP_M)

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kout = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row, y_row = row_offsets(m, O1, O2, O3, R1, R2, R3, XSN, XSC, XS1, XS2, XS3, YSN, YS1, YS2,
                               YS3, CHANNELS_LAST_COLUMNS, RUN, ROW_ALIGN)  # fmt: skip
    w_row = kout.to(tl.int64) * WLD
    if W_ALIGN > 1:
        w_row = tl.multiple_of(w_row, W_ALIGN)
    m_ok = below(m, M, PIXEL_ALIGN)
    n_ok = kout < KOUT

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, KRED, BLOCK_K):
        kr = k0 + tl.arange(0, BLOCK_K)
        x_col, k_ok = column_offsets(kr, KRED, C, R1, R2, R3, XSC, XS1, XS2, XS3,
            CHANNELS_LAST_COLUMNS, RUN, ROW_ALIGN, GATHER_ALIGN)  # fmt: skip
        a = tl.load(x_ptr + gathered(x_row, x_col, GATHER_ALIGN),
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(w_ptr + w_row[None, :] + kr[:, None],
                    mask=below(kr, KRED, W_ALIGN)[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(b_ptr + kout * BS, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + pixel_tile(y_row, kout.to(tl.int64) * YSC, PIXEL_ALIGN, True), out,
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


def _wgrad_kernel(
    dy_ptr, x_ptr, part_ptr,
    M, KOUT, KRED, C, O1, O2, O3, R1, R2, R3,
    XSN, XSC, XS1, XS2, XS3,
    YSN, YSC, YS1, YS2, YS3,
    M_PER_SPLIT,
    CHANNELS_LAST_COLUMNS: tl.constexpr,
    RUN: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    GATHER_ALIGN: tl.constexpr,
    PIXEL_ALIGN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """part[split, KOUT, KRED] = dY[m-range]^T @ col(x)[m-range] in fp32. BLOCK_N tiles the
    output channels, BLOCK_K the reduction columns, BLOCK_M is the chunk of M per step."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    split = tl.program_id(2)
    kout = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kr = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    dy_col = kout.to(tl.int64) * YSC
    n_ok = kout < KOUT
    x_col, k_ok = column_offsets(kr, KRED, C, R1, R2, R3, XSC, XS1, XS2, XS3,
        CHANNELS_LAST_COLUMNS, RUN, ROW_ALIGN, GATHER_ALIGN)  # fmt: skip
    part_row = kout.to(tl.int64) * KRED
    if ROW_ALIGN > 0:
        part_row = tl.multiple_of(part_row, ROW_ALIGN)

    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, dtype=tl.float32)
    # M_PER_SPLIT is a multiple of BLOCK_M (weight_grad_launch): so is every step's first
    # row, which the pixel groups' masks and hints rest on.
    m_start = tl.multiple_of(split * M_PER_SPLIT, BLOCK_M)
    m_end = tl.where(m_start + M_PER_SPLIT < M, m_start + M_PER_SPLIT, M)
    for m0 in range(m_start, m_end, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        x_row, dy_row = row_offsets(m, O1, O2, O3, R1, R2, R3, XSN, XSC, XS1, XS2, XS3, YSN, YS1,
                                    YS2, YS3, CHANNELS_LAST_COLUMNS, RUN, ROW_ALIGN)  # fmt: skip
        m_ok = below(m, m_end, PIXEL_ALIGN)
        a = tl.load(dy_ptr + pixel_tile(dy_row, dy_col, PIXEL_ALIGN, False),
                    mask=n_ok[:, None] & m_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(x_ptr + gathered(x_row, x_col, GATHER_ALIGN),
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    base = split.to(tl.int64) * KOUT * KRED
    tl.store(part_ptr + base + part_row[:, None] + kr[None, :], acc,
             mask=n_ok[:, None] & k_ok[None, :])  # fmt: skip


def _dgrad_kernel(
    dy_ptr, w_ptr, dx_ptr,
    M, KOUT, KRED, C, O1, O2, O3, R1, R2, R3,
    XSN, XSC, XS1, XS2, XS3,
    YSN, YSC, YS1, YS2, YS3,
    WLD,
    W_ALIGN: tl.constexpr,
    CHANNELS_LAST_COLUMNS: tl.constexpr,
    RUN: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    GATHER_ALIGN: tl.constexpr,
    PIXEL_ALIGN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dcol[M, KRED] = dY @ W, each tile scattered straight into dx's patch positions
    (the x strides here are dx's). BLOCK_N tiles the reduction columns of the output,
    BLOCK_K steps over the output channels (this GEMM's reduction)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kr = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row, dy_row = row_offsets(m, O1, O2, O3, R1, R2, R3, XSN, XSC, XS1, XS2, XS3, YSN, YS1, YS2,
                                YS3, CHANNELS_LAST_COLUMNS, RUN, ROW_ALIGN)  # fmt: skip
    x_col, kr_ok = column_offsets(kr, KRED, C, R1, R2, R3, XSC, XS1, XS2, XS3,
        CHANNELS_LAST_COLUMNS, RUN, ROW_ALIGN, GATHER_ALIGN)  # fmt: skip
    m_ok = below(m, M, PIXEL_ALIGN)

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, KOUT, BLOCK_K):
        kout = k0 + tl.arange(0, BLOCK_K)
        k_ok = kout < KOUT
        a = tl.load(dy_ptr + pixel_tile(dy_row, kout.to(tl.int64) * YSC, PIXEL_ALIGN, True),
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w_row = kout.to(tl.int64) * WLD
        if W_ALIGN > 1:
            w_row = tl.multiple_of(w_row, W_ALIGN)
        b = tl.load(w_ptr + w_row[:, None] + kr[None, :],
                    mask=k_ok[:, None] & below(kr, KRED, W_ALIGN)[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    out = acc.to(dx_ptr.dtype.element_ty)
    tl.store(dx_ptr + gathered(x_row, x_col, GATHER_ALIGN), out,
             mask=m_ok[:, None] & kr_ok[None, :])  # fmt: skip


def _output_strides(t: torch.Tensor) -> tuple[int, ...]:
    """n, c and three spatial element strides of [N, K, O..] (missing dims stride 0)."""
    dims = t.dim() - 2
    return (t.stride(0), t.stride(1), *((0,) * (3 - dims)), *t.stride()[2:])


def whole_row_alignment(g: PatchGeometry, element_size: int, *row_strides: int) -> int:
    """ROW_ALIGN: 0 unless every patch is a whole sample whose memory is dense in the
    column order (row m at m * stride_n, column k at offset k); then the largest power
    of two, up to 16 bytes' worth of elements, dividing the reduction, stride_n and
    ``row_strides`` (the other operands' row strides along the reduction)."""
    if g.outs != (1, 1, 1):
        return 0
    _, sc, s1, s2, s3 = g.strides
    r1, r2, r3 = g.kernel
    if g.channels_last_columns:
        nested = ((g.c, sc, 1), (r3, s3, g.c), (r2, s2, g.c * r3), (r1, s1, g.c * r3 * r2))
    else:
        nested = ((r3, s3, 1), (r2, s2, r3), (r1, s1, r3 * r2), (g.c, sc, r3 * r2 * r1))
    if any(size > 1 and stride != dense for size, stride, dense in nested):
        return 0
    # One sample's stride is never stepped over (row 0 only), and torch leaves a size-1
    # dimension's stride free: it must not change the tiles, or a sample alone could run
    # other tiles than in a batch (gemmconv.batch_invariant).
    sample_stride = g.strides[0] if g.n > 1 else g.reduction
    return vector_elements(element_size, g.reduction, sample_stride, *row_strides)


def gather_alignment(g: PatchGeometry, element_size: int) -> int:
    """GATHER_ALIGN for the general index map (ROW_ALIGN 0): the largest power of two,
    up to 16 bytes' worth of elements, that divides the contiguous run (contiguous_run)
    and every stride a patch or a run within it starts at, so that each aligned group
    of that many columns is consecutive memory from an aligned offset; 0 where no run is
    contiguous or the group would be one element. A spatial or channel stride along a
    dimension of size one is never stepped over and does not count (torch leaves it
    free); the sample stride always counts, as a masked row past the last sample steps
    over it. It changes only how wide the loads are, never the order of the sums."""
    run = contiguous_run(g)
    sn, sc, s1, s2, s3 = g.strides
    (o1, o2, o3), (r1, r2, _) = g.outs, g.kernel
    if run == 0 or (sc if g.channels_last_columns else s3) != 1:
        return 0
    # (size, stride) of each step between patches or between runs within one: rows step
    # by o1 and o2 (a window each) and by o3 (a run); runs by r1, r2 and, channels-first,
    # by c (channels-last: c is inside the run).
    steps = [(o1, r1 * s1), (o2, r2 * s2), (o3, run), (r1, s1), (r2, s2)]
    if not g.channels_last_columns:
        steps.append((g.c, sc))
    strides = [sn, *(stride for size, stride in steps if size > 1)]
    align = vector_elements(element_size, run, *strides)
    return align if align > 1 else 0


def _weight_alignment(g: PatchGeometry, weight_rows: torch.Tensor, row_align: int) -> int:
    """W_ALIGN: the vector, in elements, that W's dense rows load in (the whole-row
    alignment where there is one): the largest power of two up to 16 bytes dividing the
    reduction and the row stride. Triton cannot see it where the reduction is not a
    multiple of 16 (588 proves 4: 8-byte loads where it compiled 2-byte ones)."""
    return row_align or vector_elements(
        weight_rows.element_size(), g.reduction, weight_rows.stride(0)
    )


def pixel_alignment(t: torch.Tensor) -> int:
    """PIXEL_ALIGN for an output-shaped operand ``t`` [N, K, O..] (y or dY): the largest
    power of two, up to 16 bytes' worth of elements, such that each aligned group of
    that many pixels (rows m, in (n, o1, o2, o3) order) is consecutive memory from a
    multiple of it: it divides the run of dense innermost pixels and every stride a
    group can start at (the sample's, the channel's, and those of the pixel dimensions
    outside the run); 0 where no run is longer than one pixel. A dimension of size one
    is never stepped over and does not count. Channels-last operands have no such run
    (a pixel's channels are what is contiguous) and get 0."""
    n_stride, k_stride, *pixel_strides = t.stride()
    run, stepped = 1, []
    for size, stride in reversed(list(zip(t.shape[2:], pixel_strides))):
        if size == 1:
            continue
        if not stepped and stride == run:
            run *= size
        else:
            stepped.append(stride)
    if run == 1:
        return 0
    sizes = (t.shape[0], t.shape[1])
    strides = [s for size, s in zip(sizes, (n_stride, k_stride)) if size > 1]
    align = vector_elements(t.element_size(), run, *strides, *stepped)
    return align if align > 1 else 0


def vector_elements(element_size: int, *extents: int) -> int:
    """The largest power of two, up to 16 bytes' worth of elements, dividing every one
    of ``extents`` (in elements): the widest vector every row they describe loads in."""
    align = 1
    while 2 * align * element_size <= 16 and all(v % (2 * align) == 0 for v in extents):
        align *= 2
    return align


def _tile_constants(
    g: PatchGeometry,
    cfg: TileConfig,
    dtype: torch.dtype,
    channels_last_columns: bool,
    allow_tf32: bool,
    row_align: int,
) -> dict[str, object]:
    """The constexpr arguments every patch GEMM kernel takes: the column order and its
    contiguous run, the whole-row alignment (whole_row_alignment), the dot's precision
    and the tile sizes."""
    return {
        "CHANNELS_LAST_COLUMNS": channels_last_columns,
        "RUN": contiguous_run(g),
        "ROW_ALIGN": row_align,
        "GATHER_ALIGN": 0 if row_align else gather_alignment(g, dtype.itemsize),
        "INPUT_PRECISION": _precision(dtype, allow_tf32),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
    }


def _precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    # Triton's single-pass tf32 dot feeds the tensor cores fp32 bits whose mantissa they
    # truncate: on an H200 a one-term fp32 reduction came out 1.3e-3 off (rms_range),
    # beyond the TF32 tolerance (2^-10) that cuDNN and cuBLAS stay within. Three passes
    # (tf32x3) still run on tensor cores and are about as accurate as fp32.
    return "tf32x3" if dtype == torch.float32 and allow_tf32 else "ieee"


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} of shape {tuple(t.shape)}: expected {shape}")
    if t.dtype != like.dtype or t.device != like.device:
        raise ValueError(
            f"{name} is {t.dtype} on {t.device}; expected {like.dtype} on {like.device}"
        )


def _check_weight_rows(
    weight_rows: torch.Tensor, kout: int, reduction: int, like: torch.Tensor
) -> None:
    _check("weight_rows", weight_rows, (kout, reduction), like)
    if weight_rows.stride(1) != 1:
        raise ValueError(f"weight_rows with strides {weight_rows.stride()}: expected dense rows")


def _meta(t: torch.Tensor | None) -> tuple | None:
    """What a prepared launch fixes about a tensor: sizes, strides, dtype, device."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


_launches = LaunchCache()


def forward_launch(
    x: torch.Tensor,
    weight_rows: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: tuple[int, ...],
    channels_last_columns: bool,
    out: torch.Tensor,
    allow_tf32: bool,
    device: torch.device,
) -> PreparedLaunch | None:
    """The forward's launch on ``device`` for operands of these sizes and strides (real
    or meta tensors), taking (x, weight_rows, bias, out); None for an empty problem."""
    outs = tuple(out.shape[2:])
    g = PatchGeometry.of(x, outs, kernel, channels_last_columns)
    kout = weight_rows.shape[0]
    _check("out", out, (g.n, kout, *outs), x)
    _check_weight_rows(weight_rows, kout, g.reduction, x)
    if bias is not None:
        _check("bias", bias, (kout,), x)
    if g.rows == 0 or kout == 0:
        return None
    row_align = whole_row_alignment(g, x.element_size(), weight_rows.stride(0))
    cfg = forward_tiles(g, x.dtype, row_align, device)
    grid = (triton.cdiv(g.rows, cfg.block_m) * triton.cdiv(kout, cfg.block_n),)
    # A missing bias is never read (HAS_BIAS); the weight stands in for the pointer.
    bias_slot = TensorSlot(2) if bias is not None else TensorSlot(1)
    args = (
        TensorSlot(0), TensorSlot(1), bias_slot, TensorSlot(3),
        g.rows, kout, g.reduction, g.c, *g.outs, *g.kernel, *g.strides,
        *_output_strides(out), weight_rows.stride(0),
        1 if bias is None else bias.stride(0),  # a bias is taken with any stride
    )  # fmt: skip
    constants = {
        **_tile_constants(g, cfg, x.dtype, channels_last_columns, allow_tf32, row_align),
        "W_ALIGN": _weight_alignment(g, weight_rows, row_align),
        "PIXEL_ALIGN": pixel_alignment(out),
        "HAS_BIAS": bias is not None,
        "GROUP_M": 8,
    }
    return PreparedLaunch(_forward_kernel, grid, args, constants, cfg.launch_options(),
                          device, {"do_not_specialize": _FORWARD_ARGS})  # fmt: skip


def forward_tiles(
    g: PatchGeometry, dtype: torch.dtype, row_align: int, device: torch.device
) -> TileConfig:
    """The forward's tiles for geometry ``g`` (see WIDE_RUN_TILES), from the dtype and
    the geometry alone; a table's tiles where the geometry's do not fit the device's
    shared memory."""
    if row_align:
        return WHOLE_ROW_FORWARD_TILES.get(dtype, FORWARD_TILES[dtype])
    default = FORWARD_TILES[dtype]
    if dtype not in (torch.float16, torch.bfloat16):
        return default
    run = contiguous_run(g)
    if g.reduction <= SHALLOW_REDUCTION or (not g.channels_last_columns and run < 8):
        chosen = SHALLOW_TILES
    elif not g.channels_last_columns and run % 8 == 0:
        chosen = WIDE_RUN_TILES
    else:
        return default
    return chosen if fits(chosen, 2, device) else default


def patch_gemm_forward(
    x: torch.Tensor,
    weight_rows: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: tuple[int, ...],
    channels_last_columns: bool,
    out: torch.Tensor,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """out [N, K, O..] (any strides) = conv(x, W) for a patch-class problem, where
    ``weight_rows`` [K, Kred] is the weight flattened in the column order. Returns out."""
    key = ("forward", _meta(x), _meta(weight_rows), _meta(bias), _meta(out), tuple(kernel),
           channels_last_columns, allow_tf32)  # fmt: skip
    _launches.launch(
        key,
        lambda: forward_launch(x, weight_rows, bias, kernel, channels_last_columns, out,
                               allow_tf32, x.device),  # fmt: skip
        x, weight_rows, bias, out,
    )  # fmt: skip
    return out


def backward_data_launch(
    grad_output: torch.Tensor,
    weight_rows: torch.Tensor,
    kernel: tuple[int, ...],
    channels_last_columns: bool,
    dx: torch.Tensor,
    allow_tf32: bool,
    device: torch.device,
) -> PreparedLaunch | None:
    """Backward-data's launch on ``device`` for operands of these sizes and strides
    (real or meta tensors), taking (grad_output, weight_rows, dx); None when empty."""
    outs = tuple(grad_output.shape[2:])
    g = PatchGeometry.of(dx, outs, kernel, channels_last_columns)
    kout = grad_output.shape[1]
    _check("grad_output", grad_output, (g.n, kout, *outs), dx)
    _check_weight_rows(weight_rows, kout, g.reduction, dx)
    if g.rows == 0 or g.reduction == 0:
        return None
    cfg = DGRAD_TILES[dx.dtype]
    grid = (triton.cdiv(g.rows, cfg.block_m), triton.cdiv(g.reduction, cfg.block_n))
    args = (
        TensorSlot(0), TensorSlot(1), TensorSlot(2),
        g.rows, kout, g.reduction, g.c, *g.outs, *g.kernel, *g.strides,
        *_output_strides(grad_output), weight_rows.stride(0),
    )  # fmt: skip
    row_align = whole_row_alignment(g, dx.element_size(), weight_rows.stride(0))
    constants = {
        **_tile_constants(g, cfg, dx.dtype, channels_last_columns, allow_tf32, row_align),
        "W_ALIGN": _weight_alignment(g, weight_rows, row_align),
        "PIXEL_ALIGN": pixel_alignment(grad_output),
    }
    return PreparedLaunch(_dgrad_kernel, grid, args, constants, cfg.launch_options(),
                          device, {"do_not_specialize": _FORWARD_ARGS})  # fmt: skip


def patch_gemm_backward_data(
    grad_output: torch.Tensor,
    weight_rows: torch.Tensor,
    kernel: tuple[int, ...],
    channels_last_columns: bool,
    dx: torch.Tensor,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """Write dY @ W into the patch positions of dx [N, C, S..] (any strides); positions
    no patch covers are left as they are. Returns dx."""
    key = ("backward_data", _meta(grad_output), _meta(weight_rows), _meta(dx), tuple(kernel),
           channels_last_columns, allow_tf32)  # fmt: skip
    _launches.launch(
        key,
        lambda: backward_data_launch(grad_output, weight_rows, kernel, channels_last_columns,
                                     dx, allow_tf32, dx.device),  # fmt: skip
        grad_output, weight_rows, dx,
    )  # fmt: skip
    return dx


def wgrad_splits(rows: int, kout: int, reduction: int, dtype: torch.dtype, programs: int) -> int:
    """How many slices the reduction over M is cut into (reduction_slices)."""
    return reduction_slices(rows, kout, reduction, WGRAD_TILES[dtype], programs)


def reduction_slices(rows: int, kout: int, reduction: int, cfg: TileConfig, programs: int) -> int:
    """How many slices a weight gradient tiled by ``cfg`` (block_m rows reduced a step,
    block_n x block_k output tiles) cuts its reduction over ``rows`` into: enough
    programs to fill ``programs`` (about twice the multiprocessors:
    gemmconv.kernels.split_programs), never a slice shorter than four steps."""
    tiles = triton.cdiv(kout, cfg.block_n) * triton.cdiv(reduction, cfg.block_k)
    longest = max(1, triton.cdiv(rows, 4 * cfg.block_m))
    return max(1, min(triton.cdiv(programs, tiles), longest))


def patch_gemm_weight_grad(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    kernel: tuple[int, ...],
    channels_last_columns: bool,
    splits: int,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """dW as fp32 rows [K, Kred] in the column order, from dY [N, K, O..] and x (any
    strides each), the reduction over M cut into ``splits`` fp32 partials."""
    if splits < 1:
        raise ValueError(f"splits={splits}: expected at least 1")
    key = ("weight_grad", _meta(grad_output), _meta(x), tuple(kernel), channels_last_columns,
           splits, allow_tf32)  # fmt: skip
    launch = _launches.get(
        key,
        lambda: weight_grad_launch(grad_output, x, kernel, channels_last_columns, splits,
                                   allow_tf32, x.device),
    )  # fmt: skip
    return launch.run(grad_output, x)


class WeightGradLaunch:
    """The weight gradient's launch and its fp32 partials' shape (parts, K, Kred)."""

    __slots__ = ("launch", "partials_shape", "device")

    def __init__(
        self, launch: PreparedLaunch | None, partials_shape: tuple[int, int, int],
        device: torch.device,
    ) -> None:  # fmt: skip
        self.launch, self.partials_shape, self.device = launch, partials_shape, device

    def run(self, grad_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dW as fp32 rows [K, Kred] of these operands (of the launch's metadata)."""
        parts, kout, reduction = self.partials_shape
        if self.launch is None:
            return torch.zeros(kout, reduction, dtype=torch.float32, device=self.device)
        # Every element of every partial is written: each split owns a non-empty M range.
        partials = torch.empty(self.partials_shape, dtype=torch.float32, device=self.device)
        self.launch(grad_output, x, partials)
        return partials[0] if parts == 1 else partials.sum(0)


def weight_grad_launch(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    kernel: tuple[int, ...],
    channels_last_columns: bool,
    splits: int,
    allow_tf32: bool,
    device: torch.device,
) -> WeightGradLaunch:
    """The weight gradient's launch on ``device`` for operands of these sizes and
    strides (real or meta tensors), taking (grad_output, x, partials)."""
    outs = tuple(grad_output.shape[2:])
    g = PatchGeometry.of(x, outs, kernel, channels_last_columns)
    kout = grad_output.shape[1]
    _check("grad_output", grad_output, (g.n, kout, *outs), x)
    cfg = WGRAD_TILES[x.dtype]
    per_split = triton.cdiv(triton.cdiv(max(g.rows, 1), splits), cfg.block_m) * cfg.block_m
    parts = triton.cdiv(max(g.rows, 1), per_split)
    if not (g.rows and kout and g.reduction):
        return WeightGradLaunch(None, (parts, kout, g.reduction), device)
    grid = (triton.cdiv(kout, cfg.block_n), triton.cdiv(g.reduction, cfg.block_k), parts)
    args = (
        TensorSlot(0), TensorSlot(1), TensorSlot(2),
        g.rows, kout, g.reduction, g.c, *g.outs, *g.kernel, *g.strides,
        *_output_strides(grad_output), per_split,
    )  # fmt: skip
    row_align = whole_row_alignment(g, x.element_size())
    constants = {
        **_tile_constants(g, cfg, x.dtype, channels_last_columns, allow_tf32, row_align),
        "PIXEL_ALIGN": pixel_alignment(grad_output),
    }
    launch = PreparedLaunch(_wgrad_kernel, grid, args, constants, cfg.launch_options(),
                            device, {"do_not_specialize": _WGRAD_ARGS})  # fmt: skip
    return WeightGradLaunch(launch, (parts, kout, g.reduction), device)


__all__ = [
    "DGRAD_TILES",
    "FORWARD_TILES",
    "WGRAD_TILES",
    "WHOLE_ROW_FORWARD_TILES",
    "WIDE_RUN_TILES",
    "SHALLOW_TILES",
    "WeightGradLaunch",
    "backward_data_launch",
    "forward_launch",
    "forward_tiles",
    "gather_alignment",
    "pixel_alignment",
    "patch_gemm_backward_data",
    "patch_gemm_forward",
    "patch_gemm_weight_grad",
    "weight_grad_launch",
    "vector_elements",
    "wgrad_splits",
    "whole_row_alignment",
]
