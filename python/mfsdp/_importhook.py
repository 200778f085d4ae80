# SPDX-License-Identifier: Apache-2.0
"""Run a callback right after a named module has executed, wherever it is imported from."""
import importlib.abc
import importlib.util
import sys


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, callback):
        self._inner = inner
        self._callback = callback

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._callback(module)

    def __getattr__(self, name):  # get_source, is_package, ... of the real loader
        return getattr(self._inner, name)


class AfterImport(importlib.abc.MetaPathFinder):
    """sys.meta_path finder: callbacks[name](module) runs once that module has executed."""

    def __init__(self, callbacks):
        self._callbacks = dict(callbacks)

    def find_spec(self, name, path, target=None):
        callback = self._callbacks.get(name)
        if callback is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        del self._callbacks[name]
        spec.loader = _Loader(spec.loader, callback)
        return spec


def after_import(callbacks):
    """Install the hooks; a module already imported gets its callback now."""
    pending = {}
    for name, callback in callbacks.items():
        if name in sys.modules:
            callback(sys.modules[name])
        else:
            pending[name] = callback
    if pending:
        sys.meta_path.insert(0, AfterImport(pending))


def chain_sitecustomize(own_dir):
    """Import the next sitecustomize on sys.path after own_dir (one is imported per process,
    so a sitecustomize put first on PYTHONPATH must run the one it shadows)."""
    import os
    own = os.path.realpath(own_dir)
    seen_own = False
    for entry in list(sys.path):
        d = os.path.realpath(entry or os.getcwd())
        if d == own:
            seen_own = True
            continue
        if not seen_own:
            continue
        for fname in ("sitecustomize.py", os.path.join("sitecustomize", "__init__.py")):
            path = os.path.join(d, fname)
            if os.path.isfile(path):
                spec = importlib.util.spec_from_file_location(
                    f"_sitecustomize_{abs(hash(path))}", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return
