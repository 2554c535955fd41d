"""Test data for tests/test_data_*.py: a real Qwen2.5-VL processor for the tiny model, generated
images, videos and datasets (JSON Lines, JSON, ``save_to_disk``).

The processor is transformers' own ``Qwen2_5_VLProcessor`` (``Qwen2VLImageProcessor`` /
``Qwen2VLVideoProcessor`` sized for the tiny vision tower: patch 4, merge 2, temporal patch 2), a
word-level tokenizer whose special ids are the tiny model's (pad 0, vision start 3, vision end 4,
image 5, video 6) and a chat template written like Qwen's (``<|im_start|>ROLE\\n ... <|im_end|>\\n``).
Until ``ppmedia.testing.processors`` exists this stands in for it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>", "[UNK]"]
WORDS = ["system", "user", "assistant", "You", "are", "a", "helpful", "assistant."]
WORDS += [f"w{i}" for i in range(128 - len(SPECIAL) - len(WORDS))]

#: Qwen's layout: a default system turn when the record has none; media parts as vision blocks
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% if message['role'] == 'system' and not loop.first %}{{ raise_exception('a system turn must come first') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_qwen_processor(folder: str, template: str = TEMPLATE) -> Any:
    """Writes the processor to ``folder`` (``save_pretrained``) and returns
    ``AutoProcessor.from_pretrained(folder)``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (AutoProcessor, PreTrainedTokenizerFast, Qwen2_5_VLProcessor, Qwen2VLImageProcessor,
                              Qwen2VLVideoProcessor)

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>", additional_special_tokens=SPECIAL[1:7])
    sizes = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 8 * 8, "max_pixels": 32 * 32}
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        video_processor=Qwen2VLVideoProcessor(**sizes, fps=2.0, min_frames=2, max_frames=8, do_sample_frames=True, cap_pixels_per_frame=False),
        tokenizer=tokenizer, chat_template=template)
    processor.save_pretrained(folder)
    return AutoProcessor.from_pretrained(folder)


def AutoProcessor_from(folder: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)


def write_image(path: str, height: int, width: int, seed: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def write_video(path: str, frames: int = 8, size: int = 16, rate: int = 4, seed: int = 0) -> str:
    import av

    rng = np.random.default_rng(seed)
    with av.open(path, "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def words(rng: np.random.Generator, n: int) -> str:
    return " ".join(f"w{int(k)}" for k in rng.integers(0, 100, n))


def llava_records(folder: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` LLaVA-style records with images written under ``folder`` (relative paths): record ``i``
    has ``i % 3`` images (0: text only), one or two question/answer exchanges."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        images = [write_image(os.path.join(folder, f"img{i}_{k}.png"), 8 * (1 + (i + k) % 3), 8 * (1 + (i + 2 * k) % 2), seed + 7 * i + k)
                  for k in range(i % 3)]
        turns = [{"from": "human", "value": "<image>\n" * len(images) + words(rng, 1 + i % 4)},
                 {"from": "gpt", "value": words(rng, 1 + (i * 5) % 4)}]
        if i % 2:
            turns += [{"from": "human", "value": words(rng, 2)}, {"from": "gpt", "value": words(rng, 3)}]
        record: dict[str, Any] = {"id": i, "conversations": turns}
        if images:
            record["images" if len(images) > 1 else "image"] = [os.path.basename(p) for p in images] if len(images) > 1 else os.path.basename(images[0])
        records.append(record)
    return records


def write_jsonl(path: str, records: list[dict[str, Any]]) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path
