"""Is a replica's step stall the engine process's own, or its surroundings' (Ray, Serve, the API servers)?

    python3 results/h200/scripts/engine_process_alone.py OUT.json [--concurrency 16] [--num-prompts 256]
        [--py-spy PY_SPY --modes process+]

The same closed loop (bundled model, K=0, one ORT thread, random 100-token prompts, 128 tokens
each) driven from one asyncio client, three ways in one process, no Ray anywhere:
  thread:    an EngineLoop (the owner thread, which builds the engine: ``EngineLoop.launch``) here;
  process:   an EngineProcess (the replica's engine process, spawned from here);
  process+:  the same while 3 busy Python processes spin beside it (a host with more to run).
With --py-spy, the engine process's threads are sampled (native frames too) through each timed
load, into OUT.json's folder as pyspy-MODE.txt (py-spy's raw format: a stack and its count a line).
Each says its TTFT / ITL p50 and p99 and its owner-thread stalls (``engine_loop.Stall``, with the
owner thread's CPU time and involuntary switches), so a stall that appears only under Serve is
Serve's surroundings', and one that appears here is the engine process's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def closed_loop(loop, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    from mtpserve.engine.sampler import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ttft, itl, queue_ = [], [], list(range(len(prompts)))

    async def one(i: int) -> None:
        start = time.perf_counter()
        last = None
        async for event in loop.submit(f"r{i}", prompts[i], params):
            if not event.token_ids:
                continue
            now = time.perf_counter()
            if last is None:
                ttft.append(now - start)
            else:
                itl.append((now - last) / len(event.token_ids))
            last = now

    async def worker() -> None:
        while queue_:
            await one(queue_.pop(0))
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    status = await loop.status()

    def ms(xs, q):
        return round(1e3 * float(np.percentile(xs, q)), 3)
    return {"wall_s": round(wall, 3), "tok_per_s": round(len(prompts) * max_tokens / wall, 1),
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "itl_p50_ms": ms(itl, 50),
            "itl_p99_ms": ms(itl, 99), "num_stalls": status["num_stalls"], "stalls": status["stalls"],
            "owner_niceness": status.get("owner_niceness")}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default="thread,process,process+")
    p.add_argument("--py-spy", help="py-spy's path: sample the engine process through each timed load")
    args = p.parse_args()

    from mtpserve.actors.engine_loop import EngineLoop
    from mtpserve.actors.engine_process import EngineProcess
    from mtpserve.engine.config import CacheConfig, EngineConfig, SpecConfig
    from mtpserve.engine.engine import Engine
    config = EngineConfig(device=args.device, num_threads=1,
                          cache=CacheConfig(max_resident_requests=max(16, args.concurrency)), spec=SpecConfig(0))
    rng = np.random.default_rng(0)
    results = {}
    for mode in args.modes.split(","):
        started = time.perf_counter()
        if mode == "thread":
            loop = EngineLoop.launch(lambda: Engine(config)).start()
        else:
            loop = EngineProcess(config).start()
            loop.set_grant(1 << 30, 1 << 30)
        print(f"{mode}: ready in {time.perf_counter() - started:.1f} s", flush=True)
        spinners = [multiprocessing.Process(target=_spin, args=(120.0,), daemon=True)
                    for _ in range(3 if mode == "process+" else 0)]
        for s in spinners:
            s.start()
        try:
            vocab = 1000
            warm = [list(map(int, rng.integers(10, vocab, 100))) for _ in range(args.concurrency)]
            asyncio.run(closed_loop(loop, warm, args.concurrency, 16))
            prompts = [list(map(int, rng.integers(10, vocab, 100))) for _ in range(args.num_prompts)]
            spy = None
            if args.py_spy and mode != "thread":
                out = os.path.join(os.path.dirname(os.path.abspath(args.out)), f"pyspy-{mode}.txt")
                spy = subprocess.Popen([args.py_spy, "record", "--pid", str(loop.pid), "--native", "--threads",
                                        "--rate", "250", "--format", "raw", "--output", out, "--duration", "60"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                time.sleep(1.0)
            result = asyncio.run(closed_loop(loop, prompts, args.concurrency, args.max_tokens))
            if spy is not None:
                spy.send_signal(2)          # py-spy writes what it has on SIGINT
                spy.wait(30)
        finally:
            for s in spinners:
                s.terminate()
            loop.stop()
        results[mode] = result
        worst = max(result["stalls"], key=lambda s: s["turn_ms"], default=None)
        print(f"{mode}: {result['tok_per_s']} tok/s, TTFT p50/p99 {result['ttft_p50_ms']}/{result['ttft_p99_ms']} "
              f"ms, ITL p50/p99 {result['itl_p50_ms']}/{result['itl_p99_ms']} ms, {result['num_stalls']} stalls"
              + (f", the longest {worst['turn_ms']:.1f} ms (owner on the CPU {worst['cpu_ms']:.1f} ms, "
                 f"{worst['involuntary_switches']} involuntary switches)" if worst else ""), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
