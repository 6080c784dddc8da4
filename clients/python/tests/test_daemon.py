"""The Python client against a real tierd process on a real socket.

Needs the tierd binary: `cargo build -p tierd` (the README's test command builds it), or set
KVTIER_TIERD to its path.
"""

import os
import socket
import subprocess
import time

import numpy as np
import pytest

from kvtier import Client, DecodeEntry, Dtype, ErrorCode, Geometry, Policy, ServerError, bf16_to_f32, f32_to_bf16

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def tierd_binary() -> str:
    path = os.environ.get("KVTIER_TIERD") or os.path.join(REPO, "target", "debug", "tierd")
    if not os.path.exists(path):
        pytest.fail(f"tierd binary not found at {path}: run `cargo build -p tierd` or set KVTIER_TIERD")
    return path


@pytest.fixture
def daemon(tmp_path):
    sock = str(tmp_path / "tierd.sock")
    proc = subprocess.Popen(
        [tierd_binary(), "--socket", sock, "--host-capacity", "64MiB",
         "--set", 'host.max_run_bytes="4KiB"', "--log-level", "warn",
         "--set", f'nvme.dir="{tmp_path / "state"}"', "--set", 'nvme.capacity="64MiB"'],
        stdin=subprocess.DEVNULL,
    )
    deadline = time.time() + 20
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail("tierd did not start")
            time.sleep(0.02)
    yield sock, proc
    proc.terminate()
    assert proc.wait(timeout=15) == 0, "tierd exits cleanly on SIGTERM"
    assert not os.path.exists(sock), "socket removed at shutdown"


# Two layers, GQA 4/2, D=32, B=16: one (layer, block) run is exactly 4 KiB.
G = Geometry(2, 4, 2, 32, Dtype.BF16, 16)
POLICY = Policy(sink_blocks=1, local_blocks=1, top_k=2)


def dense_on_keep_set(q, k, v, selected, block_tokens):
    """Softmax attention in float64 over the tokens of the selected blocks, per kv head.
    q [Hq, D]; k, v [T, Hkv, D] float32."""
    hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = np.zeros((hq, d))
    for h in range(hq):
        kv_h = h // g
        toks = np.concatenate([np.arange(b * block_tokens, min((b + 1) * block_tokens, k.shape[0]))
                               for b in selected[kv_h]])
        s = k[toks, kv_h, :].astype(np.float64) @ q[h].astype(np.float64) / np.sqrt(d)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ v[toks, kv_h, :].astype(np.float64)
    return out


def test_session_lifecycle_inline_and_shm_append_and_decode(daemon):
    sock, _ = daemon
    rng = np.random.default_rng(7)
    with Client(sock, client_name="pytest") as c:
        sid = c.create_session(G, POLICY, label="py")
        # Per layer stored K, V as float32 [T, Hkv, D] (after bf16 rounding).
        ks = [np.zeros((0, 2, 32), np.float32) for _ in range(2)]
        vs = [np.zeros((0, 2, 32), np.float32) for _ in range(2)]

        def append(n, start, shm):
            kv = f32_to_bf16(rng.standard_normal((G.layers, 2, n, G.kv_heads, G.head_dim), dtype=np.float32))
            for layer in range(2):
                ks[layer] = np.concatenate([ks[layer], bf16_to_f32(kv[layer, 0])])
                vs[layer] = np.concatenate([vs[layer], bf16_to_f32(kv[layer, 1])])
            return (c.append_kv_shm if shm else c.append_kv)(sid, start, n, kv)

        assert append(90, 0, shm=False) == 90
        assert append(61, 90, shm=True) == 151
        for step in range(12):
            for layer in range(2):
                pos = ks[layer].shape[0]
                q = rng.standard_normal((4, 32), dtype=np.float32)
                k = f32_to_bf16(rng.standard_normal((2, 32), dtype=np.float32))
                v = f32_to_bf16(rng.standard_normal((2, 32), dtype=np.float32))
                ks[layer] = np.concatenate([ks[layer], bf16_to_f32(k)[None]])
                vs[layer] = np.concatenate([vs[layer], bf16_to_f32(v)[None]])
                out = c.decode(layer, sid, pos, q, k, v, want_stats=True)
                st = out.stats
                assert st.blocks_total == (pos + 1 + 15) // 16
                assert [len(s) for s in st.selected] == [4, 4]
                want = dense_on_keep_set(q, ks[layer], vs[layer], st.selected, 16)
                rel = np.abs(out.out - want).max() / np.abs(want).max()
                assert rel < 2e-3, f"step {step} layer {layer}: rel err {rel}"
        info = c.session_info(sid)
        assert (info.tokens_min, info.tokens_max) == (163, 163)
        assert info.label == "py"
        assert [s.session for s in c.list_sessions()] == [sid]
        stats = c.stats()
        assert stats["decode_entries_total"] == 24
        c.close(sid)
        with pytest.raises(ServerError) as e:
            c.session_info(sid)
        assert e.value.code == ErrorCode.NOT_FOUND


def test_batch_decode_and_typed_errors(daemon):
    sock, _ = daemon
    rng = np.random.default_rng(1)
    with Client(sock) as c:
        a = c.create_session(G, POLICY)
        b = c.create_session(G, POLICY)
        for s in (a, b):
            kv = f32_to_bf16(rng.standard_normal((2, 2, 40, 2, 32), dtype=np.float32))
            c.append_kv(s, 0, 40, kv)
        q = rng.standard_normal((4, 32), dtype=np.float32)
        k = f32_to_bf16(rng.standard_normal((2, 32), dtype=np.float32))
        outs = c.decode_batch(0, [DecodeEntry(a, 40, q, k, k), DecodeEntry(b, 40, q, k, k)])
        assert len(outs) == 2 and outs[0].out.shape == (4, 32)
        cases = [
            (lambda: c.decode(0, a, 40, q, k, k), ErrorCode.FAILED_PRECONDITION),  # position reused
            (lambda: c.decode(5, a, 41, q, k, k), ErrorCode.INVALID_ARGUMENT),  # layer out of range
            (lambda: c.decode(0, 999, 0, q, k, k), ErrorCode.NOT_FOUND),
            (lambda: c.decode(0, a, 41, q[:, :16], k, k), ErrorCode.INVALID_ARGUMENT),  # q size
            (lambda: c.create_session(Geometry(2, 3, 2, 32, Dtype.BF16, 16)), ErrorCode.INVALID_ARGUMENT),
            (lambda: c.append_kv(a, 0, 1, np.zeros((2, 2, 1, 2, 32), np.uint16)), ErrorCode.FAILED_PRECONDITION),
        ]
        for call, code in cases:
            with pytest.raises(ServerError) as e:
                call()
            assert e.value.code == code, e.value
        # Nothing above changed the session.
        assert c.session_info(a).tokens_max == 41


def test_decode_loop_example_runs_against_the_daemon(daemon):
    sock, _ = daemon
    import sys
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "clients", "python", "examples", "decode_loop.py"),
         "--socket", sock, "--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "32",
         "--block-tokens", "16", "--prompt-tokens", "300", "--chunk-tokens", "100", "--steps", "3"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "appended 300 tokens" in out.stdout, out.stdout


def test_demote_promote_and_pin(daemon):
    sock, _ = daemon
    rng = np.random.default_rng(3)
    with Client(sock) as c:
        sid = c.create_session(G, POLICY)
        kv = f32_to_bf16(rng.standard_normal((2, 2, 100, 2, 32), dtype=np.float32))
        c.append_kv(sid, 0, 100, kv)
        q = rng.standard_normal((4, 32), dtype=np.float32)
        k = f32_to_bf16(rng.standard_normal((2, 32), dtype=np.float32))
        c.pin(sid)
        with pytest.raises(ServerError) as e:
            c.demote(sid)
        assert e.value.code == ErrorCode.FAILED_PRECONDITION
        c.pin(sid, False)
        assert c.demote(sid) == 2 * 7  # 100 tokens = 7 blocks of 16 per layer
        assert c.session_info(sid).host_bytes == 0
        out = c.decode(0, sid, 100, q, k, k, want_stats=True)
        assert out.stats.blocks_nvme > 0 and out.stats.bytes_moved > 0
        assert c.promote(sid) > 0
        assert c.stats()["demotions_total"] == 1


def test_rows_written_in_place_after_reserve_equal_an_append(tierd_factory):
    """RESERVE / COMMIT: rows written into the leased arena where RESERVE says (what a GPU
    DMA does) give the same runs as APPEND_KV of them; wrong requests are typed errors."""
    sock = tierd_factory("--set", 'host.max_run_bytes="4KiB"', "--set", "host.shared=true",
                         capacity="64MiB")
    c = Client(sock)
    rng = np.random.default_rng(9)
    first, n = 20, 30
    rows = [[f32_to_bf16(rng.standard_normal((first + n, G.kv_heads, G.head_dim), dtype=np.float32))
             for _ in range(2)] for _ in range(G.layers)]

    def payload(lo, hi):
        return b"".join(kv[lo:hi].tobytes() for layer in rows for kv in layer)

    twin = c.create_session(G, POLICY, "append")
    c.append_kv(twin, 0, first + n, payload(0, first + n))
    s = c.create_session(G, POLICY, "in place")
    c.append_kv(s, 0, first, payload(0, first))
    with pytest.raises(ServerError) as e:
        c.reserve(s, n)  # no lease on this connection
    assert e.value.code == ErrorCode.FAILED_PRECONDITION
    lease = c.lease(s, writable=True)
    bt = G.block_tokens

    def write_in_place(r):
        """Each reserved row where RESERVE says, as an engine's DMA writes it."""
        for l in range(G.layers):
            for i in range(r.tokens):
                pos = r.start + i
                run = lease.run_at(int(r.layers[l][pos // bt - r.start // bt]))
                tiles = run.view("<u2").reshape(G.kv_heads, 2, bt, G.head_dim)
                for kv in range(2):
                    tiles[:, kv, pos % bt] = rows[l][kv][pos]
                del run, tiles

    r = c.reserve(s, n)
    assert (r.start, r.tokens, len(r.layers)) == (first, n, G.layers)
    write_in_place(r)
    with pytest.raises(ServerError) as e:
        c.append_kv(s, first, 1, payload(first, first + 1))
    assert e.value.code == ErrorCode.FAILED_PRECONDITION and "RESERVE" in str(e.value)
    with pytest.raises(ServerError) as e:
        c.commit(s, n + 1)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT
    assert c.session_info(s).tokens_max == first  # the over-commit dropped the append
    write_in_place(c.reserve(s, n))
    assert c.commit(s, n) == first + n
    c.release(s)
    lease.close()
    a, b = c.lease(s), c.lease(twin)
    for l in range(G.layers):
        for blk in range(-(-(first + n) // bt)):
            assert np.array_equal(a.run(l, blk), b.run(l, blk)), (l, blk)
    c.disconnect()
    a.close()
    b.close()


def test_lease_reads_block_runs_in_place(tierd_factory):
    """LEASE with tierd's shared arena: the runs read in place are the appended rows laid out
    per KV head (K tile, then V tile); DEMOTE waits for RELEASE."""
    sock = tierd_factory("--set", 'host.max_run_bytes="4KiB"', "--set", "host.shared=true",
                         capacity="64MiB")
    c = Client(sock)
    n = 40  # 3 blocks of 16, the last partial
    rng = np.random.default_rng(5)
    rows = [[f32_to_bf16(rng.standard_normal((n, G.kv_heads, G.head_dim), dtype=np.float32))
             for _ in range(2)] for _ in range(G.layers)]
    s = c.create_session(G, POLICY, "leased")
    payload = b"".join(kv.tobytes() for layer in rows for kv in layer)
    c.append_kv(s, 0, n, payload)
    lease = c.lease(s)
    bt, d = G.block_tokens, G.head_dim
    assert lease.table.run_bytes == 4096 and len(lease.table.layers) == G.layers
    for l in range(G.layers):
        assert lease.table.layers[l].tokens == n
        for b in range(3):
            run = lease.run(l, b).view("<u2").reshape(G.kv_heads, 2, bt, d)
            want = np.zeros((G.kv_heads, 2, bt, d), dtype=np.uint16)
            for i in range(2):  # K, then V
                toks = rows[l][i][b * bt:(b + 1) * bt]
                want[:, i, :len(toks)] = toks.transpose(1, 0, 2)
            assert np.array_equal(run, want), (l, b)
            del run
    with pytest.raises(ServerError) as e:
        c.demote(s)
    assert e.value.code == ErrorCode.FAILED_PRECONDITION and "leased" in str(e.value)
    c.release(s)
    assert c.demote(s) > 0
    lease.close()
    with pytest.raises(ServerError) as e:
        c.release(s)
    assert e.value.code == ErrorCode.FAILED_PRECONDITION
    c.disconnect()
