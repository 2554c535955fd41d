"""``ppmedia plan FILE --microbatches N --stages P [--schedule S] [--timeline FILE.svg]``: per-microbatch
vision load of a saved batch, the predicted step time and bubble with and without balancing, and
where the vision work should run.

Loads are the adapter's encoder cost (:meth:`VlmAdapter.image_costs`, in MFLOP) when the model type is
known (``--model-type`` or a ``config.json`` beside the file), else patches. Times come from
``--calibration FILE`` (JSON with the fields of :class:`ppmedia.planning.simulate.Calibration`, in ms, e.g. the
``calibration`` that ``tests/bench/run.py --balance`` writes), else relative units: one stage's text
forward is 1 and the average microbatch's vision forward is ``--vision-share`` of it.

With a model config, the placement of the vision work (:func:`ppmedia.planning.stepmodel.compare_placements`):
(a) on stage 0 with the uniform split, (b) on stage 0 with the best static ``layers_per_stage`` for
this batch, (c) spread over the pipeline ranks (``encoder="spread"``) with the uniform split, (d)
spread with its best split; predicted from per-operation costs (a ``--calibration`` file with the fields
of :class:`ppmedia.planning.stepmodel.OpCosts`, in seconds, as ``tests/bench/run.py --stage0`` writes it, else
the config's FLOPs), with the recommendation; ``--timeline FILE.svg`` draws their predicted timelines.
``--stages`` is the number of pipeline ranks there (a schedule with 2 stages per rank has twice as many).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from .base import UsageError, non_negative_float, positive_int
from ..planning.loads import plan_batch

__all__ = ["add_arguments", "plan_batch", "run"]


def _calibration(path: pathlib.Path) -> Any:
    """``--calibration FILE``: a JSON object with the fields of :class:`ppmedia.planning.simulate.Calibration`,
    or of :class:`ppmedia.planning.stepmodel.OpCosts` (per-operation costs, in seconds)."""
    from .base import CliError
    from ..planning.simulate import Calibration
    from ..planning.stepmodel import OpCosts

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "layer_forward" in data:
            return OpCosts.from_dict(data)
        return Calibration(**data)
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"argument --calibration: {path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    except (ValueError, TypeError) as exc:
        raise CliError(f"argument --calibration: {path}: not a calibration JSON object ({exc})") from None


def run(args: argparse.Namespace) -> int:
    """``ppmedia plan``: load the batch (as ``inspect`` does), print loads and predicted step times."""
    from .inspect_batch import check_microbatches, load_inputs
    from ..planning.simulate import Calibration, predict
    from .tables import format_table

    path, batch, model = load_inputs(args)
    check_microbatches(path, batch, model, args.microbatches)
    adapter, config = model.adapter, model.config
    check_stages(args.stages, config)
    plan = plan_batch(batch, args.microbatches, adapter, config)
    n, unit = args.microbatches, plan["unit"]
    rows = [(k, f"{plan['images'][k]:.0f}", f"{plan['loads'][k]:.3g}", f"{plan['balanced_images'][k]:.0f}",
             f"{plan['balanced_loads'][k]:.3g}") for k in range(n)]
    print(f"{path}: {len(plan['costs'])} samples, {n} microbatches, {args.stages} stages; vision load in {unit}"
          + (f" ({adapter.name} encoder cost)" if unit == "MFLOP" else " (no model config: linear in patches)"))
    print(format_table(("mb", "media", f"load ({unit})", "media balanced", f"load balanced ({unit})"), rows))
    print(f"balanced order (original sample per position): {plan['permutation']}")
    costs = None
    if args.calibration:
        calibration, time_unit = _calibration(pathlib.Path(args.calibration)), "ms"
        if not isinstance(calibration, Calibration):
            costs, calibration = calibration, _as_calibration(calibration, config, args.stages)
        if len(calibration.text_forward) != args.stages:
            raise ValueError(f"{args.calibration}: calibrated for {len(calibration.text_forward)} stages; got --stages {args.stages}")
    else:
        calibration, time_unit = Calibration.relative(plan["loads"], args.stages, args.vision_share), "units"
    predicted: list[tuple[str, ...]] = []
    schedules = [args.schedule] if args.schedule != "all" else ["gpipe", "1f1b"]
    for schedule in [s for s in schedules if s in ("gpipe", "1f1b")]:
        plain = predict(schedule, plan["loads"], calibration)
        balanced = predict(schedule, plan["balanced_loads"], calibration)
        predicted.append((schedule, f"{plain.step_time:.4g}", f"{plain.bubble:.3f}", f"{balanced.step_time:.4g}",
                     f"{balanced.bubble:.3f}", f"{balanced.step_time / plain.step_time:.3f}"))
    print(format_table(("schedule", f"step ({time_unit})", "bubble", f"balanced step ({time_unit})",
                        "balanced bubble", "balanced/plain"), predicted))
    if not args.calibration:
        print(f"uncalibrated: a stage's text forward = 1 unit, the mean microbatch's vision = {args.vision_share:g} of it, "
              "backward = 2x forward (pass --calibration for measured costs)")
    _placements(args, batch, plan, config, costs, schedules)
    return 0


def _as_calibration(costs: Any, config: Any, n_stages: int) -> Any:
    """The balancing table's per-stage :class:`~ppmedia.planning.simulate.Calibration` (uniform split, ms) of
    per-operation costs."""
    from ..pipeline import default_layer_split
    from ..planning.simulate import Calibration

    layers = default_layer_split(_num_layers(config) or n_stages, n_stages)
    forward = [n * costs.layer_forward + (costs.first_forward if s == 0 else 0) + (costs.last_forward if s == n_stages - 1 else 0)
               for s, n in enumerate(layers)]
    backward = [n * costs.layer_bwd + (costs.first_backward if s == 0 else 0) + (costs.last_backward if s == n_stages - 1 else 0)
                for s, n in enumerate(layers)]
    ratio = [b / f if f > 0 else 2.0 for f, b in zip(forward, backward)]
    return Calibration([f * 1e3 for f in forward], costs.vision_forward * 1e3, ratio, costs.latency * 1e3)


def check_stages(n_stages: int, config: Any) -> None:
    """``--stages`` against the model's decoder layers: with more than ``layers + 2`` stages some stage
    between the first (embedding, vision) and the last (head) holds nothing at all, whatever the split
    (and an optimizer over it fails). Refused before anything is printed (exit 2)."""
    layers = _num_layers(config)
    if layers is not None and n_stages > layers + 2:
        raise UsageError(
            f"argument --stages: got {n_stages} for a model of {layers} decoder layers; expected at most {layers + 2} "
            f"(the first and last stage besides one stage per layer: more leave a stage with nothing to run)"
        )


def _num_layers(config: Any) -> int | None:
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "num_hidden_layers", None)
    return int(value) if value else None


def _placements(args: argparse.Namespace, batch: dict[str, Any], plan: dict[str, Any], config: Any, costs: Any,
                schedules: list[str]) -> None:
    """Where the vision work should run: the four placements per schedule, the recommendation, and
    ``--timeline``'s picture (of the first schedule)."""
    from ..planning.stepmodel import OpCosts, compare_placements
    from .tables import format_table
    from ..planning.timeline import write_svg

    num_layers = _num_layers(config)
    if num_layers is None:
        print("vision placement: needs the model config (decoder layers, widths): pass --config or --model-type with a config.json")
        return
    ids = batch["input_ids"]
    if costs is None:
        costs = OpCosts.from_config(config, max(1, ids.shape[0] // args.microbatches), ids.shape[1])
    scale, unit = (1e3, "ms") if costs.unit == "s" else (1.0, costs.unit)
    pictures = []
    for schedule in schedules:
        options, best = compare_placements(schedule, costs, plan["loads"], n_ranks=args.stages, num_layers=num_layers)
        base = options[0].step_time
        print(f"vision placement, {schedule} on {args.stages} ranks ({num_layers} decoder layers; "
              + ("calibrated" if args.calibration else "FLOPs of the config, uncalibrated") + "):")
        print(format_table(("placement", "layers", f"step ({unit})", "bubble", "vs (a)"),
                           [(o.label, "+".join(map(str, o.layers_per_stage)), f"{o.step_time * scale:.4g}", f"{o.bubble:.3f}",
                             f"{o.step_time / base:.3f}" if base > 0 else "-") for o in options]))
        print(f"recommended for {schedule}: {best.label} (layers_per_stage={best.layers_per_stage}"
              + (", encoder='spread')" if best.encoder == "spread" else ")"))
        pictures.append([o.timeline for o in options])
    if args.timeline:
        write_svg(args.timeline, [[t] for t in pictures[0]], f"{args.file}: predicted step, {schedules[0]}, {args.stages} ranks")
        print(f"wrote {args.timeline}")


def _schedule(value: str) -> str:
    """``--schedule``: ``all``, or a schedule name in any case (its canonical spelling)."""
    from ..pipeline.schedules import schedule_argument, schedule_choices

    if value.lower() == "all":
        return "all"
    name = schedule_argument(value)
    if name not in schedule_choices():
        raise argparse.ArgumentTypeError(f"got {value!r}; expected all or one of {', '.join(schedule_choices())}")
    return name


def add_arguments(plan: argparse.ArgumentParser) -> None:
    """``ppmedia plan``'s arguments."""
    plan.add_argument("file", help="a batch saved with torch.save (dict of tensors) or safetensors")
    plan.add_argument("--microbatches", type=positive_int, required=True, metavar="N", help="the schedule's n_microbatches")
    plan.add_argument("--stages", type=positive_int, required=True, metavar="P", help="pipeline stages")
    plan.add_argument("--schedule", default="1f1b", type=_schedule, metavar="NAME",
                      help="gpipe, 1f1b, all (both), or any torch schedule name (default 1f1b; the balancing "
                           "table covers gpipe and 1f1b)")
    plan.add_argument("--model-type", help="model type of the adapter (cost model and placeholder counts)")
    plan.add_argument("--config", help="model config.json (default: config.json beside FILE, if any)")
    plan.add_argument("--calibration", help="JSON calibration in ms (text_forward, vision_per_unit, backward_ratio, latency)")
    plan.add_argument("--timeline", metavar="FILE.svg", help="draw the predicted timelines of the vision placements here")
    plan.add_argument("--vision-share", type=non_negative_float, default=1.0,
                      help="uncalibrated: mean microbatch vision forward / one stage's text forward (default 1)")
