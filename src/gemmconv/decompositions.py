"""The three custom ops in terms of aten convolutions, for exported programs.

A program from ``torch.export`` keeps the ``gemmconv::`` ops, so it runs gemmconv's
solvers, and loading it needs gemmconv imported. ``ep.run_decompositions()`` (and the
ONNX exporter, which runs it) replaces them by the aten ops below, so the program
loads and runs anywhere torch does, and ONNX gets a standard Conv node:

- ``conv_forward`` -> ``aten.convolution``
- ``conv_backward_data`` -> ``aten.convolution`` transposed, which is the gradient of
  a convolution with respect to its input
- ``conv_backward_weights`` -> ``aten.convolution_backward`` with only the weight's
  gradient asked for (the weight itself is then read for its shape alone)

Each is registered as the op's CompositeImplicitAutograd kernel in the Python
dispatcher, the kernel torch.export's default decomposition table picks up for a
custom op. Tracers outside export (torch.compile, make_fx, fake tensors, flop
counters) consult that kernel too; for them it declines (returns NotImplemented), so
their graphs keep gemmconv's ops and the speed of its solvers. Under export, fake
tensors also take the forward's output metadata from its aten form, whose shapes and
strides are the fake implementation's except for a 1-D problem with a transposed
weight (channels-last from torch's CPU convolution, contiguous from gemmconv).
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey

import gemmconv.ops  # noqa: F401  (defines the ops decomposed here)

# Whether the op is being traced by torch.export, the one place where the portable
# graph is wanted (``ep.run_decompositions()`` and ONNX export included). An older
# torch without the flag keeps the ops everywhere.
_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _forward(input, weight, bias, stride, padding, dilation, groups):
    if not _exporting():
        return NotImplemented
    no_output_padding = [0] * len(stride)
    return torch.ops.aten.convolution.default(
        input, weight, bias, stride, padding, dilation, False, no_output_padding, groups
    )


# The backward ops' channels_last flag chose gemmconv's problem layout; the aten forms
# choose their own from their operands, so they leave it unread.
def _backward_data(
    grad_output, weight, input_size, stride, padding, dilation, groups, channels_last
):
    if not _exporting():
        return NotImplemented
    # The transposed convolution's output size is fixed up to the input positions the
    # forward's stride skipped at the far end; output_padding adds them back (always
    # fewer than the stride, as aten requires).
    kernel = weight.shape[2:]
    output_padding = [
        s - ((o - 1) * u - 2 * p + d * (r - 1) + 1)
        for s, o, r, u, p, d in zip(
            input_size[2:], grad_output.shape[2:], kernel, stride, padding, dilation
        )
    ]
    return torch.ops.aten.convolution.default(
        grad_output, weight, None, stride, padding, dilation, True, output_padding, groups
    )


def _backward_weights(
    grad_output, input, weight_size, stride, padding, dilation, groups, channels_last
):
    if not _exporting():
        return NotImplemented
    # convolution_backward reads the weight only for its shape when it computes just
    # the weight's gradient; an uninitialised tensor of that shape (as small as the
    # result) stands in for it.
    shape_only_weight = grad_output.new_empty(weight_size)
    no_output_padding = [0] * len(stride)
    _, grad_weight, _ = torch.ops.aten.convolution_backward.default(
        grad_output, input, shape_only_weight, None, stride, padding, dilation, False,
        no_output_padding, groups, [False, True, False],
    )  # fmt: skip
    return grad_weight


_DECOMPOSITIONS = {
    torch.ops.gemmconv.conv_forward.default: _forward,
    torch.ops.gemmconv.conv_backward_data.default: _backward_data,
    torch.ops.gemmconv.conv_backward_weights.default: _backward_weights,
}
for _op, _decomposition in _DECOMPOSITIONS.items():
    _op.py_impl(DispatchKey.CompositeImplicitAutograd)(_decomposition)
