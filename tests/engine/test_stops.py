"""Stop token ids and EOS under MTP, on the real bundled model: a stop that lands inside an
accepted draft run ends the request there, with the same tokens as MTP off up to and including it.

A step emits its accepted drafts and then one token from the target; a stop anywhere in that run
must cut it. A request whose stop was not the last token of its step shows it in its stats: the
step's emitted tokens (counted before the cut) outnumber the tokens it was given.
"""
from __future__ import annotations

import pytest

from mtpserve.engine.request import FinishReason
from mtpserve.engine.sampler import SamplingParams

from test_engine import PROMPTS, make_engine
from test_engine import run_requests as generate

# ChatML requests of the kind the bundled model was trained on: it writes the function, then
# <|im_end|>, one of the model's EOS ids, after 22-60 tokens.
FUNCTIONS = [("getregentry", "encodings.cp1251"), ("decode", "encodings.utf_8"), ("truth", "operator"),
             ("isabs", "posixpath"), ("basename", "posixpath"), ("normcase", "posixpath"),
             ("splitext", "posixpath"), ("exists", "genericpath"), ("isdir", "genericpath"),
             ("getsize", "genericpath"), ("_get_sep", "posixpath"), ("escape", "html"),
             ("b64encode", "base64"), ("nlargest", "heapq"), ("cmp_to_key", "functools"),
             ("iskeyword", "keyword")]
CHAT_PROMPTS = [f"<|im_start|>user\nWrite the Python function `{f}` of the module `{m}`.<|im_end|>\n"
                f"<|im_start|>assistant\n" for f, m in FUNCTIONS]
# enough budget that every decoding request drafts its full K each step
BUDGET = 512


def cut_inside_a_step(request) -> bool:
    """The request's last step emitted tokens after its stop (the stop was an accepted draft)."""
    return request.stats.num_emitted_tokens > request.num_output_tokens


@pytest.fixture(scope="module")
def chat_reference(model_dir):
    """MTP off, greedy, past EOS: each chat prompt's tokens and the position of its first EOS."""
    engine = make_engine(model_dir, k=0, budget=BUDGET, max_rows=32, batch=32)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    tokens, _, _ = generate(engine, CHAT_PROMPTS, [params] * len(CHAT_PROMPTS))
    eos = set(engine.manifest.eos_token_ids)
    first_eos = {}
    for rid, out in tokens.items():
        first_eos[rid] = next(i for i, t in enumerate(out) if t in eos)
    return tokens, first_eos


@pytest.fixture(scope="module")
def plain_reference(model_dir):
    """MTP off, greedy, ignoring EOS: 64 tokens of each of PROMPTS."""
    engine = make_engine(model_dir, k=0, budget=BUDGET, max_rows=32, batch=32)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    tokens, _, _ = generate(engine, PROMPTS, [params] * len(PROMPTS))
    return tokens


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_eos_ends_the_request_where_mtp_off_reaches_it(model_dir, chat_reference, k):
    tokens_off, first_eos = chat_reference
    engine = make_engine(model_dir, k=k, budget=BUDGET, max_rows=32, batch=32)
    params = SamplingParams(temperature=0, max_tokens=80)
    tokens, reasons, requests = generate(engine, CHAT_PROMPTS, [params] * len(CHAT_PROMPTS))
    for rid, out in tokens.items():
        assert out == tokens_off[rid][:first_eos[rid] + 1], rid
        assert reasons[rid] == FinishReason.STOP, rid
    inside = [rid for rid, r in requests.items() if cut_inside_a_step(r)]
    print(f"K={k}: {len(inside)} of {len(tokens)} EOS inside an accepted draft run")
    assert len(inside) >= 5, f"K={k}: only {inside} hit EOS inside an accepted draft run"


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_a_stop_token_id_inside_an_accepted_draft_run_ends_the_request_there(model_dir, plain_reference, k):
    """Each request stops on a token it first emits in the middle of its output (EOS ignored)."""
    engine = make_engine(model_dir, k=k, budget=BUDGET, max_rows=32, batch=32)
    stop_at, params = {}, []
    for i in range(len(PROMPTS)):
        out = plain_reference[f"r{i}"]
        # the first token past the 8th that did not appear earlier in the output (a request
        # whose output only repeats itself gets none and runs to max_tokens)
        p = next((p for p in range(8, len(out)) if out[p] not in out[:p]), None)
        never = next(t for t in range(engine.manifest.vocab_size) if t not in out)
        if p is not None:
            stop_at[f"r{i}"] = p
        params.append(SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                                     stop_token_ids=[never] if p is None else [never, out[p]]))
    assert len(stop_at) >= len(PROMPTS) // 2
    tokens, reasons, requests = generate(engine, PROMPTS, params)
    for rid, out in tokens.items():
        if rid in stop_at:
            assert out == plain_reference[rid][:stop_at[rid] + 1], rid
            assert reasons[rid] == FinishReason.STOP, rid
        else:
            assert out == plain_reference[rid] and reasons[rid] == FinishReason.LENGTH, rid
    inside = [rid for rid, r in requests.items() if cut_inside_a_step(r)]
    print(f"K={k}: {len(inside)} of {len(stop_at)} stops inside an accepted draft run")
    assert len(inside) >= 5, f"K={k}: only {inside} stopped inside an accepted draft run"


def test_eos_ends_a_request_at_its_first_token(model_dir):
    """A prompt whose greedy continuation starts with EOS: one token, finish reason stop."""
    engine = make_engine(model_dir, k=2)
    eos = engine.manifest.eos_token_ids
    tokens, reasons, _ = generate(engine, ["if __name__ == '__main__':\n    main()\n"],
                                  [SamplingParams(temperature=0, max_tokens=16)])
    assert len(tokens["r0"]) == 1 and tokens["r0"][0] in eos and reasons["r0"] == FinishReason.STOP


@pytest.mark.parametrize("k", [2, 4])
def test_a_stop_string_inside_an_accepted_draft_run_ends_on_mtp_offs_last_token(model_dir, plain_reference, k):
    """Text, tokens and output counts (usage) of requests ending on a stop string are MTP off's,
    also where the token completing it came in the middle of a step's emitted run."""
    probe = make_engine(model_dir, k=0)
    stops = {}
    for i in range(len(PROMPTS)):
        text = probe.tokenizer.decode(plain_reference[f"r{i}"])
        stops[i] = text[len(text) // 3:len(text) // 3 + 3]        # found in the first third, or earlier
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, stop=[stops[i]]) for i in range(len(PROMPTS))]
    results = {}
    for kk in (0, k):
        engine = make_engine(model_dir, k=kk, budget=BUDGET, max_rows=32, batch=32)
        tokens, reasons, requests = generate(engine, PROMPTS, params)
        results[kk] = tokens, reasons, {rid: r.num_output_tokens for rid, r in requests.items()}, requests
    (t0, r0, n0, _), (tk, rk, nk, requests) = results[0], results[k]
    assert all(r == FinishReason.STOP for r in r0.values())
    assert tk == t0 and rk == r0 and nk == n0
    cut = [rid for rid, r in requests.items() if cut_inside_a_step(r)]
    print(f"K={k}: {len(cut)} of {len(tk)} stop strings completed inside an accepted draft run")
    assert len(cut) >= 5
