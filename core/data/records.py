"""One training record in one form, from either JSON style: the turns and the media they refer to.

LLaVA style: ``conversations`` (``from`` = ``system`` / ``human`` / ``gpt``, ``value``) with
``image`` / ``images``, ``video`` / ``videos``, ``audio`` / ``audios``. Messages style: ``messages``
(``role`` = ``system`` / ``user`` / ``assistant``, ``content`` a string or a list of parts) with
``images`` / ``videos`` / ``audios`` lists. In text, each ``<image>`` / ``<video>`` / ``<audio>`` tag
takes the record's next item of that kind, in order over all turns.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import DataError

__all__ = ["KINDS", "Record", "parse_record"]

#: the media kinds, as ``type`` of a content part and as the tag in text (``<image>``)
KINDS = ("image", "video", "audio")
_TAG = re.compile(r"<(image|video|audio)>")
_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass
class Record:
    """One sample before processing.

    Attributes:
        where: ``"FILE:LINE"`` or ``"NAME[INDEX]"``: what errors and the log name.
        messages: the turns, ``{"role": "system" | "user" | "assistant", "content": [part, ...]}``
            where a part is ``{"type": "text", "text": str}`` or ``{"type": KIND}`` (a media slot).
        media: per kind, its items in tag order: a resolved file path (``str``), a ``datasets``
            ``{"bytes": ..., "path": ...}`` dict, or an in-memory object (a PIL image).
    """

    where: str
    messages: list[dict[str, Any]]
    media: dict[str, list[Any]] = field(default_factory=dict)

    def slots(self, kind: str) -> int:
        """How many media slots of ``kind`` the turns hold."""
        return sum(1 for m in self.messages for p in m["content"] if p["type"] == kind)


def _parts(text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    pos = 0
    for m in _TAG.finditer(text):
        if m.start() > pos:
            parts.append({"type": "text", "text": text[pos : m.start()]})
        parts.append({"type": m.group(1)})
        pos = m.end()
    if pos < len(text) or not parts:
        parts.append({"type": "text", "text": text[pos:]})
    return parts


def _content(where: str, turn: int, content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return _parts(content)
    if not isinstance(content, list):
        raise DataError(where, f"turn {turn}: content is {type(content).__name__}, expected a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts += _parts(part["text"])
        elif kind in KINDS:
            parts.append({"type": kind})
        else:
            raise DataError(where, f"turn {turn}: content part {part!r} is neither text nor one of {KINDS}")
    return parts


def _turns(raw: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    pairs: list[tuple[Any, Any]]
    if isinstance(raw.get("conversations"), list):
        pairs = [(t.get("from"), t.get("value")) if isinstance(t, Mapping) else (None, None) for t in raw["conversations"]]
    elif isinstance(raw.get("messages"), list):
        pairs = [(t.get("role"), t.get("content")) if isinstance(t, Mapping) else (None, None) for t in raw["messages"]]
    else:
        raise DataError(where, f"no 'conversations' or 'messages' list (keys: {sorted(raw)})")
    turns: list[dict[str, Any]] = []
    for i, (role, content) in enumerate(pairs):
        if role not in _ROLES:
            raise DataError(where, f"turn {i}: role {role!r}, expected one of {sorted(_ROLES)}")
        turns.append({"role": _ROLES[role], "content": _content(where, i, content)})
    if not any(t["role"] == "assistant" for t in turns):
        raise DataError(where, "no assistant turn: nothing to learn from")
    for t in turns:
        if t["role"] == "assistant" and any(p["type"] != "text" for p in t["content"]):
            raise DataError(where, "an assistant turn holds a media tag: only user and system turns may")
    return turns


def _items(raw: Mapping[str, Any], kind: str) -> list[Any]:
    items: list[Any] = []
    for key in (kind, kind + "s"):
        value = raw.get(key)
        if value is None:
            continue
        items += list(value) if isinstance(value, (list, tuple)) else [value]
    return items


def _resolve(item: Any, folders: list[str]) -> Any:
    if not isinstance(item, str) or os.path.isabs(item):
        return item
    for folder in folders:  # media_dir first, then the data file's folder
        path = os.path.join(folder, item)
        if os.path.exists(path):
            return path
    return os.path.join(folders[0], item) if folders else item


def parse_record(raw: Any, where: str, folders: list[str] | None = None) -> Record:
    """``raw`` (a decoded JSON object or a ``datasets`` row) as a :class:`Record`; relative media paths
    are looked up in ``folders`` in order. Raises :class:`DataError` (naming ``where``) for a missing
    turn list, an unknown role, no assistant turn, or tags that do not match the media in number."""
    if not isinstance(raw, Mapping):
        raise DataError(where, f"a record is {type(raw).__name__}, expected a JSON object")
    record = Record(where, _turns(raw, where))
    for kind in KINDS:
        items = [_resolve(item, folders or []) for item in _items(raw, kind)]
        tags = record.slots(kind)
        if tags != len(items):
            raise DataError(where, f"{tags} <{kind}> tag(s) in the turns but {len(items)} {kind}(s) in the record")
        if items:
            record.media[kind] = items
    return record
