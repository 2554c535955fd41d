"""``ppmedia plan FILE --microbatches N --stages P [--schedule S]``: per-microbatch vision load of a
saved batch, and the predicted step time and bubble with and without balancing.

Loads are the adapter's encoder cost (:meth:`VlmAdapter.image_costs`, in MFLOP) when the model type is
known (``--model-type`` or a ``config.json`` beside the file), else patches. Times come from
``--calibration FILE`` (JSON with the fields of :class:`ppmedia.simulate.Calibration`, in ms, e.g. the
``calibration`` that ``tests/bench/run.py --balance`` writes), else relative units: one stage's text
forward is 1 and the average microbatch's vision forward is ``--vision-share`` of it.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
from typing import Any

from .cli_base import positive_int

__all__ = ["add_arguments", "plan_batch", "run"]


def plan_batch(batch: dict[str, Any], n_microbatches: int, adapter: Any = None, config: Any = None) -> dict[str, Any]:
    """Per-sample costs, the plain and balanced per-microbatch loads and media (images + videos) counts,
    and the balancing permutation."""
    from .balance import balance_microbatches, microbatch_loads, sample_costs
    from .split import split_media

    work = dict(batch)
    kwargs: dict[str, Any] = {}
    if adapter is not None and config is not None and "input_ids" in work:
        kwargs = dict(adapter.media_counts(work, config))
    ids = work.get("input_ids")
    B = ids.shape[0] if ids is not None and ids.dim() else None
    if not B:
        raise ValueError("batch: no input_ids [B, S] to plan for")
    per_sample = split_media(work, B, **kwargs)
    if adapter is not None and config is not None:
        costs = sample_costs(per_sample, per_sample.tensors, functools.partial(adapter.image_costs, config=config)) / 1e6
        unit = "MFLOP"
    else:
        costs, unit = sample_costs(per_sample, per_sample.tensors), "patches"
    permutation = balance_microbatches(costs, n_microbatches)
    images = [float(i + v) for i, v in zip(per_sample.images, per_sample.videos)]
    return {
        "unit": unit,
        "costs": costs.tolist(),
        "permutation": permutation,
        "loads": microbatch_loads(costs, n_microbatches),
        "balanced_loads": microbatch_loads(costs, n_microbatches, permutation),
        "images": microbatch_loads(images, n_microbatches),
        "balanced_images": microbatch_loads(images, n_microbatches, permutation),
    }


def _calibration(path: pathlib.Path) -> Any:
    """``--calibration FILE``: a JSON object with the fields of :class:`ppmedia.simulate.Calibration`."""
    from .cli_base import CliError
    from .simulate import Calibration

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Calibration(**data)
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"argument --calibration: {path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    except (ValueError, TypeError) as exc:
        raise CliError(f"argument --calibration: {path}: not a calibration JSON object ({exc})") from None


def run(args: argparse.Namespace) -> int:
    """``ppmedia plan``: load the batch (as ``inspect`` does), print loads and predicted step times."""
    from .cli_inspect import check_microbatches, load_inputs
    from .simulate import Calibration, predict
    from .tables import format_table

    path, batch, model = load_inputs(args)
    check_microbatches(path, batch, model, args.microbatches)
    adapter, config = model.adapter, model.config
    plan = plan_batch(batch, args.microbatches, adapter, config)
    n, unit = args.microbatches, plan["unit"]
    rows = [(k, f"{plan['images'][k]:.0f}", f"{plan['loads'][k]:.3g}", f"{plan['balanced_images'][k]:.0f}",
             f"{plan['balanced_loads'][k]:.3g}") for k in range(n)]
    print(f"{path}: {len(plan['costs'])} samples, {n} microbatches, {args.stages} stages; vision load in {unit}"
          + (f" ({adapter.name} encoder cost)" if unit == "MFLOP" else " (no model config: linear in patches)"))
    print(format_table(("mb", "media", f"load ({unit})", "media balanced", f"load balanced ({unit})"), rows))
    print(f"balanced order (original sample per position): {plan['permutation']}")
    if args.calibration:
        calibration, time_unit = _calibration(pathlib.Path(args.calibration)), "ms"
        if len(calibration.text_forward) != args.stages:
            raise ValueError(f"{args.calibration}: calibrated for {len(calibration.text_forward)} stages; got --stages {args.stages}")
    else:
        calibration, time_unit = Calibration.relative(plan["loads"], args.stages, args.vision_share), "units"
    predicted: list[tuple[str, ...]] = []
    for schedule in [args.schedule] if args.schedule != "all" else ["gpipe", "1f1b"]:
        plain = predict(schedule, plan["loads"], calibration)
        balanced = predict(schedule, plan["balanced_loads"], calibration)
        predicted.append((schedule, f"{plain.step_time:.4g}", f"{plain.bubble:.3f}", f"{balanced.step_time:.4g}",
                     f"{balanced.bubble:.3f}", f"{balanced.step_time / plain.step_time:.3f}"))
    print(format_table(("schedule", f"step ({time_unit})", "bubble", f"balanced step ({time_unit})",
                        "balanced bubble", "balanced/plain"), predicted))
    if not args.calibration:
        print(f"uncalibrated: a stage's text forward = 1 unit, the mean microbatch's vision = {args.vision_share:g} of it, "
              "backward = 2x forward (pass --calibration for measured costs)")
    return 0


def add_arguments(plan: argparse.ArgumentParser) -> None:
    """``ppmedia plan``'s arguments."""
    plan.add_argument("file", help="a batch saved with torch.save (dict of tensors) or safetensors")
    plan.add_argument("--microbatches", type=positive_int, required=True, metavar="N", help="the schedule's n_microbatches")
    plan.add_argument("--stages", type=positive_int, required=True, metavar="P", help="pipeline stages")
    plan.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "all"), help="schedule (default 1f1b)")
    plan.add_argument("--model-type", help="model type of the adapter (cost model and placeholder counts)")
    plan.add_argument("--config", help="model config.json (default: config.json beside FILE, if any)")
    plan.add_argument("--calibration", help="JSON calibration in ms (text_forward, vision_per_unit, backward_ratio, latency)")
    plan.add_argument("--vision-share", type=float, default=1.0,
                      help="uncalibrated: mean microbatch vision forward / one stage's text forward (default 1)")
