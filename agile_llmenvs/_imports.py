"""Resolve ``module:attr`` paths and env_config files named in manifests."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from agile_llmenvs._yaml import safe_load
from agile_llmenvs.errors import EnvBuildError, ImportPathError

__all__ = [
    "LOOKED_UP",
    "add_import_folder",
    "load_env_config",
    "load_module_file",
    "load_object",
    "module_file",
    "user_module_files",
]

#: Where a relative path or a module Python cannot find is looked up, as messages say it.
LOOKED_UP = "(a relative path is looked up next to the manifest, then in the working directory)"
_MODULE_LOOKED_UP = (
    "(a module Python cannot find is looked up next to the manifest, then in the working directory)"
)

# The folders of the manifests loaded so far, the latest first: a module a manifest names
# that is not on sys.path is imported from one of them (see _import_module).
_MANIFEST_FOLDERS: list[Path] = []
# The Python files loaded by path, by the private module name each runs under.
_USER_FILES: dict[str, Path] = {}


def add_import_folder(folder: str | Path) -> None:
    """Let the modules a manifest in ``folder`` names be imported from ``folder`` when Python
    cannot find them on ``sys.path`` (which is left as it is)."""
    resolved = Path(folder).resolve()
    if resolved in _MANIFEST_FOLDERS:
        _MANIFEST_FOLDERS.remove(resolved)
    _MANIFEST_FOLDERS.insert(0, resolved)


def load_object(target: str, *, file: str | None = None) -> Any:
    """Import the object an import path names.

    A top-level module Python cannot find on ``sys.path`` is imported from the folder of a
    loaded manifest that holds it (the latest first), else from the working directory; the
    folder is on ``sys.path`` only while the module imports.

    Args:
        target: ``package.module:attr`` or dotted ``package.module.attr``; with ``file``, an
            attribute (possibly dotted) of that Python file.
        file: Optional Python source file to load ``target`` from.

    Raises:
        ImportPathError: the module or the attribute does not exist.
    """
    if file is not None:
        module = load_module_file(Path(file))
        attr_path = target.split(":", 1)[-1]
    elif ":" in target:
        module_name, attr_path = target.split(":", 1)
        module = _import_module(module_name, target)
    else:
        module_name, _, attr_path = target.rpartition(".")
        if not module_name:
            raise ImportPathError(f"{target!r} is not an import path; write 'package.module:attr'")
        module = _import_module(module_name, target)
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ImportPathError(f"{target!r}: {module.__name__} has no attribute {part!r}.{hint}")
        obj = getattr(obj, part)
    return obj


def _import_module(name: str, target: str) -> ModuleType:
    """Import ``name``; a top-level module not on ``sys.path`` is imported from the folder of
    a loaded manifest that holds it, else from the working directory."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = name.partition(".")[0]
        folder = _folder_holding(top) if exc.name == top else None
        if folder is None:
            where = f" {_MODULE_LOOKED_UP}" if exc.name == top else ""
            raise ImportPathError(
                f"{target!r}: cannot import module {name!r} ({exc}); is its package installed "
                f"and on PYTHONPATH?{where}"
            ) from exc
    with _on_sys_path(folder):  # for as long as it imports: it may import its neighbours
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise ImportPathError(
                f"{target!r}: cannot import module {name!r} from {str(folder)!r} ({exc})"
            ) from exc


def module_file(name: str) -> Path | None:
    """The file of the top-level module ``name`` when it is a ``.py`` file imported from a
    loaded manifest's folder or the working directory, not found on ``sys.path``; else None."""
    if not name.isidentifier() or name in sys.builtin_module_names:
        return None
    if importlib.machinery.PathFinder.find_spec(name, sys.path) is not None:
        return None
    folder = _folder_holding(name)
    path = None if folder is None else folder / f"{name}.py"
    return path if path is not None and path.is_file() else None


def _folder_holding(module: str) -> Path | None:
    """The first folder of a loaded manifest, or else the working directory, that holds the
    top-level ``module`` (a ``.py`` file or a package)."""
    for folder in dict.fromkeys([*_MANIFEST_FOLDERS, Path.cwd()]):
        if importlib.machinery.PathFinder.find_spec(module, [str(folder)]) is not None:
            return folder
    return None


@contextmanager
def _on_sys_path(folder: Path) -> Iterator[None]:
    """``folder`` at the end of ``sys.path`` (it shadows nothing), taken off again after."""
    entry = str(folder)
    added = entry not in sys.path
    if added:
        sys.path.append(entry)
        importlib.invalidate_caches()
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def load_module_file(path: Path) -> ModuleType:
    """Import the Python file at ``path`` as a module (once per resolved path); while it runs,
    its folder is on ``sys.path``, so it may import the modules beside it."""
    if not path.is_file():
        looked = "" if path.is_absolute() else f" (looked for {path.resolve()})"
        state = "is not a Python file" if path.exists() else "does not exist"
        raise ImportPathError(f"{str(path)!r} {state}{looked}")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"_agile_llmenvs_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportPathError(f"path {str(path)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec, so pickling by reference (subprocess envs) works
    try:
        with _on_sys_path(path.resolve().parent):
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _USER_FILES[name] = path.resolve()
    return module


def user_module_files() -> dict[str, Path]:
    """The files :func:`load_module_file` has loaded, by the module name each runs under.

    An object of such a module pickles by reference to that name, which another interpreter
    cannot import: it must load the same files first (the name is the path's digest, so
    loading a file gives it the same name there).
    """
    return dict(_USER_FILES)


def load_env_config(env_config: dict[str, Any] | str | None) -> dict[str, Any]:
    """Keyword arguments for an env: the dict itself, or the YAML/JSON file a string names."""
    if env_config is None:
        return {}
    if isinstance(env_config, dict):
        return dict(env_config)
    path = Path(env_config)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise EnvBuildError(f"env_config: cannot read {env_config!r}: {exc}") from exc
    try:
        loaded = json.loads(text) if path.suffix.lower() == ".json" else safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise EnvBuildError(f"env_config: {env_config!r} is not valid YAML/JSON: {exc}") from exc
    if not isinstance(loaded, dict):
        raise EnvBuildError(
            f"env_config: {env_config!r} must hold a mapping of keyword arguments, "
            f"got {type(loaded).__name__}"
        )
    return loaded
