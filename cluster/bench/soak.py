"""A soak of the serving edge: `mtpserve bench --replicas N --soak S`.

    mtpserve bench --replicas 2 --soak 300 --concurrency 32

Deploys N replicas (with an API key and a 1 MiB body limit, so hostile bodies stay cheap) and runs
C client threads for S seconds, each sending one request after another, at random:

    stream       streamed completion read to its end (finish_reason, then [DONE])
    drop         streamed completion closed by the client after a few chunks
    whole        non-streamed completion: 200 with exactly max_tokens tokens
    chat         non-streamed chat completion
    bad          a hostile or malformed request (no key, an oversized or broken body, wrong
                 types, a prompt over the context, an unknown path, a lone surrogate, n=0):
                 must be refused with a 4xx in the OpenAI envelope

Halfway (or --kill-replica-after S) the busiest replica's process is killed; Serve replaces it.
Every request ends in one outcome: ``ok``, ``dropped`` (by the client), ``refused`` (the 4xx a bad
request deserves), ``clear error`` (a request failed with an error in the envelope or an SSE
error event: the killed replica's; a bad request too, when it reached that replica before it
read the body: CI saw one such 503 in 830 requests), ``unclear`` (anything else: a 5xx without the envelope, a
wrong token count, a 4xx for a good request, a refusal without the envelope) or ``hung`` (no
answer within --timeout-s). Afterwards every replica must be idle with intact pools. The run
passes when nothing hung, nothing was unclear and the pools are clean.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections import Counter

from mtpserve.cluster import deploy
from mtpserve.cluster.bench.http_driver import SSE_END, sse_objects
from mtpserve.cluster.bench.replicas import APP_NAME, deployed, num_devices, parse_replicas, serve_options
from mtpserve.cluster.deploy import kill_replica, placement

API_KEY = "soak-key"
BODY_LIMIT = 1 << 20
KINDS = {"stream": 40, "drop": 20, "whole": 15, "chat": 10, "bad": 15}
ENVELOPE = {"message", "type", "param", "code"}


def _bad_requests(model: str, context: int) -> list[tuple[str, dict]]:
    """(name, requests.post keyword arguments) of each kind of bad request."""
    key = {"Authorization": f"Bearer {API_KEY}"}
    ok = {"model": model, "prompt": "x = ", "max_tokens": 2}
    raw = json.dumps(ok).replace('"prompt": "', '"prompt": "\\udc00', 1)
    return [
        ("no key", dict(json=ok)),
        ("wrong key", dict(json=ok, headers={"Authorization": "Bearer nope"})),
        ("oversized body", dict(data=b"{" * (BODY_LIMIT + 1), headers={**key, "Content-Type": "application/json"})),
        ("broken JSON", dict(data=b'{"model": ', headers={**key, "Content-Type": "application/json"})),
        ("wrong types", dict(json={**ok, "max_tokens": "4", "prompt": [1, True]}, headers=key)),
        ("prompt over the context", dict(json={**ok, "prompt": [7] * (context + 1)}, headers=key)),
        ("lone surrogate", dict(data=raw, headers={**key, "Content-Type": "application/json"})),
        ("n=0", dict(json={**ok, "n": 0}, headers=key)),
        ("unknown model", dict(json={**ok, "model": "nope"}, headers=key)),
    ]


class _Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.by_kind: Counter = Counter()
        self.statuses: Counter = Counter()
        self.messages: Counter = Counter()
        self.latencies: list[float] = []

    def add(self, kind: str, outcome: str, status: int | None, message: str | None, seconds: float) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.by_kind[(kind, outcome)] += 1
            if status is not None:
                self.statuses[status] += 1
            if message and outcome in ("clear error", "unclear", "hung"):
                self.messages[f"{outcome}: {message[:160]}"] += 1
            self.latencies.append(seconds)


def _enveloped(resp) -> bool:
    try:
        return set(resp.json()["error"]) == ENVELOPE
    except Exception:  # noqa: BLE001 - not JSON, not an object, no "error"
        return False


def _one(session, url: str, model: str, kind: str, rng: random.Random, bad: list, timeout_s: float):
    """Send one request of ``kind``; returns (outcome, status, message)."""
    import requests
    key = {"Authorization": f"Bearer {API_KEY}"}
    max_tokens = rng.randint(4, 40)
    prompt = rng.choice(["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self",
                         "for i in range(10):\n    ", "SELECT name FROM users WHERE"])
    try:
        if kind == "bad":
            name, kwargs = rng.choice(bad)
            r = session.post(f"{url}/v1/completions", timeout=timeout_s, **kwargs)
            if 400 <= r.status_code < 500 and _enveloped(r):
                return "refused", r.status_code, None
            if r.status_code >= 500 and _enveloped(r):   # sent to the killed replica before it read the body
                return "clear error", r.status_code, f"{name}: {r.json()['error']['message']}"
            return "unclear", r.status_code, f"{name}: {r.status_code} {r.text[:100]}"
        if kind == "chat":
            r = session.post(f"{url}/v1/chat/completions", timeout=timeout_s, headers=key, json={
                "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens})
            return _judged(r, None)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        if kind == "whole":
            return _judged(session.post(f"{url}/v1/completions", timeout=timeout_s, headers=key, json=body),
                           max_tokens)
        with session.post(f"{url}/v1/completions", timeout=timeout_s, headers=key, stream=True,
                          json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return _judged(r, None)
            finished = done = False
            num_chunks, stop_after = 0, rng.randint(1, 8) if kind == "drop" else None
            for obj in sse_objects(r.iter_lines()):
                if obj is SSE_END:
                    done = True
                    break
                if "error" in obj:
                    return "clear error", r.status_code, f"SSE error event: {obj['error'].get('message', '')}"
                finished = finished or any(c.get("finish_reason") for c in obj.get("choices", []))
                num_chunks += 1
                if stop_after is not None and num_chunks >= stop_after:
                    return "dropped", r.status_code, None
            if finished and done:
                return "ok", 200, None
            return "unclear", 200, f"the stream ended without {'[DONE]' if finished else 'a finish_reason'}"
    except requests.Timeout:
        return "hung", None, f"no answer within {timeout_s:g} s"
    except requests.RequestException as e:
        return "clear error", None, f"connection: {type(e).__name__}"


def _judged(r, max_tokens: int | None):
    """A good request's non-streamed answer."""
    if r.status_code == 200:
        got = r.json().get("usage", {}).get("completion_tokens")
        if max_tokens is None or got == max_tokens:
            return "ok", 200, None
        return "unclear", 200, f"{got} tokens for max_tokens {max_tokens}"
    if r.status_code >= 500 and _enveloped(r):
        return "clear error", r.status_code, r.json()["error"]["message"]
    return "unclear", r.status_code, r.text[:160]


def run_soak(args, log) -> dict:
    """The soak (see the module docstring); returns its figures."""
    import ray
    import requests

    from mtpserve.cluster.client import replica_statuses
    top = max(int(c) for c in str(args.concurrency or "32").split(","))
    with deploy.connected(args.address or None, quiet=True):
        num_replicas = max(parse_replicas(args.replicas, args.device, num_devices(ray, args.device)))
        options = serve_options(args, num_replicas, int(ray.cluster_resources().get("CPU", 1)))
        options = dataclasses.replace(options, worker=dataclasses.replace(
            options.worker, api_key=API_KEY, max_request_bytes=BODY_LIMIT))
        with deployed(options, args.port, log) as url:
            model = options.served_model_name
            context = requests.get(f"{url}/v1/models", timeout=30,
                                   headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["max_model_len"]
            bad = _bad_requests(model, context)
            tally, started = _Tally(), time.perf_counter()
            deadline = started + args.soak
            kinds, weights = list(KINDS), list(KINDS.values())

            def client(i: int) -> None:
                rng, session = random.Random(args.seed * 1000 + i), requests.Session()
                while time.perf_counter() < deadline:
                    kind = rng.choices(kinds, weights)[0]
                    t0 = time.perf_counter()
                    outcome, status, message = _one(session, url, model, kind, rng, bad, args.timeout_s)
                    tally.add(kind, outcome, status, message, time.perf_counter() - t0)

            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(top)]
            for t in threads:
                t.start()
            kill = {}
            if num_replicas >= 2:
                time.sleep(args.kill_replica_after if args.kill_replica_after is not None else args.soak / 2)
                view = placement(APP_NAME)
                victim = max(view.replicas, key=lambda rid: view.replicas[rid].num_running)
                kill = {"victim": victim, "how": kill_replica(APP_NAME, victim),
                        "at_s": round(time.perf_counter() - started, 1)}
                log(f"killed replica {victim} ({kill['how']}) {kill['at_s']} s in")
            for t in threads:
                t.join(args.soak + args.timeout_s + 60)
            still_running = sum(t.is_alive() for t in threads)
            log(f"soak over: {sum(tally.outcomes.values())} requests, {dict(tally.outcomes)}")
            statuses, wait_until = {}, time.monotonic() + 120
            while time.monotonic() < wait_until:       # the new replica up, every pool back to idle
                try:
                    statuses = replica_statuses(APP_NAME)
                except Exception:  # noqa: BLE001 - the planner's view is catching up
                    statuses = {}
                if len(statuses) == num_replicas and all(s["idle_and_empty"] for s in statuses.values()):
                    break
                time.sleep(1)
            health = requests.get(f"{url}/health", timeout=30).status_code
    lat = sorted(tally.latencies)
    figures = {
        "duration_s": args.soak, "concurrency": top, "num_replicas": num_replicas,
        "num_requests": sum(tally.outcomes.values()),
        "requests_per_s": round(sum(tally.outcomes.values()) / args.soak, 2),
        "outcomes": dict(tally.outcomes),
        "by_kind": {f"{k} {o}": n for (k, o), n in sorted(tally.by_kind.items())},
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "messages": dict(tally.messages.most_common(12)),
        "latency_s": {"p50": round(lat[len(lat) // 2], 3), "p99": round(lat[int(len(lat) * 0.99)], 3),
                      "max": round(lat[-1], 3)} if lat else None,
        "clients_still_running": still_running,
        "kill": kill, "health_after": health,
        "replicas_after": {rid: {k: s[k] for k in ("integrity", "idle_and_empty", "num_free_blocks",
                                                   "num_usable_blocks", "num_free_rows", "num_rows")}
                           for rid, s in statuses.items()},
    }
    figures["passed"] = soak_ok(figures)
    return figures


def soak_ok(f: dict) -> bool:
    replicas = f["replicas_after"]
    return (not f["outcomes"].get("hung") and not f["outcomes"].get("unclear") and not f["clients_still_running"]
            and f["health_after"] == 200 and len(replicas) == f["num_replicas"]
            and all(r["integrity"] == "ok" and r["idle_and_empty"] for r in replicas.values()))


def format_soak(f: dict) -> str:
    lines = [f"soak: {f['num_requests']} requests in {f['duration_s']:g} s ({f['requests_per_s']} req/s) from "
             f"{f['concurrency']} clients on {f['num_replicas']} replicas" +
             (f"; replica {f['kill']['victim']} killed at {f['kill']['at_s']} s" if f["kill"] else ""),
             "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(f["outcomes"].items())),
             "statuses: " + ", ".join(f"{k}: {v}" for k, v in f["statuses"].items())]
    lines += [f"  {n} x {m}" for m, n in f["messages"].items()]
    for rid, r in f["replicas_after"].items():
        lines.append(f"replica {rid}: integrity {r['integrity']}, idle {r['idle_and_empty']}, blocks "
                     f"{r['num_free_blocks']}/{r['num_usable_blocks']} free, rows {r['num_free_rows']}/{r['num_rows']} free")
    lines.append("PASSED" if f["passed"] else "FAILED: hung or unclear requests, or pools not clean (see above)")
    return "\n".join(lines)
