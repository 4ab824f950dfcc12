"""The configuration reference (docs/configuration.md), generated from ``RunConfig``.

``python -m dedloc_pipeline.protocol.reference > docs/configuration.md`` writes it, and
tests/test_docs.py keeps the file equal to what this prints, so a setting's type, default and
description are spelled once, in ``protocol/config.py``, and the reference cannot drift from it.
"""

from __future__ import annotations

import json
import types
from typing import Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from ..model.presets import PRESETS
from .config import RECIPES, RunConfig

# Fields whose Field() carries no description: what they mean, said here.
UNDESCRIBED = {
    "RunConfig.layout_version": "the bucket layout the run is written in; a dedloc that reads another refuses the run",
    "RunConfig.run": "the run's name: its keys are under `runs/RUN/` in the bucket",
    "RunConfig.cadence": "how often volunteers read the round view and heartbeat",
    "RunConfig.optimizer": "the optimizer step (the aggregators' in `dedloc`, the volunteers' inner one in `diloco`)",
    "RunConfig.outer": "diloco: the aggregators' outer step",
    "RunConfig.close": "when the scheduler closes a round, and how much one volunteer may count in it",
    "OptimizerConfig.betas": "AdamW and LAMB: decay rates of the first and second moments",
    "OptimizerConfig.eps": "AdamW and LAMB: added to the second moment's root",
    "OptimizerConfig.weight_decay": "decoupled weight decay",
}

INTRO = """\
# Configuration reference

<!-- Generated from RunConfig (dedloc_pipeline/protocol/config.py) by
     `python -m dedloc_pipeline.protocol.reference > docs/configuration.md`; tests/test_docs.py
     keeps this file equal to it. Edit the fields' descriptions there, not here. -->

A run's settings are written once, by `dedloc init` (or by the `pretrain` flow's `config`
parameter when the bucket has no run yet), to `runs/RUN/run.json`; every process of the run reads
them from there and none can change them afterwards. `dedloc init` takes most of them as options
(`dedloc init --help` lists them); the `pretrain` flow takes any of them as JSON, nested settings
as objects (`-p config='{"preset": "sahajbert", "close": {"timeout_s": 600}}'`). A setting left
unset is the preset's recipe (last table), else the default below. Values are shown as they are
in run.json (JSON). How to choose them: [organizer.md](organizer.md#choosing-the-settings).
"""


def type_name(annotation: object) -> str:
    """A field's type as a reader writes it in run.json: choices quoted, nested settings linked."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f'`"{a}"`' for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in get_args(annotation))
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in get_args(annotation)) + "]"
    if annotation is type(None):
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(annotation, str(annotation))


def default_of(field: FieldInfo) -> str:
    if field.default is PydanticUndefined:
        return "required"
    if isinstance(field.default, BaseModel):
        return "see below"
    return f"`{json.dumps(field.default)}`"


def bounds(field: FieldInfo) -> str:
    """The field's constraints (``gt``, ``le``, ``pattern``...), as checked at init."""
    signs = {Gt: ">", Ge: "≥", Lt: "<", Le: "≤"}
    out = []
    for m in field.metadata:
        for kind, sign in signs.items():
            if isinstance(m, kind):
                out.append(f"{sign} {getattr(m, kind.__name__.lower())}")
        if getattr(m, "pattern", None):
            out.append(f"matches `{m.pattern}`")
    return ", ".join(out)


def describe(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    text = field.description or UNDESCRIBED.get(f"{model.__name__}.{name}")
    if not text:
        raise ValueError(f"{model.__name__}.{name} has no description: give its Field one (protocol/config.py)")
    return " ".join(text.replace("|", "\\|").split())


def section(model: type[BaseModel], prefix: str) -> list[str]:
    doc = " ".join((model.__doc__ or "nested settings.").split())
    lines = [f"## {model.__name__}", ""]
    if prefix:
        lines += [f"`{prefix}` in run.json: {doc}", ""]
    lines += ["| setting | type | default | allowed | description |", "| --- | --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        lines.append(f"| `{path}` | {type_name(field.annotation)} | {default_of(field)} | {bounds(field)} "
                     f"| {describe(model, name, field)} |")
    return lines + [""]


def nested(model: type[BaseModel]) -> list[tuple[str, type[BaseModel]]]:
    """The nested settings models of RunConfig, by field name, in field order."""
    return [(name, f.annotation) for name, f in model.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)]


def recipes() -> list[str]:
    lines = ["## Recipes", "",
             "What each preset sets when the run does not: these override the defaults above, and an "
             "explicit setting overrides them (a nested one field by field).", "",
             "| preset | settings |", "| --- | --- |"]
    for preset in PRESETS:
        recipe = RECIPES.get(preset, {})
        flat = {f"{k}.{kk}" if isinstance(v, dict) else k: vv
                for k, v in recipe.items() for kk, vv in (v.items() if isinstance(v, dict) else [(None, v)])}
        text = ", ".join(f"`{k}` {json.dumps(v)}" for k, v in flat.items()) or "the defaults"
        lines.append(f"| `{preset}` | {text} |")
    return lines + [""]


def markdown() -> str:
    lines = [INTRO, *section(RunConfig, "")]
    for name, model in nested(RunConfig):
        lines += section(model, name)
    lines += recipes()
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
