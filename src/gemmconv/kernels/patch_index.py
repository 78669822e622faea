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
                    ROW_ALIGN: tl.constexpr):  # fmt: skip
    """(offset of columns ``k`` within a patch, whether they are below KRED). With
    ``ROW_ALIGN`` > 0 the offset is k itself and the test is made over groups of
    ROW_ALIGN columns, so that it is constant over each aligned vector."""
    if ROW_ALIGN > 0:
        offset = k
        inside = k // ROW_ALIGN < KRED // ROW_ALIGN
    else:
        offset = patch_columns(k, C, R1, R2, R3, XSC, XS1, XS2, XS3, CHANNELS_LAST_COLUMNS, RUN)
        inside = k < KRED
    return offset, inside


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
row_offsets = DeviceHelper(_row_offsets)
column_offsets = DeviceHelper(_column_offsets)

__all__ = ["DeviceHelper", "column_offsets", "patch_columns", "patch_rows", "row_offsets"]
