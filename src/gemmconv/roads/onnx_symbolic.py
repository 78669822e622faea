"""``gemmconv::conv_forward`` for torch's TorchScript-based ONNX exporter
(``torch.onnx.export(..., dynamo=False)``): a standard ONNX Conv node.

That exporter traces the model with torch.jit and looks each traced op up in its
registry of symbolic functions, where a custom op has none until one is registered.
Registering needs ``torch.onnx``, whose import costs about 40 ms, so it is done the
first time torch.jit traces the op (the exporter's own trace included), or at import
when ``torch.onnx`` is already loaded, rather than on every ``import gemmconv``. The
dynamo-based exporter needs nothing here: it decomposes the op first
(gemmconv.roads.decompositions).
"""

from __future__ import annotations

import sys

import torch

_OP_NAME = "gemmconv::conv_forward"
# Registered from the oldest opset the TorchScript exporter writes, so that every
# opset it writes finds it: ONNX's Conv has taken these inputs and attributes in all.
_FIRST_OPSET = 7
# How the exporter's parse_args hands each argument to _conv_forward: graph values
# for the tensors, Python constants for the integer lists and the group count, which
# ONNX takes as attributes.
_ARGUMENT_KINDS = ("v", "v", "v", "is", "is", "is", "i")

_registered = False


def _conv_forward(g, input, weight, bias, stride, padding, dilation, groups):
    operands = [input, weight] if bias.node().mustBeNone() else [input, weight, bias]
    return g.op(
        "Conv",
        *operands,
        strides_i=stride,
        # ONNX lists every dimension's start padding, then every end padding.
        pads_i=list(padding) + list(padding),
        dilations_i=dilation,
        group_i=groups,
    )


def register() -> None:
    """Register the Conv translation with the TorchScript ONNX exporter (once)."""
    global _registered
    if _registered:
        return
    import torch.onnx
    from torch.onnx.symbolic_helper import parse_args

    symbolic = parse_args(*_ARGUMENT_KINDS)(_conv_forward)
    torch.onnx.register_custom_op_symbolic(_OP_NAME, symbolic, _FIRST_OPSET)
    _registered = True


def register_if_tracing() -> None:
    """Register when torch.jit is tracing (a cheap check on the custom-op road)."""
    if not torch.compiler.is_compiling() and not _registered and torch._C._is_tracing():
        register()


if "torch.onnx" in sys.modules:  # loaded already: registering costs nothing
    register()
