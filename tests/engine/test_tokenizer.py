"""Tokenizer, streaming detokenization and chat template of the bundled model."""
from __future__ import annotations

import random

import pytest

from mtpserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


def stream(tok, ids):
    d, deltas = IncrementalDetokenizer(tok), []
    for t in ids:
        deltas.append(d.add([t]))
    return deltas, d.text


def test_streamed_text_adds_up_to_the_decoded_text_with_multibyte_characters(tok):
    text = 'def naïve(s: str) -> str:\n    """Ünïcödé — ✓ 漢字 🙂."""\n    return s.strip()\n'
    ids = tok.encode(text)
    deltas, streamed = stream(tok, ids)
    assert streamed == "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas), "a split multi-byte character leaked as U+FFFD"


def test_streaming_random_token_sequences_matches_one_shot_decoding(tok):
    rnd = random.Random(0)
    for _ in range(200):
        ids = [rnd.randrange(tok.vocab_size) for _ in range(rnd.randrange(1, 60))]
        assert stream(tok, ids)[1] == tok.decode(ids).rstrip("\ufffd")


def test_chat_template_renders_chatml_with_a_generation_prompt(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
