"""A GEMM kernel's tile configuration, and whether its pipeline fits a device."""

from __future__ import annotations

import dataclasses
import functools

import torch

from gemmconv.kernels.launch import COMPILE_OPTIONS


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def launch_options(self) -> dict[str, object]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **COMPILE_OPTIONS}


def fits(cfg: TileConfig, element_size: int, device: torch.device) -> bool:
    """Whether ``cfg``'s pipelined operand tiles fit one program's shared memory on
    ``device`` (a consumer Ada or Ampere card has about 100 KB; the interpreter has no
    limit)."""
    if device.type != "cuda":
        return True
    need = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * element_size
    return need <= shared_memory(device.index if device.index is not None else 0)


@functools.cache
def shared_memory(index: int) -> int:
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


__all__ = ["TileConfig", "fits", "shared_memory"]
