"""Documented dataclass fields. One declaration gives a config or sampling field its
default and its help text; the CLI flags and the HTTP schema are derived from it."""
from __future__ import annotations

from dataclasses import Field, field
from typing import Any

BOUNDS = ("ge", "gt", "le")  # pydantic's names: >=, >, <=


def option(default: Any, help: str, *, choices: tuple | None = None,
           ge: float | None = None, gt: float | None = None, le: float | None = None) -> Any:
    """A field with its help text, and the range a number must lie in (checked where
    the dataclass validates itself, and stated in the HTTP schema)."""
    bounds = {name: value for name, value in zip(BOUNDS, (ge, gt, le)) if value is not None}
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "bounds": bounds})


def help_of(f: Field) -> str:
    return f.metadata.get("help", "")


def bounds_of(f: Field) -> dict[str, float]:
    """{"ge"|"gt"|"le": limit} for a bounded number field; {} otherwise."""
    return dict(f.metadata.get("bounds", {}))


def bounds_text(bounds: dict[str, float]) -> str:
    """The range in words, e.g. "in (0, 1]" or ">= 0"."""
    low = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds.get("gt"))
    if "le" in bounds and low[1] is not None:
        return f"in {low[0]}{low[1]:g}, {bounds['le']:g}]"
    if "le" in bounds:
        return f"<= {bounds['le']:g}"
    return f"{'>=' if low[0] == '[' else '>'} {low[1]:g}"


def within(value: float, bounds: dict[str, float]) -> bool:
    return (value >= bounds.get("ge", value) and value <= bounds.get("le", value)
            and ("gt" not in bounds or value > bounds["gt"]))
