"""The output processor on the bundled model's real tokenizer: streamed text and stop strings."""
from __future__ import annotations

import pytest

from mtpserve.engine.output import OutputProcessor
from mtpserve.engine.request import FinishReason, Request
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


def stream(tokenizer, text: str, stop: list[str], chunks: list[int]):
    """Feed ``text``'s tokens to a fresh request in chunks of the given sizes (then the rest);
    the events' text joined, and the finish reason of the last event."""
    out = OutputProcessor(tokenizer)
    req = Request("r", [1], SamplingParams(max_tokens=100, stop=stop))
    out.start(req)
    ids, shown, start = tokenizer.encode(text), [], 0
    for n in chunks + [len(tokenizer.encode(text))]:
        piece = ids[start:start + n]
        if not piece:
            break
        req.token_ids.extend(piece)
        event = out.process(req, piece, None)
        shown.append(event.text)
        start += n
        if event.finish_reason is not None:
            return "".join(shown), event.finish_reason
    return "".join(shown), None


def test_a_stop_string_at_the_very_start_ends_the_output_with_no_text(tokenizer):
    assert stream(tokenizer, "return x + 1", ["return"], [3]) == ("", FinishReason.STOP)


def test_a_stop_string_completed_across_two_steps_cuts_the_text_before_it(tokenizer):
    """"ZQXJ" is four one-character tokens: split it between two steps at every point."""
    text = "a = 1 ZQXJ b = 2"
    before = len(tokenizer.encode("a = 1 "))
    assert len(tokenizer.encode("ZQXJ")) == 4
    for first in range(before, before + 4):
        assert stream(tokenizer, text, ["ZQXJ"], [first]) == ("a = 1 ", FinishReason.STOP), first


def test_the_first_stop_string_in_a_step_wins(tokenizer):
    assert stream(tokenizer, "x = 1\ny = 1\nz = 2\n", ["= 1"], []) == ("x ", FinishReason.STOP)
    assert stream(tokenizer, "a = 1\nb = 2\nc = 3\n", ["c =", "b ="], []) == ("a = 1\n", FinishReason.STOP)


def test_text_that_may_start_a_stop_string_is_held_back_until_the_end(tokenizer):
    """The last len(stop) - 1 characters stay back while the request runs; the finish flushes them."""
    out = OutputProcessor(tokenizer)
    req = Request("r", [1], SamplingParams(max_tokens=100, stop=["xyz!"]))
    out.start(req)
    shown = ""
    for t in tokenizer.encode("abc xyz done"):
        req.token_ids.append(t)
        shown += out.process(req, [t], None).text
        full = req.detokenizer.text
        assert full.startswith(shown) and len(shown) == max(0, len(full) - 3), (shown, full)
    final = out.process(req, [], FinishReason.LENGTH)
    assert shown + final.text == "abc xyz done" and final.finish_reason is FinishReason.LENGTH
