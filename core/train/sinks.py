"""Where rank 0 sends each step's record besides ``--loss-log``: TensorBoard (``--tensorboard DIR``, the
``tensorboard`` extra) and Weights & Biases (``--wandb PROJECT``, the ``wandb`` extra; ``WANDB_MODE=offline``
logs to ``./wandb`` with no network).

Scalars, one point per step at the step's number: ``train/loss``, ``train/lr``, ``train/grad_norm``,
``train/tokens_per_s``, ``train/padding_fraction``, ``eval/loss`` (on evaluated steps, and the final
model's at the step after the last); W&B also gets ``train/peak_memory_gb`` (rank 0's) and ``train/mfu``.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["SCALARS", "Sinks", "scalars"]

#: the record's field behind each TensorBoard tag
SCALARS: dict[str, str] = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
                           "train/tokens_per_s": "tokens_per_s", "train/padding_fraction": "padding_fraction",
                           "eval/loss": "eval_loss"}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The :data:`SCALARS` a step's record holds, by tag."""
    return {tag: float(record[key]) for tag, key in SCALARS.items() if record.get(key) is not None}


class Sinks:
    """The loggers ``args`` asks for (none: every call does nothing); create on rank 0 only."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.tensorboard: Any = None
        self.wandb: Any = None
        if args.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ValueError(f"--tensorboard {args.tensorboard}: needs the tensorboard package "
                                 f"(pip install 'ppmedia[tensorboard]'): {exc}") from None
            self.tensorboard = SummaryWriter(args.tensorboard)
        if args.wandb:
            try:
                import wandb
            except ImportError as exc:
                raise ValueError(f"--wandb {args.wandb}: needs the wandb package (pip install 'ppmedia[wandb]'): "
                                 f"{exc}") from None
            self.wandb = wandb.init(project=args.wandb, config={k: v for k, v in vars(args).items()
                                                                if isinstance(v, (str, int, float, bool, type(None)))})

    def write(self, record: dict[str, Any]) -> None:
        """One step's points (``record`` as ``pipeline.step_record`` makes it, with the run's extra fields)."""
        step, points = int(record["step"]), scalars(record)
        if self.tensorboard is not None:
            for tag, value in points.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb is not None:
            extra = {"train/mfu": record.get("mfu")}
            if record.get("peak_memory_gb"):
                extra["train/peak_memory_gb"] = record["peak_memory_gb"][0]
            self.wandb.log({**points, **{k: v for k, v in extra.items() if v is not None}}, step=step)

    def final_eval(self, step: int, loss: float) -> None:
        """The final model's held-out loss, at the step after the last."""
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("eval/loss", loss, step)
        if self.wandb is not None:
            self.wandb.log({"eval/loss": loss}, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
