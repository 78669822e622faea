"""The vendor path: aten's convolution, transposed convolution and convolution_backward
(cuDNN on CUDA, the native kernels on CPU). It applies to every problem, so nothing is
ever left without a correct solver."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gemmconv.core.device_rates import FACTORS, DeviceRates
from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem, Direction, dtype_name
from gemmconv.solvers.base import ConvTensors, Solver
from gemmconv.solvers.cpu_conv_hazards import (
    hazard_layout,
    run_avoiding,
    weight_gradient_arguments,
)

# Patch embeddings with at least this many kernel taps are "large" in the cost table.
LARGE_PATCH_TAPS = 16
# cuDNN's channels-last small-patch kernels run far from the floor below this many
# channels a group, forward and backward-data. On an H100 the 16-channel latent
# patchifies reached 0.52 (SD3) and 0.63 (Wan 2.1) of the floor forward, 0.37 and 0.55
# in the weight gradient, 0.25 and 0.24 in backward-data, DiT-XL/2's 4 channels 0.40,
# 0.31 and 0.22, against ConvNeXt's 192-channel downsample's 0.73, 0.50 and 0.43 (its
# backward-data's 96 channels). Counted few below 8 channels (where cuDNN pads to 8)
# outside backward-data, SD3's forward was priced with ConvNeXt's and sent to cuDNN
# by the forward tie rule, 0.066 ms a call against patch_triton's 0.049 on the H100.
FEW_CHANNELS = 32


def vendor_efficiency(p: ConvProblem, rates: DeviceRates) -> float:
    """The fraction of the GEMM floor the vendor's general kernels reach on ``p``: the
    device's fitted factor for the problem's class (device_rates.FACTORS), scaled for
    its dtype where the device has a scale for it."""
    return rates.factor(vendor_factor(p)) * rates.vendor_dtype_scale.get(dtype_name(p.dtype), 1.0)


def vendor_factor(p: ConvProblem) -> str:
    """The name of the factor (device_rates.FACTORS) that prices the vendor on ``p``:
    its class's factor for the problem's direction where the table fits one apart
    (``<class>_backward_data``, ``<class>_backward_weights``), else the class's."""
    by_direction = f"{vendor_class(p)}_{p.direction.value}"
    return by_direction if by_direction in FACTORS else vendor_class(p)


def vendor_class(p: ConvProblem) -> str:
    """The factor (device_rates.FACTORS) of ``p``'s class; the direction picks among a
    class's factors (vendor_factor)."""
    if all(r == 1 for r in p.kernel):
        return "vendor_pointwise"
    if p.stride == p.kernel and not any(p.padding) and all(d == 1 for d in p.dilation):
        if math.prod(p.kernel) >= LARGE_PATCH_TAPS:
            if math.prod(p.output_spatial) == 1:
                return "vendor_point_output"
            return "vendor_large_patch"
        if p.layout is Layout.CHANNELS_FIRST:
            return "vendor_small_patch_channels_first"
        if p.c // p.groups < FEW_CHANNELS:
            return "vendor_few_channel_patch"
        return "vendor_small_patch"
    return "vendor_other"


class VendorSolver(Solver):
    id = "vendor"
    handles_empty = True
    max_operand_elements = None  # aten splits large convolutions itself (or raises as F.conv*)
    # cuDNN and the CPU kernels pick their deterministic algorithms under
    # torch.use_deterministic_algorithms, as F.conv* does.
    uses_cublas = False

    def invariance_reasons(self, problem: ConvProblem) -> list[str]:
        return [
            "torch's convolution picks its algorithm by the batch size (cuDNN, oneDNN); "
            "gemmconv does not fix its reduction order"
        ]

    def work_ms(self, problem: ConvProblem, rates: DeviceRates) -> float:
        work = super().work_ms(problem, rates) / vendor_efficiency(problem, rates)
        return max(work, _serial_reduction_ms(problem, rates))

    def gemm_is_aligned(self, problem: ConvProblem) -> bool:
        return True

    def host_launches(self, problem: ConvProblem) -> int:
        return 1  # one aten call, which allocates its own result

    def allocations(self, problem: ConvProblem) -> int:
        return 0

    def _args(self, p: ConvProblem):
        return (list(p.stride), list(p.padding), list(p.dilation), False, [0] * p.dims, p.groups)

    def forward(self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None) -> torch.Tensor:
        # torch.convolution is aten.convolution through torch's C binding, traced as the
        # same op: 4.4 us a call less than torch.ops.aten's Python overload on the CPU
        # machine (transposed_input_gradient calls it too).
        args = self._args(p)
        hazard = hazard_layout(t.input, t.weight, p.output_shape, p.stride, p.padding,
                               p.dilation, p.groups)  # fmt: skip
        if hazard is None:
            y = torch.convolution(t.input, t.weight, t.bias, *args)
        else:
            y = run_avoiding(hazard, torch.convolution, t.input, t.weight, t.bias, *args)
        return _deliver(y, out)

    def backward_data(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        if 0 in (p.n, p.c):
            dx = _empty_problem_input_gradient(t.grad_output, t.weight, p)
        else:
            dx = transposed_input_gradient(
                t.grad_output, t.weight, p.input_shape, p.stride, p.padding, p.dilation, p.groups
            )
        return _deliver(dx, out)

    def backward_weights(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dw = weight_gradient(
            t.grad_output, t.input, p.weight_shape, p.stride, p.padding, p.dilation, p.groups
        )
        return _deliver(dw, out)


def _serial_reduction_ms(p: ConvProblem, rates: DeviceRates) -> float:
    """The least time the vendor's forward of a large patch embedding takes, set by the
    reduction its kernel walks serially (DeviceRates.vendor_patch_forward_us_per_reduction)."""
    large = vendor_class(p) in ("vendor_large_patch", "vendor_point_output")
    if p.direction is not Direction.FORWARD or not large:
        return 0.0
    return p.gemm_k * rates.vendor_patch_forward_us_per_reduction / 1000.0


def transposed_input_gradient(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    input_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """dX as aten's transposed convolution of dY with the weight: the vendor's
    backward-data kernels, laid out as dY and the weight suggest.

    Not convolution_backward with a stand-in input: cuDNN's backward converts dY to the
    memory format the input suggests, which a one-element expanded stand-in makes
    channels-first, so a channels-last problem paid a transpose of dY and a
    mixed-layout kernel (4-6x the call's time on the H200, bench/NOTES.md)."""
    steps, output_padding = [], []
    sides = zip(input_size[2:], grad_output.shape[2:], weight.shape[2:], stride, padding, dilation)
    for s, o, r, u, p, d in sides:
        if u > _INT32_MAX and o == 1:
            # A stride past 32 bits (torch takes any that fits in 64) overflows the CPU
            # kernels; with one output position it is never taken, and the smallest
            # stride that leaves the output padding below it gives the same result.
            u = s + 2 * p - d * (r - 1)
        steps.append(u)
        # The transposed convolution's output size is fixed up to the input positions
        # the forward's stride skipped at the far end; output_padding adds them back
        # (always fewer than the stride, as aten requires).
        output_padding.append(s - ((o - 1) * u - 2 * p + d * (r - 1) + 1))
    return torch.convolution(
        grad_output, weight, None, steps, list(padding), list(dilation), True,
        output_padding, groups,
    )  # fmt: skip


_INT32_MAX = 2**31 - 1


def weight_gradient(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """dW as aten's convolution_backward with only the weight's gradient asked for."""
    # convolution_backward reads the weight only for its shape when it computes just
    # the weight's gradient; an uninitialised tensor of that shape (as small as the
    # result) stands in for it. Contiguous, it never asks for channels-last, so the
    # input's memory format decides the kernels' layout, as in torch's own backward.
    shape_only_weight = grad_output.new_empty(weight_size)
    no_output_padding = [0] * len(stride)
    input, shape_only_weight, stride, dilation = weight_gradient_arguments(
        input, shape_only_weight, list(stride), padding, list(dilation), groups
    )
    _, grad_weight, _ = torch.ops.aten.convolution_backward.default(
        grad_output, input, shape_only_weight, None, stride, list(padding), dilation,
        False, no_output_padding, groups, [False, True, False],
    )  # fmt: skip
    return grad_weight


def _empty_problem_input_gradient(
    grad_output: torch.Tensor, weight: torch.Tensor, p: ConvProblem
) -> torch.Tensor:
    """dX of an empty batch or a zero-channel input, as torch's own backward gives it:
    convolution_backward, with an input of no elements standing in for x. The
    transposed convolution cannot take dY here: torch gives a zero-channel input a
    zero-channel output, so dY does not have the weight's output channels."""
    shape_only_input = grad_output.new_empty(p.input_shape)
    no_output_padding = [0] * p.dims
    grad_input, _, _ = torch.ops.aten.convolution_backward.default(
        grad_output, shape_only_input, weight, None, list(p.stride), list(p.padding),
        list(p.dilation), False, no_output_padding, p.groups, [True, False, False],
    )  # fmt: skip
    return grad_input


def _deliver(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out
