"""Model presets and their run recipes (sahajBERT: ALBERT-large with LAMB, target batch 4096)."""

import pytest
import torch
from transformers import LlamaForCausalLM
from typer.testing import CliRunner

from dedloc_pipeline.cli import app
from dedloc_pipeline.model.albert import build_model
from dedloc_pipeline.model.causal import causal_config
from dedloc_pipeline.model.flat import FlatLayout
from dedloc_pipeline.planning.planned import n_params
from dedloc_pipeline.protocol.config import recipe_config
from dedloc_pipeline.protocol.run import Run
from dedloc_pipeline.storage.bucket import Bucket


@pytest.mark.parametrize("preset,low,high", [("micro", 2e5, 4e5), ("tiny", 1.5e6, 2.5e6), ("small", 3e6, 8e6),
                                             ("sahajbert", 16e6, 20e6)])
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


@pytest.mark.parametrize("preset,billions", [("causal-125m", 0.11), ("causal-1b", 1.1), ("causal-7b", 6.7)])
def test_the_large_causal_presets_have_their_size_on_the_meta_device(preset, billions):
    """Built without memory (torch's meta device): their shapes, and the count the cost model
    and the scale table (docs/diloco.md) use."""
    with torch.device("meta"):
        model = LlamaForCausalLM(causal_config(preset))
    n = sum(p.numel() for p in model.parameters())
    assert n == n_params(preset)
    assert abs(n / 1e9 - billions) / billions < 0.05, n
    assert all(p.is_meta for p in model.parameters())
