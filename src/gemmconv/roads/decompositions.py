"""The three custom ops in terms of aten convolutions: the portable form of a graph.

- ``conv_forward`` -> ``aten.convolution``
- ``conv_backward_data`` -> ``aten.convolution`` transposed, which is the gradient of
  a convolution with respect to its input
- ``conv_backward_weights`` -> ``aten.convolution_backward`` with only the weight's
  gradient asked for (the weight itself is then read for its shape alone)

Under ``torch.export`` gemmconv.functional records the forward in this aten form, so an
exported program (and the ONNX model the dynamo exporter makes of it) holds no
gemmconv op and loads wherever torch does. The functions are not registered as the
ops' CompositeImplicitAutograd kernels: inductor puts every such kernel in its
decomposition table and then refuses the op's fallback ("both a fallback and a decomp
for same op"), which broke torch.compile. A graph that calls the ops themselves is
made portable with ``ep.run_decompositions({**torch.export.default_decompositions(),
**gemmconv.roads.decompositions.table()})``.
"""

from __future__ import annotations

import torch

import gemmconv.roads.ops  # noqa: F401  (defines the ops decomposed here)
from gemmconv.solvers.vendor import transposed_input_gradient, weight_gradient

_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def exporting() -> bool:
    """Whether torch.export is tracing (its default, non-strict mode), the one place
    where the portable graph is wanted. Inside a dynamo trace torch 2.11 folds
    ``is_exporting()`` to True for torch.compile too (a compiled graph then ran
    torch's convolution on the H200), so a dynamo trace never counts as exporting;
    an older torch without the flag keeps the ops everywhere."""
    return _is_exporting() and not torch.compiler.is_dynamo_compiling()


def conv_forward(input, weight, bias, stride, padding, dilation, groups):
    """``gemmconv::conv_forward`` as ``aten.convolution``."""
    no_output_padding = [0] * len(stride)
    return torch.ops.aten.convolution.default(
        input, weight, bias, stride, padding, dilation, False, no_output_padding, groups
    )


# The backward ops' channels_last flag chose gemmconv's problem layout; the aten forms
# choose their own from their operands, so they leave it unread.
def conv_backward_data(
    grad_output, weight, input_size, stride, padding, dilation, groups, channels_last
):
    """``gemmconv::conv_backward_data`` as a transposed ``aten.convolution``."""
    return transposed_input_gradient(
        grad_output, weight, input_size, stride, padding, dilation, groups
    )


def conv_backward_weights(
    grad_output, input, weight_size, stride, padding, dilation, groups, channels_last
):
    """``gemmconv::conv_backward_weights`` as ``aten.convolution_backward``."""
    return weight_gradient(grad_output, input, weight_size, stride, padding, dilation, groups)


def table() -> dict:
    """The ops' aten forms as a decomposition table (op overload -> function)."""
    return {
        torch.ops.gemmconv.conv_forward.default: conv_forward,
        torch.ops.gemmconv.conv_backward_data.default: conv_backward_data,
        torch.ops.gemmconv.conv_backward_weights.default: conv_backward_weights,
    }
