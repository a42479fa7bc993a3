"""Serving overhead: TTFT and inter-token latency through HTTP vs. the in-process engine.

    mtpserve bench --serving-overhead [--model DIR] [--requests 20] [--max-tokens 64]
    python -m mtpserve.cluster.bench.serving_overhead [--model DIR] [--requests 20] [--max-tokens 64]

Runs the same prompts one at a time (latency, not throughput) twice: straight on an ``Engine``
in this process, then streamed over HTTP from one CPU replica of the Serve app on a local Ray.
TTFT: request sent -> first token (engine: add_request -> first event with tokens; HTTP: POST
-> first SSE chunk with text). ITL: between consecutive token events / chunks. The difference
is what Ray Serve, the proxy hop, the owner thread and SSE cost. Same engine settings both times
(MTP off by default, so every event is one token).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from mtpserve.engine.bundled import MODEL_DIR

APP_NAME = "overhead"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class LinkedList:\n    def __init__(self",
           "for i in range(10):\n    ", "with open(path) as f:\n", "try:\n    import json\nexcept"]


def _pct(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)) * 1e3, float(np.percentile(values, 99)) * 1e3


class _Latencies:
    """TTFT and inter-token gaps of requests run one after another."""

    def __init__(self):
        self.ttft, self.itl = [], []
        self._started = self._last = None

    def start(self) -> None:
        self._started, self._last = time.perf_counter(), None

    def token(self) -> None:
        now = time.perf_counter()
        (self.ttft if self._last is None else self.itl).append(now - (self._last or self._started))
        self._last = now


def measure_engine(model_dir: str, prompts: list[str], max_tokens: int, draft_tokens: int, threads: int):
    from mtpserve.engine.config import CacheConfig, EngineConfig, SpecConfig
    from mtpserve.engine.engine import Engine
    from mtpserve.engine.sampler import SamplingParams
    engine = Engine(EngineConfig(model_dir, num_threads=threads, cache=CacheConfig(1024, 64),
                                 spec=SpecConfig(draft_tokens)))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    lat = _Latencies()
    for i, prompt in enumerate(prompts):
        lat.start()
        engine.add_request(f"r{i}", prompt, params)
        while engine.has_work:
            for event in engine.step():
                if event.token_ids:
                    lat.token()
    return lat.ttft, lat.itl


def measure_http(url: str, model: str, prompts: list[str], max_tokens: int):
    import requests
    session = requests.Session()
    lat = _Latencies()
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        lat.start()
        with session.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    lat.token()
    return lat.ttft, lat.itl


def _server_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of the replicas' TTFT histogram on /metrics."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families
    total = count = 0.0
    for fam in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "mtpserve:time_to_first_token_seconds_sum":
                total += s.value
            elif s.name == "mtpserve:time_to_first_token_seconds_count":
                count += s.value
    return total, count


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(MODEL_DIR))
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads (both runs)")
    p.add_argument("--port", type=int, default=8123)
    args = p.parse_args(argv)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(args.requests)]

    measure_engine(args.model, prompts[:2], 8, args.draft_tokens, args.threads)        # warm-up
    engine = measure_engine(args.model, prompts, args.max_tokens, args.draft_tokens, args.threads)

    from mtpserve.cluster import deploy
    from mtpserve.cluster.app import ServeOptions
    deploy.connect(quiet=True, proxy_middleware=False)   # the proxy as Serve ships it
    try:
        deploy.start_http(deploy.LOCAL_HOST, args.port)
        options = ServeOptions.from_flat(model_dir=args.model, draft_tokens=args.draft_tokens,
                                         num_threads=args.threads, num_blocks=1024)
        deploy.deploy(options, APP_NAME, route_prefix="/")
        url = f"http://{deploy.LOCAL_HOST}:{args.port}"
        measure_http(url, options.served_model_name, prompts[:2], 8)                    # warm-up
        before = _server_ttft(url)
        http = measure_http(url, options.served_model_name, prompts, args.max_tokens)
        after = _server_ttft(url)
    finally:
        deploy.teardown(APP_NAME)

    print(f"{args.requests} requests one at a time, {args.max_tokens} tokens each, greedy, "
          f"draft tokens {args.draft_tokens}, {args.threads} ORT thread(s)")
    print(f"{'':18}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}   (ms)")
    rows = {"in-process engine": engine, "HTTP (Serve)": http}
    for name, (ttft, itl) in rows.items():
        print(f"{name:18}" + "".join(f"{v:10.2f}" for v in (*_pct(ttft), *_pct(itl))))
    diff = [h - e for h, e in zip((*_pct(http[0]), *_pct(http[1])), (*_pct(engine[0]), *_pct(engine[1])))]
    print(f"{'overhead':18}" + "".join(f"{v:10.2f}" for v in diff))
    inside = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3
    print(f"mean TTFT inside the replica (handler entry -> first token, from /metrics): {inside:.2f} ms; "
          f"mean HTTP TTFT {np.mean(http[0]) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
