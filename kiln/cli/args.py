"""Command-line flags generated from config dataclasses: one flag per field, help from its docstring."""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from kiln.config import field_docs


def parse_bool(text: str) -> bool:
    value = text.lower()
    if value in ("1", "true", "yes", "enable", "on"):
        return True
    if value in ("0", "false", "no", "disable", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected enable/disable (or true/false), got {text!r}")


def _scalar_type(annotation):
    """(converter, is_list) for a field annotation such as `int | None` or `list[str]`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _scalar_type(args[0])
    if origin is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def add_dataclass_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> list[str]:
    """Add --<field> for each scalar field of `cls`; return the field names added."""
    hints, docs, added = typing.get_type_hints(cls), field_docs(cls), []
    for f in dataclasses.fields(cls):
        if f.name in skip or dataclasses.is_dataclass(hints[f.name]):
            continue
        kind, is_list = _scalar_type(hints[f.name])
        if kind is dict or kind is typing.Any:
            continue
        kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=docs.get(f.name, ""))
        if kind is bool:
            kwargs.update(nargs="?", const=True, type=parse_bool, metavar="enable|disable")
        elif is_list:
            kwargs.update(nargs="+", type=kind)
        else:
            kwargs.update(type=kind)
        parser.add_argument(f"--{f.name}", **kwargs)
        added.append(f.name)
    return added


def pick(namespace: argparse.Namespace, names: list[str]) -> dict:
    """The fields among `names` that were given on the command line."""
    return {n: getattr(namespace, n) for n in names if hasattr(namespace, n)}
