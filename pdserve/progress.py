"""Progress bars for the long commands (tqdm, on stderr): silent when stderr is not a
terminal, or when the command was asked to be quiet (--quiet)."""
from __future__ import annotations

from tqdm import tqdm


def bar(total: int | None, desc: str, unit: str, quiet: bool = False) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True,
                disable=True if quiet else None)  # None: off when not a terminal
