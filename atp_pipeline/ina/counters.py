"""Integer counters named by ``__slots__``: the roles' statistics (switch, PS, workers)."""

from __future__ import annotations

from typing import Dict, Tuple


class Counters:
    """Subclasses list their counter names in ``__slots__``; all start at 0."""

    __slots__: Tuple[str, ...] = ()

    def __init__(self) -> None:
        for s in self.__slots__:
            setattr(self, s, 0)

    def as_dict(self) -> Dict[str, int]:
        return {s: getattr(self, s) for s in self.__slots__}
