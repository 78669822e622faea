"""Usage errors of the ``gemmconv`` command: one rule for every subcommand.

A bad flag, a bad value or an inconsistent problem is reported as argparse reports
its own errors, ``gemmconv <command>: error: <message>``, in one line on stderr, and
the process exits with status 2. The parsers here raise instead of exiting, so the
caller prints that one line (never argparse's usage block) and picks the status.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

USAGE_EXIT_STATUS = 2


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
    "USAGE_EXIT_STATUS",
    "HelpFormatter",
    "Parser",
    "UsageError",
    "report_usage_error",
    "reports_usage_errors",
]
