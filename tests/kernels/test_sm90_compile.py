"""gemmconv's Triton kernels compile for a Hopper GPU, and the loads the host proves
aligned are pipelined there: Triton's interpreter (the other CPU tests) runs a kernel's
Python, never its compiler, so a kernel that cannot compile (a device function
returning int32 on one constexpr branch and int64 on another did), or whose loads lose
their width, passes there. Compiled here for sm_90 without a GPU (kernels/offline.py),
a few seconds a kernel."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gemmconv.kernels import amax_scale, patch_gemm, pixel_rows_gemm
from gemmconv.kernels.launch import LaunchCache
from gemmconv.kernels.offline import load_widths, sm90_ptx
from gemmconv.kernels.patch_permute import gather_patches, scatter_patches
from gemmconv.kernels.pixel_rows_gemm import channels_first_into_rows, rows_into_channels_first
from gemmconv.kernels.strided_copy import pad_rows, strided_copy

CPU = torch.device("cpu")


def _operands(shape, kernel, k, channels_last):
    """Meta x [N, C, S..], W rows [K, Kred] and y [N, K, O..] in bf16."""
    memory = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x = torch.empty(shape, device="meta", dtype=torch.bfloat16)
    outs = tuple(s // r for s, r in zip(shape[2:], kernel))
    y = torch.empty(shape[0], k, *outs, device="meta", dtype=torch.bfloat16)
    if channels_last:
        x, y = x.to(memory_format=memory), y.to(memory_format=memory)
    w = torch.empty(k, shape[1] * math.prod(kernel), device="meta", dtype=torch.bfloat16)
    return x, w, y


# (name, x shape, kernel, output channels, channels-last): the suite's classes, full size.
GEOMETRIES = [
    ("point2d whole rows", (9500, 3, 14, 14), (14, 14), 1280, False),
    ("clip_l14 cf: runs of 14", (128, 3, 336, 336), (14, 14), 1024, False),
    ("convnext cf: rows of 56", (128, 192, 56, 56), (2, 2), 384, False),
    ("wan cf 3d: rows of 104", (1, 16, 21, 60, 104), (1, 2, 2), 5120, False),
    ("vit_b16 cl", (256, 3, 224, 224), (16, 16), 768, True),
]


@pytest.mark.parametrize(("name", "shape", "kernel", "k", "last"), GEOMETRIES,
                         ids=[g[0] for g in GEOMETRIES])  # fmt: skip
def test_the_three_kernels_compile_for_sm90(name, shape, kernel, k, last):
    x, w, y = _operands(shape, kernel, k, last)
    forward = patch_gemm.forward_launch(x, w, None, kernel, last, y, False, CPU)
    backward_data = patch_gemm.backward_data_launch(y, w, kernel, last, x, False, CPU)
    weight_grad = patch_gemm.weight_grad_launch(y, x, kernel, last, 4, False, CPU)
    partials = torch.empty(weight_grad.partials_shape, device="meta")
    for ptx in (
        sm90_ptx(forward, (x, w, None, y)),
        sm90_ptx(backward_data, (y, w, x)),
        sm90_ptx(weight_grad.launch, (y, x, partials)),
    ):
        assert load_widths(ptx)["wgmma"] == 1, name


def _copies_and_pixel_rows():
    """The permutation, copy and pixel-rows kernels run on small CPU tensors
    (interpreted): gathers and scatters in both column orders, a scaled transposed
    gather, transposes plain and scaled, padded rows by words and scaled, the pixel-rows
    GEMM both ways."""
    x = torch.randn(2, 3, 8, 9, dtype=torch.float16)
    one = torch.ones(1)
    for last in (False, True):
        cols = gather_patches(x, (2, 3), (4, 3), last, out=torch.empty(12, 40, dtype=x.dtype))
        scatter_patches(cols, (2, 3), (4, 3), last, torch.empty_like(x))
    gather_patches(x, (2, 3), (4, 3), False, torch.empty(40, 16), scale=one, transposed=True)
    src = torch.randn(3, 70, 130, dtype=torch.float16)
    strided_copy(torch.empty(3, 130, 70, dtype=src.dtype).transpose(1, 2), src)
    strided_copy(torch.empty(3, 130, 70).transpose(1, 2), src, scale=one)
    pad_rows(torch.empty(70, 136, dtype=torch.float16), src[0])
    pad_rows(torch.empty(130, 80), src[0].t(), scale=one)
    col, w = torch.randn(2 * 12, 24), torch.randn(5, 24)
    rows_into_channels_first(col, w, torch.randn(5), torch.empty(2, 5, 12))
    channels_first_into_rows(torch.randn(2, 5, 12), w, torch.empty(2 * 12, 24))


def _recorded_launches(monkeypatch) -> list:
    """(prepared launch, tensors) of each kernel variant _copies_and_pixel_rows runs."""
    launched = []
    launch = LaunchCache.launch

    def recording(self, key, prepare, *tensors):
        launched.append((self.get(key, prepare), tensors))
        launch(self, key, prepare, *tensors)

    monkeypatch.setattr(LaunchCache, "launch", recording)
    _copies_and_pixel_rows()
    kernels = {}
    for prepared, tensors in launched:
        if prepared is None:
            continue
        dtypes = tuple(None if t is None else t.dtype for t in tensors)
        constants = tuple(sorted((k, str(v)) for k, v in prepared.constants.items()))
        kernels[(prepared.kernel.fn, constants, dtypes)] = (prepared, tensors)
    return list(kernels.values())


def test_the_copy_and_pixel_rows_kernels_compile_for_sm90(monkeypatch):
    kernels = _recorded_launches(monkeypatch)
    names = {prepared.kernel.fn.__name__ for prepared, _ in kernels}
    assert names == {"_permute_kernel", "_strided_copy_kernel", "_pixel_rows_gemm_kernel"}
    assert len(kernels) >= 8  # the variants above, each its own constants or dtypes
    for prepared, tensors in kernels:
        assert ".entry" in sm90_ptx(prepared, tensors), prepared.kernel.fn.__name__


def test_every_kernel_asks_for_fp_fusion_and_triton_does_not_warn(monkeypatch):
    # Triton 3.9 warns about each kernel that leaves floating-point contraction to its
    # default, which 3.10 turns off; gemmconv's kernels ask for it (launch.COMPILE_OPTIONS).
    x, w, y = _operands((2, 3, 32, 32), (16, 16), 64, False)
    forward = patch_gemm.forward_launch(x, w, None, (16, 16), False, y, False, CPU)
    launches = [*_recorded_launches(monkeypatch), (forward, (x, w, None, y))]
    for prepared, _ in launches:
        assert prepared.options["enable_fp_fusion"] is True, prepared.kernel.fn.__name__
    for tiles in (patch_gemm.FORWARD_TILES, pixel_rows_gemm.TILES, pixel_rows_gemm.WGRAD_TILES):
        assert all(cfg.launch_options()["enable_fp_fusion"] is True for cfg in tiles.values())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm90_ptx(forward, (x, w, None, y))
    assert not [w for w in caught if "FP_FUSION" in str(w.message)]


def test_the_pixel_rows_weight_gradient_and_its_split_sum_compile_for_sm90():
    dy3, col = (
        torch.randn(2, 5, 128, dtype=torch.float16),
        torch.randn(256, 24, dtype=torch.float16),
    )
    out = torch.empty(5, 24)
    product, total, parts = pixel_rows_gemm._prepared_weight_gradient(
        dy3, col, out, 256, 5, 24, 128, (640, 128), 2, False
    )
    assert parts == 2 and total is not None
    partials = torch.empty(parts, 5, 24)
    assert ".entry" in sm90_ptx(product, (dy3, col, partials))
    assert ".entry" in sm90_ptx(total, (partials, out))


@pytest.mark.parametrize(("name", "shape", "kernel", "k", "last"), GEOMETRIES[1:4],
                         ids=[g[0] for g in GEOMETRIES[1:4]])  # fmt: skip
def test_gathers_the_host_proves_aligned_are_pipelined(name, shape, kernel, k, last):
    # Without the hints these forwards compiled to 2-byte plain loads of x (and of W
    # where the reduction, 588, is no multiple of 16), unpipelined.
    x, w, y = _operands(shape, kernel, k, last)
    launch = patch_gemm.forward_launch(x, w, None, kernel, last, y, False, CPU)
    assert launch.constants["GATHER_ALIGN"] > 1 and launch.constants["W_ALIGN"] > 1
    hinted = load_widths(sm90_ptx(launch, (x, w, None, y)))
    assert hinted["ld"] == 0 and hinted["cp4"] > 0, hinted
    bare = {**launch.constants, "GATHER_ALIGN": 0, "W_ALIGN": 0}
    assert load_widths(sm90_ptx(launch, (x, w, None, y), bare))["ld"] > 0


@pytest.mark.parametrize(("name", "shape", "kernel", "k", "last"),
                         [GEOMETRIES[2], ("vit_b16 cf", (256, 3, 224, 224), (16, 16), 768, False)],
                         ids=["convnext cf", "vit_b16 cf"])  # fmt: skip
def test_channels_first_pixels_are_loaded_and_stored_in_vectors(name, shape, kernel, k, last):
    # A channels-first dY compiled to 2-byte plain loads in backward-data and the weight
    # gradient, even ViT-B/16's, without PIXEL_ALIGN (its pixel index's divisions hide
    # that a sample's output pixels are consecutive).
    x, w, y = _operands(shape, kernel, k, last)
    backward_data = patch_gemm.backward_data_launch(y, w, kernel, last, x, False, CPU)
    weight_grad = patch_gemm.weight_grad_launch(y, x, kernel, last, 4, False, CPU)
    partials = torch.empty(weight_grad.partials_shape, device="meta")
    for launch, tensors in ((backward_data, (y, w, x)), (weight_grad.launch, (y, x, partials))):
        assert launch.constants["PIXEL_ALIGN"] > 1
        assert load_widths(sm90_ptx(launch, tensors))["ld"] == 0, name
        bare = {**launch.constants, "PIXEL_ALIGN": 0}
        assert load_widths(sm90_ptx(launch, tensors, bare))["ld"] > 0, name
    forward = patch_gemm.forward_launch(x, w, None, kernel, last, y, False, CPU)
    ptx = sm90_ptx(forward, (x, w, None, y))
    assert ptx.count("st.global.v") == ptx.count("st.global") > 0  # y in vectors only


@pytest.mark.parametrize("by_reciprocal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_fp8_scale_kernel_compiles_for_sm90_with_exact_division(dtype, by_reciprocal):
    # Its result is torch's bytes only with IEEE division (div.rn, not div.full or
    # div.approx): the scale's, and the inverse's unless it is CUDA's product with the
    # reciprocal; the last program reads the others' maxima only through
    # acquire-release atomics; x is read in 16-byte vectors.
    flat = torch.empty(8192 * 1176, dtype=dtype)
    state = torch.zeros(amax_scale._STATE_WORDS, dtype=torch.int32)
    result = torch.empty(amax_scale._WORDS, dtype=torch.float32)
    launch = amax_scale._prepare(flat, 448.0, 1e-12, by_reciprocal)
    ptx = sm90_ptx(launch, (flat, state, result))
    divisions = 1 if by_reciprocal else 2
    assert ptx.count("div.rn.f32") == divisions and "div.full" not in ptx
    assert "div.approx" not in ptx
    atomics = [line for line in ptx.splitlines() if "atom." in line]
    assert len(atomics) == 3 and all(".acq_rel." in line for line in atomics)
    # A thread's 8 elements of a block: one 16-byte load in half precision, two in fp32.
    vectors = [line for line in ptx.splitlines() if "ld.global" in line]
    assert len(vectors) == dtype.itemsize // 2 and all("v4.b32" in line for line in vectors)
