"""What each part of a speculative step costs on the device, apart from everything else.

    python3 step_costs.py MODEL_DIR OUT.json [--batches 1,16] [--drafts 2] [--profile-requests 48]

One engine (K fixed, CUDA graphs, the KV context cut to 512 tokens so few graphs are captured),
then, with nothing else running:
  replays   every captured graph a K-draft step replays, back to back on the engine's stream:
            GPU ms per replay (CUDA events) and host ms per launch. The main model's decode
            (1 row per request) and verify (1 + K), the head's catch-up (1 + K rows) and chained
            (1) forward, at each batch size.
  commit    StateBank.commit_step of B rows keeping 2 of 3 (the partial-keep replay) and 3 of
            3 (a published present), host ms per call and GPU ms per call; and
            commit_step_on_device, a launched draft step's (in place, the kept counts on the
            device: the fused replay), which the ceiling counts.
  ceiling   the K-draft step's GPU time (catch-up + (K-1) chained + verify + partial commit on the device)
            against the decode step's: with zero host time, K=K vs K=0 tokens/s can reach at
            most tokens_per_step * decode / step (tokens_per_step for acceptance a per draft).
  profile   cProfile of the engine's step loop at K and at 0 (the same engine, its draft policy
            swapped), closed loop at each batch size, synthetic acceptance 0.8: the host
            functions with the most own time, and ms per step.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import cupy as cp
import numpy as np

from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from mtpserve.engine.cuda_graphs import GraphShape
from mtpserve.engine.draft_policy import FixedDraftPolicy
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.state_bank import StepCaptures, StepStates


def timed(fn, n: int, stream) -> dict:
    fn()
    stream.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    t0 = time.perf_counter()
    start.record(stream)
    for _ in range(n):
        fn()
    end.record(stream)
    host = (time.perf_counter() - t0) / n * 1e3
    end.synchronize()
    gpu = cp.cuda.get_elapsed_time(start, end) / n
    # back to back, the GPU time is the work's own unless the host cannot keep ahead of it
    return {"gpu_ms": round(gpu, 4), "host_ms_per_call": round(host, 4), "host_bound": host > 0.9 * gpu}


def replays(engine: Engine, batches, k: int, n: int) -> dict:
    out, stream = {}, engine._stream
    g, hg = engine.graphs, engine.proposer.graphs if engine.proposer is not None else None
    w = min(g.catalog.table_widths)
    for b in batches:
        for tokens in sorted({1, 1 + k}):
            graph = g._graphs[GraphShape(b, tokens, w, 0)]
            out[f"main B={b} rows/request={tokens}"] = timed(lambda: g._replay(graph), n, stream)
        if hg is not None:
            for tokens in sorted(hg.catalog.token_counts):
                graph = hg._graphs.get(GraphShape(b, tokens, w, 0))
                if graph is None:        # (the head's fill shapes are captured for some batch sizes only)
                    continue
                out[f"head B={b} rows/request={tokens}"] = timed(lambda: hg._replay(graph), n, stream)
    return out


def commits(engine: Engine, batches, k: int, n: int) -> dict:
    out, bank, stream = {}, engine.state_bank, engine._stream
    ids = bank.spec.layer_ids
    for b in batches:
        rids = [f"<commit-{i}>" for i in range(b)]
        for r in rids:
            bank.admit(r)
        caps = engine.graphs.captures
        captures = StepCaptures(caps.layer_ids, caps.conv_value[:, :b], caps.recurrent_capsule[:, :b])
        for kept in (k, 1 + k):
            def commit():
                present = StepStates(ids, bank.conv[:, 1, :b], bank.recurrent[:, 1, :b])
                bank.commit_step(rids, present, [1 + k] * b, [kept] * b, captures)
            out[f"B={b} keep {kept} of {1 + k}"] = timed(commit, n, stream)
            on_device = cp.full(b, kept, cp.int64)

            def commit_on_device():     # a launched draft step's: in place, the kept counts on the device
                bank.commit_step_on_device(rids, bank.step_buffers(rids).present, 1 + k, on_device, captures)
            out[f"B={b} keep {kept} of {1 + k} on device"] = timed(commit_on_device, n, stream)
        for r in rids:
            bank.release(r)
    return out


def profile(engine: Engine, k: int, batch: int, num_requests: int, max_tokens: int, rng) -> dict:
    engine.draft_policy = engine.scheduler.draft_policy = FixedDraftPolicy(k)
    vocab = engine.manifest.vocab_size
    prompts = [rng.integers(0, vocab, 128).tolist() for _ in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pending, live, steps, tokens = list(range(num_requests)), 0, 0, 0
    prof = cProfile.Profile()
    started = time.perf_counter()
    prof.enable()
    while pending or engine.has_work:
        while pending and live < batch:
            i = pending.pop(0)
            engine.add_request(f"p{k}-{batch}-{i}", prompts[i], params)
            live += 1
        for e in engine.step():
            tokens += len(e.token_ids)
            if e.finish_reason is not None:
                live -= 1
        steps += 1
    prof.disable()
    wall = time.perf_counter() - started
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats("mtpserve", 45)
    return {"k": k, "batch": batch, "steps": steps, "wall_s": round(wall, 3),
            "ms_per_step_profiled": round(wall / steps * 1e3, 4), "profile": s.getvalue()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--drafts", type=int, default=2)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--profile-requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--acceptance", type=float, default=0.8)
    ap.add_argument("--no-profile", action="store_true", help="replays, commits and ceilings only")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    k, largest = a.drafts, max(batches)
    config = EngineConfig(a.model_dir, device="cuda",
                          cache=CacheConfig(num_blocks=largest * 40 + 64, max_resident_requests=largest),
                          scheduler=SchedulerConfig(max_requests_per_step=largest, max_tokens_per_step=2048),
                          spec=SpecConfig(draft_tokens=k, synthetic_acceptance=a.acceptance),
                          max_model_len=512)
    t0 = time.perf_counter()
    engine = Engine(config)
    result = {"model_dir": a.model_dir, "drafts": k, "batches": batches, "acceptance": a.acceptance,
              "engine_ready_s": round(time.perf_counter() - t0, 1)}
    print(f"engine ready in {result['engine_ready_s']} s", flush=True)
    with engine.device_context():
        result["replays"] = replays(engine, batches, k, a.replays)
        result["commit"] = commits(engine, batches, k, a.replays)
    for name, v in {**result["replays"], **result["commit"]}.items():
        print(f"{name:34s} gpu {v['gpu_ms']:.4f} ms  host/call {v['host_ms_per_call']:.4f} ms"
              + ("  (host-bound)" if v["host_bound"] else ""), flush=True)
    ceilings = {}
    tokens_per_step = sum(a.acceptance ** i for i in range(k + 1))
    for b in batches:
        r, c = result["replays"], result["commit"]
        decode = r[f"main B={b} rows/request=1"]["gpu_ms"]
        step = (r[f"main B={b} rows/request={1 + k}"]["gpu_ms"] + r[f"head B={b} rows/request={1 + k}"]["gpu_ms"]
                + (k - 1) * r[f"head B={b} rows/request=1"]["gpu_ms"] + c[f"B={b} keep {k} of {1 + k} on device"]["gpu_ms"])
        ceilings[f"B={b}"] = {"decode_gpu_ms": decode, "k_step_gpu_ms": round(step, 4),
                              "tokens_per_step": round(tokens_per_step, 3),
                              "max_speedup_at_zero_host_time": round(tokens_per_step * decode / step, 3)}
        print(f"ceiling B={b}: {ceilings[f'B={b}']}", flush=True)
    result["ceilings"] = ceilings
    rng = np.random.default_rng(0)
    result["profiles"] = []
    for b in batches if not a.no_profile else []:
        for kk in (0, k):
            p = profile(engine, kk, b, a.profile_requests if b > 1 else max(4, a.profile_requests // 8),
                        a.max_tokens, rng)
            print(f"profile K={kk} B={b}: {p['steps']} steps, {p['ms_per_step_profiled']} ms/step (profiled)",
                  flush=True)
            result["profiles"].append(p)
    engine.check_integrity()
    json.dump(result, open(a.out, "w"), indent=1)
    for p in result["profiles"]:
        print(f"\n===== K={p['k']} B={p['batch']}\n" + p["profile"][:9000])


if __name__ == "__main__":
    main()
