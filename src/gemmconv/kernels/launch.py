"""Prepared Triton launches: a kernel bound to every argument but its tensors.

A Triton launch through ``kernel[grid](...)`` binds and specialises every argument
in Python before the driver call; with a dozen integer arguments, calls of a handful
of such launches spent 0.5-0.95 ms on the H200's host (bench/NOTES.md), more than
their kernels. A convolution plan knows every size and stride of its operands once it
is built, so the plan binds them here once: a call then passes only its tensors.

On CUDA the first call goes through Triton's ordinary launch (which compiles) and
keeps the compiled kernel; later calls hand the ready argument list straight to
the compiled kernel's launcher. Triton specialises pointer arguments on 16-byte
alignment, so a call whose tensors differ in that from the first one takes the
ordinary route (which compiles the other variant). On the CPU (Triton's
interpreter) every call takes the ordinary route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import triton

from gemmconv.kernels import compiled

log = logging.getLogger("gemmconv.kernels")

# Triton passes every bound argument, constexprs included, to a compiled kernel's
# launcher from release 3.3 on; older releases take the ordinary route only.
_DIRECT_LAUNCH_SINCE = (3, 3)
_POINTER_ALIGNMENT = 16
# Floating-point contraction (a * b + c as one fma) asked for, not left to Triton's
# default: Triton 3.9 warns once a process about every kernel that leaves it unset, and
# 3.10 turns it off. On, as every earlier Triton compiled (and the tests checked)
# gemmconv's kernels.
COMPILE_OPTIONS: dict[str, object] = {"enable_fp_fusion": True}


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _runtime_knobs():
    """Triton's runtime settings (launch hooks), where this release has them."""
    knobs = getattr(triton, "knobs", None)
    return None if knobs is None else knobs.runtime


def launch_hooks_absent(knobs) -> bool:
    """Whether no launch hook is installed in Triton's runtime ``knobs``: the direct
    route calls none, so it is taken only then. A hook is None where none is set
    before Triton 3.5; from 3.5 on it is a HookChain, never None, empty while its list
    of calls is (a None test there never passed, and every launch took the ordinary
    route)."""
    return all(
        hook is None or not getattr(hook, "calls", True)
        for hook in (knobs.launch_enter_hook, knobs.launch_exit_hook)
    )


class TensorSlot:
    """Marks the place of a tensor argument in a prepared launch's argument list."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class PreparedLaunch:
    """``fn`` over ``grid`` with ``args`` (positional, ``TensorSlot(i)`` where the i-th
    tensor of a call goes) and ``constants`` (constexpr arguments by name) fixed;
    ``options`` are launch options such as num_warps (COMPILE_OPTIONS added),
    ``jit_options`` go to ``triton.jit`` (do_not_specialize)."""

    def __init__(
        self,
        fn: Callable,
        grid: Sequence[int],
        args: Sequence[object],
        constants: dict[str, object],
        options: dict[str, object],
        device: torch.device,
        jit_options: dict[str, object] | None = None,
    ) -> None:
        self.kernel = compiled(fn, device, **(jit_options or {}))
        self.jit_options = dict(jit_options or {})
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.args = list(args)
        self.constants = constants
        self.options = {**COMPILE_OPTIONS, **options}
        self.slots = [i for i, a in enumerate(self.args) if isinstance(a, TensorSlot)]
        self.device = device
        self._index = device.index if device.index is not None else 0
        # All arguments in the kernel's parameter order, as the compiled launcher
        # takes them; tensors are put in per call.
        names = list(getattr(self.kernel, "arg_names", []))
        self._ordered = [*self.args, *(constants[name] for name in names[len(self.args) :])]
        self._direct: Callable | None = None
        self._direct_proven = False  # whether a direct launch has gone through
        self._alignment: tuple[bool, ...] | None = None
        self._direct_ok = (
            device.type == "cuda"
            and _triton_version() >= _DIRECT_LAUNCH_SINCE
            and len(self._ordered) == len(names)
        )

    def _fill(self, values: list, tensors: Sequence[torch.Tensor | None]) -> list:
        for slot in self.slots:
            values[slot] = tensors[values[slot].index]
        return values

    def __call__(self, *tensors: torch.Tensor | None) -> None:
        if (
            self._direct is not None
            and torch._C._cuda_getDevice() == self._index
            and self._aligned(tensors) == self._alignment
        ):
            if launch_hooks_absent(_runtime_knobs()) and self._launch_direct(tensors):
                return
        if self.device.type == "cuda":
            # Triton launches on the current device; make it the tensors' one.
            with torch.cuda.device(self._index):
                result = self._ordinary(tensors)
        else:
            result = self._ordinary(tensors)
        if self._direct is None and self._direct_ok:
            self._keep_direct(result, tensors)

    def _launch_direct(self, tensors: Sequence[torch.Tensor | None]) -> bool:
        """Launch through the compiled kernel's launcher; False where the launcher
        refused its first call (a Triton whose launcher takes other arguments), after
        which this launch always takes the ordinary route. A refusal comes before the
        kernel runs, and the ordinary launch writes the same outputs."""
        try:  # costs nothing measurable when nothing is raised
            self._direct(*self._fill(list(self._ordered), tensors))
        except Exception as exc:
            if self._direct_proven:
                raise  # a launcher that took its arguments before: a real failure
            log.warning("direct Triton launch refused (%s: %s); launching the ordinary "
                        "way from now on", type(exc).__name__, exc)  # fmt: skip
            self._direct, self._direct_ok = None, False
            return False
        self._direct_proven = True
        return True

    def _ordinary(self, tensors: Sequence[torch.Tensor | None]) -> object:
        return self.kernel[self.grid](
            *self._fill(list(self.args), tensors), **self.constants, **self.options
        )

    @staticmethod
    def _aligned(tensors: Sequence[torch.Tensor | None]) -> tuple[bool, ...]:
        return tuple(t is not None and t.data_ptr() % _POINTER_ALIGNMENT == 0 for t in tensors)

    def _keep_direct(self, kernel: object, tensors: Sequence[torch.Tensor | None]) -> None:
        """Keep ``kernel`` (what the ordinary launch compiled and returned) for direct
        launches of tensors aligned as these are."""
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        run = getattr(kernel, "run", None)
        if run is None or _runtime_knobs() is None:
            self._direct_ok = False
            return
        from triton.runtime import driver

        get_stream = driver.active.get_current_stream
        index = self._index
        g0, g1, g2 = self.grid
        function, metadata = kernel.function, kernel.packed_metadata

        def direct(*values: object) -> None:
            run(g0, g1, g2, get_stream(index), function, metadata, None, None, None, *values)

        self._alignment = self._aligned(tensors)
        self._direct = direct


class LaunchCache:
    """Prepared launches (or what a launch helper keeps with them) by a key of
    everything they fix: sizes, strides, dtypes, devices, constants. Bounded: a
    stream of ever-new shapes empties it rather than growing it without limit."""

    def __init__(self, limit: int = 1024) -> None:
        self._launches: dict[tuple, object] = {}
        self._limit = limit

    def get(self, key: tuple, prepare: Callable[[], object]):
        """The entry of ``key``, made by ``prepare()`` on a miss."""
        try:
            return self._launches[key]
        except KeyError:
            pass
        launch = prepare()
        if len(self._launches) >= self._limit:
            self._launches.clear()
        self._launches[key] = launch
        return launch

    def launch(self, key: tuple, prepare: Callable[[], PreparedLaunch | None], *tensors) -> None:
        """Launch the entry of ``key`` (``prepare()`` makes it on a miss) on ``tensors``;
        an entry of None (an empty problem) launches nothing. A hit is looked up
        inline rather than through get(), which would add a frame to every launch."""
        try:
            launch = self._launches[key]
        except KeyError:
            launch = self.get(key, prepare)
        if launch is not None:
            launch(*tensors)

    def clear(self) -> None:
        self._launches.clear()


def check_scale(scale: torch.Tensor, device: torch.device) -> None:
    """A copy kernel's scale is one float32 element on the copy's device: the kernel
    reads it by pointer (no host sync) and multiplies in fp32."""
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
        raise ValueError(
            f"scale of shape {tuple(scale.shape)}, {scale.dtype} on {scale.device}: expected "
            f"one torch.float32 element on {device}"
        )


__all__ = ["LaunchCache", "PreparedLaunch", "TensorSlot", "check_scale", "launch_hooks_absent"]
