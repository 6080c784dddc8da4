"""kvtier.engine, the in-engine path's Python binding. Without a GPU: the extension loads and a
missing device is a typed error. With one (the GPU host): decoding a session tierd holds, on
this process's device, matches dense attention over the reported keep-set."""

import os

import numpy as np
import pytest

from kvtier import Client, Dtype, Geometry, Policy, f32_to_bf16, bf16_to_f32
from kvtier import engine

from test_daemon import dense_on_keep_set


def has_gpu() -> bool:
    return os.path.exists("/dev/nvidia0")


def test_the_extension_is_built_and_a_missing_device_is_a_typed_error():
    assert engine.available(), "kvtier._native is built by scripts/test.sh"
    if has_gpu():
        pytest.skip("a GPU is present: the device test covers it")
    g = Geometry(2, 4, 2, 32, Dtype.BF16, 16)
    with pytest.raises(engine.EngineUnavailable, match="CUDA"):
        engine.InEngine("/nonexistent.sock", g, Policy(1, 1, 2))


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")
def test_in_engine_decode_matches_dense_attention_over_its_keep_set(tierd_factory):
    sock = tierd_factory("--backend", "cpu", "--set", "host.shared=true")
    g = Geometry(2, 28, 4, 128, Dtype.BF16, 128)
    pol = Policy(sink_blocks=1, local_blocks=2, top_k=3)
    c = Client(sock)
    s = c.create_session(g, pol, "py-engine")
    n = 1500  # 12 blocks, the last partial
    rng = np.random.default_rng(8)
    kv = [[f32_to_bf16(rng.standard_normal((n, g.kv_heads, g.head_dim), dtype=np.float32))
           for _ in range(2)] for _ in range(g.layers)]
    c.append_kv_shm(s, 0, n, b"".join(x.tobytes() for layer in kv for x in layer))
    e = engine.InEngine(sock, g, pol)
    e.attach(s)
    for layer in range(g.layers):
        q = rng.standard_normal((1, g.q_heads, g.head_dim), dtype=np.float32)
        out = e.decode_layer(layer, [s], q)
        keep = e.keep_sets(layer)[0]
        assert all(len(k) == 6 for k in keep)
        k32, v32 = bf16_to_f32(kv[layer][0]), bf16_to_f32(kv[layer][1])
        want = dense_on_keep_set(q[0], k32, v32, keep, g.block_tokens)
        err = np.abs(out[0] - want).max() / np.abs(want).max()
        assert err < 2e-3, (layer, err)
    e.detach(s)
