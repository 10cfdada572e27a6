"""A library imported when it is first used rather than when the module naming it is: grain and Orbax
(and jaxlm's grain pipelines) are a large part of every command's start after JAX, and a command that
refuses its config, its flags or its paths at start-up does so without them.

    grain = lazy.module("grain")  # instead of `import grain`: `grain.MapDataset` imports it

Only for names used inside functions: a class that derives from the library's (a grain iterator)
lives in a module that imports it at the top (`jaxlm.data.streams`).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _Module:
    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported when first used>"


def module(name: str) -> Any:
    """The module `name`, imported at the first use of one of its attributes."""
    return _Module(name)
