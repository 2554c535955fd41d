"""Sequence packing: several samples per row, exact per sample on every pipeline stage.

The API (``ppmedia.packing``)::

    plan_rows(lengths: Sequence[int], max_length: int, costs: Sequence[float] | None = None, *,
              n_microbatches: int | None = None, multiple_of: int = 1) -> list[list[int]]
    pack_samples(samples: Sequence[Mapping[str, Any] | None], rows: Sequence[Sequence[int]], pad_id: int, *,
                 max_length: int | None = None) -> dict[str, Tensor]
    sample_costs(samples: Sequence[Mapping[str, Any]], config, adapter=None, pad_id: int = 0) -> np.ndarray  # [samples]
    sample_positions(segments: Tensor) -> Tensor                       # [b, S] -> [b, S]
    enable_packing(modules: Iterable[StageModule | PipelineStage], enabled: bool = True) -> None
    packing_problem(config, adapter=None) -> str | None
    isolate(config, hidden: Tensor, mask, segments: Tensor) -> Tensor | dict[str, Tensor]

A step::

    lengths = [s["input_ids"].shape[1] for s in samples]       # SampleProcessor outputs, [1, L] each
    rows = plan_rows(lengths, max_length, sample_costs(samples, config), n_microbatches=n)
    batch = pack_samples(samples, rows, pad_id, max_length=max_length)   # [R, max_length] rows
    enable_packing(stage_modules)                                        # once, on every rank
    ... the batch then goes where an unpacked collate's goes (presplit_batch / split_media / step) ...

The packed batch has the unpacked collate's keys. Its ``attention_mask`` ``[R, S]`` holds each
token's sample number within its row (1, 2, ...; 0 on padding at the row's end): read as a 0/1 mask
it marks the same tokens real, and the stages isolate the samples from it. ``labels`` are each
sample's own shifted labels (its last position ignored: no label crosses into the next sample; the
row's last column :data:`~ppmedia.pipeline.SHIFTED_MARK`); :func:`ppmedia.pipeline.make_labels` on a
packed batch ignores the boundary positions too. Media are the samples' media in row order.

On a stage of a packed pipeline (:func:`enable_packing`): positions restart per sample through the
adapter's one hook ``packed_position_ids`` (1-D by default; the mrope families' own rope index per
sample), and the language model's masks (causal, sliding windows, Gemma 3's image blocks, PaliGemma's
prefix, as the family builds them) are ANDed with "same sample" (:func:`isolate`: dense ``[b, 1, S, S]``
masks for ``sdpa`` / ``eager``). Families that cannot isolate are refused (:func:`packing_problem`).
"""

from __future__ import annotations

from .assemble import pack_samples
from .costs import sample_costs
from .isolation import PACKED_ATTENTION, enable_packing, isolate, packing_problem, rows_as_samples
from .positions import sample_positions
from .rows import plan_rows, row_costs

__all__ = [
    "PACKED_ATTENTION",
    "enable_packing",
    "isolate",
    "pack_samples",
    "packing_problem",
    "plan_rows",
    "row_costs",
    "rows_as_samples",
    "sample_costs",
    "sample_positions",
]
