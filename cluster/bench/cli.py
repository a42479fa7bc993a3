"""`mtpserve bench`: serving benchmarks, in process or over HTTP, side by side with og.Engine.

    mtpserve bench --draft-tokens 0,1,2,3 --concurrency 1,16          the engine in process
    mtpserve bench --device cuda --make-model mid --synthetic-acceptance 0.7 --draft-tokens 0,1,2,3
    mtpserve bench --device cuda --draft-tokens 0 --concurrency 1,8,64 --compare ortgenai
    mtpserve bench --url http://127.0.0.1:8000 --concurrency 1,8 --slo-ttft-ms 500 --slo-tpot-ms 50
    mtpserve bench --request-rate 2,8 --prompts random --input-len 256
    mtpserve bench --replicas 1,2 --concurrency 16,64,256 --max-tokens 32   the Serve app, 1 then 2 replicas
    mtpserve bench --device cuda --replicas 1,all --concurrency 16,64,256  1 replica, then one per GPU
    mtpserve bench --replicas 0,1 --concurrency 1,16 --draft-tokens 0       what HTTP serving adds to TTFT / ITL
    mtpserve bench --replicas 0,1 --direct-ingress ...                        the same without the proxy hop
    mtpserve bench --replicas 2 --concurrency 16 --kill-replica-after 5     a replica killed mid-load
    mtpserve bench --replicas 2 --soak 300 --concurrency 32                  hostile traffic, a replica killed
    mtpserve bench --serving-overhead --requests 24 --max-tokens 64          HTTP vs in-process latency
    mtpserve bench --nodes 3 --concurrency 6 --max-tokens 24                 a 3-node Ray cluster, a node lost

Every configuration (draft count; og.Engine with --compare ortgenai) runs at every load
(closed-loop concurrencies, or Poisson request rates) against the same prompts, after a warm-up.
Figures: cluster/bench/report.py; speedups are against K=0 of the same run. Results go to
<results-dir>/<timestamp>-<name>.json (+ .png). With --synthetic-acceptance every draft is
accepted with that probability instead of checked against the model (for untrained MTP heads):
such outputs are not the model's, and every report says "synthetic". With --replicas the
real Serve app is deployed once per replica count and driven over HTTP (cluster/bench/replicas.py;
--kill-replica-after: cluster/bench/fault.py). --nodes N starts a Ray cluster of N nodes on this machine,
one replica per worker node, and kills a worker node's raylet mid-load (cluster/bench/nodes.py).
--serving-overhead runs cluster/bench/serving_overhead.py
with the options after it (see `mtpserve bench --serving-overhead --help`; --model given before it
is passed on).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from mtpserve.cluster.bench import report
from mtpserve.cluster.bench.workload import (
    BUNDLED_PROMPTS,
    Load,
    Workload,
    output_lengths,
    random_workload,
    text_workload,
    with_shared_prefixes,
)
from mtpserve.cluster.flags import on_off


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to an argparse subparsers object; returns its parser."""
    from mtpserve.engine.bundled import MODEL_DIR
    p = subparsers.add_parser("bench", help="benchmark the engine (in process or over HTTP), optionally "
                                            "against onnxruntime-genai's og.Engine",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    g = p.add_argument_group("target")
    g.add_argument("--model", default=str(MODEL_DIR), help="paged export directory (default: the bundled model)")
    g.add_argument("--make-model", choices=["tiny", "mid"],
                   help="first make a random-weight model of this shape and export it (needs mtpserve[export]); "
                        "mid: hidden 2048, 24 layers 3:1, ~1.4 B parameters; reused if already made")
    g.add_argument("--model-out", help="where --make-model writes (default: $MTPSERVE_CACHE/bench-models/SHAPE)")
    g.add_argument("--make-only", action="store_true", help="stop after --make-model")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    g.add_argument("--num-threads", type=int, default=0, help="ORT intra-op threads (0 = ORT's default)")
    g.add_argument("--url", help="benchmark this OpenAI-compatible server instead (e.g. http://127.0.0.1:8000)")
    g.add_argument("--served-model", help="model name to send over HTTP (default: the first of /v1/models)")
    g.add_argument("--api-key", help="bearer token for the HTTP server")
    g.add_argument("--compare", choices=["ortgenai"], help="also run onnxruntime-genai's og.Engine (CUDA only)")
    g.add_argument("--replicas", help="deploy the Serve app with each of these replica counts in turn and drive it "
                                      "over HTTP, e.g. 1,2 or 1,all (all: one per GPU with --device cuda); 0 = the "
                                      "replica's engine in this process, the baseline for what serving adds")
    g.add_argument("--kill-replica-after", type=float, metavar="S",
                   help="with --replicas N: kill the busiest replica's process S seconds into the top "
                        "concurrency's load and record errors, recovery and the pools afterwards")
    g.add_argument("--soak", type=float, metavar="S",
                   help="with --replicas N: S seconds of mixed traffic (streams read to the end or dropped, "
                        "hostile requests) from --concurrency clients, one replica killed halfway "
                        "(--kill-replica-after to choose when); fails on a hung or unclear request or unclean pools")
    g.add_argument("--nodes", type=int, metavar="N",
                   help="instead: a Ray cluster of N nodes on this machine (a head, N-1 worker nodes with one CPU "
                        "replica each), requests through every node's proxy, a worker node's raylet killed mid-load")
    g.add_argument("--deploy", default="cli", choices=["cli", "config"],
                   help="with --nodes: deploy with `mtpserve serve --address` (cli) or `serve deploy` of "
                        "--serve-config (config)")
    g.add_argument("--serve-config", help="with --nodes --deploy config: the Serve config (default "
                                          "manifests/serve-nodes.yaml; its HTTP port is replaced by this run's)")
    g.add_argument("--kill-node-after", type=float, default=4.0, metavar="S",
                   help="with --nodes: kill the busiest worker node's raylet S seconds into the load (default 4)")
    g.add_argument("--node-down-s", type=float, default=8.0, metavar="S",
                   help="with --nodes: keep the lost node down this long before it rejoins (default 8)")
    g.add_argument("--keep-workdir", action="store_true", help="with --nodes: keep the cluster's logs in /tmp")
    g.add_argument("--address", help="with --replicas: deploy onto this Ray cluster instead of a local one")
    g.add_argument("--port", type=int, default=8000, help="with --replicas: Serve's HTTP port")
    g.add_argument("--direct-ingress", action="store_true",
                   help="with --replicas 0,1: drive the replica on its own HTTP port (Ray Serve's direct ingress, "
                        "as `serve --direct-port`: no proxy hop) instead of through the proxy")
    g.add_argument("--client-processes", type=int, default=1, metavar="P",
                   help="HTTP loads: split each load's requests over P client processes (default 1): one Python "
                        "client parsing tens of thousands of chunks a second delays what it times (each run "
                        "records the client's CPU share of its wall time)")
    g.add_argument("--stall-phases", action="store_true",
                   help="with --replicas: the replicas time each step by phase (as `serve --stall-phases on`), so "
                        "each run's stalls (extra.stalls) say where their steps' time went")
    g.add_argument("--api-servers", default="0", metavar="N[,N...]",
                   help="with --direct-ingress: the replica's own HTTP processes, compared in one run (as `serve "
                        "--direct-port --api-servers N`; 0 = Ray Serve's direct ingress in the replica; default 0). "
                        "N > 0 runs the engine in a process of its own")
    g.add_argument("--serving-overhead", nargs=argparse.REMAINDER, metavar="OPTION",
                   help="instead: TTFT and inter-token latency over HTTP from one CPU replica vs the in-process "
                        "engine, one request at a time; the options after it are that tool's own (--requests, "
                        "--max-tokens, --draft-tokens, --threads, --port; --model defaults to this --model)")

    g = p.add_argument_group("workload")
    g.add_argument("--prompts", default="bundled", choices=["bundled", "random"],
                   help="bundled code-like prompts of mixed lengths, or random token ids of --input-len")
    g.add_argument("--prompts-file", help="one prompt per line (\\n for newlines); replaces --prompts")
    g.add_argument("--input-len", type=int, default=128, help="random prompt length in tokens")
    g.add_argument("--prefix-groups", type=int, default=1,
                   help="with --shared-prefix-len: this many distinct shared prefixes, each request given one at "
                        "random (seeded)")
    g.add_argument("--shared-prefix-len", type=int, default=0,
                   help="prepend the same N random tokens to every prompt (a shared system prompt)")
    g.add_argument("--vocab-size", type=int, help="random token ids range, for --url without a local --model")
    g.add_argument("--num-prompts", type=int, help="requests per load (default: max(16, 2 x top concurrency))")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    g.add_argument("--range-ratio", type=float, default=0.0, metavar="R",
                   help="each request's output length drawn (seeded) from --max-tokens x [1 - R, 1 + R], as vLLM's "
                        "--random-range-ratio draws them (default 0: every request --max-tokens, so a closed loop's "
                        "requests finish together and arrive in waves)")
    g.add_argument("--concurrency", default=None, help="closed-loop concurrency levels, e.g. 1,16 (default 1)")
    g.add_argument("--request-rate", default=None, help="open-loop Poisson request rates in req/s, e.g. 2,8")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0, help="seeds prompts, arrivals and sampling")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (default: always generate --max-tokens)")
    g.add_argument("--no-token-ids", dest="return_token_ids", action="store_false",
                   help="over HTTP, do not ask for return_token_ids (vLLM's field; without it tokens are "
                        "timed by the stream's text chunks, which hold back incomplete UTF-8)")

    g = p.add_argument_group("configurations")
    g.add_argument("--draft-tokens", help="MTP draft counts to run, e.g. 0,1,2,3,auto (0 = MTP off, auto = the "
                                          "adaptive policy, auto-timed = it on step costs timed at start-up, "
                                          "--draft-calibration on; default 0,2); with --replicas the servers' one "
                                          "setting, K or auto (default auto)")
    g.add_argument("--synthetic-acceptance", type=float, default=None,
                   help="accept each draft with this probability (untrained MTP heads); labels the run synthetic "
                        "(with --url it only labels the results: the server must be run that way)")
    g.add_argument("--num-blocks", type=int, help="KV blocks per pool (default: enough for every resident request)")
    g.add_argument("--kv-block-size", type=int, metavar="TOKENS",
                   help="serve the export with KV blocks of this many tokens (default: the export's; og.Engine "
                        "gets the same): on CUDA, ORT's flash PagedAttention reads prompts and verifies in place "
                        "only at multiples of 256 / 128 / 64 tokens for head sizes up to 64 / 128 / 256")
    g.add_argument("--max-resident-requests", type=int, help="state-bank rows (default: the top concurrency)")
    g.add_argument("--max-model-len", type=int,
                   help="longest prompt + output the engine serves (default: the model's context)")
    g.add_argument("--max-tokens-per-step", type=int,
                   help="the step's token budget (default: max(512 on the CPU or 2048 on CUDA, rows x (K+1)))")
    g.add_argument("--prefix-cache", default="on", metavar="on|off|all,...",
                   help="the engine's prefix cache: on (its default snapshot policy, reused), off, or all (on with "
                        "--prefix-snapshots all: every prompt boundary snapshotted); "
                        "a list runs each and compares them with off (default on)")
    g.add_argument("--prefix-routing", default="on", metavar="on|off[,...]",
                   help="with --replicas: the Serve app's prefix-aware routing; on,off deploys each in turn on the "
                        "same prompts and compares them (cached prompt tokens, TTFT, tokens/s, requests per replica)")
    g.add_argument("--prefix-max-imbalance", type=float, metavar="R",
                   help="with --replicas: the router's load bound for prefix-aware routing (requests; default: the "
                        "server's)")
    g.add_argument("--prefix-host-gib", type=float, metavar="G",
                   help="with --replicas: the replicas' host tier for evicted prefixes (default: the server's; 0 = "
                        "none, so a small --num-blocks makes the cache's size matter)")
    g.add_argument("--overlap-decode", default=None, metavar="on|off[,...]",
                   help="in process: launch each decode step before the previous one's tokens are read (the "
                        "engine's default: on with CUDA); on,off runs each and compares them ('mtpserve "
                        "no-overlap')")
    g.add_argument("--cuda-graphs", default=True, type=on_off, metavar="on|off",
                   help="CUDA: replay captured decode / verify steps (default on; off = every step eager)")
    g.add_argument("--prompt-graphs", default=None, type=on_off, metavar="on|off",
                   help="in process: prompt steps through varlen graphs (the engine's default: captured with "
                        "CUDA graphs, off on the CPU, where on binds them and runs them eagerly)")
    g.add_argument("--prompt-graph-rows", type=int, default=None, metavar="N",
                   help="with --prompt-graphs: the most rows in all of a captured prompt step (default: the "
                        "engine's prompt_graph_rows)")
    g.add_argument("--prompt-graph-slot-tokens", type=int, default=None, metavar="N",
                   help="with --prompt-graphs: the most padded requests x KV-bucket tokens of a captured prompt "
                        "step, which sets their memory (default: the engine's prompt_graph_slot_tokens)")
    g.add_argument("--warmup-requests", type=int, default=4, help="requests run untimed first, per configuration")
    g.add_argument("--rounds", type=int, default=1,
                   help="in process: every draft count's engine built once, then this many rounds of every "
                        "(load, K) back to back in a rotating order; ratios are taken within a round and "
                        "reported as their median over rounds (on a shared host, drift between K's run one "
                        "after another is larger than the differences between them)")
    g.add_argument("--phases", default="off", choices=("off", "on", "sync"),
                   help="in process: where each step's time goes, ms per step of each engine phase (schedule, "
                        "propose, verify, accept, commit, ...), prefill and decode steps apart, in the JSON and "
                        "printed; sync: the device synchronised after each phase, so each owns its GPU work "
                        "(engine/phase_timers.py)")
    g.add_argument("--timeout-s", type=float, default=600.0, help="give up a load after this long")
    g.add_argument("--anchor-draft-tokens", help="og.Engine draft counts (default: --draft-tokens; 0 with synthetic)")
    g.add_argument("--anchor-num-blocks", type=int, default=8192, help="og.Engine's block pool in the export's blocks (keep it "
                   "generous; with --kv-block-size og gets as many tokens in its larger blocks)")
    g.add_argument("--anchor-stall-s", type=float, default=60.0, help="og.Engine without a token this long = stalled")
    g.add_argument("--anchor-timeout-s", type=float, default=1800.0, help="kill og.Engine's process after this long")

    g = p.add_argument_group("output")
    g.add_argument("--slo-ttft-ms", type=float, help="goodput SLO on time to first token")
    g.add_argument("--slo-tpot-ms", type=float, help="goodput SLO on time per output token")
    g.add_argument("--results-dir", default="results", help="where the JSON and PNG go (default ./results)")
    g.add_argument("--name", help="file name stem after the timestamp (default: mode-model)")
    g.add_argument("--copy-gbps", type=float, default=4300.0,
                   help="device memory copy rate for the batch-1 bandwidth bound in the report (default 4300: "
                        "the H200's measured device copy rate, 4.26 TB/s; on a CPU the bound is only indicative)")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--save-requests", action="store_true", help="keep every request's timeline in the JSON")
    p.set_defaults(func=cmd_bench)
    return p


def draft_count(value: str) -> int | str:
    """One --draft-tokens item: an integer K, "auto" (the adaptive policy) or "auto-timed" (the
    adaptive policy on a table of step costs timed at start-up)."""
    v = value.strip().lower()
    return v if v in ("auto", "auto-timed") else int(value)


def parse_list(value: str | None, kind, what: str) -> tuple:
    if value is None:
        return ()
    try:
        items = tuple(kind(v) for v in str(value).split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list, got {value!r}") from None
    if not items:
        raise ValueError(f"{what} is empty")
    return items


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_bench(args) -> int:
    from mtpserve.engine.manifest import ModelLoadError
    if args.serving_overhead is not None:
        if args.range_ratio:
            print("mtpserve: error: --serving-overhead sends requests of its own: drop --range-ratio", file=sys.stderr)
            return 2
        from mtpserve.cluster.bench import serving_overhead
        return serving_overhead.main(["--model", args.model, *args.serving_overhead],
                                     prog="mtpserve bench --serving-overhead")
    try:
        return _bench(args)
    except (ValueError, ModelLoadError, RuntimeError) as e:
        print(f"mtpserve: error: {e}", file=sys.stderr)
        return 2


def _loads(args) -> tuple[Load, ...]:
    if args.concurrency and args.request_rate:
        raise ValueError("give --concurrency or --request-rate, not both")
    if args.request_rate:
        rates = parse_list(args.request_rate, float, "--request-rate")
        if any(r <= 0 for r in rates):
            raise ValueError("request rates must be > 0")
        return tuple(Load(request_rate=r) for r in rates)
    levels = parse_list(args.concurrency or "1", int, "--concurrency")
    if any(c < 1 for c in levels):
        raise ValueError("concurrency levels must be >= 1")
    return tuple(Load(concurrency=c) for c in levels)


def _workload(args, tokenizer, vocab_size: int | None, exclude: tuple[int, ...], num_requests: int) -> Workload:
    if args.prompts_file:
        with open(args.prompts_file) as f:
            texts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
        return text_workload(texts, tokenizer.encode if tokenizer else _bytes, num_requests)
    if args.prompts == "bundled":
        return text_workload(BUNDLED_PROMPTS, tokenizer.encode if tokenizer else _bytes, num_requests)
    if vocab_size is None:
        raise ValueError("random prompts need a vocabulary size: give --model DIR or --vocab-size N")
    return random_workload(num_requests, args.input_len, vocab_size, args.seed, exclude)


def _prefix_mode(text: str) -> str:
    """--prefix-cache values: on, off (on_off's spellings too), or all."""
    if text.strip().lower() == "all":
        return "all"
    try:
        return "on" if on_off(text) else "off"
    except argparse.ArgumentTypeError:
        raise ValueError(f"--prefix-cache takes on, off or all, got {text!r}") from None


def _count(text: str) -> int:
    """A non-negative integer list item."""
    n = int(text)
    if n < 0:
        raise ValueError(f"expected a count >= 0, got {n}")
    return n


def _on_off(text: str) -> bool:
    try:
        return on_off(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None


def _bytes(text: str) -> list[int]:
    """Stand-in token count for HTTP runs without a local tokenizer (usage overrides it)."""
    return list(text.encode())


def _bench(args) -> int:
    loads = _loads(args)
    parse_list(args.prefix_cache, _prefix_mode, "--prefix-cache")      # a bad value fails now, not after a run
    parse_list(args.prefix_routing, _on_off, "--prefix-routing")
    if args.overlap_decode is not None:
        parse_list(args.overlap_decode, _on_off, "--overlap-decode")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio:g}")
    if args.range_ratio and (args.nodes is not None or args.soak is not None):
        raise ValueError("--nodes and --soak send requests of their own: drop --range-ratio")
    if args.nodes is not None:
        if args.kv_block_size is not None:
            raise ValueError("--nodes deploys the CPU replicas of its manifest as they are: drop --kv-block-size")
        return _bench_nodes(args)
    if args.soak is not None:
        return _bench_soak(args)
    if args.direct_ingress and (not args.replicas or args.address or args.kill_replica_after is not None
                                or not set(args.replicas.split(",")) <= {"0", "1"}):
        raise ValueError("--direct-ingress measures one replica's own HTTP port on a local Ray: give --replicas 0,1 "
                         "(or 1), without --address or --kill-replica-after")
    api_servers = parse_list(args.api_servers, _count, "--api-servers")
    if args.client_processes < 1:
        raise ValueError("--client-processes must be >= 1")
    if api_servers != (0,) and not args.direct_ingress:
        raise ValueError("--api-servers serves the replica's direct URL: add --direct-ingress")
    if args.replicas or args.kill_replica_after is not None:
        _check_cluster_args(args, loads)
        draft_tokens = ()
    else:
        draft_tokens = parse_list(args.draft_tokens or "0,2", draft_count, "--draft-tokens")
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    if args.rounds > 1 and (args.url or args.replicas or args.compare or args.kill_replica_after is not None):
        raise ValueError("--rounds interleaves the in-process engines only: drop --url, --replicas and --compare")
    a = args.synthetic_acceptance
    if a is not None and args.temperature > 0:
        raise ValueError("--synthetic-acceptance applies to greedy requests only: use --temperature 0")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if args.url and args.compare:
        raise ValueError("--compare ortgenai runs in process; drop --url")
    if args.prompt_graphs and (args.url or args.replicas):
        raise ValueError("--prompt-graphs sets the in-process engine; a server takes it as "
                         "'mtpserve serve --prompt-graphs on': drop --url and --replicas")
    if args.prompt_graphs and not args.cuda_graphs:
        raise ValueError("--prompt-graphs needs --cuda-graphs on")
    bounds = {"--prompt-graph-rows": args.prompt_graph_rows, "--prompt-graph-slot-tokens": args.prompt_graph_slot_tokens}
    from mtpserve.engine.config import resolve_prompt_graphs
    prompt_graphs = resolve_prompt_graphs(args.prompt_graphs, args.device, args.cuda_graphs)
    for flag, value in bounds.items():       # (their values: EngineConfig.validate)
        if value is not None and not prompt_graphs:
            raise ValueError(f"{flag} bounds captured prompt steps, which are off here: add --prompt-graphs on")
    if args.make_model:
        from mtpserve.cluster.checkpoints import make_bench_model
        from mtpserve.engine.cpu_adapter import default_cache_root
        out = Path(args.model_out or default_cache_root() / "bench-models" / args.make_model)
        started = time.perf_counter()
        args.model = str(make_bench_model(out, args.make_model))
        _log(f"model {args.model} ready in {time.perf_counter() - started:.0f} s")
        if args.make_only:
            return 0
    peak = max(l.concurrency or 0 for l in loads)
    num_requests = args.num_prompts or max(16, 2 * peak)
    if peak > num_requests:
        _log(f"WARNING: --num-prompts {num_requests} is below concurrency {peak}: that load never has more "
             f"than {num_requests} requests in flight (give at least {peak} prompts, better {2 * peak})")
    synthetic = a is not None and (bool(args.url) or any(draft_tokens))
    manifest = _manifest(args.model, required=not args.url)
    tokenizer = None
    if manifest is not None:
        from mtpserve.engine.tokenizer import Tokenizer
        tokenizer = Tokenizer(manifest.path)
    vocab = args.vocab_size or (manifest.vocab_size if manifest else None)
    exclude = tuple(manifest.eos_token_ids) if manifest else ()
    workload = _workload(args, tokenizer, vocab, exclude, num_requests)
    workload = replace(workload, output_lens=output_lengths(num_requests, args.max_tokens, args.range_ratio, args.seed))
    if args.shared_prefix_len:
        if vocab is None:
            raise ValueError("--shared-prefix-len needs a vocabulary size: give --model DIR or --vocab-size N")
        workload = with_shared_prefixes(workload, args.shared_prefix_len, max(1, args.prefix_groups), vocab,
                                        args.seed, exclude)
    if synthetic:
        _log(f"SYNTHETIC acceptance: each draft is accepted with probability {a:g}; the outputs are not the model's")

    runs, anchor_note = [], None
    if args.replicas:
        return _bench_cluster(args, workload, loads, manifest)
    if args.url:
        from mtpserve.cluster.bench.http_driver import HttpTarget, run_http_loads
        from mtpserve.cluster.bench.workload import per_load
        target = HttpTarget(args.url.rstrip("/"), args.served_model, args.api_key, args.max_tokens,
                            args.temperature, args.ignore_eos, args.timeout_s, args.warmup_requests,
                            args.return_token_ids, args.client_processes)
        runs = run_http_loads(target, per_load(workload, loads, args.seed), log=_log)
        for run in runs:    # the server's own setting; the flag only labels its results
            run.synthetic_acceptance = a
    else:
        if args.compare == "ortgenai":
            from mtpserve.cluster.bench.anchor import AnchorSweep, run_anchor
            anchor_k = parse_list(args.anchor_draft_tokens, int, "--anchor-draft-tokens")
            if not anchor_k:
                anchor_k = (0,) if synthetic else tuple(k for k in draft_tokens if isinstance(k, int))
                if synthetic:
                    _log("ortgenai: og.Engine has no synthetic acceptance; it runs at K=0 only "
                         "(--anchor-draft-tokens to override)")
            # --anchor-num-blocks counts the export's blocks (8192 x 16 tokens: 131k); at another block
            # size og gets as many tokens, not as many blocks (at 64, 4x the memory)
            anchor_blocks = args.anchor_num_blocks
            if args.kv_block_size:
                anchor_blocks = max(64, -(-anchor_blocks * manifest.block_size // args.kv_block_size))
            anchor = AnchorSweep(str(manifest.path), anchor_k, loads, args.max_tokens, args.ignore_eos, args.seed,
                                 anchor_blocks, args.warmup_requests, args.anchor_stall_s, args.anchor_timeout_s,
                                 args.kv_block_size)
            runs, anchor_note = run_anchor(anchor, workload, args.device, log=_log)
        from mtpserve.cluster.bench.engine_driver import EngineSweep, run_engine_rounds, run_engine_sweep
        overlaps = [None] if args.overlap_decode is None else parse_list(args.overlap_decode, _on_off, "--overlap-decode")
        for mode, overlap in [(m, o) for m in parse_list(args.prefix_cache, _prefix_mode, "--prefix-cache")
                              for o in overlaps]:
            sweep = EngineSweep(str(manifest.path), args.device, args.num_threads, draft_tokens, a, loads,
                                args.max_tokens, args.temperature, args.ignore_eos, args.seed, args.num_blocks,
                                args.max_resident_requests, args.max_tokens_per_step, args.max_model_len,
                                args.warmup_requests, args.timeout_s, args.cuda_graphs, mode != "off",
                                "all" if mode == "all" else "reused", args.phases, overlap_decode=overlap,
                                kv_block_size=args.kv_block_size, prompt_graphs=args.prompt_graphs,
                                prompt_graph_rows=args.prompt_graph_rows,
                                prompt_graph_slot_tokens=args.prompt_graph_slot_tokens)
            from mtpserve.engine.manifest import with_block_size
            block_size = with_block_size(manifest, args.kv_block_size).block_size
            if args.rounds > 1:
                runs = run_engine_rounds(sweep, workload, block_size, args.rounds, log=_log) + runs
            else:
                runs = run_engine_sweep(sweep, workload, block_size, log=_log) + runs
    return _report(args, runs, workload, loads, manifest, synthetic, anchor_note)


def _bench_soak(args) -> int:
    from mtpserve.cluster.bench import soak
    if not args.replicas or args.url or args.compare or args.soak <= 0:
        raise ValueError("--soak S (S > 0) runs on its own Serve app: give --replicas N, not --url or --compare")
    if args.timeout_s == 600.0:
        args.timeout_s = 120.0          # a soak's request that takes this long is hung
    figures = soak.run_soak(args, log=_log)
    now = _dt.datetime.now()
    path = Path(args.results_dir) / f"{now.strftime('%Y%m%d-%H%M%S')}-{args.name or 'soak'}.json"
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "serving_overhead")}
    report.write_json(path, {"name": args.name or "soak", "created": now.isoformat(timespec="seconds"),
                             "mode": "soak", "command": sys.argv, "git_commit": _git_commit(),
                             "machine": report.machine_info(), "device": args.device, "settings": settings,
                             "soak": figures})
    print(soak.format_soak(figures) + f"\n\nresults: {path}")
    return 0 if figures["passed"] else 1


def _bench_nodes(args) -> int:
    from mtpserve.cluster.bench import nodes
    if args.replicas or args.url or args.compare or args.address or args.soak is not None:
        raise ValueError("--nodes N starts its own cluster and app: drop --replicas, --url, --compare, --address "
                         "and --soak")
    if args.timeout_s == 600.0:
        args.timeout_s = 120.0          # a request that takes this long here is hung
    figures = nodes.run_nodes(args, log=_log)
    now = _dt.datetime.now()
    name = args.name or f"nodes-{args.nodes}-cpu"
    path = Path(args.results_dir) / f"{now.strftime('%Y%m%d-%H%M%S')}-{name}.json"
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "serving_overhead")}
    report.write_json(path, {"name": name, "created": now.isoformat(timespec="seconds"), "mode": "nodes",
                             "command": sys.argv, "git_commit": _git_commit(), "machine": report.machine_info(),
                             "device": "cpu", "settings": settings, "nodes": figures})
    print(nodes.format_nodes(figures) + f"\n\nresults: {path}")
    return 0 if figures["passed"] else 1


def _check_cluster_args(args, loads) -> None:
    if not args.replicas:
        raise ValueError("--kill-replica-after needs --replicas N")
    if args.url or args.compare:
        raise ValueError("--replicas deploys and drives its own Serve app; drop --url and --compare")
    if args.kill_replica_after is not None and any(l.concurrency is None for l in loads):
        raise ValueError("--kill-replica-after runs closed-loop loads: give --concurrency, not --request-rate")
    if args.draft_tokens and "," in args.draft_tokens:
        raise ValueError("with --replicas, --draft-tokens is the servers' one setting: K or auto")
    if args.synthetic_acceptance is not None:
        raise ValueError("--synthetic-acceptance is not a server setting; drop it with --replicas")


def _bench_cluster(args, workload: Workload, loads, manifest) -> int:
    from mtpserve.cluster.bench import replicas
    from mtpserve.cluster.bench.workload import per_load
    if args.kill_replica_after is None:
        runs = replicas.run_replica_sweep(args, per_load(workload, loads, args.seed), log=_log)
        return _report(args, runs, workload, loads, manifest, False, None, mode="replicas")
    from mtpserve.cluster.bench import fault
    top = max(loads, key=lambda l: l.concurrency)
    figures = fault.run_fault(args, top, workload, log=_log)
    return _report(args, figures.pop("runs"), workload, (top,), manifest, False, None, mode="fault", fault=figures)


def _report(args, runs, workload: Workload, loads, manifest, synthetic: bool, anchor_note: str | None,
            mode: str | None = None, fault: dict | None = None) -> int:
    """Figures -> JSON (+ PNG) under --results-dir, and a table on stdout."""
    a = args.synthetic_acceptance
    summaries = [report.summarize(r, args.slo_ttft_ms, args.slo_tpot_ms) for r in runs]
    comps = report.comparisons(summaries)
    mode = mode or ("http" if args.url else "engine")
    model_name = Path(args.model).name if not args.url else args.url.split("//")[-1].replace(":", "_").replace("/", "_")
    name = args.name or f"{mode}-{model_name}" + ("-synthetic" if synthetic else "")
    now = _dt.datetime.now()
    path = Path(args.results_dir) / f"{now.strftime('%Y%m%d-%H%M%S')}-{name}.json"
    lengths = [len(p) for p in workload.prompt_ids]
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "serving_overhead")}
    if args.url:
        settings["draft_tokens"] = "the server's"
    scaling = overhead = routing = None
    if mode == "replicas":
        from mtpserve.cluster.bench import replicas
        scaling, overhead = replicas.scaling(summaries), replicas.http_overhead(summaries)
        routing = replicas.prefix_routing_effect(summaries)
    payload = {
        "name": name, "created": now.isoformat(timespec="seconds"), "mode": mode,
        "command": sys.argv, "git_commit": _git_commit(),
        "synthetic": {"acceptance": a, "note": "drafts accepted with this probability instead of checked "
                                               "against the model; outputs are not the model's"} if synthetic else None,
        "model": _model_info(manifest, getattr(args, "kv_block_size", None)), "machine": report.machine_info(),
        "device": args.device,
        "settings": settings,
        "workload": {"num_requests": workload.num_requests, "prompt_set": "file" if args.prompts_file else args.prompts,
                     "prompt_tokens": {"min": min(lengths), "max": max(lengths),
                                       "mean": round(sum(lengths) / len(lengths), 1)},
                     "max_tokens": args.max_tokens, "loads": [l.label for l in loads],
                     **({"output_tokens": {"range_ratio": args.range_ratio, "min": min(workload.output_lens),
                                           "max": max(workload.output_lens)}} if workload.output_lens else {})},
        "anchor_note": anchor_note,
        "results": summaries, "comparisons": comps,
    }
    rounds = report.round_medians(comps)
    if rounds:
        payload["rounds"] = rounds
    if scaling is not None:
        payload["scaling"] = scaling
    if overhead:
        payload["http_overhead"] = overhead
    if routing:
        payload["prefix_routing"] = routing
    if fault is not None:
        payload["fault"] = fault
    if manifest is not None:
        context = sum(lengths) / len(lengths) + args.max_tokens / 2
        payload["batch1_bandwidth_bound"] = report.bandwidth_bound(manifest, context, args.copy_gbps, summaries)
    if args.save_requests:
        payload["requests"] = [{"label": r.config_label, "load": r.load_label,
                                "records": [vars(x) for x in r.records]} for r in runs]
    report.write_json(path, payload)
    title = f"{name}: {mode} on {args.device}" + (f" — SYNTHETIC acceptance a={a:g}" if synthetic else "")
    if args.no_plot or mode == "fault":
        plot_note = None
    elif routing:
        plot_note = replicas.plot_prefix_routing(routing, path.with_suffix(".png"), title)
    elif scaling is not None:
        plot_note = replicas.plot_scaling(summaries, scaling, path.with_suffix(".png"), title)
    else:
        plot_note = report.plot(report.median_round_summaries(summaries) if rounds else summaries,
                                path.with_suffix(".png"), title + (f" (median of {args.rounds} rounds)" if rounds else ""))
    if synthetic:
        print(f"NOTE: SYNTHETIC acceptance a={a:g} (drafts accepted at random, not by the model)")
    if anchor_note:
        print(f"NOTE: {anchor_note}")
    print(report.format_table(summaries, comps))
    phased = [s for s in summaries if (s.get("extra") or {}).get("phases")]
    if phased:
        from mtpserve.cluster.bench.phases import format_phases
        print("\nms per step by engine phase (a phase includes those it calls; " + (
            "the device synchronised after each)" if args.phases == "sync" else "launches asynchronous)"))
        for s in phased:
            print(format_phases(f"{s['label']} {s['load']}", s["extra"]["phases"]))
    for m in rounds:
        print(f"{m['kind']:<22} {m['label']:<34} {m['baseline']:<34} {m['load']:>6}  median "
              f"{m['median_output_token_throughput']:.3f}x over {len(m['rounds'])} rounds "
              f"({' '.join(f'{v:.2f}' for v in m['rounds'])})")
    bound = payload.get("batch1_bandwidth_bound")
    if bound and "measured_tpot_p50_ms" in bound:
        print(f"batch-1 decode: TPOT p50 {bound['measured_tpot_p50_ms']:.3f} ms vs bandwidth bound "
              f"{bound['bound_ms']:.3f} ms ({bound['bytes_per_step'] / 1e9:.3f} GB at {bound['copy_gbps']:g} GB/s): "
              f"{100 * bound['fraction_of_bound']:.1f}% of the bound")
    if scaling:
        print("\n" + replicas.format_scaling(scaling))
    if routing:
        print("\nprefix-aware routing on vs off (cached: prompt tokens served from the replicas' caches):\n"
              + replicas.format_prefix_routing(routing))
    if overhead:
        print("\nwhat serving adds (1 replica over HTTP vs the same engine in process):\n"
              + replicas.format_http_overhead(overhead))
    if fault is not None:
        from mtpserve.cluster.bench.fault import format_fault
        print("\n" + format_fault(fault))
    drew = not (args.no_plot or plot_note or mode == "fault")
    print(f"\nresults: {path}" + (f"\nplot:    {path.with_suffix('.png')}" if drew else ""))
    if plot_note:
        print(plot_note)
    if fault is not None:
        from mtpserve.cluster.bench.fault import fault_ok
        return 0 if fault_ok(fault) else 1
    return 0 if all(s["num_completed"] for s in summaries) else 1


def _manifest(model: str, required: bool):
    from mtpserve.engine.manifest import ModelLoadError, load_manifest
    try:
        return load_manifest(model)
    except ModelLoadError:
        if required:
            raise
        return None


def _model_info(manifest, kv_block_size: int | None = None) -> dict | None:
    """The export's summary; ``block_size`` is the one served (``--kv-block-size``), the export's
    own under ``export_block_size`` when they differ."""
    from mtpserve.engine.manifest import with_block_size
    if manifest is None:
        return None
    info = with_block_size(manifest, kv_block_size).to_dict()
    info.pop("files", None)
    if info["block_size"] != manifest.block_size:
        info["export_block_size"] = manifest.block_size
    return info


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None
