"""The solver interface: stateless, declarative, one GEMM mapping per solver.

A solver declares what it can do (directions, spatial dims, layouts, dtypes,
devices); the base class turns those declarations into rejection reasons, and a
solver adds only the reasons special to its mapping. Its cost estimate is in real
units: the GEMM's flops at the device's matrix rate plus every byte it moves at the
device's bandwidth.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from typing import ClassVar

import torch

from gemmconv.core.device_rates import DeviceRates, rates_for
from gemmconv.core.invariance import batch_invariant_enabled
from gemmconv.core.memory_format import Layout
from gemmconv.core.precision import conv_gemm_precision, convolutions_allow_tf32
from gemmconv.core.problem import DIRECTIONS, ConvProblem, Direction, dtype_name
from gemmconv.core.sizes import round_up

ALL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
ALL_LAYOUTS = frozenset({Layout.CHANNELS_FIRST, Layout.CHANNELS_LAST})

# GEMM libraries index in 32 bits: cuBLAS takes int sizes and has read out of bounds
# on operands of more than 2^31 elements (pytorch/pytorch#17897), and CPU BLAS paths
# have overflowed 32-bit products of sizes (pytorch/pytorch#191083). A GEMM solver
# refuses any problem with a larger operand; the vendor path takes it.
INT32_MAX = 2**31 - 1

# cuBLAS is bitwise reproducible run to run only with one of these workspace
# configurations (its documentation; torch refuses cuBLAS calls under
# torch.use_deterministic_algorithms(True) without one).
CUBLAS_DETERMINISTIC_CONFIGS = (":4096:8", ":16:8")


def cublas_is_reproducible() -> bool:
    if torch.version.hip:  # ROCm's BLAS needs no workspace setting
        return True
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG", "") in CUBLAS_DETERMINISTIC_CONFIGS


def cublas_refused_reasons() -> list[str]:
    """Why no cuBLAS solver may run now, for any problem (empty: they may): under
    torch.use_deterministic_algorithms without a CUBLAS_WORKSPACE_CONFIG
    (Solver.determinism_reasons). The chunked cuBLAS GEMM is then not CUDA's invariant
    form; the implicit Triton GEMM is."""
    if torch.are_deterministic_algorithms_enabled() and not cublas_is_reproducible():
        return ["cuBLAS is refused (torch.use_deterministic_algorithms is on without "
                "CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8)"]  # fmt: skip
    return []


# CUDA's batch-invariant form of a problem, by its geometry alone (never its batch, so
# a batch-dependent pick between the two families cannot change a bit). On an H100
# (bench/results/h100.json) the chunked cuBLAS form won in fp32 (point 2D: 1.40x the
# default call against the implicit GEMM's 3.6x) and on channels-first 1x1 (ResNet:
# 1.12x against 5.4x); the implicit Triton GEMM won on half-precision patches (ViT-B/16
# channels-last: 0.98x against 1.70x; point 2D 1.0x against 2.3x).
CHUNKED_DTYPES = frozenset({torch.float32, torch.float64})


def chunked_form_reasons(p: ConvProblem) -> list[str]:
    """Why CUDA's batch-invariant form of ``p`` is not the chunked cuBLAS GEMM of the
    column and pointwise solvers (empty: it is); where it is not, it is the implicit
    Triton GEMM (patch_implicit)."""
    refused = cublas_refused_reasons()
    if refused:
        return refused
    if p.dtype in CHUNKED_DTYPES:
        return []
    if all(r == 1 for r in p.kernel) and (
        p.layout is Layout.CHANNELS_FIRST or any(s != 1 for s in p.stride)
    ):
        return []
    return [f"CUDA's batch-invariant form of a {dtype_name(p.dtype)} patch problem is the "
            "implicit Triton GEMM (patch_implicit)"]  # fmt: skip


def determinism_state() -> tuple[bool, bool]:
    """What the determinism rules depend on, for caches of solver decisions."""
    return torch.are_deterministic_algorithms_enabled(), cublas_is_reproducible()


@dataclasses.dataclass
class ConvTensors:
    """The operands of one direction. Which are needed depends on the direction:
    forward: input, weight, bias; backward-data: grad_output, weight;
    backward-weights: grad_output, input."""

    input: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None


class Solver:
    id: ClassVar[str]
    directions: ClassVar[frozenset[Direction]] = frozenset(DIRECTIONS)
    spatial_dims: ClassVar[frozenset[int]] = frozenset({1, 2, 3})
    layouts: ClassVar[frozenset[Layout]] = ALL_LAYOUTS
    dtypes: ClassVar[frozenset[torch.dtype]] = ALL_DTYPES
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    handles_empty: ClassVar[bool] = False
    # The most elements any one operand of the solver's GEMMs may have; None: no limit.
    max_operand_elements: ClassVar[int | None] = INT32_MAX
    # Bitwise identical results run to run on the same device and inputs. False for a
    # solver whose reductions depend on scheduling (split reductions with atomics);
    # such a solver is refused under torch.use_deterministic_algorithms(True).
    deterministic: ClassVar[bool] = True
    # Whether its GEMMs run on cuBLAS on CUDA (reproducible only with a
    # CUBLAS_WORKSPACE_CONFIG from CUBLAS_DETERMINISTIC_CONFIGS, and governed by the
    # precision flags Solver.run sets).
    uses_cublas: ClassVar[bool] = True
    # Whether its weight gradient is one GEMM of dY with the column matrix its forward
    # multiplies: the eager road then runs that GEMM on the columns the forward kept
    # (ColumnKeepingForward) instead of gathering them again.
    weight_gradient_multiplies_columns: ClassVar[bool] = False
    # Devices on which its forward is batch-invariant under gemmconv.batch_invariant(): a
    # sample's output the same bits whatever the batch size and the sample's place in
    # it (fixed tiles and reduction order, nothing chosen by the row count). The
    # tests (tests/solvers/test_batch_invariance.py) hold every solver to it.
    batch_invariant_devices: ClassVar[frozenset[str]] = frozenset()
    # Whether its invariant forward on CUDA multiplies in fixed-size chunks, with only
    # torch's own (64-bit) copies and views around them: then only a chunk's operands
    # meet the 32-bit limit below, and which solver applies never turns on the batch
    # size (a bigger batch must not leave the family whose bits the smaller ones had).
    chunked_invariant_operands: ClassVar[bool] = False

    # ---- applicability ------------------------------------------------------

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        """Empty when the solver applies; otherwise every reason it does not."""
        reasons = []
        if problem.direction not in self.directions:
            reasons.append(f"direction {problem.direction.value} not supported")
        if problem.dims not in self.spatial_dims:
            reasons.append(f"{problem.dims}-D convolution not supported")
        if problem.layout not in self.layouts:
            reasons.append(f"layout {problem.layout.value} not supported")
        if problem.dtype not in self.dtypes:
            reasons.append(f"dtype {dtype_name(problem.dtype)} not supported")
        if problem.device_type not in self.devices:
            reasons.append(f"device {problem.device_type} not supported")
        if not self.handles_empty and 0 in (problem.n, problem.c, problem.k):
            reasons.append(f"empty problem (N={problem.n}, C={problem.c}, K={problem.k})")
        reasons += self._operand_size_reasons(problem)
        reasons += self.determinism_reasons(problem)
        return reasons + self.problem_reasons(problem)

    def determinism_reasons(self, problem: ConvProblem) -> list[str]:
        """Why the solver may not run while torch.use_deterministic_algorithms is on."""
        if not torch.are_deterministic_algorithms_enabled():
            return []
        if not self.deterministic:
            return ["not bitwise reproducible (torch.use_deterministic_algorithms is on)"]
        if problem.device_type == "cuda" and self.uses_cublas and not cublas_is_reproducible():
            return [
                "cuBLAS is not reproducible without CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8 "
                "(torch.use_deterministic_algorithms is on)"
            ]
        return []

    def invariance_reasons(self, problem: ConvProblem) -> list[str]:
        """Why this solver's forward of ``problem`` would not be batch-invariant (empty:
        it is), for the selection under gemmconv.batch_invariant()."""
        if problem.device_type in self.batch_invariant_devices:
            if problem.device_type == "cpu":
                from gemmconv.solvers.invariant import cpu_reasons

                return cpu_reasons(problem)
            return self.cuda_invariance_reasons(problem)
        if problem.device_type == "cuda" and self.uses_cublas:
            return ["its GEMM runs on cuBLAS, which picks tile shapes and split-K by the row count"]
        return ["its forward is not batch-invariant"]

    def cuda_invariance_reasons(self, problem: ConvProblem) -> list[str]:
        """Why this solver's invariant forward on CUDA would not serve ``problem``: by
        default that form is the chunked cuBLAS GEMM (solvers/invariant.py). On CUDA
        exactly one family of solvers is invariant for a given geometry and selection
        state, never chosen by the batch size, since two families' products differ in
        their bits: chunked_form_reasons says which."""
        return chunked_form_reasons(problem)

    def runs_invariant(self, problem: ConvProblem) -> bool:
        """Whether this run of ``problem`` takes the solver's batch-invariant form: a
        forward on a device it declares, while gemmconv.batch_invariant() is on."""
        return (
            problem.direction is Direction.FORWARD
            and problem.device_type in self.batch_invariant_devices
            and batch_invariant_enabled()
        )

    def operand_elements(self, problem: ConvProblem) -> dict[str, int]:
        """Elements of each tensor the solver's GEMMs read or write (their views reach
        over the whole input and output), by name."""
        return {
            "input": math.prod(problem.input_shape),
            "weight": math.prod(problem.weight_shape),
            "output": math.prod(problem.output_shape),
            "column matrix": problem.groups * problem.gemm_m * problem.gemm_k,
        }

    def invariant_operand_elements(self, problem: ConvProblem) -> dict[str, int]:
        """Elements of each operand one product of the chunked invariant forward on
        CUDA reads or writes, by name: the padded weight and one sample's input and
        output (a chunk's rows are bounded by solvers/invariant.py to fit)."""
        from gemmconv.solvers.invariant import COLUMN_MULTIPLE, aligned_width

        n = max(1, problem.n)
        width = round_up(problem.k, COLUMN_MULTIPLE)
        return {
            "padded weight": width * aligned_width(problem.gemm_k, problem.dtype),
            "one sample's input": math.prod(problem.input_shape) // n,
            "one sample's output": math.prod(problem.output_shape) // n,
        }

    def _operand_size_reasons(self, problem: ConvProblem) -> list[str]:
        limit = self.max_operand_elements
        if limit is None:
            return []
        elements = (
            self.invariant_operand_elements(problem)
            if self.chunked_invariant_operands
            and problem.device_type == "cuda"
            and self.runs_invariant(problem)
            else self.operand_elements(problem)
        )
        return [
            f"{name} has {count} elements, more than {limit} (32-bit GEMM indexing)"
            for name, count in elements.items()
            if count > limit
        ]

    def problem_reasons(self, problem: ConvProblem) -> list[str]:
        """What this solver's mapping rejects, beyond the declared capabilities."""
        return []

    def is_applicable(self, problem: ConvProblem) -> bool:
        return not self.not_supported_reasons(problem)

    # ---- cost ---------------------------------------------------------------

    def workspace_bytes(self, problem: ConvProblem) -> int:
        """Temporary device memory the solver allocates beyond the result."""
        return 0

    def copied_bytes(self, problem: ConvProblem) -> int:
        """Bytes moved outside the GEMM itself (gathers, scatters, zero fills)."""
        return 0

    def gemm_launches(self, problem: ConvProblem) -> int:
        return 1

    def gemm_is_aligned(self, problem: ConvProblem) -> bool:
        return (problem.gemm_k * problem.element_size) % 16 == 0

    def gemm_slowdown(self, problem: ConvProblem) -> float:
        """The solver's GEMM time against cuBLAS's at the same alignment (1: cuBLAS's)."""
        return 1.0

    def host_launches(self, problem: ConvProblem) -> int:
        """Launches the host issues per call (the GEMMs and copies, plus the result's
        allocation)."""
        return self.gemm_launches(problem) + 1

    def allocations(self, problem: ConvProblem) -> int:
        """How many of the host's launches are allocations alone (the result's), each
        costing the host less than an op (DeviceRates.host_allocation_us)."""
        return 1

    def triton_launches(self, problem: ConvProblem) -> int:
        """How many of the host's launches are Triton kernels, each costing the host
        more than a torch op (DeviceRates.host_triton_launch_us)."""
        return 0

    def host_ms(self, problem: ConvProblem, rates: DeviceRates | None = None) -> float:
        """Host time of one call on the eager road."""
        rates = rates or rates_for(problem.device_type)
        triton, allocations = self.triton_launches(problem), self.allocations(problem)
        torch_ops = self.host_launches(problem) - triton - allocations
        return (
            torch_ops * rates.host_launch_us
            + triton * rates.host_triton_launch_us
            + allocations * rates.host_allocation_us
        ) / 1000.0

    def call_ms(
        self, problem: ConvProblem, rates: DeviceRates | None = None, in_node: bool = True
    ) -> float:
        """What one call costs in a steady stream of calls: device and host time
        overlap on a GPU (the host queues ahead), and add up on a CPU. A backward
        direction runs inside gemmconv's autograd node, whose host time it pays too
        (``in_node``; False: the call alone, as the training road counts the node once
        for all directions)."""
        rates = rates or rates_for(problem.device_type)
        device, host = self.estimate_ms(problem, rates), self.host_ms(problem, rates)
        if in_node and problem.direction is not Direction.FORWARD:
            host += rates.autograd_node_us / 1000.0
        return max(device, host) if rates.host_overlaps_device else device + host

    def estimate_ms(self, problem: ConvProblem, rates: DeviceRates | None = None) -> float:
        """Device time of one call: the work, and the gaps between its launches."""
        rates = rates or rates_for(problem.device_type)
        launch_ms = self.gemm_launches(problem) * rates.launch_us / 1000.0
        return self.work_ms(problem, rates) + launch_ms

    def work_ms(self, problem: ConvProblem, rates: DeviceRates) -> float:
        """The GEMM (flops at the matrix rate or bytes at the bandwidth, whichever is
        longer) and every byte copied besides it."""
        flop_ms = gemm_flop_ms(problem, rates)
        flop_ms *= self.gemm_slowdown(problem)
        if not self.gemm_is_aligned(problem):
            # Unaligned reductions run on slower GEMM kernels (DeviceRates says how much).
            flop_ms *= rates.unaligned_slowdown
        byte_ms = problem.min_bytes() / rates.bytes_per_ms()
        gemm_ms = max(flop_ms, byte_ms)
        return gemm_ms + self.copied_bytes(problem) / rates.bytes_per_ms()

    # ---- execution ----------------------------------------------------------

    def prepare(
        self, problem: ConvProblem, tensors: ConvTensors
    ) -> Callable[[ConvTensors], torch.Tensor]:
        """The run of ``problem`` made ready for operands with the sizes, strides,
        dtypes and device of ``tensors`` (and the same ones None): what an eager
        call's plan keeps, so that a call repeats only the work that depends on the
        data. The result is allocated by each call. By default, ``run`` itself."""
        return functools.partial(self.run, problem)

    def run(
        self, problem: ConvProblem, tensors: ConvTensors, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Compute the problem's direction and return its result.

        Writes every element of ``out`` when one is given (forward: y,
        backward-data: dx, backward-weights: dw), else allocates the result. The
        accumulation rules are cuBLAS's flags, so a solver that issues no cuBLAS GEMM
        (the vendor's cuDNN, the Triton kernels) runs without switching them: each
        switch is host time on every call of a prepared run."""
        if not self.uses_cublas:
            return self._direction(problem, tensors, out)
        with conv_gemm_precision(problem.dtype, problem.device_type):
            return self._direction(problem, tensors, out)

    def _direction(
        self, problem: ConvProblem, tensors: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        if problem.direction is Direction.FORWARD:
            return self.forward(problem, tensors, out)
        if problem.direction is Direction.BACKWARD_DATA:
            return self.backward_data(problem, tensors, out)
        return self.backward_weights(problem, tensors, out)

    def forward(
        self, problem: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def backward_data(
        self, problem: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def backward_weights(
        self, problem: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<solver {self.id}>"


def gemm_flop_ms(problem: ConvProblem, rates: DeviceRates) -> float:
    """The problem's GEMM flops at the device's matrix rate for its math mode (TF32 for
    fp32 on CUDA where convolutions allow it), before any kernel's slowdown."""
    return problem.flops() / rates.matrix_rate(_math_mode(problem))


def _math_mode(problem: ConvProblem) -> str:
    if problem.dtype == torch.float32 and problem.device_type == "cuda":
        return "tf32" if convolutions_allow_tf32() else "fp32"
    return dtype_name(problem.dtype)
