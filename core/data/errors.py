"""The one error a bad record raises (:class:`DataError`), naming where the record is."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """A bad record: ``where`` is ``"FILE:LINE"`` (JSON Lines; ``FILE:ITEM`` for a JSON list, 1-based)
    or ``"NAME[INDEX]"`` (a ``datasets`` dataset, 0-based); the message names it and the problem."""

    def __init__(self, where: str, problem: str | None = None) -> None:
        # one argument: a whole message (a DataLoader worker re-raises its errors that way)
        super().__init__(where if problem is None else f"{where}: {problem}")
        self.where = where
        self.problem = "" if problem is None else problem

    def __reduce__(self) -> tuple[type[DataError], tuple[str, str]]:  # pickles with both parts
        return (type(self), (self.where, self.problem))
