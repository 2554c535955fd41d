"""What a training loop reports per step: the loss-log record, its JSON-lines file, the progress display.

:func:`step_record` builds one step's record (the fields of ``examples/train.py --loss-log``);
:class:`LossLog` appends records to a JSON-lines file; :class:`Progress` shows them, as a ``tqdm`` bar
when the stream is a terminal and as one plain line per step otherwise (:func:`format_step`). Call
them on one rank (rank 0): they do no collective.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

__all__ = ["LossLog", "Progress", "format_step", "step_record"]


def step_record(
    step: int,
    *,
    loss: float,
    tokens: int,
    samples: int,
    skipped: int,
    lr: float,
    grad_norm: float,
    step_time_s: float,
    padding_fraction: float,
    eval_loss: float | None = None,
    nonfinite: bool = False,
) -> dict[str, Any]:
    """One step's record: ``step``, ``loss`` (the global batch's mean token loss), ``tokens`` (its label
    tokens), ``samples``, ``skipped`` (samples skipped so far), ``lr``, ``grad_norm`` (before clipping),
    ``step_time_s``, ``tokens_per_s`` (label tokens over the step time), ``padding_fraction`` (pad
    positions / all token positions of the step's rows), and ``eval_loss`` when given."""
    record: dict[str, Any] = {
        "step": int(step), "loss": float(loss), "tokens": int(tokens), "samples": int(samples),
        "skipped": int(skipped), "lr": float(lr), "grad_norm": float(grad_norm),
        "step_time_s": float(step_time_s),
        "tokens_per_s": float(tokens) / step_time_s if step_time_s > 0 else 0.0,
        "padding_fraction": float(padding_fraction),
    }
    if eval_loss is not None:
        record["eval_loss"] = float(eval_loss)
    if nonfinite:
        record["nonfinite"] = True
    return record


def format_step(record: dict[str, Any]) -> str:
    """The plain line of a record: ``step 3: loss 4.631234 lr 0.001 grad norm 1.4816 step 0.21 s
    1234 tokens/s`` (and ``eval loss ...`` when evaluated, ``skipped (not finite)`` for a skipped step)."""
    text = (f"step {record['step']}: loss {record['loss']:.6f} lr {record['lr']:.3g} grad norm "
            f"{record['grad_norm']:.4f} step {record['step_time_s']:.2f} s {record['tokens_per_s']:.0f} tokens/s")
    text += " skipped (not finite)" if record.get("nonfinite") else ""
    return text + (f" eval loss {record['eval_loss']:.6f}" if "eval_loss" in record else "")


class LossLog:
    """Appends one JSON line per record to ``path`` (the file is opened and closed per record, so a
    killed run leaves every finished step's line)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


class Progress:
    """Per-step progress: a ``tqdm`` bar over ``total`` steps from ``start`` when ``stream`` is a terminal
    (``bar=None``) or ``bar=True``, else one :func:`format_step` line per step.

    Args:
        total: the step the run ends at (exclusive).
        start: the first step (a resumed run's).
        stream: where to write (default ``sys.stdout``).
        bar: force the bar (``True``) or plain lines (``False``); ``None`` decides by ``stream.isatty()``.
    """

    def __init__(self, total: int, start: int = 0, *, stream: TextIO | None = None, bar: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        use_bar = self.stream.isatty() if bar is None else bar
        self._bar: Any = None
        if use_bar:
            from tqdm import tqdm  # type: ignore[import-untyped]

            self._bar = tqdm(total=total, initial=start, file=self.stream, unit="step", dynamic_ncols=True)

    def update(self, record: dict[str, Any]) -> None:
        """Show one step's record."""
        if self._bar is None:
            print(format_step(record), file=self.stream, flush=True)
            return
        postfix = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}",
                   "s/step": f"{record['step_time_s']:.2f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
        if "eval_loss" in record:
            postfix["eval"] = f"{record['eval_loss']:.4f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def write(self, message: str) -> None:
        """A message line that does not break the bar."""
        if self._bar is None:
            print(message, file=self.stream, flush=True)
        else:
            self._bar.write(message, file=self.stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
