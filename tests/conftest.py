"""Shared test fixtures: seeded random operands, NaN-filled outputs, the gpu marker, a
log of the gemmconv ops that run."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gemmconv.memory_format import Layout, empty_in


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dispatch_cache():
    from gemmconv import dispatch

    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


def random_in(shape, layout: Layout, dtype, device, generator) -> torch.Tensor:
    """Uniform(-1, 1) values (never zeros) dense in ``layout``."""
    t = empty_in(shape, layout, torch.float32, device)
    values = torch.rand(tuple(shape), generator=generator, dtype=torch.float32) * 2 - 1
    t.copy_(values.to(device))
    return t.to(dtype)


def nan_in(shape, layout: Layout, dtype, device) -> torch.Tensor:
    t = empty_in(shape, layout, dtype, device)
    return t.fill_(float("nan"))


class GemmconvOpLog(TorchDispatchMode):
    """Records which gemmconv ops run while it is active."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "gemmconv":
            self.calls.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))
