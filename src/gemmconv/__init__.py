"""gemmconv: convolutions that are matrix products, run as single GEMMs.

A patch embedding (stride == kernel, no padding), a 1x1 and a strided 1x1 convolution are
matrix products: gemmconv runs each of their directions (forward, backward-data,
backward-weights) as one GEMM, and every other convolution through torch's own, with
torch's arguments, results and output memory format.

- ``conv1d``, ``conv2d``, ``conv3d`` (``gemmconv.functional``) take the arguments of
  ``torch.nn.functional.conv*``; ``explain`` says which solver would run each direction
  of such a call, and why each other would not.
- ``gemmconv.nn.Conv1d``, ``gemmconv.nn.Conv2d`` and ``gemmconv.nn.Conv3d`` are drop-in
  subclasses of torch's modules; ``convert`` swaps them into a model in place and
  ``revert`` swaps them back (``gemmconv.convert``).
- ``Float8Config`` configures the opt-in fp8 mode (``convert(model, fp8=...)``,
  ``module.set_fp8``): the three GEMMs of a patch, point-output or 1x1 convolution in
  fp8 on CUDA devices of compute capability 8.9 and up.
- ``find_mode`` and ``set_find_mode`` choose how a solver is selected (a ``FindMode``);
  ``sync_choices`` gives every rank of a process group the same ``Choice``.
- ``batch_invariant()`` (a context manager), ``set_batch_invariant(True)`` and
  ``$GEMMCONV_BATCH_INVARIANT=1`` make a sample's forward output the same bits whatever
  the batch it runs in; ``explain`` says where a convolution cannot be made so.
- ``SOLVERS`` is the registry of solvers, in the order that breaks ties (``solver_ids``,
  ``get_solver``); ``ConvProblem`` with its ``Direction`` and ``Layout`` describes one
  call, and ``verify`` checks a result for it (``ConvTensors``) against float64,
  returning a ``Verdict``.
- ``decompositions.table()`` maps gemmconv's custom ops to aten convolutions, for
  ``ExportedProgram.run_decompositions``.
"""

from gemmconv import nn
from gemmconv.convert import ConversionReport, convert, revert
from gemmconv.core.float8 import Float8Config
from gemmconv.core.invariance import batch_invariant, set_batch_invariant
from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.core.version import __version__
from gemmconv.functional import conv1d, conv2d, conv3d, explain
from gemmconv.measuring.verify import Verdict, verify
from gemmconv.profiling import ModelProfile, profile

# gemmconv.decompositions.table() is how the README's export recipe names the table.
from gemmconv.roads import decompositions
from gemmconv.selection.dispatch import Choice, FindMode, find_mode, set_find_mode, sync_choices
from gemmconv.solvers import SOLVERS, ConvTensors, get_solver, solver_ids

__all__ = [
    "SOLVERS",
    "Choice",
    "ConversionReport",
    "ConvProblem",
    "ConvTensors",
    "FindMode",
    "Float8Config",
    "Direction",
    "Layout",
    "ModelProfile",
    "Verdict",
    "__version__",
    "batch_invariant",
    "conv1d",
    "decompositions",
    "conv2d",
    "conv3d",
    "convert",
    "explain",
    "find_mode",
    "get_solver",
    "set_batch_invariant",
    "set_find_mode",
    "nn",
    "profile",
    "revert",
    "solver_ids",
    "sync_choices",
    "verify",
]
