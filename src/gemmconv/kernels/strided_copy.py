"""A batched strided copy whose two sides are contiguous along different dims.

torch's copy through a transposed view moved about 1.2 TB/s on an H200 (a third of a
plain copy): it walks the destination in order and reads the source with a stride.
This kernel loads a [BLOCK_I, BLOCK_J] tile along the source's contiguous dim and
stores it along the destination's; Triton moves the tile between the two register
layouts through shared memory, so both sides are read and written in full lines.

Used where a channels-first tensor [N, K, L] must become rows [N*L, K] or back: the
weight gradient's dY rows, backward-data's dY rows and the forward output written
from a row-major GEMM result into channels-first y. And, through pad_rows, for rows
copied into a wider zero-padded buffer: a bf16 row of 588 elements is 1176
bytes, not a multiple of 16, so it is copied as 147 8-byte words rather than as
2-byte elements.

With a scale, both quantize dY for the fp8 GEMMs (solvers/float8.py): the values are
multiplied in fp32 and rounded once to the destination's dtype (fp8), as torch's
``torch.mul(dy, scale, out=fp8_view)`` does, at full bandwidth where torch's strided
elementwise kernel crawls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmconv.kernels.launch import LaunchCache, PreparedLaunch, TensorSlot, check_scale

# Grid axis 1 (the batch) is limited to 65535 programs by CUDA.
MAX_BATCH = 65535


def _strided_copy_kernel(
    src_ptr,
    dst_ptr,
    scale_ptr,
    ROWS,
    COLS,
    SRC_COLS,
    SRC_B,
    SRC_I,
    SRC_J,
    DST_B,
    DST_I,
    DST_J,
    SRC_I_ALIGN: tl.constexpr,
    SRC_J_ALIGN: tl.constexpr,
    DST_I_ALIGN: tl.constexpr,
    DST_J_ALIGN: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """dst[b, i, j] <- src[b, i, j] for i < ROWS, j < COLS (strides in elements), or 0
    where j >= SRC_COLS (a padded destination row). SCALED: src times scale_ptr's fp32
    scalar, in fp32 (the store rounds it to dst's dtype). The *_ALIGN constants are
    powers of two dividing a non-unit stride (1: no claim): a stride such as 196 is
    not one Triton specialises on, and without the claim the contiguous side of the
    tile would be moved element by element."""
    tiles_j = (COLS + BLOCK_J - 1) // BLOCK_J
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    i0 = (tile // tiles_j) * BLOCK_I
    j0 = (tile % tiles_j) * BLOCK_J
    i = (i0 + tl.arange(0, BLOCK_I)).to(tl.int64)
    j = (j0 + tl.arange(0, BLOCK_J)).to(tl.int64)
    src_i = i * SRC_I
    src_j = j * SRC_J
    dst_i = i * DST_I
    dst_j = j * DST_J
    if SRC_I_ALIGN > 1:
        src_i = tl.multiple_of(src_i, SRC_I_ALIGN)
    if SRC_J_ALIGN > 1:
        src_j = tl.multiple_of(src_j, SRC_J_ALIGN)
    if DST_I_ALIGN > 1:
        dst_i = tl.multiple_of(dst_i, DST_I_ALIGN)
    if DST_J_ALIGN > 1:
        dst_j = tl.multiple_of(dst_j, DST_J_ALIGN)
    src = src_ptr + b * SRC_B + src_i[:, None] + src_j[None, :]
    dst = dst_ptr + b * DST_B + dst_i[:, None] + dst_j[None, :]
    if (i0 + BLOCK_I <= ROWS) & (j0 + BLOCK_J <= COLS) & (j0 + BLOCK_J <= SRC_COLS):
        # An interior tile: no masks to stop vectorising.
        if SCALED:
            tl.store(dst, tl.load(src).to(tl.float32) * tl.load(scale_ptr))
        else:
            tl.store(dst, tl.load(src))
    else:
        mask = (i < ROWS)[:, None] & (j < COLS)[None, :]
        in_src = mask & (j < SRC_COLS)[None, :]
        values = tl.load(src, mask=in_src, other=0)
        if SCALED:
            # where(): the padding stays zero whatever the scale (a NaN one included).
            values = tl.where(in_src, values.to(tl.float32) * tl.load(scale_ptr), 0.0)
        tl.store(dst, values, mask=mask)


def _stride_alignment(stride: int, element_size: int) -> int:
    """The largest power of two (up to 16 bytes' worth of elements) dividing a stride
    other than 1; 1 for a unit stride, whose axis is the contiguous one."""
    if stride == 1:
        return 1
    align = 1
    while align * 2 * element_size <= 16 and stride % (align * 2) == 0:
        align *= 2
    return align


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


def strided_copy(
    dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``dst.copy_(src)`` for 2-D or 3-D tensors of one shape, dtype and device, any
    strides; meant for pairs whose contiguous dims differ (a transpose). With ``scale``
    (see ``kernels.launch.check_scale``) dst gets src * scale rounded to dst's dtype,
    which may then differ from src's. Returns dst."""
    if dst.shape != src.shape or dst.dim() not in (2, 3):
        raise ValueError(
            f"dst {tuple(dst.shape)} and src {tuple(src.shape)}: expected one 2-D or 3-D shape"
        )
    if (dst.dtype != src.dtype and scale is None) or dst.device != src.device:
        raise ValueError(
            f"dst is {dst.dtype} on {dst.device}, src {src.dtype} on {src.device}: "
            "expected the same dtype and device (another dtype only with a scale)"
        )
    return _launch(dst, src, src.shape[-1], scale)


_launches = LaunchCache()


def _launch(
    dst: torch.Tensor, src: torch.Tensor, src_cols: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    # The grid covers dst; src contributes its strides and its last-dim extent.
    d3, s3 = _as_3d(dst), _as_3d(src)
    if scale is None:
        key = (d3.shape, d3.stride(), s3.shape, s3.stride(), d3.dtype, d3.device, src_cols)
        _launches.launch(key, lambda: _prepare(d3, s3, src_cols), s3, d3)
        return dst
    check_scale(scale, dst.device)
    key = (d3.shape, d3.stride(), s3.shape, s3.stride(), d3.dtype, d3.device, src_cols,
           s3.dtype)  # fmt: skip
    _launches.launch(key, lambda: _prepare(d3, s3, src_cols, scaled=True), s3, d3, scale)
    return dst


def _prepare(
    d3: torch.Tensor, s3: torch.Tensor, src_cols: int, scaled: bool = False
) -> PreparedLaunch | None:
    batch, rows, cols = d3.shape
    if batch == 0 or rows == 0 or cols == 0:
        return None
    if batch > MAX_BATCH:
        raise ValueError(f"batch {batch}: expected at most {MAX_BATCH}")
    block_i, block_j = 64, 64
    grid = (triton.cdiv(rows, block_i) * triton.cdiv(cols, block_j), batch)
    # Unscaled, the kernel never reads the scale's pointer: the source stands in for it.
    scale_slot = TensorSlot(2) if scaled else TensorSlot(0)
    args = (TensorSlot(0), TensorSlot(1), scale_slot, rows, cols, src_cols, *s3.stride(),
            *d3.stride())  # fmt: skip
    constants = {
        "SRC_I_ALIGN": _stride_alignment(s3.stride(1), s3.element_size()),
        "SRC_J_ALIGN": _stride_alignment(s3.stride(2), s3.element_size()),
        "DST_I_ALIGN": _stride_alignment(d3.stride(1), d3.element_size()),
        "DST_J_ALIGN": _stride_alignment(d3.stride(2), d3.element_size()),
        "SCALED": scaled,
        "BLOCK_I": block_i,
        "BLOCK_J": block_j,
    }
    return PreparedLaunch(
        _strided_copy_kernel, grid, args, constants, {"num_warps": 4}, d3.device,
        {"do_not_specialize": ("ROWS", "COLS", "SRC_COLS")},
    )  # fmt: skip


def _word_dtype(*tensors: torch.Tensor) -> torch.dtype | None:
    """The widest integer word (8, 4 bytes) every row of every tensor is made of."""
    for dtype in (torch.int64, torch.int32):
        width = dtype.itemsize
        if all(
            t.stride(-1) == 1
            and (t.shape[-1] * t.element_size()) % width == 0
            and (t.stride(0) * t.element_size()) % width == 0
            and (t.data_ptr() % width) == 0
            for t in tensors
        ):
            return dtype
    return None


def pad_rows(
    dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy ``src`` [M, n] into the first n columns of ``dst`` [M, n'] (n' >= n) and set
    the other columns to zero, in one pass. Rows contiguous in both are moved in the
    widest integer words that whole rows of both are made of; other strides element by
    element. With ``scale`` (see ``kernels.launch.check_scale``) dst gets src * scale
    rounded to dst's dtype, which may then differ from src's: src [K, M] as a
    transposed view and dst [K, M'] make the fp8 weight gradient's dY^T, zeros in
    columns M..M'-1. Returns dst."""
    if dst.dim() != 2 or src.dim() != 2 or dst.shape[0] != src.shape[0]:
        raise ValueError(
            f"dst {tuple(dst.shape)} and src {tuple(src.shape)}: expected 2-D, same rows"
        )
    if (
        dst.shape[1] < src.shape[1]
        or (dst.dtype != src.dtype and scale is None)
        or dst.device != src.device
    ):
        raise ValueError(
            f"dst {tuple(dst.shape)} {dst.dtype} on {dst.device}, src {tuple(src.shape)} "
            f"{src.dtype} on {src.device}: expected dst at least as wide, same dtype (another "
            "only with a scale) and device"
        )
    if scale is not None:
        if dst.shape[0] and dst.shape[1]:
            _launch(dst, src, src.shape[1], scale)
        return dst
    words = _word_dtype(dst, src)
    dst_words, src_words = (dst, src) if words is None else (dst.view(words), src.view(words))
    if dst.shape[0] and dst.shape[1]:
        # src's strides, dst's sizes: reads beyond src's width are masked to zero.
        _launch(dst_words, src_words, src_words.shape[1])
    return dst


__all__ = ["MAX_BATCH", "pad_rows", "strided_copy"]
