"""The fp8 scale kernel (kernels/amax_scale.py) gives the tensorwise recipe's bytes:
inverse = max(amax, eps) / fp8_max and scale = 1 / inverse, as torch computes them on
the tensor's device (CUDA's division by a Python number is a product with its fp32
reciprocal, emulated on the CPU too),
over sizes that end inside a block, on a program's edge and across many programs, and
over zeros, values below eps, NaN and infinities wherever they sit. Interpreted on the
CPU; compiled on CUDA (gpu)."""

from __future__ import annotations

import pytest
import torch

from gemmconv.core.float8 import AMAX_EPS
from gemmconv.kernels import amax_scale as kernel
from gemmconv.kernels.amax_scale import amax_scale, dense_flat, fp32_reciprocal

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
CHUNK = kernel._BLOCK * kernel._BLOCKS_PER_PROGRAM
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _recipe(t: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's form of the recipe, the reference (solvers/float8.py's uncompiled path)."""
    amax = torch.linalg.vector_norm(t, float("inf")).reshape(1).float()
    inverse = amax.clamp_(min=AMAX_EPS).div_(fp8_max)
    return inverse.reciprocal(), inverse


def _assert_same_bits(got, expected, device):
    for g, e in zip(got, expected):
        assert g.shape == (1,) and g.dtype == torch.float32 and g.device == e.device
        if e.isnan().all() and device == "cpu":
            # The CPU keeps a NaN's payload through arithmetic; CUDA returns its one
            # canonical NaN, so there the bytes are compared too.
            assert g.isnan().all()
            continue
        assert torch.equal(g.view(torch.int32), e.view(torch.int32)), (g, e)


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("numel", [1, 17, CHUNK - 1, CHUNK, 3 * CHUNK + 5])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_random_tensors_get_the_recipes_bytes(device, numel, dtype, fp8):
    gen = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=gen) * 7).to(dtype).to(device)
    _assert_same_bits(amax_scale(t, FP8_MAX[fp8], AMAX_EPS), _recipe(t, FP8_MAX[fp8]), device)


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cudas_product_with_the_reciprocal_is_emulated_to_the_bit(dtype, fp8):
    # The CUDA form interpreted on the CPU, against the recipe with CUDA's arithmetic:
    # max(amax, eps) times fp8_max's fp32 reciprocal, then a rounded reciprocal. Over
    # 24 draws the two forms of the inverse differ in about half (the form is tested).
    gen = torch.Generator().manual_seed(7)
    fp8_max = FP8_MAX[fp8]
    reciprocal = torch.tensor([fp32_reciprocal(fp8_max)])
    differs = 0
    for _ in range(24):
        t = (torch.randn(33, generator=gen) * 7).to(dtype)
        amax = torch.linalg.vector_norm(t, float("inf")).reshape(1).float()
        inverse = amax.clamp_(min=AMAX_EPS).mul_(reciprocal)
        got = amax_scale(t, fp8_max, AMAX_EPS, by_reciprocal=True)
        _assert_same_bits(got, (inverse.reciprocal(), inverse), "cpu")
        differs += not torch.equal(inverse, amax_scale(t, fp8_max, AMAX_EPS)[1])
    assert differs > 0


def test_the_fp32_reciprocal_is_fp32s_rounded_quotient():
    for value in (448.0, 57344.0, 3.0):
        r = fp32_reciprocal(value)
        assert torch.tensor(r, dtype=torch.float32).item() == r
        assert abs(r * value - 1) < 2**-23


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("special", [0.0, 1e-30, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_special_values_anywhere_get_the_recipes_bytes(device, dtype, special, where):
    # 0 and 1e-30 fill the whole tensor (an amax below eps); NaN and the infinities sit
    # at one place, in the first, a middle or the last program.
    numel = 2 * CHUNK + 3
    if special in (0.0, 1e-30):
        t = torch.full((numel,), special, dtype=dtype)
        t[{"first": 0, "middle": CHUNK + 1, "last": -1}[where]] = -special
    else:
        t = torch.randn(numel, generator=torch.Generator().manual_seed(1)).to(dtype)
        t[{"first": 0, "middle": CHUNK + 1, "last": -1}[where]] = special
    t = t.to(device)
    _assert_same_bits(amax_scale(t, 448.0, AMAX_EPS), _recipe(t, 448.0), device)


@pytest.mark.parametrize("numel", [100, 3 * CHUNK + 5])
def test_each_call_starts_from_a_clean_maximum(numel):
    # The merged maximum and the count of programs done live in a buffer kept across
    # calls, which the last program zeroes: a large tensor's amax must not leak into the
    # next, smaller one's scale, and the count must start again from zero.
    big = torch.full((numel,), 300.0)
    small = torch.full((numel,), 0.5)
    amax_scale(big, 448.0, AMAX_EPS)
    state = kernel._state_for(big.device)
    assert state.tolist() == [0] * kernel._STATE_WORDS
    for _ in range(2):
        _assert_same_bits(amax_scale(small, 448.0, AMAX_EPS), _recipe(small, 448.0), "cpu")
    assert kernel._state_for(big.device) is state and state.tolist() == [0, 0]


def test_each_calls_scale_is_its_own_tensor():
    # The backward keeps the forward's scales: a later call must not overwrite them.
    first = amax_scale(torch.full((10,), 2.0), 448.0, AMAX_EPS)
    kept = [t.clone() for t in first]
    amax_scale(torch.full((10,), 9.0), 448.0, AMAX_EPS)
    assert all(torch.equal(a, b) for a, b in zip(first, kept))


@pytest.mark.gpu
def test_streams_keep_their_own_state():
    # Launches on two streams may overlap, so each stream merges into its own words.
    device = torch.device("cuda")
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    tensors = [torch.full((3 * CHUNK + 5,), v, device=device) for v in (300.0, 0.5)]
    results = []
    for stream, t in zip(streams, tensors):
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            results.append(amax_scale(t, 448.0, AMAX_EPS))
    torch.cuda.synchronize(device)
    for got, t in zip(results, tensors):
        _assert_same_bits(got, _recipe(t, 448.0), "cuda")
    kept = kernel._states
    states = {kept[(t.device, s.cuda_stream)].data_ptr() for s, t in zip(streams, tensors)}
    assert len(states) == 2


def test_dense_tensors_flatten_in_any_dimension_order():
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    for t in (x, x.to(memory_format=torch.channels_last), x.transpose(0, 3), x[1:]):
        flat = dense_flat(t)
        assert flat is not None and flat.dim() == 1 and flat.stride(0) == 1
        assert flat.data_ptr() == t.data_ptr()
        # The same elements, in memory order.
        assert torch.equal(flat.sort().values, t.reshape(-1).sort().values)


def test_tensors_with_gaps_or_repeats_do_not_flatten():
    x = torch.randn(4, 6, 8)
    assert dense_flat(x[:, :3]) is None  # a slice: gaps
    assert dense_flat(x[..., ::2]) is None
    assert dense_flat(torch.ones(1).expand(5, 3)) is None  # an expanded gradient: repeats


@pytest.mark.parametrize(
    "flat",
    [torch.ones(4, 4), torch.ones(8)[::2], torch.ones(0)],
    ids=["2-D", "strided", "empty"],
)
def test_the_kernel_takes_only_a_non_empty_contiguous_vector(flat):
    with pytest.raises(ValueError, match=r"flat of shape .*expected a non-empty contiguous"):
        amax_scale(flat, 448.0, AMAX_EPS)
