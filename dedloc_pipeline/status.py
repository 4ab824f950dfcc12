"""What a run looks like now, read from the bucket alone (``dedloc status``)."""

from __future__ import annotations

import json
import time

from .run import Run


def _commits(run: Run) -> list[dict]:
    keys = run.keys
    states = sorted(int(s) for s in run.bucket.list(keys.states) if s.isdigit() and int(s) > 0)
    raw = run.bucket.read_many([keys.commit(s) for s in states])
    return [json.loads(raw[keys.commit(s)]) for s in states if raw.get(keys.commit(s))]


def status(run: Run) -> dict:
    """The open round's progress, every peer's contribution, and the ledger of closed rounds."""
    keys, bucket, cfg = run.keys, run.bucket, run.config
    latest = run.latest()
    commits = _commits(run)
    now = time.time()
    peers: dict[str, dict] = {}

    def peer(pid: str) -> dict:
        return peers.setdefault(pid, {"peer_id": pid, "samples": 0, "rounds": 0, "last_seen": None})

    history = []
    for c in commits:
        for pid in dict.fromkeys(s["peer"] for s in c.get("shards", [])):
            peer(pid)["rounds"] += 1
        for s in c.get("shards", []):
            p = peer(s["peer"])
            p["samples"] += s["samples"]
            p["last_seen"] = max(p["last_seen"] or 0.0, c["closed_at"])
        history.append({"round": c["round"], "samples": c["samples"], "contributors": c["contributors"],
                        "loss": c["loss"], "rejected": len(c.get("rejected", [])), "lr": c.get("lr"),
                        "closed_at": c["closed_at"], "committed_at": c["committed_at"]})
    progress = [json.loads(v) for v in bucket.read_many(bucket.find(keys.progress_dir(latest))).values() if v]
    live = [p for p in progress if now - float(p.get("time", 0)) < cfg.peer_timeout_s]
    for p in progress:
        q = peer(p["peer"])
        q["last_seen"] = max(q["last_seen"] or 0.0, float(p["time"]))
    manifests = bucket.find(keys.manifests_dir(latest))
    uploaded = 0
    for v in bucket.read_many(manifests).values():
        try:
            uploaded += int(json.loads(v)["samples"]) if v else 0
        except (ValueError, KeyError, TypeError):
            continue
    return {
        "run": run.name, "round": latest, "target_batch_size": cfg.target_batch_size,
        "codec": cfg.codec, "optimizer": cfg.optimizer.name, "n_params": run.commit_of(0).get("n_params"),
        "progress": {"round": latest, "samples": uploaded + sum(int(p["samples"]) for p in live),
                     "uploaded_samples": uploaded, "peers": len(live),
                     "closed": bucket.exists(keys.close(latest))},
        "peers": sorted(peers.values(), key=lambda p: -p["samples"]),
        "history": history,
    }
