"""Pre-split microbatches: a split batch as torch's ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=)``.

torch 2.14 takes a step's microbatches already split: ``arg_mbs`` (one tuple of positional inputs per
microbatch, given to the first stage only), ``kwarg_mbs`` (one dict per microbatch, given to EVERY
stage the rank holds) and ``target_mbs``. :func:`microbatch_inputs` builds them from a
:class:`~ppmedia.StagedMedia`: microbatch ``k``'s text rows (views of the batch's tensors) as its
positional inputs, and its media chunk as its own keyword input ``media`` (:data:`MEDIA_KWARG`, a
:class:`MicrobatchMedia`). Nothing is hung on a module and there is no cursor: the schedule hands
every forward the inputs of the microbatch it runs, the shape-inference forward included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from torch import Tensor

from ..chunk import VlmMediaChunk
from .staged import StagedMedia

__all__ = ["MEDIA_KWARG", "MicrobatchInputs", "MicrobatchMedia", "microbatch_inputs"]

#: the keyword under which each microbatch's media reach the stages (``kwarg_mbs[k]["media"]``).
MEDIA_KWARG = "media"


@dataclass(frozen=True, slots=True)
class MicrobatchMedia:
    """One microbatch's media, as the keyword input ``media`` of every stage on the rank.

    The first stage merges ``chunk``; every other stage takes the keyword and ignores it (torch gives
    keyword inputs to every stage of the rank). Not a pytree node: torch's schedule, its
    shape-inference forward and FSDP2's input casting pass it through untouched (no detach, no dtype
    cast), so the chunk's tensors stay the split's views.

    Attributes:
        index: the microbatch, ``0 <= index < n_microbatches`` (the encoder spread's features and
            error messages are keyed by it).
        chunk: what :meth:`StagedMedia.chunk` gives for it: the media views and per-sample inputs
            (``chunk.extras``), or ``None`` for a text-only microbatch without per-sample inputs.
    """

    index: int
    chunk: VlmMediaChunk | None


@dataclass
class MicrobatchInputs:
    """One step's pre-split inputs (``n`` entries each), for ``schedule.step(**inputs.step_kwargs())``.

    Attributes:
        arg_mbs: per microbatch ``(input_ids [b, S], attention_mask [b, S])``: views of the batch's rows.
        kwarg_mbs: per microbatch ``{"media": MicrobatchMedia}``.
        target_mbs: per microbatch the target rows ``[b, S]`` (views), or ``None`` without a target.
        loss_kwargs: keyword arguments of the loss function (e.g. ``{"num_valid_tokens": N}``), or ``None``.
    """

    arg_mbs: list[tuple[Tensor, ...]]
    kwarg_mbs: list[dict[str, Any]]
    target_mbs: list[Tensor] | None = None
    loss_kwargs: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.arg_mbs)

    def step_kwargs(self) -> dict[str, Any]:
        """``arg_mbs``, ``kwarg_mbs`` and (when set) ``target_mbs`` and ``loss_kwargs``, as keyword
        arguments of ``schedule.step`` / ``schedule.eval`` (add ``losses=`` yourself)."""
        out: dict[str, Any] = {"arg_mbs": self.arg_mbs, "kwarg_mbs": self.kwarg_mbs}
        if self.target_mbs is not None:
            out["target_mbs"] = self.target_mbs
        if self.loss_kwargs is not None:
            out["loss_kwargs"] = self.loss_kwargs
        return out


def _rows(name: str, tensor: Any, staged: StagedMedia) -> list[Tensor]:
    """``tensor``'s rows per microbatch (views), as the split cut the samples."""
    if not isinstance(tensor, Tensor) or tensor.dim() == 0:
        raise TypeError(f"microbatch_inputs: {name} is a {type(tensor).__name__}; expected a [B, ...] tensor")
    if tensor.shape[0] != staged.batch_size:
        raise ValueError(
            f"microbatch_inputs: {name} has {tensor.shape[0]} rows on dim 0; the media were split for a batch "
            f"of {staged.batch_size} samples (split_media of the same batch)"
        )
    return [tensor[a:b] for a, b in staged.samples]


def microbatch_inputs(
    media: Any,
    input_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    *,
    target: Tensor | None = None,
    loss_kwargs: Mapping[str, Any] | None = None,
) -> MicrobatchInputs:
    """A split batch as pre-split microbatches for ``schedule.step(**inputs.step_kwargs(), losses=...)``.

    Microbatch ``k`` gets the samples ``media.samples[k]`` (``torch.tensor_split``'s rows, or a balanced
    split's, after its in-place reordering of the batch's rows): ``arg_mbs[k] = (input_ids[a:b],
    attention_mask[a:b])`` and ``target_mbs[k] = target[a:b]`` (views, no copy) and ``kwarg_mbs[k] =
    {"media": MicrobatchMedia(k, media.chunk(k))}``, whose tensors are the split's views themselves.
    No tensor data is read on the host. Call it on every pipeline rank with the same batch (positional
    inputs reach only the first stage, targets only the last; other ranks' entries are ignored).

    Args:
        media: the batch's :class:`~ppmedia.StagedMedia` (:func:`~ppmedia.split_media`), or a
            :class:`~ppmedia.PipelineBatch` (``collate_for_pipeline``), whose ``text`` supplies
            ``input_ids`` and ``attention_mask`` when they are not given.
        input_ids: ``[B, S]`` token ids.
        attention_mask: ``[B, S]``.
        target: ``[B, S]`` shifted labels (:func:`~ppmedia.pipeline.make_labels`), or ``None``.
        loss_kwargs: the loss function's keyword arguments (``{"num_valid_tokens": N}`` for
            :func:`~ppmedia.pipeline.pipeline_loss`, N counted over the GLOBAL batch).

    Raises:
        TypeError: ``media`` is neither; a text input is not a tensor.
        ValueError: a text input's rows are not the split batch's ``B``.
    """
    from .collate import PipelineBatch

    if isinstance(media, PipelineBatch):
        input_ids = media.text.get("input_ids") if input_ids is None else input_ids
        attention_mask = media.text.get("attention_mask") if attention_mask is None else attention_mask
        media = media.media
    if not isinstance(media, StagedMedia):
        raise TypeError(
            f"microbatch_inputs: media is a {type(media).__name__}; expected ppmedia.StagedMedia (split_media) "
            f"or ppmedia.PipelineBatch"
        )
    if input_ids is None or attention_mask is None:
        missing = "input_ids" if input_ids is None else "attention_mask"
        raise TypeError(f"microbatch_inputs: {missing} is missing; expected a [B, S] tensor")
    ids, mask = _rows("input_ids", input_ids, media), _rows("attention_mask", attention_mask, media)
    targets = None if target is None else _rows("target", target, media)
    return MicrobatchInputs(
        arg_mbs=list(zip(ids, mask)),
        kwarg_mbs=[{MEDIA_KWARG: MicrobatchMedia(k, media.chunk(k))} for k in range(media.n_microbatches)],
        target_mbs=targets,
        loss_kwargs=None if loss_kwargs is None else dict(loss_kwargs),
    )
