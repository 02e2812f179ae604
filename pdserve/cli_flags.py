"""argparse flags derived from documented dataclasses (`engine.options.option`): a
field's flag name, type, default, choices and help come from its one declaration,
the way vLLM derives its engine flags from EngineArgs."""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import Field, fields

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.options import help_of

_NESTED = ("model", "scheduler", "cache")  # EngineConfig fields that are no flag


def add_flags(group, cls, exclude: tuple[str, ...] = (),
              only: tuple[str, ...] | None = None) -> list[str]:
    """One --flag-name per field of `cls` (those in `only`, when given); returns the
    field names added."""
    hints = typing.get_type_hints(cls)
    names = []
    for f in fields(cls):
        if f.name not in exclude and (only is None or f.name in only):
            _add(group, f, _scalar(hints[f.name]))
            names.append(f.name)
    return names


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (vLLM's names and meanings)")
    for cls in (EngineConfig, SchedulerConfig, CacheConfig):
        add_flags(group, cls, exclude=_NESTED)


def engine_config(args: argparse.Namespace, model: str, **overrides) -> EngineConfig:
    kwargs = {f.name: getattr(args, f.name) for f in EngineConfig.flat_fields()}
    return EngineConfig.from_kwargs(model, **{**kwargs, **overrides})


def values(args: argparse.Namespace, cls, only: tuple[str, ...] | None = None) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(cls)
            if only is None or f.name in only}


def _add(group, f: Field, kind) -> None:
    flag = "--" + f.name.replace("_", "-")
    if kind is bool:  # --flag / --no-flag; argparse appends the default itself
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=help_of(f))
        return
    shown = "" if f.default is None else " (default: %(default)s)"
    group.add_argument(flag, type=kind, default=f.default, help=help_of(f) + shown,
                       choices=f.metadata.get("choices"))


def _scalar(hint):
    """int | None -> int; a flag's value is one scalar, or a config dataclass as JSON
    (--speculative-config '{"method": "ngram", ...}', as vLLM spells it)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if dataclasses.is_dataclass(hint):
        return _json_of(hint)
    if hint not in (int, float, str, bool):
        raise TypeError(f"no flag for a field of type {hint!r}")
    return hint


def _json_of(cls):
    def parse(text: str):
        try:
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError("must be a JSON object")
            return cls(**value)
        except (ValueError, TypeError) as err:
            raise argparse.ArgumentTypeError(f"{cls.__name__}: {err}") from None
    parse.__name__ = f"{cls.__name__} JSON"  # argparse names the type in its errors
    return parse
