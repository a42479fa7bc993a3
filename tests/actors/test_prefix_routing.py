"""Prefix-aware routing's plain parts: the router's digests of a prompt are the ones the replica's
prefix cache holds after serving it (HTTP bodies through the proxy's head, handle prompts), the
head is bounded and the body reaches the replica intact, and the router's memory of recent sends."""
from __future__ import annotations

import asyncio
import json

import pytest

from mtpserve.actors.prefix_routing import (
    HEAD_CHARS,
    SCOPE_KEY,
    PromptDigests,
    RecentPrefixes,
    block_size_of,
    deepest_match,
    index_set,
    matched_blocks,
    prompt_head,
)
from mtpserve.actors.proxy_middleware import MAX_HEAD_BODY_BYTES, PromptHeadMiddleware
from mtpserve.engine.config import CacheConfig, EngineConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.prefix_cache import ROUTED_PREFIX_TOKENS
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.tokenizer import Tokenizer

CODE = "".join(f"def step_{i}(state, value={i}):\n    return state.update(key_{i}=value * {i})\n\n"
               for i in range(60))           # ~4.6 KB: longer than a head keeps
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a symbol.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


def _replica_ids(tokenizer, body: dict, chat: bool) -> list[int]:
    """What the replica's routes compute from the body (ingress.completions / chat_completions)."""
    if not chat:
        prompt = body["prompt"]
        return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    tools = body.get("tools") if body.get("tool_choice") != "none" else None
    return tokenizer.encode(tokenizer.apply_chat_template(body["messages"], tools=tools))


BODIES = {
    "text": ({"prompt": CODE[:1500]}, False),
    "long text (cut)": ({"prompt": CODE}, False),
    "token ids": ({"prompt": list(range(3, 3 + 700))}, False),
    "chat": ({"messages": [{"role": "system", "content": "You write Python."},
                           {"role": "user", "content": CODE[:1200]}]}, True),
    "chat with tools": ({"messages": [{"role": "user", "content": CODE[:800]}], "tools": TOOLS}, True),
    "long chat (cut)": ({"messages": [{"role": "system", "content": "You write Python."},
                                      {"role": "user", "content": CODE},
                                      {"role": "user", "content": "and more"}]}, True),
}


@pytest.mark.parametrize("kv_block_size", [None, 64])
def test_the_routers_digests_are_what_the_replicas_cache_holds_after_serving_the_prompt(model_dir, tokenizer,
                                                                                       kv_block_size):
    """The export's block size, or the one the replicas are served with (``kv_block_size``: the
    router is told it, ``test_the_router_hashes_blocks_of_the_replicas_size``)."""
    engine = Engine(EngineConfig(str(model_dir), num_threads=2, cache=CacheConfig(num_blocks=1024, max_resident_requests=8,
                                                                                   kv_block_size=kv_block_size),
                                 spec=SpecConfig(draft_tokens=0)))
    digests = PromptDigests(tokenizer, kv_block_size or block_size_of(model_dir))
    bs = digests.block_size
    for i, (body, chat) in enumerate(BODIES.values()):
        engine.add_request(f"r{i}", _replica_ids(tokenizer, body, chat), SamplingParams(max_tokens=1, temperature=0))
    while engine.has_work:
        engine.step()
    engine.check_integrity()
    index = index_set(engine.prefix_cache.routing_index(4096))
    for name, (body, chat) in BODIES.items():
        ids = _replica_ids(tokenizer, body, chat)
        head = prompt_head(json.dumps(body).encode(), chat)
        got = digests.of_head(head)
        full = min(len(ids) // bs, ROUTED_PREFIX_TOKENS // bs)
        if head["cut"]:       # the head's last block is left out; the rest is exact
            assert full - 2 <= len(got) <= full, (name, len(got), full)
        else:
            assert len(got) == full, (name, len(got), full)
        assert got and deepest_match(got, index) == len(got), f"{name}: the replica's cache does not hold them"
    # a handle call's prompt (text or ids) hashes the same way
    text = BODIES["text"][0]["prompt"]
    assert digests.of_prompt(text) == digests.of_head(prompt_head(json.dumps({"prompt": text}).encode(), False))
    other = digests.of_prompt("class Unrelated:\n    pass\n" * 40)
    assert deepest_match(other, index) == 0


def test_the_router_hashes_blocks_of_the_replicas_size(model_dir):
    """The Serve app hands the router the engine's kv_block_size; its digests are then of blocks
    of that size (of the export's without it), or no prompt would ever match a replica's cache."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from mtpserve.actors.router import StateAffinityRouter
    from mtpserve.cluster.app import ServeOptions, build_app

    sizes = {}
    for kv_block_size in (None, 64):
        app = build_app(ServeOptions.from_flat(kv_block_size=kv_block_size))
        kwargs = app._bound_deployment._deployment_config.request_router_config.request_router_kwargs
        router = StateAffinityRouter(DeploymentID(name="d", app_name="a"), DeploymentHandleSource.UNKNOWN)
        router.initialize_state(**kwargs)
        router._loader.join(30)
        sizes[kv_block_size] = router._digests.block_size
    assert sizes == {None: block_size_of(model_dir), 64: 64}


def test_the_head_is_bounded_and_refuses_what_is_no_prompt():
    head = prompt_head(json.dumps({"prompt": "x" * 100_000}).encode(), False)
    assert len(head["prompt"]) == HEAD_CHARS and head["cut"]
    assert prompt_head(json.dumps({"prompt": list(range(5000))}).encode(), False)["prompt"] == \
        list(range(ROUTED_PREFIX_TOKENS))
    assert prompt_head(json.dumps({"prompt": ["first", "second"]}).encode(), False)["prompt"] == "first"
    chat = prompt_head(json.dumps({"messages": [{"role": "user", "content": "y" * 100_000},
                                                {"role": "user", "content": "z"}]}).encode(), True)
    assert len(chat["messages"]) == 1 and len(json.dumps(chat)) < 2 * HEAD_CHARS and chat["cut"]
    for bad in (b"not json", b"[1, 2]", json.dumps({"prompt": 3}).encode(), json.dumps({"messages": []}).encode()):
        assert prompt_head(bad, chat=b"messages" in bad) is None


def _run_middleware(path: str, body: bytes, declared: int | None = None):
    """The middleware over an app that records its scope and reads the whole body, as Serve's proxy does."""
    seen = {}

    async def app(scope, receive, send):
        chunks = []
        while True:
            m = await receive()
            chunks.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        seen["scope"], seen["body"] = scope, b"".join(chunks)

    parts = [body[i:i + 65536] for i in range(0, len(body), 65536)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body) if declared is None else declared).encode())]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(PromptHeadMiddleware(app)(scope, receive, None))
    return seen


def test_the_middleware_puts_the_head_in_the_scope_and_replays_the_body_byte_for_byte():
    body = json.dumps({"model": "m", "prompt": CODE * 20, "max_tokens": 4}).encode()    # several receive() chunks
    seen = _run_middleware("/v1/completions", body)
    assert seen["body"] == body
    assert seen["scope"][SCOPE_KEY]["prompt"] == CODE[:HEAD_CHARS]
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    seen = _run_middleware("/app/v1/chat/completions", chat)
    assert seen["body"] == chat and seen["scope"][SCOPE_KEY]["messages"] == [{"role": "user", "content": "hi"}]
    # other routes, oversized bodies and bodies that are no request pass untouched
    for path, payload, declared in (("/tokenize", body, None), ("/v1/completions", body, MAX_HEAD_BODY_BYTES + 1),
                                    ("/v1/completions", b"{broken", None)):
        seen = _run_middleware(path, payload, declared)
        assert seen["body"] == payload and SCOPE_KEY not in seen["scope"]


def test_recent_sends_remember_the_deepest_replica_per_prefix_and_expire():
    recent = RecentPrefixes(ttl_s=10.0, max_digests=100)
    a, b = [bytes([1, k]) for k in range(6)], [bytes([1, k]) for k in range(3)] + [bytes([2, k]) for k in range(3)]
    recent.remember(a, "r1", now=0.0)
    recent.remember(b, "r2", now=1.0)        # shares a's first 3 blocks, then diverges
    assert recent.matches(a, now=2.0) == {"r2": 3, "r1": 6}
    assert recent.matches(b, now=2.0) == {"r1": 3, "r2": 6}
    assert recent.matches(a, now=10.5) == {"r2": 3}, "r1's send is older than ttl_s"
    recent.remember(a, "r2", now=11.0)
    assert recent.matches(a, now=12.0) == {"r2": 6}
    recent.remember([bytes([3, k]) for k in range(120)], "r3", now=3.0)
    assert len(recent) == 100, "bounded"
    indexes = {"r1": frozenset(a[:4]), "r4": frozenset(b)}
    assert matched_blocks(a, indexes, RecentPrefixes(), now=0.0) == {"r1": 4, "r4": 3}
    assert matched_blocks(a, indexes, recent, now=2.0)["r1"] == 4, "the deeper of index and memory"


def test_a_cut_text_leaves_out_the_block_its_cut_may_have_changed(model_dir, tokenizer):
    """A head cut inside a word tokenizes differently at its end: its last block is left out, so
    every digest it gives is one of the whole prompt's."""
    digests = PromptDigests(tokenizer, block_size_of(model_dir))
    full = tokenizer.encode(CODE)
    whole = digests.of_prompt(CODE)
    cuts = [c for c in range(200, 1500) if len(ids := tokenizer.encode(CODE[:c])) % 16 == 0
            and ids[-1] != full[len(ids) - 1]]           # a cut whose last full block ends in a changed token
    assert cuts, "no cut of the text changes a block's last token: pick another text"
    for c in cuts[:5]:
        assert not set(digests.of_prompt(CODE[:c], cut=False)) <= set(whole), "the test's cut changes nothing"
        got = digests.of_prompt(CODE[:c], cut=True)
        assert got and got == whole[:len(got)]


def test_a_head_that_cannot_travel_in_the_scope_is_left_out():
    """A lone surrogate in the prompt (json allows it, UTF-8 does not: the proxy would fail the
    request with a 500 carrying it in the scope) or nesting too deep to parse: no head, the
    request goes on to the replica, which answers it with a 400."""
    assert prompt_head(b'{"prompt": "\\udc00x", "model": "m"}', chat=False) is None
    assert prompt_head(b'{"messages": [{"role": "user", "content": "\\udc00"}]}', chat=True) is None
    assert prompt_head(b"[" * 50_000 + b"]" * 50_000, chat=False) is None
    assert prompt_head(b'{"prompt": "ok"}', chat=False) == {"prompt": "ok", "cut": False}
