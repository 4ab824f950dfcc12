"""``dedloc init``'s options, generated from ``RunConfig``: each option's flag, type, choices,
default and help come from its field (``protocol/config.py``), so a setting is spelled only there;
and validation errors named by the flag the user typed."""

from __future__ import annotations

import functools
import inspect
import types
from enum import Enum
from typing import Literal, Optional, Union, get_args, get_origin

import typer
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from ..model.presets import PRESETS
from ..protocol.config import RECIPES, RunConfig, recipe_config
from ..trust import identity


def one_line(text: str) -> str:
    return " ".join(text.split())


# The RunConfig fields `dedloc init` sets, as paths into it. Each option's flag, type, choices,
# default and help come from the field (protocol/config.py), so a setting is spelled only there.
INIT_SETTINGS = ("preset", "target_batch_size", "data", "micro_batch", "codec", "download_codec",
                 "optimizer.name", "optimizer.lr", "optimizer.warmup_steps", "seed", "seq_len", "chunk_size",
                 "chunks_per_part",
                 "close.timeout_s", "close.min_fraction", "close.late_shards", "delayed_updates",
                 "peer_timeout_s", "cadence.poll_min_s", "cadence.poll_max_s", "cadence.heartbeat_max_s",
                 "organizer_key", "aggregation", "algorithm", "inner_batch", "outer.lr", "outer.momentum")

# A flag that takes something other than its field's value: its metavar and help, and how the value is made.
_READS = {"organizer_key": ("FILE", "your private key (`dedloc keygen`): its public key goes in the run, "
                            "which then admits only shards of volunteers you enroll",
                            lambda file: identity.public(identity.load(file)))}


def _field(path: str) -> FieldInfo:
    model, *inner, leaf = RunConfig, *path.split(".")
    for name in inner:
        model = model.model_fields[name].annotation
    return model.model_fields[leaf]


def _flag(path: str) -> str:
    """The field's own spelling (``json_schema_extra={"flag": ...}``), else its name with dashes."""
    extra = _field(path).json_schema_extra or {}
    return extra.get("flag") or "--" + path.rpartition(".")[2].replace("_", "-")


# the flag that set each config field, for validation errors; block_size is derived from chunk_size
_FLAGS = {path: _flag(path) for path in ("run", *INIT_SETTINGS)} | {"block_size": _flag("chunk_size")}


def _by_preset(path: str) -> dict[str, object]:
    """What each preset makes of a setting that some preset's recipe sets (else nothing)."""
    head, _, leaf = path.rpartition(".")
    if not any(leaf in (recipe.get(head, {}) if head else recipe) for recipe in RECIPES.values()):
        return {}
    return {p: functools.reduce(getattr, path.split("."), recipe_config("help", p)) for p in PRESETS}


def _option(path: str) -> inspect.Parameter:
    """The field at ``path`` as a typer option (named by the path, ``__`` for its dots); left
    unset, a setting that a recipe sets is the preset's."""
    field = _field(path)
    kind = field.annotation
    if get_origin(kind) in (Union, types.UnionType):  # X | None
        kind = next(a for a in get_args(kind) if a is not type(None))
    default, help, metavar = field.default, field.description or "", None
    if by_preset := _by_preset(path):
        default = None
        help += "; default: the preset's recipe (" + ", ".join(f"{p} {v}" for p, v in by_preset.items()) + ")"
    if get_origin(kind) is Literal:  # as an Enum: choices on every typer, not only those that read Literal
        kind = Enum(path, [(v, v) for v in get_args(kind)], type=str)
        default = None if default is None else kind(default)
    if path in _READS:
        metavar, help, _ = _READS[path]
    flag = _flag(path)
    return inspect.Parameter(
        path.replace(".", "__"), inspect.Parameter.KEYWORD_ONLY,
        annotation=Optional[kind] if default is None else kind,
        default=typer.Option(default, f"{flag}/--no-{flag[2:]}" if kind is bool else flag, help=help,
                             metavar=metavar, rich_help_panel="Run settings (kept in run.json)"))


def with_settings(command):
    """Gives ``command`` an option per INIT_SETTINGS field (typer reads the signature); their
    values reach it as ``**settings``."""
    sig = inspect.signature(command, eval_str=True)
    own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    command.__signature__ = sig.replace(parameters=own + [_option(path) for path in INIT_SETTINGS])
    return command


def config_args(settings: dict[str, object]) -> dict:
    """init's option values as recipe_config's arguments: nested by path, those left unset left to
    the preset's recipe and the defaults."""
    args: dict = {}
    for name, value in settings.items():
        path = name.replace("__", ".")
        if value is None:
            continue
        value = value.value if isinstance(value, Enum) else value
        if path in _READS:
            value = _READS[path][2](value)
        head, _, leaf = path.rpartition(".")
        (args.setdefault(head, {}) if head else args)[leaf] = value
    args["block_size"] = min(4096, args["chunk_size"])  # a chunk smaller than an int8 block is one block
    return args


def describe(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        parts = []
        for e in exc.errors():
            where = _flag_at(e.get("loc", ()))
            msg = e.get("msg", "invalid").removeprefix("Value error, ")
            parts.append(f"{where}: {msg}" if where else msg)
        return "invalid value: " + "; ".join(parts)
    text = one_line(str(exc))
    return text or type(exc).__name__


def _flag_at(loc: tuple) -> str:
    """The flag that set the value at a pydantic error's location (in RunConfig or a nested
    model: ``("lr",)`` is ``optimizer.lr``), else the location."""
    path = ".".join(str(x) for x in loc)
    return next((flag for p, flag in _FLAGS.items() if p == path or p.endswith("." + path)), path)
