"""Assistant-only labels from the chat template itself.

The template renders the record to text. Which characters are the assistant's comes from the
template, never from tokenising the reply on its own:

* a template with generation markers (``{% generation %}`` ... ``{% endgeneration %}``) marks them
  itself (transformers' ``return_assistant_tokens_mask`` spans): exactly the marked tokens are labels;
* otherwise the record is rendered a second time with a sentinel in place of each assistant reply;
  the template text around the sentinels must equal the real rendering around the replies, which
  gives each reply's characters; its tokens plus the one token the template writes right after it
  (the end-of-turn token, e.g. ``<|im_end|>``) are labels.

The processor tokenises the same text but expands media placeholders (one ``<|image_pad|>`` becomes
one per feature); :func:`align` maps the text's tokens onto the processor's by their longest common
runs, so a label lands on the same token of the processor's ``input_ids``, whatever the expansion.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from .errors import DataError

__all__ = ["align", "has_generation_markers", "label_token_mask", "render"]

_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SENTINEL = "\u2063PPMEDIA_REPLY_{}\u2063"


def _template(processor: Any) -> str:
    template = processor.chat_template
    return str(template["default"] if isinstance(template, dict) else template)  # named templates: the default


def has_generation_markers(template: str) -> bool:
    """Whether ``template`` marks the assistant's text with ``{% generation %}``."""
    return bool(_MARKER.search(template))


def _render(processor: Any, messages: list[dict[str, Any]], markers: bool, where: str) -> tuple[str, list[tuple[int, int]]]:
    from transformers.utils.chat_template_utils import render_jinja_template

    tokenizer = getattr(processor, "tokenizer", processor)
    try:
        prompts, spans = render_jinja_template(
            conversations=[messages], chat_template=_template(processor),
            return_assistant_tokens_mask=markers, **tokenizer.special_tokens_map)
    except Exception as e:  # jinja2's TemplateError (raise_exception in the template) and the like
        raise DataError(where, f"the chat template refuses this record ({type(e).__name__}: {e})") from None
    return prompts[0], [(int(s[0]), int(s[1])) for s in (spans[0] if spans else [])]


def render(processor: Any, messages: list[dict[str, Any]], where: str) -> tuple[str, list[tuple[int, int]], bool]:
    """The rendered text, the assistant's character spans ``[(start, end)]`` in it, and whether they
    come from generation markers (then they already cover what the template marks, end of turn
    included or not); :class:`DataError` if the template refuses the record or changes a reply."""
    if has_generation_markers(_template(processor)):
        text, spans = _render(processor, messages, True, where)
        return text, spans, True
    text, _ = _render(processor, messages, False, where)
    replies, sentinel_messages = [], []
    for m in messages:
        if m["role"] == "assistant":
            replies.append("".join(p["text"] for p in m["content"]))
            m = {**m, "content": [{"type": "text", "text": _SENTINEL.format(len(replies) - 1)}]}
        sentinel_messages.append(m)
    framed, _ = _render(processor, sentinel_messages, False, where)
    pieces = re.split("\u2063PPMEDIA_REPLY_\\d+\u2063", framed)
    if len(pieces) != len(replies) + 1:
        raise DataError(where, f"the chat template renders {len(pieces) - 1} of {len(replies)} assistant replies")
    for strip in (False, True):  # the reply as given, or as a template that trims it writes it
        shown = [r.strip() if strip else r for r in replies]
        if "".join(p + s for p, s in zip(pieces, shown + [""])) == text:
            spans, pos = [], 0
            for p, s in zip(pieces, shown):
                pos += len(p)
                spans.append((pos, pos + len(s)))
                pos += len(s)
            return text, spans, False
    raise DataError(where, "the chat template rewrites the assistant replies: their tokens cannot be found "
                           "(add {% generation %} markers to the template)")


def label_token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]], end_of_turn: bool) -> list[bool]:
    """Per token of the rendered text (``offsets``: its ``(start, end)`` characters), whether it is a
    label: it overlaps an assistant span, or (``end_of_turn``) it is the first token after one."""
    mask = [False] * len(offsets)
    for start, end in spans:
        last = -1
        for i, (a, b) in enumerate(offsets):
            if b > a and a < end and b > start:
                mask[i] = True
                last = i
        if end_of_turn:
            after = [i for i, (a, b) in enumerate(offsets) if b > a and a >= end and i > last]
            if after:
                mask[after[0]] = True
    return mask


def align(text_ids: list[int], ids: list[int], where: str, needed: list[int]) -> dict[int, int]:
    """Position in ``ids`` (the processor's, media expanded) of each position ``needed`` of
    ``text_ids`` (the rendered text's tokens); :class:`DataError` if one has no counterpart."""
    matcher = difflib.SequenceMatcher(None, text_ids, ids, autojunk=False)
    where_in: dict[int, int] = {}
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            where_in[a + k] = b + k
    lost = [i for i in needed if i not in where_in]
    if lost:
        raise DataError(where, f"{len(lost)} assistant token(s) of the rendered text are not in the processor's "
                               "input_ids (its media expansion changed them)")
    return {i: where_in[i] for i in needed}
