"""`--compare ortgenai`: onnxruntime-genai's own og.Engine on the same paged export and prompts.

og.Engine runs the paged export on CUDA only (PagedAttention has no CPU kernel), so on the CPU
this reports why it skipped. On CUDA it runs in a child process (`python -m
mtpserve.cluster.bench.anchor SPEC OUT`), before our engine takes the GPU, for two reasons:
og.Engine has been seen to stall silently with a small block pool (DESIGN §6), and a hung
native call cannot be interrupted in-process; the parent kills the child past a hard deadline,
and the child reports a stall (no token for `stall_s` while requests are pending) by itself.

The child reads the export through a shadow folder: symlinks to every file, plus its own
genai_config.json (MTP on/off, `speculative.max_draft_tokens`, a generous `num_blocks`,
`max_batch_size`) and tokenizer_config.json (`tokenizer_class` Qwen2Tokenizer, which 0.18 can
load). The user's export is never written to.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mtpserve.cluster.bench.report import LoadRun, RequestRecord
from mtpserve.cluster.bench.workload import Load, Submitter, Workload, per_load

NEEDS_CUDA = ("--compare ortgenai needs CUDA: og.Engine runs the paged export's PagedAttention "
              "only on CUDA (it has no CPU kernel); skipped. Rerun with --device cuda on a GPU machine.")
TOKEN, TURN_FINISHED, CAPACITY_BLOCKED, FAILED = 1, 2, 4, 8     # og.EngineEventFlags


@dataclass(frozen=True)
class AnchorSweep:
    model_dir: str
    draft_tokens: tuple[int, ...]
    loads: tuple[Load, ...]
    max_tokens: int
    ignore_eos: bool = True
    seed: int = 0
    num_blocks: int = 8192
    num_warmup_requests: int = 4
    stall_s: float = 60.0
    timeout_s: float = 1800.0
    block_size: int | None = None        # og's KV block size (None: the export's), as the engine's kv_block_size


def run_anchor(sweep: AnchorSweep, workload: Workload, device: str, log=print) -> tuple[list[LoadRun], str | None]:
    """og.Engine at every K and load; returns (runs, a note when skipped or cut short)."""
    if device != "cuda":
        return [], NEEDS_CUDA
    import importlib.util
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return [], "--compare ortgenai: onnxruntime-genai is not installed (pip install onnxruntime-genai-cuda); skipped"
    with tempfile.TemporaryDirectory(prefix="mtpserve-anchor-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        sets = [workload.prompt_set(i).prompt_ids for i in range(1, len(sweep.loads) + 1)] if workload.fresh else None
        spec = {"sweep": asdict(sweep), "prompt_ids": workload.prompt_ids, "prompt_sets": sets,
                "shadow": str(Path(tmp) / "model")}
        spec_path.write_text(json.dumps(spec))
        note = None
        try:
            proc = subprocess.run([sys.executable, "-m", "mtpserve.cluster.bench.anchor", str(spec_path), str(out_path)],
                                  timeout=sweep.timeout_s, stdout=_stderr_fd(), env=_child_env())
            if proc.returncode != 0:
                note = f"og.Engine child exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            note = f"og.Engine did not finish within {sweep.timeout_s:g} s (hung); killed it"
        result = json.loads(out_path.read_text()) if out_path.is_file() else {"runs": []}
    note = "; ".join(x for x in (result.get("note"), note) if x) or None
    if note:
        log(f"ortgenai: {note}")
    return [LoadRun.from_dict(r) for r in result["runs"]], note


def _child_env() -> dict:
    """Our environment, with our import path, so the child finds mtpserve however we did."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def _stderr_fd():
    """The child's progress goes to our stderr when it is a real file (not under pytest capture)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


# ------------------------------------------------------------------ the child process
def shadow_export(model_dir: Path, shadow: Path, k: int, num_blocks: int, max_batch_size: int,
                  block_size: int | None = None) -> Path:
    """A folder og.Model can load: the export's files as symlinks, with og's settings for this run."""
    if shadow.exists():
        for p in shadow.iterdir():
            p.unlink()
    shadow.mkdir(parents=True, exist_ok=True)
    for p in model_dir.iterdir():
        if p.name not in ("genai_config.json", "tokenizer_config.json"):
            (shadow / p.name).symlink_to(p.resolve())
    config = json.loads((model_dir / "genai_config.json").read_text())
    if k:
        if "mtp" not in config["model"]:
            raise ValueError(f"{model_dir} has no MTP head; og.Engine cannot draft")
        config["speculative"] = {"max_draft_tokens": k}
    if "mtp" in config["model"]:
        config["model"]["mtp"]["enabled"] = bool(k)
    config.setdefault("engine", {}).setdefault("dynamic_batching", {}).update(
        {"num_blocks": num_blocks, "max_batch_size": max_batch_size,
         **({"block_size": block_size} if block_size else {})})
    (shadow / "genai_config.json").write_text(json.dumps(config, indent=1))
    tok_path = model_dir / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text()) if tok_path.is_file() else {}
    tok["tokenizer_class"] = "Qwen2Tokenizer"
    (shadow / "tokenizer_config.json").write_text(json.dumps(tok, indent=1))
    return shadow


# og.Requests of the current load stay referenced while unfinished (in og_run_load's `live`);
# a finished one is dropped at once: og.Engine closes a dropped request and frees its batch slot.
# A finished request that stays referenced keeps its slot (seen on the H200 with og 0.18: after
# max_batch_size finished requests were kept, every new one waited forever), and its late events
# are counted as stray.


def og_run_load(og, engine, workload: Workload, load: Load, k: int, sweep: AnchorSweep,
                max_tokens: int | None = None) -> LoadRun:
    """Like engine_driver.run_load, for og.Engine: one `engine.run` call is one step (``max_tokens``
    as there: one length for all, else each request's own from the workload)."""
    import numpy as np

    prompts, n = workload.prompt_ids, workload.num_requests
    records: list[RequestRecord] = []
    live = {}                        # id(og.Request) -> (request, record) of unfinished requests
    buffer = engine.create_event_buffer(4096)
    stats0 = _numeric(engine.get_speculative_stats())
    t0 = time.perf_counter()
    last_progress, blocked, stray = 0.0, 0, 0

    def submit(i: int, arrival: float) -> None:
        req = engine.create_request()
        opts = og.TurnOptions(req)
        length = max_tokens or workload.max_tokens(i, sweep.max_tokens)
        opts.set_max_generated_tokens(length)
        if sweep.ignore_eos:
            opts.set_min_generated_tokens(length)
        opts.set_do_sample(False)
        req.begin_turn(np.asarray(prompts[i], dtype=np.int32), opts)
        rec = RequestRecord(f"og-{i}", len(prompts[i]), arrival)
        records.append(rec)
        live[id(req)] = (req, rec)

    schedule = Submitter(workload, load, submit)
    num_done, error = 0, None
    while num_done < n:
        schedule.arrive(time.perf_counter() - t0)
        if not engine.has_pending_requests():
            if schedule.wait_for_next(time.perf_counter() - t0):
                continue
            error = f"og.Engine has no pending request with {n - num_done} unfinished"
            break
        events = engine.run(buffer)
        t = time.perf_counter() - t0
        tokens: dict[int, int] = {}
        finished = []
        for ev in events:
            key = id(ev.request)
            if key not in live:      # a late event of a finished (or warm-up) request: not ours to count
                stray += 1
                continue
            flags = int(ev.flags)
            if flags & TOKEN:
                tokens[key] = tokens.get(key, 0) + 1
            if flags & CAPACITY_BLOCKED:
                blocked += 1
            if flags & FAILED:
                live[key][1].error = f"og FAILED event (error code {int(ev.error_code)})"
            if flags & (TURN_FINISHED | FAILED):
                finished.append((key, str(ev.finish_reason).rsplit(".", 1)[-1].lower()))
        for key, count in tokens.items():
            rec = live[key][1]
            rec.add_chunk(t, count)
            rec.num_output_tokens += count
            last_progress = t
        for key, reason in finished:
            req, rec = live.pop(key)      # dropping the request closes it in og and frees its slot
            del req
            rec.finish_s, rec.finish_reason = t, reason
            num_done += 1
            schedule.finished(t)
        if t - last_progress > sweep.stall_s:
            error = (f"og.Engine stalled: no token for {t - last_progress:.0f} s with {n - num_done} requests "
                     f"pending ({blocked} capacity-blocked events); raise --anchor-num-blocks")
            break
    end = time.perf_counter() - t0
    for rec in records:
        if rec.finish_s is None:
            rec.error = rec.error or "unfinished"
    stats1 = _numeric(engine.get_speculative_stats())
    raw = {key: v - stats0.get(key, 0) for key, v in stats1.items()}
    spec = {"og_stats": raw}
    if "draft_tokens_proposed" in raw:
        spec.update(num_draft_tokens=int(raw["draft_tokens_proposed"]),
                    num_accepted_tokens=int(raw.get("draft_tokens_accepted", 0)))
    finish = [r.finish_s for r in records if r.finish_s is not None]
    return LoadRun("ortgenai", k, None, load.concurrency, load.request_rate,
                   end if error else max(finish, default=end), records, spec,
                   {"capacity_blocked_events": blocked, "stray_events": stray, "num_blocks": sweep.num_blocks},
                   error)


def _og_engine(og, shadow: Path, k: int, workload: Workload, sweep: AnchorSweep):
    """A ready og.Engine on the shadow export, warmed up on the first prompts; (model, engine)."""
    started = time.perf_counter()
    model = og.Model(str(shadow))
    engine = og.Engine(model)
    print(f"ortgenai K={k}: og.Engine ready in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    if sweep.num_warmup_requests:
        n = min(sweep.num_warmup_requests, workload.num_requests)
        og_run_load(og, engine, workload.warmup(n), Load(concurrency=n), k, sweep,
                    min(16, sweep.max_tokens))
    return model, engine


def _numeric(stats) -> dict:
    return {k: v for k, v in dict(stats).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def child_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    sw = spec["sweep"]
    sweep = AnchorSweep(**{**sw, "draft_tokens": tuple(sw["draft_tokens"]),
                           "loads": tuple(Load(**l) for l in sw["loads"])})
    sets = spec.get("prompt_sets")       # each load's own prompts, as the parent's per_load gives them
    workload = Workload(spec["prompt_ids"], None, fresh=(lambda i: sets[i - 1]) if sets else None)
    result: dict = {"runs": [], "note": None}

    def save() -> None:
        Path(out_path).write_text(json.dumps(result))

    try:
        import onnxruntime as ort
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
    except ImportError:
        pass
    import onnxruntime_genai as og
    if not og.is_cuda_available():
        result["note"] = "--compare ortgenai: this onnxruntime-genai has no CUDA support (install onnxruntime-genai-cuda); skipped"
        save()
        return 0
    notes = []
    max_batch = max(l.concurrency or workload.num_requests for l in sweep.loads)
    for k in sweep.draft_tokens:
        try:
            shadow = shadow_export(Path(sweep.model_dir), Path(spec["shadow"]), k, sweep.num_blocks, max(max_batch, 1),
                                   sweep.block_size)
            engine = model = None
            for load, wl in per_load(workload, sweep.loads, sweep.seed):
                if engine is None:
                    model, engine = _og_engine(og, shadow, k, workload, sweep)
                max_drafts = engine.max_draft_tokens_per_proposal() if k else 0
                run = og_run_load(og, engine, wl, load, k, sweep)
                run.extra["og_max_draft_tokens_per_proposal"] = max_drafts
                result["runs"].append(run.to_dict())
                save()
                print(f"ortgenai K={k} {run.load_label}: {sum(r.num_output_tokens for r in run.records)} tokens "
                      f"in {run.duration_s:.2f} s" + (f" — {run.error}" if run.error else ""), file=sys.stderr, flush=True)
                if run.error:     # a stalled engine is not trusted with the next load
                    notes.append(f"K={k} {run.load_label}: {run.error}; later loads of K={k} skipped")
                    break
        except Exception as e:   # noqa: BLE001 - report og's failure and go on with the next K
            notes.append(f"K={k}: og.Engine failed: {type(e).__name__}: {str(e)[:300]}")
        engine = model = None   # noqa: F841 - drop og's objects so gc frees them before the next K
        gc.collect()
        result["note"] = "; ".join(notes) or None
        save()
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1], sys.argv[2]))
