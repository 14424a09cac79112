"""Sampler: greedy, seeded determinism, top-k / top-p masks, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.engine.sampler import Sampler, SamplingRow, apply_top_k_top_p
from kvserve.engine.sampling_params import SamplingParams


def rows(*params, ids=None, **kw):
    ids = ids or [f"r{i}" for i in range(len(params))]
    return [SamplingRow(rid, p, **kw) for rid, p in zip(ids, params, strict=True)]


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    toks, lps = Sampler()(logits, rows(*[SamplingParams(temperature=0)] * 3))
    assert toks == logits.argmax(-1).tolist()
    assert lps == [None, None, None]


def test_seeded_sampling_independent_of_batch():
    torch.manual_seed(0)
    target = torch.randn(1, 100)
    p = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_extra: int, other_seed: int | None) -> list[int]:
        s = Sampler(seed=other_seed or 0)
        out = []
        for _ in range(20):
            noise = torch.randn(batch_extra, 100)
            logits = torch.cat([noise, target])
            extra = [SamplingParams(temperature=0.7, seed=other_seed)] * batch_extra
            toks, _ = s(logits, rows(*extra, p, ids=[f"x{i}" for i in range(batch_extra)] + ["me"]))
            out.append(toks[-1])
        return out

    alone = run(0, None)
    assert alone == run(3, None) == run(5, 99)  # same tokens whatever shares the batch
    assert len(set(alone)) > 3  # and it is really sampling
    s = Sampler()
    other = [s(target, rows(SamplingParams(temperature=1.0, seed=4321)))[0][0] for _ in range(20)]
    assert other != alone


def test_drop_resets_generator():
    s = Sampler()
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=7)
    first = [s(logits, rows(p))[0][0] for _ in range(5)]
    s.drop({"r0"})
    assert [s(logits, rows(p))[0][0] for _ in range(5)] == first


def test_distribution_follows_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    s = Sampler(seed=3)
    counts = [0, 0, 0]
    n = 3000
    batch = torch.cat([logits] * n)
    toks, _ = s(batch, rows(*[SamplingParams(temperature=1.0)] * n))
    for t in toks:
        counts[t] += 1
    assert [round(c / n, 1) for c in counts] == [0.5, 0.3, 0.2]


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3]]))
    out = apply_top_k_top_p(logits, [2, 0], [1.0, 0.6])
    # Row 0: top-2 = tokens 1 and 3. Row 1: nucleus 0.6 = tokens 1 (0.4) then 3 (0.3).
    assert torch.isfinite(out).tolist() == [[False, True, False, True]] * 2
    # Row 1: top-3 renormalizes to 0.44, 0.33, 0.22; 0.77 < 0.8 keeps the third.
    out = apply_top_k_top_p(logits, [0, 3], [0.05, 0.8])
    assert torch.isfinite(out[0]).tolist() == [False, True, False, False]  # at least one
    assert torch.isfinite(out[1]).tolist() == [False, True, True, True]
    # Sampling never leaves the mask.
    s = Sampler()
    p = SamplingParams(temperature=2.0, top_k=2)
    toks, _ = s(torch.cat([logits[:1]] * 500), rows(*[p] * 500))
    assert set(toks) == {1, 3}


def test_logprobs_from_raw_logits():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]])
    raw = logits.log_softmax(-1)[0]
    p = SamplingParams(temperature=0.0, logprobs=2)
    toks, lps = Sampler()(logits, rows(p))
    assert toks == [4]
    chosen, top = lps[0]
    assert math.isclose(chosen, raw[4].item(), rel_tol=1e-6)
    assert set(top) == {4, 0}
    # Temperature does not change the reported logprobs; the sampled token is always included.
    p = SamplingParams(temperature=5.0, logprobs=0, seed=1)
    s = Sampler()
    for _ in range(10):
        toks, lps = s(logits, rows(p))
        assert lps[0][1] == {toks[0]: pytest.approx(raw[toks[0]].item())}


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0]])
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert Sampler()(logits, rows(p, num_output_tokens=0, eos_token_id=1))[0] == [3]
    assert Sampler()(logits, rows(p, num_output_tokens=2, eos_token_id=1))[0] == [1]
    p = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert Sampler()(logits, rows(p, num_output_tokens=0, eos_token_id=1))[0] == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_greedy_and_seeded_rows(dtype):
    """Greedy rows are argmax and seeded rows draw as they would alone, whatever the mix and
    the logits dtype."""
    torch.manual_seed(1)
    logits = torch.randn(4, 300).to(dtype)
    greedy = SamplingParams(temperature=0.0)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    mixed, _ = Sampler()(logits, rows(greedy, seeded, greedy, seeded))
    assert [mixed[0], mixed[2]] == logits[[0, 2]].float().argmax(-1).tolist()
    alone = [Sampler()(logits[i : i + 1], rows(seeded, ids=[f"r{i}"]))[0][0] for i in (1, 3)]
    assert [mixed[1], mixed[3]] == alone
    all_seeded, _ = Sampler()(logits, rows(*[seeded] * 4))
    assert [all_seeded[1], all_seeded[3]] == alone
