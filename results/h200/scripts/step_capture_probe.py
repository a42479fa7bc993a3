"""Can a whole steady K=2 draft continuation (the head's drafting, the verify, the accept, the
commit, the readback: ~15 device calls and three ORT runs, ~650 us of host time a step at C=16 in
session 30's py-spy) be recorded as ONE CUDA graph of ours, with ORT's runs eager (graph id -1)
inside it, and is the step it computes exact?

    python3 step_capture_probe.py OUT.json [MODEL_DIR] [--captures N] [--requests B] [--tokens T]

Two CUDA engines in turn (bundled, K=2, as served), each a closed batch of B greedy requests of T
tokens (EOS ignored), the same prompts:
  reference  stepped as usual
  probed     stepped as usual, except that N of its steady draft continuations (a draft step
             continuing one with the same requests, staged from it on the device) are launched by
             recording ``Engine._launch_drafting`` in a stream capture of ours (relaxed mode),
             with every ORT replay swapped for an eager run of the same binding, then launching
             the recorded graph once; the loop goes on as usual.
What it writes:
  captures   per attempt: "ok" or where the capture broke (the exception and its trace); a
             failed capture leaves the probed engine's host state ahead of its device, so its
             exception ends the probed run
  exact      requests whose tokens equal the reference's, and the probed engine's integrity check
  cost       host us of a usual steady launch (median of the probed run's others) against the
             recording's launch call; GPU us from events around each (a usual launch's events
             include the device's idle gaps while the host launches: what a host-bound step costs)
Session 33 (`eo` at 03cc7d5): 16 of 16 requests equal, integrity ok; the launch 209-253 us of host
time (its first launch: the graph's upload to the device), 812-846 us of GPU time against the usual
launch's 958 (gaps included). Since then every timed launch (``--spin-ms``, default 3) waits
behind a spin kernel on the stream, so its events time the GPU's work alone (the host has queued
the whole step before the GPU reaches it), and a recording is uploaded before its timed launch:
the GPU time of the step as launched today against as one graph, and a warm launch's host us.

``--replay`` (session 36, not yet run) asks the next question: can one recording be launched
again for a later steady continuation, its host staging done anew? Every steady continuation
after the first 16 is then recorded (ORT's runs eager, as above) under a CuPy memory pool of its
own, keyed by the graphs ORT ran in it, the staging copies it made (a block table's only when
one changed) and by what alternates step to step (row 0's state bank, the readback's pinned
slot, the commit's pinned index block); when the key has a recording
already, this one (whose recording ran the host's side: staging into the pinned blocks, lengths,
the engine's bookkeeping) is dropped and the earlier recording is launched instead. Exact tokens
and a clean integrity check over many such launches say a whole-step graph can be replayed step
after step with the engine's buffers as they are (what alternates kept apart); a difference says
something a step reads moved (a table upload made only when a table changed, a temporary of
CuPy's pool, an address of ORT's arena).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import cupy as cp
from eager_capture_probe import eager_options  # (this directory: the scripts run as files)

from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS, text_workload
from mtpserve.engine import cuda_graphs
from mtpserve.engine.config import EngineConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams

_SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}""", "spin")


def spin(stream, ms: float) -> None:
    """Hold ``stream``'s GPU for about ``ms`` ms (at the device's clock rate), so that work the host
    queues next starts only after the host has queued all of it."""
    if ms > 0:
        rate_khz = cp.cuda.Device().attributes["ClockRate"]
        with stream:
            _SPIN((1,), (1,), (cp.int64(int(ms * rate_khz)),))


def run(model_dir: str, prompts, tokens: int, probe: dict | None) -> dict[str, list[int]]:
    """One engine's closed batch; with ``probe``, ``probe["captures"]`` steady continuations
    recorded and launched as graphs of ours (results into ``probe``)."""
    engine = Engine(EngineConfig(model_dir, device="cuda", spec=SpecConfig(2)))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    if probe is not None:
        _probe_launches(engine, probe)
    out: dict[str, list[int]] = {}
    while engine.has_work:                 # (a failed capture raises out of here)
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    if probe is not None:
        engine.check_integrity()
        probe["integrity"] = "ok"
    del engine
    gc.collect()
    return out


class _Unrecorded:
    """An event's stand-in while recording: an event recorded inside a capture is "last recorded
    in a capturing stream", and its next wait fails (cudaErrorCapturedEvent). The stream is
    synchronised before the capture and after the graph's launch, so the real events' last
    records are done and what they guard is in place: skipping the records loses nothing."""
    done = True

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _swap_events(engine: Engine) -> list:
    """Every event the step path records (staged inputs' uploads, the commit's index copies, the
    readback's copies) swapped for ``_Unrecorded``; what ``_restore`` puts back."""
    owners = [(g.inputs, "_sent") for graphs in (engine.graphs, getattr(engine.proposer, "graphs", None))
              if graphs is not None for g in graphs._graphs.values()]
    if engine.state_bank.fused_replay is not None:
        owners.append((engine.state_bank.fused_replay, "_sent"))
    owners.append((engine._readback, "_done"))
    saved = [(owner, name, getattr(owner, name)) for owner, name in owners]
    for owner, name, value in saved:
        setattr(owner, name, [_Unrecorded() for _ in value] if isinstance(value, list) else _Unrecorded())
    return saved


def _restore(saved: list) -> None:
    for owner, name, value in saved:
        setattr(owner, name, value)


class _Phases:
    """Events on the stream between a usual launch's parts (the head's drafting, the verify, the
    accept, the commit, the readback) and around each ORT replay inside them, for one launch at a
    time (``start`` .. ``stop``); behind the spin, each gap is GPU time: "ORT: part" a part's ORT
    replays, "ours: part" our kernels in it, "ours: between parts" the kernels outside them."""

    def __init__(self, engine: Engine, stream):
        self.stream, self.armed, self.marks, self.part = stream, False, [], "between parts"
        self.phase_us: dict[str, list[float]] = {}
        self._wrap(engine.proposer, "propose", "head drafting")
        self._wrap(engine, "_verify_after", "verify")
        self._wrap(engine.scheduler, "commit_states_on_device", "commit")
        self._wrap(engine._readback, "send", "readback")
        from mtpserve.engine import cuda_kernels
        self._wrap(cuda_kernels, "accept_step_on_device", "accept")
        replay, phases = cuda_graphs._GraphSet._replay, self

        def timed_replay(graph_set, graph):
            phases.mark(f"ours: {phases.part}")
            replay(graph_set, graph)
            phases.mark(f"ORT: {phases.part}")
        cuda_graphs._GraphSet._replay = timed_replay

    def _wrap(self, owner, name: str, label: str) -> None:
        fn, phases = getattr(owner, name), self

        def wrapped(*a, **kw):
            phases.mark("ours: between parts")
            phases.part = label
            try:
                return fn(*a, **kw)
            finally:
                phases.mark(f"ours: {label}")
                phases.part = "between parts"
        setattr(owner, name, wrapped)

    def mark(self, key: str) -> None:
        """An event now; the GPU time since the one before goes to ``key``."""
        if self.armed:
            event = cp.cuda.Event()
            event.record(self.stream)
            self.marks.append((key, event))

    def start(self) -> None:
        self.armed, self.marks = True, []
        self.mark("start")

    def stop(self) -> None:
        """After the launch's end has synchronised: the us of each key, summed over the launch."""
        self.armed = False
        totals: dict[str, float] = {}
        for (_, a), (key, b) in zip(self.marks, self.marks[1:]):
            totals[key] = totals.get(key, 0.0) + cp.cuda.get_elapsed_time(a, b) * 1e3
        for key, us in totals.items():
            self.phase_us.setdefault(key, []).append(us)


def _eager_replay(options, ran: list | None = None):
    """A stand-in for ``_GraphSet._replay`` that runs the graph's binding eagerly (``options``:
    graph id -1), so that a capture of ours records ORT's kernels; ``ran`` gets each graph's id."""
    def replay(graph_set, graph):
        if ran is not None:
            ran.append(id(graph))
        graph_set.session.run_with_iobinding(graph.binding.io, options)
        graph_set.num_replays += 1
    return replay


def _probe_launches(engine: Engine, probe: dict) -> None:
    phases = _Phases(engine, engine._stream) if probe.get("phases") else None
    probe["phase_split"] = phases
    usual = engine._launch_drafting
    stream, eager_replay = engine._stream, _eager_replay(eager_options())
    probe.update(attempts=[], usual_host_us=[], usual_gpu_us=[], graph_launch_host_us=[], graph_gpu_us=[],
                 eligible=0)

    def launch(plan, after=None):
        steady = (after is not None and after.num_drafts and after.staging is not None
                  and tuple(plan.request_ids) == tuple(after.plan.request_ids)
                  and len(plan.request_ids) == probe["requests"])
        if not steady:
            return usual(plan, after)
        probe["eligible"] += 1
        if probe.get("replay") and probe["eligible"] > 16:
            return _record_or_replay(engine, usual, plan, after, probe)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        record = probe["eligible"] > 16 and probe["eligible"] % 8 == 0 and len(probe["attempts"]) < probe["captures"]
        if not record:
            split = phases is not None and probe["eligible"] % 2 == 1    # (the others: the launch's time untouched)
            spin(stream, probe["spin_ms"])
            start.record(stream)
            if split:
                phases.start()
            t0 = time.perf_counter()
            flight = usual(plan, after)
            host_us = (time.perf_counter() - t0) * 1e6
            end.record(stream)
            end.synchronize()      # (the probe's own wait: the next launch's host time starts clean)
            if split:
                phases.stop()
            else:
                probe["usual_host_us"].append(host_us)
                probe["usual_gpu_us"].append(cp.cuda.get_elapsed_time(start, end) * 1e3)
            return flight
        saved = cuda_graphs._GraphSet._replay
        attempt = {"at_eligible": probe["eligible"]}
        probe["attempts"].append(attempt)
        step = "begin_capture"
        stream.synchronize()
        events = _swap_events(engine)
        cuda_graphs._GraphSet._replay = eager_replay
        try:
            stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
            step = "Engine._launch_drafting under capture"
            flight = usual(plan, after)
            step = "end_capture"
            graph = stream.end_capture()
        except Exception as e:     # noqa: BLE001 - where it broke is the finding
            attempt["capture"] = f"failed at {step}: {type(e).__name__}: {e}"[:1500]
            attempt["trace"] = traceback.format_exc()[-3000:]
            try:
                if stream.is_capturing():
                    stream.end_capture()
            except Exception as e2:    # noqa: BLE001
                attempt["end_after_failure"] = f"{type(e2).__name__}: {e2}"[:500]
            _restore(events)
            raise                      # host state ran ahead of a device that never ran the step
        finally:
            cuda_graphs._GraphSet._replay = saved
        attempt["capture"] = "ok"
        if hasattr(graph, "upload"):
            graph.upload(stream)
        stream.synchronize()
        spin(stream, probe["spin_ms"])
        start.record(stream)
        t0 = time.perf_counter()
        graph.launch(stream)
        attempt["launch_host_us"] = (time.perf_counter() - t0) * 1e6
        end.record(stream)
        end.synchronize()
        _restore(events)
        attempt["gpu_us"] = cp.cuda.get_elapsed_time(start, end) * 1e3
        probe["graph_launch_host_us"].append(attempt["launch_host_us"])
        probe["graph_gpu_us"].append(attempt["gpu_us"])
        attempt["graph"] = graph       # kept alive until the step has landed (dropped in the report)
        return flight

    engine._launch_drafting = launch


def _replay_key(engine: Engine) -> tuple:
    """What alternates from one steady continuation to the next (each flips once a step)."""
    commit = engine.state_bank.fused_replay
    return (int(engine.state_bank._active[0]), engine._readback._next, getattr(commit, "_turn", None))


def _record_or_replay(engine: Engine, usual, plan, after, probe: dict):
    """``--replay``: record this steady continuation (its host side runs for real); launch the
    recording of an earlier one with the same key instead when there is one (see the docstring)."""
    stream = engine._stream
    recordings = probe.setdefault("recordings", {})
    ran = []
    saved = cuda_graphs._GraphSet._replay
    eager_replay = _eager_replay(eager_options(), ran)
    upload = cuda_graphs._StaticInputs.upload

    def recorded_upload(inputs, name=None):      # which copies this step makes (a table only when one changed)
        ran.append((id(inputs), name))
        upload(inputs, name)
    pre = _replay_key(engine)
    stream.synchronize()
    events = _swap_events(engine)
    pool = cp.cuda.MemoryPool()        # the step's temporaries: kept for the probe's life (a recording's for its graph's)
    probe.setdefault("pools", []).append(pool)
    cuda_graphs._GraphSet._replay = eager_replay
    cuda_graphs._StaticInputs.upload = recorded_upload
    t0 = time.perf_counter()
    try:
        with cp.cuda.using_allocator(pool.malloc):
            stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
            try:
                flight = usual(plan, after)
            finally:
                graph = stream.end_capture()
    finally:
        cuda_graphs._GraphSet._replay = saved
        cuda_graphs._StaticInputs.upload = upload
    host_us = (time.perf_counter() - t0) * 1e6
    key = (pre, tuple(plan.request_ids), tuple(ran))
    earlier = recordings.get(key)
    if earlier is None:
        recordings[key] = (graph, pool)
        probe["recorded"] = probe.get("recorded", 0) + 1
        if hasattr(graph, "upload"):
            graph.upload(stream)
        launched = graph
    else:
        probe["replayed"] = probe.get("replayed", 0) + 1
        launched = earlier[0]
    t1 = time.perf_counter()
    launched.launch(stream)
    probe.setdefault("launch_host_us", []).append((time.perf_counter() - t1) * 1e6)
    probe.setdefault("record_host_us", []).append(host_us)
    stream.synchronize()
    _restore(events)
    probe["keys"] = len(recordings)
    return flight


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("model_dir", nargs="?", default="engine/bundled/model")
    p.add_argument("--captures", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--phases", action="store_true",
                   help="every other usual launch split into its parts' GPU time (events between them)")
    p.add_argument("--spin-ms", type=float, default=3.0, help="a GPU spin before each timed launch (0: none)")
    p.add_argument("--replay", action="store_true",
                   help="launch an earlier recording again for each steady continuation with its key (docstring)")
    args = p.parse_args()
    prompts = text_workload(BUNDLED_PROMPTS, _tokenizer(args.model_dir), args.requests).prompt_ids
    result: dict = {"requests": args.requests, "tokens": args.tokens, "spin_ms": args.spin_ms}
    reference = run(args.model_dir, prompts, args.tokens, None)
    probe = {"captures": args.captures, "requests": args.requests, "spin_ms": args.spin_ms, "phases": args.phases,
             "replay": args.replay}
    try:
        probed = run(args.model_dir, prompts, args.tokens, probe)
    except Exception as e:         # noqa: BLE001 - a failed capture ends the probed run
        probed = {}
        result["probed_run_error"] = f"{type(e).__name__}: {e}"[:1500]
    for a in probe.get("attempts", []):
        a.pop("graph", None)
    probe.pop("recordings", None)
    probe.pop("pools", None)
    split = probe.get("phase_split")
    if split is not None:
        result["phase_gpu_us_median"] = {k: _median(v) for k, v in split.phase_us.items()}
        result["phase_launches"] = max(map(len, split.phase_us.values()), default=0)
    same = sum(probed.get(rid) == toks for rid, toks in reference.items())
    result.update(
        attempts=probe.get("attempts"), eligible=probe.get("eligible"), integrity=probe.get("integrity"),
        requests_equal=f"{same} of {len(reference)}" if probed else None,
        usual_host_us_median=_median(probe.get("usual_host_us")), usual_gpu_us_median=_median(probe.get("usual_gpu_us")),
        graph_launch_host_us=[round(x, 1) for x in probe.get("graph_launch_host_us", [])],
        graph_gpu_us=[round(x, 1) for x in probe.get("graph_gpu_us", [])])
    if args.replay:
        result.update(recorded=probe.get("recorded", 0), replayed=probe.get("replayed", 0), keys=probe.get("keys"),
                      record_host_us_median=_median(probe.get("record_host_us")),
                      launch_host_us_median=_median(probe.get("launch_host_us")))
    print(json.dumps({k: v for k, v in result.items() if k != "attempts"}, indent=1))
    for a in result["attempts"] or []:
        print(json.dumps({k: v for k, v in a.items() if k != "trace"})[:1500])
    Path(args.out).write_text(json.dumps(result, indent=1))


def _median(xs):
    return round(statistics.median(xs), 1) if xs else None


def _tokenizer(model_dir: str):
    from mtpserve.engine.tokenizer import Tokenizer
    return Tokenizer(model_dir).encode


if __name__ == "__main__":
    sys.exit(main())
