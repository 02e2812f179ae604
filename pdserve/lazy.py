"""A package whose public names load on first use (PEP 562): `import pdserve` (the
SDK: no torch, no Ray) and `import pdserve.kv_transfer` (its settings: no torch)."""
from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_names(package: str, names: dict[str, str], namespace: dict
               ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The package's `__getattr__` and `__dir__`: each of `names` (public name -> the
    module that defines it) imported when first asked for, then kept in `namespace`
    (the package's globals()), so the next access skips the hook."""
    def __getattr__(name: str):
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
