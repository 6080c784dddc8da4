"""kvtier.engine, the in-engine path's Python binding. Without a GPU: the extension loads and a
missing device is a typed error. With one (the GPU host): decoding a session tierd holds, on
this process's device, matches dense attention over the reported keep-set."""

import os

import numpy as np
import pytest

from kvtier import Client, Dtype, Geometry, KvtierError, Policy, f32_to_bf16, bf16_to_f32
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


# The device-batch tests' sessions: 2 layers of Qwen2.5-7B's heads in 32-token blocks (a
# hand-off every 32 steps), a keep-set of 6 blocks.
BATCH_GEO = Geometry(2, 28, 4, 128, Dtype.BF16, 32)
BATCH_POLICY = Policy(sink_blocks=1, local_blocks=2, top_k=3)


def shared_tierd(tierd_factory):
    """A tierd on the CPU backend sharing its arena (what the in-engine path leases), and a
    client of it."""
    sock = tierd_factory("--backend", "cpu", "--set", "host.shared=true")
    return sock, Client(sock)


def dense_on_keep_set_and_tail(q, k, v, keep, block_tokens, stored):
    """Softmax attention in float64 over the kept blocks' stored tokens (before `stored`) and
    every token from `stored` on. q [Hq, D]; k, v [T, Hkv, D]."""
    hq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros((hq, d))
    tail = np.arange(stored, k.shape[0])
    for h in range(hq):
        kv_h = h // g
        kept = [np.arange(b * block_tokens, min((b + 1) * block_tokens, stored)) for b in keep[kv_h]]
        toks = np.concatenate(kept + [tail])
        s = k[toks, kv_h, :].astype(np.float64) @ q[h].astype(np.float64) / np.sqrt(d)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ v[toks, kv_h, :].astype(np.float64)
    return out


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")
def test_device_batch_matches_dense_attention_over_keep_set_and_gpu_tail(tierd_factory):
    """Two sessions of different lengths decoded with torch tensors on the GPU through the
    device path for 70 steps (two hand-offs of 32-token tails to tierd): every output is dense
    attention over kvtier's keep-set of the stored tokens plus every token still on the GPU,
    and tierd ends up holding every token."""
    torch = pytest.importorskip("torch")
    sock, c = shared_tierd(tierd_factory)
    g, pol = BATCH_GEO, BATCH_POLICY
    gen = torch.Generator(device="cuda").manual_seed(5)
    hist = []  # per session, per layer: [k, v] float32 [T, Hkv, D] of bf16 values
    sessions = []
    for i, n in enumerate([300, 333]):
        s = c.create_session(g, pol, f"device-batch-{i}")
        kv = torch.randn((g.layers, 2, n, g.kv_heads, g.head_dim), generator=gen, device="cuda")
        kv = kv.to(torch.bfloat16)
        c.append_kv_shm(s, 0, n, kv.view(torch.int16).cpu().numpy().tobytes())
        hist.append([[kv[l, j].float().cpu().numpy() for j in range(2)] for l in range(g.layers)])
        sessions.append(s)
    e = engine.InEngine(sock, g, pol)
    db = engine.DeviceBatch(e, c, sessions)
    worst = 0.0
    for step in range(70):
        stored = list(db.stored)
        for layer in range(g.layers):
            q = torch.randn((2, g.q_heads, g.head_dim), generator=gen, device="cuda")
            k = torch.randn((2, g.kv_heads, g.head_dim), generator=gen, device="cuda").to(torch.bfloat16)
            v = torch.randn((2, g.kv_heads, g.head_dim), generator=gen, device="cuda").to(torch.bfloat16)
            out = db.attend(layer, q, k, v)
            keep = e.keep_sets(layer)
            for i in range(2):
                hk, hv = hist[i][layer]
                hist[i][layer] = [np.concatenate([hk, k[i].float().cpu().numpy()[None]]),
                                  np.concatenate([hv, v[i].float().cpu().numpy()[None]])]
                want = dense_on_keep_set_and_tail(q[i].cpu().numpy(), *hist[i][layer], keep[i],
                                                  g.block_tokens, stored[i])
                err = np.abs(out[i].cpu().numpy() - want).max() / np.abs(want).max()
                worst = max(worst, err)
                assert err < 2e-3, (step, layer, i, err)
    assert db.stored == [300 + 64, 333 + 64] and db.count == 6
    db.close()
    for i, s in enumerate(sessions):
        assert c.session_info(s).tokens_max == [370, 403][i]
        with c.lease(s) as lease:
            # The hand-offs landed where they belong: the last full block tierd holds is the
            # tokens decoded on the GPU, bit for bit.
            bt = g.block_tokens
            blk = (370 if i == 0 else 403) // bt - 1
            run = lease.run(1, blk).view("<u2").reshape(g.kv_heads, 2, bt, g.head_dim)
            for j in range(2):  # K, V: [Hkv, bt, D] in the run, [bt, Hkv, D] in the history
                got = bf16_to_f32(run[:, j]).transpose(1, 0, 2)
                assert np.array_equal(got, hist[i][1][j][blk * bt:(blk + 1) * bt]), (i, j)
            del run
    print(f"device batch: worst relative error {worst:.2e} over 140 layer steps x 2 sessions")


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")
def test_a_captured_step_replays_like_the_eager_step_across_hand_offs(tierd_factory):
    """A whole step (both layers' stage, kvtier launch and finish) captured by CapturedStep and
    replayed for 70 steps equals the same steps made eagerly on twin sessions, bit for bit:
    outputs, the tokens handed to tierd and the keep-sets; and the tile cache decides alike
    (the same hits and misses in every step: replays keep LRU order, although a replayed
    launch repeats its arguments). The two hand-offs (tails of 32 tokens) each cause one new
    capture, before the next replay."""
    torch = pytest.importorskip("torch")
    sock, c = shared_tierd(tierd_factory)
    g, pol = BATCH_GEO, BATCH_POLICY
    gen = torch.Generator(device="cuda").manual_seed(6)
    pairs = []  # (captured session, eager twin) with the same stored KV
    for i, n in enumerate([300, 333]):
        kv = torch.randn((g.layers, 2, n, g.kv_heads, g.head_dim), generator=gen, device="cuda")
        payload = kv.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes()
        twin = []
        for who in ("captured", "eager"):
            s = c.create_session(g, pol, f"{who}-{i}")
            c.append_kv_shm(s, 0, n, payload)
            twin.append(s)
        pairs.append(twin)
    captured_e, eager_e = engine.InEngine(sock, g, pol), engine.InEngine(sock, g, pol)
    cap = engine.DeviceBatch(captured_e, c, [p[0] for p in pairs])
    ref = engine.DeviceBatch(eager_e, c, [p[1] for p in pairs])
    # Static inputs and outputs of the captured step (a graph reads and writes fixed addresses).
    q_in = torch.zeros((g.layers, 2, g.q_heads, g.head_dim), device="cuda")
    k_in = torch.zeros((g.layers, 2, g.kv_heads, g.head_dim), device="cuda", dtype=torch.bfloat16)
    v_in = torch.zeros_like(k_in)
    out = torch.zeros_like(q_in)

    def step():
        for layer in range(g.layers):
            out[layer].copy_(cap.attend(layer, q_in[layer], k_in[layer], v_in[layer]))

    whole = engine.CapturedStep(cap, step)
    for i in range(70):
        q_in.copy_(torch.randn(q_in.shape, generator=gen, device="cuda"))
        k_in.copy_(torch.randn(k_in.shape, generator=gen, device="cuda"))
        v_in.copy_(torch.randn(v_in.shape, generator=gen, device="cuda"))
        whole()
        want = torch.stack([ref.attend(layer, q_in[layer], k_in[layer], v_in[layer])
                            for layer in range(g.layers)])
        torch.cuda.synchronize()
        assert torch.equal(out, want), (i, (out - want).abs().max().item())
        if i > 0:  # the first step ran eagerly (the warm-up)
            assert captured_e.keep_sets(1) == eager_e.keep_sets(1), i
        # Since the last bind (both hand off at the same steps). 10-13 blocks against 6 kept
        # and 9 distant cache slots: eviction order decides hits.
        assert captured_e.bound_stats() == eager_e.bound_stats(), i
    # Captured at step 1, then again after the hand-offs of steps 31 and 63.
    assert whole.captures == 3 and cap.epoch == ref.epoch == 2
    assert cap.stored == ref.stored == [364, 397] and cap.count == ref.count == 6
    cap.close()
    ref.close()
    for a, b in pairs:
        assert c.session_info(a).tokens_max == c.session_info(b).tokens_max
        with c.lease(a) as la, c.lease(b) as lb:
            for layer in range(g.layers):
                for blk in range(c.session_info(a).tokens_max // g.block_tokens):
                    assert np.array_equal(la.run(layer, blk), lb.run(layer, blk)), (a, layer, blk)


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")
def test_a_failed_hand_off_stops_the_next_step_with_a_typed_error(tierd_factory):
    """tierd killed while the tails fill: the step whose hand-off fails still returns its
    output; every later step (eager or a CapturedStep) raises a typed error before it writes
    anything, and the GPU stays usable (no write past the tails)."""
    torch = pytest.importorskip("torch")
    sock, c = shared_tierd(tierd_factory)
    g = BATCH_GEO
    s = c.create_session(g, BATCH_POLICY, "failed-hand-off")
    rng = np.random.default_rng(3)
    kv = f32_to_bf16(rng.standard_normal((g.layers, 2, 300, g.kv_heads, g.head_dim), dtype=np.float32))
    c.append_kv_shm(s, 0, 300, kv.tobytes())
    e = engine.InEngine(sock, g, BATCH_POLICY)
    db = engine.DeviceBatch(e, c, [s])
    q = torch.randn((1, g.q_heads, g.head_dim), device="cuda")
    k = torch.randn((1, g.kv_heads, g.head_dim), device="cuda")

    def step():
        return [db.attend(layer, q, k, k) for layer in range(g.layers)]

    for _ in range(31):
        step()
    tierd_factory.procs[-1].kill()
    tierd_factory.procs[-1].wait()
    out = step()  # the 32nd token fills the tails: its hand-off fails, the step is done
    assert torch.isfinite(out[-1]).all() and db.count == 32
    assert isinstance(db.handoff_error, (engine.EngineError, KvtierError, OSError))
    for _ in range(2):
        with pytest.raises((engine.EngineError, KvtierError, OSError)):
            step()
        assert db.count == 32 and db.epoch == 0
    with pytest.raises((engine.EngineError, KvtierError, OSError)):
        engine.CapturedStep(db, step)()
    torch.cuda.synchronize()
    assert int(db.pos.max()) == 32  # nothing staged past the tails


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("by_layer", [False, True])
def test_hf_adapter_decodes_in_engine_on_a_gpu_like_dense(tierd_factory, dtype, by_layer, monkeypatch):
    """kvtier.hf with the model on the GPU takes the in-engine path (no DECODE per step, the
    prefill and the hand-offs by DMA, never through host memory and APPEND_KV): with a policy
    that covers every block, greedy generation equals dense generation (f32 KV: exactly; bf16:
    nearly always), across hand-offs of the GPU-held tokens to tierd, with the prefill handed
    over at once or layer by layer."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    from kvtier import hf

    sock = tierd_factory("--set", "host.shared=true")
    torch.manual_seed(0)
    # 5 layers: by layer, the prefill's commits lag its copies by two layers; the last lands it.
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    m = Qwen2ForCausalLM(cfg).eval().to("cuda")
    hf.enable(m)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (2, 300), generator=g)
    am = torch.ones_like(ids)
    ids[1, :37], am[1, :37] = 0, 0  # left padding
    kw = dict(input_ids=ids.cuda(), attention_mask=am.cuda(), max_new_tokens=40, do_sample=False,
              pad_token_id=0)
    # past_key_values: the keyword every transformers 5.x takes (later ones also say cache=).
    dense = m.generate(past_key_values=DynamicCache(config=m.config), **kw)
    wire = Dtype.F32 if dtype == "f32" else Dtype.BF16
    # 340 tokens in blocks of 16: 22 blocks <= 1 + 4 + 32; 40 steps cross two hand-offs.
    def through_host(*args, **kwargs):
        raise AssertionError("K/V went through host memory and APPEND_KV")

    monkeypatch.setattr(Client, "append_kv_shm", through_host)
    monkeypatch.setattr(Client, "append_kv_fd", through_host)
    with hf.KvtierCache(m, socket=sock, policy=Policy(1, 4, 32), block_tokens=16, dtype=wire,
                        engine="on", prefill_by_layer=by_layer) as c:
        sparse = m.generate(past_key_values=c, **kw)
        assert c.device_batch is not None and c.engine_error is None
        assert c.device_batch.stored == [300 + 32, 263 + 32] and c.device_batch.count == 7
        sessions = list(c.sessions)
        client = Client(sock)
        c.device_batch.close()
        # Every token (39 decoded steps appended: the last step's token is never attended)
        # is in tierd once the device batch hands its tail over.
        assert [client.session_info(s).tokens_max for s in sessions] == [339, 302]
    if dtype == "f32":
        assert torch.equal(dense, sparse)
    else:
        assert (dense[:, 300:] == sparse[:, 300:]).float().mean() >= 0.75


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")
def test_head_shards_in_one_process_equal_the_whole_engine(tierd_factory):
    """Two engines of one process, each attending half of every session's KV heads (rank 0 and
    1 of 2), give the whole engine's output for their query heads, bit for bit; a shard that
    does not divide the heads is a typed error."""
    sock = tierd_factory("--backend", "cpu", "--set", "host.shared=true")
    g = Geometry(2, 28, 4, 128, Dtype.BF16, 128)
    pol = Policy(sink_blocks=1, local_blocks=2, top_k=3)
    c = Client(sock)
    s = c.create_session(g, pol, "py-shards")
    n = 1500
    rng = np.random.default_rng(9)
    kv = [[f32_to_bf16(rng.standard_normal((n, g.kv_heads, g.head_dim), dtype=np.float32))
           for _ in range(2)] for _ in range(g.layers)]
    c.append_kv_shm(s, 0, n, b"".join(x.tobytes() for layer in kv for x in layer))
    with pytest.raises(engine.EngineUnavailable, match="shard"):
        engine.InEngine(sock, g, pol, rank=0, world=3)
    whole = engine.InEngine(sock, g, pol)
    whole.attach(s)
    shards = [engine.InEngine(sock, g, pol, rank=r, world=2) for r in range(2)]
    for e in shards:
        e.attach(s)
    for layer in range(g.layers):
        q = rng.standard_normal((1, g.q_heads, g.head_dim), dtype=np.float32)
        want = whole.decode_layer(layer, [s], q)
        keep = whole.keep_sets(layer)[0]
        for r, e in enumerate(shards):
            got = e.decode_layer(layer, [s], q[:, r * 14:(r + 1) * 14])
            assert np.array_equal(got.view(np.uint32), want[:, r * 14:(r + 1) * 14].view(np.uint32))
            assert e.keep_sets(layer)[0] == keep[r * 2:(r + 1) * 2]


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")
def test_device_path_refuses_bad_buffers_and_batches_with_typed_errors(tierd_factory):
    """Every way to call the device path wrong is a typed error before anything runs: no bound
    batch, a stale binding after sync, wrong dtype, shape, device or layout, a DeviceBatch over
    a shard or over an engine that cannot append in place, a block cache smaller than the
    keep-set."""
    torch = pytest.importorskip("torch")
    sock = tierd_factory("--backend", "cpu", "--set", "host.shared=true")
    g = Geometry(2, 28, 4, 128, Dtype.BF16, 128)
    pol = Policy(sink_blocks=1, local_blocks=2, top_k=3)
    c = Client(sock)
    s = c.create_session(g, pol, "bad-device-calls")
    rng = np.random.default_rng(4)
    n = 300
    kv = f32_to_bf16(rng.standard_normal((g.layers, 2, n, g.kv_heads, g.head_dim), dtype=np.float32))
    c.append_kv_shm(s, 0, n, kv.tobytes())
    e = engine.InEngine(sock, g, pol)
    e.attach(s)
    dev = "cuda"
    q = torch.randn((1, g.q_heads, g.head_dim), device=dev)
    out = torch.empty_like(q)
    lse = torch.empty((1, g.q_heads), device=dev)
    with pytest.raises(engine.EngineError, match="bound"):
        e.decode_layer_torch(0, q, out, lse)
    e.bind([s])
    for bad, what in [(q.half(), "float32"), (q[:, :27], "float32"), (q.cpu(), "cuda"),
                      (torch.randn((1, g.head_dim, g.q_heads), device=dev).transpose(1, 2), "contiguous")]:
        with pytest.raises(ValueError, match=what):
            e.decode_layer_torch(0, bad, out, lse)
    with pytest.raises(ValueError, match="lse"):
        e.decode_layer_torch(0, q, out, lse[:, :3])
    e.decode_layer_torch(0, q, out, lse)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # The block cache's size changes what crosses PCIe, never the answer; below the keep-set
    # (1 + 2 + 3 blocks) it is refused.
    with pytest.raises(engine.EngineUnavailable, match="cache_slots 5"):
        engine.InEngine(sock, g, pol, cache_slots=5)
    big = engine.InEngine(sock, g, pol, cache_slots=64)
    big.attach(s)
    big.bind([s])
    out2 = torch.empty_like(out)
    big.decode_layer_torch(0, q, out2, None)
    torch.cuda.synchronize()
    assert torch.equal(out, out2)
    big.detach(s)
    e.sync(s)  # changes device state: the binding is gone
    with pytest.raises(engine.EngineError, match="bound"):
        e.decode_layer_torch(0, q, out, lse)
    shard = engine.InEngine(sock, g, pol, rank=1, world=2)
    with pytest.raises(ValueError, match="every head"):
        engine.DeviceBatch(shard, c, [s])
    with pytest.raises(engine.EngineUnavailable, match="every head"):
        engine.InEngine(sock, g, pol, rank=1, world=2, in_place=True)
    read_only = engine.InEngine(sock, g, pol, in_place=False)
    with pytest.raises(ValueError, match="in_place"):
        engine.DeviceBatch(read_only, c, [s])
    rows = torch.zeros((g.layers, 1, g.kv_heads, 2, 8, g.head_dim), dtype=torch.bfloat16, device=dev)
    with pytest.raises(engine.EngineError, match="in_place"):
        read_only.append_rows([s], rows, 8)
    for bad, tokens, first, what in [(rows.float(), 8, 0, "bfloat16"), (rows[:, :, :3], 8, 0, "kv_heads"),
                                      (rows.cpu(), 8, 0, "cuda"), (rows, 9, 0, "rows"),
                                      (rows, 4, 5, "rows"), (rows, 0, 0, "rows")]:
        with pytest.raises(ValueError, match=what):
            e.append_rows([s], bad, tokens, first)
    assert c.session_info(s).tokens_max == 300


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")
def test_an_append_layer_by_layer_equals_one_append_of_every_layer(tierd_factory):
    """kvtier.hf's prefill on a GPU: rows copied and committed layer by layer (the commits
    lagging the copies) give tierd the session one append of every layer gives, byte for byte,
    and land with the last layer; the engine answers alike from both. Misuse is a typed error
    and lands nothing."""
    torch = pytest.importorskip("torch")
    sock = tierd_factory("--backend", "cpu", "--set", "host.shared=true")
    g = Geometry(4, 8, 2, 64, Dtype.BF16, 16)
    pol = Policy(sink_blocks=1, local_blocks=2, top_k=3)
    c = Client(sock)
    a, b = c.create_session(g, pol, "at-once"), c.create_session(g, pol, "by-layer")
    e = engine.InEngine(sock, g, pol)
    e.attach(a)
    e.attach(b)
    n = 200
    torch.manual_seed(3)
    rows = torch.randn((g.layers, 1, g.kv_heads, 2, n, g.head_dim), device="cuda").to(torch.bfloat16)
    e.append_rows([a], rows, n)
    with pytest.raises(engine.EngineError, match="no append by layer"):
        e.commit_layers(0, 1)
    e.begin_append_by_layer([b], [n])
    e.copy_layer(0, [rows[0, 0]])
    e.copy_layer(1, [rows[1, 0]])
    e.commit_layers(0, 1)
    assert c.session_info(b).tokens_max == 0  # lands with the last layer
    e.copy_layer(2, [rows[2, 0]])
    e.copy_layer(3, [rows[3, 0]])
    e.commit_layers(1, 3)
    assert [c.session_info(s).tokens_max for s in (a, b)] == [n, n]
    la, lb = c.lease(a), c.lease(b)
    for layer in range(g.layers):
        for blk in range((n + g.block_tokens - 1) // g.block_tokens):
            assert np.array_equal(la.run(layer, blk), lb.run(layer, blk)), (layer, blk)
    la.close()
    lb.close()
    q = np.random.default_rng(5).standard_normal((1, g.q_heads, g.head_dim), dtype=np.float32)
    for layer in range(g.layers):
        out = e.decode_layer(layer, [a, b], np.concatenate([q, q]))
        assert np.array_equal(out[0], out[1]), layer
    # Misuse: a commit of a layer not copied, a committed layer copied again (each drops the
    # append), rows of the wrong shape.
    def recopy():
        e.copy_layer(0, [rows[0, 0]])
        e.commit_layers(0, 1)
        e.copy_layer(0, [rows[0, 0]])

    for wrong, error in [(lambda: e.commit_layers(0, 1), engine.EngineError), (recopy, engine.EngineError),
                         (lambda: e.copy_layer(0, [rows[0, 0, :1]]), ValueError)]:
        e.begin_append_by_layer([b], [8])
        with pytest.raises(error):
            wrong()
    assert c.session_info(b).tokens_max == n
    # The rows of the wrong shape were refused before the append was touched: it is still open,
    # and completes with the right rows, every layer committed by one call.
    for layer in range(g.layers):
        e.copy_layer(layer, [rows[layer, 0]])
    e.commit_layers(0, g.layers)
    assert c.session_info(b).tokens_max == n + 8
    # Rows tierd refuses (not finite) in layer 1: its COMMIT fails on the committer thread, the
    # error comes back by the last commit_layers at the latest, nothing lands, and the engine
    # has its connection again (sync, then a whole append by layer).
    bad = rows.clone()
    bad[1, 0, 0, 0, 5, 0] = float("nan")
    for src, error in [(bad, "non-finite"), (rows, None)]:
        e.begin_append_by_layer([b], [n])
        try:
            for layer in range(g.layers):
                e.copy_layer(layer, [src[layer, 0]])
                if layer >= 1:
                    e.commit_layers(layer - 1, 1 if layer < g.layers - 1 else 2)
        except engine.EngineError as x:
            assert error is not None and error in str(x), x
        else:
            assert error is None
        e.sync(b)
    assert c.session_info(b).tokens_max == 2 * n + 8


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")
def test_hf_adapter_falls_back_to_decode_when_tierd_does_not_share_its_arena(tierd_factory):
    """engine="auto" against a tierd without host.shared decodes through DECODE (still like
    dense) and says why in engine_error; engine="on" raises instead."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    from kvtier import hf

    sock = tierd_factory()  # host.shared is off
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    m = Qwen2ForCausalLM(cfg).eval().to("cuda")
    hf.enable(m)
    ids = torch.randint(3, 256, (1, 100), generator=torch.Generator().manual_seed(2)).cuda()
    kw = dict(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    dense = m.generate(past_key_values=DynamicCache(config=m.config), **kw)
    with hf.KvtierCache(m, socket=sock, policy=Policy(1, 4, 32), block_tokens=16, dtype=Dtype.F32) as c:
        with pytest.warns(RuntimeWarning, match="host.shared"):
            out = m.generate(past_key_values=c, **kw)
        assert c.device_batch is None and "host.shared" in c.engine_error
    assert torch.equal(dense, out)
    with hf.KvtierCache(m, socket=sock, policy=Policy(1, 4, 32), block_tokens=16, dtype=Dtype.F32,
                        engine="on") as c:
        with pytest.raises(Exception, match="host.shared"):
            m.generate(past_key_values=c, **kw)
