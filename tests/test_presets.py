"""Model presets and their run recipes (sahajBERT: ALBERT-large with LAMB, target batch 4096)."""

import pytest
from typer.testing import CliRunner

from dedloc_pipeline.cli import app
from dedloc_pipeline.model.albert import FlatLayout, build_model
from dedloc_pipeline.protocol.config import recipe_config
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage.bucket import Bucket


@pytest.mark.parametrize("preset,low,high", [("tiny", 1.5e6, 2.5e6), ("small", 3e6, 8e6), ("sahajbert", 16e6, 20e6)])
def test_preset_sizes(preset, low, high):
    model = build_model(preset, seed=0)
    n = FlatLayout(model).n
    assert low <= n <= high, n
    if preset == "sahajbert":
        c = model.config
        assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.embedding_size,
                c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (1024, 24, 16, 128, 4096, 32000, 512)
        assert c.num_hidden_groups == 1  # the 24 layers share one set of weights


def test_sahajbert_recipe_and_explicit_overrides():
    cfg = recipe_config("s", "sahajbert")
    o = cfg.optimizer
    assert cfg.target_batch_size == 4096
    assert (o.name, o.lr, o.warmup_steps, o.weight_decay, o.eps, o.clamp) == ("lamb", 0.00176, 5000, 0.01, 1e-6, 10000)
    mine = recipe_config("s", "sahajbert", target_batch_size=512, optimizer={"lr": 1e-3, "name": None})
    assert mine.target_batch_size == 512 and mine.optimizer.lr == 1e-3 and mine.optimizer.name == "lamb"
    assert recipe_config("t").optimizer.name == "adamw" and recipe_config("t").target_batch_size == 256


def test_init_takes_the_recipe_of_its_preset(tmp_path):
    url = f"file://{tmp_path}/b"
    res = CliRunner().invoke(app, ["init", "--bucket", url, "--run", "big", "--preset", "small", "--lr", "5e-4"])
    assert res.exit_code == 0, res.output
    cfg = Run(Bucket(url), "big").config
    assert cfg.preset == "small" and cfg.target_batch_size == 512 and cfg.optimizer.lr == 5e-4
    bad = CliRunner().invoke(app, ["init", "--bucket", url, "--run", "x", "--preset", "huge"])
    assert bad.exit_code != 0 and "unknown preset" in bad.output
    assert not Bucket(url).exists("runs/x/run.json")  # nothing written
