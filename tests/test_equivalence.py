"""Invariant 3: with the exact codec, N collaborating peers train the same model as one process.

The reference below knows nothing of shards, chunks, parts or codecs: it takes the samples each
round accepted (as the manifests name them), computes the whole batch's gradient on full tensors
(a delayed-update shard's stale samples on the state before), and steps torch's AdamW or SGD,
or a textbook LAMB. The protocol must land on the same parameters.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dedloc_pipeline.compute.optim import lr_at
from dedloc_pipeline.model.data import make_source
from dedloc_pipeline.model.families import loss_sum
from dedloc_pipeline.model.flat import FlatLayout
from dedloc_pipeline.testing import collaborate


def _lamb_step(params, decay, state, cfg, lr, step):
    b1, b2 = cfg.betas
    for name, p in params.items():
        st = state.setdefault(name, {"m": torch.zeros_like(p), "v": torch.zeros_like(p)})
        g = p.grad
        st["m"] = b1 * st["m"] + (1 - b1) * g
        st["v"] = b2 * st["v"] + (1 - b2) * g * g
        u = (st["m"] / (1 - b1 ** step)) / ((st["v"] / (1 - b2 ** step)).sqrt() + cfg.eps)
        if decay[name]:
            u = u + cfg.weight_decay * p
        pn, un = p.detach().double().norm(), u.detach().double().norm()
        trust = float(pn / un) if pn > 0 and un > 0 else 1.0
        with torch.no_grad():
            p -= lr * min(trust, cfg.clamp) * u


def reference(run, rounds: int) -> list[np.ndarray]:
    cfg = run.config
    model = run.build_model()
    flat = FlatLayout(model)
    source = make_source(run)
    params = dict(model.named_parameters())
    decay = {t.name: t.decay for t in flat.tensors}
    oc = cfg.optimizer
    groups = [{"params": [params[n] for n in params if decay[n]], "weight_decay": oc.weight_decay},
              {"params": [params[n] for n in params if not decay[n]], "weight_decay": 0.0}]
    torch_opt = (torch.optim.SGD(groups, lr=oc.lr, momentum=oc.momentum, nesterov=oc.nesterov) if oc.name == "sgd"
                 else torch.optim.AdamW(groups, lr=oc.lr, betas=oc.betas, eps=oc.eps))
    lamb_state: dict = {}
    thetas = [flat.get()]
    for r in range(rounds):
        close = run.bucket.read_json(run.keys.close(r))
        grad = np.zeros(flat.n, np.float64)
        for s in close["accepted"]:
            idx = [i for a, c in s["data"]["ranges"] for i in range(a, a + c)]
            k = s["stale_samples"]
            for ids, theta in ((idx[:k], thetas[r - 1] if r else None), (idx[k:], thetas[r])):
                if not ids:
                    continue
                flat.set(theta)
                model.zero_grad()
                batches = [source.batch(s["data"]["stream"], i, 1) for i in ids]
                batch = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
                loss_sum(model, batch).backward()
                grad += flat.grad()
        flat.set(thetas[r])
        g = (grad / close["samples"]).astype(np.float32)
        for t in flat.tensors:
            params[t.name].grad = torch.from_numpy(g[t.offset:t.offset + t.size].copy()).view(t.shape)
        lr = lr_at(oc, r + 1)
        if oc.name in ("adamw", "sgd"):
            for group in torch_opt.param_groups:
                group["lr"] = lr
            torch_opt.step()
        else:
            _lamb_step(params, decay, lamb_state, oc, lr, r + 1)
        thetas.append(flat.get())
    return thetas


CASES = [
    ([("solo", 4)], "adamw", False),
    ([("a", 4), ("b", 3)], "adamw", True),
    ([("a", 4), ("b", 3), ("c", 5)], "adamw", False),
    ([("a", 4), ("b", 3), ("c", 5)], "adamw", True),
    ([("a", 4), ("b", 3)], "lamb", False),
    ([("a", 4), ("b", 3), ("c", 5)], "lamb", True),
]


@pytest.mark.parametrize("peers,optimizer,delayed", CASES,
                         ids=[f"{len(p)}peers-{o}-{'delayed' if d else 'sync'}" for p, o, d in CASES])
@pytest.mark.slow
def test_n_peers_equal_one_process(make_run, peers, optimizer, delayed):
    rounds = 3
    opt = {"name": optimizer, "lr": 3e-3, "warmup_steps": 2}
    run = make_run(codec="none", optimizer=opt, delayed_updates=delayed)
    assert run.n_parts >= 2  # the optimizer really runs on ranges that cut tensors
    collaborate(run, peers, rounds)
    thetas = reference(run, rounds)
    for r in range(1, rounds + 1):
        got = run.load_params(r)
        diff = np.abs(got - thetas[r]).max()
        # Adam divides each element by its own magnitude, so float32 summation-order noise in
        # elements with |g| near eps shows as up to ~1e-3 of a step (lr 3e-3); a wrong sample
        # weighting moves the weights by ~3e-3.
        assert diff <= 5e-6, f"state {r}: max |diff| {diff:.3g}"
        assert np.abs(got - thetas[0]).max() > 1e-4  # and training did move the weights
    shards = [s for r in range(rounds) for s in run.bucket.read_json(run.keys.close(r))["accepted"]]
    assert {s["peer"] for s in shards} == {name for name, _ in peers}
    assert all(s["weight"] == s["samples"] for s in shards), "an honest volunteer's samples were capped"
    if delayed:
        assert any(s["stale_samples"] for s in shards), "delayed updates never produced a stale sample"


@pytest.mark.slow
def test_a_causal_decoder_in_n_peers_equals_one_process(make_run):
    """The same invariant for the causal family (model/causal.py): next-token loss, Llama."""
    rounds = 3
    run = make_run(preset="causal-tiny", codec="none", optimizer={"lr": 3e-3, "warmup_steps": 2}, delayed_updates=True)
    assert type(run.build_model()).__name__ == "LlamaForCausalLM"
    collaborate(run, [("a", 4), ("b", 3), ("c", 5)], rounds)
    thetas = reference(run, rounds)
    for r in range(1, rounds + 1):
        assert np.abs(run.load_params(r) - thetas[r]).max() <= 5e-6, f"state {r}"
    losses = [run.commit_of(r)["loss"] for r in range(1, rounds + 1)]
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
def test_int8_loss_curve_stays_close_to_exact(bucket):
    from dedloc_pipeline.protocol.run import init_run

    from .conftest import small_config

    curves = {}
    for codec in ("none", "int8"):
        run = init_run(bucket, small_config(run=f"eq-{codec}", codec=codec, optimizer={"lr": 3e-3}))
        collaborate(run, [("a", 4), ("b", 3), ("c", 5)], rounds=6)
        curves[codec] = np.array([run.commit_of(r)["loss"] for r in range(1, 7)])
    none, int8 = curves["none"], curves["int8"]
    assert none[-1] < none[0] - 0.3  # it learns
    assert np.all(np.abs(int8 - none) / none <= 0.03), (none, int8)
