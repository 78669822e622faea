"""The channels-last rule of gemmconv.core.memory_format against torch's own."""

from __future__ import annotations

import random

import pytest
import torch
from torch._prims_common import are_strides_like_channels_last_or_false

from gemmconv.core.memory_format import (
    Layout,
    _strides_like_channels_last,
    has_strides_of,
    layout_of,
    output_layout,
)


def test_channels_last_rule_is_torchs_on_random_strides():
    rng = random.Random(0)
    for _ in range(5000):
        dims = rng.choice((4, 5))
        shape = [rng.choice((0, 1, 2, 3)) for _ in range(dims)]
        strides = [rng.choice((0, 1, 2, 3, 4, 6, 8, 12, 24, 36)) for _ in range(dims)]
        want = are_strides_like_channels_last_or_false(shape, strides)
        assert _strides_like_channels_last(shape, strides) == want, (shape, strides)


def test_layout_of_real_tensors():
    x = torch.empty(2, 3, 8, 8)
    w = torch.empty(4, 3, 2, 2)
    assert layout_of(x, w) is Layout.CHANNELS_FIRST
    assert layout_of(x.to(memory_format=torch.channels_last), w) is Layout.CHANNELS_LAST
    assert layout_of(x, w.to(memory_format=torch.channels_last)) is Layout.CHANNELS_LAST
    x5 = torch.empty(2, 3, 4, 8, 8).to(memory_format=torch.channels_last_3d)
    assert layout_of(x5, torch.empty(4, 3, 2, 2, 2)) is Layout.CHANNELS_LAST


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "onednn-disabled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("dims", [2, 3])
def test_cpu_output_layout_is_the_one_torch_gives(dims, dtype, onednn, monkeypatch):
    """The problem-level rule against F.conv* on the CPU, channels-last in: which 3-D
    dtypes the CPU hands to oneDNN (channels-last out) depends on the processor (fp16
    needs AVX512-FP16) and on torch.backends.mkldnn; the rest give contiguous outputs."""
    x = torch.rand((4, 3, *(6,) * dims), dtype=dtype).to(
        memory_format=torch.channels_last if dims == 2 else torch.channels_last_3d
    )
    w = torch.rand((5, 3, *(2,) * dims), dtype=dtype)
    conv = torch.nn.functional.conv2d if dims == 2 else torch.nn.functional.conv3d
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", onednn)
    y = conv(x, w, stride=2)
    rule = output_layout(Layout.CHANNELS_LAST, dims, dtype, "cpu")
    assert has_strides_of(y, rule), (rule, y.stride())
