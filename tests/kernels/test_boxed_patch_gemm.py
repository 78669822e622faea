"""The boxed forward GEMMs (gemmconv.kernels.boxed_patch_gemm): channels-first patches
loaded by TMA boxes of a 5-D view of x, permuted into the column tile in registers,
and whole-sample rows loaded by 2-D boxes.

Checked against float64 on fresh random operands with the result pre-filled with NaN,
interpreted on the CPU in fp32 and fp16 (the interpreter's bf16 dot is wrong) and
compiled on CUDA (marker gpu) in bf16 and fp16: 2-D and 3-D, patch grids that fill
their boxes and grids that leave rows and columns of a box idle (ViT's 14 x 14 in
16-wide boxes), inputs whose size leaves pixels no patch reads, output channels past
a tile's end, with and without bias, into channels-first and channels-last outputs.
It also compiles for sm_90 with TMA loads and wgmma (no GPU needed)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.nn.functional as F

from gemmconv.kernels.boxed_patch_gemm import (
    FORWARD_TILES,
    applies,
    box_shape,
    boxed_patch_backward_data,
    boxed_patch_forward,
    boxed_patch_weight_grad,
    boxed_rows_forward,
    rows_apply,
)
from gemmconv.kernels.patch_gemm import TileConfig

# Small tiles for the interpreter; the GPU runs the table's.
_SMALL = TileConfig(32, 16, 32, 4, 2)

# (x shape, kernel, output channels): grids that fill a box, that leave part of it
# idle, a remainder of pixels no patch reads, 3-D patches with a temporal kernel.
CASES = [
    ((2, 3, 32, 32), (8, 8), 24),
    ((3, 2, 40, 48), (8, 8), 20),
    ((1, 3, 70, 64), (16, 16), 17),
    ((2, 2, 5, 24, 32), (2, 8, 8), 12),
]


def _assert_close(got, ref, dtype, label):
    """``got`` within its own rounding (an ulp of the largest value, ``dtype``'s) and the
    fp32 sums' of the float64 ``ref``, every element written (the results start NaN)."""
    assert torch.isfinite(got).all(), label
    err = (got.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= torch.finfo(dtype).eps * scale + 1e-4 * scale, (label, err)


def _check(shape, kernel, k, bias, dtype, device, cfg, channels_last=False):
    gen = torch.Generator().manual_seed(sum(shape) + k)
    x = torch.randn(shape, generator=gen).to(dtype).to(device)
    w = torch.randn(k, shape[1], *kernel, generator=gen).to(dtype).to(device)
    b = torch.randn(k, generator=gen).to(dtype).to(device) if bias else None
    conv = F.conv2d if len(kernel) == 2 else F.conv3d
    ref = conv(x.double(), w.double(), None if b is None else b.double(), stride=kernel)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=device)
    if channels_last:
        memory = torch.channels_last if len(kernel) == 2 else torch.channels_last_3d
        out = out.to(memory_format=memory)
    boxed_patch_forward(x, w.reshape(k, -1), b, kernel, out, cfg)
    _assert_close(out, ref, dtype, (shape, kernel))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("shape", "kernel", "k"), CASES)
def test_matches_float64_interpreted(shape, kernel, k, dtype, bias):
    _check(shape, kernel, k, bias, dtype, "cpu", _SMALL)


def test_a_channels_last_output_is_written_through_its_strides():
    _check((2, 3, 32, 32), (8, 8), 24, True, torch.float32, "cpu", _SMALL, channels_last=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "kernel", "k"),
    [*CASES, ((4, 3, 224, 224), (16, 16), 768), ((2, 3, 4, 224, 224), (2, 16, 16), 768)],
)
def test_matches_float64_on_cuda(shape, kernel, k, dtype):
    _check(shape, kernel, k, True, dtype, "cuda", FORWARD_TILES)


def test_box_shapes_fit_the_grid_and_the_patch():
    # ViT-B/16: 14 patches a row in 16-wide boxes, 8 rows of them; 4 pixel rows a step.
    assert box_shape(14, 16, 16, FORWARD_TILES) == (8, 4, 16)
    # SAM: 64 patches a row fill a box of 64, two rows of them.
    assert box_shape(64, 16, 16, FORWARD_TILES) == (2, 4, 64)
    # A patch 12 rows high takes boxes of 4 rows (the power of two that divides it).
    assert box_shape(14, 12, 16, FORWARD_TILES) == (8, 4, 16)
    assert box_shape(14, 6, 16, FORWARD_TILES) == (8, 2, 16)


@pytest.mark.parametrize(
    ("shape", "kernel", "dtype", "reason"),
    [
        ((2, 3, 336, 336), (14, 14), torch.bfloat16, "patch width 14"),
        ((2, 3, 36, 36), (12, 12), torch.bfloat16, "patch width 12"),
        ((2, 3, 36, 36), (4, 4), torch.bfloat16, "patch width 4"),
        ((2, 3, 36, 38), (4, 4), torch.float32, "rows of 38"),
        ((2, 3, 20, 20), (4, 5), torch.float32, "patch width 5"),
    ],
)
def test_patches_tma_cannot_box_are_refused_by_name(shape, kernel, dtype, reason):
    x = torch.zeros(shape, dtype=dtype)
    w = torch.zeros(4, shape[1] * kernel[0] * kernel[1], dtype=dtype)
    assert any(reason in r for r in applies(x, kernel, w))
    out = torch.empty(2, 4, shape[2] // kernel[0], shape[3] // kernel[1], dtype=dtype)
    with pytest.raises(ValueError, match=reason):
        boxed_patch_forward(x, w, None, kernel, out)


def test_more_frames_than_32_bit_coordinates_reach_are_refused():
    x = torch.empty(2**20, 2**11, 8, 8, device="meta")
    assert any("exceed TMA's 32-bit coordinates" in r for r in applies(x, (8, 8)))


def test_channels_last_inputs_are_refused():
    x = torch.zeros(2, 3, 32, 32).to(memory_format=torch.channels_last)
    w = torch.zeros(4, 3 * 64)
    assert "x is not contiguous channels-first" in applies(x, (8, 8), w)


def test_wrong_result_shapes_are_refused():
    x, w = torch.zeros(2, 3, 32, 32), torch.zeros(4, 3 * 64)
    with pytest.raises(ValueError, match=r"out \(2, 4, 3, 4\): expected \[2, 4, 4, 4\]"):
        boxed_patch_forward(x, w, None, (8, 8), torch.empty(2, 4, 3, 4))
    with pytest.raises(ValueError, match=r"weight_rows \(4, 100\): expected \[K, 192\]"):
        boxed_patch_forward(x, torch.zeros(4, 100), None, (8, 8), torch.empty(2, 4, 4, 4))


def _sm90_ptx(fn, signature: dict[str, object], constants: dict[str, object]) -> str:
    """``fn`` compiled for sm_90 here with FORWARD_TILES' warps and stages: ``signature``
    maps each runtime argument to its type, or to an int Triton's launcher would
    specialise it to (a stride of 1); pointer arguments 16-byte aligned. Not
    kernels/offline.sm90_ptx, which compiles prepared launches: these kernels take
    tensor descriptors, which no prepared launch binds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    given = {**signature, **constants}
    names = list(inspect.signature(fn).parameters)  # the kernel's own order
    values = {k: v for k, v in given.items() if not isinstance(v, str)}
    pointers = {(names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items()
                if isinstance(v, str) and v.startswith("*")}  # fmt: skip
    source = ASTSource(
        triton.jit(fn),
        {k: "constexpr" if k in values else given[k] for k in names},
        {(names.index(k),): v for k, v in values.items()},
        pointers,
    )
    options = {"num_warps": FORWARD_TILES.num_warps, "num_stages": FORWARD_TILES.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def _vit_boxes() -> dict[str, object]:
    rows, depth, width = box_shape(14, 16, 16, FORWARD_TILES)
    return {"KT": 1, "PH": 16, "PIXEL_ALIGN": 2, "BHP": rows, "BWP": width, "BKH": depth,
            "PW": 16, "BLOCK_N": FORWARD_TILES.block_n}  # fmt: skip


def _x_box() -> str:
    rows, depth, width = box_shape(14, 16, 16, FORWARD_TILES)
    return f"tensordesc<bf16[1, {rows}, {depth}, {width}, 16]>"


def test_the_patch_kernel_compiles_for_sm90_with_tma_loads_and_wgmma():
    # ViT-B/16's forward in bf16: both operands arrive by TMA (x's 5-D box and W's 2-D
    # box), the permuted x tile feeds warpgroup MMAs, and y's 14-patch rows are stored
    # in 4-byte pairs (PIXEL_ALIGN 2), not 2-byte pieces.
    from gemmconv.kernels import boxed_patch_gemm

    integers = ("C", "F", "TP", "HP", "WP", "KOUT", "YSN", "YSC", "YST", "YSH")
    depth = _vit_boxes()["BKH"]
    signature = {
        "x_desc": _x_box(), "w_desc": f"tensordesc<bf16[{FORWARD_TILES.block_n}, {depth * 16}]>",
        "b_ptr": "*bf16", "y_ptr": "*bf16", **dict.fromkeys(integers, "i32"), "YSW": 1, "BS": 1,
    }  # fmt: skip
    ptx = _sm90_ptx(boxed_patch_gemm._forward_kernel, signature, {**_vit_boxes(), "HAS_BIAS": True})
    assert re.search(r"cp\.async\.bulk\.tensor\.5d", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d", ptx)
    assert "wgmma.mma_async" in ptx
    assert re.search(r"st\.global\.b32", ptx) and not re.search(r"st\.global\.b16", ptx)


def test_the_weight_gradient_compiles_for_sm90_with_pipelined_loads():
    # ViT-B/16's: x by TMA boxes, dY's 14-patch rows by 4-byte cp.async copies
    # (pipelined, where without the 3-D tile and the hint they were 2-byte plain loads).
    from gemmconv.kernels import boxed_patch_gemm
    from gemmconv.kernels.offline import load_widths

    integers = ("C", "F", "TP", "HP", "WP", "KOUT", "KRED", "TILES", "PER_SPLIT", "YSN", "YSC",
                "YST", "YSH")  # fmt: skip
    signature = {"dy_ptr": "*bf16", "x_desc": _x_box(), "part_ptr": "*fp32",
                 **dict.fromkeys(integers, "i32"), "YSW": 1}  # fmt: skip
    ptx = _sm90_ptx(boxed_patch_gemm._wgrad_kernel, signature, _vit_boxes())
    widths = load_widths(ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.5d", ptx) and widths["wgmma"]
    assert widths["cp4"] > 0 and widths["ld"] == 0, widths


def test_backward_data_compiles_for_sm90_with_pipelined_loads_and_a_tma_store():
    # ViT-B/16's: W by TMA boxes, dY's 14-patch rows by 4-byte cp.async copies (plain
    # loads when dY's tile had the channels innermost), dx's box stored by TMA.
    from gemmconv.kernels import boxed_patch_gemm
    from gemmconv.kernels.boxed_patch_gemm import DGRAD_TILES
    from gemmconv.kernels.offline import load_widths

    rows, depth, width = box_shape(14, 16, 16, DGRAD_TILES)
    integers = ("C", "F", "TP", "HP", "WP", "KOUT", "KRED", "YSN", "YSC", "YST", "YSH")
    signature = {"dy_ptr": "*bf16",
                 "w_desc": f"tensordesc<bf16[{DGRAD_TILES.block_n}, {depth * 16}]>",
                 "dx_desc": f"tensordesc<bf16[1, {rows}, {depth}, {width}, 16]>",
                 **dict.fromkeys(integers, "i32"), "YSW": 1}  # fmt: skip
    constants = {**_vit_boxes(), "BHP": rows, "BWP": width, "BKH": depth,
                 "BLOCK_N": DGRAD_TILES.block_n}  # fmt: skip
    ptx = _sm90_ptx(boxed_patch_gemm._dgrad_kernel, signature, constants)
    widths = load_widths(ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.5d\.global\.shared", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared", ptx) and widths["wgmma"]
    assert widths["cp4"] > 0 and widths["ld"] == 0, widths


def test_the_rows_kernel_compiles_for_sm90_with_tma_loads_and_wgmma():
    from gemmconv.kernels import boxed_patch_gemm

    cfg = FORWARD_TILES
    signature = {
        "x_desc": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
        "w_desc": f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>",
        "b_ptr": "*bf16", "y_ptr": "*bf16",
        **dict.fromkeys(("M", "KOUT", "KRED", "YSM", "YSC", "BS"), "i32"),
    }  # fmt: skip
    constants = {"HAS_BIAS": True, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                 "BLOCK_K": cfg.block_k, "GROUP_M": 8}  # fmt: skip
    ptx = _sm90_ptx(boxed_patch_gemm._rows_kernel, signature, constants)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) >= 2
    assert "wgmma.mma_async" in ptx


def _check_rows(m, k, n, bias, dtype, device, cfg, transposed_out=False):
    gen = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = torch.randn(n, k, generator=gen).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    out = torch.full((n, m) if transposed_out else (m, n), float("nan"), dtype=dtype,
                     device=device)  # fmt: skip
    out = out.t() if transposed_out else out
    boxed_rows_forward(x, w, b, out, cfg)
    _assert_close(out, ref, dtype, (m, k, n))


# (rows, reduction, output channels): tiles that fit, and tails in every dimension.
ROWS = [(64, 64, 32), (70, 40, 20), (33, 104, 17)]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "k", "n"), ROWS)
def test_rows_match_float64_interpreted(m, k, n, dtype, bias):
    _check_rows(m, k, n, bias, dtype, "cpu", _SMALL)


def test_rows_are_written_through_the_outputs_strides():
    _check_rows(70, 40, 20, True, torch.float32, "cpu", _SMALL, transposed_out=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "n"), [*ROWS, (8192, 1176, 1280), (1000, 1536, 1152)])
def test_rows_match_float64_on_cuda(m, k, n, dtype):
    _check_rows(m, k, n, True, dtype, "cuda", FORWARD_TILES)


def test_rows_tma_cannot_box_are_refused_by_name():
    w = torch.zeros(4, 588, dtype=torch.bfloat16)
    # Point 2D's rows: 588 bf16 elements, 1176 bytes (kernels/paired_rows_gemm.py's).
    assert rows_apply(torch.zeros(10, 588, dtype=torch.bfloat16), w) == [
        "x_rows's rows of stride 588 are not 16-byte aligned",
        "weight_rows's rows of stride 588 are not 16-byte aligned",
    ]
    x = torch.zeros(10, 592, dtype=torch.bfloat16)[:, ::2]
    assert "expected rows with unit column stride" in rows_apply(x, w)[0]
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        boxed_rows_forward(torch.zeros(10, 588, dtype=torch.bfloat16), w, None,
                           torch.empty(10, 4, dtype=torch.bfloat16))  # fmt: skip
    x, w = torch.zeros(10, 64), torch.zeros(4, 32)
    with pytest.raises(ValueError, match=r"weight_rows \(4, 32\): expected \[4, 64\]"):
        boxed_rows_forward(x, w, None, torch.empty(10, 4))


def _check_weight_grad(shape, kernel, k, dtype, device, cfg, programs, dy_layout="cf"):
    gen = torch.Generator().manual_seed(sum(shape) * k)
    x = torch.randn(shape, generator=gen).to(dtype).to(device)
    conv = F.conv2d if len(kernel) == 2 else F.conv3d
    outs = [s // r for s, r in zip(shape[2:], kernel)]
    dy = torch.randn(shape[0], k, *outs, generator=gen).to(dtype).to(device)
    if dy_layout == "cl":
        dy = dy.to(
            memory_format=torch.channels_last if len(kernel) == 2 else torch.channels_last_3d
        )
    w = torch.zeros(k, shape[1], *kernel, dtype=torch.float64, requires_grad=True)
    conv(x.double().cpu(), w, stride=kernel).backward(dy.double().cpu())
    ref = w.grad.reshape(k, -1).to(device)
    got = boxed_patch_weight_grad(dy, x, kernel, programs, cfg)
    # fp32 partials: products of half-precision operands are exact there.
    assert got.dtype == torch.float32 and got.shape == ref.shape
    _assert_close(got, ref, torch.float32, (shape, kernel))


@pytest.mark.parametrize("programs", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("shape", "kernel", "k"), CASES)
def test_weight_grad_matches_float64_interpreted(shape, kernel, k, dtype, programs):
    _check_weight_grad(shape, kernel, k, dtype, "cpu", _SMALL, programs)


def test_weight_grad_reads_a_channels_last_dy_through_its_strides():
    _check_weight_grad((2, 3, 32, 32), (8, 8), 24, torch.float32, "cpu", _SMALL, 8, "cl")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "kernel", "k"),
    [*CASES, ((4, 3, 224, 224), (16, 16), 768), ((2, 3, 4, 224, 224), (2, 16, 16), 768)],
)
def test_weight_grad_matches_float64_on_cuda(shape, kernel, k, dtype):
    from gemmconv.kernels import split_programs

    device = torch.device("cuda")
    _check_weight_grad(shape, kernel, k, dtype, device, None, split_programs(device))


def test_weight_grad_refuses_a_dy_of_the_wrong_shape():
    x = torch.zeros(2, 3, 32, 32)
    with pytest.raises(ValueError, match=r"grad_output \(2, 24, 4, 3\): expected \[2, 24, 4, 4\]"):
        boxed_patch_weight_grad(torch.zeros(2, 24, 4, 3), x, (8, 8), 8)


def _check_backward_data(shape, kernel, k, dtype, device, cfg, dy_layout="cf"):
    gen = torch.Generator().manual_seed(sum(shape) + 3 * k)
    conv = F.conv2d if len(kernel) == 2 else F.conv3d
    outs = [s // r for s, r in zip(shape[2:], kernel)]
    dy = torch.randn(shape[0], k, *outs, generator=gen).to(dtype).to(device)
    if dy_layout == "cl":
        last = torch.channels_last if len(kernel) == 2 else torch.channels_last_3d
        dy = dy.to(memory_format=last)
    w = torch.randn(k, shape[1], *kernel, generator=gen).to(dtype).to(device)
    x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    conv(x, w.double().cpu(), stride=kernel).backward(dy.double().cpu())
    ref = x.grad.to(device)
    # NaN everywhere first: every element must be written, pixels no patch covers as 0.
    dx = torch.full(shape, float("nan"), dtype=dtype, device=device)
    boxed_patch_backward_data(dy, w.reshape(k, -1), kernel, dx, cfg)
    _assert_close(dx, ref, dtype, (shape, kernel))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("shape", "kernel", "k"), CASES)
def test_backward_data_matches_float64_interpreted(shape, kernel, k, dtype):
    _check_backward_data(shape, kernel, k, dtype, "cpu", _SMALL)


def test_backward_data_reads_a_channels_last_dy_through_its_strides():
    _check_backward_data((2, 3, 32, 32), (8, 8), 24, torch.float32, "cpu", _SMALL, "cl")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "kernel", "k"),
    [*CASES, ((4, 3, 224, 224), (16, 16), 768), ((2, 3, 4, 224, 224), (2, 16, 16), 768)],
)
def test_backward_data_matches_float64_on_cuda(shape, kernel, k, dtype):
    _check_backward_data(shape, kernel, k, dtype, "cuda", None)
