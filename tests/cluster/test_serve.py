"""`mtpserve serve` onto the session's Ray cluster, driven by the official openai client."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from serve_process import start_serve  # noqa: E402

from mtpserve.cluster.bench.grammar import COST_SCHEMAS  # noqa: E402
from mtpserve.engine.tokenizer import Tokenizer  # noqa: E402

APP, KEY = "cli", "test-key"
ORIGIN = "http://app.example"


def test_replicas_that_cannot_start_end_serve_with_the_reason_in_one_line(ray_cluster, model_dir, tmp_path):
    """What only a replica finds (here a tokenizer.json that does not parse: the checks before
    Ray read the model's graphs and config, not its tokenizer): serve says why in one line,
    exits 1 and leaves no application behind. (First in this module: the module's server below
    takes the route prefix / once it starts.)"""
    import shutil

    from ray import serve
    model = tmp_path / "broken-tokenizer"
    shutil.copytree(model_dir, model)
    (model / "tokenizer.json").write_text('{"broken": ')
    port = ray_cluster["url"].rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "mtpserve.cluster.serve", "--address", ray_cluster["address"],
                           "--port", port, "--model", str(model), "--app-name", "cannot-start", "--num-threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mtpserve: error:")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("mtpserve: error: the replicas could not start: ValueError: ")
    assert "tokenizer.json: not a tokenizer the tokenizers library reads" in errors[0], errors
    assert "cannot-start" not in serve.status().applications


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir):
    served = start_serve(ray_cluster, model_dir, APP, "--api-key", KEY, "--num-threads", "1",
                         "--shutdown-grace-s", "1", "--allowed-origins", ORIGIN)
    yield {"base": f"{ray_cluster['url']}/v1", "model": served.model, "proc": served.proc, "lines": served.lines,
           "reader": served.reader, "tokenizer": Tokenizer(model_dir)}
    served.stop()


def _client(server, key=KEY):
    return openai.OpenAI(base_url=server["base"], api_key=key, max_retries=0, timeout=120)


def test_completions_streamed_and_not_agree_and_usage_adds_up(server):
    client, model, prompt = _client(server), server["model"], "def add(a, b):"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(server["tokenizer"].encode(prompt))
    assert whole.usage.completion_tokens == 20
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 20
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    raw = requests.post(f"{server['base']}/completions", headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": model, "prompt": prompt, "max_tokens": 4, "stream": True}, timeout=60)
    assert [line for line in raw.text.split("\n") if line][-1] == "data: [DONE]"


def test_return_token_ids_gives_every_token_streamed_and_not(server):
    """vLLM's return_token_ids: the whole answer's ids decode to its text; streamed, every step's
    ids arrive in a chunk (also those whose text is held back) and add up to the same ids."""
    client, model, prompt = _client(server), server["model"], "def add(a, b):"
    tok = server["tokenizer"]
    args = dict(model=model, prompt=prompt, max_tokens=20, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**args).model_dump()["choices"][0]
    assert len(whole["token_ids"]) == 20 and tok.decode(whole["token_ids"]) == whole["text"]
    assert whole["prompt_token_ids"] == tok.encode(prompt)
    chunks = [c.model_dump() for c in client.completions.create(stream=True, **args)]
    streamed = [i for c in chunks for ch in c["choices"] for i in ch["token_ids"]]
    assert streamed == whole["token_ids"]
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks][:2] == [tok.encode(prompt), None]
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=4).model_dump()["choices"][0]
    assert "token_ids" not in plain


def test_chat_completions_async_streamed_and_not(server):
    client = openai.AsyncOpenAI(base_url=server["base"], api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A loop?"}]
    kwargs = dict(model=server["model"], messages=messages, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True}, extra_headers={"x-session-id": "chat-streamed-and-not"})

    async def both():
        whole = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        return whole, [c async for c in stream]
    whole, chunks = asyncio.run(both())
    tok = server["tokenizer"]
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(messages)))
    assert whole.usage.completion_tokens == 12
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    streamed = chunks[-1].usage
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (whole.usage.prompt_tokens, 12)
    # the same conversation again in its session: its prompt's full blocks come from the prefix cache
    n = whole.usage.prompt_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens in (0, (n - 1) // 16 * 16)
    assert streamed.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16


def test_stop_strings_are_honoured(server):
    client, model = _client(server), server["model"]
    full = client.completions.create(model=model, prompt="for i in", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) >= 8, f"need some text to cut: {full!r}"
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = full[:full.find(stop)]
    got = client.completions.create(model=model, prompt="for i in", max_tokens=30, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=model, prompt="for i in", max_tokens=30, temperature=0,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut
    kept = client.completions.create(model=model, prompt="for i in", max_tokens=30, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop


def test_min_tokens_holds_against_an_early_stop_id(server):
    client, model = _client(server), server["model"]
    free = client.completions.create(model=model, prompt="def f(x):", max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True}).model_dump()["choices"][0]["token_ids"]
    stop = free[1]
    early = client.completions.create(model=model, prompt="def f(x):", max_tokens=12, temperature=0,
                                      extra_body={"stop_token_ids": [stop]})
    held = client.completions.create(model=model, prompt="def f(x):", max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [stop], "min_tokens": 6, "return_token_ids": True})
    assert early.usage.completion_tokens == 2
    ids = held.model_dump()["choices"][0]["token_ids"]
    assert len(ids) >= 6 and stop not in ids[:6]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"min_tokens": 5})


def test_penalties_logit_bias_and_min_p_and_out_of_range_values_refused(server):
    client, model = _client(server), server["model"]
    args = dict(model=model, prompt="for i in range(10):\n", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**args).choices[0].text
    freq = client.completions.create(**args, frequency_penalty=1.5).choices[0].text
    rep = client.completions.create(**{**args, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.5}}).choices[0].text
    assert freq != plain and rep != plain
    forced = client.completions.create(model=model, prompt="x = ", max_tokens=4, temperature=0,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert forced.model_dump()["choices"][0]["token_ids"] == [42] * 4
    sampled = client.completions.create(model=model, prompt="x = ", max_tokens=4, temperature=1.0, seed=1,
                                        extra_body={"min_p": 0.3})
    assert sampled.usage.completion_tokens >= 1
    for bad in (dict(frequency_penalty=2.5), dict(presence_penalty=-3), dict(extra_body={"repetition_penalty": 0}),
                dict(logit_bias={"x": 1}), dict(logit_bias={"5": 101}), dict(extra_body={"min_p": 1.5}),
                dict(logit_bias={str(10**7): 1})):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt="x", max_tokens=2, **bad)


def test_n_choices_with_seeds(server):
    client, model = _client(server), server["model"]
    kwargs = dict(model=model, prompt="x = ", max_tokens=8, temperature=1.0, n=3, seed=7,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == len(server["tokenizer"].encode("x = "))
    assert len({c.text for c in first.choices}) > 1, "choice i uses seed + i"
    # a seed's sample does not depend on the drafts each step carried (the server drafts with
    # `auto`), so it repeats every time: alone, streamed, and among other requests

    def streamed_texts():
        by_index: dict[int, str] = {}
        for chunk in client.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                by_index[c.index] = by_index.get(c.index, "") + c.text
        return [by_index[i] for i in range(3)]
    texts = [c.text for c in first.choices]
    assert [c.text for c in client.completions.create(**kwargs).choices] == texts, "seeded choices repeat"
    assert streamed_texts() == texts, "streamed seeded choices repeat"
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        crowd = [pool.submit(client.completions.create, model=model, prompt=f"def f{i}(x):", max_tokens=24,
                             temperature=0.8, extra_body={"ignore_eos": True}) for i in range(5)]
        among = pool.submit(client.completions.create, **kwargs)
        assert [c.text for c in among.result().choices] == texts, "seeded choices repeat among other requests"
        assert all(f.result().usage.completion_tokens == 24 for f in crowd)


def test_errors_use_the_openai_envelope(server):
    client, model = _client(server), server["model"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    context = client.models.list().data[0].model_extra["max_model_len"]
    bad = [dict(temperature=-1), dict(top_p=2.0), dict(n=0), dict(max_tokens=0),
           dict(extra_body={"top_k": -5}), dict(logprobs=21), dict(prompt=[7] * context),
           dict(prompt=[10**7]), dict(prompt="x", stop=["a", "b", "c", "d", "e"]),
           dict(prompt=[5, True]), dict(n=True), dict(max_tokens="4"), dict(extra_body={"seed": "1"}),
           dict(prompt=["x"] * 1025)]
    for params in bad:
        kwargs = {"model": model, "prompt": "x", **params}
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**kwargs)
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").completions.create(model=model, prompt="x")
    r = requests.post(f"{server['base']}/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": model, "prompt": "x", "temperature": "hot"}, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] == "temperature"
    for raw in (b"", b"[1, 2]", b'{"model": 1', b"null"):      # no body, not an object, broken, null
        r = requests.post(f"{server['base']}/completions", data=raw, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        assert ".py" not in r.text and "Traceback" not in r.text, r.text
    for field in ("prompt", "model"):            # lone surrogates: JSON allows them, text does not
        raw = json.dumps({"model": model, "prompt": "x", "max_tokens": 1}).replace(
            f'"{field}": "', f'"{field}": "\\ud800', 1)
        r = requests.post(f"{server['base']}/completions", data=raw, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = requests.post(f"{server['base']}/completions", json={"model": model, "prompt": "x", "max_tokens": 1},
                      headers={"Authorization": f"Bearer {KEY}", "x-session-id": "s" * 8192}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-session-id"


def test_vllm_endpoints_and_an_optional_model(server):
    """/v1/models/{id}, /tokenize, /detokenize and /version in vLLM's shapes; a request may leave
    out `model` (one model is served)."""
    client, model, tok = _client(server), server["model"], server["tokenizer"]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
    root, auth = server["base"].rsplit("/v1", 1)[0], {"Authorization": f"Bearer {KEY}"}
    text = "def add(a, b):\n    return a + b"
    r = requests.post(f"{root}/tokenize", json={"prompt": text}, headers=auth, timeout=30).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    chat = requests.post(f"{root}/tokenize", json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                         headers=auth, timeout=30).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    back = requests.post(f"{root}/detokenize", json={"tokens": r["tokens"]}, headers=auth, timeout=30).json()
    assert back == {"prompt": text}
    bad = requests.post(f"{root}/detokenize", json={"tokens": [10**9]}, headers=auth, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert requests.get(f"{root}/version", timeout=30).json()["version"]
    r = requests.post(f"{server['base']}/completions", json={"prompt": "x = ", "max_tokens": 2}, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == model and r.json()["usage"]["completion_tokens"] == 2


def test_fields_the_server_does_not_honour_are_refused_and_max_tokens_is_not_cut(server):
    """An unknown or unsupported field is a 400 naming it (never silently ignored); an explicit
    null is a field not sent; prompt + max_tokens beyond the context is a 400, not a shorter answer."""
    client, model = _client(server), server["model"]
    for field, value in (("guided_decoding_backend", "xgrammar"),
                         ("functions", [{"name": "f"}]), ("top_a", 0.5), ("chat_template", "{{ x }}")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body={field: value})
        assert e.value.body["param"] == field and e.value.body["code"] == "unsupported_parameter", e.value.body
    ok = client.completions.create(model=model, prompt="x = ", max_tokens=2, extra_body={"suffix": None, "logit_bias": None})
    assert ok.usage.completion_tokens == 2
    context = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x = ", max_tokens=context)
    assert e.value.body["param"] == "max_tokens" and str(context) in e.value.body["message"]



def test_requests_an_api_audit_found_mishandled_are_400s_naming_the_field_before_any_stream(server):
    """A content part whose text is not a string (was a 500 without the envelope), a logit_bias
    id past the vocabulary (was a 200 stream ending in an error event, naming `prompt`), a
    stop_token_ids id past it (failed the replica's step, and so every request on it), a body
    that is not JSON (named a character offset as its param), a prompt longer than the context
    with max_tokens (named max_tokens); and chat logprobs' bytes of a character split over
    tokens (were U+FFFD's bytes)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    model, base = server["model"], server["base"]

    def post(route, body, **kw):
        return requests.post(f"{base}/{route}", headers=headers, json=body, timeout=60, **kw)
    chat = {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    r = post("chat/completions", {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].text", r.text
    vocab = server["tokenizer"].vocab_size
    for stream in (False, True):
        r = post("chat/completions", {**chat, "stream": stream, "logit_bias": {str(vocab): 5}}, stream=stream)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (stream, r.status_code, r.text)
        # an id past the vocabulary in the min_tokens mask failed the step: every request of the replica
        for ids in ([vocab + 5], [2**70]):
            r = post("chat/completions", {**chat, "stream": stream, "stop_token_ids": ids, "min_tokens": 1},
                     stream=stream)
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", (ids, r.text)
    assert post("chat/completions", chat).status_code == 200, "the replica still serves"
    r = requests.post(f"{base}/completions", data=b'{"prompt": "x", "max_tokens": 2,', timeout=30,
                      headers={**headers, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None and "JSON" in r.json()["error"]["message"], r.text
    context = requests.get(f"{base}/models", headers=headers, timeout=30).json()["data"][0]["max_model_len"]
    r = post("completions", {"model": model, "prompt": [7] * (context + 5), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = post("chat/completions", {**chat, "messages": [{"role": "user", "content": "Say e with an accent."}],
                                  "max_tokens": 8, "logprobs": True, "guided_choice": ["\u00e9t\u00e9"]})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert r.json()["choices"][0]["message"]["content"] == "\u00e9t\u00e9"
    joined = bytes(b for e in content for b in e["bytes"]).decode("utf-8", errors="strict")
    assert joined.startswith("\u00e9t\u00e9"), content

def test_cors_is_opt_in_and_answers_preflights_for_allowed_origins(server):
    root = server["base"].rsplit("/v1", 1)[0]
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = requests.options(f"{root}/v1/chat/completions", headers=preflight, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = requests.options(f"{root}/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = requests.get(f"{root}/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_logprobs_of_completions_and_chat_streamed_and_not(server):
    """Completions `logprobs=N` and chat `logprobs` / `top_logprobs`: one entry per output token,
    the greedy token the most likely of its alternatives, offsets adding up, and the streamed
    entries the same as the whole answer's (to float rounding: the two run in other batches)."""
    client, model = _client(server), server["model"]
    args = dict(model=model, prompt="def add(a, b):", max_tokens=12, temperature=0, logprobs=3,
                extra_body={"ignore_eos": True})
    lp = client.completions.create(**args).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and value <= 0 and abs(max(top.values()) - value) < 1e-5
        assert top.get(token) is not None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **args)
                if c.choices and c.choices[0].logprobs]
    assert [v for c in streamed for v in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset
    chat_args = dict(model=model, messages=[{"role": "user", "content": "Write a haiku."}], max_tokens=8,
                     temperature=0, logprobs=True, top_logprobs=2)
    content = client.chat.completions.create(**chat_args).choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == max(t.logprob for t in entry.top_logprobs)
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5 and entry.bytes == list(entry.token.encode())
    chunks = [c.choices[0].logprobs for c in client.chat.completions.create(stream=True, **chat_args)
              if c.choices and c.choices[0].logprobs]
    assert [e.logprob for c in chunks for e in c.content] == pytest.approx([e.logprob for e in content], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{**chat_args, "logprobs": False})
    assert e.value.body["param"] == "top_logprobs"
    plain = client.completions.create(model=model, prompt="x", max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_use_it(server):
    """completions echo + logprobs (lm-eval's loglikelihood request): the text starts with the
    prompt, the prompt's tokens are scored (the first has no logprob), and a prompt made of a
    prompt plus its greedy continuation scores that continuation as generation did."""
    client, model, tok = _client(server), server["model"], server["tokenizer"]
    prompt = "def add(a, b):"
    gen = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})
    whole = prompt + gen.choices[0].text
    n = len(tok.encode(prompt))
    echoed = client.completions.create(model=model, prompt=whole, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith(whole)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    count = len(tok.encode(whole))
    assert len(lp.token_logprobs) == count + 1
    assert lp.token_logprobs[n:count] == pytest.approx(gen.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = [c.choices[0] for c in client.completions.create(model=model, prompt=whole, max_tokens=1, temperature=0,
                                                                 logprobs=1, echo=True, stream=True) if c.choices]
    assert "".join(c.text for c in streamed) == echoed.choices[0].text
    assert [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs][1:] == pytest.approx(
        lp.token_logprobs[1:], abs=1e-4)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=2, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in plain if c.choices).startswith(prompt)


# Every request field of OpenAI's completions and chat APIs and vLLM's extensions, with a value a
# client would send. The server must honour a field (the README's table says how; the other tests
# assert the effects) or refuse it with a 400 naming it: a 200 for a field not listed as honoured
# is a field silently ignored.
HONOURED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
            "stop", "seed", "user", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "echo", "stop_token_ids", "ignore_eos",
            "min_tokens", "include_stop_str_in_output", "return_token_ids", "response_format", "guided_json",
            "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "tools", "tool_choice",
            "parallel_tool_calls"}
COMMON = dict(frequency_penalty=0.5, logit_bias={"5": 1.0}, max_tokens=2, n=2, presence_penalty=0.5, seed=3,
              stop=["\n\n"], stream=False, temperature=0.7, top_p=0.9, user="u1",
              top_k=5, min_p=0.05, repetition_penalty=1.1, length_penalty=1.0, stop_token_ids=[5], ignore_eos=True,
              min_tokens=1, skip_special_tokens=False, spaces_between_special_tokens=False, truncate_prompt_tokens=8,
              allowed_token_ids=[1, 2, 3], prompt_logprobs=1, add_special_tokens=True, guided_json={"type": "object"},
              guided_regex="a+", guided_choice=["a", "b"], guided_grammar="root ::= 'a'",
              guided_decoding_backend="xgrammar", guided_whitespace_pattern=" ", priority=1, logits_processors=["x"],
              return_tokens_as_token_ids=True, return_token_ids=True, bad_words=["x"], cache_salt="s",
              kv_transfer_params={}, vllm_xargs={}, structured_outputs={"regex": "a+"}, response_format={"type": "text"})
COMPLETION_ONLY = dict(best_of=2, echo=True, logprobs=1, suffix="x")
CHAT_ONLY = dict(audio={"voice": "alloy", "format": "wav"}, function_call="auto", functions=[{"name": "f"}],
                 logprobs=True, max_completion_tokens=2, metadata={"k": "v"}, modalities=["text"],
                 parallel_tool_calls=False, prediction={"type": "content", "content": "x"}, reasoning_effort="low",
                 service_tier="auto", store=False, tool_choice="none", tools=[{"type": "function", "function":
                                                                               {"name": "f", "parameters": {}}}],
                 top_logprobs=1, web_search_options={}, verbosity="low", prompt_cache_key="k", safety_identifier="s",
                 add_generation_prompt=True, continue_final_message=False, chat_template="{{ x }}",
                 chat_template_kwargs={}, documents=[], mm_processor_kwargs={}, echo=True)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_every_openai_and_vllm_request_field_is_honoured_or_refused_by_name(server, route):
    base = ({"prompt": "x = "} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    fields = {**COMMON, **(COMPLETION_ONLY if route == "completions" else CHAT_ONLY)}
    ignored = []
    for name, value in fields.items():
        extra = {"top_logprobs": 1} if name == "logprobs" and route != "completions" else {}
        body = {"model": server["model"], **base, "max_tokens": 2, name: value, **extra}
        r = requests.post(f"{server['base']}/{route}", json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        if r.status_code == 400:
            assert r.json()["error"]["param"] == name, (name, r.json())
        else:
            assert r.status_code == 200, (name, r.status_code, r.text[:300])
            if name not in HONOURED:
                ignored.append(name)
    assert ignored == [], f"answered 200 without honouring: {ignored}"


JSON_SCHEMAS = COST_SCHEMAS     # bounded: a small model's answers end
TOPICS = ["a user", "a point", "tags of a module", "a function call", "the os module", "a file", "a loop", "a class",
          "json", "a test"]


def chat_answer(client, args: dict, streamed: bool) -> tuple[str, str]:
    """(content, finish_reason) of a chat completion, streamed (deltas joined) or not."""
    if streamed:
        chunks = list(client.chat.completions.create(stream=True, **args))
        return ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                [c.choices[0].finish_reason for c in chunks if c.choices][-1])
    choice = client.chat.completions.create(**args).choices[0]
    return choice.message.content, choice.finish_reason


def test_json_schema_output_parses_and_validates_for_20_prompts(server):
    """response_format json_schema through the openai client, streamed and not, greedy and
    sampled: every answer is JSON that validates against its schema."""
    jsonschema = pytest.importorskip("jsonschema")
    client, model = _client(server), server["model"]
    for i in range(20):
        schema = JSON_SCHEMAS[i % len(JSON_SCHEMAS)]
        args = dict(model=model, messages=[{"role": "user", "content": f"Describe {TOPICS[i % 10]} as JSON."}],
                    max_tokens=160, temperature=0 if i % 2 else 1.2, seed=i,
                    response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        text, finish = chat_answer(client, args, streamed=i % 4 == 3)
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)
    obj = client.completions.create(model=model, prompt="x = ", max_tokens=80, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].text), dict)
    for extra in ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}):
        regex = client.completions.create(model=model, prompt="x = ", max_tokens=20, temperature=0,
                                          extra_body=extra).choices[0].text
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex), extra
    choice = client.completions.create(model=model, prompt="x = ", max_tokens=20, temperature=1.0, n=4,
                                       extra_body={"guided_choice": ["True", "False", "None"]})
    assert {c.text for c in choice.choices} <= {"True", "False", "None"}


def test_structured_output_that_cannot_be_met_is_a_400_naming_the_field(server):
    client, model = _client(server), server["model"]
    msgs = [{"role": "user", "content": "hi"}]
    for extra, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                                        {"type": "objec"}}}},
                          "response_format"),
                         ({"guided_json": {"type": "integer", "minimum": 5, "maximum": "x"}}, "guided_json"),
                         ({"guided_regex": "(ab"}, "guided_regex"), ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
                         ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                         ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
                         ({"response_format": {"type": "json_schema"}}, "response_format")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=msgs, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
    ok = client.chat.completions.create(model=model, messages=msgs, max_tokens=3, response_format={"type": "text"})
    assert ok.choices[0].finish_reason in ("stop", "length")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "b": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}


def test_parallel_tool_calls_is_accepted_and_false_answers_one_call(server):
    """Through the API with the openai client (the rule itself, and its break, in test_protocol:
    this tiny model makes one call either way)."""
    client, model = _client(server), server["model"]
    msgs = [{"role": "user", "content": "Weather in Paris and in Rome, and add 2 and 3."}]
    counts = {}
    for parallel in (True, False):
        for seed in range(4):
            choice = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, ADD], max_tokens=160,
                                                    tool_choice="required", temperature=1.0, seed=seed,
                                                    parallel_tool_calls=parallel).choices[0]
            assert choice.finish_reason == "tool_calls", choice
            counts.setdefault(parallel, []).append(len(choice.message.tool_calls))
    assert counts[False] == [1, 1, 1, 1]
    assert all(n >= 1 for n in counts[True])


def test_forced_tool_calls_have_arguments_that_validate_streamed_and_not(server):
    """tool_choice named or required: the call is forced by a grammar, parsed into
    message.tool_calls (streamed: delta.tool_calls) with finish_reason tool_calls (stop for a
    named choice, as OpenAI answers), and its arguments validate against the tool's schema; the
    result goes back as a tool message."""
    jsonschema = pytest.importorskip("jsonschema")
    client, model = _client(server), server["model"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    msgs = [{"role": "user", "content": "What is the weather in Paris? Then add 2 and 3."}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}},
                   {"type": "function", "function": {"name": "add"}}, "required"):
        for temperature in (0, 1.2):
            args = dict(model=model, messages=msgs, tools=[WEATHER, ADD], tool_choice=choice, max_tokens=120,
                        temperature=temperature, seed=7)
            reason = "stop" if isinstance(choice, dict) else "tool_calls"
            whole = client.chat.completions.create(**args).choices[0]
            assert whole.finish_reason == reason and whole.message.tool_calls, whole
            chunks = list(client.chat.completions.create(stream=True, **args))
            streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
            if temperature == 0:      # a seed repeats a sample only under the same draft counts and step cuts
                assert [(t.function.name, t.function.arguments) for t in streamed] == [
                    (t.function.name, t.function.arguments) for t in whole.message.tool_calls]
            for call in [*whole.message.tool_calls, *streamed]:
                if isinstance(choice, dict):
                    assert call.function.name == choice["function"]["name"]
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    call = whole.message.tool_calls[0]
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"result": 5}'}]
    answer = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER, ADD], max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.prompt_tokens > 100
    tok = server["tokenizer"]
    rendered = tok.apply_chat_template([*msgs, {"role": "tool", "content": '{"result": 5}'}], tools=[WEATHER])
    assert "<tools>\n" + json.dumps(WEATHER) in rendered and "<tool_response>\n{\"result\": 5}\n</tool_response>" in rendered
    none = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert none.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(msgs)))     # tools not offered
    for extra, param in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
                          "tool_choice"), ({"tool_choice": "required"}, "tool_choice"),
                         ({"tools": [WEATHER, WEATHER]}, "tools")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=msgs, max_tokens=4, **extra)
        assert e.value.body["param"] == param, (extra, e.value.body)


def test_auto_tool_choice_streams_content_until_a_call_starts(server):
    """With tools offered and no call made, the answer streams step by step (not held to the
    end) and adds up to the whole answer's content."""
    client, model = _client(server), server["model"]
    args = dict(model=model, messages=[{"role": "user", "content": "Write the Python function `main`."}],
                tools=[WEATHER, ADD], max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.message.tool_calls is None and whole.finish_reason == "length"
    chunks = [c.choices[0].delta.content for c in client.chat.completions.create(stream=True, **args)
              if c.choices and c.choices[0].delta.content]
    assert len(chunks) > 5 and "".join(chunks) == whole.message.content


def test_models_health_and_metrics(server):
    assert [m.id for m in _client(server).models.list().data] == [server["model"]]
    root = server["base"].rsplit("/v1", 1)[0]
    assert requests.get(f"{root}/health", timeout=30).json()["status"] == "ok"
    text = requests.get(f"{root}/metrics", timeout=30).text
    assert "mtpserve:request_success_total" in text and "mtpserve:spec_decode_num_drafts_total" in text


def test_ctrl_c_shuts_down_cleanly(server):
    from ray import serve

    from mtpserve.actors.planner import get_planner
    proc = server["proc"]
    # a long stream in flight: the drain is bounded by the replicas' grace (1 s here), not by the
    # stream's length nor Serve's own 20 s: it ends long before its 1900 tokens
    ended, chunks = threading.Event(), []

    def stream():
        with requests.post(f"{server['base']}/completions", stream=True, timeout=120,
                           headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": server["model"], "prompt": "for i in", "max_tokens": 1900,
                                 "ignore_eos": True, "stream": True}) as r:
            try:
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        chunks.append(line)
                        started.set()
            except requests.RequestException:
                pass
        ended.set()
    started = threading.Event()
    client = threading.Thread(target=stream, daemon=True)
    client.start()
    assert started.wait(60)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    assert ended.wait(30), "the in-flight stream never ended"
    finished = [c for c in chunks if any(ch.get("finish_reason") for ch in json.loads(c[6:]).get("choices", []))]
    assert time.monotonic() - t0 < 1 + 12 and not finished, (
        f"shutdown took {time.monotonic() - t0:.1f} s and let the stream run to its end ({len(chunks)} chunks)")
    server["reader"].join(10)
    rest = []
    while not server["lines"].empty():
        rest.append(server["lines"].get())
    assert "mtpserve: stopped\n" in rest
    assert APP not in serve.status().applications
    assert get_planner(APP) is None


def test_without_address_serve_starts_its_own_ray_even_when_RAY_ADDRESS_names_a_cluster(ray_cluster):
    """`mtpserve serve` without --address must never join (and on exit shut down Serve on) a
    cluster it did not start: RAY_ADDRESS and the machine's latest cluster are ignored."""
    import os
    code = ("import ray; from mtpserve.cluster import deploy; "
            "started = deploy.connect(quiet=True, num_cpus=1, proxy_middleware=False); "
            "print(started, ray.get_runtime_context().gcs_address); ray.shutdown()")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RAY_ADDRESS": ray_cluster["address"]},
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    started, gcs = out.stdout.split()[-2:]
    assert started == "True" and gcs != ray_cluster["address"]


def test_bench_direct_ingress_drives_the_replica_on_its_own_port(tmp_path):
    """`bench --replicas 0,1 --direct-ingress`: the in-process engine, then one replica driven on
    its own HTTP port (no proxy hop), every request answered, and what HTTP adds per load."""
    import json
    import os
    import socket

    from mtpserve.cluster.local_cluster import free_ports

    def pair_free(port: int) -> bool:        # the bench's proxy takes --port, the replica --port + 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return True
            except OSError:
                return False
    port = next(p for p in free_ports(16) if pair_free(p))
    out = subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", "bench", "--replicas", "0,1", "--direct-ingress",
                          "--concurrency", "1,4", "--num-prompts", "8", "--max-tokens", "8", "--draft-tokens", "2",
                          "--port", str(port), "--no-plot", "--results-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=240,
                         env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "direct ingress: replica" in out.stderr and f"http://127.0.0.1:{port + 1}" in out.stderr, out.stderr[-3000:]
    (path,) = tmp_path.glob("*.json")
    report = json.loads(path.read_text())
    served = [r for r in report["results"] if r["extra"].get("direct_ingress")]
    assert [r["label"] for r in served] == ["1 replica, direct ingress"] * 2
    assert all(r["num_completed"] == 8 and not r["num_failed"] for r in report["results"])
    assert [row["load"] for row in report["http_overhead"]] == ["C=1", "C=4"]
    assert all(row["ttft_p50_added_ms"] is not None for row in report["http_overhead"])


def test_direct_port_serves_each_replica_without_the_proxy_hop(ray_cluster, model_dir):
    """`--direct-port`: the replica answers on its own port too (Ray Serve's direct ingress), with
    the same greedy output as through the proxy; the flag is refused with --address."""
    import os

    from mtpserve.cluster.local_cluster import free_ports
    refused = subprocess.run([sys.executable, "-m", "mtpserve.cluster.serve", "--address", ray_cluster["address"],
                              "--direct-port", "31000"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--direct-port needs a Ray of our own" in refused.stderr
    ports = free_ports(2)      # clear of the OS's ephemeral ports: Serve moves a replica off a taken one
    proc = subprocess.Popen([sys.executable, "-m", "mtpserve.cluster.serve", "--model", str(model_dir),
                             "--port", str(ports[0]), "--direct-port", str(ports[1]), "--num-threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    try:
        lines, deadline = [], time.monotonic() + 240
        while not any("Ctrl-C to stop" in line for line in lines):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        direct = [line.split(": ", 1)[1].strip() for line in lines if "direct (replica" in line]
        assert direct == [f"http://127.0.0.1:{ports[1]}/v1"], "".join(lines)
        body = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}
        via_proxy = requests.post(f"http://127.0.0.1:{ports[0]}/v1/completions", json=body, timeout=60)
        via_replica = requests.post(f"{direct[0]}/completions", json=body, timeout=60)
        assert via_proxy.status_code == via_replica.status_code == 200, via_replica.text
        assert via_replica.json()["choices"][0]["text"] == via_proxy.json()["choices"][0]["text"]
        assert requests.get(f"http://127.0.0.1:{ports[1]}/health", timeout=10).status_code == 200
        bad = requests.post(f"{direct[0]}/completions", json={**body, "temperature": -1}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        assert proc.returncode == 0 and time.monotonic() - started < 30
    finally:
        if proc.poll() is None:
            proc.kill()
