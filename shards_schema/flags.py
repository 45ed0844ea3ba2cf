"""Command-line flags generated from a config dataclass's fields.

A field declared with `setting(...)` carries its flag in its metadata: the `--help` line, the
`--help` group, and any further argparse keywords (type, choices, metavar, action, required,
a default the command line shows instead of the field's own). A field holding another config
dataclass is declared with `nested(...)`: its fields become flags too, their names prefixed,
or, for a dataclass of another package that declares none, named in `flags`. `add_flags` adds
one flag per setting, in field order (groups appear where their first flag does), and
`config_from_args` builds the dataclass back from the parsed namespace. So a setting cannot
reach the command line undocumented, and a flag cannot set a field other than its own.
`to_flat` / `from_flat` write and read a config as one flat mapping keyed by the flags'
destinations (their names, underscored): the form of a config file and of a saved config.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
from dataclasses import MISSING, dataclass, field

from .errors import UserError
from .storage import refuse_malformed_url

FLAG_KEY = "flag"  # metadata key of a setting's Flag
NESTED_KEY = "nested"  # metadata key of a nested config's Nested


@dataclass(frozen=True)
class Flag:
    """How one field is set on the command line."""

    help: str
    group: str | None = None  # None: the parser's own options (or positionals)
    name: str | None = None  # default: "--" + the (prefixed) field name, dashed; no dashes: a positional
    argparse: dict = field(default_factory=dict)  # further add_argument keywords


@dataclass(frozen=True)
class Nested:
    """A field holding a config dataclass whose fields are flags of their own."""

    prefix: str = ""  # put before its fields' names: "video_" makes `fps` --video-fps
    flags: dict | None = None  # field name -> Flag, for a dataclass that declares none itself


def setting(default=MISSING, *, help: str, group: str | None = None, name: str | None = None,
            default_factory=MISSING, flag_default=MISSING, **argparse_keywords):
    """A dataclass field set by one flag (see the module's docstring); `flag_default`: the
    command line's default where it differs from the field's."""
    if flag_default is not MISSING:
        argparse_keywords["default"] = flag_default
    flag = Flag(help=help, group=group, name=name, argparse=argparse_keywords)
    return field(default=default, default_factory=default_factory, metadata={FLAG_KEY: flag})


def nested(default=MISSING, *, default_factory=MISSING, prefix: str = "", flags: dict | None = None):
    """A dataclass field holding another config dataclass (its type: the default's, or the
    default factory when that is the class itself)."""
    return field(default=default, default_factory=default_factory, metadata={NESTED_KEY: Nested(prefix, flags)})


def flag_name(name: str) -> str:
    """The command-line flag of setting `name`."""
    return "--" + name.replace("_", "-")


def _nested_type(f: dataclasses.Field) -> type:
    return type(f.default) if f.default is not MISSING else f.default_factory


def _field_default(f: dataclasses.Field):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _flags(cls, prefix: str = "", declared: dict | None = None):
    """(field path, Flag, flag name, the field's default) of every flag of `cls`, in field order."""
    for f in dataclasses.fields(cls):
        flag = (declared or {}).get(f.name) if declared is not None else f.metadata.get(FLAG_KEY)
        inner = f.metadata.get(NESTED_KEY) if declared is None else None
        if inner is not None:
            for path, sub, name, default in _flags(_nested_type(f), prefix + inner.prefix, inner.flags):
                yield (f.name, *path), sub, name, default
        elif flag is not None:
            yield (f.name,), flag, flag.name or flag_name(prefix + f.name), _field_default(f)


def _dest(flag: Flag, name: str) -> str:
    """Where argparse puts the flag's value (as argparse itself derives it)."""
    return flag.argparse.get("dest") or name.lstrip("-").replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, cls, groups: dict[str, str] | None = None) -> None:
    """One flag per setting of the config dataclass `cls`, in its group; `groups` (name ->
    description): groups added in this order, with their descriptions, before any flag."""
    added = {name: parser.add_argument_group(name, description) for name, description in (groups or {}).items()}
    for _, flag, name, default in _flags(cls):
        target = parser
        if flag.group is not None:
            if flag.group not in added:
                added[flag.group] = parser.add_argument_group(flag.group)
            target = added[flag.group]
        keywords = dict(flag.argparse)
        if "default" not in keywords and default is not MISSING and not keywords.get("required"):
            keywords["default"] = default
        target.add_argument(name, help=flag.help, **keywords)


def flat_paths(cls) -> dict[str, tuple[str, ...]]:
    """Each flag's destination (its key in a flat mapping) -> the path of the field it sets."""
    return {_dest(flag, name): path for path, flag, name, _ in _flags(cls)}


def config_from_args(cls, args: argparse.Namespace):
    """The config dataclass `cls` holding the parsed flags' values (fields without a flag: their defaults)."""
    return from_flat(cls, {dest: getattr(args, dest) for dest in flat_paths(cls)})


def from_flat(cls, values: dict):
    """The config dataclass `cls` from a flat mapping of flag destinations to values (settings
    not in it: their defaults). KeyError naming the keys that are no setting of `cls`."""
    paths = flat_paths(cls)
    unknown = sorted(set(values) - set(paths))
    if unknown:
        raise KeyError(unknown)
    nested_values: dict = {}
    for key, value in values.items():
        holder = nested_values
        for part in paths[key][:-1]:
            holder = holder.setdefault(part, {})
        holder[paths[key][-1]] = value
    return _build(cls, nested_values)


def to_flat(config) -> dict:
    """The settings of config dataclass `config` as one flat mapping (flag destination -> a copy
    of its value), in field order: what `from_flat` reads back."""
    values = {}
    for dest, path in flat_paths(type(config)).items():
        value = config
        for part in path:
            value = getattr(value, part)
        values[dest] = copy.deepcopy(value)
    return values


def _build(cls, values: dict):
    nested_types = {f.name: _nested_type(f) for f in dataclasses.fields(cls) if NESTED_KEY in f.metadata}
    return cls(**{k: _build(nested_types[k], v) if k in nested_types else v for k, v in values.items()})


# ---------------------------------------------------------------- argparse types of common settings


def parse_bool(text: str) -> bool:
    """true/false, also 1/0, yes/no, on/off (any case)."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def positive_bytes(text: str) -> int:
    """A byte count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive whole number of bytes, got {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text}")
    return value


def integer_from(low: int, high: int):
    """An argparse type: an integer from `low` to `high`."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {text}")
        return value

    return integer


def refuse_empty(flag: str, value, fix: str = "give its value, or leave the flag out") -> None:
    """UserError for a flag or argument given an empty value (an unset shell variable: `--out
    "$OUT"`), which would otherwise mean the current directory (--out, --media-root, a directory
    argument) or nothing at all (--model, --profile: the default), without a word."""
    if isinstance(value, str) and not value.strip():
        raise UserError(f"{flag} is given as an empty string ({value!r}): {fix}")


def refuse_bad_location(flag: str, value, fix: str = "give its value, or leave the flag out") -> None:
    """A directory or file flag: refuse_empty, and a store's URL without the `//` after its
    scheme (`s3:/bucket`), which would otherwise be a local directory named `s3:`."""
    refuse_empty(flag, value, fix)
    refuse_malformed_url(flag, value)
