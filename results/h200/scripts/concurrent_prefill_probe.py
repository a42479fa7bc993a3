"""How much of a prompt step can run beside draft steps? Two engines of one model in one process,
each on its own thread and CUDA stream (an engine is built on the thread that steps it: ORT keeps
CUDA graphs per thread):

    decoder   an MTP engine (K=2) in a closed loop at C=16, every request 128 tokens
    prefiller an engine that only takes prompts (max_tokens=1): GROUP prompts a step, again and again

Each alone, then both at once: the decoder's tokens/s and steady step, the prefiller's prompt
step time. If the decoder keeps most of its speed while the prefiller's steps run, a prompt step
on a second stream (its own session and rows, joining the running batch when it lands) would hide
most of what arrivals cost a round with waves (35% of a K=2 round at C=16 on the H100, session 30).

    python3 concurrent_prefill_probe.py MODEL_DIR OUT.json [--device cuda] [--seconds 8] [--group 4]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from auto_ab import ClosedLoop  # noqa: E402

from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS, text_workload  # noqa: E402
from mtpserve.engine.config import CacheConfig, EngineConfig, SpecConfig  # noqa: E402
from mtpserve.engine.engine import Engine  # noqa: E402
from mtpserve.engine.sampler import SamplingParams  # noqa: E402


class Worker(threading.Thread):
    """An engine built and stepped on this thread; ``phase(name)`` runs ``work`` for ``seconds``
    and records what it measured under ``name``."""

    def __init__(self, model_dir: str, device: str, k: int, work):
        super().__init__(daemon=True)
        self.model_dir, self.device, self.k, self.work = model_dir, device, k, work
        self.ready, self.go, self.done = threading.Event(), threading.Event(), threading.Event()
        self.results: dict[str, dict] = {}
        self.plan: tuple[str, float] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            # (no prefix cache: the same prompts come again and again, and a hit would skip the prefill)
            self.engine = Engine(EngineConfig(self.model_dir, device=self.device, spec=SpecConfig(self.k),
                                              cache=CacheConfig(prefix_cache=False)))
            self.work(self, 1.0, warm_up=True)
            self.ready.set()
            while True:
                self.go.wait()
                self.go.clear()
                if self.plan is None:
                    return
                name, seconds = self.plan
                self.results[name] = self.work(self, seconds)
                self.done.set()
        except BaseException as e:      # noqa: BLE001 - reported by the main thread
            self.error = e
            self.ready.set()
            self.done.set()

    def start_phase(self, name: str, seconds: float) -> None:
        self.plan = (name, seconds)
        self.done.clear()
        self.go.set()


_IDS = itertools.count()


def decode_loop(w: Worker, seconds: float, warm_up: bool = False) -> dict:
    """Closed loops of 16 requests of 128 tokens until ``seconds`` pass."""
    prompts = text_workload(BUNDLED_PROMPTS, w.engine.tokenizer.encode, 64).prompt_ids
    tokens, steps, times, t0 = 0, 0, [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        loop = ClosedLoop(w.engine, prompts[:32], 16, f"d{next(_IDS)}", 128)
        loop.advance()
        tokens += loop.tokens
        steps += len(loop.times)
        times += loop.times
    wall = time.perf_counter() - t0
    return {"tok_s": round(tokens / wall, 1), "steps": steps, "step_p50_ms": round(statistics.median(times) * 1e3, 4)}


def prefill_loop(w: Worker, seconds: float, warm_up: bool = False) -> dict:
    """Steps of ``GROUP`` prompts with max_tokens=1 until ``seconds`` pass: each step's time."""
    e = w.engine
    prompts = text_workload(BUNDLED_PROMPTS, e.tokenizer.encode, 64).prompt_ids
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for p in prompts[:GROUP]:
            e.add_request(f"p{next(_IDS)}", p, params)
        while e.has_work:
            s0 = time.perf_counter()
            e.step()
            times.append(time.perf_counter() - s0)
    return {"prompt_steps": len(times), "step_p50_ms": round(statistics.median(times) * 1e3, 4),
            "step_mean_ms": round(statistics.fmean(times) * 1e3, 4)}


GROUP = 4


def main() -> None:
    global GROUP
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--group", type=int, default=4)
    args = p.parse_args()
    GROUP = args.group
    decoder = Worker(args.model_dir, args.device, 2, decode_loop)
    prefiller = Worker(args.model_dir, args.device, 0, prefill_loop)
    for w in (decoder, prefiller):
        w.start()
        w.ready.wait()
        if w.error is not None:
            raise w.error
    for name, workers in (("alone", (decoder,)), ("alone", (prefiller,)), ("together", (decoder, prefiller))):
        for w in workers:
            w.start_phase(name, args.seconds)
        for w in workers:
            w.done.wait()
            if w.error is not None:
                raise w.error
    for w in (decoder, prefiller):
        w.plan = None
        w.go.set()
    result = {"device": args.device, "group": GROUP, "seconds": args.seconds,
              "decoder": decoder.results, "prefiller": prefiller.results}
    d, f = decoder.results, prefiller.results
    result["decoder_kept"] = round(d["together"]["tok_s"] / d["alone"]["tok_s"], 3)
    result["prefill_step_slowed"] = round(f["together"]["step_p50_ms"] / f["alone"]["step_p50_ms"], 3)
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
