"""Stop strings while streaming: what is streamed is exactly the final text.

Stops are drawn from the text the tiny model generates greedily, so they do occur (often
across several steps) or almost occur (a real prefix that never completes), which is where
streamed text used to run ahead of the final text.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16], [300, 301, 302]]
MAX_TOKENS = 48
_NO_EOS = {"ignore_eos": True}  # full-length texts to draw from


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def base_texts(llm) -> list[str]:
    """Each prompt's greedy text without stops (the source of the drawn stop strings)."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, **_NO_EOS))
    texts = [o.outputs[0].text for o in outs]
    assert all(len(t) > 40 for t in texts)
    return texts


def stream(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Every output of one request, stepping the engine until it finishes."""
    rid = engine.add_request(None, prompt, params)
    outs: list[RequestOutput] = []
    while not outs or not outs[-1].finished:
        outs += [o for o in engine.step() if o.request_id == rid]
    while engine.has_unfinished_requests():  # e.g. frees after a stop string
        engine.step()
    return outs


def check_stream(llm: LLM, outs: list[RequestOutput], params: SamplingParams) -> None:
    final = outs[-1].outputs[0]
    streamed = "".join(o.new_text for o in outs)
    assert streamed == final.text
    for o in outs:  # every intermediate state shows a prefix of the final text
        assert final.text.startswith(o.outputs[0].text)
    decoded = llm.get_tokenizer().decode(final.token_ids)
    if final.finish_reason == "length":
        # Finished by length: any held-back tail (a stop's prefix) is flushed.
        assert final.text == decoded
        assert not any(s in final.text for s in params.stop)
    else:
        assert final.finish_reason == "stop" and final.stop_reason in params.stop
        if params.include_stop_str_in_output:
            assert final.text.endswith(final.stop_reason)
            assert decoded.startswith(final.text)
        else:
            assert decoded.startswith(final.text + final.stop_reason)
            assert not any(s in final.text for s in params.stop)


@st.composite
def stop_case(draw, texts: list[str]):
    i = draw(st.integers(0, len(texts) - 1))
    text = texts[i]
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, len(text) - 2))
        length = draw(st.integers(2, 12))
        stop = text[pos : pos + length]
        if draw(st.booleans()):
            # A near miss: a real prefix that never completes (held back, then flushed).
            stop += draw(st.sampled_from(["\x00", "\u2603", "~~"]))
        stops.append(stop)
    params = SamplingParams(
        max_tokens=draw(st.integers(1, MAX_TOKENS)),
        temperature=0,
        stop=stops,
        include_stop_str_in_output=draw(st.booleans()),
        **_NO_EOS,
    )
    return PROMPTS[i], params


def test_streamed_text_equals_final_text_for_drawn_stop_strings(llm, base_texts):
    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        derandomize=True,
    )
    @given(stop_case(base_texts))
    def check(case):
        prompt, params = case
        assume(all(len(s) >= 2 for s in params.stop))
        check_stream(llm, stream(llm.engine, prompt, params), params)

    check()


def test_multi_token_stop_is_never_streamed_in_part(llm, base_texts):
    """The reported case: a stop string spanning several tokens, e.g. " sle" + " mid;"."""
    text = base_texts[0]
    stop = text[10:30]  # ~20 characters: several tokens of the tiny tokenizer
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=[stop], **_NO_EOS)
    outs = stream(llm.engine, PROMPTS[0], params)
    assert outs[-1].outputs[0].text == text[:10]
    assert "".join(o.new_text for o in outs) == text[:10]
    assert len(outs) > 3  # the stop arrived over several steps
    check_stream(llm, outs, params)


def test_length_finish_flushes_a_held_back_prefix(llm, base_texts):
    text = base_texts[1]
    stop = text[-3:] + "\x00"  # the text ends with a prefix of it: held back, then flushed
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=[stop], **_NO_EOS)
    outs = stream(llm.engine, PROMPTS[1], params)
    final = outs[-1].outputs[0]
    assert final.finish_reason == "length" and final.text == text
    assert "".join(o.new_text for o in outs) == text


def test_include_stop_str_in_output_streams_the_stop(llm, base_texts):
    text = base_texts[2]
    stop = text[8:20]
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0,
        stop=[stop],
        include_stop_str_in_output=True,
        **_NO_EOS,
    )
    outs = stream(llm.engine, PROMPTS[2], params)
    assert outs[-1].outputs[0].text == text[:20]
    assert "".join(o.new_text for o in outs) == text[:20]
