"""dedloc-pipeline: volunteer language-model pretraining through an object-storage bucket.

``join`` is the notebook way in (Jupyter, Colab). Everything heavy (torch, the model) is
imported only when it is called, so ``import dedloc_pipeline`` stays quick.
"""

from __future__ import annotations

import threading


def join(bucket: str, run: str, peer_id: str | None = None, key: str | None = None, device: str | None = None,
         until_round: int | None = None, *, micro_batch: int | None = None, threads: int | None = None,
         poll: float = 1.0, endpoint_url: str | None = None, stop: threading.Event | None = None,
         plain: bool | None = None, every: float = 10.0, organizer: str | None = None) -> dict:
    """Volunteer for ``run`` in ``bucket`` from this cell, with a live progress display; returns
    what this session contributed (see ``dedloc_pipeline.monitoring.volunteer.summary``).

    It works until state ``until_round`` is committed, the organizer stops the run, ``stop`` is
    set (from another thread), or the notebook's stop button: the first press finishes an upload
    under way and leaves, a second quits at once. Keep ``peer_id`` stable across sessions: a
    returning peer continues its data where its uploads end. ``key`` is your private key file
    (runs that require signed shards); ``device`` defaults to the GPU when there is one;
    ``organizer`` is the organizer's public key as they gave it (default: the one the run names,
    pinned on first join: ``dedloc_pipeline.trust.pins``).
    """
    from .monitoring.volunteer import make_worker, summary_text, volunteer

    worker = make_worker(bucket, run, peer_id, key, device, micro_batch, threads, poll, endpoint_url,
                         organizer=organizer)
    summary = volunteer(worker, until_round, stop, plain=plain, every=every)
    print(summary_text(summary))
    return summary
