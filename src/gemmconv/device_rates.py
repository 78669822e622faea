"""Peak rates of the machine a problem runs on, for the cost model.

The table holds rates measured on real devices (matrix rate on random data through
torch.matmul, copy bandwidth counting bytes read plus written); a device not in it
gets conservative defaults scaled from its multiprocessor count.
"""

from __future__ import annotations

import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    name: str
    matrix_tflops: dict[str, float]  # by dtype name; "fp32" is full fp32, "tf32" the TF32 mode
    bandwidth_gbs: float
    launch_us: float

    def matrix_rate(self, dtype_key: str) -> float:
        """Flops per millisecond for this dtype/math mode."""
        return self.matrix_tflops.get(dtype_key, self.matrix_tflops["fp32"]) * 1e9

    def bytes_per_ms(self) -> float:
        return self.bandwidth_gbs * 1e6


# Measured on an H200 of this workplace (KINDS.md: 8192^3 bf16 matmul 769-798 TFLOP/s,
# device copy about 4.3 TB/s); fp32 and tf32 rates are the datasheet's dense figures
# scaled by the same measured/datasheet ratio as bf16 (about 0.8).
_H200 = DeviceRates(
    name="NVIDIA H200",
    matrix_tflops={"bf16": 780.0, "fp16": 780.0, "tf32": 390.0, "fp32": 50.0, "fp64": 50.0},
    bandwidth_gbs=4300.0,
    launch_us=4.0,
)

_KNOWN: dict[str, DeviceRates] = {"NVIDIA H200": _H200, "NVIDIA H100 80GB HBM3": _H200}

# A 2-core CI machine: orders of magnitude below any GPU; only the ratios between
# solvers matter here, and those are set by bytes copied versus flops.
_CPU = DeviceRates(
    name="cpu",
    matrix_tflops={"bf16": 0.05, "fp16": 0.02, "tf32": 0.1, "fp32": 0.1, "fp64": 0.05},
    bandwidth_gbs=10.0,
    launch_us=5.0,
)


@functools.cache
def rates_for(device_type: str, index: int = 0) -> DeviceRates:
    if device_type != "cuda" or not torch.cuda.is_available():
        return _CPU
    name = torch.cuda.get_device_name(index)
    if name in _KNOWN:
        return _KNOWN[name]
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    scale = sms / 132.0
    return DeviceRates(
        name=name,
        matrix_tflops={k: v * scale * 0.5 for k, v in _H200.matrix_tflops.items()},
        bandwidth_gbs=2000.0,
        launch_us=5.0,
    )
