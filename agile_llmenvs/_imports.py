"""Resolve ``module:attr`` paths and env_config files named in manifests."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from agile_llmenvs._yaml import safe_load
from agile_llmenvs.errors import EnvBuildError, ImportPathError

__all__ = ["load_env_config", "load_module_file", "load_object"]


def load_object(target: str, *, file: str | None = None) -> Any:
    """Import the object an import path names.

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
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise ImportPathError(
            f"{target!r}: cannot import module {name!r} ({exc}); is its package installed "
            "and on PYTHONPATH?"
        ) from exc


def load_module_file(path: Path) -> ModuleType:
    """Import the Python file at ``path`` as a module (once per resolved path)."""
    if not path.is_file():
        raise ImportPathError(f"path {str(path)!r} is not a Python file")
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
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


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
