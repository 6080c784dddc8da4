# Lets `python3 -m pytest clients/python` import the package without installing it, and gives
# the adapter tests a real tierd (`tierd_factory`).
import os
import socket
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def tierd_path() -> str:
    """$KVTIER_TIERD, else target/debug/tierd (what scripts/test.sh builds), else target/release/tierd."""
    if os.environ.get("KVTIER_TIERD"):
        return os.environ["KVTIER_TIERD"]
    for kind in ("debug", "release"):
        p = os.path.join(REPO, "target", kind, "tierd")
        if os.path.exists(p):
            return p
    pytest.fail("tierd binary not found: run `cargo build -p tierd` or set KVTIER_TIERD")


@pytest.fixture
def tierd_factory(tmp_path):
    """start(*extra_args) -> socket path of a fresh tierd on a temp socket and NVMe dir."""
    procs = []

    def start(*extra, capacity="1GiB"):
        d = tmp_path / f"tierd{len(procs)}"
        d.mkdir()
        sock = str(d / "tierd.sock")
        proc = subprocess.Popen(
            [tierd_path(), "--socket", sock, "--host-capacity", capacity, "--log-level", "warn",
             "--set", "host.lock_memory=false", "--set", "host.huge_pages=false",
             "--set", f'nvme.dir="{d / "state"}"', "--set", 'nvme.capacity="256MiB"', *extra],
            stdin=subprocess.DEVNULL)
        procs.append(proc)
        deadline = time.time() + 20
        while True:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(sock)
                return sock
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail("tierd did not start")
                time.sleep(0.02)

    start.procs = procs  # the tierd processes, for tests that kill one
    yield start
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=15)
