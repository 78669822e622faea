"""Copies in wider words (solvers/word_copy.py): bitwise the plain copy on every shape,
dtype and offset, in words exactly where torch's view rule allows them."""

from __future__ import annotations

import pytest
import torch

from gemmconv.solvers.patch.mapping import patch_view
from gemmconv.solvers.word_copy import contiguous_in_words, copy_in_words, word_dtype

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that NaN payloads and signed zeros compare too."""
    return t.contiguous().view(torch.uint8)


def _random(shape, dtype, g) -> torch.Tensor:
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
        flat = t.view(-1)
        flat[::7] = float("nan")
        flat[3::11] = -0.0
        return t
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", [(2, 2), (1, 4), (3, 3), (16, 16), (2, 7)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_patch_gather_and_scatter_match_the_plain_copy_bitwise(dtype, kernel, channels_last):
    g = torch.Generator().manual_seed(sum(kernel) + channels_last)
    # 5 x 3 patches plus a cropped remainder on each side.
    shape = (2, 3, 5 * kernel[0] + 1, 3 * kernel[1] + 1)
    x = _random(shape, dtype, g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    source = patch_view(x, (5, 3), kernel, channels_last)
    gathered = contiguous_in_words(source)
    assert gathered.is_contiguous() and gathered.shape == source.shape
    assert torch.equal(_bits(gathered), _bits(source))
    # The scatter: the patches written back into a NaN-filled tensor of x's strides.
    back = torch.full_like(x, float("nan") if dtype.is_floating_point else 0)
    copy_in_words(patch_view(back, (5, 3), kernel, channels_last), gathered)
    covered = (slice(None), slice(None), slice(0, 5 * kernel[0]), slice(0, 3 * kernel[1]))
    assert torch.equal(_bits(back[covered]), _bits(x[covered]))


@pytest.mark.parametrize(
    ("kernel", "dtype", "expected"),
    [
        ((2, 2), torch.float32, torch.int64),  # runs of 8 bytes
        ((2, 2), torch.bfloat16, torch.int32),  # runs of 4 bytes
        ((4, 4), torch.bfloat16, torch.int64),
        ((2, 14), torch.bfloat16, torch.int32),  # 28-byte runs: 4-byte words
        ((3, 3), torch.float32, None),  # 12-byte runs in a 3-wide row: no wider word
        ((2, 2), torch.float64, None),  # already 8 bytes
    ],
)
def test_the_widest_word_the_runs_allow_is_used(kernel, dtype, expected):
    x = torch.zeros(2, 3, 4 * kernel[0], 4 * kernel[1], dtype=dtype)
    source = patch_view(x, (4, 4), kernel, False)
    assert word_dtype(torch.empty(source.shape, dtype=dtype), source) == expected


def test_no_words_where_torch_would_refuse_or_must_not_see_them():
    x = torch.zeros(2, 3, 8, 8)
    source = patch_view(x, (4, 4), (2, 2), False)
    out = torch.empty(source.shape)
    assert word_dtype(out, source) == torch.int64
    # An odd storage offset breaks the word alignment.
    shifted = torch.zeros(2 * 3 * 8 * 8 + 1)[1:].view(2, 3, 8, 8)
    assert word_dtype(out, patch_view(shifted, (4, 4), (2, 2), False)) is None
    # A tensor needing a gradient keeps the differentiable copy.
    leaf = torch.zeros(2, 3, 8, 8, requires_grad=True)
    assert word_dtype(out, patch_view(leaf, (4, 4), (2, 2), False)) is None
    with torch.no_grad():
        assert word_dtype(out, patch_view(leaf, (4, 4), (2, 2), False)) == torch.int64
    # Other dtypes, shapes or devices than the destination's: the plain copy decides.
    assert word_dtype(out.double(), source.double()[..., :1]) is None
    assert word_dtype(out.to(torch.float16), source) is None
    assert word_dtype(torch.empty(source.shape, device="meta"), source.to("meta")) is None
    assert word_dtype(torch.empty(0, 2), torch.empty(0, 2)) is None


def test_a_plain_copy_where_no_word_applies_still_copies():
    g = torch.Generator().manual_seed(3)
    x = _random((2, 3, 9, 9), torch.float32, g)
    source = patch_view(x, (3, 3), (3, 3), False)
    assert word_dtype(torch.empty(source.shape), source) is None
    assert torch.equal(_bits(contiguous_in_words(source)), _bits(source))
    out = torch.full(source.shape, float("nan"))
    assert copy_in_words(out, source) is out and torch.equal(_bits(out), _bits(source))
