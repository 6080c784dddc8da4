"""The Python encoder and decoder against the golden frames written by the Rust crate."""

import dataclasses

import numpy as np
import pytest

from kvtier import protocol as p

from golden import GEOMETRY, PAYLOAD, POLICY, decode_entries, load, session_info, split

REQUESTS = {
    "hello_request": lambda: p.frame(p.Op.HELLO, 0, 1, p.encode_hello("kvtier-golden", 2, 5)),
    "create_session_request": lambda: p.frame(
        p.Op.CREATE_SESSION, 0, 2, p.encode_create_session(GEOMETRY, POLICY, "golden")),
    "append_kv_inline_request": lambda: p.frame(
        p.Op.APPEND_KV, 0, 3, p.encode_append_inline(7, 0, 1, PAYLOAD.tobytes())),
    "append_kv_shm_request": lambda: p.frame(
        p.Op.APPEND_KV, p.FLAG_APPEND_SHM, 4, p.encode_append_shm(7, 1, 1, 0, 64)),
    "decode_request": lambda: p.frame(p.Op.DECODE, 0, 5, p.encode_decode(1, decode_entries(), True)),
    "session_info_request": lambda: p.frame(p.Op.SESSION_INFO, 0, 6, p.encode_session(7)),
    "list_sessions_request": lambda: p.frame(p.Op.LIST_SESSIONS, 0, 7),
    "stats_request": lambda: p.frame(p.Op.STATS, 0, 8),
    "close_session_request": lambda: p.frame(p.Op.CLOSE_SESSION, 0, 10, p.encode_session(7)),
    "evict_request": lambda: p.frame(p.Op.EVICT, 0, 11, p.encode_session(9)),
    "demote_request": lambda: p.frame(p.Op.DEMOTE, 0, 12, p.encode_session(7)),
    "promote_request": lambda: p.frame(p.Op.PROMOTE, 0, 13, p.encode_session(7)),
    "pin_request": lambda: p.frame(p.Op.PIN, 0, 14, p.encode_session(7)),
    "unpin_request": lambda: p.frame(p.Op.UNPIN, 0, 15, p.encode_session(7)),
    "lease_request": lambda: p.frame(p.Op.LEASE, 0, 16, p.encode_session(7)),
    "release_request": lambda: p.frame(p.Op.RELEASE, 0, 17, p.encode_session(7)),
    "reserve_request": lambda: p.frame(p.Op.RESERVE, 0, 18, p.encode_session_tokens(7, 3)),
    "commit_request": lambda: p.frame(p.Op.COMMIT, 0, 19, p.encode_session_tokens(7, 2)),
    "commit_layers_request": lambda: p.frame(p.Op.COMMIT, p.FLAG_COMMIT_LAYERS, 20, p.encode_session_tokens(7, 2, (1, 3))),
    "offload_request": lambda: p.frame(p.Op.OFFLOAD, 0, 24, p.encode_session(7)),
}


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_request_encoding_matches_golden(name):
    assert REQUESTS[name]() == load(name)


def reply(name):
    rid, opcode, flags, body = split(load(name))
    return rid, p.decode_reply(opcode, flags, body)


def test_hello_reply():
    assert reply("hello_reply") == (1, p.HelloReply(p.PROTOCOL_VERSION, 16 << 20, "tierd", "0.1.0"))


def test_simple_replies():
    assert reply("create_session_reply") == (2, 7)
    assert reply("append_kv_reply") == (3, 1)
    assert reply("close_session_reply") == (10, None)
    assert reply("stats_reply") == (8, {"uptime_ms": 1234, "sessions": 2})
    assert reply("error_reply") == (9, p.ErrorReply(p.ErrorCode.NOT_FOUND, "session 42 not found"))
    assert reply("owned_elsewhere_reply") == (25, p.ErrorReply(p.ErrorCode.OWNED_ELSEWHERE, "node-b"))


def test_tier_and_lease_replies():
    for name, rid, value in [("evict_reply", 11, None), ("demote_reply", 12, 4), ("promote_reply", 13, 3),
                             ("pin_reply", 14, None), ("unpin_reply", 15, None), ("release_reply", 17, None),
                             ("commit_reply", 19, 22), ("offload_reply", 24, 6)]:
        assert reply(name) == (rid, value), name
    rid, lease = reply("lease_reply")
    assert rid == 16
    assert (lease.instance, lease.arena_bytes, lease.run_bytes) == (0x0123456789ABCDEF, 1 << 20, 512)
    assert [(l.tokens, list(l.offsets)) for l in lease.layers] == [(20, [0, 4096]), (20, [8192, p.LEASE_COLD])]
    rid, res = reply("reserve_reply")
    assert rid == 18 and (res.start, res.tokens) == (20, 3)
    assert [list(l) for l in res.layers] == [[4096], [12288]]


def test_session_replies():
    assert reply("session_info_reply") == (6, session_info(7, "golden", False))
    assert reply("list_sessions_reply") == (7, [session_info(7, "golden", False), session_info(9, "", True)])


def test_decode_reply():
    rid, outs = reply("decode_reply")
    assert rid == 5 and len(outs) == 2
    np.testing.assert_array_equal(outs[0].out, np.arange(16, dtype=np.float32) * 0.5)
    np.testing.assert_array_equal(outs[1].out, -np.arange(16, dtype=np.float32))
    assert outs[0].stats == p.DecodeStats(3, 6, 1024, 512, 2, 4, 0, [[0, 1, 2], [0, 1, 2]])
    assert outs[1].stats == p.DecodeStats(1, 2, 256, 0, 0, 2, 0, [[0], [0]])


def test_golden_files_are_complete():
    # Every reply file parses; every request file is covered above.
    import os
    from golden import GOLDEN_DIR

    names = {f[:-4] for f in os.listdir(GOLDEN_DIR) if f.endswith(".hex")}
    assert {n for n in names if n.endswith("_request")} == set(REQUESTS)
    for n in names - set(REQUESTS):
        reply(n)


@pytest.mark.parametrize("cut", [0, 1, 5, 23])
def test_bad_headers(cut):
    frame = load("hello_request")
    with pytest.raises(p.ProtocolError):
        p.decode_header(frame[:cut])
    bad = b"XVT1" + frame[4:24]
    with pytest.raises(p.ProtocolError, match="magic"):
        p.decode_header(bad)
    with pytest.raises(p.ProtocolError, match="reserved"):
        p.decode_header(frame[:20] + b"\x01\x00\x00\x00")


def test_truncated_and_trailing_replies_rejected():
    for name in ["hello_reply", "decode_reply", "list_sessions_reply", "stats_reply", "error_reply",
                 "owned_elsewhere_reply"]:
        _, opcode, flags, body = split(load(name))
        for cut in range(len(body)):
            with pytest.raises(p.ProtocolError):
                p.decode_reply(opcode, flags, body[:cut])
        with pytest.raises(p.ProtocolError, match="trailing"):
            p.decode_reply(opcode, flags, body + b"\x00")


def test_version_3_session_info_has_no_remote_bytes():
    # Version 3 lays SessionInfo out as version 4 without its last field.
    _, opcode, flags, body = split(load("session_info_reply"))
    info = p.decode_reply(opcode, flags, body[:-8], version=3)
    assert info == dataclasses.replace(session_info(7, "golden", False), remote_bytes=0)
    with pytest.raises(p.ProtocolError):
        p.decode_reply(opcode, flags, body[:-8])


def test_bad_reply_fields():
    _, opcode, flags, body = split(load("session_info_reply"))
    bad = bytearray(body)
    state = len(bad) - 25  # then created, last access, remote bytes
    bad[state] = 3  # pinned and damaged
    info = p.decode_reply(opcode, flags, bytes(bad))
    assert info.pinned and info.damaged
    bad[state] = 4  # an unknown state bit
    with pytest.raises(p.ProtocolError, match="session state"):
        p.decode_reply(opcode, flags, bytes(bad))
    with pytest.raises(p.ProtocolError, match="error code"):
        p.decode_reply(p.ERROR_OPCODE, 0, b"\x63\x00\x00\x00\x00\x00")
    with pytest.raises(p.ProtocolError, match="not a reply"):
        p.decode_reply(1, 0, b"")
    with pytest.raises(p.ProtocolError, match="flags"):
        p.decode_reply(p.Op.STATS.reply, 1, b"\x00\x00\x00\x00")
    # A forged count cannot make the decoder loop over a tiny body.
    with pytest.raises(p.ProtocolError, match="cannot fit"):
        p.decode_reply(p.Op.LIST_SESSIONS.reply, 0, b"\xff\xff\xff\xff")


def test_bf16_round_to_nearest_even():
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0x80000000,
                     0x7F800000, 0xFF800000], dtype=np.uint32)
    got = p.f32_to_bf16(bits.view(np.float32))
    assert [hex(x) for x in got] == [hex(x) for x in
                                     [0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0x8000, 0x7F80, 0xFF80]]
    nan = p.f32_to_bf16(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(p.bf16_to_f32(nan)).all()
    # Every bf16 value converts to f32 and back unchanged (NaNs excepted).
    all_bf16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = p.bf16_to_f32(all_bf16)
    ok = ~np.isnan(f)
    np.testing.assert_array_equal(p.f32_to_bf16(f)[ok], all_bf16[ok])
    # Golden payload values are exact in bf16.
    np.testing.assert_array_equal(p.bf16_to_f32(PAYLOAD), np.arange(32, dtype=np.float32) * 0.25)


def test_encoder_rejects_ambiguous_arrays():
    e = decode_entries()[0]
    with pytest.raises(TypeError):
        p.encode_decode(0, [p.DecodeEntry(1, 0, e.q, e.k.astype(np.float64), e.v)])
    with pytest.raises(ValueError):
        p.encode_decode(0, [p.DecodeEntry(1, 0, e.q, e.k, e.v[:1])])


def test_pack_append_payload_layout():
    L, n, H, D = 2, 3, 2, 4
    k = np.arange(L * n * H * D, dtype=np.float32).reshape(L, n, H, D)
    v = -k
    payload = np.frombuffer(p.pack_append_payload(k, v), dtype="<f4")
    per_layer = n * H * D
    assert payload.size == GEOMETRY.__class__(L, 4, H, D, p.Dtype.F32).append_payload_bytes(n) // 4
    np.testing.assert_array_equal(payload[:per_layer], k[0].ravel())
    np.testing.assert_array_equal(payload[per_layer : 2 * per_layer], v[0].ravel())
    np.testing.assert_array_equal(payload[2 * per_layer : 3 * per_layer], k[1].ravel())
