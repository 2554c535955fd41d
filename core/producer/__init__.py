"""The producer: a batch's media split per microbatch exactly as the schedule splits its rows, and staged.

The path is top-down, one module per step (docs/architecture.md): :mod:`.split` (the entry,
:func:`~ppmedia.split_media`) -> :mod:`.plan` (layouts selected, one planner per layout, the one host read)
-> :mod:`.balancing` (a row order, optional) -> :mod:`.assemble` (fields gathered once, cut per microbatch)
-> :mod:`.staged` (views). Around it: :mod:`.layouts` and the planners (:mod:`.planners`,
:mod:`.planners_audio`, :mod:`.planners_frames`, :mod:`.declared`), :mod:`.hostreads` (the one read),
:mod:`.staging` (:func:`~ppmedia.stage_media`), :mod:`.presplit` (pre-split microbatches) and
:mod:`.collate` (the split in ``DataLoader`` workers). The public names are in :mod:`ppmedia`,
:mod:`ppmedia.layouts` and :mod:`ppmedia.balance`.
"""
