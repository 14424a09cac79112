"""Through the real server: a streamed answer with multi-token stop strings is exactly the
non-streamed answer (no part of a stop string reaches the client)."""

from __future__ import annotations


def test_streamed_completion_with_stop_strings_equals_the_whole_answer(served):
    client = served.client()
    args = {"model": served.model, "max_tokens": 40, "temperature": 0}
    prompt = [21, 22, 23, 24, 25, 26]
    base = client.completions.create(prompt=prompt, **args).choices[0].text
    assert len(base) > 30
    cases = [
        [base[12:28]],  # completes over several tokens
        [base[12:28] + "\x00"],  # a prefix that never completes: held back, then flushed
        [base[20:24], base[6:30]],  # two overlapping stops
    ]
    for stop in cases:
        whole = client.completions.create(prompt=prompt, stop=stop, **args).choices[0].text
        chunks = client.completions.create(prompt=prompt, stop=stop, stream=True, **args)
        pieces = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(pieces) == whole, stop
    messages = [{"role": "user", "content": "tell me about the weather"}]
    base = client.chat.completions.create(messages=messages, **args).choices[0].message.content
    stop = [base[10:26]]
    whole = client.chat.completions.create(messages=messages, stop=stop, **args)
    stream = client.chat.completions.create(messages=messages, stop=stop, stream=True, **args)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content == base[:10]
    served.wait_idle()
