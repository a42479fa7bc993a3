"""A replica killed mid-load: `mtpserve bench --replicas N --kill-replica-after S`.

    mtpserve bench --replicas 2 --concurrency 16 --kill-replica-after 5 --max-tokens 128

Deploys N replicas (as the scaling run does), starts the load at the top concurrency, and S
seconds in SIGKILLs the process of the replica with the most running requests (``ray.kill``
when it lives on another node); Serve is left to replace it. Recorded:

- the victim's requests: finished before the kill, or in flight and ended with what error
  (what the client saw: the SSE error event or the HTTP status and envelope);
- requests that reached no replica (answered by the proxy: 503 envelope);
- the other replicas' requests: all complete, at full length;
- seconds from the kill until the victim left the planner's view, until Serve ran N replicas
  again, and until the planner's view showed N live replicas;
- after recovery: a second load, whose requests must complete, some on the new replica, and
  every replica's pools idle, empty and passing their integrity checks.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from mtpserve.cluster import deploy
from mtpserve.cluster.bench.replicas import (
    APP_NAME,
    deployed,
    num_devices,
    parse_replicas,
    replica_label,
    replica_share,
    serve_options,
)
from mtpserve.cluster.deploy import kill_replica, num_running, placement, serve_replica_ids


def wait_for_recovery(victim: str, num_replicas: int, killed_at: float, timeout_s: float) -> dict:
    """Seconds after ``killed_at`` until each recovery milestone (None: not within the timeout)."""
    before = serve_replica_ids(APP_NAME)
    out = {"victim_left_view_s": None, "serve_replaced_s": None, "view_recovered_s": None}
    deadline = killed_at + timeout_s
    while time.perf_counter() < deadline and None in out.values():
        now = time.perf_counter() - killed_at
        view = placement(APP_NAME)
        if view is not None and out["victim_left_view_s"] is None and victim not in view.replicas:
            out["victim_left_view_s"] = round(now, 2)
        if out["serve_replaced_s"] is None and serve_replica_ids(APP_NAME) - before - {victim} \
                and num_running(APP_NAME) == num_replicas:
            out["serve_replaced_s"] = round(now, 2)
        if view is not None and victim not in view.replicas and len(view.replicas) == num_replicas:
            out["view_recovered_s"] = round(now, 2)
        time.sleep(0.1)
    return out


def outcomes(records, victim: str, max_tokens: int | None) -> dict:
    """Requests of one load grouped by what happened to them."""
    on_victim = [r for r in records if r.replica_id == victim]
    unplaced = [r for r in records if r.replica_id is None]
    others = [r for r in records if r.replica_id not in (victim, None)]
    failed = [r for r in on_victim if not r.completed]
    full = [r for r in others if r.completed and (max_tokens is None or r.num_output_tokens == max_tokens)]
    return {
        "victim": {"num_requests": len(on_victim), "num_finished_before_kill": len(on_victim) - len(failed),
                   "num_in_flight_failed": len(failed),
                   "num_tokens_before_failure": [r.num_output_tokens or len(r.chunk_times_s) for r in failed],
                   "client_saw": dict(Counter(r.error for r in failed))},
        "unplaced": {"num_requests": len(unplaced), "num_failed": sum(not r.completed for r in unplaced),
                     "client_saw": dict(Counter(r.error for r in unplaced if r.error))},
        "others": {"num_requests": len(others), "num_completed": sum(r.completed for r in others),
                   "num_full_length": len(full), "errors": dict(Counter(r.error for r in others if r.error))},
    }


def run_fault(args, load, workload, log) -> dict:
    """The fault run (see the module docstring); returns its figures and the two LoadRuns."""
    import ray

    from mtpserve.cluster.bench.http_driver import HttpTarget, run_http_loads
    from mtpserve.cluster.bench.workload import Load, Workload
    from mtpserve.cluster.client import replica_statuses
    with deploy.connected(args.address or None, quiet=True):
        num_replicas = max(parse_replicas(args.replicas, args.device, num_devices(ray, args.device)))
        if num_replicas < 2:
            raise ValueError("--kill-replica-after needs --replicas N with N >= 2")
        n = min(4 * num_replicas, workload.num_requests)
        post_workload = Workload(workload.prompt_ids[:n], workload.prompt_texts and workload.prompt_texts[:n])
        options = serve_options(args, num_replicas, int(ray.cluster_resources().get("CPU", 1)))
        with deployed(options, args.port, log) as url:
            target = HttpTarget(url, options.served_model_name, None, args.max_tokens, args.temperature,
                                args.ignore_eos, args.timeout_s, num_warmup_requests=0)
            run_http_loads(target, [(Load(concurrency=num_replicas * 2), post_workload)], log=lambda m: None)
            result: dict = {}
            loader = threading.Thread(target=lambda: result.update(run=run_http_loads(target, [(load, workload)],
                                                                                      log=log)[0]))
            loader.start()
            time.sleep(args.kill_replica_after)
            view = placement(APP_NAME)
            victim = max(view.replicas, key=lambda rid: view.replicas[rid].num_running)
            running = {rid: r.num_running for rid, r in view.replicas.items()}
            how = kill_replica(APP_NAME, victim)
            killed_at = time.perf_counter()
            log(f"killed replica {victim} ({how}) {args.kill_replica_after:g} s into the load; running: {running}")
            recovery = wait_for_recovery(victim, num_replicas, killed_at, timeout_s=300)
            log(f"recovery (s after the kill): {recovery}")
            loader.join()
            run = result["run"]
            run.system = replica_label(num_replicas) + ", one killed"
            after = run_http_loads(target, [(Load(concurrency=num_replicas * 2), post_workload)], log=log)[0]
            after.system = replica_label(num_replicas) + ", after recovery"
            new = sorted(set(placement(APP_NAME).replicas) - set(view.replicas))
            statuses = replica_statuses(APP_NAME)
    return {
        "num_replicas": num_replicas, "victim": victim, "killed_by": how, "kill_after_s": args.kill_replica_after,
        "running_at_kill": running, "recovery_s": recovery,
        "during": outcomes(run.records, victim, args.max_tokens if args.ignore_eos else None),
        "after_recovery": {"num_requests": len(after.records), "num_completed": sum(r.completed for r in after.records),
                           "new_replicas": new, "replica_share": replica_share(after.records),
                           "on_new_replica": sum(r.replica_id in new for r in after.records)},
        "replicas_after": {rid: {k: s[k] for k in ("integrity", "idle_and_empty", "num_free_blocks",
                                                   "num_usable_blocks", "num_free_rows", "num_rows")}
                           for rid, s in statuses.items()},
        "runs": [run, after],
    }


def format_fault(f: dict) -> str:
    d, a, r = f["during"], f["after_recovery"], f["recovery_s"]
    v, o, u = d["victim"], d["others"], d["unplaced"]
    lines = [f"killed {f['victim']} ({f['killed_by']}) {f['kill_after_s']:g} s into the load on "
             f"{f['num_replicas']} replicas",
             f"victim:    {v['num_requests']} requests, {v['num_finished_before_kill']} finished before the kill, "
             f"{v['num_in_flight_failed']} in flight failed; client saw {v['client_saw']}",
             f"unplaced:  {u['num_requests']} requests reached no replica; client saw {u['client_saw']}",
             f"others:    {o['num_completed']}/{o['num_requests']} completed, {o['num_full_length']} at full length"
             + (f"; errors {o['errors']}" if o["errors"] else ""),
             f"recovery:  victim out of the planner's view {r['victim_left_view_s']} s, Serve ran "
             f"{f['num_replicas']} replicas again {r['serve_replaced_s']} s, planner view back to "
             f"{f['num_replicas']} live replicas {r['view_recovered_s']} s after the kill",
             f"after:     {a['num_completed']}/{a['num_requests']} completed, {a['on_new_replica']} on the new "
             f"replica {a['new_replicas']}",
             "pools:     " + ", ".join(f"{rid}: integrity {s['integrity']}, idle and empty {s['idle_and_empty']}"
                                       for rid, s in f["replicas_after"].items())]
    return "\n".join(lines)


def fault_ok(fault: dict) -> bool:
    """Only the victim's in-flight requests failed, the app recovered and its pools are clean."""
    others, after = fault["during"]["others"], fault["after_recovery"]
    return (others["num_completed"] == others["num_requests"] and after["num_completed"] == after["num_requests"]
            and fault["recovery_s"]["view_recovered_s"] is not None
            and all(s["integrity"] == "ok" and s["idle_and_empty"] for s in fault["replicas_after"].values()))
