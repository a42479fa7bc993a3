"""Can ORT capture a *varlen* step (prompt chunks and decode rows of different lengths in one
forward, ``cumulative_sequence_lengths`` on the device) as a CUDA graph, and replay it exactly
for other lengths that fill the same number of rows?

    python3 prompt_capture_probe.py OUT.json [MODEL_DIR] [--rows 256] [--batch 32]

Why: a step that feeds a prompt runs ORT eagerly. Session 30's py-spy of a K=2 loop at C=16
(bundled) put ORT's eager runs at 15% of the loop's wall time, ~2.5 ms of host time a prompt step
(65% of what prompt steps cost), where a replay's call costs ~2 us; at C=16 prompt steps are 23%
of a K=2 loop's time and 13% of K=0's. A captured prompt step would be keyed on (padded batch,
total rows, table width, bank) with the rows split among requests on the device; this asks
whether ORT's kernels allow that.

One CUDA engine (bundled, K=0, graphs as served). A binding of our own for ``--batch`` requests
and ``--rows`` rows in all (the uniform shape batch x rows/batch, its ranges then rewritten),
bank 0 -> 1 at state rows 0 .. batch-1, ``attention_metadata`` loose: [rows, width x block, 1]:
  A   16 prompts of mixed lengths from an empty state, each on blocks of its own; the slots after
      them zero-length requests, and one padding request on the scratch block that takes the
      rows left over
  C   a mixed step after A: 15 requests decode one row each from A's state (bank 1 copied into
      bank 0) at their A lengths, one feeds a 50-row chunk, the padding request the rest
  B   other lengths from an empty state (two requests zero-length), run last: it rewrites A's blocks
For each: ORT's eager run of the binding (graph id -1) against the engine's own eager path
(``Runner.run_main`` with the rows as a real step builds them: tight metadata, no padding), then
the binding captured by ORT (a graph id of its own, captured on A's inputs) and replayed on C's
and B's inputs: logits of every real row and the present states of every real request, max
abs error against the engine's eager run. Costs: host / GPU us of an eager run against a replay,
of the eager run with B's longest range (the padding request's) as ``max_query_len`` (does the loose bound cost GPU
time: session 35 measured the replay of 256 rows in 32 slots at ~2.1 ms of GPU time), and of the
engine's own eager path on B's rows (tight bounds, no padding slots).
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback

import cupy as cp
import numpy as np
import onnxruntime as ort
from eager_capture_probe import maxerr, timed  # (this directory: the scripts run as files)

from mtpserve.engine.config import EngineConfig
from mtpserve.engine.cuda_graphs import GraphShape, _paged_graph_inputs
from mtpserve.engine.engine import Engine
from mtpserve.engine.runner import PackedRows


def options(graph_id: int) -> ort.RunOptions:
    o = ort.RunOptions()
    o.add_run_config_entry("gpu_graph_id", str(graph_id))
    o.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return o


class VarlenStep:
    """The probe's binding: ``batch`` requests, ``rows`` rows in all, ranges set per case."""

    def __init__(self, engine: Engine, batch: int, rows: int, width: int):
        r, m, xp = engine.runner, engine.runner.manifest, cp
        assert rows % batch == 0, "rows must be a multiple of batch (the helper's uniform layout)"
        self.engine, self.batch, self.rows, self.width = engine, batch, rows, width
        self.block_size = m.block_size
        shape = GraphShape(batch, rows // batch, width, 0)
        self.binding, self.inputs, self.host_arrays = _paged_graph_inputs(
            r.session, r.kv, r.main_input_names, shape, m.block_size, xp,
            {"state_update_active": np.array([0], np.int32)})
        self.host_arrays[0][:] = [rows, width * m.block_size, 1]     # loose bounds (bound by pointer)
        if "state_update_capture_count" in self.inputs.host:
            self.inputs.writable()["state_update_capture_count"][:] = 0
        bank = engine.state_bank
        index = {layer_id: i for i, layer_id in enumerate(bank.spec.layer_ids)}
        C = m.capture_capacity
        self.scratch = []
        for layer in m.conv_layers:
            i = index[layer.layer_id]
            self.binding.bind_at(layer.state_input, bank.conv[i, 0, :batch])
            self.binding.bind_at(layer.state_output, bank.conv[i, 1, :batch], output=True)
            self.scratch.append(xp.empty((batch, C, layer.conv_dim), layer.dtype))
            self.binding.bind_at(layer.capture_output, self.scratch[-1], output=True)
        for layer in m.recurrent_layers:
            i = index[layer.layer_id]
            self.binding.bind_at(layer.state_input, bank.recurrent[i, 0, :batch])
            self.binding.bind_at(layer.state_output, bank.recurrent[i, 1, :batch], output=True)
            self.scratch.append(xp.empty((batch, C * layer.capsule_width_per_token), np.float32))
            self.binding.bind_at(layer.capture_output, self.scratch[-1], output=True)
        self.logits = xp.empty((rows, m.vocab_size), m.compute_dtype)
        self.hidden = xp.empty((rows, m.hidden_size), r.hidden_dtype)
        self.binding.bind_at(m.logits_output, self.logits, output=True)
        self.binding.bind_at(m.hidden_output, self.hidden, output=True)

    def stage(self, requests: list[tuple[list[int], int, list[int]]]) -> list[int]:
        """``requests[b] = (token ids, past length, block table)`` for b < len(requests) (a
        zero-length request: no ids); then zero-length slots, and the last slot a padding
        request on the scratch block taking the rows left. Returns each real row's index."""
        host = self.inputs.writable()
        n = sum(len(ids) for ids, _, _ in requests)
        assert len(requests) < self.batch and n <= self.rows
        lengths = [len(ids) for ids, _, _ in requests] + [0] * (self.batch - 1 - len(requests)) + [self.rows - n]
        host["cumulative_sequence_lengths"][:] = np.concatenate([[0], np.cumsum(lengths)])
        past = [p for _, p, _ in requests] + [0] * (self.batch - len(requests))
        host["past_sequence_lengths"][:] = past
        host["input_ids"][:] = 0
        host["input_ids"][:n] = [t for ids, _, _ in requests for t in ids]
        pos = np.concatenate([p + np.arange(k) for p, k in zip(past, lengths)]).astype(np.int64)
        host["position_ids"][:] = pos
        table = host["block_table"]
        table[:] = 0
        for b, (_, _, blocks) in enumerate(requests):
            table[b, :len(blocks)] = blocks[:self.width]
        self.inputs.upload()
        return list(range(n))

    def run(self, graph_id: int) -> None:
        self.engine.runner.session.run_with_iobinding(self.binding.io, options(graph_id))


def engine_eager(engine: Engine, requests, batch: int):
    """The engine's own eager forward of ``requests`` (``Runner.run_main``: tight metadata, no
    padding) from state rows 0..B-1 of bank 0, present into bank-1-shaped copies: (logits of
    every row, present recurrent states of the B requests, present conv states)."""
    bank, B = engine.state_bank, len(requests)
    rows = [PackedRows(list(ids), past, list(blocks)) for ids, past, blocks in requests]
    past = bank.conv[:, 0, :B], bank.recurrent[:, 0, :B]
    present = (cp.empty_like(past[0]), cp.empty_like(past[1]))
    out = engine.runner.run_main(rows, past_states(bank, 0, B), np.zeros(B, np.int32),
                                 present_into=present_states(bank, present))
    return out.logits.copy(), present[1].copy(), present[0].copy()


def past_states(bank, which: int, B: int):
    from mtpserve.engine.state_bank import StepStates
    return StepStates(bank.spec.layer_ids, bank.conv[:, which, :B], bank.recurrent[:, which, :B])


def present_states(bank, arrays):
    from mtpserve.engine.state_bank import StepStates
    return StepStates(bank.spec.layer_ids, arrays[0], arrays[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("model_dir", nargs="?", default="engine/bundled/model")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    result: dict = {"rows": args.rows, "batch": args.batch}
    engine = Engine(EngineConfig(args.model_dir, device="cuda", num_threads=1, max_model_len=512))
    stream, bank, bs = engine._stream, engine.state_bank, engine.manifest.block_size
    width = engine.graphs.catalog.width_for(512)
    rng = np.random.default_rng(0)
    per = width                                      # blocks a request (its own, after the scratch block)
    assert 1 + 16 * per <= engine.kv_pool.num_blocks, "the pool holds 16 requests' tables"
    assert bank.conv.shape[2] >= args.batch, f"the bank's {bank.conv.shape[2]} rows hold --batch"
    tables = [list(range(1 + b * per, 1 + (b + 1) * per)) for b in range(16)]
    la = [40, 7, 1, 3, 20, 2, 9, 1, 15, 5, 30, 1, 4, 11, 8, 6]       # 163 rows
    lb = [12, 0, 25, 1, 1, 0, 60, 2, 2, 3, 7, 1, 1, 20, 9, 30]       # 174 rows
    A = [(rng.integers(3, 4000, n).tolist(), 0, t) for n, t in zip(la, tables)]
    B = [(rng.integers(3, 4000, n).tolist(), 0, t) for n, t in zip(lb, tables)]
    C = [(rng.integers(3, 4000, 50 if b == 4 else 1).tolist(), la[b], t) for b, t in enumerate(tables)]
    result.update(lengths_a=la, lengths_b=lb, lengths_c=[len(x[0]) for x in C], width=width, block_size=bs)
    with engine.device_context(), stream:
        step = VarlenStep(engine, args.batch, args.rows, width)
        cases = {}
        try:
            # (C reads A's KV: it runs before B rewrites those blocks)
            for name, reqs, from_a in (("A", A, False), ("C", C, True), ("B", B, False)):
                for i in range(bank.conv.shape[0]):
                    if from_a:        # C continues A: A's present (bank 1) as the past
                        bank.conv[i, 0, :16] = cases["A"]["present"][1][i]
                        bank.recurrent[i, 0, :16] = cases["A"]["present"][0][i]
                    else:
                        bank.conv[i, 0, :args.batch] = 0
                        bank.recurrent[i, 0, :args.batch] = 0
                ref_logits, ref_rec, ref_conv = engine_eager(engine, [x for x in reqs if x[0]], 16)
                real = step.stage(reqs)
                step.run(-1)
                stream.synchronize()
                nz = [b for b, x in enumerate(reqs) if x[0]]
                case = {"present": (bank.recurrent[:, 1, :16].copy(), bank.conv[:, 1, :16].copy())}
                # the engine's eager path was given the non-empty requests only: compare those
                eager_logits = step.logits[:len(real)].copy()
                case["eager_vs_engine_logits"] = maxerr(eager_logits, ref_logits[:len(real)])
                case["eager_vs_engine_recurrent"] = maxerr(bank.recurrent[:, 1, nz], ref_rec)
                case["eager_vs_engine_conv"] = maxerr(bank.conv[:, 1, nz], ref_conv)
                if name == "A":
                    step.run(7001)                   # ORT: warm-up runs, then the capture
                    step.run(7001)
                else:
                    step.stage(reqs)
                    step.run(7001)                   # a replay on this case's inputs
                stream.synchronize()
                case["replay_vs_engine_logits"] = maxerr(step.logits[:len(real)], ref_logits[:len(real)])
                case["replay_vs_engine_recurrent"] = maxerr(bank.recurrent[:, 1, nz], ref_rec)
                case["replay_vs_engine_conv"] = maxerr(bank.conv[:, 1, nz], ref_conv)
                case["replay_vs_eager_logits"] = maxerr(step.logits[:len(real)], eager_logits)
                cases[name] = case
                print(name, {k: v for k, v in case.items() if k != "present"}, flush=True)
            result["cases"] = {k: {kk: vv for kk, vv in v.items() if kk != "present"} for k, v in cases.items()}
            result["eager_us"] = timed(lambda: step.run(-1), stream, 50)
            result["replay_us"] = timed(lambda: step.run(7001), stream, 50)
            # does the loose bound cost GPU time? B's rows eager with max_query_len its longest range
            # (the padding request's 82 rows) instead of all the rows, then the engine's own eager
            # path (tight, no padding slots)
            step.host_arrays[0][0] = max(max(lb), args.rows - sum(lb))
            result["eager_tight_us"] = timed(lambda: step.run(-1), stream, 50)
            step.host_arrays[0][0] = args.rows
            real_b = [x for x in B if x[0]]
            result["engine_eager_us"] = timed(lambda: engine_eager(engine, real_b, 16), stream, 20)
        except Exception as e:      # noqa: BLE001 - where it broke is the finding
            result["error"] = f"{type(e).__name__}: {e}"[:1500]
            result["trace"] = traceback.format_exc()[-3000:]
    print(json.dumps({k: v for k, v in result.items() if k != "trace"}, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
