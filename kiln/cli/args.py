"""Command-line flags generated from config dataclasses (one flag per field, help from its docstring and its
default), the help format every command shares, and parsing that suggests the flag a typo meant."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
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
        kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=_with_default(docs.get(f.name, ""), f, kind))
        if kind is bool:
            kwargs.update(nargs="?", const=True, type=parse_bool, metavar="enable|disable")
        elif is_list:
            kwargs.update(nargs="+", type=kind)
        else:
            kwargs.update(type=kind)
        parser.add_argument(f"--{f.name}", **kwargs)
        added.append(f.name)
    return added


def _with_default(doc: str, f: dataclasses.Field, kind) -> str:
    """A field's help: its docstring and, where it has one worth showing, its default (flags of dataclass fields
    default to SUPPRESS, so that only given ones are picked, and argparse cannot show the real default)."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if default is None or default == [] or default is dataclasses.MISSING:
        return doc.replace("%", "%%")
    shown = ("enable" if default else "disable") if kind is bool else default
    return f"{doc} (default: {shown})".replace("%", "%%")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default (unless it is None, a switch's off, or already said), and the
    examples in a command's epilog keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or action.nargs == 0 or "default" in help_text:
            return help_text
        return super()._get_help_string(action)


def parse_with_suggestions(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parser.parse_args, except that an unknown flag is reported by the (sub)command it was given to, with that
    command's usage and the flag it most likely meant."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        owner = _command_parser(parser, args)
        owner.error(f"unrecognized arguments: {' '.join(unknown)}{_suggestion(unknown, owner)}")
    return args


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return _command_parser(action.choices[getattr(args, action.dest)], args)
    return parser


def _suggestion(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    flags = [s for action in parser._actions for s in action.option_strings]
    hints = []
    for arg in unknown:
        close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1) if arg.startswith("-") else []
        hints += [f"did you mean {close[0]}?"] if close else []
    return f" ({'; '.join(hints)})" if hints else ""


def pick(namespace: argparse.Namespace, names: list[str]) -> dict:
    """The fields among `names` that were given on the command line."""
    return {n: getattr(namespace, n) for n in names if hasattr(namespace, n)}
