"""The ``ppmedia`` command: ``demo``, ``inspect``, ``plan`` and the other subcommands.

:mod:`ppmedia.cli.commands` holds the command table (:data:`COMMANDS`) and the entry point; :mod:`.base` the
``Command`` record and the two errors; one module per subcommand beside them (``inspect_batch``, ``plan``,
``demo``) and ``tables`` for their text tables.
"""

from .base import CliError, Command, UsageError, cli_terms, one_line, positive_int
from .commands import COMMANDS, build_parser, main

__all__ = [
    "COMMANDS",
    "CliError",
    "Command",
    "UsageError",
    "build_parser",
    "cli_terms",
    "main",
    "one_line",
    "positive_int",
]
