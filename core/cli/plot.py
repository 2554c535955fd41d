"""``ppmedia plot LOG.jsonl --out loss.png``: a training log (``--loss-log``'s JSON lines) as a PNG, for
those without TensorBoard: the loss and the held-out loss against the step (top), the learning rate
(bottom). Drawn with Pillow (the ``data`` extra), not matplotlib: nothing else to install."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from .base import CliError, UsageError

__all__ = ["add_arguments", "read_log", "run", "series"]

WIDTH, HEIGHT, MARGIN = 900, 640, 70
COLOURS = {"loss": (31, 119, 180), "eval loss": (214, 39, 40), "lr": (44, 160, 44)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", metavar="LOG.jsonl", help="a --loss-log file (one JSON record per step)")
    parser.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")


def read_log(path: str) -> list[dict[str, Any]]:
    """The log's records; a line that is not a JSON object with a ``step`` is a :class:`CliError` naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror or exc}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{path}:{number}: not JSON ({exc.msg}); expected one record per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise CliError(f"{path}:{number}: expected a JSON object with an integer 'step'")
        records.append(record)
    if not records:
        raise CliError(f"{path}: no records")
    return records


def series(records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """``loss``, ``eval loss`` (a final model's ``final_eval_loss`` at the step after the last) and ``lr``
    as (step, value) points; a resumed run's repeated steps keep their last record."""
    by_step = {int(r["step"]): r for r in records}
    out: dict[str, list[tuple[float, float]]] = {"loss": [], "eval loss": [], "lr": []}
    for step in sorted(by_step):
        r = by_step[step]
        for name, key in (("loss", "loss"), ("eval loss", "eval_loss"), ("lr", "lr")):
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
                out[name].append((step, float(r[key])))
        if isinstance(r.get("final_eval_loss"), (int, float)):
            out["eval loss"].append((step + 1, float(r["final_eval_loss"])))
    return out


def _panel(draw: Any, box: tuple[int, int, int, int], lines: dict[str, list[tuple[float, float]]], title: str,
           steps: tuple[float, float]) -> None:
    x0, y0, x1, y1 = box
    draw.rectangle(box, outline=(0, 0, 0))
    values = [v for points in lines.values() for _, v in points]
    if not values:
        return
    low, high = min(values), max(values)
    high = high if high > low else low + (abs(low) or 1.0)
    s0, s1 = steps[0], steps[1] if steps[1] > steps[0] else steps[0] + 1

    def at(step: float, value: float) -> tuple[float, float]:
        return (x0 + (step - s0) / (s1 - s0) * (x1 - x0), y1 - (value - low) / (high - low) * (y1 - y0))

    for k in range(5):  # value ticks
        value = low + (high - low) * k / 4
        y = at(s0, value)[1]
        draw.line([(x0 - 4, y), (x0, y)], fill=(0, 0, 0))
        draw.text((4, y - 6), f"{value:.3g}", fill=(0, 0, 0))
    legend = x0 + 8
    for name, points in lines.items():
        colour = COLOURS[name]
        xy = [at(s, v) for s, v in points]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for x, y in xy if len(xy) < 60 else ():
            draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colour)
        if points:
            draw.text((legend, y0 + 6), name, fill=colour)
            legend += 8 * len(name) + 16
    draw.text((x0, y0 - 16), title, fill=(0, 0, 0))


def run(args: argparse.Namespace) -> int:
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        raise UsageError("ppmedia plot draws with Pillow: pip install 'ppmedia[data]'") from None
    lines = series(read_log(args.log))
    steps = [s for points in lines.values() for s, _ in points]
    span = (min(steps), max(steps))
    image = Image.new("RGB", (WIDTH, HEIGHT), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    split = MARGIN + (HEIGHT - 2 * MARGIN) * 2 // 3
    _panel(draw, (MARGIN, MARGIN, WIDTH - 20, split - 30), {k: lines[k] for k in ("loss", "eval loss")},
           f"{args.log}: loss", span)
    _panel(draw, (MARGIN, split + 10, WIDTH - 20, HEIGHT - MARGIN), {"lr": lines["lr"]}, "learning rate", span)
    for k in range(5):  # step ticks
        step = span[0] + (span[1] - span[0]) * k / 4
        x = MARGIN + (WIDTH - 20 - MARGIN) * k / 4
        draw.text((x - 6, HEIGHT - MARGIN + 6), f"{step:g}", fill=(0, 0, 0))
    draw.text(((WIDTH - 30) // 2, HEIGHT - MARGIN + 24), "step", fill=(0, 0, 0))
    try:
        image.save(args.out, format="PNG")
    except OSError as exc:
        raise CliError(f"--out {args.out}: {exc.strerror or exc}") from None
    print(f"wrote {args.out}: {len(lines['loss'])} steps, {len(lines['eval loss'])} eval points")
    return 0
