"""The channels-last rule of gemmconv.core.memory_format against torch's own."""

from __future__ import annotations

import random

import torch
from torch._prims_common import are_strides_like_channels_last_or_false

from gemmconv.core.memory_format import Layout, _strides_like_channels_last, layout_of


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
