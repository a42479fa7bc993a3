"""What `mtpserve bench` measured, turned into figures (DESIGN §8), JSON, a table and a plot.

One `LoadRun` is one configuration (system, draft tokens) at one load (a concurrency or a
request rate); each of its requests is a `RequestRecord` of timestamped token chunks:

    arrival        chunk 0        chunk 1    ...   chunk n-1 = finish
       |--- TTFT ---|--- ITL[0] ---|--- ...          |
       |---------------------- E2E ------------------|
    TPOT = (E2E - TTFT) / (output tokens - 1)       one chunk may carry several tokens (MTP)
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's timeline, in seconds from the start of its load run."""
    request_id: str
    num_prompt_tokens: int
    arrival_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_num_tokens: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    finish_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    replica_id: str | None = None        # the server replica that answered (HTTP header), if any
    num_cached_tokens: int = 0           # prompt tokens served from the prefix cache (HTTP usage), if told

    def add_chunk(self, t: float, num_tokens: int) -> None:
        self.chunk_times_s.append(t)
        self.chunk_num_tokens.append(num_tokens)

    @property
    def completed(self) -> bool:
        return self.finish_s is not None and self.error is None and bool(self.chunk_times_s)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass
class LoadRun:
    """One configuration at one load. `spec` holds plain counters (see `spec_figures`)."""
    system: str                          # "mtpserve", "ortgenai" or "http"
    num_draft_tokens: int | None
    synthetic_acceptance: float | None
    concurrency: int | None
    request_rate: float | None
    duration_s: float
    records: list[RequestRecord]
    spec: dict | None = None
    extra: dict = field(default_factory=dict)
    error: str | None = None

    @property
    def config_label(self) -> str:
        label = self.system if self.num_draft_tokens is None else f"{self.system} K={self.num_draft_tokens}"
        if self.synthetic_acceptance is not None and self.num_draft_tokens != 0:   # None: a server's K
            label += f" synthetic a={self.synthetic_acceptance:g}"
        return label

    @property
    def load_label(self) -> str:
        return f"C={self.concurrency}" if self.concurrency is not None else f"{self.request_rate:g} req/s"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LoadRun:
        d = dict(d)
        d["records"] = [RequestRecord(**r) for r in d["records"]]
        return cls(**d)


def distribution_ms(values_s) -> dict | None:
    v = np.asarray([x for x in values_s if x is not None], dtype=np.float64) * 1000.0
    if v.size == 0:
        return None
    out = {"mean": round(float(v.mean()), 3)}
    out.update({f"p{p}": round(float(np.percentile(v, p)), 3) for p in PERCENTILES})
    return out


def theory_tokens_per_forward(alpha: float, k: int) -> float:
    """Expected tokens per target forward with K drafts each accepted with probability alpha
    (until the first rejection): (1 - a^(K+1)) / (1 - a)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def spec_figures(spec: dict, k: int | str | None, synthetic: float | None) -> dict:
    """Derived speculative figures from counters: num_drafts, num_draft_tokens,
    num_accepted_tokens, num_target_forwards, num_emitted_tokens, accepted_per_position,
    drafted_per_position (any may be missing or None)."""
    out = dict(spec)
    drafted, accepted = spec.get("num_draft_tokens"), spec.get("num_accepted_tokens")
    if drafted:
        out["acceptance_rate"] = round(accepted / drafted, 4)
    drafts = spec.get("num_drafts")
    if drafts:
        out["acceptance_length"] = round(1.0 + accepted / drafts, 4)
    acc_pos, draft_pos = spec.get("accepted_per_position") or [], spec.get("drafted_per_position")
    if draft_pos:
        out["acceptance_rate_per_position"] = [round(_at(acc_pos, i) / d, 4) if d else 0.0
                                               for i, d in enumerate(draft_pos)]
    elif acc_pos and drafts:   # a fixed K drafts every position in every drafting forward
        out["acceptance_rate_per_position"] = [round(a / drafts, 4) for a in acc_pos]
    forwards, emitted = spec.get("num_target_forwards"), spec.get("num_emitted_tokens")
    if forwards and emitted:
        out["tokens_per_target_forward"] = round(emitted / forwards, 4)
    per_pos = out.get("acceptance_rate_per_position")
    if isinstance(k, str):          # auto: the adaptive policy's K varies per request and step: no one theory
        return out
    if k is None and per_pos:       # a server's K: as many positions as its counters report
        k = out["inferred_num_draft_tokens"] = len(per_pos)
    if k:
        if synthetic is not None:
            out["theory_alpha"], out["theory_alpha_source"] = synthetic, "synthetic acceptance probability"
        elif per_pos:
            out["theory_alpha"], out["theory_alpha_source"] = per_pos[0], "measured acceptance of draft 0"
        if "theory_alpha" in out:
            out["theory_tokens_per_forward"] = round(theory_tokens_per_forward(out["theory_alpha"], k), 4)
    return out


def _at(counts: list, i: int):
    return counts[i] if i < len(counts) else 0


def bandwidth_bound(manifest, context_len: float, copy_gbps: float, results: list[dict]) -> dict:
    """The batch-1 decode step's memory-bandwidth floor, and how far the measured one is from it.

    One decode step of one request must read (at least) the main graph's weights except the
    embedding table (it gathers one row), its fixed state (read as past, written as present)
    and the K/V of its context; at ``copy_gbps`` (a measured device copy rate) that takes

        bound = (weights - embedding + 2 * state + context * kv_per_token) / copy rate

    Compared with the TPOT p50 of the K=0, concurrency-1 run of our engine, when there is one.
    """
    def itemsize(dtype: str) -> int:
        return 2 if dtype in ("float16", "bfloat16") else 4

    weights = sum(size for name, size in manifest.files.items() if name.startswith("model.onnx"))
    embedding = manifest.vocab_size * manifest.hidden_size * itemsize(manifest.compute_dtype)
    state = sum(l.conv_dim * (l.kernel_size - 1) * itemsize(l.dtype) for l in manifest.conv_layers)
    state += sum(itemsize(l.dtype) * l.num_value_heads * l.value_head_size * l.key_head_size
                 for l in manifest.recurrent_layers)
    kv_per_token = sum(2 * l.num_kv_heads * l.head_size * itemsize(l.dtype) for l in manifest.kv_layers)
    step_bytes = weights - embedding + 2 * state + context_len * kv_per_token
    bound_ms = step_bytes / (copy_gbps * 1e9) * 1e3
    out = {"copy_gbps": copy_gbps, "weight_file_bytes": weights, "embedding_bytes_skipped": embedding,
           "state_bytes_per_request": state, "kv_bytes_per_token": kv_per_token, "context_tokens": context_len,
           "bytes_per_step": step_bytes, "bound_ms": bound_ms}
    base = next((r for r in results if r["system"] == "mtpserve" and r["num_draft_tokens"] == 0
                 and r["concurrency"] == 1 and r["num_completed"]), None)
    tpot = base and base.get("tpot_ms") and base["tpot_ms"].get("p50")
    if tpot:
        out.update(measured_tpot_p50_ms=tpot, fraction_of_bound=bound_ms / tpot)
    return out


def summarize(run: LoadRun, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> dict:
    """Every figure of one load run, as plain JSON-able values."""
    done = [r for r in run.records if r.completed]
    duration = run.duration_s if run.duration_s > 0 else float("nan")
    num_out = sum(r.num_output_tokens for r in done)
    num_prompt = sum(r.num_prompt_tokens for r in done)
    synthetic = run.synthetic_acceptance if run.num_draft_tokens != 0 else None
    drafting = run.num_draft_tokens or (run.num_draft_tokens is None and (run.spec or synthetic is not None))
    s = {
        "system": run.system, "label": run.config_label, "load": run.load_label,
        "num_draft_tokens": run.num_draft_tokens,
        "acceptance": None if not drafting else ("synthetic" if synthetic is not None else "real"),
        "synthetic_acceptance": synthetic,
        "concurrency": run.concurrency, "request_rate": run.request_rate,
        "num_requests": len(run.records), "num_completed": len(done),
        "max_in_flight": min(run.concurrency, len(run.records)) if run.concurrency else None,
        "num_failed": len(run.records) - len(done),
        "num_prompt_tokens": num_prompt, "num_output_tokens": num_out,
        "duration_s": round(run.duration_s, 4),
        "request_throughput": round(len(done) / duration, 4),
        "output_token_throughput": round(num_out / duration, 2),
        "total_token_throughput": round((num_out + num_prompt) / duration, 2),
        "ttft_ms": distribution_ms(r.ttft_s for r in done),
        "tpot_ms": distribution_ms(r.tpot_s for r in done),
        "itl_ms": distribution_ms(float(x) for r in done for x in np.diff(r.chunk_times_s)),
        "e2e_ms": distribution_ms(r.e2e_s for r in done),
        "tokens_per_chunk": round(num_out / max(1, sum(len(r.chunk_times_s) for r in done)), 4),
        "goodput": None, "spec": None, "extra": run.extra, "error": run.error,
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = [r for r in done
                if (slo_ttft_ms is None or r.ttft_s * 1000 <= slo_ttft_ms)
                and (slo_tpot_ms is None or (r.tpot_s or 0.0) * 1000 <= slo_tpot_ms)]
        s["goodput"] = {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "num_good": len(good),
                        "fraction": round(len(good) / max(1, len(run.records)), 4),
                        "request_goodput": round(len(good) / duration, 4),
                        "token_goodput": round(sum(r.num_output_tokens for r in good) / duration, 2)}
    if run.spec is not None:
        s["spec"] = spec_figures(run.spec, run.num_draft_tokens, synthetic)
    errors = sorted({r.error for r in run.records if r.error})
    if errors:
        s["request_errors"] = errors[:5]
    return s


def _round(s: dict):
    return (s.get("extra") or {}).get("round")


def comparisons(summaries: list[dict]) -> list[dict]:
    """Ratios at equal load: each K against K=0 of the same system ("our own baseline"), and
    mtpserve against ortgenai at the same K. With interleaved rounds (``extra.round``), within
    each round; each ratio then carries its ``round``."""
    by_key = {(s["system"], s["num_draft_tokens"], s["load"], _round(s)): s for s in summaries if s["num_completed"]}
    out = []
    for (system, k, load, rnd), s in by_key.items():
        base = by_key.get((system, 0, load, rnd))
        found = []
        if k and base is not None:
            found.append(_ratio("speedup_vs_k0", s, base))
        anchor = by_key.get(("ortgenai", k, load, rnd))
        if system == "mtpserve" and anchor is not None:
            found.append(_ratio("mtpserve_vs_ortgenai", s, anchor))
        uncached = by_key.get(("mtpserve no-prefix-cache", k, load, rnd))
        if system == "mtpserve" and uncached is not None:
            found.append(_ratio("prefix_cache_on_vs_off", s, uncached))
        no_overlap = by_key.get(("mtpserve no-overlap", k, load, rnd))
        if system == "mtpserve" and no_overlap is not None:
            found.append(_ratio("overlap_on_vs_off", s, no_overlap))
        if system == "mtpserve snapshots-all" and uncached is not None:
            found.append(_ratio("snapshots_all_vs_off", s, uncached))
        if isinstance(k, str):      # auto or auto-timed, against the best fixed K
            fixed = [f for (sy, fk, fl, fr), f in by_key.items()
                     if sy == system and fl == load and fr == rnd and isinstance(fk, int)]
            if fixed:
                best = max(fixed, key=lambda f: f["output_token_throughput"])
                found.append(_ratio("auto_vs_best_fixed", s, best) | {"baseline": "best fixed K",
                                                                       "best_fixed": best["label"]})
        for r in found:
            if rnd is not None:
                r["round"] = rnd
        out += found
    return out


def round_medians(comps: list[dict]) -> list[dict]:
    """Per (kind, label, load): the median over interleaved rounds of the tokens/s ratio, and
    each round's (what ``mtpserve bench --rounds`` reports: drift between rounds cancels within
    a round, and the median drops a round a burst of noise hit). auto_vs_best_fixed compares
    with each round's best fixed K, the luckiest of several noisy figures: it reads low."""
    groups: dict[tuple, list[float]] = {}
    for c in comps:
        if c.get("round") is None or c["output_token_throughput"] is None:
            continue
        groups.setdefault((c["kind"], c["label"], c["baseline"], c["load"]), []).append(c["output_token_throughput"])
    return [{"kind": kind, "label": label, "baseline": base, "load": load,
             "median_output_token_throughput": round(float(np.median(v)), 4), "rounds": v}
            for (kind, label, base, load), v in groups.items()]


def median_round_summaries(summaries: list[dict]) -> list[dict]:
    """One summary per (label, load): the round whose tokens/s is the median (for a plot)."""
    groups: dict[tuple, list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["label"], s["load"]), []).append(s)
    return [sorted(g, key=lambda s: s["output_token_throughput"])[(len(g) - 1) // 2] for g in groups.values()]


def _ratio(kind: str, s: dict, base: dict) -> dict:
    def p50(d, key):
        return (d.get(key) or {}).get("p50")
    r = {"kind": kind, "label": s["label"], "baseline": base["label"], "load": s["load"],
         "output_token_throughput": _div(s["output_token_throughput"], base["output_token_throughput"])}
    for key in ("tpot_ms", "ttft_ms", "e2e_ms"):   # baseline / this: > 1 means this one is faster
        r[f"{key.split('_')[0]}_p50_speedup"] = _div(p50(base, key), p50(s, key))
    return r


def _div(a, b):
    return round(a / b, 4) if a is not None and b else None


# ---------------------------------------------------------------------------- output
def machine_info() -> dict:
    """CPU count, platform, GPU name (nvidia-smi), ORT and onnxruntime-genai versions/providers."""
    info = {"platform": platform.platform(), "python": sys.version.split()[0], "cpu_count": os.cpu_count()}
    try:
        import onnxruntime as ort
        info["onnxruntime"] = ort.__version__
        info["ort_providers"] = ort.get_available_providers()
    except ImportError:
        pass
    try:
        from importlib.metadata import version
        info["onnxruntime_genai"] = next((version(d) for d in ("onnxruntime-genai-cuda", "onnxruntime-genai")
                                          if _has_dist(d)), None)
    except Exception:   # noqa: BLE001 - metadata lookups only decorate the report
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            info["gpus"] = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version
    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
    return path


def _json_default(o):
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def format_table(summaries: list[dict], comps: list[dict]) -> str:
    """A compact human table: one row per configuration and load, then the ratios."""
    def pct(d, key, p):
        v = (d.get(key) or {}).get(p)
        return "-" if v is None else f"{v:.1f}"
    head = (f"{'configuration':<34} {'load':>11} {'done':>7} {'req/s':>7} {'out tok/s':>10} "
            f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17} {'ITL p50':>8} {'E2E p50':>9} "
            f"{'accept':>6} {'acc len':>7} {'tok/fwd (theory)':>16}")
    lines = [head, "-" * len(head)]
    for s in summaries:
        sp = s.get("spec") or {}
        tpf = sp.get("tokens_per_target_forward")
        theory = sp.get("theory_tokens_per_forward")
        tpf_s = "-" if tpf is None else f"{tpf:.2f}" + ("" if theory is None else f" ({theory:.2f})")
        acc = sp.get("acceptance_rate")
        acc_len = sp.get("acceptance_length")
        lines.append(
            f"{s['label']:<34} {s['load']:>11} {s['num_completed']:>3}/{s['num_requests']:<3} "
            f"{s['request_throughput']:>7.2f} {s['output_token_throughput']:>10.1f} "
            f"{pct(s, 'ttft_ms', 'p50'):>8}/{pct(s, 'ttft_ms', 'p99'):<8} "
            f"{pct(s, 'tpot_ms', 'p50'):>8}/{pct(s, 'tpot_ms', 'p99'):<8} {pct(s, 'itl_ms', 'p50'):>8} "
            f"{pct(s, 'e2e_ms', 'p50'):>9} {'-' if acc is None else f'{acc:.2f}':>6} "
            f"{'-' if acc_len is None else f'{acc_len:.2f}':>7} {tpf_s:>16}")
        if s.get("goodput"):
            g = s["goodput"]
            lines.append(f"{'':<34} {'':>11} goodput {g['num_good']}/{s['num_requests']} within SLO "
                         f"({g['request_goodput']:.2f} req/s, {g['token_goodput']:.1f} tok/s)")
        if s.get("error"):
            lines.append(f"{'':<34} {'':>11} ERROR: {s['error']}")
    if comps:
        lines += ["", f"{'ratio':<22} {'configuration':<34} {'vs':<34} {'load':>11} "
                      f"{'tok/s':>7} {'TPOT':>6} {'TTFT':>6}"]
        for c in comps:
            f = [("-" if c[k] is None else f"{c[k]:.2f}x")
                 for k in ("output_token_throughput", "tpot_p50_speedup", "ttft_p50_speedup")]
            lines.append(f"{c['kind']:<22} {c['label']:<34} {c['baseline']:<34} {c['load']:>11} "
                         f"{f[0]:>7} {f[1]:>6} {f[2]:>6}")
    return "\n".join(lines)


def plot(summaries: list[dict], path: Path, title: str) -> str | None:
    """tokens/s against load per configuration, and acceptance per draft position.

    Returns None when written, else why not (matplotlib missing: pip install matplotlib).
    """
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, (ax_tps, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[tuple[float, float]]] = {}
    positions: dict[str, list[list[int]]] = {}      # label -> [accepted, drafted] per position
    for s in summaries:
        x = s["concurrency"] if s["concurrency"] is not None else s["request_rate"]
        if s["num_completed"]:
            series.setdefault(s["label"], []).append((x, s["output_token_throughput"]))
        sp = s.get("spec") or {}
        drafted = sp.get("drafted_per_position")
        if drafted:
            acc = sp.get("accepted_per_position") or []
            a, d = positions.setdefault(s["label"], [[], []])
            for i, di in enumerate(drafted):
                if i == len(d):
                    a.append(0)
                    d.append(0)
                a[i] += _at(acc, i)
                d[i] += di
    colors = {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys(s["label"] for s in summaries))}
    xs = sorted({p[0] for pts in series.values() for p in pts})
    for label, pts in series.items():
        pts.sort()
        ax_tps.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=colors[label])
    closed = any(s["concurrency"] is not None for s in summaries)
    ax_tps.set_xlabel("concurrency" if closed else "request rate (req/s)")
    if len(xs) > 1 and xs[0] > 0:
        ax_tps.set_xscale("log")
    ax_tps.set_xticks(xs, [f"{x:g}" for x in xs])
    ax_tps.minorticks_off()
    ax_tps.set_ylabel("output tokens/s")
    ax_tps.set_title("throughput")
    ax_tps.grid(True, alpha=0.3)
    ax_tps.legend(fontsize=7)
    for label, (a, d) in positions.items():
        ax_acc.plot(range(1, len(d) + 1), [ai / di if di else 0.0 for ai, di in zip(a, d)], marker="o",
                    label=label, color=colors[label])
    ax_acc.set_xlabel("draft position")
    ax_acc.set_ylabel("acceptance rate")
    ax_acc.set_ylim(-0.02, 1.05)
    if positions:
        ax_acc.set_xticks(range(1, max(len(d) for _, d in positions.values()) + 1))
    ax_acc.set_title("acceptance per position (all loads)")
    ax_acc.grid(True, alpha=0.3)
    if positions:
        ax_acc.legend(fontsize=7)
    return save_figure(fig, path, title)


NO_MATPLOTLIB = "no plot: matplotlib is not installed (pip install matplotlib)"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path: Path, title: str) -> None:
    """Title, lay out, write (dpi 110) and close a matplotlib figure; None (no note to print)."""
    import matplotlib.pyplot as plt
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
