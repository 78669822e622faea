"""gemmconv.core.cached_zeros: the zero columns of a padded weight, read-only views of one
kept zero, with none kept where keeping it would be unsafe."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from gemmconv.bench.kernel_count import kernels_per_call
from gemmconv.core import cached_zeros
from gemmconv.core.memory_format import Layout
from gemmconv.solvers.patch import padded_weight_rows


@pytest.fixture(autouse=True)
def _fresh_table(monkeypatch):
    monkeypatch.setattr(cached_zeros, "_KEPT", {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_of_any_shape_come_from_one_kept_zero(dtype):
    like = torch.randn(3, dtype=dtype)
    a = cached_zeros.zeros((5, 4), like)
    b = cached_zeros.zeros((7, 2), like)
    assert a.shape == (5, 4) and a.dtype == dtype and not a.any()
    assert b.data_ptr() == a.data_ptr()  # the same zero, expanded
    assert a.stride() == (0, 0)
    assert len(cached_zeros._KEPT) == 1
    cached_zeros.zeros((1,), torch.randn(1, dtype=torch.float16))
    assert len(cached_zeros._KEPT) == 2  # one per dtype


def test_a_zero_made_under_inference_mode_serves_autograd_later():
    w = torch.randn(4, 3, 2, 2)
    with torch.inference_mode():
        padded_weight_rows(w, Layout.CHANNELS_FIRST, 16)
    (zero,) = cached_zeros._KEPT.values()
    assert not zero.is_inference()
    leaf = w.clone().requires_grad_()
    padded = padded_weight_rows(leaf, Layout.CHANNELS_FIRST, 16)
    padded.sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(leaf))


def test_fake_and_meta_tensors_keep_nothing():
    with FakeTensorMode():
        fake = torch.empty(4, 12)
        assert cached_zeros.zeros((4, 4), fake).shape == (4, 4)
    # A fake CUDA tensor, made where no GPU may be: nothing asks for its device's stream.
    with FakeTensorMode():
        fake_cuda = torch.empty(4, 12, device="cuda")
        assert cached_zeros.zeros((4, 4), fake_cuda).device.type == "cuda"
    assert cached_zeros.zeros((2, 2), torch.empty(2, device="meta")).device.type == "meta"
    assert cached_zeros._KEPT == {}


def test_a_parameter_keeps_its_zero_as_a_tensor_does():
    weight = torch.nn.Parameter(torch.randn(4, 3))
    assert not cached_zeros.zeros((4, 1), weight).any()
    assert list(cached_zeros._KEPT) == [(torch.device("cpu"), torch.float32)]


def test_the_table_starts_again_past_its_limit(monkeypatch):
    monkeypatch.setattr(cached_zeros, "_MAX_KEPT", 2)
    for dtype in (torch.float32, torch.float64, torch.float16):
        cached_zeros.zeros((1,), torch.empty(1, dtype=dtype))
    assert list(cached_zeros._KEPT) == [(torch.device("cpu"), torch.float16)]


@pytest.mark.gpu
def test_a_padded_weight_is_one_kernel_and_zeros_per_stream_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    for layout, w in ((Layout.CHANNELS_FIRST, torch.randn(64, 3, 14, 14, device=device)),
                      (Layout.CHANNELS_LAST, torch.randn(64, 3, 14, 14, device=device)
                       .to(memory_format=torch.channels_last))):  # fmt: skip
        w = w.bfloat16()
        padded_weight_rows(w, layout, 592)  # keeps the zero: its fill is not the call's
        call = functools.partial(padded_weight_rows, w, layout, 592)
        assert kernels_per_call(call, device) == 1
        wp = padded_weight_rows(w, layout, 592)
        order = w if layout is Layout.CHANNELS_FIRST else w.movedim(1, -1)
        assert torch.equal(wp[:, :588], order.reshape(64, 588)) and not wp[:, 588:].any()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        theirs = cached_zeros.zeros((2,), w)
    ours = cached_zeros.zeros((2,), w)
    assert theirs.data_ptr() != ours.data_ptr()  # no stream reads another's zero
    graph = torch.cuda.CUDAGraph()
    kept = dict(cached_zeros._KEPT)
    with torch.cuda.graph(graph):
        captured = padded_weight_rows(w, Layout.CHANNELS_FIRST, 592)
    assert all(cached_zeros._KEPT.get(k) is v for k, v in kept.items())
    assert len(cached_zeros._KEPT) == len(kept)  # a capture keeps no zero of its own
    graph.replay()
    assert not captured[:, 588:].any()
