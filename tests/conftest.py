"""Shared test fixtures: every test's clean selection state, seeded random operands,
NaN-filled outputs, the gpu marker, a log of the gemmconv ops that run, a progress bar
that records its count."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gemmconv.core.memory_format import Layout, empty_in

# The CPU suite's tensors are tiny: one intra-op thread each for this process and the
# ones it starts. More threads gain nothing there and cost much: every parallel region
# wakes the pool, and where other processes hold the cores (pytest-xdist's workers, a
# busy CI host) a tiny convolution waited milliseconds on the pool instead of taking
# microseconds.
if not torch.cuda.is_available() or os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# Where Triton's interpreter cannot run gemmconv's kernels (Triton 3.6 with NumPy >= 2.4:
# see interpreter_probe), on a machine with a CUDA device, whose gpu-marked tests run the
# same kernels compiled: each interpreted launch skips its test, naming the releases.
# Without a CUDA device those tests are the kernels' only check, so they fail instead.
_interpreter_patch = pytest.MonkeyPatch()
_INTERPRETER_REFUSAL = pytest.StashKey[str | None]()


def _interpreter_refusal() -> str | None:
    from gemmconv.kernels import triton_available

    if not triton_available():
        return None
    from interpreter_probe import interpreter_refusal

    return interpreter_refusal()


def pytest_configure(config):
    refusal = _interpreter_refusal()
    config.stash[_INTERPRETER_REFUSAL] = refusal
    if refusal is None or not torch.cuda.is_available():
        return
    from triton.runtime.interpreter import InterpretedFunction

    reason = f"{refusal}; the gpu-marked tests run these kernels compiled on this machine"

    def skip_the_test(self, *args, **kwargs):
        pytest.skip(reason)

    _interpreter_patch.setattr(InterpretedFunction, "run", skip_the_test)


def pytest_unconfigure(config):
    _interpreter_patch.undo()


def pytest_report_header(config):
    refusal = config.stash.get(_INTERPRETER_REFUSAL, None)
    if refusal is None:
        return None
    if torch.cuda.is_available():
        return f"{refusal}: tests that launch an interpreted kernel are skipped"
    return f"{refusal}: tests that launch an interpreted kernel fail (no CUDA device here)"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The environment variables that steer solver selection.
SELECTION_ENV = (
    "GEMMCONV_FIND_MODE",
    "GEMMCONV_SOLVER",
    "GEMMCONV_DISABLE",
    "GEMMCONV_FIND_VERIFY",
    "GEMMCONV_BATCH_INVARIANT",
    "GEMMCONV_NATIVE_NODE",
)


@pytest.fixture(autouse=True)
def isolated_selection(tmp_path, monkeypatch):
    """Every test selects from a clean slate: a private find database (the test's
    tmp_path/find.sqlite, never the user's), no selection variables, no find mode left
    set, batch invariance off, cudnn.benchmark off (so the default mode is database), no
    cached choices."""
    from gemmconv.core import invariance
    from gemmconv.selection import dispatch, finddb

    monkeypatch.setenv("GEMMCONV_DB", str(tmp_path / "find.sqlite"))
    for name in SELECTION_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    finddb.reset_db()
    dispatch.set_find_mode(None)
    monkeypatch.setattr(invariance, "setting", (None, None))
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()
    dispatch.set_find_mode(None)
    finddb.reset_db()


@pytest.fixture
def work_costs_only(monkeypatch):
    """Rank solvers on the CPU by the work they do alone, launches and gemmconv's
    autograd node free. Tests of tiny problems use it to reach the GEMM solver they
    exercise: counting host costs, the vendor's single launch (and torch's fused
    backward) rightly wins there."""
    import dataclasses

    from gemmconv.core import device_rates

    monkeypatch.setattr(device_rates, "CPU", dataclasses.replace(device_rates.CPU,
                        launch_us=0.0, host_launch_us=0.0, host_allocation_us=0.0,
                        autograd_node_us=0.0))  # fmt: skip


def find_db_warnings(caught) -> int:
    """How many of the warnings a ``pytest.warns`` block caught are the find database's
    own: a ResourceWarning of another test's connection, collected meanwhile, may be
    caught there too."""
    from gemmconv.selection.finddb import FindDbWarning

    return sum(issubclass(w.category, FindDbWarning) for w in caught)


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


class RecordingBar:
    """A stand-in for gemmconv.terminal.progress.progress_bar's bar that keeps its count, so a
    test can check that a bar ends exactly at its total (tqdm draws at intervals)."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str) -> None:
        pass

    def write(self, s: str) -> None:
        print(s)

    @classmethod
    def patch(cls, monkeypatch, module) -> list[RecordingBar]:
        """Make ``module.progress_bar`` hand out recording bars; returns them."""
        made: list[RecordingBar] = []

        @contextlib.contextmanager
        def recording(total, desc, unit, enabled=True):
            made.append(cls(total, desc))
            yield made[-1]

        monkeypatch.setattr(module, "progress_bar", recording)
        return made
