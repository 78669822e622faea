"""A prepared launch's kernel compiled for a Hopper GPU on a machine without one.

Triton's interpreter (the CPU tests) runs a kernel's Python, not its compiler: a
kernel that cannot compile for a GPU, or whose loads lose their width, passes there.
``sm90_ptx`` compiles the kernel as Triton's launcher would for the launch's tensors
(16-byte aligned; integer arguments of 1 and multiples of 16 specialised unless
``do_not_specialize`` names them) for sm_90, with Triton's own ptxas, and returns the
PTX. ``load_widths`` counts its global loads by width.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence

import torch

from gemmconv.kernels.launch import PreparedLaunch, TensorSlot

_POINTER_TYPES = {
    torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
    torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5",
    torch.int8: "*i8", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64",
}  # fmt: skip


def sm90_ptx(
    launch: PreparedLaunch,
    tensors: Sequence[torch.Tensor | None],
    constants: dict[str, object] | None = None,
) -> str:
    """The PTX of ``launch``'s kernel for sm_90 on ``tensors`` (real or meta; a None
    slot takes the first tensor's type), ``constants`` in place of the launch's."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = launch.constants if constants is None else constants
    fn = launch.kernel.fn
    free = set(launch.jit_options.get("do_not_specialize", ()))
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(inspect.signature(fn).parameters):
        if i >= len(launch.args):
            signature[name], constexprs[(i,)] = "constexpr", constants[name]
            continue
        value = launch.args[i]
        if isinstance(value, TensorSlot):
            tensor = tensors[value.index]
            tensor = tensors[0] if tensor is None else tensor
            signature[name] = _POINTER_TYPES[tensor.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name not in free and value == 1:
            signature[name], constexprs[(i,)] = "constexpr", 1
        else:
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            if name not in free and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(triton.jit(fn), signature, constexprs, attrs)
    compile_options = ("num_warps", "num_stages", "enable_fp_fusion")
    options = {k: v for k, v in launch.options.items() if k in compile_options}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def load_widths(ptx: str) -> dict[str, int]:
    """Global loads in ``ptx``: cp.async copies of 16, 8 and 4 bytes ('cp16', 'cp8',
    'cp4'), plain loads ('ld', not pipelined into shared memory), and 'wgmma' (1 where
    the kernel multiplies with Hopper's warpgroup MMA)."""
    widths = {"cp16": 0, "cp8": 0, "cp4": 0}
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*?,\s*(0x[0-9a-f]+|\d+)\s*[,;]", ptx)
    for size in copies:
        key = f"cp{int(size, 0)}"
        widths[key] = widths.get(key, 0) + 1
    widths["ld"] = len(re.findall(r"\bld\.global", ptx))
    widths["wgmma"] = int("wgmma" in ptx)
    return widths


__all__ = ["load_widths", "sm90_ptx"]
