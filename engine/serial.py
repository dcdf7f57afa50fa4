"""The one converter that writes the JSON documents: the JSON lines, the summaries, the
manifest and the job's outcomes (the state file keeps its own, statefile.py: it
forbids extra keys and is tuned for thousands of records).

A class declares its document's shape with :func:`shape` (plain data, no cattrs); the
converter, built at the first :func:`to_json`, turns each shape into an unstructure
hook. cattrs is imported only then: a command that serializes nothing never loads it
(tests/engine/test_import_cost.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs

if TYPE_CHECKING:
    import cattrs

T = TypeVar("T")

_SHAPES: Final[dict[type, _Shape]] = {}


@attrs.frozen
class _Shape:
    # Constant keys written first (an event's ``"event": "phase"``).
    tag: tuple[tuple[str, Any], ...] = ()
    # Field name -> key written.
    rename: Mapping[str, str] = attrs.field(factory=dict)
    # The fields in the order written, when not the class's.
    order: tuple[str, ...] = ()
    # Fields left out of the document.
    exclude: frozenset[str] = frozenset()
    # Fields left out when their (converted) value is their default.
    omit: frozenset[str] = frozenset()
    # Field -> the keys its (attrs) value contributes in its place, as {its field: key};
    # None contributes nothing.
    flatten: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)
    # Field -> a function of its value that gives what is written.
    convert: Mapping[str, Callable[[Any], Any]] = attrs.field(factory=dict)
    # Attribute (a property) -> the field it is written after; left out with that field.
    extra: Mapping[str, str] = attrs.field(factory=dict)
    # The document is that of what this function makes of the value.
    via: Callable[[Any], Any] | None = None


def shape(
    *,
    tag: Mapping[str, Any] | None = None,
    rename: Mapping[str, str] | None = None,
    order: tuple[str, ...] = (),
    exclude: frozenset[str] = frozenset(),
    omit: frozenset[str] = frozenset(),
    flatten: Mapping[str, Mapping[str, str]] | None = None,
    convert: Mapping[str, Callable[[Any], Any]] | None = None,
    extra: Mapping[str, str] | None = None,
    via: Callable[[Any], Any] | None = None,
) -> Callable[[type[T]], type[T]]:
    """Declare how :func:`to_json` writes an attrs class (a class decorator). Undeclared
    attrs classes are written field by field, under their own names."""

    declared = _Shape(
        tuple((tag or {}).items()),
        dict(rename or {}),
        order,
        exclude,
        omit,
        dict(flatten or {}),
        dict(convert or {}),
        dict(extra or {}),
        via,
    )

    def register(cls: type[T]) -> type[T]:
        _SHAPES[cls] = declared
        return cls

    return register


def to_json(value: object) -> Any:
    """``value`` as JSON-ready data (dicts, lists, str, numbers, None)."""
    return converter().unstructure(value)


def strict(kind: type, name: str) -> Callable[[object, type], object]:
    """A structure hook that takes only ``kind`` (a float also takes an int): cattrs would
    call kind(value), and "12", 1.5 and "yes" would all pass silently."""

    def structure(value: object, _: type) -> object:
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise ValueError(f"expected {name}, got {value!r}")
        return value

    return structure


@functools.cache
def converter() -> cattrs.Converter:
    """The converter: strict on what it reads, every declared shape on what it writes."""
    import cattrs

    conv = cattrs.Converter()
    conv.register_structure_hook(int, strict(int, "an integer"))
    conv.register_structure_hook(bool, strict(bool, "a boolean"))
    conv.register_structure_hook(float, strict(float, "a number"))
    conv.register_structure_hook(str, strict(str, "a string"))
    conv.register_unstructure_hook(tuple, lambda t: [conv.unstructure(v) for v in t])
    # Asked at a class's first document, so that a class declared after the converter
    # was built (its module imported later) is still written by its shape; by
    # predicate, since registering by class would resolve its annotations, some of
    # which name types imported only for the type checker.
    conv.register_unstructure_hook_factory(
        _SHAPES.__contains__, lambda cls: _hook(conv, cls, _SHAPES[cls])
    )
    return conv


def _hook(conv: cattrs.Converter, cls: type, declared: _Shape) -> Callable[[Any], Any]:
    if declared.via is not None:
        via = declared.via
        return lambda value: conv.unstructure(via(value))
    every = {f.name: f for f in attrs.fields(cls)}
    names = declared.order or tuple(every)
    fields = [every[name] for name in names if name not in declared.exclude]
    after: dict[str, list[str]] = {}
    for attribute, field in declared.extra.items():
        after.setdefault(field, []).append(attribute)

    def unstructure(value: Any) -> dict[str, Any]:
        out: dict[str, Any] = dict(declared.tag)
        for f in fields:
            raw = getattr(value, f.name)
            if f.name in declared.flatten:
                if raw is not None:
                    inner = conv.unstructure(raw)
                    for name, key in declared.flatten[f.name].items():
                        out[key] = inner[name]
                continue
            convert = declared.convert.get(f.name)
            written = convert(raw) if convert is not None else raw
            if f.name in declared.omit and written == f.default:
                continue
            out[declared.rename.get(f.name, f.name)] = conv.unstructure(written)
            for attribute in after.get(f.name, ()):
                out[attribute] = conv.unstructure(getattr(value, attribute))
        return out

    return unstructure
