"""A Hugging Face checkpoint's safetensors files: which file holds which tensor, and opening only some.

A checkpoint directory holds either one ``model.safetensors`` or shards named
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``, whose ``weight_map``
says which shard holds each tensor. :func:`read_checkpoint_files` reads that map (the index, or the
single file's header); :func:`open_tensors` opens exactly the files that hold the requested tensors
and hands out lazy slices (nothing is read until a slice is indexed). :func:`write_safetensors` and
:func:`write_index` write files in the same format (``{"format": "pt"}`` metadata, as
``save_pretrained`` writes them).

Errors name the file: a missing or unreadable index, a damaged or truncated shard (safetensors checks
that a file's header covers the file exactly), a tensor the index places in a file that lacks it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch

__all__ = [
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "CheckpointFiles",
    "open_tensors",
    "read_checkpoint_files",
    "shard_name",
    "stale_files",
    "write_index",
    "write_safetensors",
]

#: the single-file checkpoint's name (transformers' ``SAFE_WEIGHTS_NAME``).
WEIGHTS_NAME = "model.safetensors"
#: the index of a sharded checkpoint (transformers' ``SAFE_WEIGHTS_INDEX_NAME``).
INDEX_NAME = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass(frozen=True)
class CheckpointFiles:
    """Where a checkpoint's tensors are.

    Attributes:
        directory: the checkpoint directory.
        weight_map: tensor name (the file's own name, e.g. ``model.layers.0.mlp.up_proj.weight``) ->
            file name inside ``directory``.
        index: the index file's path, or ``None`` for a single ``model.safetensors``.
    """

    directory: str
    weight_map: Mapping[str, str]
    index: str | None

    @property
    def files(self) -> tuple[str, ...]:
        """Every file the checkpoint's tensors are in, sorted."""
        return tuple(sorted(set(self.weight_map.values())))

    def files_for(self, names: Iterable[str]) -> dict[str, list[str]]:
        """``file -> [tensor names]`` for ``names`` (each a key of :attr:`weight_map`)."""
        out: dict[str, list[str]] = {}
        for name in names:
            out.setdefault(self.weight_map[name], []).append(name)
        return out


def _safetensors_error() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError

    return (SafetensorError, OSError, ValueError, RuntimeError)


def _damaged(path: str, exc: BaseException) -> ValueError:
    return ValueError(f"{path}: damaged or truncated safetensors file ({type(exc).__name__}: {exc})")


def read_checkpoint_files(directory: str | os.PathLike[str]) -> CheckpointFiles:
    """The tensor -> file map of the checkpoint in ``directory``.

    Reads ``model.safetensors.index.json`` when present (no shard is opened), else the header of
    ``model.safetensors``.

    Raises:
        FileNotFoundError: ``directory`` holds neither file.
        ValueError: the index is not JSON with a ``weight_map`` of names to file names (naming the
            index), or the single file is damaged (naming it).
    """
    directory = os.fspath(directory)
    index = os.path.join(directory, INDEX_NAME)
    single = os.path.join(directory, WEIGHTS_NAME)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from exc
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and os.path.basename(v) == v for k, v in weight_map.items()
        ):
            raise ValueError(f"{index}: weight_map must map tensor names to file names in {directory}")
        return CheckpointFiles(directory, dict(weight_map), index)
    if os.path.isfile(single):
        from safetensors import safe_open

        try:
            with safe_open(single, framework="pt") as fh:
                names = list(fh.keys())
        except _safetensors_error() as exc:
            raise _damaged(single, exc) from exc
        return CheckpointFiles(directory, dict.fromkeys(names, WEIGHTS_NAME), None)
    raise FileNotFoundError(
        f"{directory}: no {WEIGHTS_NAME} or {INDEX_NAME} (a safetensors checkpoint written by "
        f"save_pretrained; .bin checkpoints are not supported)"
    )


@contextlib.contextmanager
def open_tensors(checkpoint: CheckpointFiles, names: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Open exactly the files holding ``names``; yield ``name -> lazy slice`` (``slice[...]`` reads it).

    The files stay open (memory-mapped) inside the ``with`` block and are closed after it.

    Raises:
        KeyError: a name is not in the checkpoint's map.
        FileNotFoundError: a file the map names does not exist.
        ValueError: a file is damaged or truncated, or lacks a tensor the map places in it (naming
            the file and the tensor).
    """
    from safetensors import safe_open

    wanted = list(names)
    unknown = [n for n in wanted if n not in checkpoint.weight_map]
    if unknown:
        raise KeyError(f"{checkpoint.directory}: no tensor {unknown[0]!r} in the checkpoint's files")
    with contextlib.ExitStack() as stack:
        slices: dict[str, Any] = {}
        for file, file_names in sorted(checkpoint.files_for(wanted).items()):
            path = os.path.join(checkpoint.directory, file)
            if not os.path.isfile(path):
                where = f"listed in {checkpoint.index}" if checkpoint.index else "expected"
                raise FileNotFoundError(f"{path}: {where} for {file_names[0]!r}, but it does not exist")
            try:
                handle = stack.enter_context(safe_open(path, framework="pt"))
                present = set(handle.keys())
                for name in file_names:
                    if name not in present:
                        raise ValueError(f"{path}: has no tensor {name!r}, which {checkpoint.index} places in it")
                    slices[name] = handle.get_slice(name)
            except _safetensors_error() as exc:
                if isinstance(exc, ValueError) and str(exc).startswith(path):
                    raise
                raise _damaged(path, exc) from exc
        yield slices


def shard_name(number: int, total: int) -> str:
    """``model-0000K-of-0000N.safetensors`` (1-based ``number``), or ``model.safetensors`` when ``total`` is 1."""
    return WEIGHTS_NAME if total == 1 else f"model-{number:05d}-of-{total:05d}.safetensors"


def write_safetensors(path: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` to ``path`` with ``{"format": "pt"}`` metadata.

    Tensors go to the CPU and are made contiguous; views sharing one storage (e.g. experts unfused from
    one tensor) are copied apart, since a safetensors file cannot alias.
    """
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    save_file(out, path, metadata={"format": "pt"})


def write_index(directory: str, weight_map: Mapping[str, str], total_size: int, total_parameters: int) -> str:
    """Write ``model.safetensors.index.json`` as ``save_pretrained`` does; returns its path."""
    path = os.path.join(directory, INDEX_NAME)
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path


def stale_files(directory: str, keep: Iterable[str]) -> list[str]:
    """Weight files in ``directory`` from an earlier save (shards or single file, and an index) not in ``keep``."""
    kept = set(keep)
    out = []
    for name in sorted(os.listdir(directory)):
        weights = name == WEIGHTS_NAME or _SHARD.fullmatch(name) is not None or name == INDEX_NAME
        if weights and name not in kept and os.path.isfile(os.path.join(directory, name)):
            out.append(os.path.join(directory, name))
    return out
