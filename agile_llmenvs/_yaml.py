"""The one YAML loader of manifests and config files: ``yaml.SafeLoader`` with aliases bounded.

YAML aliases (``*a``) repeat a node without copying it, so a few hundred bytes of nested
aliases ("billion laughs") load instantly as shared objects and then expand to billions of
values in whatever walks them: validation, ``dump_manifest``, an env's ``env_config``. This
loader measures the document as it would be expanded, once it is composed and before any
object is built, and refuses one whose aliases add more than :data:`MAX_ALIAS_EXPANSION`
nodes (or that contains itself).

The parser is libyaml's where PyYAML has it: the pure-Python one took 2 s to load a 1 MB
manifest of an inline list, 8 s for 3.8 MB; libyaml's takes a fifth of that.
"""

from __future__ import annotations

from typing import Any

import yaml

try:
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment]

__all__ = ["MAX_ALIAS_EXPANSION", "AliasExpansionError", "BoundedSafeLoader", "safe_load"]

#: Most nodes the aliases of one document may add once expanded; a document without
#: aliases (an inline dataset of any size) adds none.
MAX_ALIAS_EXPANSION = 10_000


class AliasExpansionError(yaml.YAMLError):
    """A YAML document whose aliases expand it past :data:`MAX_ALIAS_EXPANSION` nodes, or
    refer to a node from inside itself."""


class BoundedSafeLoader(_SafeLoader):
    """``yaml.SafeLoader`` (libyaml's, where PyYAML has it) that refuses documents whose
    aliases expand them too far.

    Raises:
        AliasExpansionError: (from ``yaml.load``) the aliases add more than
            :data:`MAX_ALIAS_EXPANSION` nodes, or an alias sits inside its own anchor.
    """

    # both of the composer's entry points (``load`` and ``load_all``): libyaml's parser
    # composes a document in C, where an override of ``compose_document`` is never called
    def get_single_node(self) -> yaml.Node | None:
        return _checked(super().get_single_node())

    def get_node(self) -> yaml.Node | None:
        return _checked(super().get_node())


def _checked(node: yaml.Node | None) -> yaml.Node | None:
    if node is not None:
        _check_expansion(node)
    return node


def safe_load(text: str) -> Any:
    """``yaml.safe_load(text)`` with aliases bounded (see :class:`BoundedSafeLoader`).

    Raises:
        yaml.YAMLError: ``text`` is not YAML, or its aliases expand too far
            (:class:`AliasExpansionError`).
    """
    return yaml.load(text, Loader=BoundedSafeLoader)


def _check_expansion(root: yaml.Node) -> None:
    """Refuse ``root`` when expanding its aliases adds more than the limit's nodes."""
    sizes: dict[int, int] = {}  # id(node) -> nodes in its expansion (itself included)
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        known = sizes.get(key)
        if known is not None:
            return known
        if key in open_nodes:
            raise AliasExpansionError(
                "an alias refers to a node from inside that node (a recursive document); "
                "write the value out"
            )
        total = 1
        if isinstance(node, yaml.SequenceNode):
            open_nodes.add(key)
            total += sum(size(child) for child in node.value)
            open_nodes.discard(key)
        elif isinstance(node, yaml.MappingNode):
            open_nodes.add(key)
            total += sum(size(k) + size(v) for k, v in node.value)
            open_nodes.discard(key)
        sizes[key] = total
        return total

    added = size(root) - len(sizes)
    if added > MAX_ALIAS_EXPANSION:
        raise AliasExpansionError(
            f"its aliases expand it by {added} nodes, more than the limit of "
            f"{MAX_ALIAS_EXPANSION} (a YAML alias bomb?); write the repeated values out, or "
            "repeat them fewer times"
        )
