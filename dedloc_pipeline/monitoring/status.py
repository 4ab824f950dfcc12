"""What a run looks like now, read from the bucket alone (``dedloc status``, ``plot``, ``report``).

Every number of a closed round comes from its COMMIT (the ledger). The open round's progress and
ETA come from the round view the scheduler publishes (``protocol/view.py``): samples of the shards
it validated, and the live peers' pending samples and speed. Manifests are not added up here:
their counts are claims until the scheduler has validated the shards. The peers' last-seen times
come from their heartbeats, which any peer writes about itself, read with their bounds.
"""

from __future__ import annotations

import time

from ..organizer import lease
from ..protocol import heartbeat, view
from ..protocol.clock import duration
from ..protocol.close import committed
from ..protocol.run import Run


def _commits(run: Run, latest: int) -> tuple[dict[int, dict], dict[str, str]]:
    """Every COMMIT (``Run.commits``): an older state's damaged one is read around and named; the
    newest state's is not (``Damaged``: `dedloc repair` mends it)."""
    commits, damaged = run.commits()
    if run.keys.commit(latest) in damaged:
        raise damaged[run.keys.commit(latest)]
    return commits, {key: str(exc) for key, exc in damaged.items()}


def _heartbeats(run: Run, r: int, now: float) -> dict[str, tuple[float, bool]]:
    """Round r's heartbeats by peer, and round r + 1's (a peer computing ahead while r is reduced):
    when its newest was written, and whether that one is live at ``now`` (the scheduler's rule,
    ``heartbeat.counted``: a heartbeat saying the peer left is not). The peer is the prefix the key lies
    under, which the volunteer's bucket policy binds to it, not the body's claim; a key that is
    no peer's heartbeat, or one above its size bound, is not read; an unreadable one
    (``heartbeat.parse``) is skipped."""
    keys, cfg = run.keys, run.config
    listed, _ = run.written()
    small = [k for rr in (r, r + 1) for k in keys.of_round(listed, rr, "progress")
             if listed[k][0] <= heartbeat.MAX_HEARTBEAT_BYTES]
    beats: dict[str, tuple[float, bool]] = {}
    for key, raw in run.bucket.read_many(small).items():
        beat = heartbeat.parse(raw)
        if beat is None:
            continue
        peer = keys.peer_of_progress(key)
        if peer not in beats or beat.time >= beats[peer][0]:  # its newest says
            beats[peer] = (beat.time, heartbeat.counted(beat, beat.round, now, cfg.peer_timeout_s,
                                                        cfg.target_batch_size, cfg.cadence.heartbeat_max_s) is not None)
    return beats


def _progress(run: Run, r: int, now: float) -> dict:
    """Open round r as its round view has it: the validated samples, and while the view is fresh
    (written within its ``view.lifetime`` of ``now``) the live peers' pending samples and speed; the
    ETA from them, by the one ETA rule (``view.eta``). No view of round r: nothing validated."""
    cfg, target = run.config, run.config.target_batch_size
    published = view.read(run.bucket, run.keys, cfg.organizer_key)
    v = published if published is not None and published.round == r else None
    stands = view.lifetime(published, cfg.peer_timeout_s, cfg.cadence.heartbeat_max_s)
    fresh = v is not None and abs(now - v.at) < stands
    validated = v.validated_samples if v is not None else 0
    # live peers: those of the round, and those computing the next one ahead while it is reduced
    pending, peers, rate = (v.pending_samples, v.peers + v.ahead_peers, v.samples_per_s) if fresh else (0, 0, 0.0)
    closed = run.bucket.exists(run.keys.close(r))
    samples = validated + pending
    return {"round": r, "samples": samples, "uploaded_samples": validated, "peers": peers, "closed": closed,
            "target": target, "fraction": min(1.0, samples / target), "samples_per_s": rate,
            "eta_s": view.eta(target, validated, pending, rate, closed),
            # the scheduler as its view shows it: when it last published, and whether it said it ended
            "scheduler_seen_at": published.written_at if published is not None else None,
            "scheduler_stands_s": stands,
            "scheduler_ended": published.ended if published is not None else None}


def _round(c: dict) -> dict:
    """One closed round as the ledger has it; its duration runs from its first work (the
    scheduler's ``started_at``; rounds committed before it was recorded: the opening) to commit,
    so a round nobody worked on for an hour does not look an hour slow."""
    opened, committed = c.get("opened_at"), c["committed_at"]
    began = c.get("started_at") or opened
    duration = committed - began if began is not None else None
    return {"round": c["round"], "samples": c["samples"], "contributors": c["contributors"],
            "peers": len(set(c["contributors"])), "loss": c["loss"], "rejected": len(c.get("rejected", [])),
            "lr": c.get("lr"), "opened_at": opened, "closed_at": c["closed_at"], "committed_at": committed,
            "duration_s": duration, "settled_s": committed - c["closed_at"], "stages": c.get("stages"),
            "samples_per_s": c["samples"] / duration if duration and duration > 0 else None}


def status(run: Run, now: float | None = None) -> dict:
    """The open round's progress and ETA, the contributors' leaderboard, and the ledger of closed rounds."""
    cfg = run.config
    now = run.clock.time() if now is None else now
    latest = run.latest()
    commits, damaged = _commits(run, latest)
    peers: dict[str, dict] = {}

    def peer(pid: str) -> dict:
        return peers.setdefault(pid, {"peer_id": pid, "samples": 0, "rounds": 0, "aggregated": 0,
                                      "last_seen": None, "live": False})

    history = [_round(commits[s]) for s in sorted(commits) if s > 0]
    for s in sorted(commits):
        c = commits[s]
        for pid in set(c.get("contributors", [])):
            peer(pid)["rounds"] += 1
        for pid in (p for by in c.get("aggregated_by", []) for p in by if p != "organizer"):
            peer(pid)["aggregated"] += 1  # a part it computed and another volunteer's answer agreed with
        for sh in committed(c)[0]:  # counted: a claim above its volunteer's cap counts capped
            p = peer(sh.peer)
            p["samples"] += sh.counted
            p["last_seen"] = max(p["last_seen"] or 0.0, c["closed_at"])
    for p in peers.values():
        p["samples"] = round(p["samples"])
    for pid, (written, live) in _heartbeats(run, latest, now).items():
        p = peer(pid)
        p["last_seen"] = max(p["last_seen"] or 0.0, written)
        p["live"] = live
    return {
        "run": run.name, "round": latest, "target_batch_size": cfg.target_batch_size,
        "peer_timeout_s": cfg.peer_timeout_s,
        "codec": cfg.codec, "optimizer": cfg.optimizer.name, "n_params": commits.get(0, {}).get("n_params"),
        "progress": _progress(run, latest, now),
        "stopped": run.stopped(),
        "scheduler": lease.holder_of(run.bucket, run.keys, now),  # who holds the lease, and since when
        "peers": sorted(peers.values(), key=lambda p: (-p["samples"], p["peer_id"])),
        "history": history,
        "damaged": damaged,  # older states' COMMITs that are not JSON, by key: left out of the history
        "at": now,
    }


def damaged_line(s: dict) -> str | None:
    """The older COMMITs read around, if any: which, and what to do."""
    if not s["damaged"]:
        return None
    return (f"damaged, left out of the history: {', '.join(sorted(s['damaged']))} (an older state's COMMIT: the "
            "run goes on without it; restore it from a copy of the bucket, or leave it)")


def scheduler_line(s: dict) -> str:
    """What is closing rounds, if anything, and how to go on when nothing is: the run stopped,
    the scheduler ended, or none has published for its view's lifetime (``view.lifetime``)."""
    p = s["progress"]
    if s["stopped"]:
        return (f"stopped: STOP.json is in the run; to continue, delete runs/{s['run']}/STOP.json and start a "
                "scheduler (dedloc aggregate, or make pretrain)")
    if p["scheduler_ended"]:
        return f"no scheduler: {p['scheduler_ended']}; start one to continue (dedloc aggregate, or make pretrain)"
    seen = p["scheduler_seen_at"]
    if seen is None:
        return "no scheduler has published yet: start one (dedloc aggregate, or make pretrain)"
    age = max(0.0, s["at"] - seen)
    if age >= p["scheduler_stands_s"]:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seen))
        return (f"no scheduler has published for {duration(age)} (since {since}): it is stopped, dead or stuck; "
                "start one (dedloc aggregate, or make pretrain)")
    holder = s.get("scheduler")
    return f"scheduler: published {duration(age)} ago" + (f"; the lease is {holder}" if holder else "")


def show(s: dict, console) -> None:
    """``dedloc status`` for people: a headline, the open round's bar, the last rounds, the leaderboard.

    Every string from the bucket goes in as ``Text``, never as markup, so a peer cannot style the
    organizer's terminal.
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    p, now = s["progress"], s["at"]
    console.print(Text(f"run {s['run']}: state {s['round']}, round {p['round']} at {p['samples']}/"
                       f"{s['target_batch_size']} samples from {p['peers']} live peers", style="bold"))
    line = scheduler_line(s)
    console.print(Text(line, style="" if line.startswith("scheduler:") else "bold yellow"))
    if damaged := damaged_line(s):
        console.print(Text(damaged, style="bold yellow"))
    eta = "closed, being reduced" if p["closed"] else (
        f"ETA {duration(p['eta_s'])}" if p["eta_s"] is not None else "ETA unknown")
    done = round(30 * p["fraction"])
    bar = Text(f"open round {p['round']} ")
    bar.append("━" * done, style="green").append("─" * (30 - done), style="dim")
    bar.append(f" {100 * p['fraction']:.0f}% of {s['target_batch_size']}, {p['samples_per_s']:.1f} samples/s, {eta}")
    console.print(bar)

    rounds = Table(box=None, show_header=False, title="last rounds", title_justify="left", padding=(0, 1),
                   pad_edge=False)
    for _ in range(6):
        rounds.add_column(no_wrap=True)
    for h in s["history"][-10:]:
        speed = f"{h['samples_per_s']:.1f} samples/s" if h["samples_per_s"] else ""
        rounds.add_row(f"round {h['round']}:", f"loss {h['loss']:.4f}", f"{h['samples']} samples",
                       f"{h['peers']} contributors", duration(h["duration_s"]), speed)
    if s["history"]:
        console.print(rounds)

    board = Table(title="contributors", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    board.add_column("peer", no_wrap=True, overflow="ellipsis", max_width=64)
    for name in ("samples", "rounds", "parts aggregated", "last seen"):  # counted in COMMITs; last seen: heartbeats too
        board.add_column(name, justify="right", no_wrap=True)
    for q in s["peers"]:
        seen = "live" if q["live"] else (
            f"{duration(max(0.0, now - q['last_seen']))} ago" if q["last_seen"] else "never")
        board.add_row(Text(q["peer_id"]), f"{q['samples']:,}", str(q["rounds"]), str(q["aggregated"]), seen)
    console.print(board)
