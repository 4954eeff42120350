"""Old import paths of modules moved into sub-packages.

``import kvjax.theory`` or ``from kvjax import decode`` still work: a finder maps each
old name in :data:`MOVED` to the module at its new path, and both names refer to the
same module object (so monkeypatching either patches both).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

MOVED = {
    "kvjax.layers": "kvjax.models.layers",
    "kvjax.attention": "kvjax.models.attention",
    "kvjax.mla": "kvjax.models.mla",
    "kvjax.model": "kvjax.models.model",
    "kvjax.convert": "kvjax.models.convert",
    "kvjax.decode": "kvjax.inference.decode",
    "kvjax.runner": "kvjax.inference.runner",
    "kvjax.theory": "kvjax.analysis.theory",
    "kvjax.hardware": "kvjax.analysis.hardware",
    "kvjax.hlo_cost": "kvjax.analysis.hlo_cost",
    "kvjax.roofline": "kvjax.analysis.roofline",
    "kvjax.costs": "kvjax.analysis.costs",
    "kvjax.data": "kvjax.training.data",
    "kvjax.evaluate": "kvjax.training.evaluate",
    "kvjax.train": "kvjax.training.train",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass


def install() -> None:
    """Registers the finder once (idempotent)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
