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

__all__ = ["add_parser", "cmd_plan", "plan_batch"]


def _load(path: pathlib.Path) -> dict[str, Any]:
    import torch

    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            batch: Any = load_file(str(path))
        else:
            batch = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # an unreadable file is the user's input
        raise ValueError(f"{path}: cannot read a batch ({type(exc).__name__})") from None
    if not isinstance(batch, dict) or not all(isinstance(k, str) for k in batch):
        raise ValueError(f"{path}: holds a {type(batch).__name__}; expected a dict of str to tensors")
    return batch


def _config(path: pathlib.Path | None, model_type: str | None) -> Any:
    if path is None or not path.is_file():
        return None
    from transformers import AutoConfig

    data = json.loads(path.read_text())
    return AutoConfig.for_model(data.pop("model_type", None) or model_type, **data)


def plan_batch(batch: dict[str, Any], n_microbatches: int, adapter: Any = None, config: Any = None) -> dict[str, Any]:
    """Per-sample costs, the plain and balanced per-microbatch loads and media (images + videos) counts,
    and the balancing permutation."""
    from .balance import balance_microbatches, microbatch_loads, sample_costs
    from .split import split_media

    work = dict(batch)
    kwargs: dict[str, Any] = {}
    if adapter is not None and config is not None and "input_ids" in work:
        images, videos = adapter.media_per_sample(work["input_ids"], config)
        if "n_images_per_sample" not in work:
            kwargs["images_per_sample"] = images
        if "n_videos_per_sample" not in work:
            kwargs["videos_per_sample"] = videos
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


def cmd_plan(args: argparse.Namespace) -> int:
    from .balance import MICROBATCH_ORDERS  # noqa: F401  (documents the default order)
    from .registry import get_adapter
    from .simulate import Calibration, predict
    from .tables import format_table

    if args.microbatches < 1 or args.stages < 1:
        raise ValueError(f"--microbatches {args.microbatches} --stages {args.stages}: expected both >= 1")
    path = pathlib.Path(args.file)
    batch = _load(path)
    config_path = pathlib.Path(args.config) if args.config else path.parent / "config.json"
    if args.config and not config_path.is_file():
        raise ValueError(f"{config_path}: no such file")
    config = _config(config_path, args.model_type)
    model_type = args.model_type or (config.model_type if config is not None else None)
    adapter = get_adapter(model_type) if model_type else None
    plan = plan_batch(batch, args.microbatches, adapter, config)
    n, unit = args.microbatches, plan["unit"]
    rows = [(k, f"{plan['images'][k]:.0f}", f"{plan['loads'][k]:.3g}", f"{plan['balanced_images'][k]:.0f}",
             f"{plan['balanced_loads'][k]:.3g}") for k in range(n)]
    print(f"{path}: {len(plan['costs'])} samples, {n} microbatches, {args.stages} stages; vision load in {unit}"
          + (f" ({adapter.name} encoder cost)" if unit == "MFLOP" else " (no model config: linear in patches)"))
    print(format_table(("mb", "media", f"load ({unit})", "media balanced", f"load balanced ({unit})"), rows))
    print(f"balanced order (original sample per position): {plan['permutation']}")
    if args.calibration:
        data = json.loads(pathlib.Path(args.calibration).read_text())
        calibration, time_unit = Calibration(**data), "ms"
        if len(calibration.text_forward) != args.stages:
            raise ValueError(f"{args.calibration}: calibrated for {len(calibration.text_forward)} stages; got --stages {args.stages}")
    else:
        calibration, time_unit = Calibration.relative(plan["loads"], args.stages, args.vision_share), "units"
    rows = []
    for schedule in [args.schedule] if args.schedule != "all" else ["gpipe", "1f1b"]:
        plain = predict(schedule, plan["loads"], calibration)
        balanced = predict(schedule, plan["balanced_loads"], calibration)
        rows.append((schedule, f"{plain.step_time:.4g}", f"{plain.bubble:.3f}", f"{balanced.step_time:.4g}",
                     f"{balanced.bubble:.3f}", f"{balanced.step_time / plain.step_time:.3f}"))
    print(format_table(("schedule", f"step ({time_unit})", "bubble", f"balanced step ({time_unit})",
                        "balanced bubble", "balanced/plain"), rows))
    if not args.calibration:
        print(f"uncalibrated: a stage's text forward = 1 unit, the mean microbatch's vision = {args.vision_share:g} of it, "
              "backward = 2x forward (pass --calibration for measured costs)")
    return 0


def add_parser(sub: Any) -> None:
    """Register ``plan`` on the ``ppmedia`` subcommand parsers."""
    plan = sub.add_parser("plan", help="per-microbatch vision load and predicted step time, with and without balancing")
    plan.add_argument("file", help="a batch saved with torch.save (dict of tensors) or safetensors")
    plan.add_argument("--microbatches", type=int, required=True, help="the schedule's n_microbatches")
    plan.add_argument("--stages", type=int, required=True, help="pipeline stages")
    plan.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "all"), help="schedule (default 1f1b)")
    plan.add_argument("--model-type", help="model type of the adapter (cost model and placeholder counts)")
    plan.add_argument("--config", help="model config.json (default: config.json beside FILE, if any)")
    plan.add_argument("--calibration", help="JSON calibration in ms (text_forward, vision_per_unit, backward_ratio, latency)")
    plan.add_argument("--vision-share", type=float, default=1.0,
                      help="uncalibrated: mean microbatch vision forward / one stage's text forward (default 1)")
    plan.set_defaults(func=cmd_plan)
