"""gemmconv: convolutions that are matrix products, run as single GEMMs."""

from gemmconv import nn
from gemmconv.convert import ConversionReport, convert, revert
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
    "Direction",
    "Layout",
    "ModelProfile",
    "Verdict",
    "__version__",
    "conv1d",
    "decompositions",
    "conv2d",
    "conv3d",
    "convert",
    "explain",
    "find_mode",
    "get_solver",
    "set_find_mode",
    "nn",
    "profile",
    "revert",
    "solver_ids",
    "sync_choices",
    "verify",
]
