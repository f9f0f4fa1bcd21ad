"""Packages whose public names are imported on first use (PEP 562), so importing the package costs nothing.

    __all__ = list(EXPORTS)                              # EXPORTS: public name -> the module defining it
    __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`: a name of `exports` is imported from its module
    when first looked up and kept in the package's namespace, so later lookups are plain attribute reads."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
