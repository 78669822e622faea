"""views.view_is_possible agrees with torch's own view on random layouts."""

from __future__ import annotations

import math
import random

import torch

from gemmconv.solvers.views import try_view, view_is_possible


def _random_tensor(rng: random.Random) -> torch.Tensor:
    dims = rng.randint(1, 5)
    shape = [rng.choice([1, 1, 2, 3, 4]) for _ in range(dims)]
    base = torch.empty([s * rng.choice([1, 1, 2]) for s in shape])
    t = base[tuple(slice(0, s) for s in shape)]  # a crop: strides with gaps
    order = list(range(dims))
    rng.shuffle(order)
    t = t.permute(order)
    if rng.random() < 0.2:
        # A stride-0 dimension, as an expanded gradient has.
        t = t.unsqueeze(0).expand(rng.choice([1, 3]), *t.shape)
    return t


def _random_new_shape(rng: random.Random, numel: int) -> tuple[int, ...]:
    sizes = []
    left = numel
    while left > 1 and len(sizes) < 5:
        factors = [f for f in range(2, left + 1) if left % f == 0]
        f = rng.choice(factors)
        sizes.append(f)
        left //= f
        if rng.random() < 0.3:
            sizes.append(1)
    sizes = sizes or [1]
    rng.shuffle(sizes)
    if rng.random() < 0.3:
        sizes[rng.randrange(len(sizes))] = -1
    return tuple(sizes)


def test_view_is_possible_matches_torch() -> None:
    rng = random.Random(1234)
    decided = 0
    for _ in range(3000):
        t = _random_tensor(rng)
        new_shape = _random_new_shape(rng, math.prod(t.shape))
        try:
            t.view(*new_shape)
            torch_ok = True
        except RuntimeError:
            torch_ok = False
        predicted = view_is_possible(tuple(t.shape), t.stride(), new_shape)
        if predicted is not None:
            decided += 1
            assert predicted == torch_ok, (tuple(t.shape), t.stride(), new_shape)
        assert (try_view(t, *new_shape) is not None) == torch_ok
    assert decided > 2500  # the check decides nearly every non-empty case itself


def test_view_is_possible_leaves_empty_and_mismatched_sizes_to_torch() -> None:
    assert view_is_possible((0, 3), (3, 1), (3, 0)) is None
    assert view_is_possible((2, 3), (3, 1), (4, 2)) is None
    assert view_is_possible((2, 3), (3, 1), (-1, 4)) is None
