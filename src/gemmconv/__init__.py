"""gemmconv: convolutions that are matrix products, run as single GEMMs."""

from gemmconv.dispatch import Choice
from gemmconv.functional import conv1d, conv2d, conv3d, explain
from gemmconv.memory_format import Layout
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers import SOLVERS, ConvTensors, get_solver, solver_ids
from gemmconv.verify import Verdict, verify

__version__ = "0.1.0"

__all__ = [
    "SOLVERS",
    "Choice",
    "ConvProblem",
    "ConvTensors",
    "Direction",
    "Layout",
    "Verdict",
    "__version__",
    "conv1d",
    "conv2d",
    "conv3d",
    "explain",
    "get_solver",
    "solver_ids",
    "verify",
]
