"""The testing kit in one object per family: what the pytest fixture ``ppmedia_kit`` hands out.

::

    llava = ppmedia_kit.family("my_plugin.tiny", plugins=["my_plugin"])
    llava.check_adapter(microbatches=[1, 2, 4])          # split -> stage -> consume -> merge vs the model
    llava.check_goldens("tests/goldens/llava")           # golden files regenerate; the adapter matches them
    llava.check_pipeline_parity(["gpipe", "1f1b"])      # real 2-process pipeline vs the model's own loss/grads
    llava.check_stage_splits([(1, 1), (2, 0)])           # stage modules in one process vs the model's grads

A :class:`FamilyKit` builds the tiny model, batch and reference once and keeps them.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from . import tiny_models
from .checks import AdapterMismatch, MicrobatchCheck, capture_reference, check_adapter
from .goldens import REGENERATION_ULPS, check_goldens, write_goldens

if TYPE_CHECKING:
    from ..adapters.base import VlmAdapter
    from ..registry import AdapterRegistry
    from .parity import ParityReport, Scenario
    from .stages import StageSplitCheck

__all__ = ["FamilyKit", "Kit", "check_pipeline_parity"]


@contextlib.contextmanager
def _plugins_in_environment(plugins: Sequence[str]) -> Iterator[None]:
    """Name ``plugins`` in ``PPMEDIA_PLUGINS`` (read by every new registry, so by spawned workers)."""
    from ..registry import PLUGINS_ENV_VAR

    before = os.environ.get(PLUGINS_ENV_VAR)
    names = [n for n in (before or "").split(",") if n.strip()]
    os.environ[PLUGINS_ENV_VAR] = ",".join(names + [p for p in plugins if p not in names])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PLUGINS_ENV_VAR, None)
        else:
            os.environ[PLUGINS_ENV_VAR] = before


def check_pipeline_parity(
    family: str | ModuleType | Sequence[str | ModuleType],
    scenarios: Iterable[str | Scenario] = ("gpipe", "1f1b"),
    *,
    plugins: Sequence[str] = (),
    steps: int = 1,
    n_microbatches: int = 4,
    seed: int = 0,
    tolerance: float = 1e-5,
    world_size: int = 2,
    rtol: float = 0.0,
) -> ParityReport:
    """Run ``family`` through a real multi-process pipeline (:func:`ppmedia.testing.parity.run_parity`:
    gloo on 127.0.0.1, ``world_size`` spawned processes) and compare loss and every gradient with the
    model's own full-batch forward.

    Args:
        family: a built-in name, or a plugin's tiny-family module or dotted name (the workers import it
            by name, so it must be importable from ``sys.path``); or a list of them, run in ONE set of
            worker processes (starting a pair costs seconds).
        scenarios: ``"schedule[/shapes]"`` strings or :class:`~ppmedia.testing.parity.Scenario`.
        plugins: dotted names of plugin modules the workers load (``PPMEDIA_PLUGINS``), for a plugin
            that is importable but not installed; an installed plugin is found by its entry point.
        steps, n_microbatches, seed, tolerance, world_size, rtol: as for ``run_parity`` (``rtol``: a
            relative bound beside the absolute ``tolerance``, for families with large gradients).

    Returns:
        The report (``report.format()`` prints it).

    Raises:
        AssertionError: a scenario missed ``tolerance``, or a worker failed; the message names the
            family and carries the report or the worker's error.
    """
    from .parity import ParityError, run_parity

    families = [family] if isinstance(family, (str, ModuleType)) else list(family)
    names = [tiny_models.family_name(f) for f in families]
    name = ", ".join(names)
    with _plugins_in_environment(plugins):
        try:
            report = run_parity(
                names, scenarios, steps=steps, n_microbatches=n_microbatches, seed=seed,
                tolerance=tolerance, world_size=world_size, rtol=rtol,
            )
        except ParityError as exc:
            raise AssertionError(f"{name}: pipeline parity run failed: {exc}") from exc
    if not report.ok:
        raise AssertionError(f"{name}: pipeline parity failed (tolerance {tolerance:g}, rtol {rtol:g})\n{report.format()}")
    return report


class FamilyKit:
    """The kit for one tiny family, with its model, batch and reference built once.

    Args:
        family: a built-in tiny family name, a plugin's tiny-family module or its dotted name.
        plugins: dotted names of plugin modules to register (here and in parity workers) when the
            plugin is not installed; an installed one is found through its entry point anyway.
        adapter: the adapter to check (instance or class); default: the registry's for the model.
        seed: the model and batch seed.
        write_goldens: :meth:`check_goldens` (re)writes the files before checking them.
    """

    def __init__(
        self,
        family: str | ModuleType,
        *,
        plugins: Sequence[str] = (),
        adapter: Any = None,
        seed: int = 0,
        write_goldens: bool = False,
    ) -> None:
        self.module = tiny_models.load(family)
        self.name = tiny_models.family_name(self.module)
        self.plugins = tuple(plugins)
        self.seed = seed
        self._adapter = adapter
        self._write_goldens = write_goldens

    def __repr__(self) -> str:
        return f"FamilyKit({self.name!r}, plugins={list(self.plugins)!r}, seed={self.seed})"

    @cached_property
    def registry(self) -> AdapterRegistry:
        """A registry of its own: built-ins, installed plugins, plus :attr:`plugins`."""
        from ..registry import AdapterRegistry

        registry = AdapterRegistry()
        for name in self.plugins:
            registry.register_module(name, f"{name} (FamilyKit plugins)")
        return registry

    @cached_property
    def model(self) -> torch.nn.Module:
        """The tiny model (float32, eval mode)."""
        return self.module.build_model(self.seed)

    @cached_property
    def batch(self) -> dict[str, Tensor]:
        """The tiny processor-style batch (never modified: checks split copies of it)."""
        return self.module.build_batch(self.seed)

    @cached_property
    def _captured(self) -> tuple[Tensor, Tensor | None]:
        return capture_reference(self.model, adapter=self.adapter, **self.module.reference_inputs(dict(self.batch)))

    @property
    def reference(self) -> Tensor:
        """The model's own merged ``inputs_embeds`` ``[B, S, hidden]`` for :attr:`batch`."""
        return self._captured[0]

    @property
    def positions(self) -> Tensor | None:
        """The ``position_ids`` the model gave its language model (Qwen's mrope ``[3, B, S]``), or ``None``."""
        return self._captured[1]

    @cached_property
    def adapter(self) -> VlmAdapter:
        """The adapter under test (the one given, else :attr:`registry`'s for the model)."""
        if self._adapter is not None:
            return self._adapter() if isinstance(self._adapter, type) else self._adapter
        return self.registry.get(self.model)

    def check_adapter(self, microbatches: Iterable[int] = (1, 2, 4), *, atol: float = 1e-5) -> list[MicrobatchCheck]:
        """:func:`~ppmedia.testing.checks.check_adapter` on this family's model, batch and reference,
        then on each batch of the family's optional ``build_batches`` (against its own reference)."""
        counts = list(microbatches)
        layouts = self.registry.media_layouts()
        out = check_adapter(
            self.module, adapter=self.adapter, microbatches=counts, atol=atol,
            model=self.model, batch=self.batch, reference=self.reference, positions=self.positions,
            layouts=layouts,
        )
        for k, more in enumerate(tiny_models.more_batches(self.module, self.seed)):
            ok = [n for n in counts if n <= more["input_ids"].shape[0]]
            try:
                out += check_adapter(self.module, adapter=self.adapter, microbatches=ok, atol=atol, model=self.model,
                                     batch=more, layouts=layouts)
            except AdapterMismatch as exc:
                raise AdapterMismatch(f"batch {k + 1} of build_batches: {exc}", exc.family, exc.n_microbatches,
                                      exc.microbatch) from exc
        return out

    def write_goldens(self, folder: str | pathlib.Path) -> dict[str, int]:
        """:func:`~ppmedia.testing.goldens.write_goldens` for this family and seed."""
        return write_goldens(self.module, folder, seed=self.seed, adapter=self.adapter)

    def check_goldens(
        self, folder: str | pathlib.Path, *, microbatches: Iterable[int] | None = None, atol: float = 1e-5,
        regeneration_atol: float | None = None, bit_identical: bool = False, regeneration_ulps: float = REGENERATION_ULPS,
    ) -> None:
        """:func:`~ppmedia.testing.goldens.check_goldens` (after writing them with ``write_goldens``)."""
        if self._write_goldens:
            self.write_goldens(folder)
        check_goldens(
            self.module, folder, adapter=self.adapter, microbatches=microbatches, seed=self.seed, atol=atol,
            regeneration_atol=regeneration_atol, bit_identical=bit_identical, layouts=self.registry.media_layouts(),
            regeneration_ulps=regeneration_ulps,
        )

    def check_stage_splits(self, splits: Iterable[Sequence[int]], *, n_microbatches: int = 4, atol: float = 1e-5) -> list[StageSplitCheck]:
        """:func:`~ppmedia.testing.stages.check_stage_splits` on this family's model and batch (the
        model's gradients are cleared after each run)."""
        from .stages import check_stage_splits

        return check_stage_splits(
            self.module, splits, adapter=self.adapter, n_microbatches=n_microbatches, atol=atol,
            model=self.model, batch=self.batch,
        )

    def check_pipeline_parity(self, scenarios: Iterable[str | Scenario] = ("gpipe", "1f1b"), **kwargs: Any) -> ParityReport:
        """:func:`check_pipeline_parity` for this family, its plugins and seed (``kwargs``: steps, ...)."""
        kwargs.setdefault("seed", self.seed)
        return check_pipeline_parity(self.module, scenarios, plugins=self.plugins, **kwargs)


class Kit:
    """What the ``ppmedia_kit`` fixture gives: :meth:`family` makes (and caches) :class:`FamilyKit` objects."""

    def __init__(self, *, write_goldens: bool = False) -> None:
        self.write_goldens = write_goldens
        self._families: dict[tuple[str, tuple[str, ...], int], FamilyKit] = {}

    def family(self, family: str | ModuleType, *, plugins: Sequence[str] = (), adapter: Any = None, seed: int = 0) -> FamilyKit:
        """The :class:`FamilyKit` of ``family``; the same object for the same arguments (unless
        ``adapter`` is given), so the model is built once per test session."""
        if adapter is not None:
            return FamilyKit(family, plugins=plugins, adapter=adapter, seed=seed, write_goldens=self.write_goldens)
        key = (tiny_models.family_name(family), tuple(plugins), seed)
        if key not in self._families:
            self._families[key] = FamilyKit(family, plugins=plugins, seed=seed, write_goldens=self.write_goldens)
        return self._families[key]
