"""Golden files of a tiny family: write them, and check an adapter and a regeneration against them.

A golden folder holds three files:

* ``config.json``: the tiny model's config (``config.to_dict()``, sorted keys);
* ``inputs.safetensors``: the processor-style batch (``input_ids`` and the media keys);
* ``expected.safetensors``: ``inputs_embeds`` ``[B, S, hidden]`` as the model's OWN full-batch forward
  merged them (captured at ``model.model.language_model``; ppmedia's path is never used to write them).

The same torch and transformers versions regenerate the files bit for bit (no safetensors metadata,
deterministic algorithms on), so :func:`check_goldens` can demand byte equality.
"""

from __future__ import annotations

import filecmp
import json
import pathlib
import tempfile
from types import ModuleType
from typing import Any, Iterable

import torch

from . import tiny_models

__all__ = ["GOLDEN_FILES", "check_goldens", "config_json", "write_goldens"]

#: the files of a golden folder.
GOLDEN_FILES: tuple[str, ...] = ("config.json", "inputs.safetensors", "expected.safetensors")


def config_json(config: Any) -> str:
    """The config as sorted JSON (stable across runs)."""
    return json.dumps(config.to_dict(), sort_keys=True, indent=1, default=str) + "\n"


def write_goldens(family: str | ModuleType, folder: str | pathlib.Path, *, seed: int = 0) -> dict[str, int]:
    """Write ``family``'s golden files into ``folder`` (created); returns each file's size in bytes.

    ``family``: a built-in tiny family name, a plugin's tiny-family module or its dotted name.
    """
    from safetensors.torch import save_file

    module = tiny_models.load(family)
    folder = pathlib.Path(folder)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        model = module.build_model(seed)
        batch = module.build_batch(seed)
        expected = tiny_models.capture_merged_embeds(model, **module.reference_inputs(dict(batch)))
    finally:
        torch.use_deterministic_algorithms(previous)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config_json(model.config))
    tensors = {k: v.contiguous() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    # no safetensors metadata: its header order is not stable, and the files must regenerate bit for bit
    save_file(tensors, str(folder / "inputs.safetensors"))
    save_file({"inputs_embeds": expected.contiguous()}, str(folder / "expected.safetensors"))
    return {name: (folder / name).stat().st_size for name in GOLDEN_FILES}


def _differences(name: str, written: pathlib.Path, on_disk: pathlib.Path) -> str:
    """What differs between two versions of one golden file, for the error message."""
    if name == "config.json":
        new, old = json.loads(written.read_text()), json.loads(on_disk.read_text())
        keys = sorted(k for k in set(new) | set(old) if new.get(k) != old.get(k))
        return f"config keys differ: {', '.join(keys[:8]) or '(formatting only)'}"
    from safetensors.torch import load_file

    new_t, old_t = load_file(str(written)), load_file(str(on_disk))
    if set(new_t) != set(old_t):
        return f"tensors {sorted(old_t)} on disk, {sorted(new_t)} regenerated"
    parts = []
    for key in sorted(new_t):
        a, b = new_t[key], old_t[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            parts.append(f"{key} {list(b.shape)} {b.dtype} on disk, {list(a.shape)} {a.dtype} regenerated")
        elif not torch.equal(a, b):
            parts.append(f"{key} max |diff| {float((a.double() - b.double()).abs().max()):.3g}")
    return "; ".join(parts) or "same tensors, different bytes"


def check_goldens(
    family: str | ModuleType,
    folder: str | pathlib.Path,
    *,
    adapter: Any = None,
    microbatches: Iterable[int] = (1, 2, 4),
    seed: int = 0,
    atol: float = 1e-5,
    bit_identical: bool = True,
) -> None:
    """Check ``folder``'s golden files of ``family``: they regenerate (bit for bit with
    ``bit_identical``, else inputs equal and expected within ``atol``), and the adapter path
    (:func:`~ppmedia.testing.checks.check_adapter` on the golden inputs) reproduces the expected
    embeddings for every microbatch count.

    Raises:
        AssertionError: naming the family and the file (or microbatch) that differs; a missing file
            says how to write them (:func:`write_goldens`, or ``pytest --ppmedia-write-goldens``).
    """
    from safetensors.torch import load_file

    from .checks import check_adapter

    module = tiny_models.load(family)
    name = tiny_models.family_name(module)
    folder = pathlib.Path(folder)
    missing = [f for f in GOLDEN_FILES if not (folder / f).is_file()]
    if missing:
        raise AssertionError(
            f"{name}: no golden {', '.join(missing)} in {folder}; write them with "
            f"ppmedia.testing.write_goldens({name!r}, {str(folder)!r}) or run pytest --ppmedia-write-goldens"
        )
    with tempfile.TemporaryDirectory(prefix="ppmedia-goldens-") as tmp:
        write_goldens(module, tmp, seed=seed)
        for file in GOLDEN_FILES:
            fresh, on_disk = pathlib.Path(tmp) / file, folder / file
            if filecmp.cmp(fresh, on_disk, shallow=False):
                continue
            detail = _differences(file, fresh, on_disk)
            close = file == "expected.safetensors" and _within(fresh, on_disk, atol)
            if bit_identical or not close:
                how = " bit for bit" if bit_identical else f" within atol {atol:g}"
                raise AssertionError(f"{name}: {on_disk} does not regenerate{how}: {detail}")
    inputs = load_file(str(folder / "inputs.safetensors"))
    expected = load_file(str(folder / "expected.safetensors"))["inputs_embeds"]
    model = module.build_model(seed)
    check_adapter(module, adapter=adapter, microbatches=microbatches, atol=atol, model=model, batch=inputs, reference=expected)


def _within(fresh: pathlib.Path, on_disk: pathlib.Path, atol: float) -> bool:
    from safetensors.torch import load_file

    a, b = load_file(str(fresh))["inputs_embeds"], load_file(str(on_disk))["inputs_embeds"]
    return a.shape == b.shape and bool((a - b).abs().max() <= atol)
