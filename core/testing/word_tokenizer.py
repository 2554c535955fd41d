"""A real word-level tokenizer for a tiny model, and chat templates in the families' styles.

:func:`word_tokenizer` builds a ``transformers`` ``PreTrainedTokenizerFast`` from a ``tokenizers``
``models.WordLevel`` vocabulary with a ``pre_tokenizers.WhitespaceSplit`` pre-tokenizer, no hub access:
its special tokens (media placeholders, media start/end, pad, eos, chat role markers) carry the tiny
model's ids, and they are matched before the whitespace split, so ``"<|vision_start|><|image_pad|>"``
gives two ids. Every other id of the vocabulary is a word: the role names (``user``, ``assistant``,
``system``, ``model``) and then ``w0``, ``w1``, ... (:func:`text_words`); anything else is the unknown
token.

:func:`chat_template` writes a Jinja chat template in one of the styles of :data:`CHAT_STYLES`, with the
family's media markup for ``{"type": "image"}`` / ``"video"`` / ``"audio"`` content items.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["CHAT_STYLES", "ROLE_WORDS", "TokenizerSpec", "chat_template", "text_words", "word_tokenizer"]

#: words every tiny vocabulary holds first, after the special tokens: the chat templates' role names.
ROLE_WORDS: tuple[str, ...] = ("user", "assistant", "system", "model")


@dataclass(frozen=True)
class TokenizerSpec:
    """What a tiny tokenizer holds.

    Attributes:
        vocab_size: the model's vocabulary size; ids ``0 .. vocab_size - 1`` are all used.
        special: special token string -> id (the model's config ids).
        pad: the pad token (one of ``special``).
        eos: the end-of-sequence token (one of ``special``), or ``None``.
        bos: the start token (one of ``special``), or ``None``.
        attributes: extra special-token attributes the processor reads from the tokenizer
            (``{"image_token": "<|image_pad|>"}`` gives ``tokenizer.image_token`` and
            ``tokenizer.image_token_id``).
        unk: the unknown token; given the first free id when it is not in ``special``.
    """

    vocab_size: int
    special: Mapping[str, int]
    pad: str
    eos: str | None = None
    bos: str | None = None
    attributes: Mapping[str, str] = field(default_factory=dict)
    unk: str = "<unk>"


def _vocabulary(spec: TokenizerSpec) -> dict[str, int]:
    taken = set(spec.special.values())
    if len(taken) != len(spec.special):
        raise ValueError(f"tiny tokenizer: special tokens share ids: {dict(spec.special)}")
    bad = {t: i for t, i in spec.special.items() if not 0 <= i < spec.vocab_size}
    if bad:
        raise ValueError(f"tiny tokenizer: special ids {bad} outside the vocabulary 0..{spec.vocab_size - 1}")
    for name in ("pad", "eos", "bos"):
        token = getattr(spec, name)
        if token is not None and token not in spec.special:
            raise ValueError(f"tiny tokenizer: {name} token {token!r} is not one of the special tokens {sorted(spec.special)}")
    vocab = dict(spec.special)
    free = (i for i in range(spec.vocab_size) if i not in taken)
    words = [w for w in (spec.unk, *ROLE_WORDS) if w not in vocab]
    for word in words:
        vocab[word] = next(free)
    for k, i in enumerate(free):
        vocab[f"w{k}"] = i
    return vocab


def word_tokenizer(spec: TokenizerSpec) -> Any:
    """A ``PreTrainedTokenizerFast`` over ``spec``'s vocabulary (see the module docstring).

    Raises:
        ValueError: two special tokens share an id, an id lies outside the vocabulary, or pad / eos /
            bos is not a special token.
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _vocabulary(spec)
    backend = Tokenizer(models.WordLevel(vocab, unk_token=spec.unk))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in spec.special])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=spec.unk,
        pad_token=spec.pad,
        eos_token=spec.eos,
        bos_token=spec.bos,
        extra_special_tokens=dict(spec.attributes),
        model_max_length=1 << 16,
    )


def text_words(tokenizer: Any) -> list[str]:
    """The plain words of a :func:`word_tokenizer` vocabulary (``w0``, ``w1``, ...), in id order."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    return sorted((w for w in vocab if w[:1] == "w" and w[1:].isdigit()), key=vocab.__getitem__)


#: chat styles :func:`chat_template` writes: (turn start, turn end) around ``role`` and the content.
CHAT_STYLES: dict[str, tuple[str, str]] = {
    "chatml": ("<|im_start|>{role}\n", "<|im_end|>\n"),  # Qwen, InternVL, MiniMax, ...
    "gemma": ("<start_of_turn>{role}\n", "<end_of_turn>\n"),
    "llama": ("<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>"),
    "llama4": ("<|header_start|>{role}<|header_end|>\n\n", "<|eot|>"),
    "idefics": ("{role}\n", "<end_of_utterance>\n"),  # Idefics3, SmolVLM ("User:...<end_of_utterance>")
    "inst": ("[INST] ", " [/INST]"),  # Mistral / LLaVA-NeXT (Mistral), Pixtral
    "plain": ("{role}\n", "\n"),  # the role word on its own line (LLaVA 1.5 "USER: ...", Idefics "User:...")
}


def chat_template(style: str, media: Mapping[str, str], *, bos: str = "", role_map: Mapping[str, str] | None = None) -> str:
    """A Jinja chat template: ``bos``, then per message the style's turn start (``{role}`` its role,
    renamed by ``role_map``), its content (a string, or items: ``{"type": "text", "text": ...}`` and
    ``{"type": m}`` for each media kind ``m`` of ``media``, written as ``media[m]``), the turn end.
    ``add_generation_prompt`` opens an ``assistant`` turn (renamed the same way).

    Raises:
        ValueError: an unknown style (not in :data:`CHAT_STYLES`).
    """
    if style not in CHAT_STYLES:
        raise ValueError(f"chat style {style!r}: expected one of {sorted(CHAT_STYLES)}")
    # newlines as expressions: transformers renders templates with trim_blocks, which would drop a
    # newline that follows a block tag
    start, end = (part.replace("\n", "{{ '\\n' }}") for part in CHAT_STYLES[style])
    roles = dict(role_map or {})

    def role(expr: str) -> str:
        mapped = "".join(f"{{% if {expr} == '{a}' %}}{b}{{% endif %}}" for a, b in roles.items())
        plain = f"{{{{ {expr} }}}}" if not roles else f"{{% if {expr} not in {list(roles)!r} %}}{{{{ {expr} }}}}{{% endif %}}"
        return mapped + plain

    def turn(expr: str) -> str:
        return start.replace("{role}", role(expr))

    items = "".join(f"{{% elif c['type'] == '{kind}' %}}{markup}" for kind, markup in media.items())
    content = (
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'text' %}{{ c['text'] }}" + items + "{% endif %}{% endfor %}{% endif %}"
    )
    return (
        bos + "{% for m in messages %}" + turn("m['role']") + content + end + "{% endfor %}"
        "{% if add_generation_prompt %}" + turn("'assistant'") + "{% endif %}"
    )
