"""The native paged-attention kernel against the torch backend (its oracle) and fp64 math on
random paged caches, and the engine on each backend against Hugging Face transformers."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM
from kvserve.engine.attention import (
    NATIVE_AVAILABLE,
    NATIVE_FAST,
    AttentionMetadata,
    NativeAttentionBackend,
    TorchAttentionBackend,
    get_attention_backend,
)
from tests.engine.test_llm_parity import HFOracle, _greedy, _prompts

# Built by `pip install -e .` wherever there is a C compiler: a missing kernel there is a bug.
pytestmark = pytest.mark.skipif(
    not NATIVE_AVAILABLE and shutil.which("cc") is None, reason="no C compiler: kernel not built"
)

# bf16: every path computes in fp32 from the bf16 inputs (the avx512/avx2/baseline paths widen
# K/V/Q; the avx512bf16 path multiplies bf16 q and k pairs with `vdpbf16ps`, whose products are
# exact in fp32 and summed in fp32, then scales the score) and rounds the output once, so it is
# within half a bf16 ulp (<= 2^-8 relative) of exact attention over the same bf16 inputs, plus
# fp32 accumulation error (covered by the absolute term).
BF16_TOL = dict(rtol=2**-8, atol=1e-4)
# The avx512bf16 path's prefill tiles also round the probabilities to bf16 before P.V (as
# torch's bf16 SDPA does): each weight within 2^-9 of itself, so the output moves by at most
# 2^-9 x max|V| of the context on top of BF16_TOL.
BF16_P_ATOL = 2**-9
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def reference(q, k, v, scale):
    """fp64 causal attention: q ``[n, Hq, D]`` at the last n of s positions, k/v ``[s, Hkv, D]``."""
    n, hq, _ = q.shape
    s, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(s - n, s)[:, None]
    scores = scores.masked_fill(torch.arange(s)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_case(seed, specs, hq, hkv, d, bs, dtype, layers=2):
    """A cache full of garbage with each request's context at shuffled blocks of one layer;
    returns what a forward call needs plus each request's full K/V."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + n) // bs) for c, n in specs)
    num_blocks = need + 1 + rng.randint(0, 8)
    cache = torch.randn(num_blocks, layers, 2, bs, hkv, d, generator=gen).to(dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    layer = rng.randrange(layers)
    tables, full_k, full_v = [], [], []
    for c, n in specs:
        table = [free.pop() for _ in range(-(-(c + n) // bs))]
        k = torch.randn(c + n, hkv, d, generator=gen).to(dtype)
        v = torch.randn(c + n, hkv, d, generator=gen).to(dtype)
        for p in range(c):
            cache[table[p // bs], layer, 0, p % bs] = k[p]
            cache[table[p // bs], layer, 1, p % bs] = v[p]
        tables.append(table)
        full_k.append(k)
        full_v.append(v)
    meta_args = dict(
        block_size=bs,
        query_lens=[n for _, n in specs],
        num_computed=[c for c, _ in specs],
        block_tables=tables,
    )
    t = sum(n for _, n in specs)
    q = (torch.randn(t, hq, d, generator=gen) * 2).to(dtype)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(full_k, specs, strict=True)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(full_v, specs, strict=True)])
    return cache, layer, meta_args, q, k_new, v_new, full_k, full_v


def run_both(case, scale):
    """(native output, torch output); each backend writes into its own copy of the cache,
    and both copies must end up equal."""
    cache, layer, meta_args, q, k, v, _, _ = case
    c_native, c_torch = cache.clone(), cache.clone()
    out_n = NativeAttentionBackend().forward(
        q, k, v, c_native[:, layer], AttentionMetadata.build(**meta_args), scale
    )
    out_t = TorchAttentionBackend().forward(
        q, k, v, c_torch[:, layer], AttentionMetadata.build(**meta_args), scale
    )
    assert torch.equal(c_native, c_torch)  # same slots written, nothing else touched
    return out_n, out_t


@st.composite
def batches(draw):
    """Decodes first (one query, context 0-300), then prefills: fresh, or chunks after a
    cached prefix; block sizes 1-32 (partial last blocks most of the time); GQA 1-8."""
    bs = draw(st.sampled_from([1, 2, 4, 16, 32]))
    hkv = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    d = draw(st.sampled_from([16, 48, 64, 96, 128]))
    decodes = draw(st.lists(st.integers(0, 300), max_size=5))
    prefills = draw(
        st.lists(
            st.tuples(st.one_of(st.just(0), st.integers(1, 200)), st.integers(2, 70)),
            max_size=3,
        )
    )
    specs = [(c, 1) for c in decodes] + prefills
    if not specs:
        specs = [(draw(st.integers(0, 40)), 1)]
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return specs, hkv * group, hkv, d, bs, dtype, draw(st.integers(0, 2**16))


@pytest.fixture(params=["avx512bf16", "avx512", "avx2", "baseline"])
def isa(request):
    """Each of the kernel's code paths in turn (a path the CPU lacks is skipped)."""
    from kvserve.engine.attention import _paged_attention as native

    before = native.build_info()["isa"]
    if native.set_isa(request.param) != request.param:
        native.set_isa(before)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    native.set_isa(before)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(batch=batches())
def test_kernel_matches_torch_and_fp64(isa, batch):
    specs, hq, hkv, d, bs, dtype, seed = batch
    case = make_case(seed, specs, hq, hkv, d, bs, dtype)
    scale = d**-0.5
    out_n, out_t = run_both(case, scale)
    assert out_n.dtype == dtype and out_n.shape == case[3].shape
    q, full_k, full_v = case[3], case[6], case[7]
    starts = [0]
    for _, n in specs:
        starts.append(starts[-1] + n)
    for i in range(len(specs)):
        a, b = starts[i], starts[i + 1]
        ref = reference(q[a:b], full_k[i], full_v[i], scale)
        if dtype == torch.float32:
            torch.testing.assert_close(out_n[a:b], out_t[a:b], **FP32_TOL)
            torch.testing.assert_close(out_n[a:b].double(), ref, **FP32_TOL)
        elif isa == "avx512bf16":
            atol = BF16_TOL["atol"] + BF16_P_ATOL * full_v[i].abs().max().item()
            torch.testing.assert_close(out_n[a:b].double(), ref, rtol=2**-8, atol=atol)
        else:
            torch.testing.assert_close(out_n[a:b].double(), ref, **BF16_TOL)


def test_threads_give_identical_results():
    """Work items are split across OpenMP threads; each is computed whole by one thread, so
    the result cannot depend on the thread count."""
    specs = [(500, 1), (37, 1), (130, 1), (0, 64), (200, 45)]
    case = make_case(3, specs, 12, 4, 64, 16, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = run_both(case, 0.125)
        torch.set_num_threads(2)
        two, _ = run_both(case, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_null_block_padding_and_poison_ignored():
    """Shorter decodes in a batch (padded tables) and blocks beyond seq_len are never read:
    NaNs there must not leak into the output."""
    bs, hkv, d = 4, 2, 64
    cache = torch.full((10, 1, 2, bs, hkv, d), float("nan"))
    k, v = torch.randn(6, hkv, d), torch.randn(6, hkv, d)
    for p in range(5):  # request 1's context, 5 tokens over blocks 7, 3
        cache[[7, 3][p // bs], 0, 0, p % bs] = k[p]
        cache[[7, 3][p // bs], 0, 1, p % bs] = v[p]
    cache[2, 0, :, :2] = torch.randn(2, 2, hkv, d)  # request 0's context: 2 tokens
    meta = AttentionMetadata.build(
        block_size=bs, query_lens=[1, 1], num_computed=[2, 5], block_tables=[[2], [7, 3]]
    )
    q = torch.randn(2, 4, d)
    k_new = torch.cat([torch.randn(1, hkv, d), k[5:]])
    v_new = torch.cat([torch.randn(1, hkv, d), v[5:]])
    out = NativeAttentionBackend().forward(q, k_new, v_new, cache[:, 0], meta, d**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out[1:].double(), reference(q[1:], k, v, d**-0.5), **FP32_TOL)


def test_bf16_poison_next_to_an_odd_context_ignored():
    """bf16 paths that read keys 16 at a time or pair tokens (avx512bf16) must not read the
    slot after a context's last token: NaNs there stay out of decodes and prefill tiles."""
    bs, hkv, g, d = 8, 2, 4, 64
    cache = torch.full((6, 1, 2, bs, hkv, d), float("nan"), dtype=torch.bfloat16)
    k, v = torch.randn(13, hkv, d).bfloat16(), torch.randn(13, hkv, d).bfloat16()
    for p in range(3):  # request 1's cached prefix: 3 tokens in block 4
        cache[4, 0, 0, p], cache[4, 0, 1, p] = k[p], v[p]
    kd, vd = torch.randn(5, hkv, d).bfloat16(), torch.randn(5, hkv, d).bfloat16()
    for p in range(4):  # request 0 (a decode): 4 cached tokens in block 2
        cache[2, 0, 0, p], cache[2, 0, 1, p] = kd[p], vd[p]
    meta = AttentionMetadata.build(
        block_size=bs, query_lens=[1, 10], num_computed=[4, 3], block_tables=[[2], [4, 1]]
    )
    q = torch.randn(11, hkv * g, d).bfloat16()
    k_new, v_new = torch.cat([kd[4:], k[3:]]), torch.cat([vd[4:], v[3:]])
    out = NativeAttentionBackend().forward(q, k_new, v_new, cache[:, 0], meta, d**-0.5)
    assert not out.isnan().any()
    for rows, kk, vv in ((slice(0, 1), kd, vd), (slice(1, 11), k, v)):
        atol = BF16_TOL["atol"] + BF16_P_ATOL * vv.abs().max().item()
        ref = reference(q[rows], kk, vv, d**-0.5)
        torch.testing.assert_close(out[rows].double(), ref, rtol=2**-8, atol=atol)


def test_bad_block_id_raises_instead_of_reading_out_of_bounds():
    cache = torch.zeros(4, 1, 2, 4, 2, 16)
    meta = AttentionMetadata.build(
        block_size=4, query_lens=[1], num_computed=[5], block_tables=[[1, 9]]
    )
    q, kv = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    with pytest.raises(IndexError, match="out of range"):
        NativeAttentionBackend().forward(q, kv, kv, cache[:, 0], meta, 0.25)


def test_unsupported_inputs_take_the_torch_path():
    """fp16 and a head dim that is not contiguous go to the fallback, same results."""
    case = make_case(5, [(20, 1), (9, 7)], 4, 2, 16, 4, torch.float16)
    out_n, out_t = run_both(case, 0.25)
    assert torch.equal(out_n, out_t)
    cache, layer, meta_args, q, k, v, _, _ = make_case(6, [(20, 1)], 4, 2, 16, 4, torch.float32)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # D is not the inner dim
    backend = NativeAttentionBackend()
    assert not backend.supports(q_strided, k, v, cache[:, layer])
    meta = AttentionMetadata.build(**meta_args)
    out = backend.forward(q_strided, k, v, cache.clone()[:, layer], meta, 0.25)
    meta = AttentionMetadata.build(**meta_args)
    ref = TorchAttentionBackend().forward(q_strided, k, v, cache[:, layer], meta, 0.25)
    assert torch.equal(out, ref)


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("KVSERVE_ATTENTION_BACKEND", raising=False)
    auto = get_attention_backend("cpu")
    assert isinstance(auto, NativeAttentionBackend if NATIVE_FAST else TorchAttentionBackend)
    assert isinstance(get_attention_backend("cpu", "torch"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("cuda"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="CPU only"):
        get_attention_backend("cuda", "native")
    with pytest.raises(ValueError, match="one of"):
        get_attention_backend("cpu", "flash")
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "torch")
    assert isinstance(get_attention_backend("cpu", "auto"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("cpu", "native"), NativeAttentionBackend)


@pytest.fixture(scope="module")
def hf_llama(tiny_model_dir):
    return str(tiny_model_dir), HFOracle(str(tiny_model_dir))


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_engine_matches_hf_on_each_backend(hf_llama, backend):
    """Greedy tokens equal transformers' with decodes batched, chunked prefills (budget 16)
    and prefix-cache hits (prefills after a cached prefix)."""
    d, hf = hf_llama
    llm = LLM(
        d, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=16, attention_backend=backend
    )
    assert llm.engine.runner.attn_backend.name == backend
    vocab = llm.engine.runner.model_config.vocab_size
    shared = _prompts(11, 1, 50, 50, vocab)[0]
    prompts = _prompts(12, 5, 1, 90, vocab) + [shared + [5, 6, 7], shared[:40] + [8]]
    outs = llm.generate(prompts[:5] + [shared], _greedy())
    outs += llm.generate(prompts[5:], _greedy())  # hits on `shared`'s cached blocks
    assert outs[-1].num_cached_tokens >= 32
    for p, o in zip(prompts[:5] + [shared] + prompts[5:], outs, strict=True):
        assert o.outputs[0].token_ids == hf.greedy(p)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_kernel_shares_torchs_openmp_runtime():
    """One libgomp in the process: the kernel's threads are torch's, so setting torch's thread
    count sizes both and the two never oversubscribe the cores with separate pools."""
    import kvserve.engine.attention._paged_attention  # noqa: F401

    maps = Path("/proc/self/maps").read_text().splitlines()
    gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) <= 1, gomp


def test_token_count_mismatch_raises():
    """The kernel reads as many K/V rows as the metadata has slots: a shorter k is refused."""
    cache = torch.zeros(4, 1, 2, 4, 2, 16)
    meta = AttentionMetadata.build(
        block_size=4, query_lens=[3], num_computed=[0], block_tables=[[1]]
    )
    q, kv = torch.randn(3, 2, 16), torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match="number of tokens"):
        NativeAttentionBackend().forward(q, kv, kv, cache[:, 0], meta, 0.25)


def test_auto_backend_uses_the_kernel_only_where_it_is_fast():
    """``auto`` keeps the torch backend for head dims without a fast path (here 48)."""
    backend = NativeAttentionBackend(fast_only=True)
    cache, layer, meta_args, q, k, v, _, _ = make_case(7, [(30, 1)], 4, 2, 48, 4, torch.float32)
    assert not backend.supports(q, k, v, cache[:, layer])
    cache, layer, meta_args, q, k, v, _, _ = make_case(7, [(30, 1)], 4, 2, 64, 4, torch.float32)
    assert backend.supports(q, k, v, cache[:, layer]) == NATIVE_FAST


def test_auto_on_avx2_leaves_prefill_steps_to_torch(monkeypatch):
    """On AVX2 ``auto`` runs the kernel for decode-only steps; a step with a prefill goes to
    the torch backend whole (its AVX2 prefill is slower than torch's)."""
    from kvserve.engine.attention import native_backend

    monkeypatch.setattr(native_backend, "ISA", "avx2")
    monkeypatch.setattr(native_backend, "FAST", True)
    case = make_case(8, [(40, 1), (30, 12)], 8, 2, 64, 16, torch.float32)
    cache, layer, meta_args, q, k, v, _, _ = case
    c_auto, c_torch = cache.clone(), cache.clone()
    out = NativeAttentionBackend(fast_only=True).forward(
        q, k, v, c_auto[:, layer], AttentionMetadata.build(**meta_args), 0.125
    )
    ref = TorchAttentionBackend().forward(
        q, k, v, c_torch[:, layer], AttentionMetadata.build(**meta_args), 0.125
    )
    assert torch.equal(out, ref) and torch.equal(c_auto, c_torch)
