"""algorithm diloco: volunteers take inner optimizer steps, the aggregators an outer step.

Two references, each knowing nothing of shards, chunks, parts or codecs:
- one inner SGD step per shard and an outer SGD step of lr 1 without momentum is the default
  algorithm with SGD: the one-process replay of test_equivalence must land on the same
  parameters, with delayed updates too (a carried shard's inner steps move with the state);
- with several inner AdamW steps per shard, a textbook DiLoCo: every volunteer's own AdamW
  (fresh with each shard, or with ``inner_state: kept`` kept across rounds) steps through its
  shard's samples from state r, the pseudo-gradients' sample-weighted mean takes a Nesterov step.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dedloc_pipeline.compute.optim import lr_at
from dedloc_pipeline.model.albert import pretraining_loss_sum
from dedloc_pipeline.model.data import make_source
from dedloc_pipeline.model.flat import FlatLayout
from dedloc_pipeline.organizer import ledger
from dedloc_pipeline.protocol import shard
from dedloc_pipeline.storage import vector
from dedloc_pipeline.testing import collaborate

from .test_equivalence import reference

PEERS = [("a", 4), ("b", 3), ("c", 5)]


@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "delayed"])
@pytest.mark.slow
def test_one_inner_sgd_step_is_the_default_algorithm_with_sgd(make_run, delayed):
    rounds = 3
    sgd = {"name": "sgd", "lr": 0.5, "warmup_steps": 2}
    run = make_run(run="diloco", codec="none", optimizer=sgd, delayed_updates=delayed, algorithm="diloco",
                   inner_batch=10_000, outer={"lr": 1.0, "momentum": 0.0},  # one inner step: at the upload
                   close={"probe_samples": None})  # SGD at lr 0.5 overshoots alone: this is about the sums
    assert run.n_parts >= 2
    collaborate(run, PEERS, rounds)
    thetas = reference(run, rounds)  # the same samples, one SGD step per round in one process
    for r in range(1, rounds + 1):
        got = run.load_params(r)
        # float32: state minus (state minus step) is the step to within an ulp of the state
        assert np.abs(got - thetas[r]).max() <= 2e-6, f"state {r}"
        assert np.abs(got - thetas[0]).max() > 1e-3
    shards = [s for r in range(rounds) for s in run.bucket.read_json(run.keys.close(r))["accepted"]]
    assert {s["peer"] for s in shards} == {p for p, _ in PEERS}
    if delayed:
        assert any(s["stale_samples"] for s in shards), "delayed updates never produced a stale sample"


def kept_manifests(monkeypatch) -> dict[str, bytes]:
    """Every manifest as it stood when a commit pruned the volunteers' prefixes: what a
    reference needs of rounds pruned since (late shards too, which no CLOSE lists)."""
    seen: dict[str, bytes] = {}
    real = ledger.prune

    def prune(run, newest, *a, **kw):
        seen.update(run.bucket.read_many([k for k in run.bucket.find(run.keys.volunteers_dir)
                                          if (w := run.keys.written(k)) is not None and w.kind == "manifest"]))
        return real(run, newest, *a, **kw)

    monkeypatch.setattr(ledger, "prune", prune)
    return seen


def diloco_reference(run, rounds: int, micro: dict[str, int], manifests: dict[str, bytes],
                     inner_state: str | None = None) -> list[np.ndarray]:
    """DiLoCo in one process: in each round every shard a volunteer made starts at state r and
    takes an AdamW step (the round's learning rate) whenever the micro-batches since the last
    reach ``inner_batch``, and one on the rest; Nesterov SGD on the accepted shards'
    sample-weighted mean of (state - local). The AdamW is fresh with each shard, or with
    ``inner_state: kept`` the volunteer's own across rounds (late shards, which no CLOSE lists,
    moved it too); ``inner_state``: default the run's."""
    cfg, oc = run.config, run.config.optimizer
    model = run.build_model()
    source = make_source(run)
    locals_, inner = {}, {}
    outer_model = copy.deepcopy(model)
    outer_flat = FlatLayout(outer_model)
    outer = torch.optim.SGD(outer_model.parameters(), lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True)
    thetas = [outer_flat.get()]

    def inner_step(m, peer, pending, r):
        m.zero_grad()
        b = [source.batch(peer, i, 1) for i in pending]
        pretraining_loss_sum(m, {k: torch.cat([x[k] for x in b]) for k in b[0]}).backward()
        for p in m.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad / len(pending)
        for g in inner[peer].param_groups:
            g["lr"] = lr_at(oc, r + 1)
        inner[peer].step()
        pending.clear()

    for r in range(rounds):
        close = run.bucket.read_json(run.keys.close(r))
        weight = {s["key"]: s["weight"] for s in close["accepted"]}
        total = np.zeros(outer_flat.n, np.float64)
        for peer in sorted(micro):
            if peer not in locals_:
                locals_[peer] = copy.deepcopy(model)
                named = dict(locals_[peer].named_parameters())
                lf = FlatLayout(locals_[peer])
                inner[peer] = torch.optim.AdamW(
                    [{"params": [named[t.name] for t in lf.tensors if t.decay], "weight_decay": oc.weight_decay},
                     {"params": [named[t.name] for t in lf.tensors if not t.decay], "weight_decay": 0.0}],
                    lr=oc.lr, betas=oc.betas, eps=oc.eps)
            m, lf = locals_[peer], FlatLayout(locals_[peer])
            mine = [k for k in manifests if run.keys.of_round([k], r, "manifest") and run.keys.writer(k) == peer]
            for mkey in sorted(mine):  # in the order made
                manifest = shard.Manifest.model_validate_json(manifests[mkey])
                if (inner_state or cfg.inner_state) == "shard":
                    inner[peer].state.clear()
                lf.set(thetas[r])
                idx = [i for a, c in manifest.data.ranges for i in range(a, a + c)]
                pending: list[int] = []
                for i in range(0, len(idx), micro[peer]):
                    pending.extend(idx[i:i + micro[peer]])
                    if len(pending) >= cfg.inner_batch:
                        inner_step(m, peer, pending, r)
                if pending:
                    inner_step(m, peer, pending, r)
                total += weight.get(run.keys.shard_of(mkey), 0) * (thetas[r].astype(np.float64) - lf.get())
        outer_flat.set(thetas[r])
        mean = (total / sum(weight.values())).astype(np.float32)
        named = dict(outer_model.named_parameters())
        for t in outer_flat.tensors:
            named[t.name].grad = torch.from_numpy(mean[t.offset:t.offset + t.size].copy()).view(t.shape)
        outer.step()
        thetas.append(outer_flat.get())
    return thetas


@pytest.mark.parametrize("inner_state", ["shard", "kept"])
@pytest.mark.slow
def test_inner_adamw_steps_and_an_outer_nesterov_step_are_diloco(make_run, monkeypatch, inner_state):
    rounds = 3
    run = make_run(run="diloco", codec="none", optimizer={"name": "adamw", "lr": 3e-3, "warmup_steps": 2},
                   algorithm="diloco", inner_batch=8, target_batch_size=48, inner_state=inner_state)
    manifests = kept_manifests(monkeypatch)
    collaborate(run, PEERS, rounds)
    thetas = diloco_reference(run, rounds, dict(PEERS), manifests)
    for r in range(1, rounds + 1):
        got = run.load_params(r)
        assert np.abs(got - thetas[r]).max() <= 1e-5, f"state {r}: max |diff| {np.abs(got - thetas[r]).max():.3g}"
    # the control: the other way of keeping the inner optimizer is another trajectory
    other = diloco_reference(run, rounds, dict(PEERS), manifests, {"shard": "kept", "kept": "shard"}[inner_state])
    assert np.abs(run.load_params(rounds) - other[rounds]).max() > 1e-3
    # the outer momentum is kept by the aggregators, beside the parameters
    momentum = vector.read_vector(run.bucket, run.keys.optim(rounds, "momentum_buffer"), run.dense_format)
    assert np.abs(momentum).max() > 0
    shards = [s for r in range(rounds) for s in run.bucket.read_json(run.keys.close(r))["accepted"]]
    assert max(s["samples"] for s in shards) >= 2 * 8, "no shard took two inner steps"


@pytest.mark.slow
def test_sparse_pseudo_gradients_take_hundredths_of_a_byte_per_parameter(make_run):
    rounds = 3
    run = make_run(run="sparse", codec="sparse", algorithm="diloco", inner_batch=8, target_batch_size=48,
                   optimizer={"name": "adamw", "lr": 3e-3})
    assert run.config.param_codec == "sparse"  # what peers download too
    workers = collaborate(run, PEERS, rounds)
    shards = [s for r in range(rounds) for s in run.bucket.read_json(run.keys.close(r))["accepted"]]
    assert {s["peer"] for s in shards} == {p for p, _ in PEERS}
    for s in shards:  # as stored: chunks, Blosc headers and zarr metadata
        assert sum(run.bucket.sizes(s["key"]).values()) / run.flat.n <= 0.05, s["key"]
    assert np.abs(run.load_params(rounds) - run.load_params(0)).max() > 1e-3
    # every peer rebuilt each state from its sparse delta bit for bit
    for w in workers:
        assert w.params.tobytes() == run.load_params(w.state).tobytes()


def test_the_sparse_codec_is_for_diloco_and_whole_blocks():
    from .conftest import small_config

    with pytest.raises(ValueError, match="--algorithm diloco"):
        small_config(codec="sparse")
    with pytest.raises(ValueError, match="multiple of 256"):
        small_config(codec="sparse", algorithm="diloco", block_size=128, chunk_size=1 << 16)


def test_a_bf16_volunteer_sends_only_what_its_inner_steps_moved(make_run):
    """bfloat16 weights round state r; the pseudo-gradient is measured from the rounded start, so
    a volunteer that took no step sends zeros, and one that did sends about what an fp32 one does."""
    from dedloc_pipeline.volunteer.worker import Worker

    run = make_run(run="bf16", algorithm="diloco", inner_batch=8, optimizer={"name": "sgd", "lr": 0.5})
    with pytest.raises(ValueError, match="bf16 is for diloco"):
        Worker(make_run(run="plain"), "x", precision="bf16")
    got = {}
    for precision in ("fp32", "bf16"):
        w = Worker(run, "p", micro_batch=4, threads=1, poll_s=0, precision=precision)  # the same samples
        w.sync()
        w._compute(0)  # 4 samples: no inner step yet
        assert not np.any(w.local.base - w.flat.get())
        w._compute(0)  # 8: one inner step
        got[precision] = w.local.base - w.flat.get()
        w.local.drop(w.params)
    fp32, bf16 = got["fp32"], got["bf16"]
    cos = float(fp32 @ bf16 / np.linalg.norm(fp32) / np.linalg.norm(bf16))
    assert cos > 0.99 and abs(np.linalg.norm(bf16) / np.linalg.norm(fp32) - 1) < 0.05, cos
