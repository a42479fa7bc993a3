"""Where an eager prompt step's time goes, and what a captured one would cost (and whether a
captured one stays exact when its requests' prompt lengths change between replays).

    python3 prefill_cost.py MODEL_DIR OUT.json [--shapes 1x96,4x96,16x96,16x32] [--no-kernels]

A bare ORT session of the paged export (no engine), prompts of B requests x P tokens from an
empty state. For each shape:
  eager      wall ms of the shape's first Run, then of one Run (median of 10, synchronised), and,
             with torch's profiler (CUPTI
             sees every kernel in the process), the GPU time of the run's kernels by op family
  graph      the same step captured (enable_cuda_graph=1, its own gpu_graph_id), wall ms of a
             replay, and its logits against the eager run's
  repacked   the captured step replayed with other prompt lengths of the same total (the packed
             ranges, positions and tokens copied into the same buffers; attention_metadata fixed
             at capture to [B*P, B*P, 1]), and with some requests of 0 tokens: its logits and
             present states against an eager run of that packing. Exact means a prompt step could
             replay one graph per (padded batch, padded token count) whatever its split.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import defaultdict

import numpy as np

try:                                    # CUPTI via torch's profiler, where torch is installed
    import torch
    from torch.profiler import ProfilerActivity, profile
except ImportError:                     # pragma: no cover - the device has it
    torch = None
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

ort.preload_dlls()
import cupy as cp  # noqa: E402

NP = {1: np.float32, 10: np.float16, 6: np.int32, 7: np.int64}
HOST = {"attention_metadata", "state_update_active"}


class Model:
    def __init__(self, model_dir: str, max_batch: int, max_tokens: int, block_size: int | None = None):
        config = json.load(open(f"{model_dir}/genai_config.json"))
        cfg = config["model"]
        self.dir, self.vocab = model_dir, int(cfg["vocab_size"])
        self.block = block_size or int(config["engine"]["dynamic_batching"]["block_size"])
        g = onnx.load(f"{model_dir}/model.onnx", load_external_data=False).graph

        def spec(v):
            t = v.type.tensor_type
            return NP[t.elem_type], [d.dim_param or d.dim_value for d in t.shape.dim]
        self.inputs = {v.name: spec(v) for v in g.input}
        self.outputs = {v.name: spec(v) for v in g.output}
        self.width = -(-max_tokens // self.block) + 1
        self.num_blocks = 1 + max_batch * self.width          # block 0: scratch
        self.kv = {n: cp.zeros(self.dims(s, 1, 1), dt) for n, (dt, s) in self.inputs.items()
                   if n.startswith("past_key_values")}
        self.sessions = {}

    def dims(self, shape, B, T):
        named = {"num_tokens": T, "batch_size": B, "batch_size + 1": B + 1, "num_blocks": self.num_blocks,
                 "block_size": self.block, "max_num_blocks": self.width}
        return [d if isinstance(d, int) else named[d] for d in shape]

    def session(self, graph: bool, profile_prefix: str | None = None):
        if graph not in self.sessions:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            if profile_prefix:
                so.enable_profiling, so.profile_file_prefix = True, profile_prefix
            so.enable_mem_pattern = False
            opts = {"device_id": 0, **({"enable_cuda_graph": "1"} if graph else {})}
            self.sessions[graph] = ort.InferenceSession(f"{self.dir}/model.onnx", so,
                                                        providers=[("CUDAExecutionProvider", opts)])
        return self.sessions[graph]

    def arrays(self, lengths: list[int], tokens: np.ndarray, meta: list[int]) -> dict:
        B, T = len(lengths), int(sum(lengths))
        tables = np.zeros((B, self.width), np.int32)
        for b, n in enumerate(lengths):
            used = -(-n // self.block)
            tables[b, :used] = 1 + b * self.width + np.arange(used)
        pos = np.concatenate([np.arange(n) for n in lengths]) if T else np.zeros(0, np.int64)
        a = {"input_ids": tokens[:T].astype(np.int64), "position_ids": np.broadcast_to(pos, (3, T)).astype(np.int64).copy(),
             "cumulative_sequence_lengths": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
             "past_sequence_lengths": np.zeros(B, np.int32), "block_table": tables,
             "attention_metadata": np.asarray(meta, np.int32),
             "state_update_capture_count": np.zeros(B, np.int32), "state_update_active": np.zeros(1, np.int32)}
        for n, (dt, s) in self.inputs.items():
            if n.startswith("past."):
                a[n] = np.zeros(self.dims(s, B, 1), dt)
        return a


class Bound:
    """Every input and output of one Run at a fixed address (what a captured graph needs)."""

    def __init__(self, model: Model, sess, arrays: dict, B: int, T: int):
        self.io, self.sess, self.buf, self.out = sess.io_binding(), sess, {}, {}
        for name in model.inputs:
            if name.startswith("past_key_values"):
                arr = model.kv[name]
            elif name in HOST:
                arr = np.ascontiguousarray(arrays[name])
            else:
                arr = cp.asarray(arrays[name])
            self.buf[name] = arr
            host = isinstance(arr, np.ndarray)
            self.io.bind_input(name, "cpu" if host else "cuda", 0, arr.dtype.type, list(arr.shape),
                               arr.ctypes.data if host else arr.data.ptr)
        for name, (dt, shape) in model.outputs.items():
            past = name.replace("present.", "past_key_values.")
            arr = model.kv[past] if past in model.kv else cp.empty(model.dims(shape, B, T), dt)
            self.out[name] = arr
            self.io.bind_output(name, "cuda", 0, arr.dtype.type, list(arr.shape), arr.data.ptr)

    def update(self, arrays: dict) -> None:
        for name, arr in arrays.items():
            if name in HOST or name.startswith("past_key_values"):
                continue
            self.buf[name].set(np.ascontiguousarray(arr, dtype=self.buf[name].dtype))

    def run(self, options=None) -> None:
        self.sess.run_with_iobinding(self.io, options)


def wall_ms(fn, n: int = 10) -> float:
    times = []
    for _ in range(n):
        cp.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        fn()
        cp.cuda.runtime.deviceSynchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


FAMILIES = [("gated_delta|gdn|delta", "GatedDeltaNet"), ("conv", "causal conv"), ("paged|flash|fmha|attention|cudnn", "attention"),
            ("gemm|gemv|cublas|cutlass|sm90|xmma|matmul", "GEMM"), ("norm", "norms"), ("rotary|rope", "rotary")]


def family(kernel: str) -> str:
    k = kernel.lower()
    return next((name for pat, name in FAMILIES if re.search(pat, k)), "other")


def kernel_times(fn) -> dict:
    """GPU time of fn's kernels (one call, after a warm one), by family and the top kernels."""
    fn()
    cp.cuda.runtime.deviceSynchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        cp.cuda.runtime.deviceSynchronize()
    by_family, by_kernel, count = defaultdict(float), defaultdict(float), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            us = e.device_time
            by_family[family(e.name)] += us / 1e3
            by_kernel[e.name[:90]] += us / 1e3
            count += 1
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:8]
    return {"kernels": count, "gpu_ms": round(sum(by_family.values()), 3),
            "by_family_ms": {k: round(v, 3) for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": {k: round(v, 3) for k, v in top}}


def compare(model: Model, bound: Bound, ref: Bound, B: int) -> dict:
    err = {}
    states = tuple(n for n in model.outputs if n.startswith("present.") and n.replace("present.", "past_key_values.") not in model.kv)
    for name in ("logits",) + states:
        a = cp.asnumpy(bound.out[name][:B] if name.startswith("present.") else bound.out[name]).astype(np.float32)
        b = cp.asnumpy(ref.out[name][:B] if name.startswith("present.") else ref.out[name]).astype(np.float32)
        err[name] = float(np.abs(a - b).max()) if a.size else 0.0
    return {"logits_maxerr": err.pop("logits"), "states_maxerr": max(err.values(), default=0.0)}


def first_call_nodes(model: Model, shapes: list, prefix: str) -> list[dict]:
    """Each shape's first and second eager Run under ORT's profiler: the nodes that paid most."""
    sess = model.session(False, prefix)
    rng = np.random.default_rng(0)
    walls = []
    for B, P in shapes:
        T = B * P
        bound = Bound(model, sess, model.arrays([P] * B, rng.integers(3, model.vocab, T), [T, T, 1]), B, T)
        walls.append((B, P, wall_ms(bound.run, 1), wall_ms(bound.run, 1)))
    events = json.load(open(sess.end_profiling()))
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    out = []
    for i, (B, P, first, second) in enumerate(walls):
        per = []
        for run in runs[2 * i:2 * i + 2]:
            lo, hi = run["ts"], run["ts"] + run["dur"]
            d = defaultdict(float)
            for e in nodes:
                if lo <= e["ts"] <= hi:
                    d[(e["name"][:-len("_kernel_time")], e.get("args", {}).get("op_name", ""))] += e["dur"] / 1e3
            per.append(d)
        if len(per) < 2:
            continue
        gap = sorted(((per[0][k] - per[1].get(k, 0.0), k) for k in per[0]), reverse=True)[:6]
        rec = {"batch": B, "prompt": P, "first_ms": round(first, 2), "second_ms": round(second, 2),
               "paid_by": [{"node": k[0], "op": k[1], "extra_ms": round(g, 2)} for g, k in gap if g > 0.2]}
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--shapes", default="1x16,1x96,1x256,4x96,16x32,16x96")
    p.add_argument("--no-kernels", action="store_true")
    p.add_argument("--ort-profile", action="store_true")
    p.add_argument("--gemm-warm", type=int, default=0)
    p.add_argument("--block-size", type=int, help="KV block size in tokens (default: the export's)")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    model = Model(args.model_dir, max(b for b, _ in shapes), max(b * n for b, n in shapes), args.block_size)
    warm = None
    if args.gemm_warm:
        from mtpserve.engine.gemm_warmup import model_gemm_shapes, warm_up_gemms
        from mtpserve.engine.manifest import load_manifest
        mtp = load_manifest(args.model_dir).mtp
        files = ["model.onnx"] + ([mtp.filename] if mtp is not None else [])
        gemms = model_gemm_shapes(args.model_dir, files)
        seconds = warm_up_gemms(gemms, args.gemm_warm, [("CUDAExecutionProvider", {"device_id": 0})], cp)
        warm = {"rows": args.gemm_warm, "shapes": sorted(gemms), "seconds": round(seconds, 2)}
        print(f"# gemm warm-up: {len(gemms)} shapes at 1..{args.gemm_warm} rows in {seconds:.2f} s", flush=True)
    if args.ort_profile:
        json.dump({"model": args.model_dir, "ort": ort.__version__, "gemm_warm": warm,
                   "first_calls": first_call_nodes(model, shapes, args.out.replace(".json", "-ort"))},
                  open(args.out, "w"), indent=1)
        return
    rng = np.random.default_rng(0)
    result = {"model": args.model_dir, "ort": ort.__version__, "block_size": model.block, "gemm_warm": warm, "shapes": []}
    for gid, (B, P) in enumerate(shapes, start=1):
        T = B * P
        rec = {"batch": B, "prompt": P, "tokens": T}
        tokens = rng.integers(3, model.vocab, T)
        meta = [T, T, 1]                              # loose: any split of T tokens fits under it
        uniform = model.arrays([P] * B, tokens, meta)
        eager = Bound(model, model.session(False), uniform, B, T)
        rec["eager_first_ms"] = round(wall_ms(eager.run, 1), 3)        # this shape's first call
        rec["eager_ms"] = round(wall_ms(eager.run), 3)
        exact = Bound(model, model.session(False), model.arrays([P] * B, tokens, [P, P, P]), B, T)
        rec["eager_exact_meta_first_ms"] = round(wall_ms(exact.run, 1), 3)
        rec["eager_exact_meta_ms"] = round(wall_ms(exact.run), 3)
        if torch is not None and not args.no_kernels:
            rec["eager_kernels"] = kernel_times(eager.run)
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(gid))
        graph = Bound(model, model.session(True), uniform, B, T)
        t0 = time.perf_counter()
        graph.run(options)
        cp.cuda.runtime.deviceSynchronize()
        rec["capture_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        graph.run(options)
        eager.run()
        rec["graph_ms"] = round(wall_ms(lambda: graph.run(options)), 3)
        rec["graph_vs_eager"] = compare(model, graph, eager, B)
        repacks = []
        splits = [list(rng.multinomial(T - B, [1 / B] * B) + 1)] if B > 1 else []
        if B > 1:
            zeroed = [0] * B
            zeroed[0] = T                             # one request takes every token, the rest none
            splits.append(zeroed)
        if B >= 4 and B % 2 == 0:
            half = [0] * B
            for b in range(0, B, 2):
                half[b] = 2 * P                       # every other request empty
            splits.append(half)
        for split in splits:
            arrays = model.arrays(split, tokens, meta)
            graph.update(arrays)
            graph.run(options)
            ref = Bound(model, model.session(False), arrays, B, T)
            ref.run()
            cp.cuda.runtime.deviceSynchronize()
            repacks.append({"lengths": [int(x) for x in split], **compare(model, graph, ref, B)})
        rec["repacked"] = repacks
        print(json.dumps(rec), flush=True)
        result["shapes"].append(rec)
    json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
