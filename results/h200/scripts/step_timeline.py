"""Where a steady step's time goes: the host's launch, its wait for the step before, its other
work, and what the GPU did in between, step by step (one engine at a time, a closed loop).

    python3 step_timeline.py MODEL_DIR OUT.json [--fixed 0,2] [--concurrency 16] [--requests 128]
        [--range-ratio 0.5] [--no-after-decode] [--prompt-graphs] [--set ATTR=0|1] [--profile PREFIX] [--device cuda]

Session 24 (H100, bundled, C=16, lengths 64-192): a K=2 step took 1.08 ms (p50) where its
replays alone take ~0.6, and ``auto_ab.py``'s host figure (wall time outside ORT's launch calls)
counts the waits for the device with the host's own work, so it could not say which one the
step waits on. Here each launch (``Engine._launch``, and ``_run_step`` for a step run alone)
records a CUDA event on the stream when the host starts queueing it and another when it is done
queueing; after the run:

    GPU gap    event(end of step i-1's queue) -> event(start of step i's): the GPU idle between
               steps because the host had not started queueing step i (host-bound: > 0)
    GPU span   event(start of i) -> event(end of i): step i's GPU time, with any idle inside it
               while the host was still queueing (the replays alone: ``step_costs.py``)
    launch     host time queueing step i;  wait: host time in ``TokenReadback.receive`` (the
               wait for a launched step's tokens);  other: the step's wall time less both

Each engine runs the loop once to warm up, then once timed. Steps are classed as step_trace.py
does: prompt (a step that fed a prompt chunk), drafting (its rows carried drafts), and whether
it was launched behind the step before (pipelined). On the CPU only the host columns mean
anything (a dry run of the script).

Each step's record also counts the host time of the calls its launches made (``calls``: eager
main / head forwards, main graph replays and misses, the head's captured drafting and fills).
Session 26 (H100): the drafting step after each arrival ran an eager head forward, 0.72 ms of
its host time; with ``HeadGraphs.fill`` it runs none.

The call right after a prompt step's is its own kind ("after prompt": where an MTP engine's
pipeline restarts and its head catches up on the new prompts; session 37 measured ~1.8 ms of
them at K=2 C=16 against K=0's 0.23). ``--profile PREFIX`` runs cProfile over those calls and,
apart, over the steady drafting ones, and writes each's functions per call (by own time and by
cumulative time) to ``PREFIX-after-prompt.txt`` / ``PREFIX-steady.txt``: where the extra host
time of a restart goes, function by function (cProfile's own cost inflates both alike).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from auto_ab import ClosedLoop  # noqa: E402

from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS, output_lengths, text_workload  # noqa: E402
from mtpserve.engine import pipeline  # noqa: E402
from mtpserve.engine.config import EngineConfig, SpecConfig  # noqa: E402
from mtpserve.engine.engine import Engine  # noqa: E402


class Timeline:
    """Wraps one engine's launches and the readback's waits while ``recording``."""

    def __init__(self, engine: Engine):
        self.engine, self.recording = engine, False
        self.cupy = None
        if engine.xp.__name__ == "cupy":
            import cupy
            self.cupy = cupy
        self.step: dict = {}
        self.steps: list[dict] = []
        for name in ("_launch", "_run_step"):
            self._wrap(name)
        # what each launch spent its host time on: eager forwards, replays, the head's drafting
        self._calls(engine.runner, "run_main", "eager main")
        self._calls(engine.runner, "run_head", "eager head")
        if engine.graphs is not None:
            self._calls(engine.graphs, "run", "main graph", none_is="main graph missed")
            self._calls(engine.graphs, "run_after", "main graph after", none_is="main graph after missed")
            self._calls(engine.graphs.bank, "padded_in_place", "bank placed")
        if engine.proposer is not None and engine.proposer.graphs is not None:
            self._calls(engine.proposer.graphs, "draft", "head graphs", none_is="head graphs missed")
            self._calls(engine.proposer.graphs, "draft_after", "head graphs after", none_is="head graphs after missed")
            self._calls(engine.proposer.graphs, "fill", "head fills")
        if engine.proposer is not None:
            self._calls(engine.proposer, "_catch_up_long", "head catch-up")
        original = self._receive = pipeline.TokenReadback.receive
        timeline = self

        def receive(readback, handle):
            t = time.perf_counter()
            try:
                return original(readback, handle)
            finally:
                if timeline.recording:
                    timeline.step["wait_us"] = timeline.step.get("wait_us", 0.0) + (time.perf_counter() - t) * 1e6
        pipeline.TokenReadback.receive = receive

    def _wrap(self, name: str) -> None:
        original = getattr(self.engine, name)
        timeline = self

        def wrapped(*args, **kwargs):
            start = timeline._event()
            t = time.perf_counter()
            out = original(*args, **kwargs)
            if timeline.recording:
                timeline.step.setdefault("launches", []).append(
                    {"what": name, "us": (time.perf_counter() - t) * 1e6, "start": start, "end": timeline._event()})
            return out
        setattr(self.engine, name, wrapped)

    def _calls(self, owner, name: str, label: str, none_is: str | None = None) -> None:
        """Count calls of ``owner.name`` and their host time (us) into the step's ``calls``
        (``none_is``: a call that returned None, e.g. no captured shape fit, counted apart)."""
        original = getattr(owner, name)
        timeline = self

        def wrapped(*args, **kwargs):
            t = time.perf_counter()
            out = original(*args, **kwargs)
            if timeline.recording:
                key = none_is if none_is is not None and out is None else label
                c = timeline.step.setdefault("calls", {}).setdefault(key, [0, 0.0])
                c[0] += 1
                c[1] = round(c[1] + (time.perf_counter() - t) * 1e6, 1)
            return out
        setattr(owner, name, wrapped)

    def _event(self):
        if self.cupy is None or not self.recording:
            return None
        e = self.cupy.cuda.Event()
        e.record(self.cupy.cuda.get_current_stream())
        return e

    def on_step(self, loop) -> None:
        """After each ``Engine.step`` call (``ClosedLoop``'s hook): its record closed. A record
        is one call: the step that landed in it (its kind: ``last_step``) and the launches made
        in it, usually of the next step (its continuation); in a steady run the two are alike."""
        if not self.recording:
            return
        timing = self.engine.last_step
        rec, self.step = self.step, {}
        rec["wall_us"] = loop.times[-1] * 1e6 if loop.times else None
        if timing is not None:
            rec.update(drafts=timing.num_head_forwards, prompt=timing.has_prefill, pipelined=timing.pipelined,
                       requests=timing.num_requests)
        rec["after_prompt"] = bool(self.steps and self.steps[-1].get("prompt")) and not rec.get("prompt")
        self.steps.append(rec)

    def finish(self) -> list[dict]:
        """Per step: host launch / wait / other (us) and, on CUDA, the GPU gap before it and span."""
        pipeline.TokenReadback.receive = self._receive
        if self.cupy is not None:
            self.cupy.cuda.get_current_stream().synchronize()
        out, last_end = [], None
        for rec in self.steps:
            launches = rec.pop("launches", [])
            launch_us = sum(x["us"] for x in launches)
            row = dict(rec)
            row["launch_us"] = round(launch_us, 1)
            row["wait_us"] = round(rec.get("wait_us", 0.0), 1)
            if rec.get("wall_us") is not None:
                row["other_us"] = round(rec["wall_us"] - launch_us - row["wait_us"], 1)
                row["wall_us"] = round(rec["wall_us"], 1)
            if self.cupy is not None and launches and launches[0]["start"] is not None:
                first, end = launches[0]["start"], launches[-1]["end"]
                row["gpu_span_us"] = round(self.cupy.cuda.get_elapsed_time(first, end) * 1e3, 1)
                if last_end is not None:
                    row["gpu_gap_us"] = round(self.cupy.cuda.get_elapsed_time(last_end, first) * 1e3, 1)
                last_end = end
            out.append(row)
        return out


class KindProfiles:
    """cProfile over one engine's ``step`` calls, one profile a kind of call: "after prompt" (the
    call after one whose step fed a prompt) and "steady" (after a call whose step fed none and
    drafted); other calls run unprofiled. The kind is known before the call (the last step's)."""

    def __init__(self, engine: Engine):
        self.engine, self.recording = engine, False
        self.profiles = {"after prompt": cProfile.Profile(), "steady": cProfile.Profile()}
        self.calls = {k: 0 for k in self.profiles}
        original = engine.step

        def step(*args, **kwargs):
            last = engine.last_step
            kind = None if not self.recording or last is None else \
                "after prompt" if last.has_prefill else "steady" if last.num_head_forwards else None
            if kind is None:
                return original(*args, **kwargs)
            self.calls[kind] += 1
            prof = self.profiles[kind]
            prof.enable()
            try:
                return original(*args, **kwargs)
            finally:
                prof.disable()
        engine.step = step

    def write(self, prefix: str, top: int = 45) -> None:
        """Each kind's functions, by own time then cumulative time, in ms per call of that kind."""
        for kind, prof in self.profiles.items():
            n = self.calls[kind]
            if not n:
                continue
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            total = sum(v[2] for v in stats.stats.values())
            out.write(f"{kind}: {n} calls, {total / n * 1e3:.3f} ms of profiled own time a call\n")
            for key, title in (("tottime", "own"), ("cumulative", "cumulative")):
                out.write(f"\n-- by {title} time, ms per call (calls per call) --\n")
                rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2 if key == "tottime" else 3], reverse=True)
                for (file, line, func), (_, nc, tt, ct, _) in rows[:top]:
                    where = f"{Path(file).name}:{line}({func})"
                    out.write(f"{(tt if key == 'tottime' else ct) / n * 1e3:8.3f}  {nc / n:7.2f}  {where}\n")
            Path(f"{prefix}-{kind.replace(' ', '-')}.txt").write_text(out.getvalue())


def summarize(rows: list[dict]) -> dict:
    """Medians (and sums) of each column by kind of step."""
    steady = [r for r in rows if not r.get("prompt") and not r.get("after_prompt")]
    kinds = {"prompt": [r for r in rows if r.get("prompt")],
             "after prompt": [r for r in rows if r.get("after_prompt")],
             "drafting, pipelined": [r for r in steady if r.get("drafts") and r.get("pipelined")],
             "drafting, alone": [r for r in steady if r.get("drafts") and not r.get("pipelined")],
             "decode, pipelined": [r for r in steady if not r.get("drafts") and r.get("pipelined")],
             "decode, alone": [r for r in steady if not r.get("drafts") and not r.get("pipelined")]}
    out = {}
    for kind, rs in kinds.items():
        if not rs:
            continue
        cols = [c for c in ("wall_us", "launch_us", "wait_us", "other_us", "gpu_gap_us", "gpu_span_us")
                if any(c in r for r in rs)]
        calls: dict = {}
        for r in rs:
            for key, (n, us) in r.get("calls", {}).items():
                c = calls.setdefault(key, [0, 0.0])
                c[0] += n
                c[1] += us
        out[kind] = {"steps": len(rs),
                     **{f"{c}_p50": round(statistics.median(r[c] for r in rs if c in r), 1) for c in cols},
                     **{f"{c}_sum_ms": round(sum(r[c] for r in rs if c in r) / 1e3, 2) for c in cols},
                     "calls a step (count, host us)": {k: (round(n / len(rs), 2), round(us / len(rs), 1))
                                                       for k, (n, us) in sorted(calls.items())}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--fixed", default="0,2", help="draft counts, one engine each (0: MTP off)")
    p.add_argument("--no-after-decode", action="store_true",
                   help="Engine.draft_after_decode off in the MTP engines (default: the engine's, on with CUDA; "
                   "before session 38 this script turned it off unless asked)")
    p.add_argument("--set", action="append", default=[], metavar="ATTR=0|1",
                   help="an Engine attribute switched in every engine (early_head_catch_up=1)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5, help="output lengths from 128 x [1 - R, 1 + R]")
    p.add_argument("--prompt-graphs", action="store_true", help="captured prompt steps (EngineConfig.prompt_graphs)")
    p.add_argument("--profile", metavar="PREFIX", help="cProfile the calls after prompt steps and the steady "
                   "drafting ones (MTP engines): PREFIX-K<k>-after-prompt.txt, PREFIX-K<k>-steady.txt")
    args = p.parse_args()
    base = EngineConfig(args.model_dir, device=args.device, overlap_decode=True, prompt_graphs=args.prompt_graphs)
    result = {"model": args.model_dir, "device": args.device, "concurrency": args.concurrency,
              "requests": args.requests, "range_ratio": args.range_ratio, "engines": {}}
    for k in [int(x) for x in args.fixed.split(",")]:
        name = f"K={k}" + (" no draft after decode" if k and args.no_after_decode else "")
        engine = Engine(dataclasses.replace(base, spec=SpecConfig(k)))
        if args.no_after_decode:
            engine.draft_after_decode = False
        for switch in args.set:
            attr, value = switch.split("=")
            if not hasattr(engine, attr):
                raise SystemExit(f"no engine attribute {attr}")
            setattr(engine, attr, bool(int(value)))
        prompts = text_workload(BUNDLED_PROMPTS, engine.tokenizer.encode, args.requests).prompt_ids
        lengths = output_lengths(len(prompts), 128, args.range_ratio) or 128
        timeline = Timeline(engine)
        profiles = KindProfiles(engine) if args.profile and k else None
        ClosedLoop(engine, prompts, args.concurrency, f"warm-{k}", lengths).advance()
        timeline.recording = True
        loop = ClosedLoop(engine, prompts, args.concurrency, f"timed-{k}", lengths, on_step=timeline.on_step)
        loop.advance()
        timeline.recording = False
        if profiles is not None:            # a second timed run, profiled (the first's timings stay clean)
            profiles.recording = True
            ClosedLoop(engine, prompts, args.concurrency, f"profiled-{k}", lengths).advance()
            profiles.recording = False
            profiles.write(f"{args.profile}-K{k}")
        rows = timeline.finish()
        r = loop.result()
        summary = summarize(rows)
        counts = {"prompt_continuations": getattr(engine, "num_prompt_continuations", 0),
                  "stops": dict(engine.overlap_blockers)}        # (warm-up, timed and profiled runs)
        result["engines"][name] = {"tokens": r["tokens"], "steps": r["steps"], "ms_per_step": r["ms_per_step"],
                                   "summary": summary, "counts": counts, "steps_detail": rows}
        print(f"{name}: {r['steps']} steps, {r['ms_per_step']:.3f} ms/step, {r['tokens']} tokens; {counts}", flush=True)
        for kind, s in summary.items():
            print(f"  {kind}: " + ", ".join(f"{c} {v}" for c, v in s.items()), flush=True)
        del engine
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
