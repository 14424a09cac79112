"""LLMEngine / LLM behaviour beyond greedy parity: validation, stops, aborts, sampling, events."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kv.events import AllBlocksCleared, BlockStored


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=8, enable_kv_cache_events=True)


def _idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.get_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], SamplingParams(), "empty"),
        ("", SamplingParams(), "empty"),
        ([1, 2, 10**9], SamplingParams(), "token ids"),
        ([1] * 5000, SamplingParams(), "context length"),
        ([1, 2, 3], SamplingParams(max_tokens=10**6), "exceeds"),
        ([1] * 1020, SamplingParams(max_tokens=2), "KV cache holds at most 1008"),  # 63 blocks
    ],
)
def test_bad_input_is_rejected_and_leaves_nothing(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request(None, prompt, params)
    _idle(llm)


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"top_p": 0}, {"n": 0}, {"temperature": -1}])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_text_prompt_and_finish_reasons(llm):
    out = llm.generate("Hello there, how are you?", SamplingParams(max_tokens=5, temperature=0))
    comp = out[0].outputs[0]
    assert len(comp.token_ids) <= 5
    assert comp.finish_reason in ("length", "stop")
    assert comp.text == llm.get_tokenizer().decode(
        [t for t in comp.token_ids if t != llm.engine.eos_token_id]
    )
    _idle(llm)


def test_stop_string_truncates_text(llm):
    base = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=16, temperature=0))[0]
    text = base.outputs[0].text
    if len(text) < 4:
        pytest.skip("model produced too little text for a stop string")
    stop = text[2:4]
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=16, temperature=0, stop=[stop]))
    comp = out[0].outputs[0]
    assert comp.finish_reason == "stop"
    assert comp.stop_reason == stop
    assert comp.text == text[: text.find(stop)]
    _idle(llm)


def test_shared_params_are_not_mutated(llm):
    sp = SamplingParams(max_tokens=None, temperature=0)  # None: fill each request's context
    eng = llm.engine
    eng.add_request("short", [40] * 30, sp)
    eng.add_request("long", [41] * 900, sp)  # fails if "short" completed the shared params
    assert sp.max_tokens is None
    eng.abort_request(["short", "long"])
    eng.step()
    _idle(llm)


def test_stop_token_ids(llm):
    base = llm.generate([[11, 12, 13]], SamplingParams(max_tokens=8, temperature=0))[0]
    toks = base.outputs[0].token_ids
    stop_tok = toks[3]
    out = llm.generate(
        [[11, 12, 13]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_tok])
    )[0].outputs[0]
    assert out.token_ids == toks[: toks.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_seeded_sampling_reproduces_and_n_fans_out(llm):
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=123, n=3)
    a = llm.generate([[20, 21, 22, 23]], sp)[0]
    b = llm.generate([[20, 21, 22, 23]], sp)[0]
    assert len(a.outputs) == 3
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    _idle(llm)


def test_logprobs(llm):
    out = llm.generate([[30, 31, 32]], SamplingParams(max_tokens=4, temperature=0, logprobs=3))
    comp = out[0].outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == 4
    for tok, lp in zip(comp.token_ids, comp.logprobs, strict=True):
        assert tok in lp  # greedy: the sampled token is the top-1
        assert max(lp.values()) == lp[tok] <= 0.0
    assert comp.cumulative_logprob == pytest.approx(
        sum(lp[t] for t, lp in zip(comp.token_ids, comp.logprobs, strict=True))
    )


def test_abort_frees_blocks(llm):
    eng = llm.engine
    eng.add_request("to-abort", list(range(3, 70)), SamplingParams(max_tokens=50))
    eng.step()
    assert llm.get_stats().kv_cache_usage > 0
    eng.abort_request(["to-abort"])
    assert llm.get_stats().kv_cache_usage == 0.0  # freed at once
    assert eng.step() == []  # the runner learns of the abort; nothing is output for it
    _idle(llm)


def test_kv_events_follow_the_pool(llm):
    llm.engine.take_kv_events()
    llm.generate([list(range(100, 140))], SamplingParams(max_tokens=2, temperature=0))
    events = llm.engine.take_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and all(e.medium == "GPU" and e.block_size == 16 for e in stored)
    assert stored[0].token_ids[:16] == list(range(100, 116))
    assert llm.reset_prefix_cache()
    assert isinstance(llm.engine.take_kv_events()[-1], AllBlocksCleared)
