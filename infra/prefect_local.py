"""A local Prefect server for one machine: SQLite under .dedloc/prefect, started in the
background, waited for until it answers, and stopped by its pid.

    python infra/prefect_local.py start|stop|status [--port 4200] [--home .dedloc/prefect]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def settings(home: str | os.PathLike, port: int) -> dict[str, str]:
    """Environment for the server and every client of it."""
    return {
        "PREFECT_HOME": str(Path(home).resolve()),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no analytics sent, by the server
        "DO_NOT_TRACK": "1",  # nor by the clients
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",  # a served deployment picks a run up in ~1 s, not ~10 s
        # the server keeps up with a round's tens of task runs instead of lagging behind them
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
        "PREFECT_LOGGING_LEVEL": os.environ.get("PREFECT_LOGGING_LEVEL", "WARNING"),
    }


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def ours(home: str | os.PathLike) -> bool:
    """Whether the server of ``home`` (its server.pid) is running: one this project started."""
    try:
        os.kill(int((Path(home) / "server.pid").read_text()), 0)
        return True
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return False
    except PermissionError:  # alive, another user's
        return True


def start(home: str = ".dedloc/prefect", port: int = 4200, ui: bool = True, timeout: float = 120) -> bool:
    """Start the server unless this project's answers already (True if this call started it). A
    server this project did not start on ``port`` (a Prefect user's own, at the default 4200) is
    refused: flows and deployments would go to it, and it may stop under them."""
    if healthy(port):
        if ours(home):
            return False
        raise RuntimeError(f"port {port} answers with a Prefect server this project did not start (none is "
                           f"running from {Path(home).resolve()}): stop that one, or use another port "
                           f"(make pretrain PREFECT_PORT={port + 100})")
    home_p = Path(home)
    home_p.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **settings(home, port))
    with open(home_p / "server.log", "ab") as log:
        proc = subprocess.Popen(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
             "--ui" if ui else "--no-ui"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (home_p / "server.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + timeout
    while not healthy(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(home)
            tail = (home_p / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"Prefect server did not come up on port {port}:\n{tail}")
        time.sleep(0.5)
    return True


def _reap(pid: int) -> None:
    """Collect the server's exit status if this process started it (start() in-process): an
    unreaped zombie still counts as a member of its process group."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop(home: str = ".dedloc/prefect") -> None:
    pidfile = Path(home) / "server.pid"
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
        for _ in range(100):
            _reap(pid)
            os.killpg(pid, 0)
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pidfile.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["start", "stop", "status"])
    ap.add_argument("--port", type=int, default=int(os.environ.get("PREFECT_PORT", 4200)))
    ap.add_argument("--home", default=os.environ.get("DEDLOC_PREFECT_HOME", ".dedloc/prefect"))
    a = ap.parse_args()
    if a.action == "start":
        started = start(a.home, a.port)
        print(f"Prefect server {'started' if started else 'already running'}: http://127.0.0.1:{a.port}")
    elif a.action == "stop":
        stop(a.home)
        print("Prefect server stopped")
    else:
        up = healthy(a.port)
        print(f"Prefect server on port {a.port}: {'up' if up else 'down'}")
        sys.exit(0 if up else 1)


if __name__ == "__main__":
    main()
