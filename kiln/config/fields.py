"""Helpers shared by the config dataclasses: field docstrings, strict dict loading, validation."""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, Iterable


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, by field name (read from the source)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def from_dict(cls: type, data: dict[str, Any] | None, where: str):
    """Build dataclass `cls` from `data` (e.g. parsed YAML/JSON); an unknown key or a value of the wrong type
    is a ValueError naming the key and `where`."""
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of keys to values, got {data!r}")
    data = dict(data or {})
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in {where}; known keys: {', '.join(sorted(known))}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()})


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check a loaded value against a field's type; accept YAML's spellings of floats such as 1e-6."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
    if hint is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    expected = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(hint)
    if typing.get_origin(hint) is list:
        expected = (list,)
    if expected and (not isinstance(value, expected) or (hint is not bool and isinstance(value, bool))):
        raise ValueError(f"{where} must be {getattr(hint, '__name__', hint)}, got {value!r}")
    return value


def to_dict(obj) -> dict[str, Any]:
    """Dataclass → plain JSON-able dict (nested dataclasses included)."""
    return dataclasses.asdict(obj)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def require_positive(owner: str, **values: int | float | None) -> None:
    for name, value in values.items():
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{owner}.{name} must be a positive number, got {value!r}")


def require_whole(owner: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{owner}.{name} must be a whole number >= 0, got {value!r}")


def require_choice(owner: str, name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{owner}.{name}={value!r} is not one of {', '.join(map(repr, choices))}")


def reject_unsupported(obj, names: Iterable[str], why: str) -> None:
    """Raise when a field Kiln cannot honour yet is set to anything but its default."""
    defaults = {f.name: f for f in dataclasses.fields(obj)}
    for name in names:
        f = defaults[name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        value = getattr(obj, name)
        if value != default:
            raise ValueError(f"{type(obj).__name__}.{name}={value!r} is not supported by Kiln yet ({why}); "
                             f"leave it at {default!r}")
