"""Triton kernels and their launch helpers (no dispatch logic here).

Each kernel is written once as a plain Triton function and compiled per device
type on first use: for CUDA tensors through ``triton.jit``, for CPU tensors through
Triton's interpreter, so the CPU test suite checks the very same kernel code. The
interpreter is also what ``TRITON_INTERPRET=1`` selects for every kernel.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


# Programs per multiprocessor a weight-gradient kernel whose reduction is split into
# partials aims for.
SPLIT_PROGRAMS_PER_SM = 2
# The interpreter (CPU tests) runs programs one by one: a few splits, so that the
# split path is exercised.
INTERPRETER_SPLIT_PROGRAMS = 8


def split_programs(device: torch.device) -> int:
    """Programs a split weight-gradient reduction aims for on ``device``."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return SPLIT_PROGRAMS_PER_SM * sms
    return INTERPRETER_SPLIT_PROGRAMS


_compiled: dict[tuple[Callable, str], object] = {}


def compiled(fn: Callable, device: torch.device, **jit_options) -> object:
    """``fn`` as a launchable Triton kernel for tensors on ``device`` (``jit_options``
    go to ``triton.jit``, e.g. do_not_specialize)."""
    key = (fn, device.type)
    kernel = _compiled.get(key)
    if kernel is None:
        if device.type == "cuda":
            import triton

            kernel = triton.jit(fn, **jit_options)
        elif device.type == "cpu":
            from triton.runtime.interpreter import InterpretedFunction

            kernel = InterpretedFunction(fn, **jit_options)
        else:
            raise ValueError(f"device={device}: Triton kernels run on cuda (or cpu, interpreted)")
        _compiled[key] = kernel
    return kernel


__all__ = ["compiled", "split_programs", "triton_available"]
