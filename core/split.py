"""The producer side: split a processor batch's media per microbatch, as the schedule splits rows.

``torch.distributed.pipelining`` gives microbatch ``k`` the rows ``torch.tensor_split(range(B), n)[k]``
of every tensor it is handed. :func:`split_media` pops the media out of the batch (media do not have
samples on dim 0) and cuts each media tensor so that microbatch ``k`` gets exactly the media of its
samples, as views of the batch's tensors. Which keys are media, and how they map to samples, is what
the registered media layouts say (:mod:`ppmedia.layouts`; ppmedia's own and plugins', one mechanism);
the plain and the balanced split take the same path (:mod:`ppmedia.splitter`).
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

from .layouts import BUILTIN_LAYOUTS, LayoutSet
from .planners import IMAGE_GRID_KEYS, CountsArgument
from .splitter import SampleInputsArgument, assemble, plan_split, pop_media
from .staged import StagedMedia, microbatch_bounds

__all__ = [
    "IMAGE_GRID_KEYS",
    "MEDIA_KEYS",
    "StagedMedia",
    "microbatch_bounds",
    "split_media",
]

#: every key :func:`split_media` pops with ppmedia's own layouts (plugins' layouts add theirs:
#: ``ppmedia.registry.default_registry().media_layouts().keys``).
MEDIA_KEYS: tuple[str, ...] = LayoutSet(BUILTIN_LAYOUTS).ordered_keys


def split_media(
    batch: MutableMapping[str, Any],
    n_microbatches: int,
    *,
    images_per_sample: CountsArgument = None,
    videos_per_sample: CountsArgument = None,
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
    check it against the samples).

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
        batch_size: ``B``; by default ``batch["input_ids"].shape[0]``.
        counts: ``{modality: [B] counts}`` for any counted modality (``counts={"video": ...}`` is
            ``videos_per_sample=``; a plugin's modality has no argument of its own).
        sample_inputs: per-sample inputs ``[B, ...]`` to stage with the media (an adapter's
            ``sample_inputs``, e.g. PaliGemma's ``token_type_ids`` ``[B, S]``): batch keys, or
            ``{key: None}`` (the batch's value) / ``{key: tensor}`` (stage this ``[B, ...]`` tensor
            instead; the batch's key is popped either way). Each is split with its samples, staged as
            views in ``chunk.extras[key]``, and reordered with them by a balanced split.
            ``adapter.media_counts(batch, config)`` passes the adapter's.
        layouts: the :class:`~ppmedia.layouts.LayoutSet` to split by (default: the process-wide
            registry's: ppmedia's layouts and every registered plugin's).
        balance: reorder the samples so every microbatch gets a similar vision load
            (:func:`ppmedia.balance.balanced_split`): ``True`` (cost linear in patches), a cost function
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
    if balance is not False and balance is not None:
        from .balance import balanced_split

        return balanced_split(batch, n_microbatches, balance, images_per_sample=images_per_sample,
                              videos_per_sample=videos_per_sample, batch_size=batch_size, counts=counts,
                              sample_inputs=sample_inputs, layouts=layouts)
    planned = plan_split(batch, n_microbatches, images_per_sample=images_per_sample, videos_per_sample=videos_per_sample,
                         counts=counts, batch_size=batch_size, sample_inputs=sample_inputs, layouts=layouts)
    staged = assemble(planned)  # every view made here, before anything is popped
    pop_media(batch, planned)
    return staged
