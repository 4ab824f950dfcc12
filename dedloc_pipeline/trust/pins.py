"""The organizer key a volunteer trusts for a run, pinned on the volunteer's machine.

A signed run's run.json names the organizer key and is signed by it, and every record the
organizer writes is checked against that key. But anyone able to rewrite run.json (every
volunteer, on R2) could name a key of their own and sign with it, and every process started
after would believe it. So a volunteer pins the key: the one the organizer gave with the bucket
and run (``--organizer``), or on first join the one run.json names, shown so the volunteer can
check it with the organizer. From then on a run.json naming another key, or none, is refused.
Pins live in ``$DEDLOC_PINS`` (default ``~/.dedloc/pins.json``), one per bucket and run.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .identity import IdentityError, check_public

PINS_ENV = "DEDLOC_PINS"


def path() -> Path:
    return Path(os.environ.get(PINS_ENV) or Path.home() / ".dedloc" / "pins.json")


def check(bucket_url: str, run: str, named: str | None, given: str | None = None) -> str | None:
    """Check run.json's organizer key (``named``; None: an unsigned run) against the one given
    (``given``) or pinned for this bucket and run; IdentityError if they differ. Pins ``given``,
    or on first join ``named``; returns the line to show for a new pin, else None."""
    if given is not None:
        check_public(given)
    pins = _load()
    where = f"{bucket_url.rstrip('/')}#{run}"
    trusted = given or pins.get(where)
    if trusted is None:
        if named is None:
            return None  # an unsigned run: nothing to pin, nothing signed to check
        _save({**pins, where: named})
        return (f"run {run}: organizer key {named} pinned on first join ({path()}): check with the organizer "
                "that it is theirs")
    if named != trusted:
        said = f"organizer key {named[:16]}..." if named else "no organizer key"
        source = "given with --organizer" if given else f"pinned in {path()}"
        raise IdentityError(f"run {run}: run.json names {said}, but this volunteer trusts {trusted[:16]}... "
                            f"({source}): a rewritten run.json is refused. If the organizer did change its "
                            "key, pass the new one with --organizer")
    if pins.get(where) != trusted:
        _save({**pins, where: trusted})
        return f"run {run}: organizer key {trusted} pinned ({path()})"
    return None


def _load() -> dict[str, str]:
    try:
        found = json.loads(path().read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise IdentityError(f"{path()}: the pinned organizer keys are unreadable ({exc}): fix or remove it") from exc
    if not isinstance(found, dict):
        raise IdentityError(f"{path()}: the pinned organizer keys are not a JSON object: fix or remove it")
    return found


def _save(pins: dict[str, str]) -> None:
    """Written whole and renamed into place: a crash leaves the old pins or the new ones."""
    target = path()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".pins-")
    with os.fdopen(fd, "w") as f:
        json.dump(pins, f, indent=1, sort_keys=True)
    os.replace(tmp, target)
