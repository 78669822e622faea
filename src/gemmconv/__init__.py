"""gemmconv: convolutions that are matrix products, run as single GEMMs."""

from gemmconv import nn
from gemmconv.convert import ConversionReport, convert, revert
from gemmconv.dispatch import Choice, FindMode, find_mode, set_find_mode, sync_choices
from gemmconv.functional import conv1d, conv2d, conv3d, explain
from gemmconv.memory_format import Layout
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers import SOLVERS, ConvTensors, get_solver, solver_ids
from gemmconv.verify import Verdict, verify

# The one place the version is written: pyproject.toml reads it from here.
__version__ = "0.2.0"

__all__ = [
    "SOLVERS",
    "Choice",
    "ConversionReport",
    "ConvProblem",
    "ConvTensors",
    "FindMode",
    "Direction",
    "Layout",
    "Verdict",
    "__version__",
    "conv1d",
    "conv2d",
    "conv3d",
    "convert",
    "explain",
    "find_mode",
    "get_solver",
    "set_find_mode",
    "nn",
    "revert",
    "solver_ids",
    "sync_choices",
    "verify",
]
