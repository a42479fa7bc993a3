"""Prefix-aware routing's plain parts (no Ray): which blocks a request's prompt starts with, and
how many of them each replica holds.

    HTTP proxy  body --prompt_head--> scope[SCOPE_KEY]: the prompt's first part, as sent
    router      that head, or a handle call's prompt --PromptDigests--> chain digests of its
                first blocks (the model's own tokenizer and chat template, as the replica renders)
                + each replica's routing index (PlacementView.prefix_indexes, from its prefix
                cache) and RecentPrefixes (where this router sent a prefix lately)
                --matched_blocks--> {replica: leading blocks it holds} --> router.prefer_cached

The digests are the engine's own (``prefix_cache.chain_digests`` over the model's tokens, cut to
``ROUTING_DIGEST_BYTES``): a digest names its whole prefix, so the deepest of a prompt's digests
found in a replica's index is the longest prefix that replica has cached. A digest that comes
out differently (a truncated head whose last token would merge with the text after it, a chat
template that looks ahead) only costs a cache miss: routing never changes what a request
computes, only where.

A head is bounded (``HEAD_CHARS`` of text or ``ROUTED_PREFIX_TOKENS`` ids): routing looks at
the first ``ROUTED_PREFIX_TOKENS`` tokens only, the part a replica's index covers.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from pathlib import Path

from mtpserve.engine.prefix_cache import ROUTED_PREFIX_TOKENS, ROUTING_DIGEST_BYTES, chain_digests

SCOPE_KEY = "mtpserve.prompt_head"   # the ASGI scope key the proxy middleware puts the head under
HEAD_CHARS = 4 * ROUTED_PREFIX_TOKENS  # text kept of a prompt: ~ROUTED_PREFIX_TOKENS tokens or more
CUT_MARK = "\ue000mtpserve-cut\ue000"  # ends a chat message the head cut short (private-use characters)
DEFAULT_MAX_IMBALANCE = 4.0          # requests: how much busier a cache match may be than the least loaded


# ---------------------------------------------------------------------------- the proxy's part
def prompt_head(body: bytes | dict, chat: bool) -> dict | None:
    """``_prompt_head`` when the head can travel in the request's scope (valid UTF-8 text: a lone
    surrogate in the body would make the proxy fail the request with a 500), else None.
    ``body``: the request's bytes, or its JSON already parsed."""
    try:
        head = _prompt_head(body, chat)
        if head is not None:
            json.dumps(head, ensure_ascii=False).encode("utf-8")
        return head
    except (ValueError, TypeError, RecursionError):    # the replica answers such a body itself (400)
        return None


def _prompt_head(body: bytes | dict, chat: bool) -> dict | None:
    """What routing needs of a /v1/completions (``chat`` False) or /v1/chat/completions body:
    ``{"prompt": text or ids, "cut": bool}`` (a batch of prompts: the first) or ``{"messages":
    [...], "tools"?, "tool_choice"?, "cut": bool}`` (messages kept whole within HEAD_CHARS of
    content; the one crossing it cut and ended with CUT_MARK; later ones dropped). None for a
    body that is not such a request (the replica answers it with its own error)."""
    request = json.loads(body) if isinstance(body, (bytes, str)) else body   # (one that does not parse: None)
    if not isinstance(request, dict):
        return None
    if not chat:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]                         # a batch: routed by its first prompt
        if isinstance(prompt, str):
            return {"prompt": prompt[:HEAD_CHARS], "cut": len(prompt) > HEAD_CHARS}
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return {"prompt": prompt[:ROUTED_PREFIX_TOKENS], "cut": False}
        return None
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    head = {k: request[k] for k in ("tools", "tool_choice") if request.get(k) is not None}
    budget = HEAD_CHARS - (len(json.dumps(head)) if head else 0)
    kept, cut = [], False
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        size = len(content) if isinstance(content, str) else len(json.dumps(content))
        if size > budget:
            cut = True
            if isinstance(content, str) and budget > 0:
                kept.append({**m, "content": content[:budget] + CUT_MARK})
            break
        kept.append(m)
        budget -= size
    if not kept:
        return None
    return {**head, "messages": kept, "cut": cut}


# ---------------------------------------------------------------------------- the router's part
def block_size_of(model_dir: str | Path) -> int:
    """The export's KV block size (genai_config.json ``engine.dynamic_batching.block_size``)."""
    config = json.loads((Path(model_dir) / "genai_config.json").read_text())
    return int(config["engine"]["dynamic_batching"]["block_size"])


class PromptDigests:
    """A model's routing digests of prompts: its tokenizer and chat template, as its replicas use them."""

    def __init__(self, tokenizer, block_size: int):
        """tokenizer: ``engine.tokenizer.Tokenizer`` of the served model."""
        self.tokenizer, self.block_size = tokenizer, block_size
        self.max_blocks = ROUTED_PREFIX_TOKENS // block_size

    def of_prompt(self, prompt: str | list[int], cut: bool = False) -> list[bytes]:
        """The digests of a prompt's first full blocks; ``cut``: the text is the start of a longer
        one, so its last block (whose tokens may merge with the text after it) is left out."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if cut:
            ids = ids[:max(0, len(ids) - self.block_size)]
        ids = ids[:self.max_blocks * self.block_size]
        return [d[:ROUTING_DIGEST_BYTES] for d in chain_digests(ids, self.block_size, [])]

    def of_head(self, head: dict) -> list[bytes]:
        """The digests of a ``prompt_head``; [] when it does not render (the replica will refuse it)."""
        if "prompt" in head:
            return self.of_prompt(head["prompt"], bool(head.get("cut")))
        from mtpserve.actors.protocol import ChatCompletionRequest
        try:
            request = ChatCompletionRequest.model_validate(
                {k: head[k] for k in ("messages", "tools", "tool_choice") if k in head})
            text = self.tokenizer.apply_chat_template(request.messages_as_dicts(), tools=request.tools_to_render(),
                                                      add_generation_prompt=not head.get("cut"))
        except Exception:   # noqa: BLE001 - a bad request is the replica's to refuse, not the router's
            return []
        if head.get("cut"):
            end = text.find(CUT_MARK)
            text = text[:end] if end >= 0 else text
        return self.of_prompt(text, bool(head.get("cut")))


def index_set(index: bytes) -> frozenset[bytes]:
    """A replica's routing index (``PrefixCache.routing_index``) as a set of digests."""
    n = ROUTING_DIGEST_BYTES
    return frozenset(index[i:i + n] for i in range(0, len(index), n))


def deepest_match(digests: list[bytes], index: frozenset[bytes] | set[bytes]) -> int:
    """How many leading blocks of the prompt ``index`` holds: the deepest digest found (each names
    its whole prefix)."""
    for k in range(len(digests) - 1, -1, -1):
        if digests[k] in index:
            return k + 1
    return 0


def matched_blocks(digests: list[bytes], indexes: dict[str, frozenset[bytes]], recent: RecentPrefixes,
                   now: float) -> dict[str, int]:
    """{replica: leading blocks of the prompt it holds}, by its reported index or, fresher, where
    this router sent the same prefix lately (whichever is deeper); replicas with none left out."""
    matched = {rid: n for rid, index in indexes.items() if (n := deepest_match(digests, index))}
    for rid, n in recent.matches(digests, now).items():
        matched[rid] = max(matched.get(rid, 0), n)
    return matched


class RecentPrefixes:
    """Where this router sent each prefix lately (digest -> {replica: when}, for ``ttl_s``, at most
    ``max_digests`` digests): a burst of requests sharing a new prefix follows the first of them
    before any replica has reported caching it (its prefill may not even have started), and once
    the bound sent some elsewhere, both replicas count as holding it."""

    def __init__(self, ttl_s: float = 30.0, max_digests: int = 200_000):
        self.ttl_s, self.max_digests = ttl_s, max_digests
        self._sent: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sent)

    def remember(self, digests: list[bytes], replica_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for d in digests:
            sent = self._sent.pop(d, None) or {}
            sent[replica_id] = now
            self._sent[d] = {r: t for r, t in sent.items() if now - t <= self.ttl_s}
        while len(self._sent) > self.max_digests:
            self._sent.popitem(last=False)

    def matches(self, digests: list[bytes], now: float | None = None) -> dict[str, int]:
        """{replica: leading blocks of the prompt sent there within ttl_s}."""
        now = time.monotonic() if now is None else now
        out: dict[str, int] = {}
        for k, d in enumerate(digests):
            for replica_id, t in self._sent.get(d, {}).items():
                if now - t <= self.ttl_s:
                    out[replica_id] = k + 1
        return out
