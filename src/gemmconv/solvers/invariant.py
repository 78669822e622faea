"""The batch-invariant GEMM of the CPU solvers (gemmconv.batch_invariant).

CPU BLAS picks its kernel by the shape: MKL's sgemm (torch 2.14, AVX-512) summed a
row one way alone (a matrix-vector product), another in products of 2 or 3 rows and
in the tail rows of products under 12, and a third way in larger ones, so a sample
alone and the same sample in a batch differed in the last bits. Here every row is
computed by a product of one fixed shape, ``rows_chunk(K, N)`` rows by the same K
and N with the same strides, whatever the batch: the rows are taken in chunks of
that many and the last chunk is padded with zero rows. The chunk depends on the
reduction and output widths only, never on the row count; it is large enough that
each call's fixed cost stays small beside its work (2^23 multiply-adds, at least
256 rows: fp32 ran 1.05-1.1x the single product's time on the CPU machine for a
768 x 768 GEMM, bench/probes/cpu_row_invariance.py).

Every batch-invariant CPU solver (patch, point_output, pointwise, strided_pointwise)
multiplies the same column matrix (x's patches in x's memory order, unpadded) through
this one function, so that which of them a batch size chooses does not change a bit.
Where a sample has several pixels and its own product is at least a chunk's work, each
sample is multiplied alone instead (store_invariant_samples), from x's patches, by the
same rule for every solver.

On CUDA the same holds by the same means (cuda_rows_gemm): cuBLAS picks its kernel
(tile shape, split-K) from the product's shape, strides, dtype and the alignment of its
pointers, never from the values, so a product of one fixed shape computes each row the
same way whatever the other rows hold. There the chunk is bigger (CUDA_CHUNK_MACS),
the last chunk is the product over the LAST ``chunk`` rows (overlapping the one before:
a row computed twice gets the same bits twice) rather than a padded copy, which is made
only where the whole matrix is shorter than one chunk, and every operand is brought to
one canonical form first: rows padded with zero columns to 16 bytes (the padded
solvers' width, so their columns need no copy), dense, on a 16-byte boundary, so that
every chunk's pointers share one alignment. A channels-first y or x with several
pixels a sample is multiplied per sample instead (cuda_batched_gemm: W @ x[n], in
batched products of a fixed sample count), as the default pointwise solver does.
cuBLAS keeps to this on one stream; with several concurrent streams it may pick other
kernels unless CUBLAS_WORKSPACE_CONFIG is set (its documentation), which
torch.use_deterministic_algorithms also asks for.
"""

from __future__ import annotations

import math

import torch

from gemmconv.core import cached_zeros
from gemmconv.core.memory_format import Layout, output_layout
from gemmconv.core.problem import ConvProblem, dtype_name
from gemmconv.core.sizes import round_up
from gemmconv.solvers.views import batched_view, rows_view, try_view

# Products of 5-7 or 9-11 columns summed a row by its place in the product (MKL's
# sgemm, fp32): the row 4 places on gave other bits. Widths of a multiple of 16 did not,
# in fp32, bf16 and fp16 (bench/probes/cpu_row_invariance.py), so the weight gets zero
# rows up to one.
COLUMN_MULTIPLE = 16
# Multiply-adds a chunk's product should do at least, and the bounds of its rows.
CHUNK_MACS = 1 << 23
MIN_CHUNK_ROWS = 256
MAX_CHUNK_ROWS = 1 << 14


def rows_chunk(reduction: int, columns: int) -> int:
    """Rows of every product the invariant GEMM runs for a [*, reduction] @
    [reduction, columns] GEMM: a power of two, from the widths alone."""
    rows = MIN_CHUNK_ROWS
    while rows < MAX_CHUNK_ROWS and rows * max(1, reduction * columns) < CHUNK_MACS:
        rows *= 2
    return rows


def invariant_rows_gemm(
    a: torch.Tensor,
    wm: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    device_type: str | None = None,
) -> torch.Tensor:
    """out [M, N] = a [M, K] @ wm [N, K]^T (+ bias), each row summed as in any other
    batch. ``device_type`` ("cpu" or "cuda"; a's device where not given) says whose
    policy: the CPU's (below) or CUDA's (cuda_rows_gemm). On the CPU every product is
    ``rows_chunk(K, N)`` rows of dense operands by N rounded up to COLUMN_MULTIPLE
    columns (zero weight rows and bias beyond N), the last chunk padded with zero rows.
    Returns out."""
    if (device_type or a.device.type) == "cuda":
        return cuda_rows_gemm(a, wm, bias, out)
    m, k = a.shape
    n = wm.shape[0]
    if m == 0 or n == 0:
        return out
    if a.stride() != (k, 1):
        a = a.contiguous()
    width = round_up(n, COLUMN_MULTIPLE)
    if width != n:
        wm = torch.cat([wm, wm.new_zeros(width - n, k)])
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(width - n)])
    b = wm.contiguous().t()
    chunk = rows_chunk(k, width)
    full = m - m % chunk
    if width == n and out.stride() == (n, 1):
        for start in range(0, full, chunk):
            _product(a[start : start + chunk], b, bias, out[start : start + chunk])
    else:
        # Products land in dense rows, as the padded chunk's do: the same strides for all.
        scratch = a.new_empty(chunk, width)
        for start in range(0, full, chunk):
            product = _product(a[start : start + chunk], b, bias, scratch)
            out[start : start + chunk].copy_(product[:, :n])
    if full < m:
        padded = a.new_zeros(chunk, k)
        padded[: m - full].copy_(a[full:])
        last = _product(padded, b, bias, a.new_empty(chunk, width))
        out[full:].copy_(last[: m - full, :n])
    return out


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor):
    if bias is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


def store_invariant_rows(
    y: torch.Tensor,
    col: torch.Tensor,
    wm: torch.Tensor,
    bias: torch.Tensor | None,
    device_type: str | None = None,
) -> torch.Tensor:
    """y [N, K, S..] = col [N*prod(S), Kred] @ wm [K, Kred]^T (+ bias), the product's rows
    being y's pixels in channels-last order: straight into y where y is those rows,
    else through a rows buffer and one copy (on CUDA the transpose kernel's where it
    runs). ``device_type`` as for invariant_rows_gemm. Returns y."""
    y_rows = rows_view(y)
    if y_rows is not None:
        invariant_rows_gemm(col, wm, bias, y_rows, device_type)
        return y
    if (device_type or col.device.type) == "cuda":
        _rows_into_channels_first(cuda_rows_gemm(col, wm, bias), y)
        return y
    n, k, *spatial = y.shape
    product = invariant_rows_gemm(col, wm, bias, col.new_empty(col.shape[0], k))
    y.copy_(product.view(n, *spatial, k).movedim(-1, 1))
    return y


# ---- the CPU's per-sample form ---------------------------------------------------

# The boundary the CPU's per-sample operands start on (a cache line, the widest vector
# MKL and oneDNN load): every sample's block shares one alignment, so that no sample's
# product can take another path by its address.
CPU_ALIGN_BYTES = 64
# The least multiply-adds of a sample's own product for it to be multiplied alone: a
# row chunk's, whose fixed cost per product was small beside that work.
SAMPLE_MACS = CHUNK_MACS


def cpu_sample_products(p: ConvProblem) -> bool:
    """Whether the CPU's invariant forward of ``p`` multiplies each sample alone
    (store_invariant_samples), from the geometry alone: where a sample has several
    pixels and its own [pixels, Kred] @ [Kred, K] product is at least SAMPLE_MACS.
    Each sample is then one product of a fixed shape, which no other sample can
    change, and a channels-first y (or a channels-first 1x1's x) needs no transpose:
    the row chunks transposed both. On a 2-core EPYC the invariant call over the
    default fell from 1.67-1.80x to 1.12x on ResNet's channels-first 1x1 and from
    1.66-1.76x to 0.81-0.85x on SD3's patchify (bench/results/cpu_invariance.md)."""
    pixels = math.prod(p.output_spatial)
    return p.device_type == "cpu" and pixels > 1 and pixels * p.gemm_k * p.k >= SAMPLE_MACS


def _cpu_blocks(t3: torch.Tensor) -> torch.Tensor:
    """[N, A, B] with each sample's [A, B] block dense, the blocks a whole number of
    CPU_ALIGN_BYTES apart from a CPU_ALIGN_BYTES boundary (_canonical_samples)."""
    n, a, b = t3.shape
    stride = round_up(a * b, max(1, CPU_ALIGN_BYTES // t3.element_size()))
    return _canonical_samples(t3, n, stride, CPU_ALIGN_BYTES)


def store_invariant_samples(
    y: torch.Tensor,
    patches: torch.Tensor,
    wm: torch.Tensor,
    bias: torch.Tensor | None,
    p: ConvProblem,
) -> torch.Tensor:
    """y [N, K, S..] of ``p`` from x's patches [N, O1..Od, <patch>] (mapping.patch_view,
    the patch in wm's column order) and wm [K, C'], on the CPU, each sample in one
    product of its own fixed shape (cpu_sample_products): X_n [P, C'] @ W^T into a
    channels-last y's rows, else W [K, C'] @ X_n [C', P] into a channels-first y. The
    layout torch gives p's y says which, never y's strides (one sample's
    channels-first y is also a strided view of rows). Every operand is brought to one
    form first (each sample's block dense, on a CPU_ALIGN_BYTES boundary), so the
    solver that passes the patches (a view of x, or of a subsampled copy) changes no
    bit. Returns y."""
    n, k, *spatial = y.shape
    d = len(spatial)
    pixels = math.prod(spatial)
    c = math.prod(patches.shape[d + 1 :])
    if n == 0 or k == 0:
        return y
    wm = wm[:, :c]
    if wm.stride() != (c, 1) or not _aligned(wm, CPU_ALIGN_BYTES):
        wm = wm.clone(memory_format=torch.contiguous_format)  # a fresh, aligned block
    rows_out = output_layout(p.layout, p.dims, p.dtype, p.device_type) is Layout.CHANNELS_LAST
    if rows_out:
        a3 = _cpu_blocks(patches.reshape(n, pixels, c))
        samples = y.movedim(1, -1)
        out3, b, shift = try_view(samples, n, pixels, k), wm.t(), bias
        block = (pixels, k)
    else:
        order = (0, *range(d + 1, patches.dim()), *range(1, d + 1))
        a3 = _cpu_blocks(patches.permute(order).reshape(n, c, pixels))
        samples = y
        out3, b, shift = batched_view(y), wm, None if bias is None else bias.view(k, 1)
        block = (k, pixels)
    direct = out3 is not None and out3.stride()[1:] == (block[1], 1)
    direct = direct and _aligned(out3, CPU_ALIGN_BYTES)
    direct = direct and (out3.stride(0) * y.element_size()) % CPU_ALIGN_BYTES == 0
    scratch = None if direct else y.new_empty(block)  # a fresh, aligned block
    for i in range(n):
        left, right = (a3[i], b) if rows_out else (b, a3[i])
        if direct:
            _product(left, right, shift, out3[i])
        else:
            _product(left, right, shift, scratch)
            samples[i].copy_(scratch.view(samples.shape[1:]))
    return y


# ---- CUDA -------------------------------------------------------------------------

# Multiply-adds (counted at the half-precision rate: a wider type's count by its
# element size over 2, since cuBLAS runs fp32 as TF32 at half that rate and fp64
# slower still) that one chunk's product may do at most. Each product costs the host
# 5-20 us to launch on the GPU hosts, so a chunk must keep the GPU busier than that
# (2^31 is about 4 us of bf16 on an H100, 2^33 about 17), while a batch smaller than
# one chunk pays for the whole chunk (one ViT-B/16 image is 196 rows of 768 x 768:
# 2^33 makes its chunk 8192 rows). bench/probes/invariant_chunk_cost.py on an H100
# (bench/probes/results/invariance_h100.md), on the rows this form serves: point 2D
# fp32 cost 1.85x the default call at 2^31, 1.43x at 2^32, 1.58x at 2^33; ResNet 1x1
# channels-first 1.29x, 1.12x, 1.08x.
CUDA_CHUNK_MACS = 1 << 32
# Rows of a chunk's product: whole tiles of cuBLAS's largest (256 rows) at least, and at
# most what keeps every operand under 2^31 elements (32-bit GEMM indexing).
CUDA_MIN_CHUNK_ROWS = 256
CUDA_MAX_CHUNK_ROWS = 1 << 20
# The alignment every chunk's pointers and row strides share (the widest vector cuBLAS
# kernels load; Hopper's TMA needs it).
ALIGN_BYTES = 16
# A strided batched GEMM's batch count stays within CUDA's grid limit on its z axis.
CUDA_MAX_CHUNK_SAMPLES = 65535
_INT32_MAX = 2**31 - 1


def _macs_weight(dtype: torch.dtype) -> int:
    return max(1, dtype.itemsize // 2)


def _floor_pow2(value: int) -> int:
    return 1 << (max(1, value).bit_length() - 1)


def aligned_width(width: int, dtype: torch.dtype) -> int:
    """``width`` elements rounded up to whole ALIGN_BYTES (mapping.padded_reduction's
    rule, so a padded solver's columns are already that wide)."""
    return round_up(width, max(1, ALIGN_BYTES // dtype.itemsize))


def cuda_rows_chunk(
    reduction: int, columns: int, dtype: torch.dtype, macs: int | None = None
) -> int:
    """Rows of every product the CUDA invariant GEMM runs for a [*, reduction] @
    [reduction, columns] GEMM (both widths as padded, aligned_width and
    COLUMN_MULTIPLE): the largest power of two whose product stays within ``macs``
    (CUDA_CHUNK_MACS where not given), from the widths and dtype alone."""
    budget = (CUDA_CHUNK_MACS if macs is None else macs) // _macs_weight(dtype)
    rows = _floor_pow2(budget // max(1, reduction * columns))
    rows = min(max(rows, CUDA_MIN_CHUNK_ROWS), CUDA_MAX_CHUNK_ROWS)
    return min(rows, _floor_pow2(_INT32_MAX // max(1, reduction, columns)))


def cuda_samples_chunk(
    reduction: int, columns: int, pixels: int, dtype: torch.dtype, macs: int | None = None
) -> int:
    """Samples of every batched product of the per-sample form (cuda_batched_gemm):
    the largest power of two of samples whose product stays within ``macs``, at least
    one; from the widths, the pixels and the dtype alone."""
    budget = (CUDA_CHUNK_MACS if macs is None else macs) // _macs_weight(dtype)
    samples = _floor_pow2(budget // max(1, reduction * columns * pixels))
    fits = _INT32_MAX // max(1, pixels * max(reduction, columns))
    return max(1, min(samples, CUDA_MAX_CHUNK_SAMPLES, _floor_pow2(fits) if fits else 1))


def chunk_starts(total: int, chunk: int) -> list[int]:
    """Where each product of ``chunk`` rows starts over ``total >= chunk`` rows: every
    whole chunk, then the last ``chunk`` rows where some are left (overlapping)."""
    starts = list(range(0, total - chunk + 1, chunk))
    if total % chunk:
        starts.append(total - chunk)
    return starts


def _aligned(t: torch.Tensor, align: int = ALIGN_BYTES) -> bool:
    return t.data_ptr() % align == 0


def _canonical_samples(
    t3: torch.Tensor, count: int, stride: int, align: int = ALIGN_BYTES
) -> torch.Tensor:
    """[count, A, B] blocks with strides (stride, B, 1) on an ``align``-byte boundary:
    ``t3`` itself where it already is (and count is its length), else a new block
    holding ``t3``'s samples first and zeros after them. A new block is aligned as
    torch's allocators align every block (64 bytes on the CPU, more on CUDA)."""
    n, rows, cols = t3.shape
    if count == n and t3.stride() == (stride, cols, 1) and _aligned(t3, align):
        return t3
    block = t3.new_zeros(count, stride) if count > n else t3.new_empty(count, stride)
    view = block.as_strided((count, rows, cols), (stride, cols, 1))
    view[:n].copy_(t3)
    return view


def _canonical_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [R, w <= width] as dense rows of ``width`` (zero columns beyond w) on an
    ALIGN_BYTES boundary: ``t`` itself where it already is, else one copy."""
    r, w = t.shape
    if w == width and t.stride() == (width, 1) and _aligned(t):
        return t
    if w == width:
        return t.clone(memory_format=torch.contiguous_format)  # a fresh, aligned block
    # One kernel: a cat against kept zeros (cached_zeros).
    return torch.cat([t, cached_zeros.zeros((r, width - w), t)], dim=1)


def _padded_rows(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``t`` [r <= rows, w <= width] in a new dense [rows, width] block, zeros beyond."""
    block = t.new_zeros(rows, width)
    block[: t.shape[0], : t.shape[1]].copy_(t)
    return block


def cuda_rows_gemm(
    a: torch.Tensor, wm: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out [M, N] = a [M, K] @ wm [N, K]^T (+ bias) by CUDA's policy: every product is
    ``cuda_rows_chunk`` rows of the canonical operands (K rounded up to whole 16 bytes,
    N to COLUMN_MULTIPLE, zeros beyond; dense; 16-byte aligned), the last one over the
    last chunk rows, and a matrix shorter than a chunk padded to one. Columns of ``a``
    and ``wm`` beyond the reduction must be zeros (a padded solver's). Returns out, or
    where it is None, the product as an [M, N] view of dense rows."""
    m, k = a.shape
    n = wm.shape[0]
    out_given = out is not None
    if m == 0 or n == 0:
        return out if out_given else a.new_empty(m, n)
    kp, width = aligned_width(k, a.dtype), round_up(max(n, 1), COLUMN_MULTIPLE)
    b = (_canonical_rows(wm, kp) if width == n else _padded_rows(wm, width, kp)).t()
    if bias is not None and width != n:
        bias = torch.cat([bias, cached_zeros.zeros((width - n,), bias)])
    chunk = cuda_rows_chunk(kp, width, a.dtype)
    if m < chunk:
        product = _product(_padded_rows(a, chunk, kp), b, bias, a.new_empty(chunk, width))
        result = product[:m, :n]
        return out.copy_(result) if out_given else result
    a = _canonical_rows(a, kp)
    direct = out_given and width == n and out.stride() == (n, 1) and _aligned(out)
    target = out if direct else a.new_empty(m, width)
    for start in chunk_starts(m, chunk):
        _product(a[start : start + chunk], b, bias, target[start : start + chunk])
    if direct:
        return out
    return out.copy_(target[:, :n]) if out_given else target[:, :n]


def _rows_into_channels_first(product: torch.Tensor, y: torch.Tensor) -> None:
    """y [N, K, S..] from its pixels' rows ``product`` [N*prod(S), K] (any row stride):
    the transpose kernel where it runs (CUDA, triton, a batch within its grid), else
    torch's copy; either copies, so the bits are the same."""
    n, k, *spatial = y.shape
    y3 = batched_view(y)
    pixels = product.shape[0] // max(1, n)
    if y3 is not None and y.is_cuda and 0 < n <= CUDA_MAX_CHUNK_SAMPLES:
        from gemmconv.kernels import triton_available

        if triton_available():
            from gemmconv.kernels.strided_copy import strided_copy

            row = product.stride(0)
            src = product.as_strided((n, pixels, k), (pixels * row, row, 1))
            strided_copy(y3.transpose(1, 2), src)
            return
    y.copy_(product.reshape(n, *spatial, k).movedim(-1, 1))


def cuda_batched_gemm(
    w: torch.Tensor, x3: torch.Tensor, bias: torch.Tensor | None, y3: torch.Tensor
) -> torch.Tensor:
    """y3 [N, K, P] = w [K, C] @ x3[n] [C, P] (+ bias) per sample, batch-invariant on
    CUDA: batched products of ``cuda_samples_chunk`` samples of canonical operands
    (each sample's block dense, on a 16-byte boundary, the blocks a whole number of 16
    bytes apart), the last over the last samples, a batch shorter than a chunk padded
    to one; the bias added after. Returns y3."""
    n, c, pixels = x3.shape
    k = w.shape[0]
    if n == 0 or k == 0:
        return y3
    if w.stride() != (c, 1) or not _aligned(w):
        w = w.clone(memory_format=torch.contiguous_format)  # a fresh, aligned block
    chunk = cuda_samples_chunk(c, k, pixels, x3.dtype)
    count = max(n, chunk)
    xs = _canonical_samples(x3, count, aligned_width(c * pixels, x3.dtype))
    y_stride = aligned_width(k * pixels, y3.dtype)
    direct = count == n and y3.stride() == (y3.shape[1] * pixels, pixels, 1)
    direct = direct and y_stride == k * pixels and _aligned(y3)
    ys = y3 if direct else y3.new_empty(count, y_stride).as_strided(
        (count, k, pixels), (y_stride, pixels, 1))  # fmt: skip
    weights = w.expand(chunk, k, c)
    for start in chunk_starts(count, chunk):
        torch.bmm(weights, xs[start : start + chunk], out=ys[start : start + chunk])
    if not direct:
        y3.copy_(ys[:n])
    if bias is not None:
        y3.add_(bias.view(1, k, 1))
    return y3


# fp64 products with an odd reduction (147) summed a row by its place in the product
# even at widths of 16 (MKL's dgemm): no fp64 forward is made invariant on the CPU.
INVARIANT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def cpu_reasons(p: ConvProblem) -> list[str]:
    """Why the CPU solvers' invariant GEMM would not serve ``p`` (empty: it does)."""
    if p.dtype not in INVARIANT_DTYPES:
        return [f"CPU BLAS sums {dtype_name(p.dtype)} rows by their place in the product"]
    return []


__all__ = [
    "ALIGN_BYTES",
    "CHUNK_MACS",
    "COLUMN_MULTIPLE",
    "CPU_ALIGN_BYTES",
    "CUDA_CHUNK_MACS",
    "INVARIANT_DTYPES",
    "SAMPLE_MACS",
    "aligned_width",
    "chunk_starts",
    "cpu_reasons",
    "cpu_sample_products",
    "cuda_batched_gemm",
    "cuda_rows_chunk",
    "cuda_rows_gemm",
    "cuda_samples_chunk",
    "invariant_rows_gemm",
    "rows_chunk",
    "store_invariant_rows",
    "store_invariant_samples",
]
