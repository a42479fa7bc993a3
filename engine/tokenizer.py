"""Tokenization, incremental detokenization and chat templates for a model directory.

`tokenizer.json` is loaded with the `tokenizers` library (the builder writes a tokenizer class name
that transformers-free code cannot resolve, so we never go through it). Chat templates come from
`tokenizer_config.json`'s `chat_template`, rendered with jinja2 in a sandbox; a ChatML template
is the fallback.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen3.5's special tokens, which the small tokenizers trained here (the bundled model's, the
# benchmark models') reserve the same way.
QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                       "</tool_call>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def train_byte_level_bpe(texts, vocab_size: int) -> HFTokenizer:
    """A byte-level BPE tokenizer set up as Qwen's (no prefix space, byte-level decoding), trained
    on ``texts`` to at most ``vocab_size`` entries, ``QWEN_SPECIAL_TOKENS`` first."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=QWEN_SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character each byte is spelled with -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_of_char()
# str.translate: each alphabet character -> its byte's code point, and a character below 256 that
# is not in the alphabet -> U+FFFF, so that latin-1 refuses every piece with a character outside it
_TO_LATIN1 = {**{o: "\uffff" for o in range(256)}, **{ord(c): b for c, b in _BYTE_OF_CHAR.items()}}


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception naming no file
            raise ValueError(f"{path}: not a tokenizer the tokenizers library reads ({e})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template") or CHATML_TEMPLATE
        if isinstance(template, list):  # [{"name": ..., "template": ...}] form
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        env = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
        # as transformers renders templates: JSON as is (jinja's own tojson escapes <, >, & and ')
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        self._chat_template = env.from_string(template)
        self.renders_tools = "tools" in template
        self.renders_names = any(f in template for f in ("message.name", "message['name']", 'message["name"]'))
        self.vocab_size = self._tok.get_vocab_size()
        self._byte_level = type(self._tok.decoder).__name__ == "ByteLevel"
        self._added = set(self._tok.get_added_tokens_decoder())
        # an upper bound on the UTF-8 bytes one token stands for (4 per character of its longest
        # entry): a text longer than context x this cannot fit, whatever its tokens (a cheap check
        # before tokenizing a huge prompt)
        self.max_bytes_per_token = 4 * max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        self._decoding_bytes: list[bytes] | None = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_id(self, text: str) -> int | None:
        """The id of a token spelled ``text`` (an added token such as ``<tool_call>``), or None."""
        return self._tok.token_to_id(text)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, even when they are part of a character (logprobs'
        ``bytes``: a client joins them to rebuild it). A byte-level BPE entry maps its characters
        back to bytes (GPT-2's table, which the ``tokenizers`` library uses); an added token, or a
        tokenizer of another kind, is its decoded text's UTF-8."""
        piece = self._tok.id_to_token(token_id)
        if self._byte_level and piece is not None and token_id not in self._added:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:
                pass
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def decoding_bytes(self) -> list[bytes] | None:
        """For a tokenizer whose decoder is byte-level alone (Qwen's): each token id's bytes as
        decoding with special tokens skipped sees them (``b""`` for a special token), so that a
        sequence's text is its tokens' bytes joined and read as UTF-8, an invalid sequence as
        U+FFFD (what the ``tokenizers`` library's byte-level decoder does). None for any other
        decoder. Made once (0.8 s for a 250k vocabulary on this repo's 2-core host), then shared."""
        if not self._byte_level:
            return None
        if self._decoding_bytes is None:
            table = [b""] * self.vocab_size
            for piece, i in self._tok.get_vocab(with_added_tokens=True).items():
                if i >= self.vocab_size:
                    continue
                try:           # a byte-level entry: each character stands for one byte
                    table[i] = piece.translate(_TO_LATIN1).encode("latin-1")
                except UnicodeEncodeError:    # a character outside the byte alphabet: the text as it is
                    table[i] = piece.encode("utf-8")
            for i, added in self._tok.get_added_tokens_decoder().items():
                if added.special and i < self.vocab_size:
                    table[i] = b""
            self._decoding_bytes = table
        return self._decoding_bytes

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render OpenAI-style messages [{"role", "content", "tool_calls"?, "tool_call_id"?}] into the
        prompt text; ``tools`` (OpenAI's [{"type": "function", "function": {...}}]) only with a
        template that renders them (``renders_tools``), else ValueError."""
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), str):
                raise ValueError("each message needs a 'role' and a string 'content'")
        if tools and not self.renders_tools:
            raise ValueError("this model's chat template does not render tools")
        return self._chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          tools=tools or None)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, each update costing O(new tokens), not
    O(output length); text that ends in U+FFFD (a multi-byte character split across tokens, or
    an invalid byte sequence) is held back until a later token makes the text end otherwise,
    as tokenizers' ``DecodeStream`` does (special tokens skipped).

    A byte-level tokenizer (``Tokenizer.decoding_bytes``) decodes each step's tokens' bytes
    with Python's incremental UTF-8 decoder, most steps in one ASCII decode: ~2.3x faster on
    text than ``DecodeStream``'s call a token, and it runs for every request of every step
    (landing a K=2 step at C=16 on this repo's 2-core host: ~90 us less a step). Any other
    tokenizer goes through ``DecodeStream`` (Rust), fed each new token once.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._bytes = tokenizer.decoding_bytes()
        if self._bytes is None:
            self._stream = DecodeStream(skip_special_tokens=True)
        else:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = ""
        self.text = ""

    def add(self, new_token_ids) -> str:
        """Feed the tokens generated since the last call; the text they complete."""
        table = self._bytes
        if table is None:
            step, tok = self._stream.step, self._tokenizer._tok
            delta = ""
            for t in new_token_ids:
                piece = step(tok, t)
                if piece:
                    delta += piece
        else:
            n = len(table)         # (an id past the tokenizer's vocabulary, which a model's may pad: no text)
            pieces = [table[t] if t < n else b"" for t in new_token_ids]
            data = b"".join(pieces)
            pending = self._utf8.getstate
            if not self._held and data.isascii() and not pending()[0]:
                delta = data.decode("ascii")         # (most steps: every token's text goes out)
            else:
                # DecodeStream's rule, token by token: the text so far goes out when it grew and
                # does not end in U+FFFD, which its lossy decoding also puts for incomplete bytes
                decode, held, delta = self._utf8.decode, self._held, ""
                for piece in pieces:
                    held += decode(piece)
                    if held and not held.endswith("\ufffd") and not pending()[0]:
                        delta += held
                        held = ""
                self._held = held
        self.text += delta
        return delta
