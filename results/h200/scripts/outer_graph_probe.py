"""Can ONNX Runtime's graph replays be captured inside a CUDA graph of our own, so a whole step
(staging upload, ORT's replays, our kernels between them) launches in one call?

    python3 outer_graph_probe.py OUT.json [MODEL_DIR]

Every ORT replay costs ~0.1 ms of host time (``run_with_iobinding``); a K=2 step makes three (head
catch-up, chained head, verify) beside CuPy launches, and its host time, not the GPU's, keeps MTP
below its GPU ceiling (~1.6x at C=1 on the bundled model). If ORT's replay only queues
``cudaGraphLaunch`` on the engine's stream (``user_compute_stream``), stream capture records it as
a child graph, and the outer graph replays everything for one ``cudaGraphLaunch``.

One CUDA engine (bundled, K=0, graphs captured as served). The decode graph of batch 4:
  reference   ORT's replay; logits copied
  capture     stream capture on the engine's stream of: ORT's replay, an argmax of its logits
              (CuPy), ORT's replay again, a copy of its logits (errors recorded, with the call)
  exact       the outer graph launched: its logits and argmax against the reference
  new inputs  other token ids written into the graph's input buffer (on the device), then the
              outer graph against ORT's replay of the same inputs
  cost        host us per launch, ORT replay vs outer graph (200 each, back to back), and GPU
              time per launch (CUDA events)
"""
from __future__ import annotations

import json
import sys
import time
import traceback

import cupy as cp
import numpy as np

from mtpserve.engine.config import EngineConfig, SpecConfig
from mtpserve.engine.cuda_graphs import GraphShape
from mtpserve.engine.engine import Engine


def main(out_path: str, model_dir: str) -> None:
    result: dict = {}
    engine = Engine(EngineConfig(model_dir, device="cuda", num_threads=1, spec=SpecConfig(0), max_model_len=512))
    g, stream = engine.graphs, engine._stream
    shape = GraphShape(g.catalog.batch_for(4), 1, min(g.catalog.table_widths), 0)
    graph = g._graphs[shape]
    B = shape.batch
    ids = graph.inputs.device["input_ids"]
    rng = np.random.default_rng(0)
    with stream:
        ids[:] = cp.asarray(rng.integers(3, 4000, B), dtype=ids.dtype)
        g._replay(graph)
        stream.synchronize()
        reference = g.logits[:B].copy()
        argmax_out = cp.zeros(B, cp.int64)
        logits_out = cp.zeros_like(reference)
        cp.argmax(g.logits[:B], axis=1, out=argmax_out)          # CuPy's kernels built before the capture
        logits_out[...] = g.logits[:B]
        stream.synchronize()
        outer = None
        try:
            stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
            step = "ORT replay 1"
            g._replay(graph)
            step = "argmax"
            cp.argmax(g.logits[:B], axis=1, out=argmax_out)
            step = "ORT replay 2"
            g._replay(graph)
            step = "copy"
            logits_out[...] = g.logits[:B]
            step = "end_capture"
            outer = stream.end_capture()
            result["capture"] = "ok"
        except Exception as e:  # record where capture broke
            result["capture"] = f"failed at {step}: {type(e).__name__}: {e}"[:1500]
            result["trace"] = traceback.format_exc()[-2500:]
            try:
                if stream.is_capturing():
                    stream.end_capture()
            except Exception as e2:
                result["end_capture_after_failure"] = f"{type(e2).__name__}: {e2}"[:500]
        print(json.dumps({"capture": result["capture"]}), flush=True)
        if outer is not None:
            try:
                logits_out[...] = 0
                outer.launch(stream)
                stream.synchronize()
                result["exact_logits_maxerr"] = float(cp.abs(logits_out.astype(cp.float32) - reference.astype(cp.float32)).max())
                result["exact_argmax_equal"] = bool((argmax_out == reference.argmax(axis=1)).all())
                ids[:] = cp.asarray(rng.integers(3, 4000, B), dtype=ids.dtype)       # new inputs, same buffer
                outer.launch(stream)
                stream.synchronize()
                from_outer = logits_out.copy()
                g._replay(graph)
                stream.synchronize()
                result["new_inputs_logits_maxerr"] = float(cp.abs(from_outer.astype(cp.float32) - g.logits[:B].astype(cp.float32)).max())
                result["new_inputs_differ_from_reference"] = bool(cp.abs(from_outer - reference).max() > 0)
                for name, fn in (("ort_replay", lambda: g._replay(graph)), ("outer_graph", lambda: outer.launch(stream))):
                    for _ in range(20):
                        fn()
                    stream.synchronize()
                    start, end = cp.cuda.Event(), cp.cuda.Event()
                    start.record(stream)
                    t0 = time.perf_counter()
                    for _ in range(200):
                        fn()
                    host = (time.perf_counter() - t0) / 200 * 1e6
                    end.record(stream)
                    end.synchronize()
                    result[f"{name}_host_us"] = round(host, 2)
                    result[f"{name}_gpu_us"] = round(cp.cuda.get_elapsed_time(start, end) / 200 * 1e3, 2)
                result["note"] = "outer_graph runs two ORT replays, an argmax and a copy; ort_replay one replay"
            except Exception as e:
                result["launch_error"] = f"{type(e).__name__}: {e}"[:1500]
                result["trace"] = traceback.format_exc()[-2500:]
    print(json.dumps(result, indent=1), flush=True)
    json.dump(result, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "engine/bundled/model")
