"""What a newcomer reads first: the docstrings of the public API, and the tables that
``explain()`` and ``module.solvers()`` print while keeping their dict access."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import gemmconv
from gemmconv.selection.explanation import slower_than


def _public_objects():
    yield "gemmconv", gemmconv
    for name in gemmconv.__all__:
        obj = getattr(gemmconv, name)
        if callable(obj) or inspect.ismodule(obj):
            yield name, obj
    for name in gemmconv.nn.__all__:
        yield f"nn.{name}", getattr(gemmconv.nn, name)


@pytest.mark.parametrize(("name", "obj"), list(_public_objects()), ids=lambda v: str(v)[:20])
def test_every_public_name_has_a_docstring_of_its_own(name, obj):
    doc = obj.__doc__
    assert doc and doc.strip(), name
    if isinstance(obj, type):
        # Not one inherited from a base (str for the enums), nor a dataclass's signature.
        assert all(doc != base.__doc__ for base in obj.__mro__[1:]), name
        assert not doc.startswith(f"{obj.__name__}("), name


def test_the_functional_docstrings_name_their_torch_counterpart():
    for dims in (1, 2, 3):
        doc = getattr(gemmconv, f"conv{dims}d").__doc__
        assert f"torch.nn.functional.conv{dims}d" in doc and "gemmconv.explain" in doc


def _explained(*shapes, **kwargs):
    x, w = (torch.empty(s) for s in shapes)  # explain reads metadata only
    with gemmconv.find_mode("immediate"):
        return gemmconv.explain(x, w, **kwargs)


def test_explain_prints_a_table_and_keeps_dict_access():
    # One patch per sample: point_output, a GEMM, in every direction on the CPU.
    choices = _explained((4, 3, 16, 16), (16, 3, 16, 16), stride=16)
    assert isinstance(choices, dict) and list(choices) == [
        "forward",
        "backward_data",
        "backward_weights",
    ]
    assert choices["forward"].solver == "point_output"
    text = repr(choices)
    assert str(choices) == text and "{" not in text and "Choice(" not in text
    lines = text.splitlines()
    assert lines[0] == "gemmconv solver choice (mode immediate)"
    assert lines[1].split() == ["direction", "solver", "source", "estimate", "measured", "reason"]
    for direction, choice in choices.items():
        start = next(i for i, line in enumerate(lines) if line.startswith(direction + " "))
        assert lines[start].split()[1:3] == [choice.solver, choice.source]
        assert lines[start].endswith(choice.reason)
        block = lines[start + 1 : start + 1 + len(choice.rejected)]
        for line, (solver_id, reasons) in zip(block, choice.rejected.items()):
            assert line.split()[:3] == [solver_id, "not", "chosen"]
            assert line.endswith("; ".join(reasons))


def test_a_choice_alone_is_a_table_too():
    choice = _explained((4, 3, 16, 16), (16, 3, 16, 16), stride=16)["forward"]
    lines = repr(choice).splitlines()
    assert lines[0].split() == ["solver", "source", "estimate", "measured", "reason"]
    assert lines[1].split()[:2] == ["point_output", "estimate"]
    assert len(lines) == 2 + len(choice.rejected)
    assert str(choice) == f"point_output ({choice.reason})"


def test_module_solvers_print_the_same_table():
    conv = gemmconv.nn.Conv2d(3, 8, kernel_size=4, stride=4)
    with gemmconv.find_mode("immediate"):
        choices = conv.solvers(torch.empty(2, 3, 8, 8))
        expected = gemmconv.explain(torch.empty(2, 3, 8, 8), conv.weight, conv.bias, stride=4)
    assert choices["forward"].solver == expected["forward"].solver
    assert repr(choices) == repr(expected)


def test_no_reason_compares_two_times_that_print_the_same():
    """The ViT-B/16 patch embedding: im2col's and patch's estimates agree to four
    digits in some directions, where '163.4 ms > 163.4 ms' once said nothing."""
    choices = _explained((64, 3, 224, 224), (768, 3, 16, 16), stride=16)
    reasons = [r for c in choices.values() for rs in c.rejected.values() for r in rs]
    compared = [re.search(r"(\S+) ms > (\S+) ms", r) for r in reasons]
    assert any(compared)
    for match in filter(None, compared):
        assert match.group(1) != match.group(2), match.string


def test_a_slower_time_shows_the_digits_that_differ_and_a_tie_says_so():
    assert slower_than("estimate", 163.42, 163.41, "patch") == (
        "estimate 163.42 ms > 163.41 ms of patch"
    )
    assert slower_than("measured", 1.00001, 1.0, "im2col") == (
        "measured 1.00001 ms > 1 ms of im2col"
    )
    assert slower_than("estimate", 2.5, 1.0, "patch") == "estimate 2.5 ms > 1 ms of patch"
    tie = slower_than("estimate", 163.4, 163.4, "patch")
    assert tie.startswith("estimate 163.4 ms, a tie with patch") and "first" in tie


def test_explain_off_cuda_says_what_cuda_would_pick():
    """The README's ViT-B/16 patch embedding: on the CPU the forward runs torch's
    convolution (as fast as a GEMM there); explain() also says what the cost model
    picks for the same call on CUDA, which the README's comment names."""
    choices = _explained((64, 3, 224, 224), (768, 3, 16, 16), stride=16)
    on_cuda = choices.on_cuda
    assert list(on_cuda) == ["forward", "backward_data", "backward_weights"]
    assert choices["forward"].solver == "vendor"
    assert all(choice.solver != "vendor" for choice in on_cuda.values())
    # What the estimate picks on CUDA is the cost model's own choice there, with this
    # machine's CUDA rates (the table's GPU entry on a machine without one).
    from gemmconv.core.problem import ConvProblem
    from gemmconv.selection.dispatch import cuda_rates, decide

    rates = cuda_rates()
    last = repr(choices).splitlines()[-1]
    solvers = ", ".join(f"{d} {c.solver}" for d, c in on_cuda.items())
    assert last == f"On CUDA the estimate (the cost table's {rates.name}) would pick: {solvers}."
    problem = ConvProblem.from_sizes(64, 3, 768, (224, 224), 16, 16, device_type="cuda")
    for direction, choice in on_cuda.items():
        assert choice.solver == decide(problem.with_direction(direction), rates=rates).solver


def test_module_solvers_off_cuda_say_what_cuda_would_pick():
    conv = gemmconv.nn.Conv2d(3, 8, kernel_size=4, stride=4)
    with gemmconv.find_mode("immediate"):
        choices = conv.solvers(torch.empty(2, 3, 8, 8))
    assert set(choices.on_cuda) == {"forward", "backward_data", "backward_weights"}
    assert repr(choices).splitlines()[-1].startswith("On CUDA the estimate")
