"""A committed state exported as a Hugging Face directory loads back with transformers."""

from __future__ import annotations

import json

import torch
from transformers import AlbertForMaskedLM, AutoModelForMaskedLM, AutoTokenizer

from dedloc_pipeline.evaluation.export import export, export_to_bucket, model_at
from dedloc_pipeline.model.data import PairSource
from dedloc_pipeline.protocol.run import init_run
from dedloc_pipeline.storage.bucket import Bucket

from .conftest import small_config
from .protocol_driver import collaborate


def test_export_loads_back_with_transformers(bengali, tmp_path):
    url, name = bengali
    run = init_run(Bucket(url), small_config("export", data=name, optimizer={"lr": 3e-3}))
    collaborate(run, [("a", 4), ("b", 4)], rounds=2)
    out = export(run, None, tmp_path / "hf")
    model = AutoModelForMaskedLM.from_pretrained(out)
    assert isinstance(model, AlbertForMaskedLM)
    tok = AutoTokenizer.from_pretrained(out)
    enc = tok("আমি বাংলায় গান গাই।", return_tensors="pt")
    assert enc["input_ids"][0, 0] == tok.cls_token_id and tok.unk_token_id not in enc["input_ids"][0, 1:-1]
    batch = PairSource(run.bucket, name, 0).batch("~heldout", 0, 2)
    ours = model_at(run, 2)
    with torch.no_grad():
        want = ours(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    token_type_ids=batch["token_type_ids"]).prediction_logits
        got = model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           token_type_ids=batch["token_type_ids"]).logits
    assert torch.allclose(got, want, atol=1e-5)  # the committed weights, not a fresh init
    meta = json.loads((out / "dedloc.json").read_text())
    assert meta["state"] == 2 and meta["samples_seen"] == sum(run.commit_of(s)["samples"] for s in (1, 2))
    prefix = export_to_bucket(run, 1)
    assert {"config.json", "model.safetensors", "tokenizer.json", "dedloc.json"} <= set(run.bucket.list(prefix))
