"""The producer side: split a processor batch's media per microbatch, as the schedule splits rows.

``torch.distributed.pipelining`` gives microbatch ``k`` the rows ``torch.tensor_split(range(B), n)[k]``
of every tensor it is handed. :func:`split_media` pops the media out of the batch (media do not have
samples on dim 0) and cuts each media tensor so that microbatch ``k`` gets exactly the media of its
samples, as views of the batch's tensors. Which keys are media, and how they map to samples, is what
the registered media layouts say (:mod:`ppmedia.producer.layouts`; ppmedia's own and plugins', one mechanism).

The producer path, top-down: :func:`split_in_order` calls the plan step (:func:`ppmedia.producer.plan.plan_split`:
checks, the one host read), then, for a row order such as ``balance=``, the strategy that decides which
sample goes where (:func:`ppmedia.producer.balancing.balanced_permutation`; packing's takes the same place), then
the assembly (:mod:`ppmedia.producer.assemble`: gather, views in :mod:`ppmedia.producer.staged`). No step calls back up;
only this module changes the batch, once everything has succeeded.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import numpy as np
import torch
from torch import Tensor

from .assemble import Planned, assemble, reorder_plan
from .balancing import DEFAULT_ORDER, balanced_permutation
from .layouts import BUILTIN_LAYOUTS, LayoutSet
from .planners import IMAGE_GRID_KEYS, CountsArgument
from .plan import SampleInputsArgument, default_layouts, plan_split
from .staged import StagedMedia, microbatch_bounds

__all__ = [
    "IMAGE_GRID_KEYS",
    "MEDIA_KEYS",
    "RowOrder",
    "StagedMedia",
    "balance_order",
    "microbatch_bounds",
    "split_in_order",
    "split_media",
]

#: a row-order strategy: ``(per-sample plan, n_microbatches) -> permutation`` of the ``B`` samples
#: (position ``i`` of the split batch holds original sample ``permutation[i]``); it reads the
#: :class:`~ppmedia.producer.assemble.Planned` of ``B`` one-sample microbatches and calls nothing above it.
RowOrder = Callable[[Planned, int], Sequence[int]]

#: every key :func:`split_media` pops with ppmedia's own layouts (plugins' layouts add theirs:
#: ``ppmedia.registry.default_registry().media_layouts().keys``).
MEDIA_KEYS: tuple[str, ...] = LayoutSet(BUILTIN_LAYOUTS).ordered_keys


def split_media(
    batch: MutableMapping[str, Any],
    n_microbatches: int,
    *,
    images_per_sample: CountsArgument = None,
    videos_per_sample: CountsArgument = None,
    audios_per_sample: CountsArgument = None,
    batch_size: int | None = None,
    balance: Any = False,
    counts: Mapping[str, CountsArgument] | None = None,
    sample_inputs: SampleInputsArgument = None,
    layouts: LayoutSet | None = None,
) -> StagedMedia:
    """Pop the media out of ``batch`` and split them per microbatch exactly as the schedule splits rows.

    Keys popped (when present, see :data:`MEDIA_KEYS`; a plugin's media layouts add theirs):
    ``pixel_values``; at most one image metadata key of :data:`IMAGE_GRID_KEYS` (``image_grid_thw`` ``[images, 3]``, ``image_grid_hws`` ``[images, 2]``,
    ``image_sizes`` ``[images, 2]``, ``image_position_ids`` ``[images, max_patches, 2]``, Gemma 3's
    ``num_crops`` ``[images]``), staged as the chunk's ``image_grid``; ``pixel_values_videos``,
    ``video_grid_thw`` ``[videos, 3]`` and ``second_per_grid_ts`` ``[videos]`` (a tensor, or a list of
    seconds that becomes one new host tensor); Step3's ``patch_pixel_values`` ``[patches, C, h, w]``,
    ``num_patches`` ``[B]`` and ``patch_newline_mask`` ``[patches]``; the counts
    ``n_images_per_sample`` / ``n_videos_per_sample`` ``[B]``; ``num_chunks_per_video`` ``[videos]``
    (MiniMax-M3-VL, Kimi-K2.5: how many ``video_grid_thw`` rows each video spans; the models do not
    read it and nothing stages it: a grid row is one video here, and those adapters' ``media_counts``
    check it against the samples); the Qwen Omnis' ``video_second_per_grid`` ``[videos]`` (staged as
    ``second_per_grid_ts``); Gemma 4's padded video frames ``pixel_values_videos`` ``[frames,
    max_patches, D]`` with ``video_position_ids`` ``[frames, max_patches, 2]`` and
    ``num_frames_per_video`` ``[videos]``; audio clips ``input_features`` ``[audios, ...]`` or
    ``audio_input_ids`` ``[audios, frames, bins]`` with ``input_features_mask``,
    ``feature_attention_mask`` or ``audio_input_ids_mask`` ``[audios, T]``, and ``n_audios_per_sample`` ``[B]``.

    Rows of ``pixel_values`` per image: with ``image_grid_thw``/``image_grid_hws``, the grid's product
    (flat patch rows ``[patches, D]``, patch-major ``[patches, C, ph, pw]``) when the products add up to
    the rows, else one; with ``num_crops``, ``1 + num_crops[i]`` (the image, then its pan-and-scan crops);
    otherwise one (complete images ``[images, C, H, W]``, padded patches, LLaVA-NeXT crops
    ``[images, max_crops, C, H, W]``). Videos likewise with ``video_grid_thw``.

    Images per sample: the batch's ``n_images_per_sample``, else ``images_per_sample``, else one per
    sample when there are exactly ``B`` images (videos likewise). Counts are ``[B]`` integer tensors or
    sequences of ints (``bool``, ``float``, ``None`` refused). With ``num_crops`` they may count images
    or rows. Microbatch ``k`` gets samples ``torch.tensor_split(range(B), n)[k]`` and exactly their media.

    All or nothing: every check and every view is made before the first key is popped, so on any error
    ``batch`` is left exactly as it was. After a successful call every tensor left in ``batch`` has
    ``B`` on dim 0 (safe for the schedule's split); a tensor that does not is an error before anything
    is popped (e.g. Qwen's mrope ``position_ids`` ``[3, B, S]``, or a per-image key ppmedia does not know).

    Args:
        batch: the processor/collator output; modified in place (media keys popped).
        n_microbatches: the schedule's ``n_microbatches``, ``1 <= n <= B`` (the schedule's own split
            never gives more microbatches than samples).
        images_per_sample: ``[B]`` image counts, e.g. from an adapter's ``media_per_sample``.
        videos_per_sample: ``[B]`` video counts.
        audios_per_sample: ``[B]`` audio-clip counts (``counts={"audio": ...}``; the batch's
            ``n_audios_per_sample``, else this, else one clip per sample when there are exactly ``B``).
        batch_size: ``B``; by default ``batch["input_ids"].shape[0]``.
        counts: ``{modality: [B] counts}`` for any counted modality (``counts={"video": ...}`` is
            ``videos_per_sample=``; a plugin's modality has no argument of its own).
        sample_inputs: per-sample inputs ``[B, ...]`` to stage with the media (an adapter's
            ``sample_inputs``, e.g. PaliGemma's ``token_type_ids`` ``[B, S]``): batch keys, or
            ``{key: None}`` (the batch's value) / ``{key: tensor}`` (stage this ``[B, ...]`` tensor
            instead; the batch's key is popped either way). Each is split with its samples, staged as
            views in ``chunk.extras[key]``, and reordered with them by a balanced split.
            ``adapter.media_counts(batch, config)`` passes the adapter's.
        layouts: the :class:`~ppmedia.producer.layouts.LayoutSet` to split by (default: the process-wide
            registry's: ppmedia's layouts and every registered plugin's).
        balance: reorder the samples so every microbatch gets a similar vision load
            (:func:`ppmedia.balance.balanced_split`, :func:`split_in_order`): ``True`` (cost linear in patches), a cost function
            ``patches -> cost`` such as ``functools.partial(adapter.image_costs, config=config)``, or
            ``[B]`` per-sample costs. The ``[B, ...]`` tensors left in ``batch`` are reordered in place
            and the result's ``permutation`` says how; the media are copied once, in the new order.

    Returns:
        A :class:`StagedMedia` of views. The integer metadata needed (counts, grids, ``num_patches``,
        ``num_crops``) is read to the host in one read per batch (one per device when on several), and
        all arithmetic on it is exact (an absurd value is an error, never a wrapped number).

    Raises:
        TypeError: a value is not a dense tensor (or a sequence where one is allowed), metadata is not
            of an integer dtype, a count is not an int.
        ValueError: any inconsistency, overflow, or metadata on the ``meta`` device; the message names
            the key, the shape or value seen, what was expected and, where one is to blame, the row,
            sample and microbatch.
    """
    row_order = None if balance is False or balance is None else balance_order(balance)
    return split_in_order(batch, n_microbatches, row_order, images_per_sample=images_per_sample,
                          videos_per_sample=videos_per_sample, audios_per_sample=audios_per_sample,
                          batch_size=batch_size, counts=counts, sample_inputs=sample_inputs, layouts=layouts)


def balance_order(balance: Any, *, order: str = DEFAULT_ORDER, patch_size: int | None = None) -> RowOrder:
    """The :data:`RowOrder` of ``split_media(balance=...)``: ``balance`` checked for its form (``True``, a
    cost function ``patches -> costs``, or ``[B]`` per-sample costs), then
    :func:`ppmedia.producer.balancing.balanced_permutation` with ``order`` and ``patch_size``."""
    if isinstance(balance, (str, bytes)) or not (
        balance is True or callable(balance) or isinstance(balance, (Sequence, np.ndarray, Tensor))
    ):
        raise TypeError(
            f"balance: got {type(balance).__name__}; expected True, a cost function patches -> costs, "
            f"or [B] per-sample costs"
        )
    return functools.partial(balanced_permutation, balance, order=order, patch_size=patch_size)


def split_in_order(
    batch: MutableMapping[str, Any],
    n_microbatches: int,
    row_order: RowOrder | None,
    *,
    images_per_sample: CountsArgument = None,
    videos_per_sample: CountsArgument = None,
    audios_per_sample: CountsArgument = None,
    batch_size: int | None = None,
    counts: Mapping[str, CountsArgument] | None = None,
    sample_inputs: SampleInputsArgument = None,
    layouts: LayoutSet | None = None,
) -> StagedMedia:
    """:func:`split_media` with the samples in the order ``row_order`` decides (``None``: as they are).

    With a row order (and ``B > 1``, ``n > 1``) the batch is planned per sample (``B`` microbatches,
    the same checks and the one host read), ``row_order`` gives the permutation, every staged tensor
    is gathered once in that order (nothing copied for the identity) and cut in ``n``; the ``[B, ...]``
    tensors and length-``B`` lists left in ``batch`` are reordered in place and the result's
    ``permutation`` says how. The other arguments are :func:`split_media`'s.
    """
    kwargs: dict[str, Any] = dict(images_per_sample=images_per_sample, videos_per_sample=videos_per_sample,
                                  audios_per_sample=audios_per_sample, batch_size=batch_size, counts=counts,
                                  sample_inputs=sample_inputs, layouts=layouts)
    if row_order is None:
        planned = plan_split(batch, n_microbatches, **kwargs)
        staged = assemble(planned)  # every view made here, before anything is popped
        _pop_media(batch, planned)
        return staged
    kwargs["layouts"] = layouts = default_layouts() if layouts is None else layouts
    B = _rows(batch, batch_size)
    if B is None or B <= 1 or n_microbatches == 1:
        planned = plan_split(batch, n_microbatches, **kwargs)
        staged = assemble(planned, tuple(range(planned.batch_size)))
        _pop_media(batch, planned)
        return staged
    row_keys = _row_keys(batch, layouts.keys.union(sample_inputs or ()), B)
    try:
        per_sample = plan_split(batch, B, **kwargs)  # the batch changes only once everything has succeeded
    except ValueError:
        plan_split(batch, n_microbatches, **kwargs)  # the same error, worded for n microbatches
        raise
    permutation = list(row_order(per_sample, n_microbatches))
    staged = assemble(reorder_plan(per_sample, permutation, n_microbatches), tuple(permutation))
    _pop_media(batch, per_sample)
    if permutation != list(range(B)):
        index = torch.as_tensor(permutation, dtype=torch.int64)
        for key in row_keys:
            value = batch[key]
            batch[key] = value.index_select(0, index.to(value.device)) if isinstance(value, Tensor) else [value[s] for s in permutation]
    return staged


def _rows(batch: MutableMapping[str, Any], batch_size: int | None) -> int | None:
    """``B`` as given, else from ``input_ids`` (``None`` when there is none: the plan step then says why)."""
    if batch_size is not None:
        return batch_size
    ids = batch.get("input_ids")
    return ids.shape[0] if isinstance(ids, Tensor) and ids.dim() >= 1 else None


def _row_keys(batch: MutableMapping[str, Any], media_keys: frozenset[str], B: int) -> list[str]:
    """Keys of the batch's ``[B, ...]`` tensors and length-``B`` lists; refuses any other tensor with
    a dim 0 (it could not follow the reordering, and would silently pair rows with other samples)."""
    keys = []
    for key, value in batch.items():
        if key in media_keys:
            continue
        if isinstance(value, Tensor) and value.dim() >= 1:
            if value.shape[0] != B:
                raise ValueError(
                    f"{key}: shape {list(value.shape)}; expected [{B}, ...] (one row per sample) to reorder "
                    f"with balance=True: compute such tensors after balancing (e.g. Qwen's [3, B, S] "
                    f"position_ids per microbatch in the first stage)"
                )
            keys.append(key)
        elif isinstance(value, list) and len(value) == B:
            keys.append(key)
    return keys


def _pop_media(batch: MutableMapping[str, Any], planned: Planned) -> None:
    """Remove from ``batch`` every key the split took (media keys, counts, per-sample inputs)."""
    popped = planned.popped
    for key in [k for k in batch if k in popped]:
        del batch[key]
