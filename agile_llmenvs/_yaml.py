"""The one YAML loader of manifests and config files: ``yaml.SafeLoader`` with aliases bounded.

YAML aliases (``*a``) repeat a node without copying it, so a few hundred bytes of nested
aliases ("billion laughs") load instantly as shared objects and then expand to billions of
values in whatever walks them: validation, ``dump_manifest``, an env's ``env_config``. This
loader measures the document as it would be expanded, once it is composed and before any
object is built, and refuses one whose aliases add more than :data:`MAX_ALIAS_EXPANSION`
nodes (or that contains itself).
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["MAX_ALIAS_EXPANSION", "AliasExpansionError", "BoundedSafeLoader", "safe_load"]

#: Most nodes the aliases of one document may add once expanded; a document without
#: aliases (an inline dataset of any size) adds none.
MAX_ALIAS_EXPANSION = 10_000


class AliasExpansionError(yaml.YAMLError):
    """A YAML document whose aliases expand it past :data:`MAX_ALIAS_EXPANSION` nodes, or
    refer to a node from inside itself."""


class BoundedSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses documents whose aliases expand them too far.

    Raises:
        AliasExpansionError: (from ``yaml.load``) the aliases add more than
            :data:`MAX_ALIAS_EXPANSION` nodes, or an alias sits inside its own anchor.
    """

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
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
