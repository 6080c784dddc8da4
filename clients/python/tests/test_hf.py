"""kvtier.hf against a real tierd: tiny randomly initialised Qwen2 and Llama models (built from
config objects, nothing downloaded) generate exactly like dense when the policy covers every
block, with batch 2 and left padding; sampling runs; typed errors for an unreachable tierd and
a refused geometry."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from kvtier import Dtype, Policy  # noqa: E402
from kvtier.hf import (  # noqa: E402
    GeometryRefused,
    KvtierCache,
    KvtierStaticCache,
    TierdUnavailable,
    UnsupportedUse,
    default_policy,
    enable,
)

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)


def tiny(kind):
    torch.manual_seed(0)
    if kind == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**SMALL))
    else:
        m = LlamaForCausalLM(LlamaConfig(**SMALL))
    m.eval()
    enable(m)
    return m


def batch(prompt_len=300, pad=37):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (2, prompt_len), generator=g)
    am = torch.ones_like(ids)
    ids[1, :pad] = 0
    am[1, :pad] = 0  # row 1 is left-padded
    return ids, am


def short_generate(m, cache, ids, am, new_tokens):
    """`generate` of a few greedy tokens of `batch`'s ids through `cache`."""
    return m.generate(input_ids=ids, attention_mask=am, max_new_tokens=new_tokens, cache=cache, pad_token_id=0)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [Dtype.F32, Dtype.BF16])
def test_generate_matches_dense_when_policy_covers_every_block(tierd_factory, kind, dtype):
    sock = tierd_factory()
    m = tiny(kind)
    ids, am = batch()
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=24, do_sample=False, pad_token_id=0)
    dense = m.generate(cache=DynamicCache(config=m.config), **kw)
    # 300 prompt + 24 new tokens in blocks of 16: 21 blocks <= 1 + 4 + 16.
    with KvtierCache(m, socket=sock, policy=Policy(1, 4, 16), block_tokens=16, dtype=dtype) as c:
        sparse = m.generate(cache=c, **kw)
        assert len(c.sessions) == 2
        # Each row's session holds only its real tokens: row 1 lost its 37 pads.
        assert c.positions[:, 0].tolist() == [300 + 23] * 3
        assert c.positions[:, 1].tolist() == [300 - 37 + 23] * 3
        assert c.geometry.layers == 3 and c.geometry.q_heads == 4 and c.geometry.kv_heads == 2
    if dtype == Dtype.F32:
        assert torch.equal(dense, sparse)
    else:  # bf16 KV in tierd vs f32 in the engine: nearly always the same tokens
        assert (dense[:, 300:] == sparse[:, 300:]).float().mean() >= 0.75


def test_sparse_policy_and_sampling_run(tierd_factory):
    sock = tierd_factory()
    m = tiny("qwen2")
    ids, am = batch(prompt_len=400)
    with KvtierCache(m, socket=sock, policy=Policy(1, 2, 3), block_tokens=16) as c:
        c.want_stats = True
        out = m.generate(input_ids=ids, attention_mask=am, max_new_tokens=12, do_sample=True,
                         top_k=20, temperature=0.9, pad_token_id=0, cache=c)
        assert out.shape == (2, 412)
        # Sparse: 1 sink + 2 local + 3 distant blocks of 16 tokens selected, per kv head.
        assert all(s.blocks_selected == 2 * 6 for s in c.last_stats)
        assert c.last_stats[0].blocks_total == 26


def compiled(**kw):
    """A generation config's `compile_config` for compiled decoding on this machine's CPU too:
    one graph for the whole step (`fullgraph`: a graph break fails)."""
    from transformers.generation.configuration_utils import CompileConfig

    cc = CompileConfig(fullgraph=True, mode="default", **kw)
    cc._compile_all_devices = True  # transformers compiles only on accelerators by default
    return cc


def graphs() -> int:
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_static_cache_decodes_as_the_eager_adapter_compiled_or_not(tierd_factory, kind):
    sock = tierd_factory()
    m = tiny(kind)
    ids, am = batch()  # batch 2, row 1 left-padded
    # Sparse: 1 sink + 2 local + 4 of the 19-20 blocks of 16 tokens.
    opts = dict(socket=sock, policy=Policy(1, 2, 4), block_tokens=16)
    n = 300 + 16
    start, step = graphs(), None
    for sample in (False, True):  # sampling is outside the step: the same step serves it
        kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=16, do_sample=sample,
                  top_k=20, pad_token_id=0)
        torch.manual_seed(5)
        with KvtierCache(m, **opts) as c:
            eager = m.generate(cache=c, **kw)
        torch.manual_seed(5)
        with KvtierStaticCache(m, max_cache_len=n, **opts) as c:
            static = m.generate(cache=c, disable_compile=True, **kw)
        assert torch.equal(static, eager)
        for i in range(2):
            torch.manual_seed(5)
            with KvtierStaticCache(m, max_cache_len=n, **opts) as c:
                out = m.generate(cache=c, compile_config=compiled(), **kw)
                assert c.positions[:, 1].tolist() == [300 - 37 + 15] * 3  # every step in tierd
            assert torch.equal(out, eager), (sample, i)
            step = step or graphs()
            assert step > start, "the decode step was compiled"
            assert graphs() == step, "later caches reuse the compiled step"


def test_static_cache_refuses_another_attention(tierd_factory):
    sock = tierd_factory()
    m = tiny("qwen2")
    m.set_attn_implementation("sdpa")
    ids, am = batch(prompt_len=40, pad=0)
    with KvtierStaticCache(m.config, max_cache_len=48, socket=sock) as c:
        with pytest.raises(UnsupportedUse, match="enable"):
            short_generate(m, c, ids, am, 3)


def test_unreachable_tierd_is_a_typed_error(tmp_path):
    m = tiny("llama")
    with pytest.raises(TierdUnavailable, match="cannot reach tierd at .*nope.sock"):
        KvtierCache(m, socket=str(tmp_path / "nope.sock"))


def test_refused_geometry_names_the_geometry(tierd_factory):
    # A block run of 2 kv heads x 2 x 64 tokens x 16 dims x 4 bytes = 16 KiB > 4 KiB runs.
    sock = tierd_factory("--set", 'host.max_run_bytes="4KiB"', capacity="64MiB")
    m = tiny("llama")
    ids, am = batch(prompt_len=20, pad=0)
    with KvtierCache(m, socket=sock) as c:
        with pytest.raises(GeometryRefused) as e:
            short_generate(m, c, ids, am, 3)
    msg = str(e.value)
    assert "layers=3, q_heads=4, kv_heads=2, head_dim=16, dtype=F32, block_tokens=64" in msg
    assert "host.max_run_bytes" in msg
    # And a geometry no tierd accepts: block_tokens above 4096.
    sock2 = tierd_factory()
    with KvtierCache(m, socket=sock2, block_tokens=8192) as c:
        with pytest.raises(GeometryRefused, match="block_tokens"):
            short_generate(m, c, ids, am, 3)


def test_the_default_is_64_token_blocks_at_the_budget_in_tokens(tierd_factory):
    sock, m, (ids, am) = tierd_factory(), tiny("llama"), batch(prompt_len=40, pad=0)
    with KvtierCache(m, socket=sock) as c:
        short_generate(m, c, ids, am, 2)
        assert (c.geometry.block_tokens, c.policy) == (64, Policy(2, 8, 64))
        info = c.client.session_info(c.sessions[0])  # what tierd holds
        assert (info.geometry.block_tokens, info.policy) == (64, Policy(2, 8, 64))
    # A sink of 128 tokens, a local window of 512, 4,096 distant tokens; at least a block each.
    assert default_policy(128) == Policy(1, 4, 32)
    assert default_policy(16) == Policy(8, 32, 256)
    assert default_policy(8192) == Policy(1, 1, 1)


def test_right_padding_is_refused(tierd_factory):
    sock = tierd_factory()
    m = tiny("qwen2")
    ids, am = batch(prompt_len=40, pad=0)
    am[1, -5:] = 0
    with KvtierCache(m, socket=sock) as c:
        with pytest.raises(UnsupportedUse, match="left padding"):
            short_generate(m, c, ids, am, 3)


def test_model_without_kvtier_attention_is_caught(tierd_factory):
    sock = tierd_factory()
    m = tiny("qwen2")
    m.set_attn_implementation("sdpa")
    ids, am = batch(prompt_len=40, pad=0)
    with KvtierCache(m.config, socket=sock) as c:  # a config: the model is not switched
        with pytest.raises(UnsupportedUse, match="enable"):
            short_generate(m, c, ids, am, 3)
    with KvtierCache(m, socket=sock) as c:  # a model: switched to "kvtier"
        short_generate(m, c, ids, am, 3)
    assert m.config._attn_implementation == "kvtier"


def test_tierd_gone_mid_generation_is_a_typed_error(tierd_factory):
    sock, m, (ids, am) = tierd_factory(), tiny("llama"), batch(prompt_len=40, pad=0)
    with KvtierCache(m, socket=sock) as c:
        short_generate(m, c, ids, am, 2)
        c.client._sock.close()  # as if tierd had gone away
        with pytest.raises(TierdUnavailable):
            m(input_ids=ids[:, :1], cache=c)
