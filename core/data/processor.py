"""One record -> the model's inputs: the model's own processor and chat template, assistant-only labels."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..pipeline.loss import IGNORE_INDEX, SHIFTED_MARK
from .errors import DataError
from .labels import align, label_token_mask, render
from .media import _name, load_audio, load_image
from .records import Record
from .video import FrameSampler, Video, audio_slots, read_video, without_sampling

__all__ = ["TOKEN_KEYS", "SampleProcessor", "TooLong"]

#: per-token keys of a processor's output (``[1, S]``), padded per row when batched (ERNIE 4.5 VL's
#: ``moe_mm_token_type_ids`` too); others are media
TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids", "moe_mm_token_type_ids")


class TooLong(DataError):
    """A sample longer than ``max_length`` that cannot be truncated without losing media tokens."""


class SampleProcessor:
    """Applies a model's processor and chat template to one :class:`~ppmedia.data.records.Record`.

    Args:
        processor: the model's processor (``AutoProcessor.from_pretrained(checkpoint)``), with a
            ``chat_template``.
        max_length: longest sample in tokens (``None``: no limit). A longer sample raises
            :class:`TooLong`, unless ``truncate`` and every media token lies before the cut.
        config: the model's config: which tokens are media placeholders (via its adapter), so a
            truncation never cuts through them (without a config nothing is truncated).
        truncate: cut a too long sample at ``max_length`` when no media token is lost.
        processor_kwargs: more keyword arguments for every processor call (e.g. ``videos_kwargs``
            that a processor class needs and does not save).

    Calling it returns the processor's own output for the one sample (``input_ids`` /
    ``attention_mask`` ``[1, S]`` and the media keys in the processor's layout) plus ``labels``
    ``[1, S]``: shifted (position ``t`` labelled with token ``t + 1``), :data:`IGNORE_INDEX` except on
    the assistant's tokens and each reply's end-of-turn token, last column :data:`SHIFTED_MARK`
    (the form :func:`ppmedia.pipeline.pipeline_loss` takes). For a prefix-LM family (PaliGemma, its
    adapter's ``prefix_lm_key``; needs ``config``) that key is 0 up to the first answer token and 1
    from it on: the prompt is the bidirectional prefix, the answers causal.
    """

    def __init__(self, processor: Any, max_length: int | None = None, config: Any = None, truncate: bool = False,
                 processor_kwargs: dict[str, Any] | None = None) -> None:
        if getattr(processor, "chat_template", None) is None:
            raise ValueError("the processor has no chat_template: save the checkpoint's processor with its "
                             "template, or set processor.chat_template (examples/train.py: --chat-template FILE)")
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(f"{type(self.tokenizer).__name__} is not a fast tokenizer: the labels need its "
                             "character offsets (return_offsets_mapping)")
        self.max_length = max_length
        self.config = config
        self.truncate = truncate
        self.processor_kwargs = dict(processor_kwargs or {})
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._sampler: FrameSampler | None = None

    @property
    def sample_axis_keys(self) -> tuple[str, ...]:
        """The media keys that hold one entry per sample on axis 0 (the family adapter's
        ``sample_axis_keys``; ``()`` without a config): :func:`~ppmedia.data.collate_samples` takes them."""
        if self.config is None:
            return ()
        from ..registry import get_adapter

        return tuple(get_adapter(self.config).sample_axis_keys)

    def _audio_rate(self, where: str) -> int:
        extractor = getattr(self.processor, "feature_extractor", None)
        if extractor is None:
            raise DataError(where, "the record holds audio but the processor has no feature extractor")
        return int(extractor.sampling_rate)

    def _videos(self, record: Record) -> list[Video]:
        """The record's videos: the frames the processor keeps, their metadata, and (when the processor
        reads the videos' audio, ``load_audio_from_video``) their audio tracks."""
        items = record.media.get("video", [])
        if not items:
            return []
        if self._sampler is None:
            if getattr(self.processor, "video_processor", None) is None:
                raise DataError(record.where, "the record holds a video but the processor has no video processor")
            self._sampler = FrameSampler(self.processor, self.processor_kwargs)
        rate = self._audio_rate(record.where) if self._sampler.audio_from_video else None
        videos = [read_video(item, record.where, self._sampler, audio_rate=rate) for item in items]
        for item, video in zip(items, videos):
            if video.audio is not None and not video.audio.size:
                raise DataError(record.where, f"video {_name(item)!r} has no audio track, and the processor takes each "
                                              "video's (load_audio_from_video)")
        return videos

    def _media_kwargs(self, record: Record) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        where = record.where
        if record.media.get("image"):
            kwargs["images"] = [[load_image(item, where) for item in record.media["image"]]]  # one list per sample
        videos = self._videos(record)
        if videos:
            kwargs["videos"] = [v.frames for v in videos]
            kwargs["video_metadata"] = [v.metadata for v in videos]
        clips = [load_audio(item, where, self._audio_rate(where)) for item in record.media.get("audio", [])]
        if any(v.audio is not None for v in videos):
            kwargs["audio"], kwargs["audio_from_video_indices"] = audio_slots(record.messages, clips, [v.audio for v in videos])
        elif clips:
            kwargs["audio"] = clips
        return kwargs

    def _labels(self, text: str, spans: list[tuple[int, int]], markers: bool, ids: list[int], where: str) -> Tensor:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = label_token_mask([tuple(o) for o in enc["offset_mapping"]], spans, end_of_turn=not markers)
        needed = [i for i, m in enumerate(mask) if m]
        targets = torch.full((len(ids),), IGNORE_INDEX, dtype=torch.int64)
        for j in align(list(enc["input_ids"]), ids, where, needed).values():
            targets[j] = ids[j]
        labels = torch.full_like(targets, IGNORE_INDEX)
        labels[:-1] = targets[1:]
        labels[-1] = SHIFTED_MARK
        return labels[None]

    def __call__(self, record: Record) -> dict[str, Any]:
        """The sample's tensors (see the class); :class:`DataError` naming ``record.where`` for an
        unreadable media file, a template that refuses the turns, or a processor error."""
        text, spans, markers = render(self.processor, record.messages, record.where)
        kwargs = self._media_kwargs(record)
        call = without_sampling(self.processor_kwargs) if "videos" in kwargs else self.processor_kwargs
        try:
            out = self.processor(text=[text], return_tensors="pt", add_special_tokens=False, **kwargs, **call)
        except Exception as e:  # the processor's own complaint about this record, whatever its type
            raise DataError(record.where, f"the processor refuses this record ({type(e).__name__}: {e})") from None
        sample = {k: v for k, v in out.items() if isinstance(v, Tensor)}
        ids = sample["input_ids"][0].tolist()
        sample["labels"] = self._labels(text, spans, markers, ids, record.where)
        self._mark_prefix(sample)
        if self.max_length is not None and len(ids) > self.max_length:
            sample = self._cut(sample, record.where)
        return sample

    def _mark_prefix(self, sample: dict[str, Any]) -> None:
        """A prefix-LM family (its adapter's ``prefix_lm_key``, e.g. PaliGemma's ``token_type_ids``):
        0 up to the first answer token (the prompt attends bidirectionally), 1 from it on (causal)."""
        if self.config is None:
            return
        from ..registry import get_adapter

        key = getattr(get_adapter(self.config), "prefix_lm_key", None)
        if key is None or key not in sample:
            return
        labelled = ((sample["labels"][0] != IGNORE_INDEX) & (sample["labels"][0] != SHIFTED_MARK)).nonzero()
        types = torch.zeros_like(sample[key])
        if labelled.numel():  # labels are shifted: position t is labelled with token t + 1
            types[0, int(labelled[0, 0]) + 1:] = 1
        sample[key] = types

    def _media_end(self, input_ids: Tensor) -> int:
        """One past the last media placeholder token (0 when none); -1 when unknown (no config)."""
        if self.config is None:
            return -1
        from ..registry import get_adapter

        masks = get_adapter(self.config).placeholder_masks(input_ids, self.config).values()
        positions = [int(m[0].nonzero().max()) + 1 for m in masks if bool(m.any())]
        return max(positions, default=0)

    def _cut(self, sample: dict[str, Any], where: str) -> dict[str, Any]:
        length, limit = sample["input_ids"].shape[1], int(self.max_length)  # type: ignore[arg-type]
        end = self._media_end(sample["input_ids"])
        if not self.truncate or end < 0 or end + 1 > limit:  # keep the token after the last media run
            raise TooLong(where, f"{length} tokens, over max_length={limit}" + (
                f" (media tokens up to position {end})" if end > 0 else ""))
        for key in TOKEN_KEYS:
            if key in sample:
                sample[key] = sample[key][:, :limit].clone()
        sample["labels"][0, -1] = SHIFTED_MARK  # its target was cut off
        return sample
