"""The output processor: a request's new tokens -> the text that is safe to stream, and stop strings.

Each request carries its own incremental detokenizer (``Request.detokenizer``). Text is streamed
as soon as no stop string can still be completed by later tokens: with stop strings, the last
``max(len(stop)) - 1`` characters are held back until they are known not to start one. A stop
string ends the request with its text cut just before the stop string (just after it with
``include_stop_str_in_output``), and its tokens cut after the one that completed it (a step
that emits several, under MTP, ends on the token plain decoding ends on).
"""

from __future__ import annotations

from mtpserve.engine.request import FinishReason, Request, TokenEvent
from mtpserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    """Detokenizes and applies stop strings; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        tokenizer.decoding_bytes()         # its table made at start, not on the first request

    def start(self, req: Request) -> None:
        """Give a new request its detokenizer."""
        req.detokenizer = IncrementalDetokenizer(self.tokenizer)

    def process(self, req: Request, new_token_ids: list[int], finish: FinishReason | None,
                logprobs: list | None = None) -> TokenEvent:
        """The event for tokens just appended to ``req`` (``finish``: a stop id or a limit hit);
        a stop string found in the new text finishes it too."""
        stop = req.params.stop
        detok = req.detokenizer
        if not stop:                  # all the text goes out as it comes
            text = detok.add(new_token_ids)
            req.num_emitted_text += len(text)
        else:
            # only text that the new tokens could have completed a stop string in
            start = max(0, len(detok.text) - max(map(len, stop)) + 1)
            if len(new_token_ids) > 1:
                new_token_ids, logprobs = self._until_stop_string(req, new_token_ids, logprobs, start)
            else:
                detok.add(new_token_ids)
            text_end = len(detok.text)
            hits = [(i, len(s)) for s in stop if (i := detok.text.find(s, start)) >= 0]
            if hits:
                hit, length = min(hits)
                finish = FinishReason.STOP
                text_end = hit + length if req.params.include_stop_str_in_output else hit
            elif finish is None:   # hold back what may be the start of a stop string
                text_end = max(req.num_emitted_text, text_end - max(map(len, stop)) + 1)
            text = detok.text[req.num_emitted_text:text_end]
            req.num_emitted_text = max(req.num_emitted_text, text_end)
        prompt = None
        if req.prompt_logprobs is not None:           # the prompt's entries go out once, with the first tokens
            prompt, req.prompt_logprobs = [req.prompt_logprobs[i] for i in sorted(req.prompt_logprobs)], None
        return TokenEvent(req.request_id, new_token_ids, text, finish, req.num_prompt_tokens, req.num_output_tokens,
                          req.num_cached_tokens, logprobs, prompt)

    @staticmethod
    def _until_stop_string(req: Request, new_token_ids: list[int], logprobs: list | None, start: int):
        """Several new tokens (a step's accepted drafts and its bonus token) fed one at a time
        until the text holds a stop string: the tokens after the one that completed it are
        dropped from the request and the event, so it ends on the token plain decoding ends on
        (and usage counts what it would)."""
        detok, stop = req.detokenizer, req.params.stop
        n = 0
        while n < len(new_token_ids):
            detok.add(new_token_ids[n:n + 1])
            n += 1
            if any(detok.text.find(s, start) >= 0 for s in stop):
                break
        dropped = len(new_token_ids) - n
        if dropped:
            del req.token_ids[-dropped:]
            new_token_ids = new_token_ids[:n]
            logprobs = logprobs[:n] if logprobs is not None else None
        return new_token_ids, logprobs
