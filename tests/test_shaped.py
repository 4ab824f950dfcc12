"""Benchmark 6's links: a volunteer's namespace moves data at its shaped rates, each direction its
own, and reaches the others through the bridge; leaving the links removes every namespace and
interface they made. Without root the benchmark says why and measures nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import shaped

WHY = shaped.missing()

# Receive until EOF and print the rate from the first byte, or connect and send N bytes.
PIPE = """
import socket, sys, time
mode, host, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "recv":
    s = socket.create_server((host, 9000))
    print("ready", flush=True)
    c, _ = s.accept()
    got, t0 = 0, None
    while chunk := c.recv(1 << 16):
        t0 = t0 or time.monotonic()
        got += len(chunk)
    print(got, got * 8 / (time.monotonic() - t0) / 1e6, flush=True)
else:
    socket.create_connection((host, 9000), timeout=10).sendall(b"x" * n)
"""


def _mbit(net: shaped.Households, sender: str, receiver: str, host: str, n: int) -> float:
    """Mbit/s of ``n`` bytes sent from namespace ``sender`` to ``host`` in ``receiver``."""
    recv = subprocess.Popen([*net.exec(receiver), sys.executable, "-c", PIPE, "recv", host, "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout.readline().strip() == "ready"
        subprocess.run([*net.exec(sender), sys.executable, "-c", PIPE, "send", host, str(n)], check=True, timeout=30)
        got, rate = recv.communicate(timeout=30)[0].split()
    finally:
        recv.kill()
        recv.wait()
    assert int(got) == n
    return float(rate)


@pytest.mark.slow
@pytest.mark.skipif(WHY is not None, reason=f"shaped links: {WHY}")
def test_each_direction_is_shaped_and_the_links_go_away():
    prefix = f"dt{os.getpid()}-"
    try:
        with shaped.Households(prefix, 2, up_mbit=2, down_mbit=4) as net:
            assert sorted(shaped.leftovers(prefix)) == sorted([net.server, *net.volunteers, f"{prefix}h"])
            up = _mbit(net, net.volunteers[0], net.server, net.server_ip, 1_000_000)
            down = _mbit(net, net.server, net.volunteers[0], net.ips[0], 2_000_000)
            # volunteer to volunteer: one's uplink then the other's downlink, so the uplink bounds it
            across = _mbit(net, net.volunteers[1], net.volunteers[0], net.ips[0], 500_000)
        assert shaped.leftovers(prefix) == []
    finally:
        shaped.remove(prefix)
    # shaped: no faster than each link's rate (how much slower depends on the machine's load,
    # which benchmark 6 reports, not this test)
    assert 0 < up < 1.5 * 2, up
    assert 0 < down < 1.5 * 4, down
    assert 0 < across < 1.5 * 2, across


def test_without_root_it_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert shaped.run() == {"skipped": "needs root: network namespaces, veth pairs and tc"}
