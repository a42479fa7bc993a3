"""Can a CUDA graph of our own record ONNX Runtime's EAGER run of a step, so a whole step (the
main forward, the head's forwards, our kernels between them) launches in one call?

    python3 eager_capture_probe.py OUT.json [MODEL_DIR]

Session at (``outer_graph_probe.py``) found that ORT's *replay* cannot go inside a stream capture
of ours: its ``cudaGraphLaunch`` failed with CUDA error 900 (its replay synchronises). Untried:
capturing ORT's eager ``Run`` (``gpu_graph_id`` -1, ``disable_synchronize_execution_providers``)
the way ORT captures its own graphs, after two warm-up runs of the shape so its arena holds every
buffer the run takes (a capture must not allocate). If that works, a step's three ORT replays
(session 24 put them at ~0.1 ms of host time each; this probe's first run, session 27, at
~4 us for the call itself) and its ~10 CuPy launches become one
``cudaGraphLaunch`` of ~10 us: at C=16 a K=2 step's launch was 0.64 ms of host time against its
~0.67 ms of GPU work, so the step would turn GPU-bound.

What ORT's eager run leaves in such a graph: the addresses of its intermediate buffers, taken
from its arena and freed when the run ends. ORT's own graphs rely on the same thing (every one
aliases the arena, safe while everything runs in order on one stream, the arena never shrinking).

One CUDA engine (bundled, K=0 / K=2 as asked, graphs captured as served). For the decode graph of
batch 4 (its fixed input / output buffers and binding):
  reference   ORT's replay of its own graph; logits copied
  eager       the same binding run eagerly (graph id -1): logits against the reference
  capture     stream capture (relaxed) on the engine's stream of: the eager run, an argmax of its
              logits (CuPy), a copy of the logits; the error and the call where it broke, if any
  exact       our graph launched, then again after new token ids go into the input buffer (on the
              device): logits against ORT's replay of the same inputs
  composed    with an MTP engine: the main decode run, then the head's one-row forward on its
              hidden rows, in one capture (two sessions in one graph): the head's logits against
              eager runs of both
  cost        host us and GPU us per launch: ORT replay against our graph (200 each)
"""
from __future__ import annotations

import json
import sys
import time
import traceback

import cupy as cp
import numpy as np
import onnxruntime as ort

from mtpserve.engine.config import EngineConfig, SpecConfig
from mtpserve.engine.cuda_graphs import GraphShape, _fill_rows
from mtpserve.engine.engine import Engine
from mtpserve.engine.runner import PackedRows


def eager_options() -> ort.RunOptions:
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", "-1")                      # no capture, no replay
    options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return options


def capture(stream, calls: list[tuple[str, object]], result: dict, key: str):
    """Our graph of ``calls`` (name, fn) captured on ``stream``, or None (why, in ``result``)."""
    step = "begin_capture"
    try:
        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        for step, fn in calls:
            fn()
        step = "end_capture"
        graph = stream.end_capture()
        result[key] = "ok"
        return graph
    except Exception as e:        # noqa: BLE001 - where the capture broke is the finding
        result[key] = f"failed at {step}: {type(e).__name__}: {e}"[:1500]
        result[key + "_trace"] = traceback.format_exc()[-2500:]
        try:
            if stream.is_capturing():
                stream.end_capture()
        except Exception as e2:   # noqa: BLE001
            result[key + "_end_after_failure"] = f"{type(e2).__name__}: {e2}"[:500]
        return None


def timed(fn, stream, n: int = 200) -> tuple[float, float]:
    """(host us, GPU us) per call of ``fn``, ``n`` back to back."""
    for _ in range(20):
        fn()
    stream.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    end.record(stream)
    end.synchronize()
    return round(host, 2), round(cp.cuda.get_elapsed_time(start, end) / n * 1e3, 2)


def maxerr(a, b) -> float:
    return float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max())


def main(out_path: str, model_dir: str) -> None:
    result: dict = {}
    engine = Engine(EngineConfig(model_dir, device="cuda", num_threads=1, spec=SpecConfig(2), max_model_len=512))
    g, stream, session = engine.graphs, engine._stream, engine.runner.session
    shape = GraphShape(g.catalog.batch_for(4), 1, min(g.catalog.table_widths), 0)
    graph = g._graphs[shape]
    B = shape.batch
    ids = graph.inputs.device["input_ids"]
    rng = np.random.default_rng(0)
    eager = eager_options()
    # real rows, each on a block of its own (blocks 1..B of the fresh engine's pools, past 3): with
    # every row padding on the scratch block, the rows race for one KV slot and two eager runs of
    # the same inputs differ (this probe's second run, session 27)
    rows = [PackedRows((), 3, [1 + b]) for b in range(B)]
    for staged in [graph] + ([engine.proposer.graphs._graphs.get(GraphShape(B, 1, shape.table_width, 0))]
                             if engine.proposer is not None else []):
        if staged is not None:
            _fill_rows(staged.inputs.writable(), rows, 1, shape.table_width)
            staged.inputs.upload()
    with stream:
        ids[:] = cp.asarray(rng.integers(3, 4000, B), dtype=ids.dtype)
        for _ in range(2):
            session.run_with_iobinding(graph.binding.io, eager)
        stream.synchronize()
        first_eager = g.logits[:B].copy()
        session.run_with_iobinding(graph.binding.io, eager)
        stream.synchronize()
        result["eager_twice_logits_maxerr"] = maxerr(g.logits[:B], first_eager)     # 0: the rows do not race
        g._replay(graph)
        stream.synchronize()
        reference = g.logits[:B].copy()
        for _ in range(3):                                    # the arena grows to what an eager run takes
            session.run_with_iobinding(graph.binding.io, eager)
        stream.synchronize()
        result["eager_vs_replay_logits_maxerr"] = maxerr(g.logits[:B], reference)
        argmax_out = cp.zeros(B, cp.int64)
        logits_out = cp.zeros_like(reference)
        cp.argmax(g.logits[:B], axis=1, out=argmax_out)       # CuPy's kernels built before the capture
        logits_out[...] = g.logits[:B]
        stream.synchronize()
        ours = capture(stream, [("ORT eager run", lambda: session.run_with_iobinding(graph.binding.io, eager)),
                                ("argmax", lambda: cp.argmax(g.logits[:B], axis=1, out=argmax_out)),
                                ("copy", lambda: logits_out.__setitem__(Ellipsis, g.logits[:B]))], result, "capture")
        print(json.dumps({"capture": result["capture"]}), flush=True)
        if ours is not None:
            try:
                logits_out[...] = 0
                ours.launch(stream)
                stream.synchronize()
                result["exact_logits_maxerr"] = maxerr(logits_out, reference)
                result["exact_argmax_equal"] = bool((argmax_out == reference.argmax(axis=1)).all())
                ids[:] = cp.asarray(rng.integers(3, 4000, B), dtype=ids.dtype)        # new inputs, same buffer
                ours.launch(stream)
                stream.synchronize()
                from_ours = logits_out.copy()
                g._replay(graph)
                stream.synchronize()
                result["new_inputs_logits_maxerr"] = maxerr(from_ours, g.logits[:B])
                result["new_inputs_differ_from_reference"] = bool(cp.abs(from_ours - reference).max() > 0)
                for name, fn in (("ort_replay", lambda: g._replay(graph)), ("our_graph", lambda: ours.launch(stream)),
                                 ("ort_eager", lambda: session.run_with_iobinding(graph.binding.io, eager))):
                    result[f"{name}_host_us"], result[f"{name}_gpu_us"] = timed(fn, stream)
                result["note"] = "our_graph: the eager run, an argmax and a copy; ort_replay / ort_eager: one forward"
            except Exception as e:        # noqa: BLE001
                result["launch_error"] = f"{type(e).__name__}: {e}"[:1500]
                result["launch_trace"] = traceback.format_exc()[-2500:]
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("trace")}), flush=True)

        # two sessions in one graph: the main decode run, then the head's one-row forward on its hidden rows
        hg = engine.proposer.graphs if engine.proposer is not None else None
        head_graph = hg._graphs.get(GraphShape(B, 1, shape.table_width, 0)) if hg is not None else None
        if ours is not None and head_graph is not None:
            head_session = engine.runner.head_session
            hidden_in = hg.hidden_in[:B]

            def main_then_head():
                session.run_with_iobinding(graph.binding.io, eager)
                hidden_in[...] = g.hidden[:B]
                head_session.run_with_iobinding(head_graph.binding.io, eager)
            for _ in range(3):
                main_then_head()
            stream.synchronize()
            head_reference = hg.logits[:B].copy()
            main_reference = g.logits[:B].copy()
            composed = capture(stream, [("main eager, copy, head eager", main_then_head)], result, "composed_capture")
            if composed is not None:
                try:
                    hg.logits[:B] = 0
                    composed.launch(stream)
                    stream.synchronize()
                    result["composed_head_logits_maxerr"] = maxerr(hg.logits[:B], head_reference)
                    # why they part, if they do: per row, the copy, and eager / captured runs against themselves
                    first = hg.logits[:B].copy()
                    result["composed_rows_maxerr"] = [maxerr(first[i], head_reference[i]) for i in range(B)]
                    result["composed_main_logits_maxerr"] = maxerr(g.logits[:B], main_reference)
                    result["composed_copy_equal"] = bool((hidden_in == g.hidden[:B]).all())
                    result["head_past_lengths"] = cp.asnumpy(head_graph.inputs.device["past_sequence_lengths"]).tolist()
                    result["head_block_table_row0"] = cp.asnumpy(head_graph.inputs.device["block_table"][0]).tolist()[:8]
                    composed.launch(stream)
                    stream.synchronize()
                    result["composed_again_maxerr"] = maxerr(hg.logits[:B], first)
                    main_then_head()
                    stream.synchronize()
                    result["eager_again_vs_reference_maxerr"] = maxerr(hg.logits[:B], head_reference)
                    result["eager_again_vs_composed_maxerr"] = maxerr(hg.logits[:B], first)
                    result["composed_host_us"], result["composed_gpu_us"] = timed(lambda: composed.launch(stream), stream)
                    result["two_replays_host_us"], result["two_replays_gpu_us"] = timed(
                        lambda: (g._replay(graph), hidden_in.__setitem__(Ellipsis, g.hidden[:B]), hg._replay(head_graph)),
                        stream)
                except Exception as e:    # noqa: BLE001
                    result["composed_launch_error"] = f"{type(e).__name__}: {e}"[:1500]
        stream.synchronize()
    engine.check_integrity()
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("trace")}, indent=1), flush=True)
    json.dump(result, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "engine/bundled/model")
