"""``ppmedia inspect FILE --microbatches N``: how a saved batch would be split and staged.

The arguments are checked before the batch is read (``--config`` exists, ``--model-type`` has an
adapter). The file's format is told from its first bytes, not its name: a ``torch.save`` zip archive
or pickle (read with torch's safe loader, ``weights_only=True``), or a safetensors file; anything else
(a text file, an empty file, a plain pickle, another archive) gets its own reason. Nothing is printed
until the whole report is ready, so a failure prints only its one error line.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import pathlib
import re
import struct
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

from .base import CliError, UsageError, cli_terms, positive_int
from .tables import format_table

__all__ = ["add_arguments", "load_batch", "run"]

#: what every "expected ..." of a bad batch file says.
_EXPECTED = "expected a dict of tensors saved with torch.save or as a .safetensors file"
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTO = 0x80


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a batch: a dict of tensors saved with torch.save, or a .safetensors file")
    parser.add_argument("--microbatches", type=positive_int, required=True, metavar="N",
                        help="microbatches per step, the schedule's n_microbatches (1 to the batch's samples)")
    parser.add_argument("--model-type", metavar="TYPE",
                        help="model type whose adapter counts each sample's placeholder tokens (see 'ppmedia adapters')")
    parser.add_argument("--config", metavar="CONFIG_JSON",
                        help="the model's config.json (default: config.json beside FILE, if there is one)")


# ------------------------------------------------------------------------------------- the batch file
def _read_head(path: pathlib.Path, size: int = 4096) -> bytes:
    if not path.exists():
        raise CliError(f"{path}: no such file")
    if path.is_dir():
        raise CliError(f"{path}: is a directory; {_EXPECTED}")
    if not path.is_file():
        raise CliError(f"{path}: not a regular file; {_EXPECTED}")
    try:
        with path.open("rb") as f:
            return f.read(size)
    except OSError as exc:
        raise CliError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _is_safetensors(head: bytes, file_size: int) -> bool:
    if len(head) < 10:
        return False
    (header_len,) = struct.unpack("<Q", head[:8])
    return head[8:9] == b"{" and 2 <= header_len <= file_size - 8


def _text_excerpt(head: bytes) -> str | None:
    """The first characters of ``head`` when it reads as text, else ``None``."""
    if b"\x00" in head:
        return None
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return None
    if sum(c.isprintable() or c in "\t\r\n" for c in text) < 0.95 * max(len(text), 1):
        return None
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first[:30]


def _not_a_batch(path: pathlib.Path, head: bytes) -> CliError:
    """Why a file that is neither a torch.save file nor safetensors cannot be a batch."""
    if not head:
        return CliError(f"{path}: an empty file (0 bytes); {_EXPECTED}")
    if head.startswith(b"\x93NUMPY"):
        return CliError(f"{path}: a numpy .npy file, not a batch; {_EXPECTED}")
    excerpt = _text_excerpt(head)
    if excerpt is not None:
        with contextlib.suppress(ValueError, OSError):
            if isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
                return CliError(f"{path}: a JSON file, not a batch; {_EXPECTED} (a model's config.json goes to --config)")
        return CliError(f"{path}: a text file (it starts with {json.dumps(excerpt)}), not a batch; {_EXPECTED}")
    start = " ".join(f"{b:02x}" for b in head[:8])
    return CliError(f"{path}: not a torch.save or safetensors file (it starts with bytes {start}); {_EXPECTED}")


#: sentences of torch's load errors that give Python advice (weights_only=False, add_safe_globals, ...).
_TORCH_ADVICE = re.compile(
    r"weights_only|safe_globals|documentation|file an issue|trust|internal miniz error|If you are seeing|"
    r"still be loaded|this error", re.IGNORECASE)


def _without_torch_advice(message: str) -> str:
    """``message`` without the sentences that tell a Python user what to change in their code."""
    sentences = re.split(r"(?<=\.)\s+|\n+", message)
    return " ".join(s.strip() for s in sentences if s.strip() and not _TORCH_ADVICE.search(s)).rstrip(".")


def _unpickling_reason(message: str) -> str:
    """What torch's safe loader refused, from its (long, multi-line) error message."""
    blocked = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"but got <class '([\w.]+)'>", message)
    if blocked:
        name = blocked.group(1)
        advice = (
            "convert numpy arrays with torch.from_numpy before saving, or save as a .safetensors file"
            if name.startswith("numpy.") else
            "re-save the batch with tensors only (torch.save), or as a .safetensors file"
        )
        return (f"the pickle in it needs {name}, which ppmedia does not unpickle (unpickling it could run "
                f"code from the file); expected a dict of tensors: {advice}")
    operand = re.search(r"Unsupported operand (\d+)", message)
    if operand:
        return (f"a plain pickle, not written by torch.save (torch's safe loader stops at pickle opcode "
                f"{operand.group(1)}); {_EXPECTED}")
    detail = _without_torch_advice(message.split("WeightsUnpickler error:", 1)[-1])
    return f"torch's safe loader refused it ({detail or 'no reason given'}); {_EXPECTED}"


def _torch_load(path: pathlib.Path, head: bytes) -> Any:
    import pickle

    import torch

    try:
        with path.open("rb") as f:  # a file object: torch.load would treat a *.safetensors name as safetensors
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CliError(f"{path}: {_unpickling_reason(str(exc))}") from None
    except Exception as exc:  # noqa: BLE001  any unreadable file is the user's input, not our bug
        message = str(exc)
        if "Invalid magic number" in message:
            raise CliError(f"{path}: a plain pickle, not written by torch.save; {_EXPECTED}") from None
        if head.startswith(_ZIP_MAGIC) and ("data.pkl" in message or "not in a subdirectory" in message):
            raise CliError(f"{path}: a zip archive, but not one written by torch.save; {_EXPECTED}") from None
        reason = _without_torch_advice(message) or "no reason given"
        raise CliError(f"{path}: damaged or not a torch.save file ({type(exc).__name__}: {reason}); {_EXPECTED}") from None


def load_batch(path: pathlib.Path) -> dict[str, Any]:
    """The batch saved in ``path``, its format told from its first bytes; :class:`CliError` says why not."""
    head = _read_head(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on pickle protocols: the error line says it all
        if _is_safetensors(head, path.stat().st_size):
            from safetensors.torch import load_file

            try:
                batch: Any = load_file(str(path))
            except Exception as exc:  # noqa: BLE001
                raise CliError(f"{path}: a damaged safetensors file ({type(exc).__name__}: {exc})") from None
        elif head.startswith(_ZIP_MAGIC) or head[:1] == bytes([_PICKLE_PROTO]):
            batch = _torch_load(path, head)
        else:
            raise _not_a_batch(path, head)
    if not isinstance(batch, dict):
        raise CliError(f"{path}: holds a {type(batch).__name__}; expected a dict of str to tensors (the batch)")
    for key in batch:
        if not isinstance(key, str):
            raise CliError(f"{path}: holds a dict with the key {key!r} ({type(key).__name__}); expected str keys such as input_ids")
    return batch


# ------------------------------------------------------------------------------------- the model
@dataclass
class _Model:
    """Who counts placeholder tokens: the adapter, and the config it reads token ids from."""

    model_type: str | None = None
    adapter: Any = None
    config: Any = None
    config_path: pathlib.Path | None = None


def _check_config_argument(args: argparse.Namespace) -> pathlib.Path | None:
    if args.config is None:
        return None
    path = pathlib.Path(args.config)
    if not path.exists():
        raise UsageError(f"argument --config: {path}: no such file")
    if not path.is_file():
        raise UsageError(f"argument --config: {path}: is {'a directory' if path.is_dir() else 'not a regular file'}; expected a config.json file")
    return path


def _adapter_for(model_type: str) -> Any:
    """The adapter serving ``model_type``, or ``None``."""
    import ppmedia
    from ppmedia.registry import UnknownModelTypeError

    try:
        return ppmedia.get_adapter(model_type)
    except UnknownModelTypeError:
        return None


def _known_model_types() -> str:
    import ppmedia

    return ", ".join(sorted(t for info in ppmedia.list_adapters() for t in info.model_types))


def _check_model_type_argument(args: argparse.Namespace) -> Any:
    if args.model_type is None:
        return None
    adapter = _adapter_for(args.model_type)
    if adapter is None:
        raise UsageError(
            f"argument --model-type: no ppmedia adapter for {args.model_type!r}; known model types: "
            f"{_known_model_types()} ('ppmedia adapters' lists them, plugins included)"
        )
    return adapter


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _read_config(path: pathlib.Path, found: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CliError(f"{path}{found}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"{path}{found}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    if not isinstance(data, dict):
        raise CliError(f"{path}{found}: holds a JSON {type(data).__name__}; expected a model config (a JSON object)")
    return data


def _model(args: argparse.Namespace, file: pathlib.Path, config_path: pathlib.Path | None, adapter: Any) -> _Model:
    """The model type, adapter and config, from ``--model-type`` and ``--config`` / config.json beside ``file``."""
    found = ""
    if config_path is None and (file.parent / "config.json").is_file():
        config_path, found = file.parent / "config.json", " (found beside the batch)"
    if config_path is None:
        return _Model(args.model_type, adapter)
    data = _read_config(config_path, found)
    in_file = data.pop("model_type", None)
    if in_file is not None and not isinstance(in_file, str):
        raise CliError(f"{config_path}{found}: model_type is {in_file!r}; expected a string")
    if args.model_type and in_file and getattr(_adapter_for(in_file), "name", None) != adapter.name:
        raise UsageError(
            f"argument --model-type: {args.model_type!r} contradicts model_type {in_file!r} in {config_path}{found}; "
            f"drop --model-type, or pass --config with a {args.model_type} config.json"
        )
    model_type = in_file or args.model_type
    if model_type is None:
        raise CliError(f"{config_path}{found}: no model_type in it; pass --model-type")
    adapter = adapter or _adapter_for(model_type)
    if adapter is None:
        raise CliError(f"{config_path}{found}: model_type {model_type!r} has no ppmedia adapter; known model types: {_known_model_types()}")
    from transformers import AutoConfig

    try:
        with _transformers_quiet():
            config = AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # noqa: BLE001  a config transformers cannot build is the user's file
        raise CliError(f"{config_path}{found}: transformers cannot build a {model_type!r} config from it ({cli_terms(str(exc))})") from None
    return _Model(model_type, adapter, config, config_path)


# ------------------------------------------------------------------------------------- the report
def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"shape {list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return f"a {type(value).__name__}"


def _batch_size(path: pathlib.Path, batch: dict[str, Any], model: _Model) -> int:
    import torch

    import ppmedia

    ids = batch.get("input_ids")
    counting = model.config is not None and not all(k in batch for k in ("n_images_per_sample", "n_videos_per_sample"))
    if ids is None and counting:
        raise CliError(
            f"{path}: no input_ids in the batch; the {model.adapter.name} adapter ({model.model_type}, from "
            f"{model.config_path}) counts each sample's images and videos from the placeholder tokens in "
            f"input_ids (batch keys: {', '.join(batch) or 'none'})"
        )
    if ids is not None:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 and (counting or ids.dim() < 1):
            raise CliError(f"{path}: input_ids: {_describe(ids)}; expected a [samples, tokens] tensor")
        return ids.shape[0]
    for key, value in batch.items():
        if key not in ppmedia.MEDIA_KEYS and isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value.shape[0]
    raise CliError(
        f"{path}: no input_ids (or other [samples, ...] tensor besides the media) to take the number of "
        f"samples from (batch keys: {', '.join(batch) or 'none'})"
    )


_ID_NAME = re.compile(r"(image|video|audio|vision|media|patch|boi|eoi|boa|eoa|frame).*_(token_id|token_index|id)$")


def _default_config(model_type: str) -> Any:
    """transformers' default config for ``model_type`` (the family's reference ids), or ``None``."""
    from transformers import AutoConfig

    try:
        with _transformers_quiet():
            return AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001  remote-code families (kimi_vl, step3_vl) have none
        return None


def _token_ids(config: Any) -> str:
    """The placeholder ids a config holds (``image_token_id 151655, video_token_id 151656``)."""
    found = {}
    for holder in (config, getattr(config, "text_config", None)):
        for name, value in sorted(vars(holder).items()) if holder is not None else ():
            if isinstance(value, int) and not isinstance(value, bool) and _ID_NAME.search(name) and name not in found:
                found[name] = value
    return ", ".join(f"{name} {value}" for name, value in found.items()) or "none found"


def _counting_config(model: _Model) -> tuple[Any, str]:
    """The config to count placeholders with, and the words saying where it comes from."""
    if model.config is not None:
        return model.config, ""
    config = _default_config(model.model_type or "")
    if config is None:
        return None, ""
    return config, (f" (no config.json: transformers' default {model.model_type} config, assuming its ids "
                    f"{_token_ids(config)}; pass --config if the checkpoint's differ)")


def _placeholders(path: pathlib.Path, batch: dict[str, Any], model: _Model) -> tuple[dict[str, Any], Any, str]:
    """Counts to pass to split_media, the placeholder masks, and the line saying where counts come from."""
    import torch

    ids = batch.get("input_ids")
    config, assumed = _counting_config(model) if model.adapter is not None else (None, "")
    if config is None or not isinstance(ids, torch.Tensor):
        if model.adapter is None:
            return {}, None, "no model type (--model-type, --config or a config.json beside the file): counts from the batch only"
        why = (f"transformers has no default {model.model_type} config" if config is None and isinstance(ids, torch.Tensor)
               else "no input_ids" if config is not None else "no input_ids and no config")
        return {}, None, (f"adapter {model.adapter.name} ({model.model_type}); no config.json beside the file and no "
                          f"--config ({why}): counts from the batch only")
    try:
        counts = model.adapter.media_counts(batch, config)
        masks = model.adapter.placeholder_masks(ids, config)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
        message = cli_terms(str(exc.args[0]) if type(exc) is KeyError and exc.args else str(exc))
        named = re.match(r"[A-Za-z_][\w.]*: ", message) is not None  # the message names its key already
        raise CliError(f"{path}: {'' if named else 'input_ids: '}{message}{assumed}") from None
    found = {"images": counts.get("images_per_sample"), "videos": counts.get("videos_per_sample")}
    if "audios_per_sample" in counts or "n_audios_per_sample" in batch:  # a family with audio
        found["audios"] = counts.get("audios_per_sample")
    line = (f"adapter {model.adapter.name} ({model.model_type}){assumed}; per-sample counts from placeholder tokens: "
            + ", ".join(f"{what} {'from the batch' if c is None else c.tolist()}" for what, c in found.items()))
    return counts, masks, line


def _split_error(message: str, model: _Model, counted: bool) -> str:
    """A split's error in command-line terms; it names only the ways out the user has not taken."""
    message = cli_terms(message)
    if model.adapter is not None and model.config is None and not counted:  # --model-type given, nothing to count with
        message = message.replace(
            "a model type (--model-type, --config or a config.json beside the file)",
            f"the model's config.json (--config, or beside the file: there is no default {model.model_type} config)",
        )
    elif counted and model.config is None:
        message += " (counted with transformers' default config: pass --config if the checkpoint's ids differ)"
    return message


def _table(staged: Any, masks: Any) -> str:
    audio = "input_features" in staged.tensors or any(staged.audios)  # the audios column only for batches with audio
    header = ["mb", "samples", "images", "videos", *(["audios"] if audio else []), "image rows", "video rows", "crop rows"]
    if masks is not None:
        header += [f"{m} tokens" for m in masks]
    rows = []
    for k, (a, b) in enumerate(staged.samples):
        row: list[Any] = [k, f"{a}..{b - 1}" if b > a else "-", staged.images[k], staged.videos[k],
                          *([staged.audios[k]] if audio else []), staged.image_rows[k], staged.video_rows[k], staged.crop_rows[k]]
        if masks is not None:
            row += [int(m[a:b].sum()) for m in masks.values()]
        rows.append(row)
    return format_table(header, rows)


def check_microbatches(path: pathlib.Path, batch: dict[str, Any], model: _Model, n: int) -> int:
    """The batch's samples, after refusing ``--microbatches`` larger than that (:class:`UsageError`)."""
    samples = _batch_size(path, batch, model)
    if n > max(samples, 1):
        raise UsageError(
            f"argument --microbatches: got {n} for a batch of {samples} samples in {path}; expected 1..{max(samples, 1)} "
            f"(the schedule's split gives at most one microbatch per sample)"
        )
    return samples


def _report(path: pathlib.Path, batch: dict[str, Any], n: int, model: _Model) -> list[str]:
    import torch

    import ppmedia

    samples = check_microbatches(path, batch, model, n)
    shapes = {k: (list(v.shape), str(v.dtype).replace("torch.", "")) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    counts, masks, counted = _placeholders(path, batch, model)
    try:
        staged = ppmedia.split_media(batch, n, batch_size=samples, **counts)
    except (ValueError, TypeError) as exc:
        raise CliError(f"{path}: {_split_error(str(exc), model, masks is not None)}") from None
    empty = [k for k, (a, b) in enumerate(staged.samples) if a == b]
    text_only = [k for k in range(staged.n_microbatches) if k not in empty and staged.chunk(k) is None]
    summary = (f"{staged.n_microbatches} microbatch{'es' if staged.n_microbatches != 1 else ''} of "
               f"{staged.batch_size} samples; text-only: {text_only or 'none'}")
    return [
        f"{path}: " + ", ".join(f"{k} {s} {d}" for k, (s, d) in shapes.items()),
        counted,
        f"popped: {', '.join(sorted(set(shapes) - set(batch))) or 'nothing'}; left for the schedule: {', '.join(batch)}",
        _table(staged, masks),
        summary + (f"; empty (no samples): {empty}" if empty else ""),
    ]


def load_inputs(args: argparse.Namespace) -> tuple[pathlib.Path, dict[str, Any], _Model]:
    """``FILE``, ``--model-type`` and ``--config`` of ``inspect`` / ``plan``: the arguments checked first
    (:class:`UsageError`), then the batch and its model config loaded (:class:`CliError`)."""
    config_path = _check_config_argument(args)
    adapter = _check_model_type_argument(args)
    path = pathlib.Path(args.file)
    batch = load_batch(path)
    return path, batch, _model(args, path, config_path, adapter)


def run(args: argparse.Namespace) -> int:
    """``ppmedia inspect``: check the arguments, load the batch and its model config, print the split."""
    path, batch, model = load_inputs(args)
    print("\n".join(_report(path, batch, args.microbatches, model)))
    return 0
