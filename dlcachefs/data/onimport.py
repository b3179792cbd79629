"""Patch a module of the training's libraries right after it is imported (the torch hook's
samplers, interception's ``torchvision.io``), without importing it ourselves."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


class PatchOnImport(importlib.abc.MetaPathFinder):
    """A meta path finder (one shot, put first on ``sys.meta_path``) that runs
    ``patch(module)`` right after module ``name`` is executed; an exception of ``patch``
    goes to ``on_error``, never to the import."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None],
                 on_error: Callable[[Exception], None]) -> None:
        self.name = name
        self.patch = patch
        self.on_error = on_error

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # (find_spec below would ask us again)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        orig_exec = spec.loader.exec_module

        def exec_module(module):
            orig_exec(module)
            try:
                self.patch(module)
            except Exception as e:  # noqa: BLE001 - never break the training's import
                self.on_error(e)

        spec.loader.exec_module = exec_module
        return spec
