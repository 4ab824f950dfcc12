"""What a volunteer did: the worker made and checked before any model is built, served with a
display until it stops, and the summary of what it contributed. ``dedloc worker`` and
``dedloc_pipeline.join`` (notebooks) both run here.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING

from rich.console import Console
from rich.filesize import decimal

from . import stop
from .display import Display
from .stop import StopRequest
from .uploads import Uploads

if TYPE_CHECKING:  # the display and the summary need no torch of their own
    from ..volunteer.worker import Worker

log = logging.getLogger(__name__)


def summary(worker: Worker, ended: str, ledger: Uploads | None = None) -> dict:
    """What this session contributed. With a ledger, the COMMITs say what counted (a few bucket
    reads); without (a second Ctrl-C), only what was uploaded."""
    s = worker.snapshot()
    out = {"peer": s.peer, "run": worker.run.name, "state": s.state, "ended": ended,
           "samples_uploaded": s.uploaded, "shards": len(s.uploads),
           "rounds": len({r for r, _, _ in s.uploads}), "samples_computed": s.computed,
           "seconds": worker.clock.monotonic() - worker.started, "bytes_up": s.bytes_up, "bytes_down": s.bytes_down,
           "signal": None}
    if ledger is not None:
        t = ledger.tally(s.uploads, worker.run.latest() if s.uploads else -1)
        out.update(samples_counted=t["counted"], shards_counted=t["counted_shards"], samples_open=t["open"],
                   samples_missed=t["missed"], rejected=t["rejected"])
    return out


ENDED = {"until_round": "state reached", "run_stopped": "the organizer stopped the run",
         "stop_requested": "asked to stop", "ctrl_c": "stopped cleanly after {signal}",
         "interrupted": "interrupted"}


def summary_text(s: dict) -> str:
    why = ENDED[s["ended"]].format(signal=stop.name(s.get("signal")))
    lines = [f"{s['peer']}: stopped at state {s['state']} ({why}); "
             f"in {timedelta(seconds=round(s['seconds']))} this session:",
             f"  uploaded  {s['samples_uploaded']} samples in {s['shards']} shards to {s['rounds']} rounds",
             f"  computed  {s['samples_computed']} samples; traffic {decimal(s['bytes_up'])} up, "
             f"{decimal(s['bytes_down'])} down"]
    if "samples_counted" not in s:
        lines.append("  counted   not looked up (interrupted)")
        return "\n".join(lines)
    lines.append(f"  counted   {s['samples_counted']} samples ({s['shards_counted']} shards) in committed "
                 "states")
    if s["samples_open"]:
        lines.append(f"  open      {s['samples_open']} samples in rounds not committed yet")
    if s["samples_missed"]:
        lines.append(f"  missed    {s['samples_missed']} samples arrived after their round closed")
    for x in s["rejected"]:
        lines.append(f"  rejected  {x['samples']} samples in round {x['round']}: {x['reason']}")
    return "\n".join(lines)


def volunteer(worker: Worker, until_round: int | None = None, event: threading.Event | None = None,
              plain: bool | None = None, every: float = 10.0, console: Console | None = None,
              aggregate: bool = False) -> dict:
    """Serve with a display until ``until_round``, the run's STOP, ``event`` or a stop signal
    (Ctrl-C, SIGTERM, SIGHUP); then leave and return the summary (``ended`` says which, and
    ``signal`` which signal). ``aggregate``: serve as a volunteer aggregator too, on a thread of
    its own (``volunteer/aggregator.py``)."""
    request, interrupted, done = StopRequest(event), False, threading.Event()
    role = _aggregator(worker, lambda: done.is_set() or request()) if aggregate else None
    with request, Display(worker, request, plain, every, console, role) as display:
        try:
            state = worker.serve(until_round, request)
        except KeyboardInterrupt:
            state, interrupted = worker.state, True
        finally:
            done.set()
    if role is not None:
        log.info("aggregated %d parts (%d revealed)", len(role.done), sum(d.revealed for d in role.done.values()))
    if interrupted:
        ended = "interrupted"
    elif request.presses:
        ended = "ctrl_c"
    elif worker.stopped:
        ended = "run_stopped"
    elif until_round is not None and state is not None and state >= until_round:
        ended = "until_round"
    else:
        ended = "stop_requested"
    return dict(summary(worker, ended, None if interrupted else display.ledger), signal=request.signum)


def _aggregator(worker: Worker, stop):
    """The worker's volunteer's aggregator role, served on a daemon thread until ``stop()``."""
    from ..volunteer.aggregator import AggregatorRole
    if worker.transfers.signer is None:
        raise ValueError("--aggregate needs your key (--key): an aggregator signs what it writes")
    role = AggregatorRole(worker.run, worker.peer, worker.transfers.signer, worker.clock)
    threading.Thread(target=role.serve, args=(stop, worker.poll_s or 2.0), name="aggregator", daemon=True).start()
    return role


def _import_tqdm_auto() -> None:
    """transformers and huggingface_hub import ``tqdm.auto``, which in a kernel without ipywidgets
    warns "IProgress not found" and falls back to tqdm's console bars. A worker shows none of
    their bars, so that one warning only alarms a volunteer: import it first without it."""
    from tqdm import TqdmWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
        importlib.import_module("tqdm.auto")


def make_worker(bucket: str, run: str, peer_id: str | None = None, key: str | None = None,
                device: str | None = None, micro_batch: int | None = None, threads: int | None = None,
                poll: float | None = None, endpoint_url: str | None = None, precision: str = "fp32",
                organizer: str | None = None, write_profile: str | None = None) -> Worker:
    """A volunteer's worker, checked before any model is built: a usable peer id, a device that
    exists (default: the GPU when there is one), the key it signs with, and the run's organizer
    key against the one this volunteer trusts (``organizer``, or pinned: ``trust.pins``).
    ``write_profile``: the AWS profile of a second credential, which writes its own prefix (R2's
    read-write one, ``dedloc policy --format r2``); the first reads."""
    _import_tqdm_auto()
    from ..protocol.run import Run
    from ..storage.bucket import Bucket
    from ..storage.layout import name_problem
    from ..trust import identity, pins
    from ..volunteer.worker import Worker

    if peer_id is not None and (problem := name_problem(peer_id)):
        raise ValueError(problem)
    for flag, value, least in (("--micro-batch", micro_batch, 1), ("--threads", threads, 1), ("--poll", poll, 0)):
        if value is not None and not value >= least:
            raise ValueError(f"{flag} {value}: at least {least}")
    import torch
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device}: not a torch device (cpu, cuda, cuda:1, mps)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device on this machine (use --device cpu)")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: no Apple GPU (MPS) on this machine (use --device cpu)")
    if kind not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {device}: this worker trains on cpu, cuda or mps")
    signer = identity.load(os.path.expanduser(key)) if key else None
    r = Run(Bucket(bucket, endpoint_url=endpoint_url, create=False), run)
    if shown := pins.check(r.bucket.url, run, r.config.organizer_key, organizer):
        log.warning("%s", shown)
    w = Worker(r, peer_id, micro_batch, threads, poll_s=poll, device=device, signer=signer, precision=precision)
    if write_profile:
        r.bucket.confine_writes(r.keys.volunteer_dir(w.peer), {"profile": write_profile})
    return w
