"""The whole-sample rows forward on TMA boxes (gemmconv.kernels.boxed_rows_gemm).

Checked against float64 on fresh random operands with the result pre-filled with NaN,
interpreted on the CPU in fp32 and fp16 (the interpreter's bf16 dot is wrong) and
compiled on CUDA (marker gpu) in bf16 and fp16; refusals by name; the tiles by the
output width alone; and the sm_90 compile (TMA loads, warpgroup MMAs) without a GPU."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from gemmconv.kernels import boxed_rows_gemm
from gemmconv.kernels.boxed_rows_gemm import (
    NARROW_TILES,
    WIDE_TILES,
    boxed_rows_forward,
    rows_apply,
    rows_tiles,
)


def _assert_close(got, ref, dtype, label):
    """``got`` within its own rounding (an ulp of the largest value, ``dtype``'s) and the
    fp32 sums' of the float64 ``ref``, every element written (the results start NaN)."""
    assert torch.isfinite(got).all(), label
    err = (got.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= torch.finfo(dtype).eps * scale + 1e-4 * scale, (label, err)


def _check_rows(m, k, n, bias, dtype, device, transposed_out=False):
    gen = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = torch.randn(n, k, generator=gen).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    out = torch.full((n, m) if transposed_out else (m, n), float("nan"), dtype=dtype,
                     device=device)  # fmt: skip
    out = out.t() if transposed_out else out
    boxed_rows_forward(x, w, b, out)
    _assert_close(out, ref, dtype, (m, k, n))


# (rows, reduction, output channels): one tile, tails in every dimension, a width the
# wide tiles take (256) and one they do not.
ROWS = [(64, 64, 32), (130, 40, 20), (33, 104, 256)]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "k", "n"), ROWS)
def test_rows_match_float64_interpreted(m, k, n, dtype, bias):
    _check_rows(m, k, n, bias, dtype, "cpu")


def test_rows_are_written_through_the_outputs_strides():
    _check_rows(70, 40, 20, True, torch.float32, "cpu", transposed_out=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "n"), [*ROWS, (8192, 1176, 1280), (1000, 1536, 1152)])
def test_rows_match_float64_on_cuda(m, k, n, dtype):
    _check_rows(m, k, n, True, dtype, "cuda")


def test_tiles_follow_the_output_width_alone():
    assert rows_tiles(1280) == WIDE_TILES  # Qwen2-VL, point 3D
    assert rows_tiles(1152) == NARROW_TILES  # Qwen3-VL
    assert rows_tiles(20) == NARROW_TILES


def test_rows_tma_cannot_box_are_refused_by_name():
    w = torch.zeros(4, 588, dtype=torch.bfloat16)
    # Point 2D's rows: 588 bf16 elements, 1176 bytes, 8 bytes off alignment.
    assert rows_apply(torch.zeros(10, 588, dtype=torch.bfloat16), w) == [
        "x_rows's rows of stride 588 are not 16-byte aligned",
        "weight_rows's rows of stride 588 are not 16-byte aligned",
    ]
    x = torch.zeros(10, 592, dtype=torch.bfloat16)[:, ::2]
    assert "expected rows with unit column stride" in rows_apply(x, w)[0]
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        boxed_rows_forward(torch.zeros(10, 588, dtype=torch.bfloat16), w, None,
                           torch.empty(10, 4, dtype=torch.bfloat16))  # fmt: skip
    shifted = torch.zeros(10 * 64 + 1)[1:].view(10, 64)
    with pytest.raises(ValueError, match="does not start 16-byte aligned"):
        boxed_rows_forward(shifted, torch.zeros(4, 64), None, torch.empty(10, 4))
    x, w = torch.zeros(10, 64), torch.zeros(4, 32)
    with pytest.raises(ValueError, match=r"weight_rows \(4, 32\): expected \[4, 64\]"):
        boxed_rows_forward(x, w, None, torch.empty(10, 4))
    with pytest.raises(ValueError, match=r"out \(10, 5\): expected \[10, 4\]"):
        boxed_rows_forward(x, torch.zeros(4, 64), None, torch.empty(10, 5))


def test_the_rows_kernel_compiles_for_sm90_with_tma_loads_and_wgmma():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = WIDE_TILES
    fn = boxed_rows_gemm._rows_kernel
    names = list(inspect.signature(fn).parameters)
    signature = {
        "x_desc": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
        "w_desc": f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>",
        "b_ptr": "*bf16", "y_ptr": "*bf16",
        **dict.fromkeys(("M", "KOUT", "KRED", "YSM", "YSC", "BS"), "i32"),
    }  # fmt: skip
    constants = {"HAS_BIAS": True, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                 "BLOCK_K": cfg.block_k, "GROUP_M": 8}  # fmt: skip
    source = ASTSource(
        triton.jit(fn),
        {k: signature.get(k, "constexpr") for k in names},
        {(names.index(k),): v for k, v in constants.items()},
        {(names.index(k),): [["tt.divisibility", 16]] for k in ("b_ptr", "y_ptr")},
    )
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) >= 2
    assert "wgmma.mma_async" in ptx
