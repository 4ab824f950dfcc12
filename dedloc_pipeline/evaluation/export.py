"""A committed state as a Hugging Face model directory: weights, config and the run's tokenizer.

An ALBERT's directory loads with ``AutoModelForMaskedLM.from_pretrained`` (the sentence-order
head is left out) or ``AlbertForPreTraining.from_pretrained`` (both heads); a causal decoder's
with ``AutoModelForCausalLM`` and a ``text-generation`` pipeline (its tokenizer starts a prompt
with [CLS] and leaves [SEP], the end of a text, to the model). So the result of a volunteer run
is used like any checkpoint on the hub.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..model import tokenizer
from ..model.data import SYNTHETIC
from ..model.flat import FlatLayout
from ..model.presets import family
from ..protocol.run import Run, RunError
from ..storage.layout import DataLayout


def model_at(run: Run, state: int):
    """The run's model with the parameters of committed ``state`` (checked against its COMMIT);
    a state whose parameters were pruned is named as such, with the states that are kept."""
    kept = run.kept_states()
    if state > kept[-1]:
        raise RunError(f"state {state} of run {run.name!r} is not committed (the newest is {kept[-1]})")
    if state not in kept:
        shown = ", ".join(map(str, kept[:3] + ["..."] + kept[-3:] if len(kept) > 6 else kept))
        raise RunError(f"state {state} of run {run.name!r}: its parameters were pruned (kept: the multiples of "
                       f"{run.config.checkpoint_every} and the last {run.config.keep_states}; here {shown})")
    model = run.build_model()
    FlatLayout(model).set(run.load_params(state))
    model.eval()
    return model


def run_tokenizer(run: Run):
    """The tokenizer the run's data set was made with (None for synthetic data)."""
    if run.config.data == SYNTHETIC:
        return None
    return tokenizer.load(run.bucket, DataLayout(run.config.data).tokenizer)


def export(run: Run, state: int | None, dest: str | os.PathLike) -> Path:
    """Write state ``state`` (default: the latest) to folder ``dest``; returns the folder."""
    state = run.latest() if state is None else state
    dest = Path(dest)
    model_at(run, state).save_pretrained(dest)
    tok = run_tokenizer(run)
    if tok is not None:
        tok = tokenizer.for_generation(tok) if family(run.config.preset) == "causal" else tok
        tok.model_max_length = run.seq_len
        tok.save_pretrained(dest)
    commit = run.commit_of(state)
    (dest / "dedloc.json").write_text(json.dumps({
        "run": run.name, "state": state, "samples_seen": sum(run.commit_of(s)["samples"] for s in range(1, state + 1)),
        "loss": commit.get("loss"), "data": run.config.data, "preset": run.config.preset,
        "params_checksums": commit["checksums"]["params"]}, indent=1))
    return dest


def export_to_bucket(run: Run, state: int | None = None) -> str:
    """Export into the run's ``export/{state}/`` prefix, where anyone with read access finds it."""
    state = run.latest() if state is None else state
    prefix = run.keys.export(state)
    with tempfile.TemporaryDirectory() as d:
        export(run, state, d)
        for name in sorted(os.listdir(d)):
            run.bucket.write_bytes(f"{prefix}/{name}", Path(d, name).read_bytes())
    return prefix
