"""Package attributes that import their module on first use, so importing a package stays cheap (no torch, fastapi
or Ray until a name that needs them is touched)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any],
                 on_missing: Callable[[str, ModuleNotFoundError], Exception] | None = None):
    """`(__getattr__, __dir__)` for a package whose public names (`exports`: name -> module) load on first use.

    A loaded name is stored in the package's `namespace`, so later lookups skip `__getattr__`. `on_missing(name, err)`
    turns a missing optional dependency into the error to raise (e.g. which extra to install).
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            value = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as err:
            if on_missing is None:
                raise
            raise on_missing(name, err) from err
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *exports])

    return __getattr__, __dir__
