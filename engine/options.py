"""Documented dataclass fields. One declaration gives a config or sampling field its
default and its help text; the CLI flags and the HTTP schema are derived from it."""
from __future__ import annotations

from dataclasses import Field, field
from typing import Any


def option(default: Any, help: str, *, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


def help_of(f: Field) -> str:
    return f.metadata.get("help", "")
