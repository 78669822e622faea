"""The forward GEMM of point problems whose rows are 8 bytes off 16-byte alignment, with
the rows loaded by the tensor memory accelerator (TMA) two samples at a time.

Point 2D's rows are 588 bf16 elements, 1176 bytes: every other row starts 8 bytes off
a 16-byte boundary, so cuBLAS runs its slow kernels on them (88 us on an H200, 31 us
for the same GEMM padded to 592) and the whole-row implicit GEMM loads them as 8-byte
vectors (56 us on an H100, bench/results/whole_row_h100.txt). A pair of rows is 2352
bytes, a multiple of 16, so the input seen as [M/2, 2*K] (one pair a row) has the
strides TMA needs, and each row of a pair is read by boxes of it from column 0 or about K:

- even samples: the descriptor [ceil(M/2), K] with row stride 2*K, boxes at column k0;
  past column K it reads zeros, so the reduction's tail needs no mask;
- odd samples: the descriptor [floor(M/2), 2*K] with the same stride, boxes from
  column K - 4 on (a box starts on a 16-byte boundary: the first one's four columns
  before the row are the even row's, zeroed before the product); past column 2*K zeros
  again. Neither descriptor reaches past x's last element.

The grid's second axis is the parity, so each program runs one loop of TMA loads and
the weight's rows into the tensor cores with fp32 accumulation, and stores its rows of
y (every other row of [M, N]) with the bias added. The weight's rows are as unaligned
as x's: ``paired_rows_forward`` loads them as 8-byte vectors, and
``paired_rows_forward_boxed`` by TMA boxes from ``boxed_weights``' padded copy.

No solver runs either yet (bench/results/paired_rows_h100.txt, an H100, point 2D's
forward GEMM, device time by CUDA-graph replay / with L2 flushed): the whole-row
implicit GEMM patch_implicit runs takes 53 / 57 us; the vector-weight kernel 47 / 52
with the tiles below; the boxed-weight kernel 38 / 42 with 128x256 tiles, plus 6 / 11
for the weight's copy; cuBLAS on rows padded to 592, 29 / 33. So the copy eats most of
what the boxes save, and one launch through Triton's ordinary route, which builds the
descriptors, cost 40-55 us of host time against 11 for the prepared whole-row launch:
a solver needs a prepared launch that takes descriptors, and a weight copy it pays
once rather than per call, before either pays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmconv.kernels import compiled
from gemmconv.kernels.boxed_rows_gemm import TMA_ALIGNMENT
from gemmconv.kernels.patch_gemm import vector_elements
from gemmconv.kernels.patch_index import DeviceHelper
from gemmconv.kernels.program_order import grouped_tile
from gemmconv.kernels.tiles import TileConfig

# Tiles for half precision: the best of bench/probes/paired_rows_probe.py's sweep on an H100
# with L2 flushed in both dtypes (bench/results/paired_rows_h100.txt).
FORWARD_TILES = {
    torch.float16: TileConfig(128, 128, 64, 4, 3),
    torch.bfloat16: TileConfig(128, 128, 64, 4, 3),
}


def _accumulate(x_desc, row0, col0, k_start, w_ptr, w_row, n_ok, KRED, acc,
                ROW_ALIGN: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc + x's box rows [row0, +BLOCK_M), columns col0 + k for k from ``k_start`` to
    the reduction's end, times the weight's rows ``w_row`` at columns k."""
    for k0 in range(k_start, KRED, BLOCK_K):
        a = x_desc.load([row0, col0 + k0])
        kr = k0 + tl.arange(0, BLOCK_K)
        # Constant over each aligned vector of ROW_ALIGN columns, so the loads stay vectors.
        k_ok = kr // ROW_ALIGN < KRED // ROW_ALIGN
        b = tl.load(w_ptr + w_row[None, :] + kr[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, b, acc)
    return acc


accumulate = DeviceHelper(_accumulate)


def _store_rows(acc, b_ptr, y_ptr, kout, n_ok, row0, parity, M, YSN, YSC, BS,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """Stores ``acc`` (+ the bias) as y's rows of one parity: the box's row i is sample
    2 * (row0 + i) + parity."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + kout * BS, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    m = 2 * (row0 + tl.arange(0, BLOCK_M)) + parity
    tl.store(y_ptr + m[:, None].to(tl.int64) * YSN + kout[None, :].to(tl.int64) * YSC,
             acc.to(y_ptr.dtype.element_ty), mask=(m < M)[:, None] & n_ok[None, :])  # fmt: skip


store_rows = DeviceHelper(_store_rows)


def _forward_kernel(
    x_even, x_odd, w_ptr, b_ptr, y_ptr,
    M, KOUT, KRED, WLD, YSN, YSC, BS,
    HAS_BIAS: tl.constexpr,
    SHIFT: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    pairs = (M + 1) // 2
    pid_m, pid_n = grouped_tile(tl.program_id(0), pairs, KOUT, BLOCK_M, BLOCK_N, GROUP_M)
    parity = tl.program_id(1)
    kout = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = kout < KOUT
    w_row = tl.multiple_of(kout.to(tl.int64) * WLD, ROW_ALIGN)
    row0 = pid_m * BLOCK_M
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    if parity == 0:
        acc = accumulate(x_even, row0, 0, 0, w_ptr, w_row, n_ok, KRED, acc, ROW_ALIGN, BLOCK_K)
    else:
        # The odd row starts SHIFT elements past a 16-byte boundary, where a box may not
        # start: the first box starts at the boundary, SHIFT columns early, and those
        # columns (the even row's last) are zeroed before they are multiplied, so even
        # an infinity there reaches no other sample.
        kr = tl.arange(0, BLOCK_K) - SHIFT
        a = x_odd.load([row0, KRED - SHIFT])
        a = tl.where(kr[None, :] >= 0, a, 0.0)
        k_ok = (kr >= 0) & (kr < KRED)
        b = tl.load(w_ptr + w_row[None, :] + kr[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, b, acc)
        acc = accumulate(x_odd, row0, KRED, BLOCK_K - SHIFT, w_ptr, w_row, n_ok, KRED, acc,
                         ROW_ALIGN, BLOCK_K)  # fmt: skip
    store_rows(acc, b_ptr, y_ptr, kout, n_ok, row0, parity, M, YSN, YSC, BS, HAS_BIAS, BLOCK_M)


def _accumulate_boxes(x_desc, x_col0, w_desc, row0, n0, k_start, k_end, acc,
                      BLOCK_K: tl.constexpr):  # fmt: skip
    """acc + x's boxes at columns x_col0 + k times the weight's boxes at columns k, for
    k from ``k_start`` up to ``k_end`` in steps of BLOCK_K (every start 16-byte aligned)."""
    for k0 in range(k_start, k_end, BLOCK_K):
        a = x_desc.load([row0, x_col0 + k0])
        b = w_desc.load([n0, k0])
        acc = tl.dot(a, b.T, acc)
    return acc


accumulate_boxes = DeviceHelper(_accumulate_boxes)


def _forward_kernel_boxed_weight(
    x_even, x_odd, w_even, w_odd, b_ptr, y_ptr,
    M, KOUT, KRED, YSN, YSC, BS,
    HAS_BIAS: tl.constexpr,
    SHIFT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """_forward_kernel with the weight's rows from TMA boxes too: ``w_even`` is the
    weight padded with SHIFT zero columns after each row, ``w_odd`` with SHIFT before,
    so the odd rows' boxes, which start SHIFT columns early, meet their columns."""
    pairs = (M + 1) // 2
    pid_m, pid_n = grouped_tile(tl.program_id(0), pairs, KOUT, BLOCK_M, BLOCK_N, GROUP_M)
    parity = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    kout = n0 + tl.arange(0, BLOCK_N)
    n_ok = kout < KOUT
    row0 = pid_m * BLOCK_M
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    if parity == 0:
        acc = accumulate_boxes(x_even, 0, w_even, row0, n0, 0, KRED, acc, BLOCK_K)
    else:
        # The first box's SHIFT columns before the odd row are the even row's: zeroed,
        # as in _forward_kernel.
        kr = tl.arange(0, BLOCK_K) - SHIFT
        a = x_odd.load([row0, KRED - SHIFT])
        a = tl.where(kr[None, :] >= 0, a, 0.0)
        acc = tl.dot(a, w_odd.load([n0, 0]).T, acc)
        acc = accumulate_boxes(x_odd, KRED - SHIFT, w_odd, row0, n0, BLOCK_K, KRED + SHIFT, acc,
                               BLOCK_K)  # fmt: skip
    store_rows(acc, b_ptr, y_ptr, kout, n_ok, row0, parity, M, YSN, YSC, BS, HAS_BIAS, BLOCK_M)


def boxed_weights(weight_rows: torch.Tensor) -> torch.Tensor:
    """The weight's rows as _forward_kernel_boxed_weight reads them, in one copy:
    [N, 2 * (K + SHIFT)], the rows padded with SHIFT zeros after (the even half) and
    before (the odd half), both halves 16-byte aligned."""
    n, k = weight_rows.shape
    shift = _shift(k, weight_rows.element_size())
    zeros = weight_rows.new_zeros(n, shift)
    return torch.cat([weight_rows, zeros, zeros, weight_rows], dim=1)


def _shift(k: int, element_size: int) -> int:
    """Elements an odd row starts past a 16-byte boundary (rows 8 bytes off: 4 halves)."""
    return (k * element_size % TMA_ALIGNMENT) // element_size


def paired_rows_forward_boxed(
    x_rows: torch.Tensor,
    weights: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: TileConfig | None = None,
) -> torch.Tensor:
    """paired_rows_forward with the weight's rows as ``weights`` = boxed_weights(W)."""
    _check_rows(x_rows)
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x_rows.shape
    n = weights.shape[0]
    shift = _shift(k, x_rows.element_size())
    width = k + shift
    if weights.shape != (n, 2 * width) or not weights.is_contiguous():
        raise ValueError(
            f"weights {tuple(weights.shape)}: expected boxed_weights' [{n}, {2 * width}]"
        )
    _check_result(out, bias, m, n)
    cfg = cfg or FORWARD_TILES[x_rows.dtype]
    even, odd = _descriptors(x_rows, cfg)
    box = [cfg.block_n, cfg.block_k]
    w_even = TensorDescriptor(weights, [n, width], [2 * width, 1], box)
    w_odd = TensorDescriptor(weights[:, width:], [n, width], [2 * width, 1], box)
    grid = _grid(m, n, cfg)
    kernel = compiled(_forward_kernel_boxed_weight, x_rows.device)
    kernel[grid](
        even, odd, w_even, w_odd, weights if bias is None else bias, out,
        m, n, k, out.stride(0), out.stride(1), 1 if bias is None else bias.stride(0),
        HAS_BIAS=bias is not None, SHIFT=shift,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8,
        **cfg.launch_options(),
    )  # fmt: skip
    return out


def applies(x_rows: torch.Tensor) -> bool:
    """Whether ``x_rows`` ([M, K], dense rows) is what this kernel is for: half
    precision, at least two rows, a 16-byte aligned start and rows 8 bytes off
    alignment (so pairs of rows are aligned)."""
    if x_rows.dim() != 2 or x_rows.dtype not in FORWARD_TILES or x_rows.shape[0] < 2:
        return False
    row_bytes = x_rows.stride(0) * x_rows.element_size()
    return (
        x_rows.stride(1) == 1
        and x_rows.stride(0) == x_rows.shape[1]
        and row_bytes % TMA_ALIGNMENT == TMA_ALIGNMENT // 2
        and x_rows.data_ptr() % TMA_ALIGNMENT == 0
    )


def _check_rows(x_rows: torch.Tensor) -> None:
    if not applies(x_rows):
        raise ValueError(
            f"x_rows {tuple(x_rows.shape)} with strides {x_rows.stride()}, {x_rows.dtype}: "
            "expected dense half-precision rows 8 bytes off 16-byte alignment, at least two, "
            "starting 16-byte aligned"
        )


def _check_result(out: torch.Tensor, bias: torch.Tensor | None, m: int, n: int) -> None:
    if out.shape != (m, n):
        raise ValueError(f"out {tuple(out.shape)}: expected [{m}, {n}]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)}: expected [{n}]")


def _grid(m: int, n: int, cfg: TileConfig) -> tuple[int, int]:
    """One program per tile of pairs of rows and of output columns, per parity."""
    return (triton.cdiv((m + 1) // 2, cfg.block_m) * triton.cdiv(n, cfg.block_n), 2)


def _descriptors(x_rows: torch.Tensor, cfg: TileConfig):
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x_rows.shape
    box = [cfg.block_m, cfg.block_k]
    even = TensorDescriptor(x_rows, [(m + 1) // 2, k], [2 * k, 1], box)
    odd = TensorDescriptor(x_rows, [m // 2, 2 * k], [2 * k, 1], box)
    return even, odd


def paired_rows_forward(
    x_rows: torch.Tensor,
    weight_rows: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: TileConfig | None = None,
) -> torch.Tensor:
    """out[M, N] = x_rows @ weight_rows^T (+ bias), for ``x_rows`` this kernel applies
    to (``applies``); ``weight_rows`` [N, K] with unit column stride, ``out`` any
    strides. ``cfg`` overrides the tile table (the probe's sweep)."""
    _check_rows(x_rows)
    m, k = x_rows.shape
    n = weight_rows.shape[0]
    if weight_rows.shape != (n, k) or weight_rows.stride(1) != 1:
        raise ValueError(f"weight_rows {tuple(weight_rows.shape)}: expected [{n}, {k}], dense rows")
    _check_result(out, bias, m, n)
    cfg = cfg or FORWARD_TILES[x_rows.dtype]
    even, odd = _descriptors(x_rows, cfg)
    grid = _grid(m, n, cfg)
    kernel = compiled(_forward_kernel, x_rows.device)
    kernel[grid](
        even, odd, weight_rows, weight_rows if bias is None else bias, out,
        m, n, k, weight_rows.stride(0), out.stride(0), out.stride(1),
        1 if bias is None else bias.stride(0),
        HAS_BIAS=bias is not None,
        SHIFT=_shift(k, x_rows.element_size()),
        ROW_ALIGN=vector_elements(x_rows.element_size(), k, weight_rows.stride(0)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8,
        **cfg.launch_options(),
    )  # fmt: skip
    return out


__all__ = [
    "FORWARD_TILES",
    "applies",
    "boxed_weights",
    "paired_rows_forward",
    "paired_rows_forward_boxed",
]
