"""Where the first engine of a process pays its one slow burst step. One engine, a warm-up phase
of WARM_C concurrent requests, then the timed C=32 phase (fresh 64-token random prompts, 128 tokens).
PROFILE=1: ORT's profiler on the main session; prints the slowest nodes of the run.
Usage: first_burst.py MODEL WARM_C [C] [N] [PLEN]"""
import glob, json, os, sys, time
import numpy as np
import onnxruntime as ort
from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams

model, warm_c = sys.argv[1], int(sys.argv[2])
C = int(sys.argv[3]) if len(sys.argv) > 3 else 32
N = int(sys.argv[4]) if len(sys.argv) > 4 else 64
plen = int(sys.argv[5]) if len(sys.argv) > 5 else 64
profile = os.environ.get("PROFILE") == "1"
if profile:
    _SO = ort.SessionOptions
    class SO(_SO):
        def __init__(self):
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = "/tmp/ortprof"
    ort.SessionOptions = SO
tag = os.environ.get("TAG", f"warm_c={warm_c}")
if os.environ.get("OLD_WARMUP") == "1":           # the warm-up before two waves: one prefill beside one decode
    from mtpserve.engine import engine as engine_mod
    _new = engine_mod.Engine.warm_up_requests
    def _old(self):
        bs, vocab = self.manifest.block_size, self.manifest.vocab_size
        prompt = [(7 * i + 11) % vocab for i in range(3 * bs + 5)]
        n = 2 + 2 * self.max_drafts
        self.add_request("<warm-up-0>", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        self.step()
        self.add_request("<warm-up-1>", prompt[::-1], SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=0, max_tokens=n, ignore_eos=True))
        while self.has_work:
            self.step()
        self.draft_policy.forget_start_up()
        self.num_steps, self.last_step = 0, None
    engine_mod.Engine.warm_up_requests = _old
import gc
_gc_start = {}
def _gc_cb(phase, info):
    if phase == "start":
        _gc_start["t"] = time.perf_counter()
    elif info["generation"] == 2 or time.perf_counter() - _gc_start["t"] > 0.01:
        print(f"{tag}: gc gen {info['generation']} {1e3 * (time.perf_counter() - _gc_start['t']):.1f} ms "
              f"(collected {info['collected']})", flush=True)
gc.callbacks.append(_gc_cb)
_collect = gc.collect
if os.environ.get("NO_GC_COLLECT") == "1":       # the engine's start-up collection left out
    gc.collect = lambda *a: 0
rng = np.random.default_rng(0)
t0 = time.perf_counter()
e = Engine(EngineConfig(model, device="cuda", cache=CacheConfig(max_resident_requests=64, prefix_cache=False),
                        scheduler=SchedulerConfig(max_requests_per_step=64).for_device("cuda")))
gc.collect = _collect
print(f"{tag}: engine up in {time.perf_counter() - t0:.1f} s; {len(gc.get_objects())} objects tracked", flush=True)
vocab = e.manifest.vocab_size
marks = {}
if os.environ.get("STACKS") == "1":                # where each CuPy compile of the timed phase comes from
    import traceback
    from cupy.cuda import compiler as _compiler
    for _name in ("_compile_module_with_cache", "compile_with_cache"):
        _orig = getattr(_compiler, _name, None)
        if _orig is None:
            continue
        def _wrap(*a, _orig=_orig, _name=_name, **k):
            if "timed" in marks:
                frames = [f for f in traceback.extract_stack() if "mtpserve" in f.filename]
                print(f"{tag}: compile via {_name} at " + " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.line}" for f in frames[::-1][:4]), flush=True)
            return _orig(*a, **k)
        setattr(_compiler, _name, _wrap)
for phase in ("warm-up", "timed"):
    marks[phase] = time.perf_counter() - t0
    n, c = (warm_c, warm_c) if phase == "warm-up" else (N, C)
    if n == 0:
        continue
    pending = [rng.integers(100, vocab - 100, plen).tolist() for _ in range(n)]
    live, steps, i = 0, [], 0
    start = time.perf_counter()
    while pending or e.has_work:
        while pending and live < c:
            e.add_request(f"{phase}-{i}", pending.pop(0), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
            live, i = live + 1, i + 1
        s = time.perf_counter()
        events = e.step()
        ms = (time.perf_counter() - s) * 1e3
        t = e.last_step
        if ms > 100:
            print(f"{tag}: {phase}: slow step {len(steps)}: {ms:.1f} ms", flush=True)
        steps.append((round(ms, 1), t.num_requests if t else 0, t.num_main_tokens if t else 0, bool(t and t.has_prefill)))
        live -= sum(ev.finish_reason is not None for ev in events)
    slow = sorted(steps, reverse=True)[:6]
    print(f"{tag}: {phase}: {len(steps)} steps in {time.perf_counter() - start:.2f} s; slowest {slow}", flush=True)
    print(f"{tag}: {phase}: prefill steps {[s for s in steps if s[3]][:10]}", flush=True)
cache = os.environ.get("CUPY_CACHE_DIR")
if cache:
    since = t0 + marks["timed"]
    for root, _, files in os.walk(cache):
        for f in files:
            path = os.path.join(root, f)
            st = os.stat(path)
            if st.st_mtime >= time.time() - (time.perf_counter() - since):
                head = ""
                try:
                    text = open(path, errors="replace").read()
                    head = " | ".join(l.strip()[:160] for l in text.splitlines() if "__global__" in l or "extern" in l)[:700]
                except Exception as e:
                    head = repr(e)
                if not head:
                    import re
                    names = sorted(set(re.findall(rb"[A-Za-z_][A-Za-z0-9_]{5,}", open(path, "rb").read())))
                    head = b" ".join(n for n in names if b"cupy" in n or b"kernel" in n.lower())[:500].decode()
                print(f"{tag}: built in the timed phase: {f} {st.st_size} B: {head}", flush=True)
    print(f"{tag}: kernel cache files in all: {sum(len(f) for _, _, f in os.walk(cache))}", flush=True)
if profile:
    for sess in (e.runner.session,):
        path = sess.end_profiling()
        ev = json.load(open(path))
        since = marks["timed"] * 1e6 - 1e6
        nodes = [x for x in ev if x.get("cat") == "Node" and x.get("dur", 0) > 3000 and x["ts"] > since]
        nodes.sort(key=lambda x: -x["dur"])
        for x in nodes[:15]:
            print(f"{tag}: node {x['name']} {x['args'].get('op_name')} {x['dur']/1e3:.1f} ms at {x['ts']/1e6:.2f} s "
                  f"in {x['args'].get('input_type_shape')}", flush=True)
        early = [x for x in ev if x.get("cat") == "Node" and x.get("dur", 0) > 30000 and 2e6 < x["ts"] < since]
        for x in sorted(early, key=lambda x: -x["dur"])[:4]:
            print(f"{tag}: start-up node {x['name']} {x['dur']/1e3:.1f} ms at {x['ts']/1e6:.2f} s in {x['args'].get('input_type_shape')}", flush=True)
        sess_ev = [x for x in ev if x.get("cat") == "Session" and x.get("dur", 0) > 20000 and x["ts"] > since]
        for x in sorted(sess_ev, key=lambda x: -x["dur"])[:6]:
            print(f"{tag}: session {x['name']} {x['dur']/1e3:.1f} ms at {x['ts']/1e6:.2f} s", flush=True)
