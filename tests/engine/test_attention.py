"""Paged attention (torch backend) vs dense causal attention on the same K/V."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.engine.attention import AttentionMetadata, TorchAttentionBackend


def dense_reference(q, k, v, scale):
    """q [n, Hq, D] at the last n of s positions; k/v [s, Hkv, D]; causal."""
    n, hq, _ = q.shape
    s, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    qpos = torch.arange(s - n, s)[:, None]
    scores = scores.masked_fill(torch.arange(s)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_mixed_batch_matches_dense(seed, heads):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    hq, hkv = heads
    d, bs, num_blocks, layers = 16, rng.choice([1, 4, 16]), 256, 2
    kv_cache = torch.randn(num_blocks, layers, 2, bs, hkv, d)  # garbage everywhere
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    # Some decodes, then prefills: fresh (no context) and chunked (with cached context).
    num_dec, num_pre = rng.randint(0, 4), rng.randint(0, 3)
    specs = [(rng.randint(1, 40), 1) for _ in range(num_dec)]
    specs += [(rng.choice([0, rng.randint(1, 30)]), rng.randint(2, 20)) for _ in range(num_pre)]
    if not specs:
        specs = [(5, 1)]
    layer = rng.randrange(layers)
    full_k, full_v, tables = [], [], []
    for computed, n in specs:
        s = computed + n
        table = [free.pop() for _ in range(-(-s // bs))]
        tables.append(table)
        k, v = torch.randn(s, hkv, d), torch.randn(s, hkv, d)
        full_k.append(k)
        full_v.append(v)
        for p in range(computed):  # the cached context
            kv_cache[table[p // bs], layer, 0, p % bs] = k[p]
            kv_cache[table[p // bs], layer, 1, p % bs] = v[p]
    meta = AttentionMetadata.build(
        block_size=bs,
        query_lens=[n for _, n in specs],
        num_computed=[c for c, _ in specs],
        block_tables=tables,
    )
    q = torch.randn(meta.num_tokens, hq, d)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(full_k, specs, strict=True)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(full_v, specs, strict=True)])
    scale = d**-0.5
    out = TorchAttentionBackend().forward(q, k_new, v_new, kv_cache[:, layer], meta, scale)
    for i, (computed, n) in enumerate(specs):
        a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        ref = dense_reference(q[a:b], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[a:b], ref, atol=1e-5, rtol=1e-5)
        # This step's K/V landed in the cache at the right slots.
        for p in range(computed, computed + n):
            blk = kv_cache[tables[i][p // bs], layer]
            assert torch.equal(blk[0, p % bs], full_k[i][p])
            assert torch.equal(blk[1, p % bs], full_v[i][p])


def test_null_block_padding_is_masked():
    """A short decode padded with block 0 must ignore whatever block 0 holds."""
    bs, hkv, d = 4, 2, 8
    kv_cache = torch.zeros(8, 1, 2, bs, hkv, d)
    kv_cache[0] = 1e4  # poison the null block
    k, v = torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    kv_cache[5, 0, 0, :2], kv_cache[5, 0, 1, :2] = k[:2], v[:2]
    kv_cache[2, 0, 0, :4] = torch.randn(4, hkv, d)
    meta = AttentionMetadata.build(
        block_size=bs, query_lens=[1, 1], num_computed=[2, 6], block_tables=[[5], [2, 3]]
    )
    q = torch.randn(2, 4, d)
    k_new = torch.cat([k[2:], torch.randn(1, hkv, d)])
    v_new = torch.cat([v[2:], torch.randn(1, hkv, d)])
    out = TorchAttentionBackend().forward(q, k_new, v_new, kv_cache[:, 0], meta, d**-0.5)
    torch.testing.assert_close(out[:1], dense_reference(q[:1], k, v, d**-0.5))
    assert out.abs().max() < 100


def test_bad_metadata_rejected():
    with pytest.raises(ValueError, match="too short"):
        AttentionMetadata.build(block_size=4, query_lens=[5], num_computed=[0], block_tables=[[1]])
    with pytest.raises(ValueError, match="decodes"):
        AttentionMetadata.build(
            block_size=4, query_lens=[3, 1], num_computed=[0, 0], block_tables=[[1], [2]]
        )


def _fill(kv_cache, layer, table, bs, k, v):
    for p in range(k.shape[0]):
        kv_cache[table[p // bs], layer, 0, p % bs] = k[p]
        kv_cache[table[p // bs], layer, 1, p % bs] = v[p]


@pytest.mark.parametrize("lens", [[9, 9, 9], [16, 16], [5, 12, 3]])
def test_decode_batches_reuse_workspace(lens):
    """Equal lengths (no mask), full last blocks, ragged lengths; one backend reused for
    batches of different shapes (its gather workspace is recycled) and for a mixed step whose
    prefill gathers after the decodes did."""
    torch.manual_seed(len(lens))
    bs, hq, hkv, d, layers = 4, 6, 2, 8, 3
    kv_cache = torch.randn(64, layers, 2, bs, hkv, d)
    backend = TorchAttentionBackend()
    free = list(range(63, 0, -1))
    for layer in (2, 0):
        specs = [(n - 1, 1) for n in lens] + [(6, 5)]  # decodes, then a chunk with context
        tables, fk, fv = [], [], []
        for c, n in specs:
            table = [free.pop() for _ in range(-(-(c + n) // bs))]
            k, v = torch.randn(c + n, hkv, d), torch.randn(c + n, hkv, d)
            _fill(kv_cache, layer, table, bs, k[:c], v[:c])
            tables.append(table)
            fk.append(k)
            fv.append(v)
        for batch in (specs[:-1], specs):
            meta = AttentionMetadata.build(
                block_size=bs,
                query_lens=[n for _, n in batch],
                num_computed=[c for c, _ in batch],
                block_tables=tables[: len(batch)],
            )
            assert (meta.decode_mask is None) == (len(set(lens)) == 1)
            q = torch.randn(meta.num_tokens, hq, d)
            k_new = torch.cat([k[c:] for k, (c, _) in zip(fk, batch, strict=False)])
            v_new = torch.cat([v[c:] for v, (c, _) in zip(fv, batch, strict=False)])
            out = backend.forward(q, k_new, v_new, kv_cache[:, layer], meta, d**-0.5)
            for i in range(len(batch)):
                a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
                ref = dense_reference(q[a:b], fk[i], fv[i], d**-0.5)
                torch.testing.assert_close(out[a:b], ref, atol=1e-5, rtol=1e-5)


def test_write_kv_into_unusual_view():
    """A layer view whose slots are not rows of [H_kv, D] takes the element-wise path."""
    bs, hkv, d = 4, 2, 8
    base = torch.zeros(6, 2, bs, d, hkv)  # heads last: [H_kv, D] is not contiguous
    kv_layer = base.transpose(-1, -2)
    meta = AttentionMetadata.build(
        block_size=bs, query_lens=[3], num_computed=[0], block_tables=[[3]]
    )
    k, v = torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    TorchAttentionBackend.write_kv(k, v, kv_layer, meta)
    assert torch.equal(kv_layer[3, 0, :3], k) and torch.equal(kv_layer[3, 1, :3], v)
    assert kv_layer[:3].abs().sum() == 0 and kv_layer[3, :, 3].abs().sum() == 0
