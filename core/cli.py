"""The ``ppmedia`` command line: ``demo``, ``adapters``, ``inspect``, ``plan``.

Bad arguments and bad files end with a one-line ``ppmedia: error: ...`` and a non-zero exit status,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any, Sequence

from .tables import format_table

__all__ = ["main"]


class _Fail(Exception):
    """A user-facing error: printed as one line, exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"ppmedia: error: {message} (see 'ppmedia {self.prog.split()[-1]} --help')\n"
                  if " " in self.prog else f"ppmedia: error: {message} (see 'ppmedia --help')\n")


# ------------------------------------------------------------------------------------- adapters
def cmd_adapters(args: argparse.Namespace) -> int:
    import ppmedia
    from ppmedia.registry import default_registry

    rows = [(i.name, ", ".join(i.model_types), i.layout, i.provider) for i in ppmedia.list_adapters()]
    print(format_table(("adapter", "model types", "layout", "provider"), rows))
    aliases = default_registry().aliases()
    if aliases:
        print("\naliases: " + ", ".join(f"{a} -> {t}" for a, t in sorted(aliases.items())))
    return 0


# ------------------------------------------------------------------------------------- inspect
def _load_batch(path: pathlib.Path) -> dict[str, Any]:
    import torch

    if not path.is_file():
        raise _Fail(f"{path}: no such file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            batch: Any = load_file(str(path))
        else:
            batch = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # any unreadable file is the user's input, not our bug
        raise _Fail(f"{path}: cannot read a batch ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    if not isinstance(batch, dict) or not all(isinstance(k, str) for k in batch):
        raise _Fail(f"{path}: holds a {type(batch).__name__}; expected a dict of str to tensors")
    return batch


def _load_config(path: pathlib.Path | None, model_type: str | None) -> Any:
    if path is None or not path.is_file():
        return None
    from transformers import AutoConfig

    try:
        data = json.loads(path.read_text())
        kind = data.pop("model_type", None) or model_type
        return AutoConfig.for_model(kind, **data)
    except Exception as exc:
        raise _Fail(f"{path}: cannot read a model config ({type(exc).__name__}: {exc})")


def cmd_inspect(args: argparse.Namespace) -> int:
    import torch

    import ppmedia

    path = pathlib.Path(args.file)
    batch = _load_batch(path)
    config_path = pathlib.Path(args.config) if args.config else path.parent / "config.json"
    if args.config and not config_path.is_file():
        raise _Fail(f"{config_path}: no such file")
    config = _load_config(config_path, args.model_type)
    model_type = args.model_type or (config.model_type if config is not None else None)
    adapter = ppmedia.get_adapter(model_type) if model_type else None
    shapes = {k: (list(v.shape), str(v.dtype).replace("torch.", "")) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    print(f"{path}: " + ", ".join(f"{k} {s} {d}" for k, (s, d) in shapes.items()))
    counts: dict[str, Any] = {}
    if adapter is not None and config is not None and isinstance(batch.get("input_ids"), torch.Tensor):
        images, videos = adapter.media_per_sample(batch["input_ids"], config)
        if "n_images_per_sample" not in batch:
            counts["images_per_sample"] = images
        if "n_videos_per_sample" not in batch:
            counts["videos_per_sample"] = videos
        print(f"adapter {adapter.name} ({model_type}); per-sample counts from placeholder tokens: "
              f"images {images.tolist()}, videos {videos.tolist()}")
    elif model_type:
        print(f"adapter {adapter.name} ({model_type}); no config.json beside the file: counts from the batch only")
    input_ids = batch.get("input_ids")
    staged = ppmedia.split_media(batch, args.microbatches, **counts)
    print(f"popped: {', '.join(sorted(set(shapes) - set(batch))) or 'nothing'}; left for the schedule: {', '.join(batch)}")
    header = ["mb", "samples", "images", "videos", "image rows", "video rows", "crop rows"]
    masks = None
    if adapter is not None and config is not None and isinstance(input_ids, torch.Tensor):
        masks = adapter.placeholder_masks(input_ids, config)
        header += [f"{m} tokens" for m in masks]
    rows = []
    for k, (a, b) in enumerate(staged.samples):
        row: list[Any] = [k, f"{a}..{b - 1}" if b > a else "-", staged.images[k], staged.videos[k],
                          staged.image_rows[k], staged.video_rows[k], staged.crop_rows[k]]
        if masks is not None:
            row += [int(m[a:b].sum()) for m in masks.values()]
        rows.append(row)
    print(format_table(header, rows))
    text_only = [k for k in range(staged.n_microbatches) if staged.chunk(k) is None]
    print(f"{staged.n_microbatches} microbatches of {staged.batch_size} samples; text-only: {text_only or 'none'}")
    return 0


# ------------------------------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo
    from .testing import parity

    code = demo.run(args)
    if parity.launched_by_torchrun():
        parity.exit_worker(code)  # this process was a gloo worker: skip the teardown (see exit_worker)
    return code


def build_parser() -> argparse.ArgumentParser:
    from .testing.tiny_models import FAMILIES

    parser = _Parser(prog="ppmedia", description="Pipeline-parallel media staging for vision-language models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="the main job: tiny seeded VLMs through a real 2-process pipeline, parity-checked")
    demo.add_argument("--family", default="all", choices=("all", *FAMILIES), help="model family (default: all)")
    demo.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    demo.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved"), help="pipeline schedule")
    demo.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    demo.set_defaults(func=cmd_demo)

    adapters = sub.add_parser("adapters", help="list registered adapters (plugins included)")
    adapters.set_defaults(func=cmd_adapters)

    inspect = sub.add_parser("inspect", help="show how a saved batch would be split and staged")
    inspect.add_argument("file", help="a batch saved with torch.save (dict of tensors) or safetensors")
    inspect.add_argument("--microbatches", type=int, required=True, help="the schedule's n_microbatches")
    inspect.add_argument("--model-type", help="model type of the adapter to count placeholders with")
    inspect.add_argument("--config", help="model config.json (default: config.json beside FILE, if any)")
    inspect.set_defaults(func=cmd_inspect)

    from .plan import add_parser as add_plan_parser  # ppmedia plan (core/plan.py)

    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ppmedia`` console script; returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except _Fail as exc:
        print(f"ppmedia: error: {exc}", file=sys.stderr)
    except (ValueError, TypeError, KeyError, RuntimeError, OSError) as exc:
        message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        print(f"ppmedia: error: {type(exc).__name__}: {message.splitlines()[0] if message else ''}", file=sys.stderr)
    except KeyboardInterrupt:
        print("ppmedia: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
