"""The patch permutation as one Triton pass: x -> column buffer (gather) and back (scatter).

For the patch class (stride == kernel, no padding) every input element lands in at
most one row of the column matrix, so im2col is a pure reordering. One kernel reads
x through its strides and writes the column buffer [M, ld] row by row, with the
reduction padded to ``ld`` columns of zeros in the same pass (a 16-byte aligned
leading dimension keeps the following GEMM on its fast kernels). Its inverse
writes a column gradient back into dx. With a scale and a transposed destination
the gather also makes the fp8 GEMM operands of x (solvers/float8.py): cols [M, ld]
and cols^T [ld, M'], quantized in the same pass.

The index map is kernels/patch_index.py's: row and column offsets are computed once
per tile edge and added, so the inner work is one load and one store per element.
Launches are prepared once per operand geometry (kernels/launch.py), so a repeated
call costs a dictionary lookup and the launch itself.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from gemmconv.kernels.launch import LaunchCache, PreparedLaunch, TensorSlot, check_scale
from gemmconv.kernels.patch_index import patch_columns, patch_rows


@dataclasses.dataclass(frozen=True)
class PatchGeometry:
    """Sizes and element strides of a patch-class operand, padded to three spatial dims."""

    n: int
    c: int
    outs: tuple[int, int, int]
    kernel: tuple[int, int, int]
    strides: tuple[int, int, int, int, int]  # n, c, s1, s2, s3 (elements)
    channels_last_columns: bool

    @property
    def rows(self) -> int:
        return self.n * self.outs[0] * self.outs[1] * self.outs[2]

    @property
    def reduction(self) -> int:
        return self.c * self.kernel[0] * self.kernel[1] * self.kernel[2]

    @classmethod
    def of(
        cls,
        t: torch.Tensor,
        outs: tuple[int, ...],
        kernel: tuple[int, ...],
        channels_last_columns: bool,
    ) -> PatchGeometry:
        """The geometry of ``t`` [N, C, S..] (1 to 3 spatial dims, any strides)."""
        dims = t.dim() - 2
        if not 1 <= dims <= 3 or len(outs) != dims or len(kernel) != dims:
            raise ValueError(
                f"tensor of shape {tuple(t.shape)} with outs={outs}, kernel={kernel}: "
                "expected 1 to 3 spatial dimensions matching outs and kernel"
            )
        for size, o, r in zip(t.shape[2:], outs, kernel):
            if o * r > size:
                raise ValueError(f"outs={outs} x kernel={kernel} exceeds spatial {t.shape[2:]}")
        lead = 3 - dims
        spatial_strides = (0,) * lead + tuple(t.stride()[2:])
        return cls(
            n=t.shape[0],
            c=t.shape[1],
            outs=(1,) * lead + tuple(outs),
            kernel=(1,) * lead + tuple(kernel),
            strides=(t.stride(0), t.stride(1), *spatial_strides),
            channels_last_columns=channels_last_columns,
        )


def _permute_kernel(
    src_ptr,
    dst_ptr,
    scale_ptr,
    M,
    KRED,
    LD,
    MP,
    C,
    O1,
    O2,
    O3,
    R1,
    R2,
    R3,
    SN,
    SC,
    S1,
    S2,
    S3,
    CHANNELS_LAST_COLUMNS: tl.constexpr,
    RUN: tl.constexpr,
    GATHER: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """GATHER: dst[M, LD] (row stride LD) <- src, zeros in columns KRED..LD-1; with
    TRANSPOSED dst[LD, MP] (row stride MP) <- src^T, zeros in rows KRED..LD-1 and
    columns M..MP-1. SCALED: the values times scale_ptr's fp32 scalar, in fp32 (the
    store rounds them to dst's dtype). Otherwise (scatter): dst (the strided tensor)
    <- src[M, LD] columns 0..KRED-1."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    _, _, _, _, row_off = patch_rows(
        m, O1, O2, O3, R1, R2, R3, SN, SC, S1, S2, S3, CHANNELS_LAST_COLUMNS, RUN
    )
    col_off = patch_columns(k, C, R1, R2, R3, SC, S1, S2, S3, CHANNELS_LAST_COLUMNS, RUN)

    strided = row_off[:, None] + col_off[None, :]
    if TRANSPOSED:
        dense = k[None, :].to(tl.int64) * MP + m[:, None]
    else:
        dense = m[:, None].to(tl.int64) * LD + k[None, :]
    row_ok = (m < M)[:, None]
    in_reduction = row_ok & (k < KRED)[None, :]
    if GATHER:
        values = tl.load(src_ptr + strided, mask=in_reduction, other=0.0)
        if SCALED:
            # where(): the padding stays zero whatever the scale (a NaN one included).
            values = tl.where(in_reduction, values.to(tl.float32) * tl.load(scale_ptr), 0.0)
        if TRANSPOSED:
            tl.store(dst_ptr + dense, values, mask=(m < MP)[:, None] & (k < LD)[None, :])
        else:
            tl.store(dst_ptr + dense, values, mask=row_ok & (k < LD)[None, :])
    else:
        values = tl.load(src_ptr + dense, mask=in_reduction)
        tl.store(dst_ptr + strided, values, mask=in_reduction)


# Sizes that only enter index arithmetic are not specialised on (Triton's default for
# integers equal to 1 or divisible by 16 would compile more variants for no gain).
# Strides, KRED and LD are: their divisibility is what lets Triton prove the 16-byte
# alignment of the contiguous runs and issue vector loads and stores.
_GEOMETRY_ARGS = ("M", "C", "O1", "O2", "O3", "R1", "R2", "R3")


def contiguous_run(g: PatchGeometry) -> int:
    """How many consecutive columns are consecutive in memory, when that can be used:
    r3 for the channels-first column order (always valid; contiguous when x's last
    stride is 1), (r3, c) for the channels-last order when x's strides nest that way
    (s3 == C * sc, a channels-last dense x). 0: no such run, use the general index map.

    The kernels step o3 by run * sc in the channels-last order, so the nesting is
    required even when R3 = 1: a C = 1 tensor whose sc is not 1 (torch leaves the
    stride of a size-1 dim free), or a channels-first x read in the channels-last
    column order, would otherwise be read at the wrong offsets."""
    _, sc, _, _, s3 = g.strides
    if not g.channels_last_columns:
        return g.kernel[2]
    if s3 == g.c * sc:
        return g.kernel[2] * g.c
    return 0


def _blocks(ld: int, transposed: bool) -> tuple[int, int]:
    # A tile of about 8K elements: wide along the reduction (the contiguous side of
    # the dense buffer) up to 128 columns, the rest in rows. Transposed, the dense
    # buffer is contiguous along the rows: 128 of them, 64 reduction columns.
    if transposed:
        return 128, 64
    block_k = min(128, triton.next_power_of_2(max(ld, 16)))
    return 8192 // block_k, block_k


def _prepare(
    strided: torch.Tensor,
    dense: torch.Tensor,
    g: PatchGeometry,
    gather: bool,
    scale: torch.Tensor | None = None,
    transposed: bool = False,
) -> PreparedLaunch | None:
    """The launch moving between ``strided`` (x or dx) and ``dense`` ([M, ld], or
    [ld, M'] where ``transposed``); None when there is nothing to move."""
    name = "out" if gather else "columns"
    if transposed:
        ld, padded_rows = _check_dense_transposed(dense, g, name)
    else:
        ld, padded_rows = _check_dense(dense, g, name), g.rows
    if scale is not None:
        check_scale(scale, strided.device)
    if dense.device != strided.device or (dense.dtype != strided.dtype and scale is None):
        raise ValueError(
            f"{name} is {dense.dtype} on {dense.device}; expected {strided.dtype} on "
            f"{strided.device} (another dtype only with a scale)"
        )
    cover = ld if gather else g.reduction
    if not (padded_rows and cover):
        return None
    block_m, block_k = _blocks(ld, transposed)
    grid = (triton.cdiv(padded_rows, block_m), triton.cdiv(cover, block_k))
    src, dst = (TensorSlot(0), TensorSlot(1)) if gather else (TensorSlot(1), TensorSlot(0))
    # Without a scale the kernel never reads its pointer: the source stands in for it.
    # MP is read only transposed; 0 otherwise, so that M's divisibility (Triton
    # specialises MP on it) compiles no other variants of the plain gather.
    scale_slot = TensorSlot(2) if scale is not None else src
    mp = padded_rows if transposed else 0
    args = (src, dst, scale_slot, g.rows, g.reduction, ld, mp, g.c, *g.outs, *g.kernel,
            *g.strides)  # fmt: skip
    constants = {
        "CHANNELS_LAST_COLUMNS": g.channels_last_columns,
        "RUN": contiguous_run(g),
        "GATHER": gather,
        "TRANSPOSED": transposed,
        "SCALED": scale is not None,
        "BLOCK_M": block_m,
        "BLOCK_K": block_k,
    }
    return PreparedLaunch(
        _permute_kernel, grid, args, constants, {"num_warps": 4}, strided.device,
        {"do_not_specialize": _GEOMETRY_ARGS},
    )  # fmt: skip


def _check_dense(buffer: torch.Tensor, g: PatchGeometry, name: str) -> int:
    if buffer.dim() != 2 or buffer.shape[0] != g.rows or buffer.shape[1] < g.reduction:
        raise ValueError(
            f"{name} of shape {tuple(buffer.shape)}: expected [{g.rows}, >= {g.reduction}]"
        )
    if buffer.stride(1) != 1 or buffer.stride(0) != buffer.shape[1]:
        raise ValueError(f"{name} with strides {buffer.stride()}: expected dense rows")
    return buffer.shape[1]


def _check_dense_transposed(buffer: torch.Tensor, g: PatchGeometry, name: str) -> tuple[int, int]:
    """(ld, M') of a transposed column buffer [ld, M']."""
    if buffer.dim() != 2 or buffer.shape[0] < g.reduction or buffer.shape[1] < g.rows:
        raise ValueError(
            f"{name} of shape {tuple(buffer.shape)}: expected [>= {g.reduction}, >= {g.rows}] "
            "(transposed)"
        )
    if buffer.stride(1) != 1 or buffer.stride(0) != buffer.shape[1]:
        raise ValueError(f"{name} with strides {buffer.stride()}: expected dense rows")
    return buffer.shape[0], buffer.shape[1]


_launches = LaunchCache()


def _move(
    strided: torch.Tensor,
    dense: torch.Tensor,
    outs: tuple[int, ...],
    kernel: tuple[int, ...],
    channels_last_columns: bool,
    gather: bool,
    scale: torch.Tensor | None = None,
    transposed: bool = False,
) -> None:
    # Everything the launch fixes is in the key, so a hit needs no checks.
    scale_key = None if scale is None else (scale.shape, scale.dtype, scale.device)
    key = (
        strided.shape, strided.stride(), strided.dtype, strided.device,
        dense.shape, dense.stride(), dense.dtype, dense.device,
        tuple(outs), tuple(kernel), channels_last_columns, gather, scale_key, transposed,
    )  # fmt: skip

    def prepare() -> PreparedLaunch | None:
        g = PatchGeometry.of(strided, outs, kernel, channels_last_columns)
        return _prepare(strided, dense, g, gather, scale, transposed)

    if scale is None:
        _launches.launch(key, prepare, strided, dense)
    else:
        _launches.launch(key, prepare, strided, dense, scale)


def gather_patches(
    x: torch.Tensor,
    outs: tuple[int, ...],
    kernel: tuple[int, ...],
    channels_last_columns: bool,
    out: torch.Tensor,
    scale: torch.Tensor | None = None,
    transposed: bool = False,
) -> torch.Tensor:
    """Write the column matrix of ``x`` into ``out`` [M, ld]: every row one patch in the
    given column order, columns beyond C*prod(R) set to zero. Returns ``out``.

    ``scale`` (a one-element float32 tensor on x's device, read by the kernel, so no
    host sync): each value is multiplied by it in fp32 and rounded to ``out``'s dtype,
    which may then differ from x's (an fp8 GEMM operand). ``transposed``: ``out`` is
    the column matrix transposed, [ld, M'] row-major, zeros in rows beyond C*prod(R)
    and in columns M..M'-1 (cuBLASLt's column-major ``b`` operand of the weight
    gradient, its reduction M padded)."""
    _move(x, out, outs, kernel, channels_last_columns, True, scale, transposed)
    return out


def scatter_patches(
    columns: torch.Tensor,
    outs: tuple[int, ...],
    kernel: tuple[int, ...],
    channels_last_columns: bool,
    dx: torch.Tensor,
) -> torch.Tensor:
    """The inverse of gather_patches: write columns [M, ld] (the first C*prod(R) of
    each row) back into the patch positions of ``dx`` [N, C, S..]. Positions no patch
    covers are left as they are. Returns ``dx``."""
    _move(dx, columns, outs, kernel, channels_last_columns, gather=False)
    return dx


__all__ = ["PatchGeometry", "contiguous_run", "gather_patches", "scatter_patches"]
