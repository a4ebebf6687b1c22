"""A user's mistake on the command line: the one type every subcommand raises for it, the
parser that raises it instead of printing its usage block, and the argument types that
several commands share."""

from __future__ import annotations

import argparse
import sys

from skippy.topology.errors import UserError


class UsageError(UserError):
    """A mistake in what the user asked for; printed as one line."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints the whole usage block
        raise UsageError(message)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def runtime_arg(name: str):
    """--runtime NAME: its descriptor (stages/runtime_kind.py), resolved here, once."""
    from skippy.stages.runtime_kind import UnknownRuntime, runtime_kind
    try:
        return runtime_kind(name)
    except UnknownRuntime as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def runtime_names() -> str:
    from skippy.stages.runtime_kind import RUNTIMES
    return ", ".join(RUNTIMES)


def port_arg(text: str) -> int:
    """--port N: a TCP port."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, not {text}")
    return port


def weight_format(runtime, fmt: str | None) -> str:
    """--weight-format for `runtime` (a descriptor): the format asked for, or the one it
    serves with untold; UsageError for one it cannot hold."""
    from skippy.stages.runtime import StageError
    fmt = fmt or runtime.serve_format
    try:
        runtime.check_weight_format(fmt)
    except StageError as e:
        raise UsageError(f"--weight-format: {e}") from None
    return fmt
