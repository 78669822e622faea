"""The paired-rows forward GEMM (gemmconv.kernels.paired_rows_gemm): rows 8 bytes off
16-byte alignment loaded by TMA boxes, even and odd samples from two descriptors.

Checked against float64 on fresh random operands with the result pre-filled with NaN,
interpreted on the CPU in fp16 (the interpreter's bf16 dot is wrong) and compiled on
CUDA (marker gpu) in bf16 and fp16. The odd samples' first box starts four columns
early, on the even sample's tail: an infinity there must stay in its own sample.
"""

from __future__ import annotations

import pytest
import torch

from gemmconv.kernels.paired_rows_gemm import (
    applies,
    boxed_weights,
    paired_rows_forward,
    paired_rows_forward_boxed,
)
from gemmconv.kernels.tiles import TileConfig

# Small tiles for the interpreter; the GPU runs the table's.
_SMALL = TileConfig(16, 16, 32, 4, 2)


def _reference(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def _run(x, w, b, out, cfg, boxed):
    if boxed:
        return paired_rows_forward_boxed(x, boxed_weights(w), b, out, cfg)
    return paired_rows_forward(x, w, b, out, cfg)


def _check(m, k, n, bias, dtype, device, cfg, boxed):
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    _run(x, w, b, out, cfg, boxed)
    ref = _reference(x, w, b)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    # The result's own rounding (half an ulp of the largest value) and the fp32 sum's.
    eps = torch.finfo(dtype).eps
    assert err <= eps * ref.abs().max().item() + 1e-3, (m, k, n, err)


@pytest.mark.parametrize(
    ("m", "k", "n", "bias"),
    [(7, 588, 40, True), (6, 588, 33, False), (2, 12, 16, True), (37, 76, 20, False)],
    ids=["point2d-rows-odd-m", "point2d-rows-even-m", "two-rows", "many-tiles"],
)
@pytest.mark.parametrize("boxed", [False, True], ids=["vector-weight", "boxed-weight"])
def test_matches_float64_interpreted(m, k, n, bias, boxed):
    _check(m, k, n, bias, torch.float16, "cpu", _SMALL, boxed)


@pytest.mark.parametrize("boxed", [False, True], ids=["vector-weight", "boxed-weight"])
def test_an_infinity_stays_in_its_sample(boxed):
    x = torch.randn(4, 588, dtype=torch.float16)
    x[0, -1] = float("inf")  # the last element of an even row, read by the odd row's box
    w = torch.randn(8, 588, dtype=torch.float16)
    out = torch.full((4, 8), float("nan"), dtype=torch.float16)
    _run(x, w, None, out, _SMALL, boxed)
    assert not torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1:]).all()


def test_applies_only_to_rows_off_alignment_by_eight_bytes():
    assert applies(torch.empty(4, 588, dtype=torch.bfloat16))
    assert not applies(torch.empty(4, 592, dtype=torch.bfloat16))  # aligned: cuBLAS's
    assert not applies(torch.empty(4, 590, dtype=torch.bfloat16))  # 4 bytes off
    assert not applies(torch.empty(4, 588, dtype=torch.float32))
    assert not applies(torch.empty(1, 588, dtype=torch.bfloat16))
    assert not applies(torch.empty(4, 600, dtype=torch.bfloat16)[:, :588])  # not dense
    assert not applies(torch.empty(4 * 588 + 4, dtype=torch.bfloat16)[4:].view(4, 588))


def test_refuses_what_it_does_not_apply_to():
    half = torch.float16
    with pytest.raises(ValueError, match="x_rows"):
        paired_rows_forward(
            torch.empty(4, 592, dtype=half), torch.empty(8, 592, dtype=half), None,
            torch.empty(4, 8, dtype=half),
        )  # fmt: skip
    x, w = torch.empty(4, 588, dtype=half), torch.empty(8, 588, dtype=half)
    with pytest.raises(ValueError, match="out"):
        paired_rows_forward(x, w, None, torch.empty(4, 9, dtype=half))
    with pytest.raises(ValueError, match="bias"):
        paired_rows_forward(x, w, torch.empty(9, dtype=half), torch.empty(4, 8, dtype=half))
    with pytest.raises(ValueError, match="weights"):  # the weight's rows, not boxed_weights'
        paired_rows_forward_boxed(x, w, None, torch.empty(4, 8, dtype=half))
    with pytest.raises(ValueError, match="out"):
        paired_rows_forward_boxed(x, boxed_weights(w), None, torch.empty(5, 8, dtype=half))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("m", "bias"), [(9500, True), (9501, False), (2, False)])
@pytest.mark.parametrize("boxed", [False, True], ids=["vector-weight", "boxed-weight"])
def test_matches_float64_on_cuda(dtype, m, bias, boxed):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check(m, 588, 1280, bias, dtype, "cuda", None, boxed)
