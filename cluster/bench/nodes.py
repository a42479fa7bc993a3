"""A multi-node Ray cluster on this machine, a node lost mid-load: `mtpserve bench --nodes 3`.

    mtpserve bench --nodes 3 --max-tokens 24 --concurrency 6                  deploy with `mtpserve serve`
    mtpserve bench --nodes 3 --deploy config                                  `serve deploy manifests/serve-nodes.yaml`

Starts a head and N-1 worker nodes as separate `ray start` processes (``cluster.local_cluster``:
node IPs 127.0.0.1..N, a Serve proxy per node on its own port, token auth, the proxy middleware's
variable on every node), then deploys one CPU replica per worker node, pinned by the custom
resource ``mtpserve_replica`` each worker node has one of (as a GPU manifest pins one per GPU):
with ``mtpserve serve --address`` (a subprocess, as a user runs it) or ``serve deploy`` of a Serve
config (the manifest, with this run's port). Then, over HTTP through every node's proxy:

1. placement: the replicas and the nodes they run on; the planner actor's node (the head);
2. greedy: prompts at temperature 0, each through another node's proxy, token ids against
   ``mtpserve generate``'s engine in this process (run before the cluster starts);
3. sessions: each session's first request through one proxy, its next ones through the others:
   every one must reach the same replica;
4. spread: concurrent requests without a session through every proxy: which replica (node) each
   reached;
5. node loss: --concurrency clients stream requests round the proxies; --kill-node-after S
   seconds in, the raylet of the worker node with the busiest replica is SIGKILLed. Every request
   is classified: ``ok`` (full length), ``clear error`` (the OpenAI envelope or SSE error event the
   proxy middleware sends for the lost replica's requests), ``proxy lost`` (its stream entered by
   the lost node's own proxy: the connection dropped, as with any lost machine), ``proxy down``
   (sent to that proxy after it died: connection refused; the client then leaves it out, as a
   load balancer's health check would), ``unclear`` (anything else) or ``hung``. The node stays
   down --node-down-s while Serve's status for the replica it cannot place is recorded (and
   whether any live node still offers the replica resource), then rejoins; recorded: seconds until the GCS counted the
   node dead, the replica left the planner's view, Serve ran every replica again and the planner's
   view recovered; the planner's pid before and after (it must be the same actor, on the head);
6. after: requests through every proxy (the returned node's too) complete; every replica's pools
   idle, empty and passing their integrity checks.

Passes when the greedy outputs match, sessions stayed, the planner survived, nothing was unclear
or hung, the other replica's requests completed, the replica came back and the pools are clean.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from mtpserve.cluster.bench.http_driver import SSE_END, sse_objects
from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS
from mtpserve.cluster.local_cluster import MAX_NODES, REPLICA_RESOURCE, LocalCluster, die_with_parent

APP_NAME = "mtpserve"
REPLICA_HEADER = "x-mtpserve-replica"
SESSION_HEADER = "x-session-id"
OTHER_PROBE_TOKENS = 160          # long enough to be in flight at the kill, short enough to finish
LOST_PROBE_TOKENS = 1536          # still in flight at the kill: the probes open at once, the kill follows
                                  # their first tokens (512 could finish first on a 2-core machine)
MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "serve-nodes.yaml"
# a lost node is declared dead after about a second of missed health checks (Ray's default is ~15 s)
FAST_NODE_DEATH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
                   "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "3"}


# ---------------------------------------------------------------------------- one request
def send(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float, session_id: str | None = None,
         first_token: threading.Event | None = None) -> dict:
    """One streamed greedy completion through ``url``; returns what the client saw. ``first_token``
    is set once its first token has arrived (or it ended without one)."""
    import requests
    out = {"url": url, "replica": None, "token_ids": [], "outcome": None, "error": None,
           "started": time.perf_counter(), "ended": None}
    headers = {SESSION_HEADER: session_id} if session_id else {}
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    try:
        with requests.post(f"{url}/v1/completions", json=body, headers=headers, stream=True,
                           timeout=timeout_s) as r:
            out["replica"] = r.headers.get(REPLICA_HEADER)
            if r.status_code != 200:
                try:
                    err = r.json()["error"]
                    out["outcome"], out["error"] = "clear error", f"HTTP {r.status_code} {err['code']}: {err['message']}"
                except Exception:  # noqa: BLE001 - not the envelope
                    out["outcome"], out["error"] = "unclear", f"HTTP {r.status_code}: {r.text[:160]}"
                return out
            finished = done = False
            for obj in sse_objects(r.iter_lines()):
                if obj is SSE_END:
                    done = True
                    break
                if "error" in obj:
                    out["outcome"] = "clear error"
                    out["error"] = f"SSE error event {obj['error'].get('code')}: {obj['error'].get('message')}"
                    return out
                for choice in obj.get("choices") or []:
                    out["token_ids"] += choice.get("token_ids") or []
                    finished = finished or bool(choice.get("finish_reason"))
                if first_token is not None and out["token_ids"]:
                    first_token.set()
            if finished and done and len(out["token_ids"]) == max_tokens:
                out["outcome"] = "ok"
            else:
                out["outcome"] = "unclear"
                out["error"] = (f"the stream ended after {len(out['token_ids'])} of {max_tokens} tokens"
                                f"{'' if finished else ' without a finish_reason'}{'' if done else ' or [DONE]'}")
    except requests.Timeout:
        out["outcome"], out["error"] = "hung", f"no answer within {timeout_s:g} s"
    except requests.ConnectionError as e:
        refused = "refused" in str(e).lower()     # nothing listens there: the proxy's node is gone
        out["outcome"] = "connection refused" if refused else "connection error"
        out["error"] = f"{type(e).__name__}: {str(e)[-160:]}"
    except requests.RequestException as e:       # e.g. ChunkedEncodingError: the stream was torn
        out["outcome"] = "connection error"
        out["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    finally:
        out["ended"] = time.perf_counter()
        if first_token is not None:
            first_token.set()
    return out


# ---------------------------------------------------------------------------- deploying
class Deployment:
    """The app on the cluster, deployed as a user would; ``stop()`` takes it down again."""

    def __init__(self, args, cluster: LocalCluster, workdir: Path, log):
        self.args, self.cluster, self.proc = args, cluster, None
        self.how = args.deploy
        flags = {"model_dir": args.model, "device": "cpu", "num_replicas": cluster.num_workers,
                 "num_cpus_per_replica": 1, "replica_resource": REPLICA_RESOURCE, "num_threads": 1,
                 "draft_tokens": args.draft_tokens or "auto", "max_resident_requests": 16}
        if self.how == "cli":
            cmd = [sys.executable, "-m", "mtpserve.cluster.serve", "--address", cluster.address,
                   "--port", str(cluster.http_port), "--app-name", APP_NAME]
            for name, value in flags.items():
                cmd += [{"model_dir": "--model", "num_replicas": "--replicas"}.get(name, "--" + name.replace("_", "-")),
                        str(value)]
            self.command = cmd
            # SIGKILLed if this process dies: its cluster dies with this process too, nothing is left to delete
            self.proc = subprocess.Popen(cmd, env=cluster.env, stdout=open(workdir / "serve.log", "w"),
                                         stderr=subprocess.STDOUT, preexec_fn=lambda: die_with_parent(signal.SIGKILL))
        else:
            import yaml
            config = yaml.safe_load(Path(args.serve_config or MANIFEST).read_text())
            config["http_options"]["port"] = cluster.http_port
            app = config["applications"][0]
            assert app["name"] == APP_NAME, f"the Serve config's application must be named {APP_NAME}"
            app["args"].update({k: v for k, v in flags.items() if k in ("model_dir", "draft_tokens")})
            path = workdir / "serve-config.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            self.command = ["serve", "deploy", str(path), "--address", cluster.dashboard_url]
            out = subprocess.run([sys.executable, "-m", "ray.serve.scripts", *self.command[1:]], env=cluster.env,
                                 capture_output=True, text=True, timeout=120)
            if out.returncode != 0:
                raise RuntimeError(f"serve deploy failed: {out.stdout[-1500:]} {out.stderr[-1500:]}")
        log(f"deployed with: {' '.join(self.command[:3])} ...")

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"mtpserve serve exited with {self.proc.returncode}")

    def stop(self) -> int | None:
        """SIGINT to `mtpserve serve` (it deletes the app and its planner); its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# ---------------------------------------------------------------------------- the run
def reference_outputs(model: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """``mtpserve generate``'s token ids (its engine and defaults, this process) for greedy prompts."""
    from mtpserve.cluster.generate import run_prompts
    from mtpserve.engine.config import EngineConfig, from_flat
    from mtpserve.engine.engine import Engine
    from mtpserve.engine.sampler import SamplingParams
    engine = Engine(from_flat(EngineConfig, {"model_dir": model, "device": "cpu", "draft_tokens": "2"}))
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]
    return [r.token_ids for r in run_prompts(engine, prompts, params)]


def run_nodes(args, log) -> dict:
    """The whole run (see the module docstring); returns its figures."""
    if not 3 <= args.nodes <= MAX_NODES:
        raise ValueError(f"--nodes N needs 3 <= N <= {MAX_NODES}: a head and at least two worker nodes, one "
                         f"replica each (each node's worker ports are a block of their own)")
    prompts = [p for p in BUNDLED_PROMPTS if p.strip()][:6]
    started = time.perf_counter()
    reference = reference_outputs(args.model, prompts, args.max_tokens)
    log(f"reference: `mtpserve generate`'s engine on {len(prompts)} prompts in {time.perf_counter() - started:.1f} s")
    workdir = Path(tempfile.mkdtemp(prefix="mtpn-", dir="/tmp"))     # short: Ray's socket paths live under it
    cluster = LocalCluster(args.nodes - 1, workdir, include_dashboard=args.deploy == "config", extra_env=dict(FAST_NODE_DEATH))
    figures: dict = {"num_nodes": args.nodes, "deployed_with": args.deploy}
    try:
        t0 = time.perf_counter()
        cluster.start()
        figures["cluster_start_s"] = round(time.perf_counter() - t0, 1)
        figures["nodes"] = [{"index": n.index, "ip": n.ip, "proxy": n.proxy_url, "resources": n.resources,
                             "num_cpus": n.num_cpus} for n in cluster.nodes]
        log(f"{args.nodes} nodes up in {figures['cluster_start_s']} s: proxies {cluster.proxy_urls}")
        figures.update(_run_on_cluster(args, cluster, workdir, prompts, reference, log))
    finally:
        t0 = time.perf_counter()
        cluster.stop()
        figures["cluster_stop_s"] = round(time.perf_counter() - t0, 1)
        if not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    figures["passed"] = nodes_ok(figures)
    return figures


def _run_on_cluster(args, cluster: LocalCluster, workdir: Path, prompts, reference, log) -> dict:
    import ray

    from mtpserve.cluster import deploy
    from mtpserve.cluster.client import replica_statuses
    figures: dict = {}
    num_replicas = cluster.num_workers
    t0 = time.perf_counter()
    deployment = Deployment(args, cluster, workdir, log)
    try:
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        deploy.wait_for_view(APP_NAME, lambda v: len(v.replicas) == num_replicas, args.timeout_s,
                             f"{num_replicas} replicas report to the planner", interval_s=0.5)
        urls = cluster.proxy_urls
        _wait_for_proxies(urls, args.timeout_s)
        figures["deploy_s"] = round(time.perf_counter() - t0, 1)
        figures["deploy_command"] = deployment.command
        statuses = replica_statuses(APP_NAME)
        replica_node = {rid: cluster.node_index(s["node_id"]) for rid, s in statuses.items()}
        planner = _planner_where(APP_NAME, cluster)
        figures["placement"] = {"replica_node": replica_node, "planner": planner}
        log(f"up in {figures['deploy_s']} s: replica -> node {replica_node}; planner on node {planner['node']}")
        model = _model_name(urls[0])

        # greedy output through each proxy in turn, against `mtpserve generate`
        got = [send(urls[i % len(urls)], model, p, args.max_tokens, args.timeout_s) for i, p in enumerate(prompts)]
        figures["greedy"] = {"num_prompts": len(prompts), "num_equal": sum(g["token_ids"] == r for g, r in
                                                                           zip(got, reference)),
                             "via": [g["url"] for g in got], "replicas": [g["replica"] for g in got],
                             "errors": [g["error"] for g in got if g["error"]]}
        log(f"greedy: {figures['greedy']['num_equal']}/{len(prompts)} equal to `mtpserve generate`")

        # sessions: the first request through one proxy, the next ones through the others
        sessions = {}
        for s in range(2 * num_replicas):
            sid, order = f"nodes-session-{s}", urls[s % len(urls):] + urls[:s % len(urls)]
            seen = []
            for j, url in enumerate(order):
                seen.append(send(url, model, prompts[s % len(prompts)], 4, args.timeout_s, session_id=sid)["replica"])
                if j == 0:
                    time.sleep(0.5)      # the binding reaches the planner and every proxy's router (0.25 s refresh)
            sessions[sid] = seen
        figures["sessions"] = {"replicas_seen": sessions,
                               "num_stayed": sum(len(set(v)) == 1 and None not in v for v in sessions.values()),
                               "num_sessions": len(sessions),
                               "replicas_used": sorted({v[0] for v in sessions.values() if v[0]})}
        log(f"sessions: {figures['sessions']['num_stayed']}/{len(sessions)} stayed on one replica across "
            f"{len(urls)} proxies")

        # spread: no sessions, concurrent, every proxy
        spread = _concurrent(urls, model, prompts, args.max_tokens, 2 * len(urls), args.timeout_s)
        figures["spread"] = {"num_requests": len(spread), "num_ok": sum(r["outcome"] == "ok" for r in spread),
                             "by_node": dict(Counter(str(replica_node.get(r["replica"])) for r in spread))}
        log(f"spread: {figures['spread']}")

        figures["node_loss"] = _node_loss(args, cluster, urls, model, prompts, replica_node, planner, log)
        deployment.check()

        # prompts no replica has cached: prefix-aware routing would send the old ones to the replica
        # that served them all while the node was down, and the burst would not show the new one serving
        fresh = [f"After the node came back, request {i}: {p}" for i, p in enumerate(prompts)]
        after = _concurrent(urls, model, fresh, args.max_tokens, 2 * len(urls), args.timeout_s)
        new_statuses = _settled_statuses(num_replicas, timeout_s=120)
        new_nodes = {rid: cluster.node_index(s["node_id"]) for rid, s in new_statuses.items()}
        figures["after"] = {"num_requests": len(after), "num_ok": sum(r["outcome"] == "ok" for r in after),
                            "errors": dict(Counter(r["error"] for r in after if r["error"])),
                            "by_node": dict(Counter(str(new_nodes.get(r["replica"])) for r in after)),
                            "replica_node": new_nodes}
        figures["replicas_after"] = {rid: {"node": new_nodes[rid],
                                           **{k: s[k] for k in ("integrity", "idle_and_empty", "num_free_blocks",
                                                                "num_usable_blocks", "num_free_rows", "num_rows")}}
                                     for rid, s in new_statuses.items()}
        figures["planner_after"] = _planner_where(APP_NAME, cluster)
        log(f"after: {figures['after']['num_ok']}/{len(after)} ok, by node {figures['after']['by_node']}; pools "
            + ", ".join(f"node {r['node']}: {r['integrity']}, idle {r['idle_and_empty']}"
                        for r in figures["replicas_after"].values()))
    finally:
        figures["serve_exit_status"] = deployment.stop()
        ray.shutdown()
    return figures


def _node_loss(args, cluster: LocalCluster, urls, model, prompts, replica_node, planner, log) -> dict:
    """Clients streaming round the proxies; a worker node's raylet killed; the node back later."""
    import ray

    from mtpserve.cluster import deploy
    view = deploy.placement(APP_NAME)
    records, lock, stop = [], threading.Lock(), threading.Event()
    down: set[str] = set()            # proxies a client found refusing connections (a load balancer's view)
    top = max(int(c) for c in str(args.concurrency or "6").split(","))

    def client(i: int) -> None:
        rng = random.Random(args.seed * 100 + i)
        k = i
        while not stop.is_set():
            live = [u for u in urls if u not in down] or urls
            url = live[k % len(live)]
            k += 1
            r = send(url, model, rng.choice(prompts), args.max_tokens, args.timeout_s)
            if r["outcome"] == "connection refused":
                down.add(url)
            with lock:
                records.append(r)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(top)]
    for t in threads:
        t.start()
    time.sleep(args.kill_node_after)
    view = deploy.placement(APP_NAME) or view
    victim = max(view.replicas, key=lambda rid: view.replicas[rid].num_running)
    index = replica_node[victim]
    victim_ip = cluster.nodes[index].ip
    other = next(rid for rid in view.replicas if rid != victim)
    probes = _open_probes(urls, model, {"lost replica": (prompts[0], victim, LOST_PROBE_TOKENS),
                                        "other replica": (prompts[1], other, OTHER_PROBE_TOKENS)}, args.timeout_s)
    running = {rid: r.num_running for rid, r in view.replicas.items()}
    pid = cluster.kill_node(index)
    killed_at = time.perf_counter()
    log(f"killed node {index} ({victim_ip})'s raylet, pid {pid}, {args.kill_node_after:g} s into the load; "
        f"its replica {victim}; running: {running}")
    times = {"node_dead_s": None, "victim_left_view_s": None}
    serve_while_down = None
    while time.perf_counter() - killed_at < args.node_down_s or None in times.values():
        now = round(time.perf_counter() - killed_at, 2)
        if now > args.node_down_s + 60:
            break
        if times["node_dead_s"] is None and cluster.num_alive_nodes() == len(cluster.nodes) - 1:
            times["node_dead_s"] = now
        v = deploy.placement(APP_NAME)
        if times["victim_left_view_s"] is None and v is not None and victim not in v.replicas:
            times["victim_left_view_s"] = now
        serve_while_down = {**(_serve_status() or {}), "replica_resource_alive":
                            ray.cluster_resources().get(REPLICA_RESOURCE, 0),
                            "replica_resource_needed": len(view.replicas)}
        time.sleep(0.25)
    stop.set()                        # the load ends while the node is still down
    for t in threads + [t for group in probes.values() for t, _ in group.values()]:
        t.join(args.timeout_s + 30)
    probe_outcomes = {name: {url: {k: r[k] for k in ("replica", "outcome", "error")} | {"num_tokens": len(r["token_ids"])}
                             for url, (_, r) in group.items()} for name, group in probes.items()}
    log(f"probes on the lost replica, by proxy: {probe_outcomes}")
    planner_while_down = _planner_where(APP_NAME, cluster)
    log(f"node down {time.perf_counter() - killed_at:.1f} s: {times}; Serve: {serve_while_down}")
    cluster.start_node(index)          # (started twice if the first start times out on a loaded machine)
    back_at = time.perf_counter()
    recovered = {"serve_running_s": None, "view_recovered_s": None}
    while time.perf_counter() - back_at < args.timeout_s and None in recovered.values():
        now = round(time.perf_counter() - back_at, 2)
        if recovered["serve_running_s"] is None and deploy.num_running(APP_NAME) == len(view.replicas):
            recovered["serve_running_s"] = now
        v = deploy.placement(APP_NAME)
        if v is not None and victim not in v.replicas and len(v.replicas) == len(view.replicas):
            recovered["view_recovered_s"] = now
        time.sleep(0.25)
    _wait_for_proxies(urls, args.timeout_s)
    log(f"node {index} back: {recovered} (s after it rejoined)")
    return {"victim_node": {"index": index, "ip": victim_ip}, "victim_replica": victim, "raylet_pid": pid,
            "kill_after_s": args.kill_node_after, "running_at_kill": running,
            "times_after_kill": times, "serve_while_down": serve_while_down,
            "recovery_after_rejoin": recovered, "planner_while_down": planner_while_down,
            "planner_before": planner, "probes": probe_outcomes,
            "outcomes": classify(records, killed_at, victim, cluster.nodes[index].proxy_url, args.max_tokens,
                                 {n.proxy_url: n.index for n in cluster.nodes})}


def _open_probes(urls, model, groups: dict[str, tuple[str, str, int]], timeout_s: float) -> dict:
    """Before the kill: through every proxy, one stream a group ``{name: (prompt, replica,
    max_tokens)}`` bound (by session) to its replica, all opened at once and each holding its
    first token; {name: {url: (thread, record)}}. On the lost replica, what each ends with shows
    what a client of that node's proxy sees (the proxy middleware's SSE error event); on another
    replica, each must complete (but the one through the lost node's own proxy). (Opened one
    after another, the first lost-replica stream once streamed all its 1,536 tokens before the
    last had its first, and ended before the kill.)"""
    import ray

    from mtpserve.actors.planner import get_planner
    planner = get_planner(APP_NAME)
    for _, replica, _ in groups.values():
        for i in range(len(urls)):
            ray.get(planner.bind_session.remote(f"probe-{replica}-{i}", replica), timeout=10)
    time.sleep(0.75)                  # every proxy's router has the bindings (0.25 s refresh)
    probes, firsts = {}, []
    for name, (prompt, replica, max_tokens) in groups.items():
        probes[name] = {}
        for i, url in enumerate(urls):
            record, first = {}, threading.Event()
            t = threading.Thread(target=lambda u=url, r=record, f=first, p=prompt, n=max_tokens,
                                 sid=f"probe-{replica}-{i}": r.update(
                send(u, model, p, n, timeout_s, session_id=sid, first_token=f)), daemon=True)
            t.start()
            probes[name][url] = (t, record)
            firsts.append(first)
    deadline = time.monotonic() + timeout_s
    for first in firsts:
        first.wait(max(0.0, deadline - time.monotonic()))
    return probes


def classify(records: list[dict], killed_at: float, victim: str, victim_proxy: str, max_tokens: int,
             proxy_node: dict[str, int]) -> dict:
    """The load's requests by what happened to them around the kill; ``stuck``: each hung or
    unclear one in full (its proxy's node by ``proxy_node``, when it started and ended against
    the kill, its replica and the tokens it got), to tell where it stalled."""
    groups: dict[str, Counter] = {"before the kill": Counter(), "in flight on the lost replica": Counter(),
                                  "in flight through the lost node's proxy": Counter(),
                                  "in flight, no response started": Counter(),
                                  "in flight elsewhere": Counter(), "after the kill": Counter()}
    messages: Counter = Counter()
    stuck = []
    for r in records:
        if r["ended"] < killed_at:
            group = "before the kill"
        elif r["started"] >= killed_at:
            group = "after the kill"
        elif r["url"] == victim_proxy:
            group = "in flight through the lost node's proxy"
        elif r["replica"] == victim:
            group = "in flight on the lost replica"
        elif r["replica"] is None:     # no replica had answered: the proxy's 503 names none (the lost one's queue)
            group = "in flight, no response started"
        else:
            group = "in flight elsewhere"
        outcome = r["outcome"]
        if outcome in ("connection error", "connection refused") and r["url"] == victim_proxy \
                and r["ended"] >= killed_at:
            outcome = "proxy lost" if outcome == "connection error" else "proxy down"
        groups[group][outcome] += 1
        if r["error"] and outcome not in ("proxy lost", "proxy down"):
            messages[f"{group}: {outcome}: {r['error'][:140]}"] += 1
        if outcome in ("hung", "unclear"):
            stuck.append({"group": group, "outcome": outcome, "via_node": proxy_node.get(r["url"], r["url"]),
                          "started_s": round(r["started"] - killed_at, 2), "ended_s": round(r["ended"] - killed_at, 2),
                          "replica": r["replica"], "num_tokens": len(r["token_ids"]), "error": r["error"]})
    return {"num_requests": len(records), **{g: dict(c) for g, c in groups.items()},
            "messages": dict(messages.most_common(10)), "stuck": stuck}


def _concurrent(urls, model, prompts, max_tokens, n, timeout_s) -> list[dict]:
    out = [None] * n

    def one(i):
        out[i] = send(urls[i % len(urls)], model, prompts[i % len(prompts)], max_tokens, timeout_s)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _wait_for_proxies(urls, timeout_s: float) -> None:
    """Until Serve's proxy on every node answers its health route."""
    import requests
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                if requests.get(f"{url}/-/healthz", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Serve's proxy at {url} did not come up within {timeout_s:g} s")
            time.sleep(0.5)


def _settled_statuses(num_replicas: int, timeout_s: float) -> dict:
    """Every replica's engine status once all are idle (in-flight aborts take a step to land)."""
    from mtpserve.cluster.client import replica_statuses
    deadline, statuses = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            statuses = replica_statuses(APP_NAME)
        except Exception:  # noqa: BLE001 - the planner's view is catching up
            statuses = {}
        if len(statuses) == num_replicas and all(s["idle_and_empty"] for s in statuses.values()):
            break
        time.sleep(1)
    return statuses


def _planner_where(app_name: str, cluster: LocalCluster) -> dict | None:
    """The planner actor's node (our index), pid and actor id."""
    import ray

    from mtpserve.actors.planner import get_planner
    planner = get_planner(app_name)
    try:
        where = ray.get(planner.where.remote(), timeout=10) if planner is not None else None
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)[:200]}
    return where and {**where, "node": cluster.node_index(where["node_id"])}


def _serve_status() -> dict | None:
    """Serve's own word on the app's deployment: status and message."""
    from ray import serve
    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)[:200]}
    if app is None:
        return None
    return {"app": str(app.status), **{name: {"status": str(d.status), "replica_states": dict(d.replica_states),
                                              "message": d.message}
                                       for name, d in app.deployments.items()}}


def _model_name(url: str) -> str:
    import requests
    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


# ---------------------------------------------------------------------------- verdict and text
def nodes_ok(f: dict) -> bool:
    loss = f.get("node_loss")
    if not loss or "after" not in f:
        return False
    o = loss["outcomes"]
    bad = sum(n for g, c in o.items() if isinstance(c, dict) and g != "messages"
              for k, n in c.items() if k in ("unclear", "hung"))
    elsewhere = o.get("in flight elsewhere", {})
    on_victim = {**o.get("in flight on the lost replica", {}), **o.get("in flight, no response started", {})}
    planner_kept = (loss["planner_before"] or {}).get("pid") == (f.get("planner_after") or {}).get("pid") \
        and (f.get("planner_after") or {}).get("node") == 0
    victim_url = f["nodes"][loss["victim_node"]["index"]]["proxy"]
    probes_ok = all(p["outcome"] == ("ok" if name == "other replica" else "clear error")
                    for name, group in loss["probes"].items() for url, p in group.items() if url != victim_url)
    return (probes_ok and f["greedy"]["num_equal"] == f["greedy"]["num_prompts"]
            and f["sessions"]["num_stayed"] == f["sessions"]["num_sessions"]
            and bad == 0 and set(elsewhere) <= {"ok"} and set(on_victim) <= {"ok", "clear error"}
            and loss["recovery_after_rejoin"]["view_recovered_s"] is not None and planner_kept
            and f["after"]["num_ok"] == f["after"]["num_requests"]
            and len(f["replicas_after"]) == f["num_nodes"] - 1
            and all(r["integrity"] == "ok" and r["idle_and_empty"] for r in f["replicas_after"].values()))


def _node_of(f: dict, proxy_url: str):
    return next((n["index"] for n in f["nodes"] if n["proxy"] == proxy_url), "?")


def format_nodes(f: dict) -> str:
    lines = [f"{f['num_nodes']} nodes ({', '.join(n['ip'] for n in f['nodes'])}) up in {f.get('cluster_start_s')} s; "
             f"app deployed with {f['deployed_with']} in {f.get('deploy_s')} s"]
    if "placement" in f:
        p = f["placement"]
        lines.append(f"replica -> node: {p['replica_node']}; planner on node {p['planner']['node']} (0 = head)")
        g, s = f["greedy"], f["sessions"]
        lines.append(f"greedy: {g['num_equal']}/{g['num_prompts']} equal to `mtpserve generate` (through "
                     f"{len(set(g['via']))} proxies, replicas {sorted(set(map(str, g['replicas'])))})")
        lines.append(f"sessions: {s['num_stayed']}/{s['num_sessions']} stayed on one replica whichever proxy "
                     f"they entered by; replicas used {s['replicas_used']}")
        lines.append(f"spread: {f['spread']['num_ok']}/{f['spread']['num_requests']} ok, by node "
                     f"{f['spread']['by_node']}")
    loss = f.get("node_loss")
    if loss:
        lines.append(f"node loss: node {loss['victim_node']['index']} ({loss['victim_node']['ip']}) raylet killed "
                     f"{loss['kill_after_s']:g} s in; {loss['times_after_kill']}; back: {loss['recovery_after_rejoin']}")
        for name, group in loss["probes"].items():
            lines.append(f"  probes on the {name}, by proxy: " + ", ".join(
                f"node {_node_of(f, url)}: {p['outcome']} after {p['num_tokens']} tokens" for url, p in group.items()))
        for group, counts in loss["outcomes"].items():
            if isinstance(counts, dict) and group not in ("messages", "stuck") and counts:
                lines.append(f"  {group}: {counts}")
        lines += [f"  {n} x {m}" for m, n in loss["outcomes"]["messages"].items()]
        lines += [f"  stuck: {r}" for r in loss["outcomes"].get("stuck", [])]
        lines.append(f"  Serve while the node was down: {loss['serve_while_down']}")
        lines.append(f"  planner: before {loss['planner_before']}, while down {loss['planner_while_down']}, "
                     f"after {f.get('planner_after')}")
    if "after" in f:
        a = f["after"]
        lines.append(f"after: {a['num_ok']}/{a['num_requests']} ok, by node {a['by_node']}")
        for rid, r in f["replicas_after"].items():
            lines.append(f"  replica {rid} on node {r['node']}: integrity {r['integrity']}, idle {r['idle_and_empty']}, "
                         f"blocks {r['num_free_blocks']}/{r['num_usable_blocks']} free, rows "
                         f"{r['num_free_rows']}/{r['num_rows']} free")
    lines.append(f"cluster stopped in {f.get('cluster_stop_s')} s")
    lines.append("PASSED" if f.get("passed") else "FAILED (see above)")
    return "\n".join(lines)
