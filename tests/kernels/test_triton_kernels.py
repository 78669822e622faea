"""The Triton patch permutation kernels and the solver built on them.

On the CPU the kernels run in Triton's interpreter (gemmconv.kernels compiles a
kernel for CPU tensors through it, as TRITON_INTERPRET=1 would), in fp32 and fp16:
the gather and scatter are pure copies, so they must match torch's permuted views
exactly. On CUDA (marker gpu) the same checks run compiled, in bf16, fp16 and fp32.
The solvers built on the kernels are checked against float64 by the solver matrix
(test_solver_matrix.py, interpreted on the CPU; test_gpu_solvers.py); here only the
channels-first rows path, in chunks.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib

import pytest
import torch

from gemmconv import ConvProblem, Direction, Layout
from gemmconv.core import device_rates
from gemmconv.core.memory_format import empty_in
from gemmconv.kernels import strided_copy as strided_copy_module
from gemmconv.kernels.patch_gemm import patch_gemm_forward, patch_gemm_weight_grad
from gemmconv.kernels.patch_permute import (
    PatchGeometry,
    contiguous_run,
    gather_patches,
    scatter_patches,
)
from gemmconv.kernels.strided_copy import pad_rows, strided_copy
from gemmconv.solvers import get_solver
from gemmconv.solvers.patch import padded_reduction, patches, rows_path

from rows_in_place import force_in_place_on_cuda
from solver_cases import Geometry, check_case, problem_for

# (spatial, kernel): exact tiling, a remainder that no patch reads, point-output.
SHAPES = {
    1: [((12,), (4,)), ((11,), (3,))],
    2: [((8, 9), (4, 3)), ((9, 7), (4, 3)), ((5, 3), (5, 3))],
    3: [((4, 6, 4), (2, 3, 2)), ((5, 7, 5), (2, 3, 2))],
}
CASES = [
    (dims, spatial, kernel, layout)
    for dims, shapes in SHAPES.items()
    for (spatial, kernel), layout in itertools.product(shapes, list(Layout))
]


def _ids(case) -> str:
    dims, spatial, kernel, layout = case
    short = "cf" if layout is Layout.CHANNELS_FIRST else "cl"
    return f"{dims}d-s{'x'.join(map(str, spatial))}-r{'x'.join(map(str, kernel))}-{short}"


def _problem(spatial, kernel, layout, dtype, device_type, c=3, n=2) -> ConvProblem:
    return ConvProblem.from_sizes(
        n, c, 5, spatial, kernel, kernel, layout=layout, dtype=dtype, device_type=device_type
    )


def _random(shape, layout, dtype, device, seed) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.rand(shape, generator=gen) * 2 - 1
    t = empty_in(shape, layout, dtype, device)
    return t.copy_(values.to(device=device, dtype=dtype))


def _check_gather_scatter(dims, spatial, kernel, layout, dtype, device, extra_pad: int) -> None:
    p = _problem(spatial, kernel, layout, dtype, device.type)
    seed = zlib.crc32(repr((spatial, kernel, layout, dtype, extra_pad)).encode())
    x = _random(p.input_shape, layout, dtype, device, seed)
    channels_last = layout is Layout.CHANNELS_LAST
    expected = patches(x, p).reshape(p.gemm_m, p.gemm_k)
    ld = padded_reduction(p) + extra_pad

    col = torch.full((p.gemm_m, ld), float("nan"), dtype=dtype, device=device)
    gather_patches(x, p.output_spatial, p.kernel, channels_last, out=col)
    assert torch.equal(col[:, : p.gemm_k], expected)
    assert torch.equal(col[:, p.gemm_k :], torch.zeros_like(col[:, p.gemm_k :]))

    # Scatter back into a NaN-filled dx: every covered element written, the rest untouched.
    dx = torch.full_like(x, float("nan"))
    scatter_patches(col, p.output_spatial, p.kernel, channels_last, dx)
    covered = (
        slice(None),
        slice(None),
        *(slice(0, o * r) for o, r in zip(p.output_spatial, p.kernel)),
    )
    assert torch.equal(dx[covered], x[covered])
    outside = torch.ones_like(dx, dtype=torch.bool)
    outside[covered] = False
    assert torch.isnan(dx[outside]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_gather_and_scatter_match_torch_views_interpreted(case, dtype):
    _check_gather_scatter(*case, dtype, torch.device("cpu"), extra_pad=0)


def test_gather_pads_to_a_wider_leading_dimension_interpreted():
    _check_gather_scatter(2, (9, 7), (4, 3), Layout.CHANNELS_LAST, torch.float32,
                          torch.device("cpu"), extra_pad=24)  # fmt: skip


def test_gather_reads_through_arbitrary_strides_interpreted():
    p = _problem((8, 6), (4, 3), Layout.CHANNELS_FIRST, torch.float32, "cpu")
    wide = _random((2, 3, 8, 12), Layout.CHANNELS_FIRST, torch.float32, torch.device("cpu"), 7)
    x = wide[..., ::2]  # a strided, non-dense view
    col = torch.full((p.gemm_m, p.gemm_k), float("nan"))
    gather_patches(x, p.output_spatial, p.kernel, False, out=col)
    assert torch.equal(col, patches(x, p).reshape(p.gemm_m, p.gemm_k))


def _assert_round_trip(x: torch.Tensor, p: ConvProblem, channels_last: bool) -> None:
    """x (covered entirely by patches) gathers to torch's patch rows and scatters back."""
    col = torch.full((p.gemm_m, p.gemm_k), float("nan"))
    gather_patches(x, p.output_spatial, p.kernel, channels_last, out=col)
    assert torch.equal(col, patches(x, p).reshape(p.gemm_m, p.gemm_k))
    dx = torch.full_like(x, float("nan"))
    scatter_patches(col, p.output_spatial, p.kernel, channels_last, dx)
    assert torch.equal(dx, x)


@pytest.mark.parametrize(
    ("c", "spatial", "kernel", "memory"),
    [
        (1, (12,), (1,), Layout.CHANNELS_FIRST),  # the H200 property-test failure
        (1, (9, 6), (3, 1), Layout.CHANNELS_FIRST),
        (3, (8, 6), (2, 1), Layout.CHANNELS_FIRST),
    ],
)
def test_channels_last_columns_with_unit_last_kernel_interpreted(c, spatial, kernel, memory):
    # R3 = 1 in the channels-last column order with x's strides not nested (s3 != C*sc:
    # a C = 1 contiguous x has sc = S, not 1): o3 must step by s3. The kernels once
    # stepped by C*sc here and read and wrote the wrong elements.
    p = _problem(spatial, kernel, Layout.CHANNELS_LAST, torch.float32, "cpu", c=c)
    x = _random(p.input_shape, memory, torch.float32, torch.device("cpu"), 23)
    g = PatchGeometry.of(x, p.output_spatial, p.kernel, True)
    assert g.strides[4] != g.c * g.strides[1]
    _assert_round_trip(x, p, True)


@pytest.mark.parametrize("memory", list(Layout))
@pytest.mark.parametrize("columns", list(Layout))
def test_column_order_independent_of_memory_order_interpreted(memory, columns):
    # Mismatched pairs take the general index map (no contiguous run to exploit).
    p = _problem((8, 6, 4), (2, 3, 2), columns, torch.float32, "cpu")
    x = _random(p.input_shape, memory, torch.float32, torch.device("cpu"), 17)
    channels_last = columns is Layout.CHANNELS_LAST
    g = PatchGeometry.of(x, p.output_spatial, p.kernel, channels_last)
    assert (contiguous_run(g) == 0) == (channels_last and memory is Layout.CHANNELS_FIRST)
    _assert_round_trip(x, p, channels_last)


def test_bad_buffers_are_refused_with_their_shapes():
    x = torch.rand(2, 3, 8, 6)
    with pytest.raises(ValueError, match=r"out of shape \(8, 35\)"):
        gather_patches(x, (2, 2), (4, 3), False, out=torch.empty(8, 35))
    with pytest.raises(ValueError, match="expected dense rows"):
        gather_patches(x, (2, 2), (4, 3), False, out=torch.empty(8, 80)[:, :40])
    with pytest.raises(ValueError, match="exceeds spatial"):
        gather_patches(x, (3, 2), (4, 3), False, out=torch.empty(12, 36))
    with pytest.raises(ValueError, match="expected torch.float32"):
        gather_patches(x, (2, 2), (4, 3), False, out=torch.empty(8, 36, dtype=torch.float16))


# ---- the scaled gather: fp8 operands, here into fp16 and fp32 --------------------
# Triton's interpreter rounds fp32 -> fp8 one binade low for some values that round up
# to a power of two (1.951 * s -> 1.0 where torch gives 2.0), so the CPU checks the
# scaled kernels' index maps and arithmetic with fp16 and fp32 destinations; the fp8
# bytes themselves are checked on CUDA (tests/api/test_fp8.py).

SCALE = 3.7
# (source dtype, destination dtype): a rounding store, an exact one, bf16 widened.
SCALED_DTYPES = [
    (torch.float32, torch.float16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float16),
]


def _dtype_ids(pair) -> str:
    return "-".join(str(d).removeprefix("torch.") for d in pair)


def _scaled(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's reference: the product in fp32, rounded once to ``dtype``."""
    return (t.float() * scale).to(dtype)


def _check_scaled_gather(case, dtypes, transposed, padded, x_layout=None) -> None:
    dims, spatial, kernel, layout = case
    source_dtype, dest_dtype = dtypes
    p = _problem(spatial, kernel, layout, source_dtype, "cpu")
    seed = zlib.crc32(repr((spatial, kernel, layout, dtypes, transposed)).encode())
    x = _random(p.input_shape, x_layout or layout, source_dtype, torch.device("cpu"), seed)
    channels_last = layout is Layout.CHANNELS_LAST
    scale = torch.tensor([SCALE])
    m, k = p.gemm_m, p.gemm_k
    expected = _scaled(patches(x, p).reshape(m, k), scale, dest_dtype)
    ld, mp = (-(-k // 16) * 16 + 16, -(-m // 16) * 16) if padded else (k, m)
    shape = (ld, mp) if transposed else (m, ld)
    out = torch.full(shape, float("nan"), dtype=dest_dtype)
    gather_patches(x, p.output_spatial, p.kernel, channels_last, out, scale, transposed)
    cols = out.t() if transposed else out  # [M', ld] or [M, ld]
    assert torch.equal(cols[:m, :k], expected)
    zeros = torch.ones_like(cols, dtype=torch.bool)
    zeros[:m, :k] = False
    assert (cols[zeros] == 0).all()  # the padding, written (NaN before)


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("transposed", [False, True], ids=["cols", "cols_t"])
@pytest.mark.parametrize("dtypes", SCALED_DTYPES, ids=_dtype_ids)
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_scaled_gather_matches_torch_interpreted(case, dtypes, transposed, padded):
    _check_scaled_gather(case, dtypes, transposed, padded)


@pytest.mark.parametrize("transposed", [False, True], ids=["cols", "cols_t"])
@pytest.mark.parametrize("memory", list(Layout))
def test_scaled_gather_in_either_column_order_from_either_memory_interpreted(memory, transposed):
    # The general index map (channels-last columns of a channels-first x) as well.
    for columns in Layout:
        case = (3, (5, 7, 5), (2, 3, 2), columns)
        _check_scaled_gather(case, SCALED_DTYPES[0], transposed, True, x_layout=memory)


def test_scaled_gather_keeps_the_padding_zero_whatever_the_scale_interpreted():
    # A NaN scale (a NaN amax) makes NaN values but never NaN padding: torch's path
    # zeroes the padding apart from the multiply.
    x = torch.rand(2, 3, 8, 6)
    for transposed, shape in ((False, (8, 48)), (True, (48, 16))):
        out = torch.full(shape, 1.0, dtype=torch.float16)
        gather_patches(x, (2, 2), (4, 3), False, out, torch.tensor([float("nan")]), transposed)
        cols = out.t() if transposed else out
        assert cols[:8, :36].isnan().all() and (cols[:, 36:] == 0).all()
        assert (cols[8:] == 0).all()


def test_unscaled_transposed_gather_copies_interpreted():
    p = _problem((9, 7), (4, 3), Layout.CHANNELS_LAST, torch.float32, "cpu")
    x = _random(p.input_shape, Layout.CHANNELS_LAST, torch.float32, torch.device("cpu"), 3)
    out = torch.full((48, 16), float("nan"))
    gather_patches(x, p.output_spatial, p.kernel, True, out, transposed=True)
    expected = torch.zeros(48, 16)
    expected[: p.gemm_k, : p.gemm_m] = patches(x, p).reshape(p.gemm_m, p.gemm_k).t()
    assert torch.equal(out, expected)


def test_bad_scaled_gathers_are_refused_with_their_values():
    x = torch.rand(2, 3, 8, 6)
    out = torch.empty(8, 36, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"scale of shape \(2,\), torch.float32 on cpu"):
        gather_patches(x, (2, 2), (4, 3), False, out, torch.ones(2))
    with pytest.raises(ValueError, match="torch.float64 on cpu: expected one torch.float32"):
        gather_patches(x, (2, 2), (4, 3), False, out, torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"out of shape \(36, 7\): expected \[>= 36, >= 8\]"):
        gather_patches(x, (2, 2), (4, 3), False, torch.empty(36, 7), transposed=True)
    with pytest.raises(ValueError, match="another dtype only with a scale"):
        gather_patches(x, (2, 2), (4, 3), False, out)


# ---- the transpose kernel ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(3, 70, 130), (1, 196, 12), (5, 1, 9)])
def test_strided_copy_transposes_interpreted(shape, dtype):
    # Sizes that are not tile multiples (the 64 x 64 tile's masked edges) and a unit dim.
    src = _random(shape, Layout.CHANNELS_FIRST, dtype, torch.device("cpu"), 31)
    b, i, j = shape
    dst = torch.full((b, j, i), float("nan"), dtype=dtype).transpose(1, 2)
    assert strided_copy(dst, src) is dst
    assert torch.equal(dst, src)


@pytest.mark.parametrize(
    ("dtype", "width", "padded", "words"),
    [
        (torch.float16, 588, 592, torch.int64),  # point 2D: 1176-byte rows, 147 words
        (torch.float16, 42, 48, torch.int32),  # 84-byte rows: 4-byte words
        (torch.float16, 21, 24, None),  # 42-byte rows: element by element
        (torch.float32, 3, 4, torch.int32),  # fp32 elements are 4-byte words already
    ],
)
def test_pad_rows_copies_and_zero_fills_interpreted(dtype, width, padded, words):
    src = _random((37, width), Layout.CHANNELS_FIRST, dtype, torch.device("cpu"), 41)
    dst = torch.full((37, padded), float("nan"), dtype=dtype)
    assert strided_copy_module._word_dtype(dst, src) == words
    assert pad_rows(dst, src) is dst
    assert torch.equal(dst[:, :width], src)
    assert torch.equal(dst[:, width:], torch.zeros(37, padded - width, dtype=dtype))
    # A slice of a wider buffer as the source: its row stride differs from its width.
    wide = torch.full((37, padded), float("nan"), dtype=dtype)
    pad_rows(wide, dst[:, :width])
    assert torch.equal(wide, dst)


@pytest.mark.parametrize("dtypes", SCALED_DTYPES, ids=_dtype_ids)
@pytest.mark.parametrize("shape", [(3, 70, 130), (1, 196, 12), (5, 1, 9)])
def test_scaled_strided_copy_transposes_interpreted(shape, dtypes):
    # dY [N, K, P] -> rows [N, P, K], quantized: backward-data's fp8 operand.
    source_dtype, dest_dtype = dtypes
    src = _random(shape, Layout.CHANNELS_FIRST, source_dtype, torch.device("cpu"), 43)
    b, i, j = shape
    scale = torch.tensor([SCALE])
    dst = torch.full((b, j, i), float("nan"), dtype=dest_dtype)
    assert strided_copy(dst, src.transpose(1, 2), scale) is dst
    assert torch.equal(dst, _scaled(src.transpose(1, 2), scale, dest_dtype))


@pytest.mark.parametrize("dtypes", SCALED_DTYPES, ids=_dtype_ids)
@pytest.mark.parametrize(("m", "padded"), [(70, 80), (130, 144), (64, 64)])
def test_scaled_pad_rows_transposes_and_zero_fills_interpreted(m, padded, dtypes):
    # rows [M, K] -> dY^T [K, M'], zeros in columns M..M'-1: the weight gradient's operand.
    source_dtype, dest_dtype = dtypes
    rows = _random((m, 48), Layout.CHANNELS_FIRST, source_dtype, torch.device("cpu"), 47)
    scale = torch.tensor([SCALE])
    dst = torch.full((48, padded), float("nan"), dtype=dest_dtype)
    assert pad_rows(dst, rows.t(), scale) is dst
    assert torch.equal(dst[:, :m], _scaled(rows.t(), scale, dest_dtype))
    assert (dst[:, m:] == 0).all()
    # A NaN scale leaves the padding zero.
    pad_rows(dst, rows.t(), torch.tensor([float("nan")]))
    assert dst[:, :m].isnan().all() and (dst[:, m:] == 0).all()


def test_scaled_copies_refuse_bad_scales_with_their_values():
    src = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"scale of shape \(3,\), torch.float32 on cpu"):
        strided_copy(torch.zeros(2, 3, 4, dtype=torch.float16), src, torch.ones(3))
    with pytest.raises(ValueError, match="torch.float16 on cpu: expected one torch.float32"):
        pad_rows(torch.zeros(3, 8), torch.zeros(3, 4), torch.ones(1, dtype=torch.float16))
    with pytest.raises(ValueError, match="another only with a scale"):
        pad_rows(torch.zeros(3, 8, dtype=torch.float16), torch.zeros(3, 4))


def test_strided_copy_refuses_mismatches_with_their_values():
    a = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"dst \(2, 4, 3\) and src \(2, 3, 4\)"):
        strided_copy(torch.zeros(2, 4, 3), a)
    with pytest.raises(ValueError, match="torch.float16 on cpu, src torch.float32.*only with a"):
        strided_copy(torch.zeros(2, 3, 4, dtype=torch.float16), a)
    with pytest.raises(ValueError, match="one 2-D or 3-D shape"):
        strided_copy(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match=r"dst \(3, 4\) .* src \(3, 5\).*at least as wide"):
        pad_rows(torch.zeros(3, 4), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="same rows"):
        pad_rows(torch.zeros(3, 4), torch.zeros(2, 4))


# ---- the solver built on the kernels -----------------------------------------

ROWS_PATH_CASES = [
    # (spatial, kernel): 3 x 2 and 3 x 3 pixels per sample, a row of them not a multiple
    # of 16 bytes in fp32 or fp16 (an unaligned bmm), so all three directions take it.
    ((12, 6), (4, 3)),
    ((13, 9), (4, 3)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
@pytest.mark.parametrize(("spatial", "kernel"), ROWS_PATH_CASES)
@pytest.mark.parametrize("chunk", [1, 2, None], ids=["chunk1", "chunk2", "whole"])
def test_channels_first_rows_path_in_chunks_interpreted(
    spatial, kernel, direction, dtype, chunk, monkeypatch
):
    # One sample per chunk, two (the last chunk short: N = 3), or all at once: every
    # chunk's slice of x, dY, y and dx lands where it belongs, bias included.
    solver = get_solver("patch_triton")
    monkeypatch.setattr(type(solver), "devices", frozenset({"cpu", "cuda"}))
    if chunk is not None:
        monkeypatch.setattr(rows_path, "chunk_samples", lambda p, ld: chunk)
    g = Geometry("rows", spatial=spatial, kernel=kernel, stride=kernel, c=3, n=3, k=5)
    p = problem_for(g, 2, Layout.CHANNELS_FIRST, dtype, "cpu", direction)
    assert rows_path.applies(p)
    case = (solver, "patch", g, 2, Layout.CHANNELS_FIRST, dtype, direction)
    check_case(case, "cpu", seed=zlib.crc32(repr((spatial, direction, dtype)).encode()))


@pytest.mark.parametrize("in_place", [False, True], ids=["cublas", "in_place"])
def test_rows_path_runs_in_one_pass_unless_its_buffers_exceed_both_limits(in_place, monkeypatch):
    # ViT-B/16 channels-first at batch 256: column rows and y or dY rows are 77 MB each,
    # two copies of x, within CHUNK_ABOVE_BYTES: one pass, no loop over chunks. Where
    # the forward's GEMM writes y in place there are no y rows and no transpose.
    force_in_place_on_cuda(monkeypatch, in_place)

    def vit(n, dtype=torch.bfloat16):
        return ConvProblem.from_sizes(n, 3, 768, (224, 224), (16, 16), (16, 16),
                                      dtype=dtype, device_type="cuda")  # fmt: skip

    solver = get_solver("patch_triton")
    p = vit(256)
    assert rows_path.applies(p)  # 196 pixels x 2 bytes: unaligned
    assert rows_path.in_place(p) == in_place
    assert rows_path.chunk_samples(p, 768) == 256
    assert solver.workspace_bytes(p) == 256 * 196 * (768 if in_place else 768 + 768) * 2
    assert solver.gemm_launches(p) == (2 if in_place else 3)
    assert not rows_path.applies(vit(256, torch.float32))  # 196 x 4 bytes: aligned
    wgrad = dataclasses.replace(p, direction=Direction.BACKWARD_WEIGHTS)
    # dY is copied to rows by the transpose kernel, or read in place by the GEMM, which
    # then sums its fp32 slices in a third launch.
    assert rows_path.in_place(wgrad) == in_place
    assert solver.workspace_bytes(wgrad) == 256 * 196 * (768 if in_place else 768 + 768) * 2
    assert solver.gemm_launches(wgrad) == 3
    # At batch 2048 the weight gradient's buffers would be 1.2 GB (0.6 with dY read in
    # place), beyond both x (617 MB) and 256 MiB: chunks that, with the padded weight
    # and the fp32 sums (768 x 768 x (2 + 8) bytes), fit in one x.
    big = dataclasses.replace(vit(2048), direction=Direction.BACKWARD_WEIGHTS)
    fixed = 768 * 768 * 10
    per_sample = 196 * (768 if in_place else 768 + 768) * 2
    step = rows_path.chunk_samples(big, 768)
    assert step == (big.largest_operand_bytes() - fixed) // per_sample < 2048
    assert solver.workspace_bytes(big) + fixed <= big.largest_operand_bytes()
    assert solver.gemm_launches(big) == 3 * -(-2048 // step)
    # A forward holds the columns and y's rows, or the columns alone: chunks as long as
    # the weight gradient's.
    assert rows_path.chunk_samples(vit(2048), 768) == step
    aligned = ConvProblem.from_sizes(8, 3, 1280, (1024, 1024), (16, 16), (16, 16),
                                     dtype=torch.bfloat16, device_type="cuda")  # fmt: skip
    assert not rows_path.applies(aligned)  # SAM: 4096 pixels, the bmm is aligned
    wgrad = dataclasses.replace(aligned, direction=Direction.BACKWARD_WEIGHTS)
    assert rows_path.applies(wgrad)  # dY is copied to rows either way


def test_the_rows_path_gemm_runs_in_place_where_its_estimate_is_cheaper(monkeypatch):
    # Off CUDA (the interpreter's runs in these tests) the in-place GEMMs serve every
    # half-precision direction. On CUDA (the H200's rates, as the table holds them)
    # from 32768 pixel rows with runs of at least 8 bytes, where the slower GEMM costs
    # less than the transpose it saves: ViT-B/16's forward at batch 256 (50176 rows,
    # 196 pixels a sample: runs of 4 bf16 elements) but not its backward-data (tied
    # when measured) or weight gradient (lost); DiT-XL/2's bandwidth-bound weight
    # gradient (16 columns), not CLIP-L/14's flop-bound one; never ViT-B/16 at batch
    # 64 nor ViT-B/32 (49 pixels), which lost whatever the estimate.
    monkeypatch.setattr(rows_path, "rates_for", lambda device_type: device_rates.H200)
    tiny = _problem((12, 6), (4, 3), Layout.CHANNELS_FIRST, torch.float16, "cpu")

    def model(n, c, k, size, patch, dtype=torch.bfloat16):
        return ConvProblem.from_sizes(n, c, k, (size, size), patch, patch, dtype=dtype,
                                      device_type="cuda")  # fmt: skip

    def vit(n, patch, dtype=torch.bfloat16):
        return model(n, 3, 768, 224, patch, dtype)

    dit, clip = model(256, 4, 1152, 32, 2), model(256, 3, 1024, 336, 14)
    assert rows_path.pixel_run_bytes(vit(256, 16)) == 8
    assert rows_path.pixel_run_bytes(vit(256, 32)) == 2
    for p, direction, expected in [
        (tiny, Direction.FORWARD, True),
        (tiny, Direction.BACKWARD_DATA, True),
        (tiny, Direction.BACKWARD_WEIGHTS, True),
        (dataclasses.replace(tiny, dtype=torch.float32), Direction.FORWARD, False),
        (vit(256, 16), Direction.FORWARD, True),
        (vit(256, 16, torch.float16), Direction.FORWARD, True),
        (vit(256, 16, torch.float32), Direction.FORWARD, False),
        (vit(256, 16), Direction.BACKWARD_DATA, False),
        (vit(256, 16), Direction.BACKWARD_WEIGHTS, False),
        (vit(64, 16), Direction.FORWARD, False),
        (vit(1024, 32), Direction.FORWARD, False),
        (dit, Direction.BACKWARD_WEIGHTS, True),
        (clip, Direction.BACKWARD_WEIGHTS, False),
    ]:
        assert rows_path.in_place(dataclasses.replace(p, direction=direction)) == expected
    # The estimate decides: were the in-place weight gradient as fast as cuBLAS's,
    # saving the transpose would pay on ViT-B/16 too.
    wgrad = dataclasses.replace(vit(256, 16), direction=Direction.BACKWARD_WEIGHTS)
    monkeypatch.setitem(rows_path.IN_PLACE_GEMM_SLOWDOWN, Direction.BACKWARD_WEIGHTS, 1.0)
    assert rows_path.in_place(wgrad)


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_rows_path_chunks_where_a_small_limit_is_exceeded_interpreted(direction, monkeypatch):
    # Four samples of 3 x 2 pixels, 36 + 5 columns each in fp32: the two buffers of two
    # samples fit a limit set just above them, four do not; the solver then runs two
    # chunks of two.
    solver = get_solver("patch_triton")
    monkeypatch.setattr(type(solver), "devices", frozenset({"cpu", "cuda"}))
    g = Geometry("rows", spatial=(12, 6), kernel=(4, 3), stride=(4, 3), c=3, n=4, k=5)
    p = problem_for(g, 2, Layout.CHANNELS_FIRST, torch.float32, "cpu", direction)
    ld = padded_reduction(p)
    fixed = p.k * ld * (4 + 8)
    monkeypatch.setattr(rows_path, "CHUNK_ABOVE_BYTES", fixed + 2 * 6 * (ld + p.k) * 4)
    assert p.largest_operand_bytes() < rows_path.CHUNK_ABOVE_BYTES
    assert rows_path.chunk_samples(p, ld) == 2
    assert solver.gemm_launches(p) == 3 * 2
    case = (solver, "patch", g, 2, Layout.CHANNELS_FIRST, torch.float32, direction)
    check_case(case, "cpu", seed=zlib.crc32(repr(("small limit", direction)).encode()))


def test_dw_from_kept_columns_reads_dy_in_place_as_the_weight_gradient_decides(monkeypatch):
    # The forward of ViT-B/16 at batch 256 runs in place on CUDA and its weight gradient
    # does not: dW from the forward's kept columns must follow the weight gradient (it
    # once followed the forward and ran the slower kernel).
    monkeypatch.setattr(rows_path, "transpose_kernel_runs", lambda p: True)
    p = ConvProblem.from_sizes(256, 3, 768, (224, 224), 16, 16, dtype=torch.bfloat16,
                               device_type="cuda")  # fmt: skip
    monkeypatch.setattr(rows_path, "rates_for", lambda device_type: device_rates.H200)
    assert rows_path.in_place(p)
    assert not rows_path.weight_gradient_reads_dy(p)
    force_in_place_on_cuda(monkeypatch, True)
    assert rows_path.weight_gradient_reads_dy(p)


def test_triton_patch_solver_declares_cuda_only():
    p = _problem((8, 6), (4, 3), Layout.CHANNELS_FIRST, torch.float32, "cpu")
    assert "device cpu not supported" in get_solver("patch_triton").not_supported_reasons(p)
    assert get_solver("patch_triton").not_supported_reasons(p.__class__.from_sizes(
        2, 3, 5, (8, 6), (4, 3), (4, 3), device_type="cuda")) == []  # fmt: skip


@pytest.mark.parametrize("layout", list(Layout))
def test_split_weight_gradient_sums_its_partials_interpreted(layout):
    # M = 4 * 5 * 4 = 80 rows cut into three fp32 partials (32 + 32 + 16 rows).
    p = _problem((10, 12), (2, 3), layout, torch.float32, "cpu", c=3, n=4)
    dev = torch.device("cpu")
    x = _random(p.input_shape, layout, torch.float32, dev, 11)
    dy = _random(p.output_shape, layout, torch.float32, dev, 12)
    channels_last = layout is Layout.CHANNELS_LAST
    rows = patch_gemm_weight_grad(dy, x, p.kernel, channels_last, splits=3)
    col = patches(x, p).reshape(p.gemm_m, p.gemm_k).double()
    expected = dy.movedim(1, -1).reshape(-1, p.k).double().t() @ col
    assert rows.dtype == torch.float32
    assert torch.allclose(rows.double(), expected, rtol=1e-5, atol=1e-5)


def test_implicit_forward_writes_through_any_output_strides_interpreted():
    p = _problem((8, 9), (4, 3), Layout.CHANNELS_FIRST, torch.float32, "cpu")
    dev = torch.device("cpu")
    x = _random(p.input_shape, Layout.CHANNELS_FIRST, torch.float32, dev, 5)
    w = _random(p.weight_shape, Layout.CHANNELS_FIRST, torch.float32, dev, 6)
    bias = torch.rand(p.k) + 0.5
    expected = torch.nn.functional.conv2d(x.double(), w.double(), bias.double(), stride=(4, 3))
    wide = torch.full((p.n, p.k, 2, 3 * 2), float("nan"))
    y = wide[..., ::2]  # an output view with a stride-2 innermost dimension
    patch_gemm_forward(x, w.reshape(p.k, -1), bias, p.kernel, False, out=y)
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.isnan(wide[..., 1::2]).all()


# ---- on the GPU --------------------------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Every new problem geometry compiles new kernel variants (the contiguous run and the
# strides are specialised), a few seconds each, so the GPU matrix keeps one problem
# per kind: 1-D with a remainder, 2-D exact, 3-D with a remainder, point-output.
GPU_PERMUTE_CASES = [
    c for c in CASES if (c[0], c[1]) in {(1, (11,)), (2, (8, 9)), (3, (5, 7, 5)), (2, (5, 3))}
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", GPU_PERMUTE_CASES, ids=[_ids(c) for c in GPU_PERMUTE_CASES])
def test_gather_and_scatter_match_torch_views_on_cuda(case, dtype):
    _check_gather_scatter(*case, dtype, torch.device("cuda"), extra_pad=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16", "fp32"])
def test_gather_large_rows_on_cuda(dtype):
    # Enough rows that the grid has many programs in both dimensions (and int64 offsets).
    _check_gather_scatter(2, (14 * 40, 14 * 3), (14, 14), Layout.CHANNELS_FIRST, dtype,
                          torch.device("cuda"), extra_pad=0)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
@pytest.mark.parametrize(("spatial", "kernel"), ROWS_PATH_CASES)
@pytest.mark.parametrize("chunk", [1, None], ids=["chunk1", "whole"])
@pytest.mark.parametrize("in_place", [False, True], ids=["cublas", "in_place"])
def test_channels_first_rows_path_on_cuda(
    spatial, kernel, direction, dtype, chunk, in_place, monkeypatch
):
    # Both GEMMs of the path in every direction, whatever the in-place estimate and its
    # limits say (fp32 takes cuBLAS's either way).
    force_in_place_on_cuda(monkeypatch, in_place)
    if chunk is not None:
        monkeypatch.setattr(rows_path, "chunk_samples", lambda p, ld: chunk)
    g = Geometry("rows", spatial=spatial, kernel=kernel, stride=kernel, c=3, n=3, k=5)
    p = problem_for(g, 2, Layout.CHANNELS_FIRST, dtype, "cuda", direction)
    assert rows_path.applies(p)
    case = (get_solver("patch_triton"), "patch", g, 2, Layout.CHANNELS_FIRST, dtype, direction)
    check_case(case, "cuda", seed=zlib.crc32(repr((spatial, direction, dtype)).encode()))


# ---- prepared launches: when the direct route is taken ---------------------------


def test_no_launch_hook_is_installed_by_default_in_this_triton():
    import triton

    from gemmconv.kernels.launch import launch_hooks_absent

    # From Triton 3.5 on a hook is an (empty) HookChain, never None: a test for None
    # never passed there, and every prepared launch took the ordinary route.
    assert launch_hooks_absent(triton.knobs.runtime)


def test_an_installed_launch_hook_sends_launches_the_ordinary_way():
    import types

    import triton

    from gemmconv.kernels.launch import launch_hooks_absent

    runtime = triton.knobs.runtime
    chain = runtime.launch_enter_hook
    if hasattr(chain, "add"):  # Triton 3.5 on: hooks are chains

        def hook(metadata):
            return None

        chain.add(hook)
        try:
            assert not launch_hooks_absent(runtime)
        finally:
            chain.remove(hook)
        assert launch_hooks_absent(runtime)
    # The older form: a hook is a callable or None.
    old = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    assert launch_hooks_absent(old)
    old.launch_exit_hook = print
    assert not launch_hooks_absent(old)


def _bare_launch(direct):
    """A PreparedLaunch whose direct route is ``direct`` and has no arguments."""
    from gemmconv.kernels.launch import PreparedLaunch

    launch = PreparedLaunch.__new__(PreparedLaunch)
    launch._direct, launch._direct_ok, launch._direct_proven = direct, True, False
    launch._ordered, launch.slots = [], []
    return launch


def test_a_refused_direct_launch_falls_back_to_the_ordinary_route_for_good(caplog):
    def refuses(*values):
        raise TypeError("launcher takes other arguments")

    launch = _bare_launch(refuses)
    with caplog.at_level("WARNING", "gemmconv.kernels"):
        assert not launch._launch_direct(())
    assert launch._direct is None and not launch._direct_ok
    assert "launcher takes other arguments" in caplog.text


def test_a_direct_launch_that_goes_through_is_trusted_after():
    calls = []
    launch = _bare_launch(lambda *values: calls.append(values))
    assert launch._launch_direct(()) and launch._direct_proven
    assert launch._launch_direct(())
    assert calls == [(), ()]


@pytest.mark.parametrize("memory", ["cf", "cl"])
def test_prepared_point_output_scatter_matches_the_scatter_interpreted(memory):
    # Point-output patches (one per sample): the prepared scatter finds dx's rows once
    # and copies the column gradient into them as the unprepared scatter does.
    from gemmconv.solvers.patch.columns import TRITON_COPY_COLUMNS, whole_sample_rows
    from gemmconv.solvers.views import meta_like

    layout = Layout.CHANNELS_FIRST if memory == "cf" else Layout.CHANNELS_LAST
    p = ConvProblem.from_sizes(
        n=3, c=2, k=4, spatial=(4, 4), kernel=4, stride=4, layout=layout,
        dtype=torch.float32, device_type="cpu", direction=Direction.BACKWARD_DATA,
    )  # fmt: skip
    ld = p.gemm_k + 4  # a padded column gradient: only the first gemm_k columns count
    gen = torch.Generator().manual_seed(3)
    dcol = torch.randn(p.gemm_m, ld, generator=gen)
    want = empty_in(p.input_shape, layout, torch.float32, torch.device("cpu"))
    want.fill_(float("nan"))
    assert whole_sample_rows(want, p) is not None
    TRITON_COPY_COLUMNS.scatter(dcol, p, want)
    got = torch.full_like(want, float("nan"))
    TRITON_COPY_COLUMNS.prepared_scatter(meta_like(got), p, ld)(dcol, got)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
