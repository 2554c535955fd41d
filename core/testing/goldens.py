"""Golden files of a tiny family: write them, and check an adapter and a regeneration against them.

A golden folder holds three files:

* ``config.json``: the tiny model's config (``config.to_dict()``, sorted keys);
* ``inputs.safetensors``: the processor-style batch (``input_ids`` and the media keys);
* ``expected.safetensors``: ``inputs_embeds`` ``[B, S, hidden]`` as the model's OWN full-batch forward
  merged them (captured at its decoder stack, ``model.model.language_model`` for most families; ppmedia's
  path is never used to write them).

The same torch and transformers versions regenerate ``config.json`` and ``inputs.safetensors`` byte for
byte (no safetensors metadata, deterministic algorithms on): they are integers, seeded draws and JSON.
``expected.safetensors`` is float arithmetic, and CPUs differ in its last bits, so :func:`check_goldens`
compares a regenerated expected tensor within a tolerance that scales with the tensor
(:func:`regeneration_tolerance`), not byte for byte.

Why a scaled tolerance: rounding differences between CPUs (AMD EPYC against Intel Xeon, or two AMD
models: other vector widths and FMA contraction in the BLAS kernels) are a few units in the last place
(ulps) of the values they touch, and grow with the values' magnitude and with depth. Measured on the
built-in families: 1.4e-9 to 2.4e-8 AMD/Intel on tensors of largest magnitude ~0.1 (up to ~2 ulps of the
largest value), and 1.4e-6 between two AMD models on Inkling, whose largest value is 3.4 (~6 ulps). A
fixed absolute bound (the former 1e-6) is then too loose for small tensors and too tight for large
ones. :data:`REGENERATION_ULPS` = 64 ulps of the tensor's largest magnitude leaves 10x or more over
every measured drift, while a real change (a reordered feature, a wrong merge) moves values by a
sizeable fraction of their magnitude; a change of twice the tolerance fails (``tests/test_goldens.py``).
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

__all__ = ["GOLDEN_FILES", "GOLDEN_MICROBATCHES", "REGENERATION_ULPS", "check_goldens", "config_json", "regeneration_tolerance", "write_goldens"]

#: the files of a golden folder.
GOLDEN_FILES: tuple[str, ...] = ("config.json", "inputs.safetensors", "expected.safetensors")

#: the microbatch counts :func:`check_goldens` splits the golden batch into by default (those up to its
#: samples): 8 puts every sample in a microbatch of its own, which 1, 2 and 4 never do.
GOLDEN_MICROBATCHES: tuple[int, ...] = (1, 2, 4, 8)

#: how far a regenerated ``expected.safetensors`` tensor may be from the file on disk, in units in the
#: last place of the on-disk tensor's largest magnitude (see the module docstring for the reasoning).
#: Configs and inputs must regenerate byte for byte.
REGENERATION_ULPS = 64


def regeneration_tolerance(reference: torch.Tensor, ulps: float = REGENERATION_ULPS) -> float:
    """The largest absolute difference a regenerated copy of ``reference`` may show elementwise:
    ``ulps * eps(dtype) * max|reference|`` (``eps``: the dtype's machine epsilon, so one ulp at 1.0);
    0.0 for an empty or all-zero tensor (those must regenerate exactly)."""
    if reference.numel() == 0:
        return 0.0
    return ulps * torch.finfo(reference.dtype).eps * float(reference.detach().abs().max())

#: the golden files that hold float arithmetic (compared within a tolerance when regenerated).
_FLOAT_FILES = frozenset({"expected.safetensors"})


def config_json(config: Any) -> str:
    """The config as sorted JSON (stable across runs)."""
    return json.dumps(config.to_dict(), sort_keys=True, indent=1, default=str) + "\n"


def write_goldens(family: str | ModuleType, folder: str | pathlib.Path, *, seed: int = 0,
                  adapter: Any = None) -> dict[str, int]:
    """Write ``family``'s golden files into ``folder`` (created); returns each file's size in bytes.

    ``family``: a built-in tiny family name, a plugin's tiny-family module or its dotted name.
    ``adapter`` (instance or class; default: the registry's for the model) says where the family
    merges (``merge_path``): the expected embeddings are captured there.
    """
    from safetensors.torch import save_file

    module = tiny_models.load(family)
    folder = pathlib.Path(folder)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        model = module.build_model(seed)
        batch = module.build_batch(seed)
        resolved = adapter() if isinstance(adapter, type) else adapter
        expected = tiny_models.capture_merged_embeds(model, adapter=resolved, **module.reference_inputs(dict(batch)))
    finally:
        torch.use_deterministic_algorithms(previous)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config_json(model.config))
    tensors = {k: v.contiguous() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    # no safetensors metadata: its header order is not stable, and the files must regenerate byte for byte
    save_file(tensors, str(folder / "inputs.safetensors"))
    save_file({"inputs_embeds": expected.contiguous()}, str(folder / "expected.safetensors"))
    for name in GOLDEN_FILES:  # readable by all, like any checked-in file (safetensors writes 0600)
        (folder / name).chmod(0o644)
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
    microbatches: Iterable[int] | None = None,
    seed: int = 0,
    atol: float = 1e-5,
    regeneration_atol: float | None = None,
    bit_identical: bool = False,
    layouts: Any = None,
    regeneration_ulps: float = REGENERATION_ULPS,
) -> None:
    """Check ``folder``'s golden files of ``family``: they regenerate, and the adapter path
    (:func:`~ppmedia.testing.checks.check_adapter` on the golden inputs) reproduces the expected
    embeddings within ``atol`` for every microbatch count (``microbatches``; default
    :data:`GOLDEN_MICROBATCHES`, 1, 2, 4 and 8, those up to the golden batch's samples).

    Regenerating means: ``config.json`` and ``inputs.safetensors`` byte for byte, and
    ``expected.safetensors`` with the same tensor names, shapes and dtypes and values within
    :func:`regeneration_tolerance` of each on-disk tensor (``regeneration_ulps`` ulps of its largest
    magnitude, default :data:`REGENERATION_ULPS`: CPUs differ in the last bits of float results), or
    within the absolute ``regeneration_atol`` where one is given. ``bit_identical=True`` demands byte equality of the expected tensors too (only on the
    machine that wrote them). ``layouts``: the media layouts to split by (default: the process-wide
    registry's; :class:`~ppmedia.testing.kit.FamilyKit` passes its own, plugins included).

    Raises:
        AssertionError: naming the family and the file (or microbatch) that differs, with the largest
            difference and the tolerance; a missing file says how to write them (:func:`write_goldens`,
            or ``pytest --ppmedia-write-goldens``).
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
        write_goldens(module, tmp, seed=seed, adapter=adapter)
        for file in GOLDEN_FILES:
            fresh, on_disk = pathlib.Path(tmp) / file, folder / file
            if filecmp.cmp(fresh, on_disk, shallow=False):
                continue
            detail = _differences(file, fresh, on_disk)
            if file in _FLOAT_FILES and not bit_identical:
                bound = _within(fresh, on_disk, regeneration_atol, regeneration_ulps)
                if bound is None:
                    continue
                how = f" within {bound}"
            else:
                how = " bit for bit" if bit_identical and file in _FLOAT_FILES else " byte for byte"
            raise AssertionError(f"{name}: {on_disk} does not regenerate{how}: {detail}")
    inputs = load_file(str(folder / "inputs.safetensors"))
    expected = load_file(str(folder / "expected.safetensors"))["inputs_embeds"]
    model = module.build_model(seed)
    if microbatches is None:
        microbatches = [n for n in GOLDEN_MICROBATCHES if n <= inputs["input_ids"].shape[0]]
    check_adapter(module, adapter=adapter, microbatches=microbatches, atol=atol, model=model, batch=inputs, reference=expected,
                  layouts=layouts)


def _within(fresh: pathlib.Path, on_disk: pathlib.Path, atol: float | None, ulps: float) -> str | None:
    """``None`` when both files hold the same tensor names, shapes and dtypes and every value is within
    the tolerance (NaN never is); else the tolerance that was broken, for the message."""
    from safetensors.torch import load_file

    new_t, old_t = load_file(str(fresh)), load_file(str(on_disk))
    if set(new_t) != set(old_t):
        return "the same tensors"
    for key, a in new_t.items():
        b = old_t[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            return "the same shapes and dtypes"
        if not b.is_floating_point():
            bound, what = 0.0, "0 (integers)"
        elif atol is not None:
            bound, what = atol, f"{atol:g}"
        else:
            bound = regeneration_tolerance(b, ulps)
            what = f"{bound:.3g} ({ulps:g} ulps of {key}'s largest value {float(b.abs().max()):.3g})"
        if a.numel() and not bool(((a.double() - b.double()).abs() <= bound).all()):
            return what
    return None
