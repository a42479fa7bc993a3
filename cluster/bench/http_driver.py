"""The HTTP side of `mtpserve bench`: streaming completions against any OpenAI-compatible server.

Each request is POST /v1/completions with stream=true and stream_options.include_usage; the
Server-Sent Events are `data: {json}` lines ending with `data: [DONE]`. A chunk's time is when
its line arrived. The wire format does not say how many tokens a chunk holds, so ITL is per
streamed chunk and TPOT uses the final chunk's usage.completion_tokens (or the chunk count when
the server sends no usage). Speculative counters come from the server's Prometheus /metrics
(vLLM-style names `*spec_decode_num_drafts_total`, ...), when it has them.

The client is Python too, and at tens of thousands of chunks a second one process is busy
enough to add its own delay to what it measures: each run records the client's CPU share of
the run's wall time (``client_cpu_share``; near 1.0 per process, the client sets the figures),
and ``client_processes`` splits a load over several processes (request i to process i mod P,
each keeping its share of the concurrency in flight; their clocks are the same monotonic one).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, replace

from mtpserve.cluster.bench.report import LoadRun, RequestRecord
from mtpserve.cluster.bench.workload import Load, Workload

REPLICA_HEADER = "x-mtpserve-replica"     # which replica answered (mtpserve's own servers)
METRICS_SETTLE_S = 1.0    # before a run's closing /metrics scrape: processes that push their counters
                          # (mtpserve's API servers, every 0.5 s) have then pushed the run's last ones


@dataclass(frozen=True)
class HttpTarget:
    url: str                     # base URL, e.g. http://127.0.0.1:8000
    model: str | None = None     # the served model's name; None = the first of GET /v1/models
    api_key: str | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = True      # a vLLM-style extension field; off for servers that refuse it
    timeout_s: float = 600.0
    num_warmup_requests: int = 4
    return_token_ids: bool = True  # vLLM's field: tokens timed as they come, even while their text is
                                   # held back (incomplete UTF-8); off for servers that refuse it
    client_processes: int = 1      # processes a load's requests are split over (see the module docstring)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def run_http_loads(target: HttpTarget, loads: list[tuple[Load, Workload]], log=print,
                   after_run=None) -> list[LoadRun]:
    """Each (load, workload) in turn: closed loop at load.concurrency, or open loop at the
    workload's arrival times (load.request_rate). ``after_run(run)``, when given, is called (on a
    thread of its own) after each run, before the next starts, and with None after the warm-up."""
    return asyncio.run(_run_all(target, loads, log, after_run))


async def _run_all(target: HttpTarget, loads, log, after_run=None) -> list[LoadRun]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                     headers=target.headers) as session:
        model = target.model or await _first_model(session, target.url)
        if target.num_warmup_requests and loads:
            wl = loads[0][1]
            n = min(target.num_warmup_requests, wl.num_requests)
            warm = wl.warmup(n)
            await _run_load(session, target, model, warm, Load(concurrency=n), max_tokens=min(16, target.max_tokens))
        if after_run is not None:
            await asyncio.to_thread(after_run, None)
        runs = []
        for load, wl in loads:
            before = await _scrape_metrics(session, target.url)
            run = await _run_load(session, target, model, wl, load)
            await asyncio.sleep(METRICS_SETTLE_S)
            after = await _scrape_metrics(session, target.url)
            run.spec = _spec_delta(before, after)
            server = _server_delta(before, after)
            if server:
                run.extra["server"] = server
                if {"ttft_ms", "queue_ms", "prefill_ms"} <= server.keys():
                    t, q, p = (server[k]["mean"] for k in ("ttft_ms", "queue_ms", "prefill_ms"))
                    log(f"http {run.load_label}: the server's mean TTFT {t:.2f} ms = queued {q:.2f} + prefill "
                        f"{p:.2f} + serving {t - q - p:.2f}; {server.get('num_steps', 0)} engine steps, "
                        f"{server.get('num_overlapped_steps', 0)} overlapped")
            run.extra["model"] = model
            decided = (after or {}).get("router_decisions")
            if decided:     # as counted by the planner so far (routers report every 0.25 s)
                old = (before or {}).get("router_decisions") or {}
                run.extra["router_decisions"] = {k: int(v - old.get(k, 0)) for k, v in decided.items()}
            if after_run is not None:
                await asyncio.to_thread(after_run, run)
            log(f"http {run.load_label}: {sum(r.num_output_tokens for r in run.records)} tokens "
                f"in {run.duration_s:.2f} s, client CPU {100 * run.extra['client_cpu_share']:.0f}% of the wall time "
                f"x {run.extra['client_processes']} process(es)" + (f" — {run.error}" if run.error else ""))
            runs.append(run)
        return runs


async def _first_model(session, url: str) -> str:
    async with session.get(f"{url}/v1/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {url}/v1/models answered {resp.status}; pass --served-model NAME")
        data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model; pass --served-model NAME")
    return data[0]["id"]


async def _run_load(session, target: HttpTarget, model: str, workload: Workload, load: Load,
                    max_tokens: int | None = None) -> LoadRun:
    n = workload.num_requests
    t0, cpu0 = time.perf_counter(), time.process_time()
    if target.client_processes > 1 and max_tokens is None and (load.concurrency or 2) > 1:
        records, cpu, t0 = await asyncio.to_thread(_run_in_processes, target, model, workload, load)
    else:
        records = await _run_requests(session, target, model, workload, load, range(n), t0, max_tokens)
        cpu = time.process_time() - cpu0
    finished = [r.finish_s for r in records if r.finish_s is not None]
    failed = sum(1 for r in records if not r.completed)
    error = None
    if failed:       # the commonest reasons, so a failed run says why without --save-requests
        reasons = Counter(r.error or "unfinished" for r in records if not r.completed).most_common(3)
        error = f"{failed} of {n} requests failed: " + "; ".join(f"{c} x {msg}" for msg, c in reasons)
    wall = time.perf_counter() - t0
    processes = max(1, min(target.client_processes, load.concurrency or target.client_processes))
    extra = {"url": target.url, "client_processes": processes, "client_cpu_share": round(cpu / wall / processes, 3)}
    return LoadRun("http", None, None, load.concurrency, load.request_rate,
                   max(finished, default=wall), records, extra=extra, error=error)


def _run_in_processes(target: HttpTarget, model: str, workload: Workload,
                      load: Load) -> tuple[list[RequestRecord], float, float]:
    """The load split over ``target.client_processes`` processes: (records in request order,
    the CPU seconds they spent, the run's start), the processes started before the clock."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    p, n = target.client_processes, workload.num_requests
    if load.concurrency is not None:
        p = min(p, load.concurrency)           # each process keeps at least one request in flight
    shares = [list(range(k, n, p)) for k in range(p)]
    loads = [load if load.concurrency is None else Load(concurrency=max(1, load.concurrency // p
                                                                        + (k < load.concurrency % p)))
             for k in range(p)]
    records: list = [None] * n
    cpu = 0.0
    workload = replace(workload, fresh=None)        # (a closure: the prompts are in it already)
    with ProcessPoolExecutor(p, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_ready, range(p)))            # started and imported before the run's clock
        t0 = time.perf_counter()
        for share, (part, part_cpu) in zip(shares, pool.map(_child_run, [target] * p, [model] * p,
                                                             [workload] * p, loads, shares, [t0] * p)):
            cpu += part_cpu
            for i, rec in zip(share, part):
                records[i] = rec
    return records, cpu, t0


def _ready(_: int) -> None:
    import aiohttp  # noqa: F401 - imported before the run starts
    time.sleep(0.2)     # every process takes one of these, so each is up before the clock starts


def _child_run(target: HttpTarget, model: str, workload: Workload, load: Load, indices: list[int],
               t0: float) -> tuple[list[RequestRecord], float]:
    """One client process's share of a load (``_run_in_processes``)."""
    async def go():
        import aiohttp
        timeout = aiohttp.ClientTimeout(total=target.timeout_s)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                         headers=target.headers) as session:
            return await _run_requests(session, target, model, workload, load, indices, t0)
    cpu0 = time.process_time()
    records = asyncio.run(go())
    return [records[i] for i in indices], time.process_time() - cpu0


async def _run_requests(session, target: HttpTarget, model: str, workload: Workload, load: Load, indices,
                        t0: float, max_tokens: int | None = None) -> list:
    """Requests ``indices`` of the workload at ``load`` (closed loop at its concurrency, or at
    their arrival times); their records, by request index (None elsewhere)."""
    records = [None] * workload.num_requests

    async def one(i: int, arrival: float) -> None:
        prompt = workload.prompt_texts[i] if workload.prompt_texts else workload.prompt_ids[i]
        rec = RequestRecord(f"http-{i}", len(workload.prompt_ids[i]), arrival)
        records[i] = rec
        payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens or workload.max_tokens(i, target.max_tokens),
                   "stream": True,
                   "temperature": target.temperature, "stream_options": {"include_usage": True}}
        if target.ignore_eos:
            payload["ignore_eos"] = True
        if target.return_token_ids:
            payload["return_token_ids"] = True
        try:
            await _stream(session, target.url, payload, rec, t0)
        except (TimeoutError, OSError, ValueError) as e:
            rec.error = rec.error or f"{type(e).__name__}: {e}"[:300]
        except Exception as e:   # noqa: BLE001 - aiohttp's errors: one failed request must not end the run
            rec.error = rec.error or f"{type(e).__name__}: {e}"[:300]

    indices = list(indices)
    if load.concurrency is not None:
        queue = iter(indices)

        async def worker() -> None:
            for i in queue:
                await one(i, time.perf_counter() - t0)
        await asyncio.gather(*(worker() for _ in range(min(load.concurrency, len(indices)))))
    else:
        async def delayed(i: int) -> None:
            await asyncio.sleep(max(0.0, workload.arrivals_s[i] - (time.perf_counter() - t0)))
            await one(i, workload.arrivals_s[i])
        await asyncio.gather(*(delayed(i) for i in indices))
    return records


SSE_END = object()      # what ``sse_payload`` returns for ``data: [DONE]``


def sse_payload(line: bytes):
    """An SSE line's parsed ``data:`` JSON, ``SSE_END`` for ``data: [DONE]``, None for any other line."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    return SSE_END if data == b"[DONE]" else json.loads(data)


def sse_objects(lines):
    """The parsed ``data:`` objects of an SSE stream's lines, ending with ``SSE_END`` if the
    stream said ``[DONE]`` (nothing after it is read)."""
    for line in lines:
        obj = sse_payload(line)
        if obj is not None:
            yield obj
            if obj is SSE_END:
                return


async def _stream(session, url: str, payload: dict, rec: RequestRecord, t0: float) -> None:
    num_chunks = 0
    async with session.post(f"{url}/v1/completions", json=payload) as resp:
        rec.replica_id = resp.headers.get(REPLICA_HEADER)
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        async for raw in resp.content:
            obj = sse_payload(raw)
            if obj is None:
                continue
            now = time.perf_counter() - t0
            if obj is SSE_END:
                break
            if "error" in obj:
                err = obj["error"]
                rec.error = (f"stream error event ({err.get('code')}): " + str(err.get("message", err)))[:300]
                break
            for choice in obj.get("choices") or []:
                ids = choice.get("token_ids")      # return_token_ids: timed by token, whatever the text
                count = len(ids) if ids is not None else int(bool(choice.get("text")))
                if count:
                    rec.add_chunk(now, count)
                    num_chunks += count
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
                    rec.finish_s = now
            usage = obj.get("usage")
            if usage:
                rec.num_output_tokens = int(usage.get("completion_tokens", 0))
                rec.num_prompt_tokens = int(usage.get("prompt_tokens", rec.num_prompt_tokens))
                rec.num_cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if rec.finish_s is None and rec.error is None:
        rec.error = "the stream ended without a finish_reason"
    if not rec.num_output_tokens:
        rec.num_output_tokens = num_chunks


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_COUNTERS = {"spec_decode_num_drafts_total": "num_drafts",
             "spec_decode_num_draft_tokens_total": "num_draft_tokens",
             "spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
             "num_target_forwards_total": "num_target_forwards",
             "generation_tokens_total": "num_emitted_tokens"}
_ENGINE = {"engine_steps_total": "num_steps", "engine_overlapped_steps_total": "num_overlapped_steps"}
_HISTOGRAMS = {"time_to_first_token_seconds": "ttft",        # the server's: handler entry -> first token
               "request_queue_time_seconds": "queue",         # engine loop's arrival -> admission
               "request_prefill_time_seconds": "prefill"}     # admission -> first tokens
_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"
_ROUTED = "router_requests_total"          # by decision label: the app's routers (prefix-aware routing)


def parse_metrics(text: str) -> dict:
    """Prometheus text -> our counter names, summed over replicas; per-position as a list; the
    routers' decisions as ``router_decisions`` {decision: requests}; the engines' steps under
    ``engine``; the TTFT, queue and prefill histograms under ``histograms`` as {"ttft": {"buckets":
    {le: cumulative count}, "sum", "count"}, ...}."""
    out: dict = {}
    per_pos: dict[int, float] = {}
    histograms: dict = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        if name.endswith(_ROUTED):
            decision = re.search(r'decision="([^"]+)"', labels or "")
            if decision:
                out.setdefault("router_decisions", {})[decision.group(1)] = v
            continue
        base, _, part = name.rpartition("_")
        short = next((key for long, key in _HISTOGRAMS.items() if base.endswith(long)), None)
        if short:
            h = histograms.setdefault(short, {"buckets": {}, "sum": 0.0, "count": 0.0})
            le = re.search(r'le="([^"]+)"', labels or "")
            if part == "bucket" and le:
                h["buckets"][le.group(1)] = h["buckets"].get(le.group(1), 0.0) + v
            elif part in ("sum", "count"):
                h[part] += v
            continue
        engine_key = next((key for suffix, key in _ENGINE.items() if name.endswith(suffix)), None)
        if engine_key:
            out.setdefault("engine", {})[engine_key] = out.get("engine", {}).get(engine_key, 0.0) + v
            continue
        if name.endswith(_PER_POSITION):
            pos = re.search(r'position="(\d+)"', labels or "")
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + v
            continue
        for suffix, key in _COUNTERS.items():
            if name.endswith(suffix):
                out[key] = out.get(key, 0.0) + v
    if per_pos:
        out["accepted_per_position"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)]
    if histograms:
        out["histograms"] = histograms
    return out


async def _scrape_metrics(session, url: str) -> dict | None:
    try:
        async with session.get(f"{url}/metrics") as resp:
            return parse_metrics(await resp.text()) if resp.status == 200 else None
    except Exception:   # noqa: BLE001 - /metrics is optional
        return None


def _spec_delta(before: dict | None, after: dict | None) -> dict | None:
    if not before or not after or "num_draft_tokens" not in after:
        return None
    out = {}
    for key, v in after.items():
        if key in ("router_decisions", "engine", "histograms"):
            continue
        if key == "accepted_per_position":
            old = before.get(key) or []
            out[key] = [int(a - (old[i] if i < len(old) else 0)) for i, a in enumerate(v)]
        else:
            out[key] = int(v - before.get(key, 0))
    return out


def _server_delta(before: dict | None, after: dict | None) -> dict | None:
    """What the server says of one run, from two /metrics scrapes: its engines' steps (all, and
    those launched before the step they follow landed: the rest fed a prompt or followed an idle
    engine), and its own TTFT (handler entry -> first token), queue and prefill times (mtpserve's
    engine loop), each as a mean and bucket quantiles: a run's TTFT splits into the engine's part,
    the serving path's and the client's with the wire's."""
    if not before or not after:
        return None
    out: dict = {}
    old = before.get("engine") or {}
    if after.get("engine"):
        out.update({k: int(v - old.get(k, 0)) for k, v in after["engine"].items()})
    for key, h1 in (after.get("histograms") or {}).items():
        h0 = (before.get("histograms") or {}).get(key) or {"buckets": {}, "sum": 0.0, "count": 0.0}
        n = h1["count"] - h0["count"]
        if n <= 0:
            continue
        buckets = sorted(((float(le), c - h0["buckets"].get(le, 0.0)) for le, c in h1["buckets"].items()),
                         key=lambda b: b[0])
        out[f"{key}_ms"] = {"mean": round(1e3 * (h1["sum"] - h0["sum"]) / n, 3), "count": int(n),
                            **{f"p{q}_at_most": _bucket_quantile(buckets, q / 100 * n) for q in (50, 90, 99)}}
    return out or None


def _bucket_quantile(cumulative: list[tuple[float, float]], rank: float) -> float | None:
    """The upper bound (ms) of the first histogram bucket holding ``rank`` observations; None past the last finite one."""
    for le, count in cumulative:
        if count >= rank:
            return None if le == float("inf") else round(1e3 * le, 3)
    return None
