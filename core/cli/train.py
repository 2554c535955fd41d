"""``ppmedia train CONFIG.yaml [--option value ...]``: training from a YAML file of the training options
(:mod:`ppmedia.train.config`), launched with ``torch.distributed.run`` (:mod:`ppmedia.train.launch`), or
``--dry-run``: every rank's bytes, built on meta from the checkpoint's ``config.json`` alone."""

from __future__ import annotations

import argparse

from .base import UsageError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG.yaml",
                        help="training options as YAML keys (batch_size or batch-size); 'python -m ppmedia.train "
                             "--help' lists them; launcher keys: nproc_per_node, nnodes, rdzv_endpoint, rdzv_id, "
                             "local_addr")
    parser.add_argument("options", nargs=argparse.REMAINDER, metavar="--option value",
                        help="training options overriding the file's (--dry-run: print the bytes per rank, train nothing)")


def run(args: argparse.Namespace) -> int:
    from ..train import config as train_config
    from ..train import launch

    try:
        config = train_config.load_config(args.config, list(args.options))
    except train_config.ConfigError as exc:
        raise UsageError(str(exc)) from None
    if config.args.dry_run:
        from ..train import dryrun

        print(dryrun.report(config.args))
        return 0
    return launch.launch(config)
