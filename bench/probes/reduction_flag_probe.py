"""What cuBLAS's reduced-precision reductions are worth on the patch GEMMs (a diagnostic).

gemmconv runs its half-precision GEMMs with torch's
``allow_{bf16,fp16}_reduced_precision_reduction`` off (precision.py: every product
summed in fp32, as a convolution accumulates), while the reshape + F.linear rewrite
runs under torch's default, on, which lets cuBLAS pick split-K kernels that sum
partials in the operands' half type. This times each GEMM of a few patch embeds
(device time, ``triton.testing.do_bench`` medians in ms) with the flag on and off,
names the kernel cuBLAS runs in each, and times the Qwen2-VL patch embed's
forward+backward as the end-to-end scenario calls it (gemmconv's module, the rewrite
with the flag on and off), so that a gap to the rewrite can be told from a
precision choice. One line per row, flushed as written. On a GPU machine:

    PYTHONPATH=src python3 bench/probes/reduction_flag_probe.py
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton.testing

import gemmconv.nn
from gemmconv.bench.linear_patch_embed import LinearPatchEmbed

# (name, rows M, reduction Kred, channels K): forward y = col [M, Kred] @ W^T, and
# the weight gradient dW [K, Kred] = dY^T [K, M] @ col.
CASES = [
    ("qwen2vl_embed_8192", 8192, 1176, 1280),
    ("point2d_9500", 9500, 588, 1280),
    ("vit_b16_b256", 50176, 768, 768),
    ("vit_b16_b32", 6272, 768, 768),
]
_FLAGS = {
    torch.bfloat16: "allow_bf16_reduced_precision_reduction",
    torch.float16: "allow_fp16_reduced_precision_reduction",
}


def _set_flag(dtype: torch.dtype, on: bool) -> None:
    setattr(torch.backends.cuda.matmul, _FLAGS[dtype], on)


def _kernel_names(fn) -> str:
    """The CUDA kernels one call of ``fn`` runs, by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return " + ".join(n[:60] for n in names) or "?"


def _gemms(dtype: torch.dtype) -> None:
    for name, m, kred, k in CASES:
        col = torch.randn(m, kred, device="cuda", dtype=dtype)
        w = torch.randn(k, kred, device="cuda", dtype=dtype)
        dy = torch.randn(m, k, device="cuda", dtype=dtype)
        for direction, fn in (
            ("forward", functools.partial(F.linear, col, w)),
            ("weight_gradient", functools.partial(torch.mm, dy.t(), col)),
        ):
            for on in (True, False):
                _set_flag(dtype, on)
                ms = triton.testing.do_bench(fn, warmup=25, rep=200)
                kernels = _kernel_names(fn)
                print(f"{name} {direction} {str(dtype)[6:]} reduced={'on' if on else 'off'} "
                      f"{ms:.4f} ms  {kernels}", flush=True)  # fmt: skip
    _set_flag(dtype, True)


def _qwen_embed_step() -> None:
    """The Qwen2-VL patch embed's forward+backward (dW; it has no bias), as module calls
    back to back: gemmconv's, the rewrite's with the flag on and off."""
    conv = torch.nn.Conv3d(3, 1280, (2, 14, 14), (2, 14, 14), bias=False)
    conv = conv.cuda().to(torch.bfloat16)
    pixels = torch.randn(8192, 3, 2, 14, 14, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(8192, 1280, 1, 1, 1, device="cuda", dtype=torch.bfloat16)
    converted = gemmconv.nn.Conv3d(3, 1280, (2, 14, 14), (2, 14, 14), bias=False)
    converted.weight = conv.weight  # the same Parameter, as convert() keeps it
    modules = {"gemmconv": converted, "linear": LinearPatchEmbed(conv)}

    def step(module):
        def run():
            module.zero_grad(set_to_none=True)
            module(pixels).backward(dy)

        return run

    for label, module, flag in (
        ("gemmconv", modules["gemmconv"], True),
        ("linear", modules["linear"], True),
        ("linear", modules["linear"], False),
    ):
        _set_flag(torch.bfloat16, flag)
        ms = triton.testing.do_bench(step(module), warmup=25, rep=300)
        print(f"qwen2vl_embed_fwd_bwd {label} reduced={'on' if flag else 'off'} "
              f"{ms:.4f} ms per call (back to back)", flush=True)  # fmt: skip
    _set_flag(torch.bfloat16, True)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for dtype in (torch.bfloat16, torch.float16):
        _gemms(dtype)
    _qwen_embed_step()


if __name__ == "__main__":
    main()
