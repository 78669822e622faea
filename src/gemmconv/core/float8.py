"""The opt-in fp8 mode's configuration, and where it can run.

``Float8Config`` follows torchao's ``Float8LinearConfig``: the fp8 format of the
forward's operands (input columns and weight) and of the gradient dY, and how the
scales are taken from the current absolute maxima ("tensorwise": one scale per
operand; "rowwise": one per row of each GEMM operand along its reduction). A
convolution configured with one runs its three GEMMs through ``torch._scaled_mm``
with fp32 accumulation, on CUDA devices of compute capability 8.9 and up
(Ada, Hopper, Blackwell), the only ones with fp8 tensor cores.
"""

from __future__ import annotations

import dataclasses

import torch

# The formats cuBLASLt multiplies: e4m3 for every operand, e5m2 (more range, one
# mantissa bit less) for gradients. An e5m2 x e5m2 product has no kernel, so the
# forward, whose two operands share one format, takes e4m3 only.
FORWARD_DTYPES = (torch.float8_e4m3fn,)
GRAD_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALINGS = ("tensorwise", "rowwise")
# fp8 tensor cores: compute capability 8.9 (Ada) and up.
MIN_CAPABILITY = (8, 9)
# cuBLASLt's fp8 GEMMs need the reduction and the result's columns in multiples of 16.
FP8_ALIGNMENT = 16
# The smallest absolute maximum a scale is taken from (torchao's EPS): an all-zero
# operand gets a finite scale.
AMAX_EPS = 1e-12

# Lets the fp8 path run on the CPU (torch._scaled_mm has a CPU kernel), so the CPU
# test suite checks its numerics and its torch.compile trace. Never set by the library.
_RUN_ON_CPU_FOR_TESTS = False


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Float8Config:
    """How a gemmconv convolution runs in fp8 (``gemmconv.convert(model, fp8=...)``,
    ``module.set_fp8(...)``).

    - ``forward_dtype``: the format of the input's columns and the weight, in all
      three GEMMs: ``torch.float8_e4m3fn``.
    - ``grad_dtype``: the format of the output gradient dY: ``torch.float8_e4m3fn``
      (the default, as torchao's tensorwise recipe) or ``torch.float8_e5m2``.
    - ``scaling``: ``"tensorwise"`` (one scale per operand from its current absolute
      maximum, torchao's default recipe) or ``"rowwise"`` (one scale per row of each
      GEMM operand along the reduction: finer, at the cost of quantizing the input
      and dY again for the weight gradient).
    - ``round_scales_to_power_of_2``: round each scale down to a power of two, so
      that scaling is exact (as torchao's option of that name).

    Results come back in the input's dtype (bf16, fp16, or fp32 for an fp32 model
    outside autocast); the GEMMs accumulate in fp32.
    """

    forward_dtype: torch.dtype = torch.float8_e4m3fn
    grad_dtype: torch.dtype = torch.float8_e4m3fn
    scaling: str = "tensorwise"
    round_scales_to_power_of_2: bool = False

    def __post_init__(self) -> None:
        _check_dtype("forward_dtype", self.forward_dtype, FORWARD_DTYPES,
                     " (cuBLASLt has no e5m2 x e5m2 GEMM)")  # fmt: skip
        _check_dtype("grad_dtype", self.grad_dtype, GRAD_DTYPES, "")
        if not isinstance(self.scaling, str):
            raise TypeError(
                f"Float8Config(scaling={self.scaling!r}): expected a str, one of "
                f"{', '.join(map(repr, SCALINGS))}; got {type(self.scaling).__name__}"
            )
        if self.scaling not in SCALINGS:
            raise ValueError(
                f"Float8Config(scaling={self.scaling!r}): expected one of "
                f"{', '.join(map(repr, SCALINGS))}"
            )
        if not isinstance(self.round_scales_to_power_of_2, bool):
            raise TypeError(
                "Float8Config(round_scales_to_power_of_2="
                f"{self.round_scales_to_power_of_2!r}): expected a bool, got "
                f"{type(self.round_scales_to_power_of_2).__name__}"
            )

    def describe(self) -> str:
        """One line: the formats and the scaling."""
        pow2 = ", scales rounded to powers of 2" if self.round_scales_to_power_of_2 else ""
        return (
            f"{_dtype_text(self.forward_dtype)} inputs and weights, "
            f"{_dtype_text(self.grad_dtype)} gradients, {self.scaling} scaling{pow2}"
        )


def _check_dtype(name: str, value: object, allowed: tuple[torch.dtype, ...], why: str) -> None:
    expected = " or ".join(f"torch.{_dtype_text(d)}" for d in allowed)
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"Float8Config({name}={value!r}): expected a torch.dtype ({expected}), "
            f"got {type(value).__name__}"
        )
    if value not in allowed:
        raise ValueError(f"Float8Config({name}={value}): expected {expected}{why}")


def as_config(value: object, argument: str) -> Float8Config | None:
    """``fp8=`` as given to convert() or set_fp8(): a Float8Config, True (the default
    config), or False / None (no fp8)."""
    if value is None or value is False:
        return None
    if value is True:
        return Float8Config()
    if isinstance(value, Float8Config):
        return value
    raise TypeError(
        f"{argument}={value!r}: expected a gemmconv.Float8Config, True (the default "
        f"config), False or None; got {type(value).__name__}"
    )


@torch.compiler.assume_constant_result
def cuda_capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index``; a constant to torch.compile,
    which would otherwise record the query."""
    return torch.cuda.get_device_capability(index)


def device_reasons(device: torch.device) -> list[str]:
    """Why fp8 GEMMs cannot run on ``device`` (empty when they can)."""
    if device.type == "cpu" and _RUN_ON_CPU_FOR_TESTS:
        return []
    if device.type != "cuda":
        return [f"device {device.type}: fp8 GEMMs run on CUDA only"]
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = cuda_capability(index)
    if tuple(capability) < MIN_CAPABILITY:
        major, minor = capability
        return [
            f"CUDA device {index} has compute capability {major}.{minor}; fp8 tensor "
            "cores need 8.9 or later (Ada, Hopper, Blackwell)"
        ]
    return []


__all__ = ["Float8Config", "as_config", "device_reasons"]
