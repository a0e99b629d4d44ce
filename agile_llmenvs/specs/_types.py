"""Shared field types for the spec models: import paths and small validated values."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, ConfigDict

__all__ = ["SPEC_CONFIG", "ImportPath", "ObjectPath", "Port"]

#: Every spec forbids unknown keys so a typo in a manifest fails at load, naming the key.
SPEC_CONFIG = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=False)

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE_ATTR = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$")
_DOTTED = re.compile(rf"^{_IDENT}(\.{_IDENT})*$")


def _check_module_attr(value: str) -> str:
    if not _MODULE_ATTR.match(value):
        raise ValueError(
            f"expected an import path of the form 'package.module:attr', got {value!r}"
        )
    return value


def _check_object_path(value: str) -> str:
    if not (_MODULE_ATTR.match(value) or _DOTTED.match(value)):
        raise ValueError(
            f"expected an import path 'package.module:attr' or 'package.module.attr', got {value!r}"
        )
    return value


def _check_port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"expected a TCP port in 1..65535, got {value}")
    return value


#: ``package.module:attr`` — a callable or class to import.
ImportPath = Annotated[str, AfterValidator(_check_module_attr)]
#: ``package.module:attr`` or dotted ``package.module.attr`` (wrappers are often written dotted).
ObjectPath = Annotated[str, AfterValidator(_check_object_path)]
#: A TCP port number.
Port = Annotated[int, AfterValidator(_check_port)]
