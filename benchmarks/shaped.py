"""Benchmark 6: shaped household links. Volunteers on asymmetric home links, ours against hivemind.

Every volunteer runs in its own Linux network namespace, joined to the organizer's namespace by
a veth pair whose ends are shaped with ``tc`` token-bucket filters: the volunteer's end shapes
its uplink, the organizer's end its downlink. The organizer's ends sit on one bridge, so
volunteers reach the organizer and each other (hivemind's peers talk directly) only through
their own two shaped directions. The organizer's namespace holds moto's S3 server and
``dedloc aggregate`` (unshaped: that is the data centre); the harness reaches it through one more,
unshaped, veth from the root namespace, so its polling costs the volunteers nothing.

Ours is benchmarks.collab's collaboration over ``s3://`` with ``ip netns exec`` in front of each
process; hivemind is benchmarks.hivemind_peers with its peers in the same namespaces. Both are
measured as in benchmark 1, next to benchmarks.collab.limit (same preset, no network).

``python -m benchmarks.shaped [PROFILE ...]`` runs ``run()`` and prints the result as JSON. It
needs root and iproute2 (``ip``, ``tc``); without them ``run()`` returns ``{"skipped": why}``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Group

from . import collab, hivemind_peers, latency, tables

PROFILES = {"10/50": (10, 50), "2/20": (2, 20)}  # Mbit/s up / down
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
S3_PORT = 5000  # the organizer's namespace is fresh: nothing else listens there
BUCKET = "bench"
# hivemind's defaults give a sender 1 s (its matchmaking time) per 512 kB part of an all-reduce, then
# average without it, silently: a part takes 2.1 s at 2 Mbit/s, 0.4 s at 10. With these a part may
# take 10 s and an averaging 120 s, so the link's rate alone never drops a sender.
HIVEMIND_TIMEOUTS = {"averaging_timeout": 120.0, "next_chunk_timeout": 10.0}


def tbf(mbit: float) -> list[str]:
    """``tc`` arguments of a token-bucket filter at ``mbit`` Mbit/s, as a household modem shapes.

    burst: the bucket's depth, what may leave at line rate at once. It must hold a full packet and
    one kernel timer tick of tokens (rate / HZ: 62 kB at 50 Mbit/s with HZ=100), else the rate
    falls short of the setting; much more and a transfer's first hundreds of kB go unshaped. 10 ms
    of tokens, at least 16 kB (about ten packets), does both. latency: the drop-tail queue in
    time, 100 ms, a modest modem buffer: TCP keeps the link full (1.94 Mbit/s measured through a
    2 Mbit/s filter) and a poll queued behind a shard upload waits at most 0.1 s more.
    """
    burst = max(16_000, int(mbit * 1e6 / 8 * 0.010))
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms"]


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _tc(ns: str, *args: str) -> None:
    done = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {done.stderr.strip()}")


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def leftovers(prefix: str) -> list[str]:
    """Namespaces and root-namespace links whose names start with ``prefix``."""
    links = [line.split(": ")[1].split("@")[0] for line in _ip("-o", "link").splitlines()]
    return [n for n in _namespaces() + links if n.startswith(prefix)]


def remove(prefix: str) -> None:
    """Delete what ``prefix`` names: the namespaces first (each takes its links with it, and a veth
    pair goes when either end does), then root links left by a run that died half-built."""
    for ns in _namespaces():
        if ns.startswith(prefix):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for link in leftovers(prefix):
        subprocess.run(["ip", "link", "del", link], capture_output=True)


def missing() -> str | None:
    """Why this machine cannot build shaped links (None: it can): tried, not guessed."""
    if os.geteuid() != 0:
        return "needs root: network namespaces, veth pairs and tc"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command (iproute2)"
    probe = f"dl{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        _tc(probe, "qdisc", "add", "dev", "lo", "root", *tbf(10))
    except RuntimeError as exc:
        return f"cannot shape links here: {exc}"
    finally:
        remove(probe)
    return None


def _subnet() -> str:
    """A /24 that this machine's root namespace does not route (the harness's link adds one)."""
    used = _ip("-4", "route", "show", "table", "all") + _ip("-o", "-4", "addr")
    for k in range(250):
        net = f"10.201.{(os.getpid() + k) % 250 + 1}"
        if f"{net}." not in used:
            return net
    raise RuntimeError("no free 10.201.N.0/24 subnet")


class Households:
    """The organizer's namespace with a bridge, one namespace per volunteer on a shaped veth, and
    an unshaped veth from the root namespace for the harness.

    Names start with ``prefix`` (keep it short, ending in a non-digit: interface names have at
    most 15 characters, and ``dl12`` must not match ``dl123``'s). Use it as a context manager:
    leaving it, for any reason, removes everything it made.
    """

    def __init__(self, prefix: str, volunteers: int, up_mbit: float, down_mbit: float):
        self.prefix, self.up_mbit, self.down_mbit = prefix, up_mbit, down_mbit
        self.server = f"{prefix}s"
        self.volunteers = [f"{prefix}v{i}" for i in range(volunteers)]
        net = _subnet()
        self.server_ip = f"{net}.1"
        self.ips = [f"{net}.{10 + i}" for i in range(volunteers)]
        self.harness_ip = f"{net}.254"

    def __enter__(self) -> "Households":
        remove(self.prefix)  # a dead run with this pid
        try:
            self._build()
        except BaseException:
            remove(self.prefix)
            raise
        return self

    def __exit__(self, *exc) -> None:
        remove(self.prefix)

    def _build(self) -> None:
        p, s = self.prefix, self.server
        _ip("netns", "add", s)
        _ip("-n", s, "link", "set", "lo", "up")
        _ip("-n", s, "link", "add", f"{p}br", "type", "bridge")
        _ip("-n", s, "addr", "add", f"{self.server_ip}/24", "dev", f"{p}br")
        _ip("-n", s, "link", "set", f"{p}br", "up")
        for i, (ns, addr) in enumerate(zip(self.volunteers, self.ips)):
            home, far = f"{p}v{i}", f"{p}v{i}s"
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", home, "type", "veth", "peer", "name", far)
            _ip("link", "set", far, "netns", s)
            _ip("link", "set", home, "netns", ns)
            _ip("-n", s, "link", "set", far, "master", f"{p}br", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", home)
            _ip("-n", ns, "link", "set", home, "up")
            _tc(ns, "qdisc", "add", "dev", home, "root", *tbf(self.up_mbit))   # uplink: what the volunteer sends
            _tc(s, "qdisc", "add", "dev", far, "root", *tbf(self.down_mbit))   # downlink: what it receives
        root_end, far = f"{p}h", f"{p}hs"
        _ip("link", "add", root_end, "type", "veth", "peer", "name", far)
        _ip("link", "set", far, "netns", s)
        _ip("-n", s, "link", "set", far, "master", f"{p}br", "up")
        _ip("addr", "add", f"{self.harness_ip}/24", "dev", root_end)
        _ip("link", "set", root_end, "up")

    @staticmethod
    def exec(ns: str) -> list[str]:
        """The command prefix that runs a command in namespace ``ns``."""
        return ["ip", "netns", "exec", ns]


class S3Server:
    """moto's standalone S3 server in the organizer's namespace, with one empty bucket."""

    def __init__(self, net: Households, log: Path):
        self.url = f"http://{net.server_ip}:{S3_PORT}"
        self._log = open(log, "wb")
        self.proc = subprocess.Popen([*net.exec(net.server), sys.executable, "-m", "moto.server", "-H", "0.0.0.0",
                                      "-p", str(S3_PORT)], env={**os.environ, **CREDENTIALS}, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def make_bucket(self, timeout: float = 30.0) -> None:
        from dedloc_pipeline.storage.bucket import Bucket

        deadline = time.monotonic() + timeout
        while True:
            try:
                Bucket(f"s3://{BUCKET}", endpoint_url=self.url).fs.mkdir(BUCKET)
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start (exit {self.proc.poll()})")
                time.sleep(0.3)

    def cpu_s(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class _Credentials:
    """The dummy S3 credentials in this process's environment for a while (the harness's reads)."""

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in CREDENTIALS}
        os.environ.update(CREDENTIALS)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(profiles=("10/50", "2/20"), peers: int = 2, preset: str = "small", micro_batch: int = 8, target: int = 64,
        warmup: int = 1, rounds: int = 3, timeout_s: float = 300) -> dict:
    """Each profile: ours then hivemind on the same shaped links; the limit once (no network)."""
    why = missing()
    if why:
        return {"skipped": why}
    began = time.monotonic()
    limit = collab.limit(micro_batch, target, seconds=15.0, warmup_s=5.0, preset=preset)
    out = {"settings": {"peers": peers, "preset": preset, "seq_len": 128, "micro_batch": micro_batch,
                        "target": target, "codec": "int8", "warmup": warmup, "rounds": rounds,
                        "tbf": {name: {"up": tbf(u), "down": tbf(d)} for name, (u, d) in PROFILES.items()},
                        "hivemind": HIVEMIND_TIMEOUTS},
           "limit": limit, "profiles": {}}
    lim = limit["samples_per_s"]
    prefix = f"dl{os.getpid()}-"
    for name in profiles:
        up, down = PROFILES[name]
        with Households(prefix, peers, up, down) as net, _Credentials():
            ours = _measured(_ours, net, peers, preset, micro_batch, target, warmup, rounds, timeout_s)
            theirs = _measured(hivemind_peers.run, peers, micro_batch, target, warmup, rounds, timeout_s, preset,
                               hosts=net.ips, prefixes=[net.exec(v) for v in net.volunteers], **HIVEMIND_TIMEOUTS)
        rate, hm = ours.get("samples_per_s"), theirs.get("samples_per_s")
        res = out["profiles"][name] = {
            "up_mbit": up, "down_mbit": down, "ours": ours, "hivemind": theirs,
            "ours_over_limit": rate / lim if rate else None,
            "hivemind_over_limit": hm / lim if hm else None,
            "ours_over_hivemind": rate / hm if rate and hm else None}
        if rate:  # one shard's upload on this uplink against one round's compute at the machine's limit
            res["shard_upload_s"] = ours["shard_bytes"] * 8 / (up * 1e6)
            res["shard_upload_over_compute"] = res["shard_upload_s"] / (target / lim)
    out["wall_s"] = round(time.monotonic() - began, 1)
    return out


def _measured(system, *args, **kwargs) -> dict:
    """One system's result, or why it has none: a collaboration that fails or runs out of time on
    a slow link is a result too, and must not cost the other measurements. The machine's load at
    the end goes with it: other work on these 2 cores slows compute and the S3 server alike."""
    try:
        res = system(*args, **kwargs)
    except ImportError as exc:  # hivemind not installed
        res = {"skipped": str(exc)}
    except RuntimeError as exc:  # the message's first lines name the cause and the kept logs
        res = {"failed": "\n".join(str(exc).splitlines()[:2])}
    res["load_1min"] = os.getloadavg()[0]
    return res


def _ours(net: Households, peers, preset, micro_batch, target, warmup, rounds, timeout_s) -> dict:
    """benchmarks.collab's collaboration, each process in its namespace, over moto's S3."""
    from dedloc_pipeline.storage.bucket import Bucket

    work = Path(tempfile.mkdtemp(prefix="dedloc-shaped-"))
    server = S3Server(net, work / "moto.log")
    url = f"s3://{BUCKET}/shaped"
    try:
        server.make_bucket()
        prefixes = {"scheduler": net.exec(net.server),
                    **{f"peer-{i}": net.exec(ns) for i, ns in enumerate(net.volunteers)}}
        cpu0, t0 = server.cpu_s(), time.monotonic()
        res = collab.collaborate(peers=peers, micro_batch=micro_batch, target=target, preset=preset,
                                 warmup=warmup, rounds=rounds, timeout_s=timeout_s, url=url,
                                 endpoint_url=server.url, env=CREDENTIALS, prefixes=prefixes)
        wall = time.monotonic() - t0
        # the S3 server shares this machine's cores with the volunteers (a real one would not);
        # over the whole collaboration, start-up included, not only the measured window
        res["s3_server_cpu_share"] = (server.cpu_s() - cpu0) / wall / os.cpu_count()
        res["wall_s"] = round(wall, 1)
        res["shard_bytes"] = _mean_shard_bytes(Bucket(url, endpoint_url=server.url))
        return res
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _mean_shard_bytes(bucket) -> float:
    """Mean stored size of the shards still in the bucket (the newest rounds keep theirs)."""
    from dedloc_pipeline.storage.layout import RunLayout

    keys, shards = RunLayout("bench"), {}
    for key, size in bucket.sizes(keys.volunteers_dir).items():
        if (shard := keys.shard_holding(key)) is not None:
            shards[shard] = shards.get(shard, 0) + size
    return sum(shards.values()) / len(shards)


def table(res: dict):
    """Benchmark 6 as a rich table: a row per profile and system, the limit last."""
    title = "6. shaped household links (up/down Mbit/s)"
    columns = ["profile", "system", "samples/s", "s/round", "compute fraction", "up B/param", "down B/param",
               "of limit", "ours / hivemind"]
    if "skipped" in res:
        return tables.table(title, ["skipped"], [[res["skipped"]]])
    lim = res["limit"]["samples_per_s"]
    rows = []
    for name, p in res["profiles"].items():
        for system, r, ratio in (("dedloc-pipeline", p["ours"], p["ours_over_hivemind"]),
                                 ("hivemind 1.1.12", p["hivemind"], None)):
            if "samples_per_s" not in r:
                rows.append([name, system, "failed" if "failed" in r else "skipped", *["-"] * 6])
                continue
            rows.append([name, system, *(r[k] for k in ("samples_per_s", "s_per_round", "compute_fraction",
                                                        "up_bytes_per_param", "down_bytes_per_param")),
                         r["samples_per_s"] / lim, "-" if ratio is None else ratio])
    rows.append(["-", "limit: no collaboration, a process per core", lim, "-", "-", "-", "-", 1.0, "-"])
    budgets = {name: p["ours"]["latency"] for name, p in res["profiles"].items() if "latency" in p["ours"]}
    return Group(tables.table(title, columns, rows),
                 latency.table("6. the round's latency budget on shaped links, seconds", budgets))


if __name__ == "__main__":
    print(json.dumps(run(tuple(sys.argv[1:]) or ("10/50", "2/20")), indent=1))
