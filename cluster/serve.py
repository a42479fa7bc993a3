"""`mtpserve serve`: start (or join) Ray, deploy the OpenAI endpoint, wait for Ctrl-C.

    mtpserve serve                                  local Ray, bundled model, CPU, one replica
    mtpserve serve --replicas 2 --port 8000         two CPU replicas
    mtpserve serve --device cuda                    one replica per GPU of this machine
    mtpserve serve --device cuda --address auto     one replica per GPU of a running cluster
    mtpserve serve --address HEAD:6379 --replicas 2 --replica-resource mtpserve_replica
                                                    one replica per worker node (manifests/serve-nodes.yaml)

With no --address a local Ray is started and shut down on exit; with --address the app is
deployed onto that cluster and deleted on exit (the cluster keeps running). Serve's HTTP proxy
binds --host (127.0.0.1 unless told otherwise): pass --api-key when exposing it. A local Ray's
proxy answers requests whose replica died with OpenAI errors (``actors/proxy_middleware.py``);
on a cluster, set that module's environment variable on the nodes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from mtpserve.cluster.app import ServeOptions
from mtpserve.cluster.flags import add_setting_flags, given_settings
from mtpserve.engine.config import config_fields

DEFAULT_APP_NAME = "mtpserve"
SETTINGS = config_fields(ServeOptions)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object; returns its parser.

    Besides --host/--port/--address/--app-name, every setting of ServeOptions (the replicas, the
    worker, the engine) has a flag named after it; --model and --replicas are the short names of
    model_dir and num_replicas."""
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API on Ray Serve")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--address", default=None, help="join this Ray cluster (e.g. auto, ray://host:10001) "
                                                   "instead of starting a local one")
    p.add_argument("--app-name", default=DEFAULT_APP_NAME, help="Serve application name (default %(default)s)")
    p.add_argument("--direct-port", type=int, default=None, metavar="PORT",
                   help="also let each replica serve HTTP itself, on ports from PORT up (Ray Serve's "
                        "experimental direct ingress): no proxy hop, so less added latency; those URLs have "
                        "no session routing and no replica-loss errors (the --port URL keeps both). "
                        "Serve's direct ingress (--api-servers 0, the CPU default) needs a Ray of our own (not "
                        "--address); the replica's own API servers (the CUDA default) work with --address too")
    add_setting_flags(p.add_argument_group("settings (ServeOptions, the worker and engine configs)"),
                      SETTINGS, [n for n in SETTINGS if n not in ("api_port", "api_host")],   # --direct-port, --host
                      rename={"model_dir": "--model", "num_replicas": "--replicas"})
    p.set_defaults(func=cmd_serve)
    return p


def options_from_args(args, num_cpus_available: float | None = None,
                      num_gpus_available: int | None = None) -> ServeOptions:
    """The flags given, over ServeOptions' defaults; replicas default to one per GPU with device
    cuda, and CPU replicas share the CPUs of a local Ray."""
    values = given_settings(args, SETTINGS)
    if getattr(args, "direct_port", None) is not None:   # where the replicas' API servers listen, if they run
        values.update(api_port=args.direct_port, api_host=args.host)
    values.setdefault("api_key", os.environ.get("MTPSERVE_API_KEY"))
    cuda = values.get("device") == "cuda"
    num_replicas = values.get("num_replicas") or (num_gpus_available if cuda and num_gpus_available else 1)
    values["num_replicas"] = num_replicas
    if not cuda and num_cpus_available and "num_cpus_per_replica" not in values:   # fit N replicas on a small machine
        values["num_cpus_per_replica"] = max(0.1, min(1.0, num_cpus_available / num_replicas))
    return ServeOptions.from_flat(**values)


def cmd_serve(args) -> int:
    import ray

    from mtpserve.cluster import deploy
    from mtpserve.engine.engine import check_settings
    from mtpserve.engine.manifest import load_manifest
    try:
        options = options_from_args(args, None)
        options.validate()
        engine = options.worker.engine           # a bad model, or a setting it refuses, fails here, before Ray
        check_settings(engine, load_manifest(engine.model_dir))
    except ValueError as e:                                  # ModelLoadError is a ValueError
        print(f"mtpserve: error: {e}", file=sys.stderr)
        return 2
    num_api = options.worker.num_api_servers
    own_servers = num_api > 0
    if (options.worker.api_servers or 0) > 0 and args.direct_port is None:
        print("mtpserve: error: --api-servers serves the --direct-port URLs: give --direct-port too", file=sys.stderr)
        return 2
    if args.direct_port is not None and not own_servers:
        if args.address is not None:
            print("mtpserve: error: --direct-port needs a Ray of our own; on a cluster, set "
                  f"{deploy.DIRECT_INGRESS_ENV}=1 in its nodes' environment instead", file=sys.stderr)
            return 2
        deploy.enable_direct_ingress(args.direct_port)
    started_ray = deploy.connect(args.address)
    resources = ray.cluster_resources()
    if options.worker.engine.device == "cuda" and not resources.get("GPU"):
        print("mtpserve: error: --device cuda, but the Ray cluster has no GPU", file=sys.stderr)
        ray.shutdown()
        return 2
    options = options_from_args(args, resources.get("CPU") if started_ray else None, int(resources.get("GPU", 0)))
    host, port = deploy.start_http(args.host, args.port)
    if not started_ray:
        try:
            deploy.refuse_clash(args.app_name, "/")
        except RuntimeError as e:           # before anything is deployed: nothing of theirs is touched
            print(f"mtpserve: error: {e}", file=sys.stderr)
            ray.shutdown()
            return 2
    stop = _install_signal_handlers()
    failed = None
    try:
        try:
            deploy.deploy(options, args.app_name, route_prefix="/")
        except RuntimeError as e:       # a replica's constructor raised (Serve tried it 3 times)
            failed = f"the replicas could not start: {deploy.failure_reason(args.app_name) or e}"
            return 1
        if (host, port) != (args.host, args.port):
            print(f"mtpserve: Serve already ran on this cluster with HTTP at {host}:{port}; "
                  f"--host/--port do not change it", flush=True)
        url = deploy.client_url(host, port)
        print(f"mtpserve: serving `{options.served_model_name}` ({options.num_replicas} {options.worker.engine.device} "
              f"replica{'s' if options.num_replicas > 1 else ''}) at {url}/v1", flush=True)
        print(f"  try: curl {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{options.served_model_name}\", \"prompt\": \"def \", \"max_tokens\": 32}}'",
              flush=True)
        if args.direct_port is not None:
            urls = deploy.api_server_urls(args.app_name, options.num_replicas) if own_servers else \
                deploy.direct_urls(args.app_name, host, options.num_replicas)
            for replica_id, direct in urls:
                how = f", {num_api} API server{'s' if num_api > 1 else ''}" if own_servers else ""
                print(f"  direct (replica {replica_id}{how}, no proxy hop): {direct}/v1", flush=True)
        auth = os.environ.get("RAY_AUTH_MODE", "token")       # Ray 2.60 starts a local Ray with token auth
        print(f"  Python (a driver with RAY_AUTH_MODE={auth} and this machine's ~/.ray/auth_token): "
              f"ray.init(address=\"{ray.get_runtime_context().gcs_address}\"); "
              f"mtpserve.cluster.client.MTPClient(\"{args.app_name}\")", flush=True)
        print("  Ctrl-C to stop", flush=True)
        while not stop["requested"]:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        print("mtpserve: shutting down", flush=True)
        deploy.teardown(args.app_name)
        if failed is not None:   # after Ray's shutdown: its replica logs, streamed to this stderr, could cut into the line
            print(f"\nmtpserve: error: {failed}\n  (each attempt's traceback is in the log above)", file=sys.stderr,
                  flush=True)
    print("mtpserve: stopped", flush=True)
    return 0


def _install_signal_handlers() -> dict:
    """Ctrl-C and SIGTERM set a flag the wait loop checks (clean shutdown, no traceback)."""
    state = {"requested": False}

    def request_stop(signum, frame):
        state["requested"] = True
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtpserve")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
