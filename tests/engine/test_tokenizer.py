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


def test_streamed_deltas_are_decodestreams_for_any_tokens_fed_in_any_groups(tok):
    """The byte-level detokenizer gives, update by update, the text the tokenizers library's own
    DecodeStream gives (special tokens skipped, split and invalid UTF-8 held back the same way),
    for random ids (many of them byte pieces of multi-byte characters, some special, some past
    the vocabulary) fed in groups of 1 to 4 as MTP steps emit them."""
    from tokenizers.decoders import DecodeStream

    assert tok.decoding_bytes() is not None, "the bundled tokenizer is byte-level: the fast path is tested"
    special = sorted(i for i, t in tok._tok.get_added_tokens_decoder().items() if t.special)
    multibyte = [i for i, b in enumerate(tok.decoding_bytes()) if b and max(b) >= 0x80]
    rnd = random.Random(1)
    for _ in range(300):
        pool = rnd.choice([multibyte, range(tok.vocab_size), special + multibyte])
        ids = [rnd.choice(pool) for _ in range(rnd.randrange(1, 40))]
        if rnd.random() < 0.2:
            ids.insert(rnd.randrange(len(ids)), tok.vocab_size + 3)
        ref, d, i = DecodeStream(skip_special_tokens=True), IncrementalDetokenizer(tok), 0
        while i < len(ids):
            group = ids[i:i + rnd.randint(1, 4)]
            i += len(group)
            want = "".join(piece for t in group if t < tok.vocab_size and (piece := ref.step(tok._tok, t)))
            assert d.add(group) == want, (ids, group)
        assert d.text == tok.decode([t for t in ids if t < tok.vocab_size]).rstrip("\ufffd")


def test_a_token_whose_bytes_end_inside_a_character_holds_its_text_as_decodestream_does(tmp_path):
    """Byte-level BPE merges bytes across characters: a token can be "A" and the first byte of
    "é". DecodeStream holds "A" back until the character is whole; so does the detokenizer."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.decoders import DecodeStream

    from mtpserve.engine.tokenizer import _BYTE_OF_CHAR

    char_of = {b: c for c, b in _BYTE_OF_CHAR.items()}
    vocab = {char_of[b]: b for b in range(256)}
    vocab["A" + char_of[0xC3]] = 256                    # b"A\xc3": "A" and the lead byte of "é" (c3 a9)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.decoder = decoders.ByteLevel()
    hf.add_tokens([AddedToken("<x\xady>", special=False)])    # U+00AD is no byte's character: its text as it is
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    assert tok.decoding_bytes()[256] == b"A\xc3"
    ids = [ord("x"), 256, 0xA9, ord("!"), 256, ord("y"), 257]   # x, A + lead, tail -> é, !, A + lead, y (lead invalid)
    ref, d = DecodeStream(skip_special_tokens=True), IncrementalDetokenizer(tok)
    for group in ([ids[0]], [ids[1]], ids[2:4], ids[4:]):
        assert d.add(group) == "".join(piece for t in group if (piece := ref.step(hf, t))), group
    assert d.text == "xAé!A\ufffdy<x\xady>"


def test_chat_template_renders_chatml_with_a_generation_prompt(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
