"""Staging: hang one batch's split media on the first stage for exactly one schedule step."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ..chunk import CURSOR_ATTRIBUTE, EXTRAS_ATTRIBUTE, STAGED_ATTRIBUTES
from .staged import StagedMedia

__all__ = ["stage_media"]

_INFRA = "_prepare_forward_infra"


def _resolve(target: Any) -> tuple[torch.nn.Module, Any | None]:
    if isinstance(target, torch.nn.Module):
        return target, None
    submod = getattr(target, "submod", None)
    if isinstance(submod, torch.nn.Module):
        if getattr(target, "is_first", True) is False:
            raise ValueError(
                f"stage_media: got pipeline stage {getattr(target, 'stage_index', '?')}, which is not the "
                f"first stage; expected the first stage (media are consumed there)"
            )
        return submod, target
    raise TypeError(
        f"stage_media: got {type(target).__name__}; expected the first PipelineStage or its torch.nn.Module"
    )


_NAMES = (*STAGED_ATTRIBUTES.values(), EXTRAS_ATTRIBUTE, CURSOR_ATTRIBUTE)
_FIELD_TO_ATTRIBUTE = tuple(STAGED_ATTRIBUTES.items())


def _is_staged(module: torch.nn.Module) -> bool:
    get = module.__dict__.get
    return any(get(name) is not None for name in _NAMES)


def _clear(module: torch.nn.Module) -> None:
    pop = module.__dict__.pop
    for name in _NAMES:
        pop(name, None)


@contextlib.contextmanager
def _rewind_shape_inference(stage: Any, module: torch.nn.Module) -> Iterator[None]:
    """Give back whatever the schedule's shape-inference forward takes from the cursor.

    Without static ``input_args``/``output_args``, a schedule's first ``step()`` (and the first after a
    train/eval switch) calls the stage's ``_prepare_forward_infra``, which runs the first stage's
    forward once on microbatch 0 to learn the shapes. That forward takes chunk 0 like any other; the
    cursor is put back when the preparation returns, so the real microbatch 0 gets chunk 0 again.
    """
    original = getattr(stage, _INFRA, None)
    if original is None:
        raise TypeError(
            f"stage_media: {type(stage).__name__} has no {_INFRA}; this torch version's pipeline stage is "
            f"not supported; pass the stage's module and give the stages static input_args/output_args"
        )
    had_own = _INFRA in vars(stage)
    previous = vars(stage).get(_INFRA)

    def prepare_forward_infra(*args: Any, **kwargs: Any) -> Any:
        state = module.__dict__
        saved = state.get(CURSOR_ATTRIBUTE)
        try:
            return original(*args, **kwargs)
        finally:
            state[CURSOR_ATTRIBUTE] = saved

    setattr(stage, _INFRA, prepare_forward_infra)
    try:
        yield
    finally:
        if had_own:
            setattr(stage, _INFRA, previous)
        else:
            delattr(stage, _INFRA)


@contextlib.contextmanager
def stage_media(target: Any, staged: StagedMedia) -> Iterator[StagedMedia]:
    """Stage ``staged`` on the first pipeline stage for one ``schedule.step()``.

    Sets the per-microbatch lists of :data:`ppmedia.STAGED_ATTRIBUTES` (``None`` for a field the batch
    lacks), the per-microbatch dicts of ``chunk.extras`` (``_vlm_extras_chunks``, ``None`` when the split
    staged nothing beyond the chunk fields) and the cursor ``_vlm_chunk_idx = 0`` on the module, and
    always removes them on exit.

    Pass the first :class:`~torch.distributed.pipelining.PipelineStage` (preferred) or its module. With a
    stage, the extra forward a schedule runs for shape inference on its first step does not cost a
    chunk; with a bare module, give the stages static ``input_args``/``output_args``.

    Example::

        staged = ppmedia.split_media(batch, n_microbatches=4)
        with ppmedia.stage_media(stage, staged):
            schedule.step(batch["input_ids"], target=labels)

    Raises:
        ValueError: the module is already staged (nested or leaked staging); or, on a normal exit, the
            step consumed a different number of chunks than were staged ("consumed X of Y"). A batch
            without media stages only ``None`` lists, which the consumer never advances: no check then.
        TypeError: ``target`` is neither a module nor a pipeline stage; ``staged`` is not a
            :class:`~ppmedia.StagedMedia`.
    """
    if not isinstance(staged, StagedMedia):
        raise TypeError(f"stage_media: staged is a {type(staged).__name__}; expected ppmedia.StagedMedia")
    module, stage = _resolve(target)
    if _is_staged(module):
        raise ValueError(
            f"stage_media: {type(module).__name__} is already staged (cursor "
            f"{module.__dict__.get(CURSOR_ATTRIBUTE)!r}); expected an unstaged first stage: finish the "
            f"previous step's staging first"
        )
    state = module.__dict__
    chunks = staged.chunks
    for field, attribute in _FIELD_TO_ATTRIBUTE:
        state[attribute] = chunks.get(field)
    state[EXTRAS_ATTRIBUTE] = staged.extras_per_microbatch()
    state[CURSOR_ATTRIBUTE] = 0
    try:
        if stage is None:
            yield staged
        else:
            with _rewind_shape_inference(stage, module):
                yield staged
        consumed = state.get(CURSOR_ATTRIBUTE)
    finally:
        _clear(module)
    # A batch without media stages only None lists; the contract leaves the cursor alone then.
    if staged.tensors and consumed != staged.n_microbatches:
        hint = (
            " (a schedule's shape-inference forward on its first step also calls the first stage: pass "
            "the PipelineStage to stage_media, or give the stages static input_args/output_args)"
            if stage is None and isinstance(consumed, int) and consumed > staged.n_microbatches
            else ""
        )
        raise ValueError(
            f"stage_media: the step consumed {consumed} of {staged.n_microbatches} staged microbatches; "
            f"expected every one exactly once{hint}"
        )
