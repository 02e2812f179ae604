"""Where a model name points: a local HF directory, or `tiny` (built and cached here)."""
from __future__ import annotations

from pathlib import Path

from pdserve.engine.tiny_model import tiny_model_dir

TINY_NAME = "tiny"


def resolve_model_path(model: str) -> Path:
    if model == TINY_NAME:
        return tiny_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r} is not a local HuggingFace directory with config.json "
            f"(nothing is downloaded; pass a directory or {TINY_NAME!r})")
    return path.resolve()
