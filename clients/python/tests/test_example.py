"""Runs examples/decode_loop.py end to end against a minimal in-process peer on a real Unix
socket, so the example is known to work before it meets the real daemon."""

import os
import runpy
import socket
import struct
import sys
import threading

from kvtier import protocol as p

from golden import read_frame_fds

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "decode_loop.py")


def serve(listener, log):
    conn, _ = listener.accept()
    with conn:
        tokens = {}
        while True:
            try:
                frame, fds = read_frame_fds(conn)
            except EOFError:
                return
            _, rid, op, flags = p.decode_header(frame[:24])
            body = frame[24:]
            w = p._Writer()
            if op == p.Op.HELLO:
                w.u16(p.PROTOCOL_VERSION).u32(1 << 20).str("fake").str("0")
            elif op == p.Op.CREATE_SESSION:
                w.u64(1)
            elif op == p.Op.APPEND_KV:
                assert flags == p.FLAG_APPEND_SHM and len(fds) == 1
                _, start, n, _, off, length = struct.unpack("<QQIIQQ", body)
                assert os.fstat(fds[0]).st_size >= off + length
                os.close(fds[0])
                tokens[1] = start + n
                log.append(("append", start, n, length))
                w.u64(start + n)
            elif op == p.Op.DECODE:
                layer, fl, count = struct.unpack_from("<III", body)
                _, pos, q_len, kv_len = struct.unpack_from("<QQII", body, 12)
                log.append(("decode", layer, pos, q_len, kv_len))
                w.u32(1).u32(q_len // 4).raw(b"\x00" * q_len).u8(1)
                w.u32(5).u32(20).u64(0).u64(0).u32(0).u32(20).u32(0).u32(0)
            elif op == p.Op.SESSION_INFO:
                w.u64(1).u32(0).str("decode_loop")
                w.u32(2).u32(4).u32(2).u32(8).u8(0).u32(16).u32(1).u32(4).u32(32).u32(1).u32(32)
                for v in (tokens[1], tokens[1], 1, 2, 0):
                    w.u64(v)
                w.u8(0).u64(0).u64(0).u64(0)  # state, created, last access, remote bytes
            elif op == p.Op.CLOSE_SESSION:
                pass
            elif op == p.Op.STATS:
                w.u32(1).str("sessions").u64(0)
            else:
                raise AssertionError(f"unexpected opcode {op}")
            conn.sendall(p.frame(op | p.REPLY_BIT, 0, rid, bytes(w.buf)))


def test_decode_loop_example(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "tierd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    log = []
    t = threading.Thread(target=serve, args=(listener, log), daemon=True)
    t.start()
    monkeypatch.setattr(sys, "argv", [EXAMPLE, "--socket", path, "--layers", "2", "--q-heads", "4",
                                      "--kv-heads", "2", "--head-dim", "8", "--block-tokens", "16",
                                      "--prompt-tokens", "100", "--chunk-tokens", "64", "--steps", "3"])
    runpy.run_path(EXAMPLE, run_name="__main__")
    t.join(5)
    listener.close()
    out = capsys.readouterr().out
    assert "appended 100 tokens" in out and "step   2" in out and "sessions=0" in out
    per_token = 2 * 2 * 2 * 8 * 2  # layers * (K,V) * Hkv * D * bf16
    assert log[:2] == [("append", 0, 64, 64 * per_token), ("append", 64, 36, 36 * per_token)]
    decodes = [e for e in log if e[0] == "decode"]
    assert [(e[1], e[2]) for e in decodes] == [(0, 100), (1, 100), (0, 101), (1, 101), (0, 102), (1, 102)]
    assert all(e[3] == 4 * 8 * 4 and e[4] == 2 * 8 * 2 for e in decodes)
