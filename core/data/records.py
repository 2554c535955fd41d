"""One training record in one form, from either JSON style: the turns and the media they refer to.

LLaVA style: ``conversations`` (``from`` = ``system`` / ``human`` / ``gpt``, ``value``) with
``image`` / ``images``, ``video`` / ``videos``, ``audio`` / ``audios``. Messages style: ``messages``
(``role`` = ``system`` / ``user`` / ``assistant``, ``content`` a string or a list of parts) with
``images`` / ``videos`` / ``audios`` lists. In text, each ``<image>`` / ``<video>`` / ``<audio>`` tag
(and each ``{"type": "image"}`` part) takes the record's next item of that kind, in order over all turns.

Or inline, as Qwen's and TRL's users write them: each media part holds its file,
``{"type": "image", "image": "a.png"}`` (also ``"path"`` or ``"url"`` in place of ``"image"``,
transformers' chat format), ``{"type": "video", "video": "v.mp4"}``, ``{"type": "audio", "audio":
"a.wav"}``, ``{"type": "image_url", "image_url": {"url": "file:///data/a.png"}}`` and ``video_url``
likewise (a path, or a ``file://`` URL; remote URLs are refused). A record gives its media one way:
inline parts next to top-level lists, or next to tags without a file, are an error naming it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import unquote

from .errors import DataError

__all__ = ["KINDS", "Record", "URL_TYPES", "parse_record"]

#: the media kinds, as ``type`` of a content part and as the tag in text (``<image>``)
KINDS = ("image", "video", "audio")
_TAG = re.compile(r"<(image|video|audio)>")
#: content part types that hold a media URL (or path): the kind they are
URL_TYPES = {"image_url": "image", "video_url": "video"}
_REMOTE = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*://|data:)")
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


def _local(value: str, where: str, turn: int) -> str:
    """A path from an inline reference: ``file://`` URLs become paths; remote URLs are refused."""
    if value.startswith("file://"):
        rest = value[len("file://"):]
        return unquote(rest[len("localhost"):] if rest.startswith("localhost/") else rest)
    if _REMOTE.match(value):
        raise DataError(where, f"turn {turn}: {value[:60]!r} is a URL, not a local file: ppmedia reads local files "
                               "(save it and give its path)")
    return value


def _inline(part: Mapping[str, Any], kind: str, where: str, turn: int) -> Any:
    """The media item a content part holds inline (a path, a ``datasets`` bytes dict, an image
    object), or ``None`` for a bare slot (``{"type": "image"}``)."""
    if part["type"] in URL_TYPES:
        value = part.get(part["type"])
        value = value.get("url") if isinstance(value, Mapping) else value
        if value is None:
            raise DataError(where, f"turn {turn}: an {part['type']!r} part without a url")
    else:
        value = next((part[key] for key in (kind, "path", "url") if part.get(key) is not None), None)
    return _local(value, where, turn) if isinstance(value, str) else value


def _content(where: str, turn: int, content: Any) -> list[dict[str, Any]]:
    """The turn's parts; a media part that holds its item inline carries it under ``"item"``."""
    if isinstance(content, str):
        return _parts(content)
    if not isinstance(content, list):
        raise DataError(where, f"turn {turn}: content is {type(content).__name__}, expected a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts += _parts(part["text"])
        elif isinstance(kind, str) and (kind in KINDS or kind in URL_TYPES):
            media = URL_TYPES.get(kind, kind)
            item = _inline(part, media, where, turn)
            parts.append({"type": media} if item is None else {"type": media, "item": item})
        else:
            raise DataError(where, f"turn {turn}: content part {part!r} is neither text nor one of "
                                   f"{KINDS + tuple(URL_TYPES)}")
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


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _inline_media(record: Record, raw: Mapping[str, Any]) -> dict[str, list[Any]] | None:
    """The media the turns hold inline, per kind in slot order (taken out of the parts), or ``None``
    when no part holds one; :class:`DataError` if the record also gives media otherwise."""
    inline: dict[str, list[Any]] = {}
    first = bare = None
    for turn, message in enumerate(record.messages):
        for part in message["content"]:
            if part["type"] == "text":
                continue
            if "item" in part:
                inline.setdefault(part["type"], []).append(part.pop("item"))
                first = (turn, part["type"]) if first is None else first
            elif bare is None:
                bare = (turn, part["type"])
    if first is None:
        return None
    listed = [key for kind in KINDS for key in (kind, kind + "s") if raw.get(key) not in (None, [], ())]
    if listed:
        raise DataError(record.where, f"turn {first[0]} holds its {first[1]} inline and the record has a top-level "
                                      f"{listed[0]!r} list: give the media one way (inline in the turns, or in lists)")
    if bare is not None:
        raise DataError(record.where, f"turn {bare[0]} has {_a(bare[1])} slot without a file (an <{bare[1]}> tag or a "
                                      f"bare part) while turn {first[0]} holds its {first[1]} inline: give the media "
                                      "one way (inline in the turns, or in lists)")
    return inline


def parse_record(raw: Any, where: str, folders: list[str] | None = None) -> Record:
    """``raw`` (a decoded JSON object or a ``datasets`` row) as a :class:`Record`; relative media paths
    are looked up in ``folders`` in order. Raises :class:`DataError` (naming ``where``) for a missing
    turn list, an unknown role, no assistant turn, tags that do not match the media in number, a
    remote URL, or media given both inline and in lists (or next to slots without a file)."""
    if not isinstance(raw, Mapping):
        raise DataError(where, f"a record is {type(raw).__name__}, expected a JSON object")
    record = Record(where, _turns(raw, where))
    inline = _inline_media(record, raw)
    for kind in KINDS:
        found = _items(raw, kind) if inline is None else inline.get(kind, [])
        items = [_resolve(item, folders or []) for item in found]
        tags = record.slots(kind)
        if tags != len(items):
            raise DataError(where, f"{tags} <{kind}> tag(s) in the turns but {len(items)} {kind}(s) in the record")
        if items:
            record.media[kind] = items
    return record
