"""A tiny checkpoint folder and a generated image-chat dataset, for fine-tuning runs without downloads.

:func:`save_tiny_checkpoint` writes a tiny family's seeded model (``save_pretrained``, in the dtype
asked for) and its real processor (:func:`ppmedia.testing.processors.save_tiny_processor`) into one
folder: what ``examples/train.py --model`` takes. :func:`write_image_chat_dataset` writes PNG images
and a LLaVA-style JSON Lines file (one ``<image>`` question and one answer per record) whose answer
words follow the image's colour, so a model can learn it: a loss that falls in a few steps.
:func:`write_length_skewed_dataset` writes records of long-tailed lengths, some with images and some
text-only: the data that sequence packing pays on (``tests/bench/run.py --pack``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["IMAGE_SIZES", "MIXED_KINDS", "OWN_NAMES", "SKEWED_IMAGE_SIZES", "main", "save_tiny_checkpoint", "write_image_chat_dataset",
           "write_length_skewed_dataset", "write_mixed_dataset", "write_video"]

#: (height, width) of the generated images, in turn (multiples of 8: whole merged patches of the tiny
#: Qwen2.5-VL processor, 4 to 6 image tokens each).
IMAGE_SIZES: tuple[tuple[int, int], ...] = ((16, 16), (16, 24), (24, 16))
#: (height, width) of :func:`write_length_skewed_dataset`'s images (4 to 16 image tokens each with the
#: tiny Qwen2.5-VL processor, whose largest image is 32 x 32 pixels).
SKEWED_IMAGE_SIZES: tuple[tuple[int, int], ...] = ((16, 16), (16, 32), (32, 16), (24, 24), (32, 32))


#: families saved under the model's own tensor names (``save_original_format=False``): transformers
#: 5.23's conversion back from the original Kimi names (fused ``self_wqkv``, ``PermuteForRope`` on
#: ``q_proj``) fails for a config with ``q_lora_rank: null`` such as the tiny one, in
#: ``from_pretrained`` and in ppmedia's per-stage loader alike (it applies the same conversion).
OWN_NAMES: frozenset[str] = frozenset({"kimi_vl", "kimi_k25_video"})


def save_tiny_checkpoint(family: str, folder: str | Path, *, seed: int = 0, dtype: Any = None,
                         max_shard_size: str = "50GB") -> Path:
    """The tiny ``family``'s model (seed ``seed``, cast to ``dtype`` if given) and its processor, saved
    into ``folder``; returns it. The model is the one the processor's output fits
    (:func:`~ppmedia.testing.processors.build_tiny_processor_model`: Gemma 4's has a larger vision
    position table, since its processor's patch coordinates reach past the plain tiny model's 16).
    A family of :data:`OWN_NAMES` is saved under the model's own tensor names."""
    from .processors import build_tiny_processor_model, save_tiny_processor

    path = Path(folder)
    model = build_tiny_processor_model(family, seed)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, max_shard_size=max_shard_size, save_original_format=family not in OWN_NAMES)
    save_tiny_processor(family, path)
    return path


def write_image_chat_dataset(folder: str | Path, n_samples: int, *, words: list[str], seed: int = 0,
                             name: str = "train.jsonl") -> Path:
    """``n_samples`` records in ``folder/name`` (images beside it, paths relative to it).

    Record ``i``: image ``img{i}.png`` (``IMAGE_SIZES[i % 3]``, one of 3 colours with noise), the human
    turn ``"<image>\\n"`` plus 2 to 4 question words, the assistant's answer 2 words chosen by the
    image's colour. ``words``: the tokenizer's plain words (``ppmedia.testing.word_tokenizer.text_words``),
    at least 12.
    """
    from PIL import Image

    if len(words) < 12:
        raise ValueError(f"write_image_chat_dataset: {len(words)} words; expected at least 12")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    colours = np.array([[220, 40, 40], [40, 200, 60], [50, 60, 230]])
    lines = []
    for i in range(n_samples):
        height, width = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        colour = int(rng.integers(0, 3))
        noise = rng.integers(-30, 30, (height, width, 3))
        pixels = np.clip(colours[colour] + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / f"img{i}.png")
        question = " ".join(words[int(k)] for k in rng.integers(6, 12, int(rng.integers(2, 5))))
        answer = f"{words[2 * colour]} {words[2 * colour + 1]}"
        lines.append({"image": f"img{i}.png", "conversations": [
            {"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]})
    path = root / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def write_length_skewed_dataset(folder: str | Path, n_samples: int, *, words: list[str], seed: int = 0,
                                max_words: int = 96, text_only: float = 0.4, median_words: float = 10.0,
                                name: str = "skewed.jsonl", two_images: float = 0.25) -> Path:
    """``n_samples`` LLaVA-style records of long-tailed lengths in ``folder/name`` (images beside it).

    Each record's question has ``round(median_words * exp(N(0, 1)))`` words (a log-normal: most
    records short, a few long), clipped to ``[1, max_words]``; its answer 1 to 4 words. A record is
    text-only with probability ``text_only``, else it holds one image (two with probability
    ``two_images``) of a size from :data:`SKEWED_IMAGE_SIZES`. The same ``seed`` writes the same
    records (and the same questions and image sizes whatever ``text_only`` and ``two_images`` are).

    Args:
        words: the tokenizer's plain words (``ppmedia.testing.word_tokenizer.text_words``), at least 12.
    """
    from PIL import Image

    if len(words) < 12:
        raise ValueError(f"write_length_skewed_dataset: {len(words)} words; expected at least 12")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n_samples):
        n_words = int(np.clip(round(median_words * float(np.exp(rng.normal()))), 1, max_words))
        question = " ".join(words[int(k)] for k in rng.integers(0, len(words), n_words))
        answer = " ".join(words[int(k)] for k in rng.integers(0, len(words), int(rng.integers(1, 5))))
        n_images = 0 if rng.random() < text_only else (2 if rng.random() < two_images else 1)
        images = []
        for j in range(n_images):
            height, width = SKEWED_IMAGE_SIZES[int(rng.integers(0, len(SKEWED_IMAGE_SIZES)))]
            pixels = rng.integers(0, 256, (height, width, 3)).astype(np.uint8)
            Image.fromarray(pixels).save(root / f"skewed{i}_{j}.png")
            images.append(f"skewed{i}_{j}.png")
        record: dict[str, Any] = {"conversations": [{"from": "human", "value": "<image>\n" * n_images + question},
                                                    {"from": "gpt", "value": answer}]}
        if images:
            record["images"] = images
        lines.append(record)
    path = root / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


#: the record kinds of :func:`write_mixed_dataset`: one image of odd size (17 x 29), two images
#: (16 x 24 and 24 x 16), text only, two exchanges (an image in the first), one video (8 frames of
#: 32 x 32 at 4 fps, MPEG-4 in an ``.mp4``).
MIXED_KINDS: tuple[str, ...] = ("odd", "two", "text", "multi", "video")


def write_video(path: str | Path, *, frames: int = 8, size: int = 32, rate: int = 4, seed: int = 0) -> Path:
    """``frames`` random frames of ``size x size`` pixels at ``rate`` frames a second, MPEG-4 (PyAV)."""
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for _ in range(frames):
            picture = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return Path(path)


def _mixed_record(kind: str, i: int, root: Path, words: list[str], rng: np.random.Generator) -> dict[str, Any]:
    from PIL import Image

    def say(n: int) -> str:
        return " ".join(words[int(k)] for k in rng.integers(0, len(words), n))

    def image(name: str, height: int, width: int) -> str:
        Image.fromarray(rng.integers(0, 256, (height, width, 3)).astype(np.uint8)).save(root / name)
        return name

    turns = [{"from": "human", "value": say(2)}, {"from": "gpt", "value": say(2)}]
    if kind == "odd":
        return {"image": image(f"odd{i}.png", 17, 29), "conversations": [
            {"from": "human", "value": "<image>\n" + say(2)}, turns[1]]}
    if kind == "two":
        return {"images": [image(f"two{i}a.png", 16, 24), image(f"two{i}b.png", 24, 16)], "conversations": [
            {"from": "human", "value": "<image>\n<image>\n" + say(1)}, turns[1]]}
    if kind == "text":
        return {"conversations": turns}
    if kind == "multi":
        return {"image": image(f"multi{i}.png", 24, 24), "conversations": [
            {"from": "human", "value": "<image>\n" + say(1)}, {"from": "gpt", "value": say(1)},
            {"from": "human", "value": say(3)}, {"from": "gpt", "value": say(2)}]}
    if kind == "video":
        write_video(root / f"clip{i}.mp4", seed=i)
        return {"video": f"clip{i}.mp4", "conversations": [{"from": "human", "value": "<video>\n" + say(2)}, turns[1]]}
    raise ValueError(f"write_mixed_dataset: record kind {kind!r}; expected one of {', '.join(MIXED_KINDS)}")


def write_mixed_dataset(folder: str | Path, kinds: list[str] | tuple[str, ...], *, words: list[str], seed: int = 0,
                        name: str = "mixed.jsonl") -> Path:
    """One LLaVA-style record per entry of ``kinds`` (:data:`MIXED_KINDS`), in that order, in
    ``folder/name`` (media beside it, relative paths): the record kinds a user's dataset mixes.

    Args:
        words: the tokenizer's plain words (``ppmedia.testing.word_tokenizer.text_words``).
    """
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = [_mixed_record(kind, i, root, list(words), rng) for i, kind in enumerate(kinds)]
    path = root / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def main(argv: list[str] | None = None) -> None:
    """``python -m ppmedia.testing.datasets CHECKPOINT DATA [--samples N]``: the tiny Qwen2.5-VL
    checkpoint with its processor in ``CHECKPOINT``, ``N`` generated image-chat records in
    ``DATA/train.jsonl`` (images beside it)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ppmedia.testing.datasets", description=main.__doc__)
    parser.add_argument("checkpoint", help="folder for the tiny checkpoint and its processor")
    parser.add_argument("data", help="folder for train.jsonl and its images")
    parser.add_argument("--samples", type=int, default=16, help="records to write (default 16)")
    parser.add_argument("--family", default="qwen2_5_vl", help="the tiny family (one with a tiny processor)")
    parser.add_argument("--mixed", metavar="KIND,KIND,...",
                        help=f"write these record kinds ({','.join(MIXED_KINDS)}) instead of the image-chat records")
    args = parser.parse_args(argv)
    import transformers

    from .word_tokenizer import text_words

    kinds = args.mixed.split(",") if args.mixed else []
    unknown = [k for k in kinds if k not in MIXED_KINDS]
    if unknown:
        parser.error(f"--mixed {args.mixed}: unknown kind(s) {', '.join(unknown)}; expected some of {','.join(MIXED_KINDS)}")
    checkpoint = save_tiny_checkpoint(args.family, args.checkpoint)
    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    if "video" in kinds and getattr(processor, "video_processor", None) is None:
        parser.error(f"--mixed {args.mixed}: the tiny {args.family} processor ({type(processor).__name__}) takes no "
                     f"videos; leave 'video' out")
    words = text_words(processor.tokenizer)
    if args.mixed:
        path = write_mixed_dataset(args.data, args.mixed.split(","), words=words, name="train.jsonl")
        args.samples = len(args.mixed.split(","))
    else:
        path = write_image_chat_dataset(args.data, args.samples, words=words)
    print(f"wrote {checkpoint} (tiny {args.family} and its processor) and {path} ({args.samples} records)")


if __name__ == "__main__":  # pragma: no cover
    main()
