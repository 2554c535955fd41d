"""Opening a dataset: a JSON / JSON Lines file, a ``datasets`` ``save_to_disk`` folder or a
``datasets.Dataset``, checked cheaply when opened (JSON, tags against media, media files exist)."""

from __future__ import annotations

import codecs
import json
import logging
import os
from typing import Any, Iterator

from .errors import DataError
from .records import KINDS, Record, parse_record

__all__ = ["RecordDataset", "open_dataset"]

log = logging.getLogger("ppmedia.data")


class RecordDataset:
    """The records of one source, by index (``ds[i]`` is a :class:`~ppmedia.data.records.Record`).

    Attributes:
        name: the file or folder (or ``"dataset"`` for an object).
        skipped: ``[(where, problem)]`` of the records left out when opened (``skip_bad_samples``).
    """

    def __init__(self, name: str, rows: Any, wheres: list[str], folders: list[str],
                 skipped: list[tuple[str, str]], index: list[int] | None = None) -> None:
        self.name = name
        self._rows = rows
        self._index = index
        self._wheres = wheres
        self._folders = folders
        self.skipped = skipped

    def __len__(self) -> int:
        return len(self._wheres)

    def __getitem__(self, i: int) -> Record:
        where = self._wheres[i]
        return parse_record(self._row(i), where, self._folders)

    def __iter__(self) -> Iterator[Record]:
        return (self[i] for i in range(len(self)))

    def where(self, i: int) -> str:
        """Record ``i``'s name (``FILE:LINE`` or ``NAME[INDEX]``)."""
        return self._wheres[i]

    def _row(self, i: int) -> Any:
        return self._rows[i if self._index is None else self._index[i]]


def _json_list(path: str, text: str) -> list[tuple[str, Any]]:
    """The items of a JSON list, each named ``FILE:LINE`` by the line it starts on."""
    decoder, rows = json.JSONDecoder(), list[tuple[str, Any]]()
    pos = len(text) - len(text.lstrip())
    try:
        if text[pos : pos + 1] != "[":
            raise DataError(path, "a .json file must hold a list of records")
        pos += 1
        while True:
            while text[pos : pos + 1].isspace() or text[pos : pos + 1] == ",":
                pos += 1
            if text[pos : pos + 1] == "]":
                return rows
            item, end = decoder.raw_decode(text, pos)
            rows.append((f"{path}:{text.count(chr(10), 0, pos) + 1}", item))
            pos = end
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}", f"not valid JSON: {e.msg} (column {e.colno})") from None


#: byte-order marks of the encodings JSON files come in besides UTF-8 (UTF-32's first: FF FE 00 00)
_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
         (codecs.BOM_UTF16_BE, "UTF-16"))
_EXPECTED = "JSON and JSON Lines files must be UTF-8: re-encode the file (e.g. iconv -t UTF-8)"


def _wide_text(path: str, raw: bytes) -> None:
    """:class:`DataError` for UTF-16 or UTF-32 text (a byte-order mark, or NUL bytes)."""
    for bom, name in _BOMS:
        if raw.startswith(bom):
            raise DataError(f"{path}:1", f"{name} text (byte-order mark {bom.hex(' ')}); {_EXPECTED}")
    nul = raw.find(b"\0", 0, 4096)
    if nul >= 0:
        line = raw.count(b"\n", 0, nul) + 1
        raise DataError(f"{path}:{line}", f"NUL bytes (UTF-16 or UTF-32 text?); {_EXPECTED}")


def _not_utf8(path: str, raw: bytes, at: int) -> DataError:
    """The error for the byte at offset ``at`` of ``raw``, which starts no UTF-8 character."""
    line, column = raw.count(b"\n", 0, at) + 1, at - raw.rfind(b"\n", 0, at)
    return DataError(f"{path}:{line}", f"not UTF-8: byte 0x{raw[at]:02x} at column {column} (Latin-1 or another "
                                       f"8-bit encoding?); {_EXPECTED}")


def _json_rows(path: str) -> list[tuple[str, Any]]:
    """``(FILE:LINE, record)`` per record; in JSON Lines a line that does not parse (or is not UTF-8)
    is a :class:`DataError` in place of its record (raised or skipped by the checks)."""
    with open(path, "rb") as f:
        raw = f.read()
    _wide_text(path, raw)
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    if path.endswith(".json") or raw.lstrip().startswith(b"["):
        try:
            return _json_list(path, raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise _not_utf8(path, raw, e.start) from None
    rows: list[tuple[str, Any]] = []
    offset = 0
    for n, line in enumerate(raw.split(b"\n"), 1):
        start, offset = offset, offset + len(line) + 1
        if not line.strip():
            continue
        try:
            rows.append((f"{path}:{n}", json.loads(line.decode("utf-8"))))
        except UnicodeDecodeError as e:
            rows.append((f"{path}:{n}", _not_utf8(path, raw, start + e.start)))
        except json.JSONDecodeError as e:
            rows.append((f"{path}:{n}", DataError(f"{path}:{n}", f"not valid JSON: {e.msg} (column {e.colno})")))
    return rows


def _missing_media(record: Record) -> str | None:
    for kind in KINDS:
        for item in record.media.get(kind, []):
            path = item if isinstance(item, str) else item.get("path") if isinstance(item, dict) and not item.get("bytes") else None
            if path is not None and not os.path.isfile(path):
                return f"{kind} file {path!r} does not exist"
    return None


def _check(rows: list[tuple[str, Any]], folders: list[str], skip: bool) -> tuple[list[int], list[tuple[str, str]]]:
    kept, skipped = [], []
    for k, (where, raw) in enumerate(rows):
        try:
            if isinstance(raw, DataError):
                raise raw
            problem = _missing_media(parse_record(raw, where, folders))
            if problem is not None:
                raise DataError(where, problem)
        except DataError as e:
            if not skip:
                raise
            log.warning("skipped %s", e)
            skipped.append((e.where, e.problem))
            continue
        kept.append(k)
    return kept, skipped


def _hf_dataset(source: Any) -> Any:
    import datasets

    ds = datasets.load_from_disk(source) if isinstance(source, (str, os.PathLike)) else source
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(str(source), f"a DatasetDict ({sorted(ds)}): open one split, e.g. ds['train']")
    for name, feature in ds.features.items():  # media stay undecoded bytes until a reading rank decodes them
        listed = isinstance(feature, datasets.List)
        inner = feature.feature if listed else feature
        if isinstance(inner, (datasets.Image, datasets.Audio)) and inner.decode:
            plain = type(inner)(decode=False)
            ds = ds.cast_column(name, datasets.List(plain) if listed else plain)
    return ds


def open_dataset(source: Any, media_dir: str | os.PathLike[str] | None = None, skip_bad_samples: bool = False) -> RecordDataset:
    """Opens and checks a dataset.

    Args:
        source: a ``.json`` (a list of records) or ``.jsonl`` file, a ``datasets`` ``save_to_disk``
            folder, or a ``datasets.Dataset``; records in the LLaVA or the messages style
            (:mod:`ppmedia.data.records`); ``datasets`` media as ``Image()`` features or paths.
        media_dir: where relative media paths are looked up first; then the data file's folder.
        skip_bad_samples: leave bad records out (each logged once, listed in ``.skipped``) instead of
            raising.

    Raises:
        DataError: naming ``FILE:LINE`` (or ``NAME[INDEX]``) and the problem: invalid JSON, no turns,
            an unknown role, more or fewer tags than media, a media file that does not exist.
    """
    folders = [os.fspath(media_dir)] if media_dir is not None else []
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        path = os.fspath(source)
        folders.append(os.path.dirname(os.path.abspath(path)))
        rows = _json_rows(path)
        kept, skipped = _check(rows, folders, skip_bad_samples)
        return RecordDataset(path, [rows[k][1] for k in kept], [rows[k][0] for k in kept], folders, skipped)
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "dataset"
    if isinstance(source, (str, os.PathLike)) and not os.path.isdir(source):
        raise DataError(name, "no such file or folder")
    if isinstance(source, (str, os.PathLike)):
        folders.append(os.path.abspath(name))
    ds = _hf_dataset(source)
    rows = [(f"{name}[{i}]", row) for i, row in enumerate(ds)]
    kept, skipped = _check(rows, folders, skip_bad_samples)
    return RecordDataset(name, ds, [rows[k][0] for k in kept], folders, skipped, kept)
