"""Replica scaling for `mtpserve bench --replicas 1,N`: the real Serve app, 1 then N replicas.

    mtpserve bench --replicas 1,2 --concurrency 16,64,256 --max-tokens 32     CPU replicas
    mtpserve bench --device cuda --replicas 1,all --concurrency 16,64,256     one replica per GPU

With ``--prefix-routing on,off`` every replica count is deployed once per setting of the
router's prefix-aware routing, on the same prompts (``--shared-prefix-len N --prefix-groups G``:
G shared prefixes, so that both caching and balancing matter): the ``prefix_routing`` rows compare
them at each load (prompt tokens served from the replicas' caches, TTFT p50/p99, tokens/s, each
replica's requests).

Replica count 0 is the baseline: the same engine config a replica builds, driven in this process
(no Ray Serve, no HTTP), so `--replicas 0,1` shows in one run what serving adds to TTFT and the
inter-token latency (the ``http_overhead`` rows: added ms at p50 and p99).

For each replica count >= 1, in one run: deploy the app (``cluster.deploy``, as `mtpserve serve`
does) on a local Ray (or ``--address``), wait until every replica reports to the planner,
drive its HTTP endpoint with the `bench --url` driver at every load, delete the app. Figures per
(replicas, load) are the usual ones; on top, the scaling ratio N-vs-1 replicas at each load
and each replica's share of the requests (from the ``x-mtpserve-replica`` header), to show
whether load was spread evenly. With --device cuda each replica takes one GPU; on the CPU the
replicas split the machine's cores (ORT threads = cores / replicas unless --num-threads).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from mtpserve.cluster import deploy
from mtpserve.cluster.bench import report

APP_NAME = "mtpserve-bench"
DEFAULT_PORT = 8000


IN_PROCESS = "in-process"      # the label of replica count 0: the replica's engine, no Serve or HTTP


def replica_label(num_replicas: int) -> str:
    if num_replicas == 0:
        return IN_PROCESS
    return f"{num_replicas} replica" + ("s" if num_replicas > 1 else "")


def parse_replicas(value: str, device: str, num_devices: int) -> tuple[int, ...]:
    """'1,2' -> (1, 2); 'all' is one replica per GPU (cuda) or per core (cpu); 0 is the
    in-process baseline."""
    items = []
    for v in str(value).split(","):
        v = v.strip()
        if v:
            items.append(num_devices if v == "all" else int(v))
    if not items or min(items) < 0 or max(items) < 1:
        raise ValueError(f"--replicas must list counts >= 1 (or 'all'; 0 = the in-process baseline), got {value!r}")
    if device == "cuda" and max(items) > num_devices:
        raise ValueError(f"--replicas {max(items)} needs {max(items)} GPUs; the cluster has {num_devices}")
    return tuple(dict.fromkeys(items))


# ---------------------------------------------------------------------------- the app
def num_devices(ray, device: str) -> int:
    resource = "GPU" if device == "cuda" else "CPU"
    return int(ray.cluster_resources().get(resource, 0))


def serve_options(args, num_replicas: int, num_cpus: int, prefix_routing: bool = True, api_servers: int = 0):
    from mtpserve.cluster.app import ServeOptions
    threads = args.num_threads
    if args.device == "cpu" and not threads:
        threads = max(1, num_cpus // num_replicas)
    given = {"draft_tokens": args.draft_tokens, "num_blocks": args.num_blocks,
             "max_resident_requests": args.max_resident_requests, "max_model_len": args.max_model_len,
             "kv_block_size": getattr(args, "kv_block_size", None),
             "prefix_max_imbalance": getattr(args, "prefix_max_imbalance", None),
             "prefix_host_gib": getattr(args, "prefix_host_gib", None),
             "stall_phases": True if getattr(args, "stall_phases", False) else None}
    if api_servers:            # the replica's own HTTP processes, beside its engine process
        given.update(api_servers=api_servers, api_port=args.port + 100, api_host=deploy.LOCAL_HOST, engine_process=True)
    return ServeOptions.from_flat(
        model_dir=args.model, device=args.device, num_replicas=num_replicas, num_threads=threads,
        num_cpus_per_replica=max(0.1, min(1.0, num_cpus / num_replicas)) if args.device == "cpu" else 1.0,
        prefix_routing=prefix_routing, **{k: v for k, v in given.items() if v is not None})


@contextmanager
def deployed(options, port: int, log, timeout_s: float = 600.0, app_name: str = APP_NAME):
    """The Serve app with ``options``, every replica reporting to its planner; yields the base URL."""
    started = time.perf_counter()
    host, port = deploy.start_http(deploy.LOCAL_HOST, port)
    with deploy.deployed(options, app_name, route_prefix="/", timeout_s=timeout_s):
        log(f"{replica_label(options.num_replicas)} up in {time.perf_counter() - started:.1f} s")
        yield deploy.client_url(host, port)       # a cluster's Serve may already listen elsewhere


# ---------------------------------------------------------------------------- the sweep
def routing_modes(args) -> tuple[bool, ...]:
    """--prefix-routing's settings, in order (on, off, or both)."""
    from mtpserve.cluster.flags import on_off
    return tuple(dict.fromkeys(on_off(v) for v in str(getattr(args, "prefix_routing", "on")).split(",") if v.strip()))


def run_replica_sweep(args, loads_with_workloads, log) -> list:
    """LoadRuns of every replica count (--replicas) at every load, for each --prefix-routing
    setting; ``system`` is the replica label (and the routing setting, when several are compared)."""
    import ray

    from mtpserve.cluster.bench.http_driver import HttpTarget, run_http_loads
    runs = []
    modes = routing_modes(args)
    direct = bool(getattr(args, "direct_ingress", False))
    api_counts = [int(a) for a in str(getattr(args, "api_servers", "0")).split(",")] if direct else [0]
    if direct:                            # before the local Ray starts: its Serve inherits the switch
        deploy.enable_direct_ingress(args.port + 1)
    with deploy.connected(args.address or None, quiet=True):
        cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        replica_counts = parse_replicas(args.replicas, args.device, num_devices(ray, args.device))
        log(f"replica counts {replica_counts} on {args.device}; loads {[l.label for l, _ in loads_with_workloads]}")
        for n in replica_counts:
            if n == 0:
                runs += run_in_process(args, serve_options(args, 1, cpus).worker.engine, loads_with_workloads, log)
                continue
            for routing, num_api in ((r, a) for r in modes for a in api_counts):
                options = serve_options(args, n, cpus, prefix_routing=routing, api_servers=num_api)
                label = replica_label(n) + (f", prefix routing {'on' if routing else 'off'}" if len(modes) > 1 else "")
                label += (f", {num_api} API server{'s' if num_api > 1 else ''}" if num_api else ", direct ingress") if direct else ""
                # an app of its own per setting: Ray Serve 2.60's proxies keep a deployment's router
                # (and the settings its initialize_state got) across a redeploy under the same name
                app_name = APP_NAME + ("" if routing else "-no-prefix-routing") + (f"-api{num_api}" if num_api else "")
                with deployed(options, args.port, log, app_name=app_name) as url:
                    if direct and num_api:
                        url = deploy.api_server_urls(app_name, 1)[0][1]
                        log(f"API servers: {url}")
                    elif direct:
                        url = _direct_url(app_name, log)
                    target = HttpTarget(url, options.served_model_name, None, args.max_tokens, args.temperature,
                                        args.ignore_eos, args.timeout_s, args.warmup_requests, args.return_token_ids,
                                        getattr(args, "client_processes", 1))
                    for run in run_http_loads(target, loads_with_workloads, log=lambda m, s=label: log(f"[{s}] {m}"),
                                              after_run=StallReader(app_name, lambda m, s=label: log(f"[{s}] {m}"))):
                        run.system = label
                        run.extra.update(num_replicas=n, prefix_routing=routing, direct_ingress=direct,
                                         api_servers=num_api,
                                         replica_share=replica_share(run.records),
                                         prefix_cache=cached_share(run.records))
                        runs.append(run)
    return runs


class StallReader:
    """After each load: the owner-thread stalls each replica had during it (``engine_loop.Stall``,
    from ``engine_status``), into ``run.extra["stalls"]`` {replica: [stall, ...]}, the longest logged."""

    def __init__(self, app_name: str, log):
        self.app_name, self.log = app_name, log
        self.seen: dict[str, int] = {}

    def __call__(self, run) -> None:
        """``run``: the load just run, or None (the warm-up: its stalls are no run's)."""
        from mtpserve.cluster.client import replica_statuses
        try:
            statuses = replica_statuses(self.app_name)
        except Exception as e:  # noqa: BLE001 - a figure the run can do without
            self.log(f"replica stalls not read: {e!r}")
            return
        out = {}
        for rid, status in statuses.items():
            total, stalls = status.get("num_stalls", 0), status.get("stalls") or []
            new = total - self.seen.get(rid, 0)
            self.seen[rid] = total
            if new > 0:
                out[rid] = stalls[-new:]
        if run is None:
            return
        run.extra["stalls"] = out
        run.extra["engine_niceness"] = {rid: status.get("owner_niceness") for rid, status in statuses.items()}
        every = [s for stalls in out.values() for s in stalls]
        if every:
            worst = max(every, key=lambda s: s["turn_ms"])
            self.log(f"{run.load_label}: {len(every)} owner-thread stalls; the longest {worst['turn_ms']:.1f} ms "
                     f"(step {worst['step_ms']:.1f} of which its events {worst['dispatch_ms']:.1f}, commands "
                     f"{worst['commands_ms']:.1f}, admission {worst['admit_ms']:.1f}, garbage collection "
                     f"{worst['gc_ms']:.1f}; the owner thread on the CPU {worst['cpu_ms']:.1f}, taken off it "
                     f"{worst['involuntary_switches']} times; {worst['num_requests']} requests, {worst['num_tokens']} tokens"
                     f"{', prefill' if worst['prefill'] else ''}{', replayed' if worst['graphed'] else ''})"
                     + (f"; its phases (ms) {dict(list(worst['phases_ms'].items())[:5])}" if worst.get("phases_ms") else ""))


def _direct_url(app_name: str, log) -> str:
    """The one replica's own HTTP base URL (direct ingress): no proxy hop."""
    urls = deploy.direct_urls(app_name, deploy.LOCAL_HOST, 1)
    if not urls:
        raise RuntimeError("direct ingress is on, but Serve named no replica port (its API is alpha in Ray 2.60)")
    log(f"direct ingress: replica {urls[0][0]} at {urls[0][1]}")
    return urls[0][1]


def cached_share(records) -> dict:
    """Prompt tokens of the completed requests and how many of them the replicas' caches served."""
    done = [r for r in records if r.completed]
    prompt, cached = sum(r.num_prompt_tokens for r in done), sum(r.num_cached_tokens for r in done)
    return {"prompt_tokens": prompt, "cached_tokens": cached,
            "cached_fraction": round(cached / prompt, 4) if prompt else None}


def prefix_routing_effect(summaries: list[dict]) -> list[dict]:
    """Prefix-aware routing on against off, per replica count and load (runs of one sweep)."""
    by_key = {(s["extra"].get("num_replicas"), s["extra"].get("prefix_routing"), s["load"]): s
              for s in summaries if s["num_completed"] and "prefix_routing" in s["extra"]}
    out = []
    for (n, routing, load), on in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[1]["concurrency"] or 0)):
        off = by_key.get((n, False, load))
        if not routing or off is None:
            continue
        row = {"num_replicas": n, "load": load, "concurrency": on["concurrency"]}
        for name, s in (("on", on), ("off", off)):
            row[name] = {"cached_fraction": s["extra"]["prefix_cache"]["cached_fraction"],
                         "ttft_p50_ms": (s.get("ttft_ms") or {}).get("p50"),
                         "ttft_p99_ms": (s.get("ttft_ms") or {}).get("p99"),
                         "output_token_throughput": s["output_token_throughput"],
                         "requests_per_replica": s["extra"]["replica_share"]["requests"],
                         "replica_max_over_mean": s["extra"]["replica_share"]["max_over_mean"]}
        row["throughput_ratio"] = round(on["output_token_throughput"] / off["output_token_throughput"], 3)
        row["ttft_p50_ratio"] = _ratio(on, off, "ttft_ms")
        out.append(row)
    return out


def format_prefix_routing(rows: list[dict]) -> str:
    lines = [f"{'replicas':>8} {'load':>6} {'routing':>7} {'cached':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'tok/s':>8}  requests per replica"]
    for r in rows:
        for name in ("on", "off"):
            x = r[name]
            lines.append(f"{r['num_replicas']:>8} {r['load']:>6} {name:>7} {100 * (x['cached_fraction'] or 0):>6.1f}% "
                         f"{x['ttft_p50_ms']:>9.1f} {x['ttft_p99_ms']:>9.1f} {x['output_token_throughput']:>8.1f}  "
                         f"{sorted(x['requests_per_replica'].values(), reverse=True)}")
        lines.append(f"{'':>8} {'':>6} {'on/off':>7} {'':>7} {_x(r['ttft_p50_ratio']):>9} {'':>9} "
                     f"{r['throughput_ratio']:>7.2f}x")
    return "\n".join(lines)


def run_in_process(args, config, loads_with_workloads, log) -> list:
    """The baseline: an Engine with the replica's own config, driven at every load in this process."""
    import gc

    from mtpserve.cluster.bench.engine_driver import EngineSweep, run_load
    from mtpserve.cluster.bench.workload import Load
    from mtpserve.engine.engine import Engine
    k = config.spec.draft_tokens
    sweep = EngineSweep(config.model_dir, config.device, config.num_threads, (k,), None,
                        tuple(load for load, _ in loads_with_workloads), args.max_tokens, args.temperature,
                        args.ignore_eos, args.seed, num_warmup_requests=args.warmup_requests,
                        timeout_s=args.timeout_s)
    started = time.perf_counter()
    engine = Engine(config)
    log(f"[{IN_PROCESS}] engine ready in {time.perf_counter() - started:.1f} s")
    runs = []
    if args.warmup_requests and loads_with_workloads:
        wl = loads_with_workloads[0][1]
        n = min(args.warmup_requests, wl.num_requests)
        run_load(engine, sweep, wl.warmup(n), Load(concurrency=n), k, tag="warmup",
                 max_tokens=min(16, args.max_tokens))
    for i, (load, wl) in enumerate(loads_with_workloads):
        run = run_load(engine, sweep, wl, load, k, tag=f"l{i}")
        log(f"[{IN_PROCESS}] {run.load_label}: {sum(r.num_output_tokens for r in run.records)} tokens "
            f"in {run.duration_s:.2f} s" + (f" — {run.error}" if run.error else ""))
        run.system = IN_PROCESS
        run.extra["num_replicas"] = 0
        runs.append(run)
    del engine
    gc.collect()
    return runs


def http_overhead(summaries: list[dict]) -> list[dict]:
    """What serving adds: 1 replica over HTTP against the in-process engine at each load, in ms
    added to TTFT and the inter-token latency (p50 and p99), and the throughput ratio; one row
    per HTTP configuration (Serve's direct ingress, N API servers, ...) and load."""
    done = [s for s in summaries if s["num_completed"]]
    base_of = {s["load"]: s for s in done if s["extra"]["num_replicas"] == 0}
    out = []
    for s in sorted((s for s in done if s["extra"]["num_replicas"] == 1), key=lambda s: s["concurrency"] or 0):
        base = base_of.get(s["load"])
        if base is None:
            continue
        row = {"system": s.get("system", ""), "load": s["load"], "concurrency": s["concurrency"],
               "throughput_ratio": round(s["output_token_throughput"] / base["output_token_throughput"], 3)}
        for key in ("ttft_ms", "itl_ms"):
            for p in ("p50", "p99"):
                a, b = (s.get(key) or {}).get(p), (base.get(key) or {}).get(p)
                row[f"{key[:-3]}_{p}_ms"] = a
                row[f"{key[:-3]}_{p}_in_process_ms"] = b
                row[f"{key[:-3]}_{p}_added_ms"] = round(a - b, 3) if a is not None and b is not None else None
        out.append(row)
    return out


def format_http_overhead(rows: list[dict]) -> str:
    width = max([len(r.get("system", "")) for r in rows] + [6])
    lines = [f"{'HTTP':<{width}} {'load':>5} {'TTFT p50 http/engine (+ms)':>28} {'TTFT p99 (+ms)':>16} "
             f"{'ITL p50 http/engine (+ms)':>27} {'ITL p99 (+ms)':>14} {'tok/s ratio':>11}"]
    for r in rows:
        lines.append(f"{r.get('system', ''):<{width}} {r['load']:>5} {r['ttft_p50_ms']:>9.2f}/{r['ttft_p50_in_process_ms']:<8.2f}"
                     f"({_signed(r['ttft_p50_added_ms'])}) {_signed(r['ttft_p99_added_ms']):>16} "
                     f"{r['itl_p50_ms']:>8.2f}/{r['itl_p50_in_process_ms']:<8.2f}({_signed(r['itl_p50_added_ms'])}) "
                     f"{_signed(r['itl_p99_added_ms']):>14} {r['throughput_ratio']:>10.2f}x")
    return "\n".join(lines)


def _signed(v) -> str:
    return "-" if v is None else f"{v:+.2f}"


def replica_share(records) -> dict:
    """Requests and output tokens per answering replica, and how uneven the split was."""
    requests = Counter(r.replica_id or "none" for r in records)
    tokens = Counter()
    for r in records:
        tokens[r.replica_id or "none"] += r.num_output_tokens if r.completed else 0
    counts = list(requests.values())
    return {"requests": dict(requests), "output_tokens": dict(tokens),
            "max_over_mean": round(max(counts) / (sum(counts) / len(counts)), 3) if counts else None}


def scaling(summaries: list[dict]) -> list[dict]:
    """N-vs-1 replica ratios at each load, for every N > 1 measured alongside 1 replica."""
    by_key = {(s["extra"]["num_replicas"], s["extra"].get("prefix_routing", True), s["load"]): s
              for s in summaries if s["num_completed"]}
    out = []
    for (n, routing, load), s in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[1]["concurrency"] or 0)):
        base = by_key.get((1, routing, load))
        if n <= 1 or base is None:
            continue
        tps, rps = s["output_token_throughput"], s["request_throughput"]
        out.append({"num_replicas": n, "prefix_routing": routing, "load": load, "concurrency": s["concurrency"],
                    "output_token_throughput": tps, "baseline_output_token_throughput": base["output_token_throughput"],
                    "throughput_ratio": round(tps / base["output_token_throughput"], 3),
                    "request_throughput_ratio": round(rps / base["request_throughput"], 3),
                    "efficiency": round(tps / base["output_token_throughput"] / n, 3),
                    "ttft_p50_ratio": _ratio(s, base, "ttft_ms"), "tpot_p50_ratio": _ratio(s, base, "tpot_ms"),
                    "replica_max_over_mean": s["extra"]["replica_share"]["max_over_mean"]})
    return out


def _ratio(s: dict, base: dict, key: str):
    a, b = (s.get(key) or {}).get("p50"), (base.get(key) or {}).get("p50")
    return round(a / b, 3) if a and b else None


def format_scaling(rows: list[dict]) -> str:
    lines = [f"{'replicas':>8} {'load':>8} {'tok/s':>9} {'1-replica':>10} {'ratio':>6} {'effic.':>6} "
             f"{'TTFT p50':>9} {'TPOT p50':>9} {'max/mean requests':>18}"]
    for r in rows:
        lines.append(f"{r['num_replicas']:>8} {r['load']:>8} {r['output_token_throughput']:>9.1f} "
                     f"{r['baseline_output_token_throughput']:>10.1f} {r['throughput_ratio']:>5.2f}x "
                     f"{r['efficiency']:>6.2f} {_x(r['ttft_p50_ratio']):>9} {_x(r['tpot_p50_ratio']):>9} "
                     f"{r['replica_max_over_mean']:>18}")
    return "\n".join(lines)


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def plot_scaling(summaries: list[dict], rows: list[dict], path: Path, title: str) -> str | None:
    """Tokens/s against concurrency per replica count, and the N-vs-1 ratio against the ideal N."""
    plt = report.pyplot()
    if plt is None:
        return report.NO_MATPLOTLIB
    fig, (ax_tps, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n in sorted({s["extra"]["num_replicas"] for s in summaries}):
        pts = sorted((s["concurrency"], s["output_token_throughput"]) for s in summaries
                     if s["extra"]["num_replicas"] == n and s["num_completed"] and s["concurrency"])
        ax_tps.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=replica_label(n))
    ax_tps.set_xscale("log")
    xs = sorted({s["concurrency"] for s in summaries if s["concurrency"]})
    ax_tps.set_xticks(xs, [str(x) for x in xs])
    ax_tps.minorticks_off()
    ax_tps.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    ax_tps.grid(True, alpha=0.3)
    ax_tps.legend(fontsize=8)
    for n in sorted({r["num_replicas"] for r in rows}):
        mine = [r for r in rows if r["num_replicas"] == n]
        ax_ratio.plot([str(r["concurrency"]) for r in mine], [r["throughput_ratio"] for r in mine], marker="o",
                      label=f"{n} vs 1 replica")
        ax_ratio.axhline(n, linestyle="--", color="grey", linewidth=1)
    ax_ratio.axhline(1, linestyle=":", color="grey", linewidth=1)
    ax_ratio.set(xlabel="concurrency", ylabel="tokens/s ratio (dashed: ideal)", title="scaling N vs 1 replica")
    ax_ratio.set_ylim(bottom=0)
    ax_ratio.grid(True, alpha=0.3)
    if rows:
        ax_ratio.legend(fontsize=8)
    return report.save_figure(fig, path, title)


def plot_prefix_routing(rows: list[dict], path: Path, title: str) -> str | None:
    """Prefix-aware routing on vs off at each load: cached prompt tokens, TTFT p50 / p99, tokens/s."""
    plt = report.pyplot()
    if plt is None:
        return report.NO_MATPLOTLIB
    panels = [("cached_fraction", "prompt tokens from cache", 100.0), ("ttft_p50_ms", "TTFT p50 (ms)", 1.0),
              ("ttft_p99_ms", "TTFT p99 (ms)", 1.0), ("output_token_throughput", "output tokens/s", 1.0)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    labels = [f"{r['num_replicas']}r {r['load']}" for r in rows]
    xs = range(len(rows))
    for ax, (key, name, scale) in zip(axes, panels):
        for offset, mode in ((-0.2, "on"), (0.2, "off")):
            ax.bar([x + offset for x in xs], [(r[mode][key] or 0) * scale for r in rows], width=0.4,
                   label=f"prefix routing {mode}")
        ax.set_xticks(list(xs), labels)
        ax.set(title=name + (" (%)" if scale == 100.0 else ""))
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    return report.save_figure(fig, path, title)
