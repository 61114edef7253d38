"""What ``"strict": true`` makes of a JSON schema: every object lists all the keys it may hold.

JSON Schema lets an object hold keys its ``properties`` do not list unless ``additionalProperties``
says otherwise, and a model under such a grammar wanders into keys of its own until it runs out of
tokens. OpenAI's strict mode (and xgrammar's) reads a missing ``additionalProperties`` as false;
so does :func:`close_objects`. A schema that says ``additionalProperties`` (or
``unevaluatedProperties``) keeps what it says, and ``required`` is honoured as written.

Keys an object declares across ``allOf`` parts, or beside its ``anyOf`` / ``oneOf`` branches, stay
allowed: closing each part on its own keys would forbid the others' (JSON Schema checks
``additionalProperties`` against the properties of its own schema only). Schemas under ``not``,
``if`` / ``then`` / ``else`` and ``dependentSchemas`` are left as written: closing a condition
changes what it tests.
"""

from __future__ import annotations

import copy
from typing import Any

#: Keywords whose value is one subschema, closed on its own.
_ONE_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "unevaluatedItems")
#: Keywords whose value maps names to subschemas, each closed on its own.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
#: Keywords whose value lists subschemas, each closed on its own.
_SCHEMA_LISTS = ("prefixItems",)
#: Keywords that hold an object's keys: a schema without a ``type`` that has one describes objects.
_OBJECT_KEYWORDS = ("properties", "patternProperties", "required", "minProperties", "maxProperties")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema without ``additionalProperties`` (or
    ``unevaluatedProperties``) has ``additionalProperties: false``."""
    closer = _Closer(copy.deepcopy(schema))
    closer.close(closer.root, inherited=(), open_top=False)
    return closer.root


class _Closer:
    """Walks one schema (a private copy, changed in place), resolving its local ``$ref`` s."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._inlining: list[str] = []  # the $refs being inlined on the current path (a cycle guard)
        self._expanded: set[tuple[int, str]] = set()  # (node id, keyword) whose parts are inlined already

    def close(self, node: Any, inherited: tuple[str, ...], open_top: bool) -> None:
        """Close ``node`` and what it holds. ``inherited``: keys an enclosing schema declares for
        the same object (``node`` is one of its ``allOf`` parts or ``anyOf`` branches);
        ``open_top``: ``node`` is an ``allOf`` part, whose enclosing schema closes the object."""
        if not isinstance(node, dict):
            return
        self._inline_refs(node, "allOf")
        declared = self.declared_keys(node)
        if inherited or declared:  # branches then share keys with this schema: each needs its own copy
            self._inline_refs(node, "anyOf")
            self._inline_refs(node, "oneOf")
        branches = [b for key in ("anyOf", "oneOf") for b in _list(node.get(key))]
        shared = _union(inherited, declared)
        whole = _union(shared, *(self.declared_keys(b) for b in branches))
        # A node that refers ($ref) is closed where the schema it names is.
        if not open_top and "$ref" not in node and self._is_object(node) and not _says_extra_keys(node):
            listed = _mapping(node.get("properties"))
            unlisted = [key for key in whole if key not in listed]
            if unlisted:
                node["properties"] = {**listed, **{key: {} for key in unlisted}}
            node["additionalProperties"] = False
        for sub in _own_subschemas(node):
            self.close(sub, (), False)
        for part in _list(node.get("allOf")):
            self.close(part, whole, True)
        for branch in branches:
            self.close(branch, shared, False)

    def declared_keys(self, node: Any, seen: frozenset[int] = frozenset()) -> tuple[str, ...]:
        """The keys ``node`` lists for its object, in order: its properties and required keys and
        those of its ``allOf`` parts."""
        node = self._resolve(node)
        if not isinstance(node, dict) or id(node) in seen:
            return ()
        own = (*_mapping(node.get("properties")), *_list_of_str(node.get("required")))
        return _union(own, *(self.declared_keys(part, seen | {id(node)}) for part in _list(node.get("allOf"))))

    def _is_object(self, node: Any, seen: frozenset[int] = frozenset()) -> bool:
        """Whether ``node`` describes objects: its type says so, or (untyped) it or an ``allOf``
        part of it holds keywords of objects."""
        node = self._resolve(node)
        if not isinstance(node, dict) or id(node) in seen:
            return False
        kind = node.get("type")
        if kind is not None:
            return kind == "object" or (isinstance(kind, list) and "object" in kind)
        if any(key in node for key in _OBJECT_KEYWORDS):
            return True
        return any(self._is_object(part, seen | {id(node)}) for part in _list(node.get("allOf")))

    def _inline_refs(self, node: dict[str, Any], keyword: str) -> None:
        """Replace each part of ``node[keyword]`` that is a local ``$ref`` by a copy of what it
        names: the part is closed (or left open) here on this object's keys, while the named
        schema, used elsewhere, is closed on its own."""
        parts = node.get(keyword)
        if not isinstance(parts, list) or (id(node), keyword) in self._expanded:
            return
        self._expanded.add((id(node), keyword))
        for i, part in enumerate(parts):
            ref = part.get("$ref") if isinstance(part, dict) else None
            if not isinstance(ref, str) or len(part) != 1 or ref in self._inlining:
                continue
            target = self._pointer(ref)
            if isinstance(target, dict):
                parts[i] = copy.deepcopy(target)
                self._inlining.append(ref)
                self._inline_refs(parts[i], "allOf")
                self._inlining.pop()

    def _resolve(self, node: Any) -> Any:
        """``node``, or what its local ``$ref`` names when it is only a reference."""
        if isinstance(node, dict) and isinstance(node.get("$ref"), str) and len(node) == 1:
            target = self._pointer(node["$ref"])
            return target if target is not None else node
        return node

    def _pointer(self, ref: str) -> Any:
        """The schema a local reference (``#/$defs/name``) names; None when it is not local or
        names nothing."""
        if not ref.startswith("#"):
            return None
        node = self.root
        for raw in ref[1:].split("/")[1:] if ref != "#" else []:
            key = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None
        return node


def _own_subschemas(node: dict[str, Any]) -> list[Any]:
    """The subschemas of ``node`` that describe other values than its own object (its properties'
    values, its items, its definitions), each closed on its own."""
    subs = [node[key] for key in _ONE_SCHEMA if isinstance(node.get(key), dict)]
    subs += _list(node.get("items"))  # draft 4's tuple form
    subs += [sub for key in _SCHEMA_MAPS for sub in _mapping(node.get(key)).values()]
    subs += [sub for key in _SCHEMA_LISTS for sub in _list(node.get(key))]
    return subs


def _union(*groups: tuple[str, ...]) -> tuple[str, ...]:
    """The keys of ``groups``, each once, in the order they first appear."""
    return tuple(dict.fromkeys(key for group in groups for key in group))


def _says_extra_keys(node: dict[str, Any]) -> bool:
    return "additionalProperties" in node or "unevaluatedProperties" in node


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _list_of_str(value: Any) -> list[str]:
    return [v for v in _list(value) if isinstance(v, str)]
