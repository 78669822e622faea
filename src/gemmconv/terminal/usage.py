"""Usage errors of the ``gemmconv`` command: one rule for every subcommand.

A bad flag, a bad value or an inconsistent problem is reported as argparse reports
its own errors, ``gemmconv <command>: error: <message>``, in one line on stderr, and
the process exits with status 2. The parsers here raise instead of exiting, so the
caller prints that one line (never argparse's usage block) and picks the status.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable

USAGE_EXIT_STATUS = 2
# torch holds sizes, strides and seeds in signed 64-bit integers: a larger flag value
# would reach torch only to fail there with a traceback.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_INTEGER_TEXT = re.compile(r"\s*[+-]?[0-9]+(?:_[0-9]+)*\s*")


class UsageError(Exception):
    """A bad flag, a bad value or an inconsistent problem; ``prog`` names the command
    (``"gemmconv conv"``) when the raiser knows it."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's formatter that shows each flag's default, leaving out the defaults
    that say nothing (None, an empty string, False for on/off switches) and those the
    help text already explains."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == "" or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that shows defaults in ``--help`` and raises UsageError."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(message, self.prog)


def int64(text: str) -> int:
    """An argparse ``type`` for integer flags: int(), refusing what does not fit a
    signed 64-bit integer with argparse's one-line error (``argument -n/--batch:
    ...``). Text that is no integer reads "invalid int value", as with ``type=int``."""
    try:
        value = int(text)
    except ValueError:
        # int() also refuses integers of more digits than Python converts (4300).
        if _INTEGER_TEXT.fullmatch(text) is None:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        value = None
    if value is None or not INT64_MIN <= value <= INT64_MAX:
        shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"
        raise argparse.ArgumentTypeError(
            f"{shown}: expected an integer from {INT64_MIN} to {INT64_MAX}"
        )
    return value


def report_usage_error(error: UsageError, prog: str) -> int:
    """Print ``error`` as one line under its command's name; the exit status to use."""
    print(f"{error.prog or prog}: error: {error}", file=sys.stderr)
    return USAGE_EXIT_STATUS


def reports_usage_errors(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorate a command's ``main`` so that a UsageError it raises is reported as one
    line under ``prog`` and becomes its exit status 2."""

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def checked(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except UsageError as e:
                return report_usage_error(e, prog)

        return checked

    return decorate


__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "USAGE_EXIT_STATUS",
    "HelpFormatter",
    "Parser",
    "UsageError",
    "int64",
    "report_usage_error",
    "reports_usage_errors",
]
