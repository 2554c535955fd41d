"""The ``ppmedia`` command line: ``demo``, ``adapters``, ``inspect``, ``plan``, ``train``, ``plot``.

Subcommands are the entries of :data:`COMMANDS`: a name, a help line, a function adding its
arguments to its parser and a function running it. Adding a subcommand is adding an entry (its two
functions may live in their own module; import heavy dependencies inside ``run``).

Exit status: 0 on success; 2 when the command line is wrong (argparse's errors, and arguments that
contradict the files they name, reported as :class:`UsageError`); 1 when a file or the batch in it
cannot be used (:class:`CliError`, or a library error relayed in command-line terms). Every failure
is exactly one ``ppmedia: error: ...`` line on stderr, with no traceback and no warning before it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from typing import Iterator, Sequence

from . import inspect_batch as cli_inspect
from . import plan
from . import plot as cli_plot
from . import train as cli_train
from .base import CliError, Command, UsageError, cli_terms, one_line, positive_int
from .tables import format_table

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


# ------------------------------------------------------------------------------------- demo
#: samples in every tiny batch the demo runs (see ppmedia.testing.parity).
_DEMO_BATCH_SIZE = 8


def family_argument(value: str) -> str:
    """``--family``'s type: ``all``, a built-in tiny family, or the dotted name of a plugin's tiny-family
    module (``my_plugin.tiny``, imported now: the workers import it by name too)."""
    from ..testing import tiny_models

    if value == "all" or value in tiny_models.FAMILIES:
        return value
    choices = f"all, {', '.join(tiny_models.FAMILIES)}, or a plugin's tiny-family module such as my_plugin.tiny"
    if "." not in value:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {choices})")
    try:
        tiny_models.load(value)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from None
    return value


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--family", action="append", type=family_argument, metavar="FAMILY",
        help="model family: all (default), a built-in one (see 'ppmedia adapters'), or the dotted name of a "
             "plugin's tiny-family module (my_plugin.tiny; its plugin installed, or named in PPMEDIA_PLUGINS); "
             "repeatable: --family A --family B runs both, in that order",
    )
    parser.add_argument("--microbatches", type=positive_int, default=4, help="microbatches per step (default 4)")
    from ..pipeline.schedules import schedule_argument, schedule_choices

    choices = schedule_choices()
    parser.add_argument(
        "--schedule", default="1f1b", type=schedule_argument, choices=choices, metavar="SCHEDULE",
        help=f"pipeline schedule, case-insensitive: {', '.join(choices)} (default 1f1b)",
    )
    parser.add_argument("--steps", type=positive_int, default=2, help="training steps (default 2)")
    parser.add_argument("--pp", type=positive_int, default=2, help="pipeline ranks (default 2)")
    parser.add_argument("--dp", type=positive_int, default=1, help="data-parallel replicas of the pipeline (default 1)")


def run_demo(args: argparse.Namespace) -> int:
    if _DEMO_BATCH_SIZE % args.dp:
        raise UsageError(
            f"argument --dp: got {args.dp}; the demo's tiny batches have {_DEMO_BATCH_SIZE} samples, shared "
            f"equally by the replicas: use 1, 2, 4 or 8"
        )
    per_replica = _DEMO_BATCH_SIZE // args.dp
    if per_replica % args.microbatches:
        divisors = [d for d in range(1, per_replica + 1) if per_replica % d == 0]
        raise UsageError(
            f"argument --microbatches: got {args.microbatches}; the demo's tiny batches have {per_replica} "
            f"samples{' per replica' if args.dp > 1 else ''} and the schedules need equal microbatches: use "
            + (f"{', '.join(map(str, divisors[:-1]))} or {divisors[-1]}" if len(divisors) > 1 else "1")
        )
    from . import demo
    from ..testing import parity

    code = demo.run(args)
    if parity.launched_by_torchrun():
        parity.exit_worker(code)  # this process was a gloo worker: skip the teardown (see exit_worker)
    return code


# ------------------------------------------------------------------------------------- adapters
def add_adapters_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no arguments


def run_adapters(args: argparse.Namespace) -> int:
    import ppmedia
    from ppmedia.registry import default_registry

    rows = [(i.name, ", ".join(i.model_types), i.layout, i.provider) for i in ppmedia.list_adapters()]
    print(format_table(("adapter", "model types", "layout", "provider"), rows))
    aliases = default_registry().aliases()
    if aliases:
        print("\naliases: " + ", ".join(f"{a} -> {t}" for a, t in sorted(aliases.items())))
    layouts = [(layout.name, layout.modality, "; ".join(
                    part for part in (", ".join(layout.requires), layout.optional and f"optional: {', '.join(layout.optional)}")
                    if part), provider)
               for layout, provider in default_registry().list_layouts()]
    print("\nmedia layouts (what split_media selects by the batch's keys):")
    print(format_table(("layout", "modality", "keys", "provider"), layouts))
    return 0


# ------------------------------------------------------------------------------------- registration
#: The subcommands, in ``ppmedia --help`` order.
COMMANDS: list[Command] = [
    Command("demo", "the main job: tiny seeded VLMs through a real 2-process pipeline, parity-checked",
            add_demo_arguments, run_demo),
    Command("adapters", "list registered adapters (plugins included)", add_adapters_arguments, run_adapters),
    Command("inspect", "show how a saved batch would be split and staged", cli_inspect.add_arguments, cli_inspect.run),
    Command("plan", "per-microbatch vision load and predicted step time, with and without balancing",
            plan.add_arguments, plan.run),
    Command("train", "train from a YAML file of training options (pp x dp x tp processes via torchrun)",
            cli_train.add_arguments, cli_train.run),
    Command("plot", "a training log (--loss-log) as a PNG: loss, eval loss and lr against steps",
            cli_plot.add_arguments, cli_plot.run),
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]  # one line, no usage dump
        _report(message, self.prog)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The ``ppmedia`` parser with one subparser per entry of :data:`COMMANDS`."""
    parser = _Parser(prog="ppmedia", description="Pipeline-parallel media staging for vision-language models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    for command in COMMANDS:
        command_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(command_parser)
        command_parser.set_defaults(run=command.run)
    return parser


# ------------------------------------------------------------------------------------- errors
def _report(message: str, prog: str | None = None) -> None:
    hint = f" (see '{prog} --help')" if prog else ""
    sys.stderr.write(f"ppmedia: error: {one_line(message)}{hint}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def _warnings_held() -> Iterator[list[warnings.WarningMessage]]:
    """Hold the warnings raised while a command runs: shown after a success, dropped on a failure."""
    with warnings.catch_warnings(record=True) as caught:
        yield caught


def _show(caught: list[warnings.WarningMessage]) -> None:
    for w in caught:
        sys.stderr.write(f"ppmedia: warning: {one_line(f'{w.category.__name__}: {w.message}')}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ppmedia`` console script; returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no advisory log lines before an error
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a bad argument (2, already reported)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        with _warnings_held() as caught:
            status = int(args.run(args) or 0)
    except CliError as exc:
        _report(str(exc), f"ppmedia {args.command}" if isinstance(exc, UsageError) else None)
        return exc.exit_status
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, OSError) as exc:
        message = str(exc.args[0]) if type(exc) is KeyError and exc.args else str(exc)
        _report(cli_terms(message) or type(exc).__name__)
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("ppmedia: interrupted\n")
        return 130
    except Exception as exc:  # noqa: BLE001  a bug: still one line; PPMEDIA_DEBUG=1 shows the traceback
        if os.environ.get("PPMEDIA_DEBUG"):
            raise
        _report(f"unexpected {type(exc).__name__}: {exc} (a bug in ppmedia or a plugin; PPMEDIA_DEBUG=1 shows the traceback)")
        return 1
    _show(caught)
    return status


if __name__ == "__main__":
    sys.exit(main())
