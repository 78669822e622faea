"""The patch index map, written once for every patch-class kernel.

Every problem is seen as 3-D (missing leading dimensions have size 1). Row m of the
column matrix is patch ((n*O1 + o1)*O2 + o2)*O3 + o3; column k is tap
((c*R1 + r1)*R2 + r2)*R3 + r3 in the channels-first column order, or
((r1*R2 + r2)*R3 + r3)*C + c in the channels-last one. The element is
x[n, c, o1*R1 + r1, o2*R2 + r2, o3*R3 + r3], whose offset is a row part plus a
column part: the kernels compute each once per tile edge and add them.

``RUN > 0`` says the innermost RUN columns are consecutive in memory (r3 of a
channels-first x, (r3, c) of a channels-last one; see ``contiguous_run``): keeping
them one modulo apart lets Triton see the contiguity and issue vector accesses.
``ROW_ALIGN > 0`` says each patch is a whole sample, dense in the column order: row
m is at m * stride_n and column k at k, with the alignment the host proved
(``row_offsets``, ``column_offsets``).
"""

from __future__ import annotations

import triton.language as tl
from triton.runtime.jit import JITFunction


class DeviceHelper(JITFunction):
    """A Triton device function that also runs as plain Python.

    Compiled kernels inline it like any ``triton.jit`` function. Under Triton's
    interpreter (the CPU tests) a jit function may not be called from a kernel, so
    there it is called as the Python function it wraps, on the interpreter's tensors.
    """

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _patch_rows(m, O1, O2, O3, R1, R2, R3, SN, SC, S1, S2, S3,
                CHANNELS_LAST_COLUMNS: tl.constexpr, RUN: tl.constexpr):  # fmt: skip
    """(n, o1, o2, o3, offset of the patch's first element) of rows ``m``."""
    o3 = m % O3
    rest = m // O3
    o2 = rest % O2
    rest = rest // O2
    o1 = rest % O1
    n = (rest // O1).to(tl.int64)
    offset = n * SN + (o1 * R1).to(tl.int64) * S1 + (o2 * R2).to(tl.int64) * S2
    if RUN > 0 and CHANNELS_LAST_COLUMNS:
        offset += (o3 * RUN).to(tl.int64) * SC  # R3 * S3 == RUN * SC: known alignment
    elif RUN > 0:
        offset += (o3 * RUN).to(tl.int64) * S3  # RUN == R3
    else:
        offset += (o3 * R3).to(tl.int64) * S3
    return n, o1, o2, o3, offset


def _patch_columns(k, C, R1, R2, R3, SC, S1, S2, S3,
                   CHANNELS_LAST_COLUMNS: tl.constexpr, RUN: tl.constexpr):  # fmt: skip
    """The offset of columns ``k`` within a patch."""
    if RUN > 0:
        inner = k % RUN
        outer = k // RUN
        r2 = outer % R2
        outer = outer // R2
        if CHANNELS_LAST_COLUMNS:
            offset = inner.to(tl.int64) * SC + outer.to(tl.int64) * S1 + r2.to(tl.int64) * S2
        else:
            r1 = outer % R1
            c = outer // R1
            offset = inner.to(tl.int64) * S3 + c.to(tl.int64) * SC + r1.to(tl.int64) * S1
            offset += r2.to(tl.int64) * S2
    else:
        if CHANNELS_LAST_COLUMNS:
            c, r3, r2, r1 = mixed_radix_digits(k, C, R3, R2)
        else:
            r3, r2, r1, c = mixed_radix_digits(k, R3, R2, R1)
        offset = c.to(tl.int64) * SC + r1.to(tl.int64) * S1 + r2.to(tl.int64) * S2
        offset += r3.to(tl.int64) * S3
    return offset


def _row_offsets(m, O1, O2, O3, R1, R2, R3, XSN, XSC, XS1, XS2, XS3, YSN, YS1, YS2, YS3,
                 CHANNELS_LAST_COLUMNS: tl.constexpr, RUN: tl.constexpr,
                 ROW_ALIGN: tl.constexpr):  # fmt: skip
    """(offset of each patch in x, offset of its pixel in y or dY) for rows ``m``. With
    ``ROW_ALIGN`` > 0 a patch is a whole dense sample: row m starts at m * XSN, a
    multiple of ROW_ALIGN elements (kernels/patch_gemm.whole_row_alignment)."""
    if ROW_ALIGN > 0:
        x_row = tl.multiple_of(m.to(tl.int64) * XSN, ROW_ALIGN)
        y_row = m.to(tl.int64) * YSN
    else:
        n, o1, o2, o3, x_row = patch_rows(
            m, O1, O2, O3, R1, R2, R3, XSN, XSC, XS1, XS2, XS3, CHANNELS_LAST_COLUMNS, RUN
        )
        y_row = n * YSN + o1.to(tl.int64) * YS1 + o2.to(tl.int64) * YS2
        y_row += o3.to(tl.int64) * YS3
    return x_row, y_row


def _column_offsets(k, KRED, C, R1, R2, R3, XSC, XS1, XS2, XS3,
                    CHANNELS_LAST_COLUMNS: tl.constexpr, RUN: tl.constexpr,
                    ROW_ALIGN: tl.constexpr, GATHER_ALIGN: tl.constexpr):  # fmt: skip
    """(offset of columns ``k`` within a patch, whether they are below KRED). With
    ``ROW_ALIGN`` > 0 the offset is k itself. The test is made over aligned groups of
    ROW_ALIGN or GATHER_ALIGN columns, so that it is constant over each vector."""
    # One return: Triton compiles every return of a device function to one type, and
    # the two offsets differ (int32 k, int64 strided).
    if ROW_ALIGN > 0:
        offset = k
        inside = below(k, KRED, ROW_ALIGN)
    else:
        offset = patch_columns(k, C, R1, R2, R3, XSC, XS1, XS2, XS3, CHANNELS_LAST_COLUMNS, RUN)
        inside = below(k, KRED, GATHER_ALIGN)
    return offset, inside


def _below(k, KRED, ALIGN: tl.constexpr):
    """k < KRED, tested over groups of ALIGN columns (KRED is a multiple of ALIGN) so that
    Triton sees it constant over each ALIGN-wide vector; it cannot see that through a
    KRED it does not know to be a multiple of 16 (588: CLIP-L/14, Qwen2-VL)."""
    if ALIGN > 1:
        return k // ALIGN < KRED // ALIGN
    return k < KRED


def _gathered(x_row, x_col, GATHER_ALIGN: tl.constexpr):
    """x_row[:, None] + x_col[None, :]: the offsets of a tile of patch columns. With
    GATHER_ALIGN > 1 (kernels/patch_gemm.gather_alignment) each aligned group of that many
    columns is consecutive memory from a multiple of it, which the host proved and
    Triton cannot see through a run of 14 or a stride not divisible by 16 (ConvNeXt's 56,
    Wan 2.1's 104). The hint is put on the 2-D offsets: on the 1-D ones Triton 3.8 lost it
    through the add for ConvNeXt's and Wan 2.1's channels-first gathers (2-byte loads in
    the compiled kernel, 4-byte copies with it here), and along the columns only: down
    a column the offsets are multiples of nothing in particular."""
    offsets = x_row[:, None] + x_col[None, :]
    if GATHER_ALIGN > 1:
        offsets = tl.multiple_of(offsets, [1, GATHER_ALIGN])
        offsets = tl.max_contiguous(offsets, [1, GATHER_ALIGN])
    return offsets


def _mixed_radix_digits(k, B0, B1, B2):
    """The digits of ``k`` in the mixed radix B0 (innermost), B1, B2, the last unbounded."""
    d0 = k % B0
    rest = k // B0
    d1 = rest % B1
    rest = rest // B1
    return d0, d1, rest % B2, rest // B2


patch_rows = DeviceHelper(_patch_rows)
patch_columns = DeviceHelper(_patch_columns)
mixed_radix_digits = DeviceHelper(_mixed_radix_digits)


def _pixel_tile(rows, columns, PIXEL_ALIGN: tl.constexpr, PIXELS_DOWN: tl.constexpr):
    """The offsets of a tile of an output-shaped operand (y or dY): pixel ``rows`` (from
    row_offsets) down axis 0 and ``columns`` (channels) across, or the other way round
    (PIXELS_DOWN false). With PIXEL_ALIGN > 1 (kernels/patch_gemm.pixel_alignment) each
    aligned group of that many pixels is consecutive memory from a multiple of it, which
    Triton cannot see through the pixel index's divisions (a channels-first dY loaded
    in 2-byte pieces, even ViT-B/16's, when compiled for sm_90). The claim is made
    along the pixels only."""
    if PIXELS_DOWN:
        offsets = rows[:, None] + columns[None, :]
        if PIXEL_ALIGN > 1:
            offsets = tl.multiple_of(offsets, [PIXEL_ALIGN, 1])
            offsets = tl.max_contiguous(offsets, [PIXEL_ALIGN, 1])
    else:
        offsets = columns[:, None] + rows[None, :]
        if PIXEL_ALIGN > 1:
            offsets = tl.multiple_of(offsets, [1, PIXEL_ALIGN])
            offsets = tl.max_contiguous(offsets, [1, PIXEL_ALIGN])
    return offsets


row_offsets = DeviceHelper(_row_offsets)
pixel_tile = DeviceHelper(_pixel_tile)
below = DeviceHelper(_below)
column_offsets = DeviceHelper(_column_offsets)
gathered = DeviceHelper(_gathered)

__all__ = [
    "DeviceHelper",
    "below",
    "column_offsets",
    "gathered",
    "patch_columns",
    "patch_rows",
    "pixel_tile",
    "row_offsets",
]
