"""Command-line flags for config settings: one flag per leaf field, its default and help taken
from the field (``engine.config.setting``), so nothing is defined twice.

Flags default to "not given" (``argparse.SUPPRESS``): ``given_settings`` returns only the
settings the user set, to lay over the config's own defaults with ``from_flat``.
"""

from __future__ import annotations

import argparse
import types
import typing

from mtpserve.engine.config import ConfigField


def add_setting_flags(parser, fields: dict[str, ConfigField], names: list[str] | None = None,
                      rename: dict[str, str] | None = None) -> None:
    """Add ``--name-with-dashes`` (or ``rename[name]``) for each setting in ``names`` (default all)."""
    rename = rename or {}
    for name in names or fields:
        f = fields[name]
        flag = rename.get(name, "--" + name.replace("_", "-"))
        kind = _scalar_type(f.type)
        default = ("on" if f.default else "off") if kind is bool and isinstance(f.default, bool) else f.default
        shown = "" if default is None else f" (default: {default})"
        if kind is bool:
            # --flag, --flag on|off (true|false, yes|no, 1|0), or --no-flag
            parser.add_argument(flag, dest=name, nargs="?", const=True, type=on_off, default=argparse.SUPPRESS,
                                metavar="on|off", help=f.help + shown)
            parser.add_argument("--no-" + flag[2:], dest=name, action="store_false", default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS, help=f.help + shown)


def on_off(text: str) -> bool:
    value = {"on": True, "true": True, "yes": True, "1": True,
             "off": False, "false": False, "no": False, "0": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value


def given_settings(args, fields: dict[str, ConfigField]) -> dict:
    """{setting name: value} of the setting flags the user gave."""
    return {n: v for n, v in vars(args).items() if n in fields}


def _scalar_type(annotation):
    """int / float / bool / str of an annotation like ``int | None``; str for mixed ones (int | str)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation
