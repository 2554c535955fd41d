"""What every ``ppmedia`` subcommand shares: the :class:`Command` entry, its errors and argument types.

A subcommand module imports from here (not from :mod:`ppmedia.cli`, which imports the subcommands).
"""

from __future__ import annotations

import argparse
import re
import unicodedata
from dataclasses import dataclass
from typing import Callable

__all__ = ["CliError", "Command", "UsageError", "cli_terms", "one_line", "positive_int"]


class CliError(Exception):
    """A failure the user can fix in their files: printed as one ``ppmedia: error:`` line, exit 1."""

    exit_status = 1


class UsageError(CliError):
    """An argument that is wrong (possibly only in the light of the files it names): exit 2."""

    exit_status = 2


@dataclass(frozen=True)
class Command:
    """One subcommand of ``ppmedia``.

    Attributes:
        name: the subcommand (``ppmedia NAME ...``).
        help: one line for ``ppmedia --help``.
        add_arguments: adds the subcommand's arguments to its ``argparse`` parser.
        run: runs it on the parsed arguments; returns the exit status. Raises :class:`CliError` or
            :class:`UsageError` for a failure the user can fix.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def positive_int(text: str) -> int:
    """``argparse`` type: an integer >= 1 (``--microbatches 0`` is an argparse error, exit 2)."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {value}; expected an integer >= 1")
    return value


def non_negative_float(text: str) -> float:
    """``argparse`` type: a finite number >= 0 (``--vision-share -1`` is an argparse error, exit 2)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a number >= 0") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"got {value:g}; expected a finite number >= 0")
    return value


_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")

#: Python names a command-line user never set, and what they are called on the command line.
_CLI_TERMS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r" or (image|video)s_per_sample=\s*\(e\.g\. an adapter's media_per_sample\(input_ids, config\)\)"),
     r", or a model type (--model-type, --config or a config.json beside the file) to count the \1 "
     r"placeholder tokens in input_ids"),
    (re.compile(r"\s*\((?:e\.g\. )?an adapter's media_per_sample(?:\(input_ids, config\))?\)"), ""),
    (re.compile(r"\b(image|video)s_per_sample=?"), r"the \1 counts taken from the placeholder tokens in input_ids"),
    (re.compile(r"\bn_microbatches\b"), "--microbatches"),
    (re.compile(r"; pass batch_size=?"), ""),
    (re.compile(r"\bbefore (?:ppmedia\.)?split_media\b"), "before saving it"),
    (re.compile(r"\bweights_only=\w+"), "a safe load"),
)


def cli_terms(message: str) -> str:
    """``message`` (a library error) with Python argument names replaced by command-line terms."""
    for pattern, replacement in _CLI_TERMS:
        message = pattern.sub(replacement, message)
    return message


def one_line(text: str) -> str:
    """``text`` as one line: ANSI codes removed, whitespace runs collapsed, control characters escaped."""
    text = " ".join(_ANSI.sub("", text).split())
    return "".join(c if unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}" for c in text)
