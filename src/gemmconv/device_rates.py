"""Peak rates of the machine a problem runs on, for the cost model.

The table holds rates measured on real devices (matrix rate on random data through
torch.matmul, copy bandwidth counting bytes read plus written). A CUDA device not in
the table is measured once — a large matmul per math mode and a large copy — and the
result is kept in the find database, so later processes reuse it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

log = logging.getLogger("gemmconv.dispatch")


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    name: str
    matrix_tflops: dict[str, float]  # by dtype name; "fp32" is full fp32, "tf32" the TF32 mode
    bandwidth_gbs: float
    launch_us: float
    # Streaming multiprocessors: kernels that size their grid to fill the device are
    # costed with it. None where not known (the CPU, rates stored without it).
    multiprocessors: int | None = None
    # How much slower a GEMM runs when its reduction rows are not 16-byte aligned
    # (measured on an H200: bf16 [9500 x 588] x [588 x 1280] 88 us, padded to 592 31 us).
    unaligned_slowdown: float = 1.0
    # Host time per kernel launch (torch op or prepared Triton launch, allocation
    # included) on the eager road, and whether the host runs ahead of the device (a
    # GPU) or does the work itself (a CPU): a call costs the larger of host and
    # device time in the first case, their sum in the second.
    host_launch_us: float = 10.0
    host_overlaps_device: bool = True

    def matrix_rate(self, dtype_key: str) -> float:
        """Flops per millisecond for this dtype/math mode."""
        return self.matrix_tflops.get(dtype_key, self.matrix_tflops["fp32"]) * 1e9

    def bytes_per_ms(self) -> float:
        return self.bandwidth_gbs * 1e6

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


# Measured on an H200 of this workplace (KINDS.md: 8192^3 bf16 matmul 769-798 TFLOP/s,
# device copy about 4.3 TB/s); fp32 and tf32 rates are the datasheet's dense figures
# scaled by the same measured/datasheet ratio as bf16 (about 0.8).
H200 = DeviceRates(
    name="NVIDIA H200",
    matrix_tflops={"bf16": 780.0, "fp16": 780.0, "tf32": 390.0, "fp32": 50.0, "fp64": 50.0},
    bandwidth_gbs=4300.0,
    multiprocessors=132,
    launch_us=4.0,
    unaligned_slowdown=2.8,
    # A torch op cost about 10 us of Python and dispatch on the H200's host
    # (bench/results/overhead_h200.md: a tiny F.conv2d forward, 29 us, is about three).
    host_launch_us=10.0,
)
_H200 = H200  # the name this table had first

_KNOWN: dict[str, DeviceRates] = {"NVIDIA H200": H200, "NVIDIA H100 80GB HBM3": H200}

# A 2-core CI machine: orders of magnitude below any GPU; only the ratios between
# solvers matter here, and those are set by bytes copied versus flops. CPU GEMMs
# showed no alignment cliff.
CPU = DeviceRates(
    name="cpu",
    matrix_tflops={"bf16": 0.05, "fp16": 0.02, "tf32": 0.1, "fp32": 0.1, "fp64": 0.05},
    bandwidth_gbs=10.0,
    launch_us=5.0,
    host_launch_us=4.0,
    host_overlaps_device=False,
)
_CPU = CPU

# The alignment cliff measured on Hopper is assumed for a measured CUDA device too.
_MEASURED_UNALIGNED_SLOWDOWN = 2.8


@functools.cache
def rates_for(device_type: str, index: int = 0) -> DeviceRates:
    if device_type != "cuda" or not torch.cuda.is_available():
        return CPU
    name = torch.cuda.get_device_name(index)
    if name in _KNOWN:
        return _KNOWN[name]
    return _stored_or_measured(index)


def _stored_or_measured(index: int) -> DeviceRates:
    from gemmconv import finddb

    db = finddb.get_db()
    identity = finddb.identity_for("cuda", index)
    stored = db.lookup_rates(identity)
    if stored is not None:
        try:
            return DeviceRates(**stored)
        except TypeError:
            log.warning("stored rates for %s are unreadable; measuring again", identity.device)
    rates = measure_rates(index)
    db.store_rates(identity, rates.as_json())
    return rates


def measure_rates(index: int = 0) -> DeviceRates:
    """Measure the matrix rate of each math mode and the copy bandwidth of a CUDA device."""
    from gemmconv.precision import _fp32_matmul_mode
    from gemmconv.timing import time_ms

    device = torch.device("cuda", index)
    generator = torch.Generator(device=device).manual_seed(0)
    tflops = {}
    modes = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}
    for key, dtype in {**modes, "fp32": torch.float32}.items():
        size = 8192 if key in modes else 4096  # full fp32 is slow; a smaller size suffices
        a = torch.empty(size, size, dtype=dtype, device=device).uniform_(-1, 1, generator=generator)
        out = torch.empty_like(a)
        # fp32 matmuls run in TF32 only in the TF32 math mode.
        with _fp32_matmul_mode(key == "tf32"):
            t = time_ms(lambda a=a, out=out: torch.mm(a, a, out=out), device=device, reps=10)
        tflops[key] = 2 * size**3 / t.median_ms / 1e9
        del a, out
    tflops["fp64"] = tflops["fp32"]
    src = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = time_ms(lambda: dst.copy_(src), device=device, reps=10)
    bandwidth = 2 * src.numel() / copy.median_ms / 1e6  # bytes read plus written
    rates = DeviceRates(
        name=torch.cuda.get_device_name(index),
        matrix_tflops={k: round(v, 1) for k, v in tflops.items()},
        bandwidth_gbs=round(bandwidth, 1),
        launch_us=5.0,
        unaligned_slowdown=_MEASURED_UNALIGNED_SLOWDOWN,
        multiprocessors=torch.cuda.get_device_properties(index).multi_processor_count,
    )
    log.info("measured peak rates of %s: %s", rates.name, rates)
    return rates
