"""The GEMM over pixel rows that reads or writes a channels-first side in place.

Against float64 products on fresh random operands, outputs pre-filled with NaN so an
unwritten element fails. On the CPU the kernel runs in Triton's interpreter (fp32,
fp16); on CUDA (marker gpu) compiled, bf16 included, with pixel counts whose
vector runs (RUN) are 1, 2, 4 and 8 elements: a wrong run claim shows there as
wrong elements, since the interpreter ignores the claim.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from gemmconv.kernels.pixel_rows_gemm import (
    TILES,
    WGRAD_TILES,
    channels_first_into_rows,
    channels_first_weight_gradient,
    rows_into_channels_first,
    weight_gradient_splits,
)

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# (samples, channels K, pixels P, reduction): pixel runs of 1, 2, 4 and 8 elements,
# one pixel a sample, and channels and reductions off the tile sizes.
CPU_SHAPES = [(3, 5, 6, 40), (2, 130, 9, 70), (4, 64, 196, 48), (5, 3, 1, 16), (2, 24, 16, 33)]
GPU_SHAPES = [
    *CPU_SHAPES,
    (17, 768, 196, 768),  # ViT-B/16's rows, the last tile of rows partly past M
    (9, 200, 49, 3072),  # ViT-B/32's 49 pixels: no run longer than one element
    (6, 136, 100, 592),  # runs of 4, a padded reduction
]


def _random(shape, dtype, device, seed) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen) * 2 - 1).to(device=device, dtype=dtype)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, reduction: int) -> None:
    assert not torch.isnan(got).any(), "an element was left unwritten"
    scale = max(1.0, reduction**0.5)
    err = (got.double() - want).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"max error {err}"


def _check_forward(shape, dtype, device, bias: bool, sliced: bool) -> None:
    n, k, pixels, reduction = shape
    seed = _seed("forward", shape, dtype, bias, sliced)
    col = _random((n * pixels, reduction), dtype, device, seed)
    # The weight rows as a transposed view ([Kred, K] memory) where asked: any strides.
    weight = _random((reduction, k), dtype, device, seed + 1).t() if sliced else None
    if weight is None:
        weight = _random((k, reduction), dtype, device, seed + 1)
    b = _random((k,), dtype, device, seed + 2) if bias else None
    # A sample slice of a larger y (as a chunk of the rows path writes): the samples
    # around it must stay untouched.
    whole = torch.full((n + 2, k, pixels), float("nan"), dtype=dtype, device=device)
    y3 = whole[1 : n + 1] if sliced else whole[:n]
    assert rows_into_channels_first(col, weight, b, y3) is y3
    want = col.double() @ weight.double().t()
    if b is not None:
        want += b.double()
    _close(y3, want.view(n, pixels, k).transpose(1, 2), dtype, reduction)
    assert torch.isnan(whole[n + 1]).all()
    if sliced:
        assert torch.isnan(whole[0]).all()


def _check_backward_data(shape, dtype, device, sliced: bool) -> None:
    n, k, pixels, reduction = shape
    seed = _seed("backward_data", shape, dtype, sliced)
    whole = _random((n + 1, k, pixels), dtype, device, seed)
    dy3 = whole[1:] if sliced else whole[:n]
    weight = _random((k, reduction), dtype, device, seed + 1)
    dcol = torch.full((n * pixels, reduction), float("nan"), dtype=dtype, device=device)
    assert channels_first_into_rows(dy3, weight, dcol) is dcol
    want = dy3.double().transpose(1, 2).reshape(n * pixels, k) @ weight.double()
    _close(dcol, want, dtype, k)


def _check_weight_gradient(shape, dtype, device, splits: int, fp32_out: bool, strided: bool):
    n, k, pixels, reduction = shape
    seed = _seed("weight_gradient", shape, dtype, splits, fp32_out, strided)
    whole = _random((n + 1, k, pixels), dtype, device, seed)
    dy3 = whole[1:] if strided else whole[:n]
    # Strided operands where asked: the first columns of a wider column matrix (a padded
    # reduction) and a transposed out.
    wide = _random((n * pixels, reduction + 3), dtype, device, seed + 1)
    col = wide[:, :reduction] if strided else wide[:, 3:].contiguous()
    out_dtype = torch.float32 if fp32_out else dtype
    if strided:
        out = torch.full((reduction, k), float("nan"), dtype=out_dtype, device=device).t()
    else:
        out = torch.full((k, reduction), float("nan"), dtype=out_dtype, device=device)
    assert channels_first_weight_gradient(dy3, col, out, splits) is out
    want = dy3.double().transpose(1, 2).reshape(n * pixels, k).t() @ col.double()
    _close(out, want, torch.float32 if fp32_out else dtype, n * pixels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("splits", [1, 3], ids=["one_slice", "slices"])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_channels_first_weight_gradient_interpreted(shape, dtype, splits, strided):
    _check_weight_gradient(shape, dtype, torch.device("cpu"), splits, strided, strided)


def test_weight_gradient_of_no_rows_is_zeros():
    out = torch.full((4, 8), float("nan"))
    channels_first_weight_gradient(torch.zeros(0, 4, 6), torch.zeros(0, 8), out, 3)
    assert (out == 0).all()


def test_weight_gradient_slices_fill_the_programs_but_stay_long():
    cfg = WGRAD_TILES[torch.bfloat16]
    # ViT-B/16 at batch 256: 36 output tiles, so 264 programs (an H100's 2 x 132) want
    # 8 slices; a short reduction gets fewer, each at least four steps long.
    assert weight_gradient_splits(256 * 196, 768, 768, torch.bfloat16, 264) == 8
    assert weight_gradient_splits(8 * cfg.block_m, 768, 768, torch.bfloat16, 264) == 2
    assert weight_gradient_splits(10, 768, 768, torch.bfloat16, 264) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_rows_into_channels_first_interpreted(shape, dtype, bias):
    _check_forward(shape, dtype, torch.device("cpu"), bias, sliced=bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "slice"])
def test_channels_first_into_rows_interpreted(shape, dtype, sliced):
    _check_backward_data(shape, dtype, torch.device("cpu"), sliced)


def test_bad_operands_are_refused_with_their_shapes():
    y3 = torch.zeros(2, 4, 6)
    with pytest.raises(ValueError, match=r"col of shape \(11, 8\): expected \(12, 8\)"):
        rows_into_channels_first(torch.zeros(11, 8), torch.zeros(4, 8), None, y3)
    with pytest.raises(ValueError, match=r"weight_rows of shape \(4, 7\): expected \(4, 8\)"):
        rows_into_channels_first(torch.zeros(12, 8), torch.zeros(4, 7), None, y3)
    with pytest.raises(ValueError, match="contiguous pixels"):
        rows_into_channels_first(torch.zeros(12, 8), torch.zeros(4, 8), None,
                                 torch.zeros(2, 6, 4).transpose(1, 2))  # fmt: skip
    with pytest.raises(ValueError, match="expected torch.float32"):
        channels_first_into_rows(torch.zeros(2, 4, 6), torch.zeros(4, 8, dtype=torch.half),
                                 torch.zeros(12, 8))  # fmt: skip
    with pytest.raises(ValueError, match=r"out of shape \(8, 4\): expected \(4, 8\)"):
        channels_first_weight_gradient(torch.zeros(2, 4, 6), torch.zeros(12, 8),
                                       torch.zeros(8, 4), 1)  # fmt: skip
    with pytest.raises(ValueError, match="expected torch.float16 or torch.float32"):
        channels_first_weight_gradient(torch.zeros(2, 4, 6, dtype=torch.half),
                                       torch.zeros(12, 8, dtype=torch.half),
                                       torch.zeros(4, 8, dtype=torch.float64), 1)  # fmt: skip
    with pytest.raises(ValueError, match="splits=0: expected at least 1"):
        channels_first_weight_gradient(torch.zeros(2, 4, 6), torch.zeros(12, 8),
                                       torch.zeros(4, 8), 0)  # fmt: skip


def test_half_tiles_fit_the_vector_runs():
    # A run is claimed up to one tile of rows: the tiles must be at least 8 rows tall.
    assert all(cfg.block_m >= 8 for cfg in TILES.values())


GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_rows_into_channels_first_on_cuda(shape, dtype, bias):
    _check_forward(shape, dtype, torch.device("cuda"), bias, sliced=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "slice"])
def test_channels_first_into_rows_on_cuda(shape, dtype, sliced):
    _check_backward_data(shape, dtype, torch.device("cuda"), sliced)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("splits", [1, 8], ids=["one_slice", "slices"])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_channels_first_weight_gradient_on_cuda(shape, dtype, splits, strided):
    _check_weight_gradient(shape, dtype, torch.device("cuda"), splits, strided, strided)
