"""The numeric contract of every GEMM gemmconv issues.

fp16/bf16 operands accumulate in fp32: cuBLAS may otherwise use reduced-precision
reductions (split-K in half precision), which a convolution never does. fp32 follows
the flag PyTorch convolutions follow, torch.backends.cudnn.allow_tf32, not the
matmul flag, so a converted convolution computes in the same math mode as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import torch

_matmul = torch.backends.cuda.matmul
R = TypeVar("R")


def convolutions_allow_tf32() -> bool:
    return bool(torch.backends.cudnn.allow_tf32)


# The context managers below write a flag only when it differs from the value needed:
# on the steady-state path the flags already hold it, and skipping the writes keeps
# the per-call host cost of a small convolution down (and other threads undisturbed).

_NOTHING_TO_CHANGE = contextlib.nullcontext()


class _MatmulFlags:
    """Sets attributes of torch.backends.cuda.matmul for a block, then restores them."""

    def __init__(self, wanted: dict[str, object]) -> None:
        self._wanted = wanted
        self._saved: dict[str, object] = {}

    def __enter__(self) -> None:
        self._saved = {name: getattr(_matmul, name) for name in self._wanted}
        for name, value in self._wanted.items():
            setattr(_matmul, name, value)

    def __exit__(self, *exc_info: object) -> None:
        for name, value in self._saved.items():
            setattr(_matmul, name, value)


def _set_matmul_flags(wanted: dict[str, object]) -> contextlib.AbstractContextManager[None]:
    changes = {name: value for name, value in wanted.items() if getattr(_matmul, name) != value}
    return _MatmulFlags(changes) if changes else _NOTHING_TO_CHANGE


# torch >= 2.9 has per-backend precision strings and refuses a mix of the new and the
# legacy API in one process, so the new one is used where it exists.
_HAS_FP32_PRECISION = hasattr(_matmul, "fp32_precision")


def _fp32_matmul_mode(allow_tf32: bool) -> contextlib.AbstractContextManager[None]:
    if _HAS_FP32_PRECISION:
        return _set_matmul_flags({"fp32_precision": "tf32" if allow_tf32 else "ieee"})
    return _set_matmul_flags({"allow_tf32": allow_tf32})


# Per half dtype, torch's C accessors of the reduced-precision flag its GEMMs read
# (None where a torch lacks them). Read and written directly: torch.backends.cuda.matmul's
# Python attribute hooks were most of the host time of a half-precision GEMM call on
# the H200's host.
_KINDS = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_REDUCED_PRECISION_FLAGS = {
    dtype: (
        getattr(torch._C, f"_get_cublas_allow_{kind}_reduced_precision_reduction", None),
        getattr(torch._C, f"_set_cublas_allow_{kind}_reduced_precision_reduction", None),
    )
    for dtype, kind in _KINDS.items()
}
_ACCESSORS_EXIST = all(get and set_ for get, set_ in _REDUCED_PRECISION_FLAGS.values())


def _turn_off(get: Callable, set_: Callable) -> tuple | None:
    """Turns a reduced-precision flag off; returns the arguments that set it back, or
    None where it was off already. A flag is a bool, or from torch 2.8 on (allow
    reduced precision, allow split-K), whose second half is kept."""
    state = get()
    if isinstance(state, tuple):
        if not state[0]:
            return None
        set_(False, *state[1:])
        return state
    if not state:
        return None
    set_(False)
    return (state,)


class _FullPrecisionReductions:
    """Turns cuBLAS's reduced-precision (half-precision split-K) reductions off for a
    block of GEMMs of one half dtype, then restores the flag exactly as it was. Only
    that dtype's flag: a GEMM reads the flag of its operands' dtype alone."""

    __slots__ = ("_flag", "_saved")

    def __init__(self, flag: tuple[Callable, Callable]) -> None:
        self._flag = flag

    def __enter__(self) -> None:
        self._saved = _turn_off(*self._flag)

    def __exit__(self, *exc_info: object) -> None:
        if self._saved is not None:
            self._flag[1](*self._saved)


def _full_precision_reductions(dtype: torch.dtype) -> contextlib.AbstractContextManager[None]:
    if _ACCESSORS_EXIST:
        return _FullPrecisionReductions(_REDUCED_PRECISION_FLAGS[dtype])
    return _set_matmul_flags({f"allow_{_KINDS[dtype]}_reduced_precision_reduction": False})


def changes_gemm_precision(dtype: torch.dtype, device_type: str) -> bool:
    """Whether conv_gemm_precision(dtype, device_type) may set any flag: CUDA only
    (CPU GEMMs already accumulate half-precision products in fp32 and never use
    TF32), and only for the dtypes those flags govern."""
    return device_type == "cuda" and dtype in _GOVERNED_DTYPES


_GOVERNED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def conv_gemm_precision(
    dtype: torch.dtype, device_type: str
) -> contextlib.AbstractContextManager[None]:
    """Run the GEMMs inside with a convolution's accumulation rules (see
    changes_gemm_precision for where there are any to apply)."""
    if not changes_gemm_precision(dtype, device_type):
        return _NOTHING_TO_CHANGE
    if dtype == torch.float32:
        return _fp32_matmul_mode(convolutions_allow_tf32())
    return _full_precision_reductions(dtype)


def with_conv_precision(
    dtype: torch.dtype, device_type: str, run: Callable[..., R]
) -> Callable[..., R]:
    """``run`` made to run under conv_gemm_precision(dtype, device_type), decided once:
    ``run`` itself where that changes nothing (off CUDA), and for half precision the
    one flag switched inline around it, without a context manager's frames (a call
    of a prepared run pays this on every GEMM it issues)."""
    if not changes_gemm_precision(dtype, device_type):
        return run
    if dtype == torch.float32 or not _ACCESSORS_EXIST:

        def in_context(*args: object) -> R:
            with conv_gemm_precision(dtype, device_type):
                return run(*args)

        return in_context
    get, set_ = _REDUCED_PRECISION_FLAGS[dtype]
    if not isinstance(get(), tuple):

        def full_precision(*args: object) -> R:
            saved = _turn_off(get, set_)
            if saved is None:
                return run(*args)
            try:
                return run(*args)
            finally:
                set_(*saved)

        return full_precision

    # torch >= 2.8's flag, (allow reduced precision, allow split-K), switched as
    # _turn_off does but inline: a call to it was 0.05 of the switch's 0.38 us on the
    # CPU machine, paid on every GEMM of a prepared run.
    def full_precision_reductions(*args: object) -> R:
        state = get()
        if not state[0]:
            return run(*args)
        set_(False, *state[1:])
        try:
            return run(*args)
        finally:
            set_(*state)

    return full_precision_reductions


def reduce_batched_products(a: torch.Tensor, b: torch.Tensor, workspace_cap: int) -> torch.Tensor:
    """sum_n a[n] @ b[n], with the sum over n kept wider than the operands.

    Used where a reduction runs over a batch as well as inside each product (the
    channels-first weight gradient). Each product is rounded once (to fp32 for
    half-precision operands, which never round to half before the whole sum), and the
    sum over the batch runs in fp64 for fp32/fp64 operands so the extra roundings of a
    two-level sum do not add up to more than a single GEMM's. The batch is walked in
    chunks so the fp32 partials never take more than ``workspace_cap`` bytes.
    """
    n, rows, _ = a.shape
    cols = b.shape[2]
    per_sample = rows * cols * 4
    chunk = max(1, min(n, workspace_cap // max(per_sample, 1)))
    half = a.dtype in (torch.float16, torch.bfloat16)
    total_dtype = torch.float32 if half else torch.float64
    product_dtype = torch.float32 if half else a.dtype
    if a.dtype == torch.float32 and not (a.device.type == "cuda" and convolutions_allow_tf32()):
        # Full-fp32 products rounded per sample, then summed, measure about twice the
        # vendor's error (one rounding of a single long reduction); fp64 products
        # round only once, at the end. Under TF32 the products keep TF32's precision.
        product_dtype = torch.float64
    total = torch.zeros(rows, cols, dtype=total_dtype, device=a.device)
    for start in range(0, n, chunk):
        a_part, b_part = a[start : start + chunk], b[start : start + chunk]
        if half and a.device.type == "cuda" and _has_bmm_out_dtype():
            partial = torch.bmm(a_part, b_part, out_dtype=torch.float32)
        else:
            partial = torch.bmm(a_part.to(product_dtype), b_part.to(product_dtype))
        total += partial.sum(0, dtype=total_dtype)
    return total


def fp32_workspace_chunk_bytes(n: int, rows: int, cols: int, workspace_cap: int) -> int:
    """Bytes reduce_batched_products holds for its fp32 partials."""
    per_sample = rows * cols * 4
    chunk = max(1, min(n, workspace_cap // max(per_sample, 1)))
    return (chunk + 1) * per_sample


def _has_bmm_out_dtype() -> bool:
    # torch.bmm(..., out_dtype=) exists from torch 2.8 on, for CUDA only.
    return hasattr(torch.ops.aten.bmm, "dtype")


# The CPU's fp32 weight-gradient GEMMs are accurate enough within these bounds (see
# _reduction_dtype); outside them the reduction runs in fp64.
CPU_FP32_REDUCTION_MAX_ROWS = 1 << 17
CPU_FP32_MIN_OUTPUT_SIDE = 16


def _reduction_dtype(
    dtype: torch.dtype, device_type: str, rows: int, out_rows: int, out_cols: int
) -> torch.dtype | None:
    """The dtype to run a weight-gradient GEMM of operands of ``dtype`` on
    ``device_type`` in, when it differs from the operands'.

    On the CPU, against a float64 reference (units of fp32 roundoff, the CPU's own
    convolution in brackets): with both sides of the [K, Kred] result 16 or more,
    fp32 GEMMs measured 0.9-1.4 (1.9-2.9) at 4K rows, 1.2-2.0 (2.0-3.3) at 30K, 1.8
    (2.2) at 100K and 3.1 (2.3) at 400K; a skinny result (3 x 5) measured 7.9-18.9
    (4.7-5.1), summed almost sequentially. Within the bounds fp32 is as accurate as
    the vendor and 1.5-3x faster than fp64 (tests/solvers/test_numerics.py checks both
    sides of the rule); elsewhere the reduction runs in fp64 and rounds once.
    """
    if device_type != "cpu" or dtype != torch.float32:
        return None
    fp32_ok = rows <= CPU_FP32_REDUCTION_MAX_ROWS and min(out_rows, out_cols) >= (
        CPU_FP32_MIN_OUTPUT_SIDE
    )
    return None if fp32_ok else torch.float64


def widens_reduction(
    dtype: torch.dtype, device_type: str, rows: int, out_rows: int, out_cols: int
) -> bool:
    """Whether reduction_mm runs [out_rows, rows] @ [rows, out_cols] operands of
    ``dtype`` on ``device_type`` wider than the operands (fp64)."""
    return _reduction_dtype(dtype, device_type, rows, out_rows, out_cols) is not None


def reduction_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b for a GEMM whose inner dimension is the long weight-gradient reduction."""
    wide = _reduction_dtype(a.dtype, a.device.type, a.shape[1], a.shape[0], b.shape[1])
    if wide is None:
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    result = torch.mm(a.to(wide), b.to(wide))
    return result.to(a.dtype) if out is None else out.copy_(result)


def reduction_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched a @ b whose inner dimension is the long weight-gradient reduction."""
    wide = _reduction_dtype(a.dtype, a.device.type, a.shape[2], a.shape[1], b.shape[2])
    if wide is None:
        return torch.bmm(a, b)
    return torch.bmm(a.to(wide), b.to(wide)).to(a.dtype)


def reduction_mm_of(
    dtype: torch.dtype, device_type: str, rows: int, out_rows: int, out_cols: int
) -> Callable[..., torch.Tensor]:
    """What reduction_mm runs as for [out_rows, rows] @ [rows, out_cols] operands of
    ``dtype`` on ``device_type``: itself where it widens the reduction, else plain
    torch.mm, so a prepared run of fixed shapes decides once rather than per call."""
    if _reduction_dtype(dtype, device_type, rows, out_rows, out_cols) is None:
        return torch.mm
    return reduction_mm
