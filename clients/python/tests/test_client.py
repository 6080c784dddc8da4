"""The Client on a real socket pair against a scripted peer that replays the golden
conversation: every request must arrive byte-identical to the Rust encoder's, and the memfd
passed with SCM_RIGHTS must hold the payload."""

import mmap
import os
import socket
import threading

import numpy as np
import pytest

from kvtier import Client, ErrorCode, ProtocolError, ServerError
from kvtier import protocol as p

from golden import GEOMETRY, PAYLOAD, POLICY, decode_entries, load, session_info, split
from golden import read_frame_fds as read_frame


class Peer(threading.Thread):
    """Runs `script(sock)` on the server end; failures are re-raised by `join_checked`."""

    def __init__(self, script):
        super().__init__(daemon=True)
        self.client_sock, self.server_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.script = script
        self.error = None

    def run(self):
        try:
            self.script(self.server_sock)
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            self.error = e

    def join_checked(self):
        self.join(5)
        assert not self.is_alive(), "peer script did not finish"
        if self.error:
            raise self.error


def expect(sock, golden_name):
    frame, fds = read_frame(sock)
    assert frame == load(golden_name), golden_name
    return fds


def test_golden_conversation():
    shm_seen = {}

    def script(s):
        expect(s, "hello_request")
        s.sendall(load("hello_reply"))
        expect(s, "create_session_request")
        s.sendall(load("create_session_reply"))
        assert expect(s, "append_kv_inline_request") == []
        s.sendall(load("append_kv_reply"))
        fds = expect(s, "append_kv_shm_request")
        assert len(fds) == 1
        with mmap.mmap(fds[0], 64, prot=mmap.PROT_READ) as m:
            shm_seen["payload"] = bytes(m[:64])
        shm_seen["size"] = os.fstat(fds[0]).st_size
        os.close(fds[0])
        s.sendall(p.frame(p.Op.APPEND_KV.reply, 0, 4, p.encode_reply_body(p.Op.APPEND_KV, 2)))
        expect(s, "decode_request")
        s.sendall(load("decode_reply"))
        expect(s, "session_info_request")
        s.sendall(load("session_info_reply"))
        expect(s, "list_sessions_request")
        s.sendall(load("list_sessions_reply"))
        expect(s, "stats_request")
        s.sendall(load("stats_reply"))
        frame, _ = read_frame(s)
        rid, opcode, _, body = split(frame)
        assert (rid, opcode, body) == (9, p.Op.SESSION_INFO, p.encode_session(42))
        s.sendall(load("error_reply"))
        expect(s, "close_session_request")
        s.sendall(load("close_session_reply"))
        expect(s, "evict_request")
        s.sendall(p.frame(p.Op.EVICT.reply, 0, 11))

    peer = Peer(script)
    peer.start()
    c = Client(sock=peer.client_sock, client_name="kvtier-golden", timeout=5)
    assert c.server == p.HelloReply(p.PROTOCOL_VERSION, 16 << 20, "tierd", "0.1.0")
    assert c.create_session(GEOMETRY, POLICY, label="golden") == 7
    assert c.append_kv(7, 0, 1, PAYLOAD) == 1
    assert c.append_kv_shm(7, 1, 1, PAYLOAD) == 2
    outs = c.decode_batch(1, decode_entries(), want_stats=True)
    assert outs[0].out.shape == (4, 4)  # reshaped like the query
    np.testing.assert_array_equal(outs[1].out.ravel(), -np.arange(16, dtype=np.float32))
    assert outs[0].stats.selected == [[0, 1, 2], [0, 1, 2]]
    assert c.session_info(7) == session_info(7, "golden", False)
    assert [i.session for i in c.list_sessions()] == [7, 9]
    assert c.stats() == {"uptime_ms": 1234, "sessions": 2}
    with pytest.raises(ServerError) as e:
        c.session_info(42)
    assert e.value.code == ErrorCode.NOT_FOUND and e.value.message == "session 42 not found"
    c.close(7)
    c.evict(9)
    peer.join_checked()
    assert shm_seen == {"payload": PAYLOAD.tobytes(), "size": 64}
    c.disconnect()


def hello_only(s):
    read_frame(s)
    s.sendall(p.frame(p.Op.HELLO.reply, 0, 1, bytes(p._Writer().u16(p.PROTOCOL_VERSION).u32(256).str("t").str("0").buf)))


def test_oversized_request_refused_locally():
    sent_after = []

    def script(s):
        hello_only(s)
        frame, _ = read_frame(s)
        sent_after.append(frame)
        s.sendall(p.frame(p.Op.STATS.reply, 0, split(frame)[0], b"\x00\x00\x00\x00"))

    peer = Peer(script)
    peer.start()
    c = Client(sock=peer.client_sock, timeout=5)
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        c.append_kv(1, 0, 1, b"\x00" * 300)
    assert c.stats() == {}
    peer.join_checked()
    # Only the STATS request reached the peer (id 3: the refused request used id 2).
    assert split(sent_after[0])[:2] == (3, p.Op.STATS)


def test_mismatched_reply_id_and_wrong_opcode():
    def script(s):
        hello_only(s)
        read_frame(s)
        s.sendall(p.frame(p.Op.STATS.reply, 0, 99, b"\x00\x00\x00\x00"))
        read_frame(s)
        s.sendall(p.frame(p.Op.LIST_SESSIONS.reply, 0, 3, b"\x00\x00\x00\x00"))

    peer = Peer(script)
    peer.start()
    c = Client(sock=peer.client_sock, timeout=5)
    with pytest.raises(ProtocolError, match="reply id 99"):
        c.stats()
    with pytest.raises(ProtocolError, match="does not answer STATS"):
        c.stats()
    peer.join_checked()


def test_server_closing_is_an_error():
    def script(s):
        hello_only(s)
        read_frame(s)
        s.close()

    peer = Peer(script)
    peer.start()
    c = Client(sock=peer.client_sock, timeout=5)
    with pytest.raises(ConnectionError):
        c.stats()
    peer.join_checked()


def test_sealed_memfd_is_immutable():
    from kvtier import sealed_memfd

    fd = sealed_memfd(b"abc")
    try:
        with pytest.raises(OSError):
            os.write(fd, b"x")
        with pytest.raises(OSError):
            os.ftruncate(fd, 1)
        assert os.pread(fd, 3, 0) == b"abc"
    finally:
        os.close(fd)


def test_client_defaults_to_the_daemons_socket_rule(tmp_path, monkeypatch):
    """`Client()` with no path connects where tierd listens by default: $KVTIER_SOCKET, else
    $XDG_RUNTIME_DIR/kvtier/tierd.sock (the daemon's own rule)."""
    from kvtier import default_socket_path

    monkeypatch.delenv("KVTIER_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == str(tmp_path / "kvtier" / "tierd.sock")
    path = str(tmp_path / "t.sock")
    monkeypatch.setenv("KVTIER_SOCKET", path)
    assert default_socket_path() == path
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve():
        conn, _ = listener.accept()
        expect(conn, "hello_request")
        conn.sendall(load("hello_reply"))
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = Client(client_name="kvtier-golden")
    assert c.path == path
    c.disconnect()
    t.join(5)
    listener.close()


def test_a_missing_socket_names_the_path_and_what_to_do(tmp_path):
    from kvtier import TierdUnavailable

    path = str(tmp_path / "nope.sock")
    with pytest.raises(TierdUnavailable) as e:
        Client(path)
    msg = str(e.value)
    assert path in msg and "tierd --socket" in msg and "KVTIER_SOCKET" in msg, msg
    # Still a ConnectionError (an OSError) for code that catches those.
    assert isinstance(e.value, ConnectionError)


def test_one_version_for_the_project():
    """kvtier.__version__, the package metadata and the Cargo workspace agree."""
    import re
    from pathlib import Path

    import kvtier

    root = Path(__file__).resolve().parents[3]
    cargo = (root / "Cargo.toml").read_text()
    pyproject = (root / "clients" / "python" / "pyproject.toml").read_text()
    workspace = re.search(r'^version = "([^"]+)"', cargo, re.M).group(1)
    package = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    assert kvtier.__version__ == workspace == package


def test_kvtier_hf_without_torch_names_the_extra():
    """`import kvtier.hf` without torch says which extra to install, not a bare
    "No module named 'torch'"."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n"
        "    import kvtier.hf\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "pip install 'kvtier[hf]'" in out.stdout, out.stdout + out.stderr


def test_decode_stats_say_their_units():
    s = p.DecodeStats(8, 14, 0, 0, 0, 14, 0, [[0, 1, 5, 6, 7, 8, 9], [0, 2, 5, 6, 7, 8, 9]])
    assert "blocks_total=8 per kv head" in repr(s) and "14 tiles over kv heads" in repr(s)
