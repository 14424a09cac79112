"""Tokenizer wrapper, chat template and incremental detokenization."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world, the river runs!",
    "  leading spaces and\ttabs\nnew lines  ",
    "Zürich, Málaga, Kraków — 東京の朝はとても静かです。 서울 🙂🚀",
    "def add(a, b):\n    return a + b",
    "",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_matches_hf_tokenizer(tok, tiny_model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in TEXTS:
        assert tok.encode(text) == hf(text)["input_ids"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert tok.eos_token_id == hf.eos_token_id
    assert tok.vocab_size == len(hf)


def test_chat_template(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}],
        },
    ]
    text = tok.apply_chat_template(msgs)
    assert text == (
        "<|system|>\nBe brief.<|eot|>\n<|user|>\nHi!<|eot|>\n<|assistant|>\nHello.<|eot|>\n"
        "<|user|>\nTwo parts<|eot|>\n<|assistant|>\n"
    )
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith(
        "<|assistant|>\n"
    )
    ids = tok.encode(text)
    assert ids.count(tok.bos_token_id) == 1  # the template adds no BOS; encode does
    assert tok.eos_token_id in ids
    assert tok.decode(ids) == "\nBe brief.\n\nHi!\n\nHello.\n\nTwo parts\n\n"
    with pytest.raises(ValueError, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_missing_template_and_dir(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_incremental_matches_full_decode(tok, data):
    """Streaming random ids (byte tokens split multi-byte characters often) in random
    step sizes yields exactly the full decode once flushed."""
    vocab = tok.vocab_size
    prompt = data.draw(st.text(max_size=12))  # a valid-text prompt gives the first context
    out = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40))
    steps = data.draw(st.lists(st.integers(1, 4), min_size=len(out), max_size=len(out)))
    detok = IncrementalDetokenizer(tok, tok.encode(prompt))
    pieces, i = [], 0
    for s in steps:
        if i >= len(out):
            break
        pieces.append(detok.add_tokens(out[i : i + s]))
        i += s
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text == tok.decode(out)


def test_incremental_holds_partial_utf8(tok):
    text = "東京🙂"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    emitted = [detok.add_tokens([t]) for t in ids]
    assert "".join(emitted) == text
    assert all("\ufffd" not in e for e in emitted)
    assert len(ids) > 2 and emitted.count("") >= 1  # some tokens were partial characters
