"""Per-rank timelines of one pipeline step, drawn as a dependency-free SVG.

A :class:`Timeline` is a list of :class:`Bar` objects, each one operation on one pipeline rank in the
order that rank ran it: the schedule's forwards (``F``), backwards (``B``; split-backward schedules
run an input-gradient part ``I`` and a weight-gradient part ``W``), and the vision work around them
(``E``: the vision tower's forward of a microbatch, ``V``: its backward; ``S`` / ``R``: the encoder
spread's parameter broadcast and gradient reduction). Overlays are drawn as strips along the foot of
the rank's row: ``wait`` (the first stage waiting for a microbatch's features inside its forward),
``EI`` (a vision forward the first stage runs inside its forward, taken back from its lane), ``LE`` /
``LV`` (a vision forward / backward on the spread's background lane, which runs in the rank's idle
time: a measured one spans from its start to its end, preemptions included; a predicted one is drawn
in the pieces the model gives it). Time in which a rank neither works nor its lane does is a bubble.

Predicted timelines come from :func:`ppmedia.planning.stepmodel.predict_step`, measured ones from
:class:`ppmedia.pipeline.trace.StepTracer`. :func:`render_svg` draws a grid of them (e.g. predicted
next to measured, one row per placement of the vision work) on one time scale, so bars compare by
length across panels. Every bar is a ``<rect>`` carrying ``data-rank``, ``data-seq`` (its position in
the rank's order), ``data-kind``, ``data-stage`` and ``data-mb`` attributes, and a ``<title>``
tooltip with its times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence
from xml.sax.saxutils import escape, quoteattr

__all__ = ["BAR_KINDS", "Bar", "Timeline", "render_svg", "write_svg"]

#: what each bar kind is, and its colour.
BAR_KINDS: dict[str, tuple[str, str]] = {
    "F": ("forward", "#4e79a7"),
    "B": ("backward", "#f28e2b"),
    "I": ("backward, input gradient", "#ffbe7d"),
    "W": ("backward, weight gradient", "#59a14f"),
    "E": ("vision forward", "#b07aa1"),
    "V": ("vision backward", "#d37295"),
    "S": ("vision weights broadcast", "#9c9c9c"),
    "R": ("vision gradients reduce", "#79706e"),
    "wait": ("waiting for features", "#e15759"),
    "LE": ("vision forward, background lane", "#d4a6c8"),
    "EI": ("vision forward inside the forward (taken back from the lane)", "#b07aa1"),
    "LV": ("vision backward, background lane", "#8cd17d"),
}
_OVERLAYS = frozenset({"wait", "LE", "LV", "EI"})  # drawn as strips over the row, not counted as separate work


@dataclass(frozen=True)
class Bar:
    """One operation on one rank.

    Attributes:
        rank: the pipeline rank that ran it.
        kind: a key of :data:`BAR_KINDS`.
        start, end: seconds (or the model's units) from the step's start.
        stage: the pipeline stage (``-1`` for work outside the schedule).
        microbatch: the microbatch (``-1`` for per-step work).
    """

    rank: int
    kind: str
    start: float
    end: float
    stage: int = -1
    microbatch: int = -1

    @property
    def label(self) -> str:
        return self.kind if self.microbatch < 0 else f"{self.kind}{self.microbatch}"


@dataclass
class Timeline:
    """One step on ``ranks`` pipeline ranks.

    Attributes:
        title: shown above the panel.
        ranks: number of lanes.
        bars: the operations, each rank's in the order it ran them.
        unit: the unit of the times for the axis (``"s"`` is drawn as ms).
    """

    title: str
    ranks: int
    bars: list[Bar] = field(default_factory=list)
    unit: str = "s"

    @property
    def step_time(self) -> float:
        """From the first operation's start to the last one's end."""
        if not self.bars:
            return 0.0
        return max(b.end for b in self.bars) - min(b.start for b in self.bars)

    def lane(self, rank: int) -> list[Bar]:
        """Rank ``rank``'s work bars (no overlays), in its order."""
        return [b for b in self.bars if b.rank == rank and b.kind not in _OVERLAYS]

    def _busy(self, rank: int) -> list[Bar]:
        """What keeps ``rank`` busy: its work bars and its background lane's (not ``wait``)."""
        return [b for b in self.bars if b.rank == rank and b.kind != "wait"]

    def bubbles(self, rank: int) -> list[tuple[float, float]]:
        """The idle intervals of ``rank`` within the step (neither its own work nor its lane's)."""
        t0 = min((b.start for b in self.bars), default=0.0)
        t1 = t0 + self.step_time
        gaps, cursor = [], t0
        for bar in sorted(self._busy(rank), key=lambda b: b.start):
            if bar.start > cursor + 1e-12:
                gaps.append((cursor, bar.start))
            cursor = max(cursor, bar.end)
        if t1 > cursor + 1e-12:
            gaps.append((cursor, t1))
        return gaps

    @property
    def bubble(self) -> float:
        """The idle share of all ranks over the step: the time :meth:`bubbles` finds."""
        step = self.step_time
        if step <= 0 or self.ranks <= 0:
            return 0.0
        idle = sum(b - a for rank in range(self.ranks) for a, b in self.bubbles(rank))
        return min(1.0, max(0.0, idle / (self.ranks * step)))

    def shifted(self) -> "Timeline":
        """The same timeline with its first operation at 0."""
        t0 = min((b.start for b in self.bars), default=0.0)
        bars = [Bar(b.rank, b.kind, b.start - t0, b.end - t0, b.stage, b.microbatch) for b in self.bars]
        return Timeline(self.title, self.ranks, bars, self.unit)


# --------------------------------------------------------------------------------------------------
# drawing

_LANE, _GAP, _LEFT, _WIDTH, _TITLE = 20, 4, 70, 720, 34


def _scale(unit: str) -> tuple[float, str]:
    """Multiplier and label of the axis for times in ``unit``."""
    return (1e3, "ms") if unit == "s" else (1.0, unit)


def _ticks(span: float) -> list[float]:
    if span <= 0:
        return [0.0]
    raw = span / 6
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    return [i * step for i in range(int(span / step) + 1)]


def _panel(t: Timeline, x0: float, y0: float, span: float) -> tuple[list[str], float]:
    """SVG elements of one panel at ``(x0, y0)``; returns them and the panel's height."""
    mult, axis_unit = _scale(t.unit)
    px = _WIDTH / span if span > 0 else 0.0
    t = t.shifted()
    out = [f'<g class="panel" transform="translate({x0:.1f},{y0:.1f})">',
           f'<text x="0" y="14" class="title">{escape(t.title)}</text>',
           f'<text x="0" y="28" class="sub">step {t.step_time * mult:.4g} {axis_unit}, bubble {t.bubble:.0%}</text>']
    top = _TITLE
    for rank in range(t.ranks):
        y = top + rank * (_LANE + _GAP)
        out.append(f'<text x="{_LEFT - 6}" y="{y + 14}" class="lane" text-anchor="end">rank {rank}</text>')
        for a, b in t.bubbles(rank):
            out.append(f'<rect class="bubble" x="{_LEFT + a * px:.2f}" y="{y}" width="{max((b - a) * px, 0.0):.2f}" '
                       f'height="{_LANE}"><title>bubble {a * mult:.4g}-{b * mult:.4g} {axis_unit}</title></rect>')
        seq = 0
        several = len({b.stage for b in t.lane(rank) if b.stage >= 0}) > 1  # label as torch does: 2F3
        for bar in [b for b in t.bars if b.rank == rank]:
            name, colour = BAR_KINDS.get(bar.kind, (bar.kind, "#bab0ac"))
            overlay = bar.kind in _OVERLAYS
            height, dy = (_LANE // 4, _LANE - _LANE // 4) if overlay else (_LANE, 0)
            x, w = _LEFT + bar.start * px, max((bar.end - bar.start) * px, 0.5)
            tip = (f"rank {rank}" + (f" stage {bar.stage}" if bar.stage >= 0 else "") + f": {name}"
                   + (f", microbatch {bar.microbatch}" if bar.microbatch >= 0 else "")
                   + f", {bar.start * mult:.4g}-{bar.end * mult:.4g} {axis_unit}")
            attrs = (f'data-rank="{rank}" data-kind={quoteattr(bar.kind)} data-stage="{bar.stage}" '
                     f'data-mb="{bar.microbatch}"' + ("" if overlay else f' data-seq="{seq}"'))
            out.append(f'<rect class="{"overlay" if overlay else "bar"}" {attrs} x="{x:.2f}" y="{y + dy}" '
                       f'width="{w:.2f}" height="{height}" fill="{colour}"><title>{escape(tip)}</title></rect>')
            if not overlay:
                seq += 1
                label = f"{bar.stage}{bar.label}" if several and bar.stage >= 0 else bar.label
                if w >= 7 * len(label):
                    out.append(f'<text x="{x + w / 2:.2f}" y="{y + 14}" class="label" text-anchor="middle">{escape(label)}</text>')
    bottom = top + t.ranks * (_LANE + _GAP)
    out.append(f'<line x1="{_LEFT}" y1="{bottom}" x2="{_LEFT + _WIDTH}" y2="{bottom}" class="axis"/>')
    for tick in _ticks(span * mult):
        x = _LEFT + tick / mult * px
        out.append(f'<line x1="{x:.2f}" y1="{bottom}" x2="{x:.2f}" y2="{bottom + 4}" class="axis"/>')
        out.append(f'<text x="{x:.2f}" y="{bottom + 15}" class="tick" text-anchor="middle">{tick:g}</text>')
    out.append(f'<text x="{_LEFT + _WIDTH}" y="{bottom + 28}" class="tick" text-anchor="end">{axis_unit}</text>')
    out.append("</g>")
    return out, bottom + 32


def _legend(kinds: Iterable[str], y: float) -> list[str]:
    out, x = [], 10.0
    for kind in kinds:
        name, colour = BAR_KINDS[kind]
        out.append(f'<rect x="{x:.1f}" y="{y}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 16:.1f}" y="{y + 10}" class="tick">{escape(kind)}: {escape(name)}</text>')
        x += 26 + 6.2 * (len(kind) + len(name))
    out.append(f'<rect x="{x:.1f}" y="{y}" width="12" height="12" class="bubble"/>')
    out.append(f'<text x="{x + 16:.1f}" y="{y + 10}" class="tick">idle (bubble)</text>')
    return out


def render_svg(panels: Sequence[Sequence[Timeline]], title: str = "") -> str:
    """An SVG document of ``panels``: rows of timelines, side by side within a row, one time scale
    (the longest step) for all of them, a legend of the bar kinds that occur."""
    rows = [list(row) for row in panels if row]
    span = max((t.step_time for row in rows for t in row), default=0.0)
    units = {t.unit for row in rows for t in row}
    if len(units) > 1:
        raise ValueError(f"render_svg: timelines in different units {sorted(units)}; expected one")
    kinds = [k for k in BAR_KINDS if any(b.kind == k for row in rows for t in row for b in t.bars)]
    body: list[str] = []
    y = 24.0 if title else 4.0
    body += _legend(kinds, y)
    y += 24
    width = 0.0
    for row in rows:
        height = 0.0
        for column, timeline in enumerate(row):
            x0 = 10 + column * (_LEFT + _WIDTH + 30)
            elements, h = _panel(timeline, x0, y, span)
            body += elements
            height = max(height, h)
            width = max(width, x0 + _LEFT + _WIDTH + 20)
        y += height + 10
    head = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{max(width, 400):.0f}" height="{y:.0f}" '
        f'viewBox="0 0 {max(width, 400):.0f} {y:.0f}" font-family="sans-serif">',
        "<style>.title{font-size:13px;font-weight:bold}.sub,.tick,.lane{font-size:10px;fill:#333}"
        ".label{font-size:9px;fill:#fff}.bubble{fill:#ececec}.axis{stroke:#555;stroke-width:1}</style>",
        '<rect width="100%" height="100%" fill="#fff"/>',
    ]
    if title:
        head.append(f'<text x="10" y="16" class="title">{escape(title)}</text>')
    return "\n".join(head + body + ["</svg>", ""])


def write_svg(path: str, panels: Sequence[Sequence[Timeline]], title: str = "") -> None:
    """:func:`render_svg` into the file ``path`` (UTF-8)."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_svg(panels, title))
