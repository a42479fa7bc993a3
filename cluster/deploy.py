"""Deploying the Serve app, written once for `mtpserve serve`, the benchmarks and the tests.

    started = connect(address)                  # join a Ray cluster, or start a local one
    host, port = start_http("127.0.0.1", 8000)  # Serve's HTTP proxies (where they really listen)
    deploy(options, "mtpserve")                 # serve.run(build_app(options)) under a name and route prefix
    wait_for_replicas("mtpserve", options.num_replicas, timeout_s=600)
    ...
    teardown("mtpserve")                        # serve.delete, the planner, then Ray

or, as context managers, ``with connected(address) as started:`` (Ray for a block) and ``with
deployed(options, app_name) as view:`` (the app, every replica reporting to its planner, deleted
afterwards). A local Ray's proxies answer requests whose replica died with OpenAI errors
(``actors/proxy_middleware.py``); on a cluster, that module's environment variable is set on the
nodes. The replica helpers at the end (actor names, ``kill_replica``, ``stop_replica``, Serve's
RUNNING count) serve the fault benchmark and the tests.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

LOCAL_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Ray starts its workers (Serve's replicas and proxies, so the engine process and the API servers
# too) at nice 15, below every ordinary process on the host. On the H200 the engine process had
# steps of 57-93 ms that the same engine in the nice-0 benchmark process never had; this is the
# likely reason, not yet measured (results/h200/serving/20261203-http-split/). A Ray we start
# runs its workers at 0, as Ray's own daemons.
WORKER_NICENESS_ENV = "RAY_worker_niceness"


# ---------------------------------------------------------------------------- Ray
def connect(address: str | None = None, *, quiet: bool = False, num_cpus: int | None = None,
            proxy_middleware: bool = True) -> bool:
    """Join the Ray cluster at ``address``, or start a new local Ray (``num_cpus``: Ray's default is the
    machine's cores) whose proxies use the replica-loss middleware unless ``proxy_middleware`` is
    False. ``quiet``: Ray logs errors only and workers' output stays off the driver. Returns True
    when it started Ray (``teardown`` then shuts Serve and Ray down)."""
    import ray

    logging = {"logging_level": "ERROR", "log_to_driver": False} if quiet else {"logging_level": "WARNING"}
    if address is not None:
        ray.init(address=address, **logging)
        return False
    if proxy_middleware:
        from mtpserve.actors.proxy_middleware import install
        install()
    extra = {} if num_cpus is None else {"num_cpus": num_cpus}
    os.environ.setdefault(WORKER_NICENESS_ENV, "0")      # its raylet reads it at start (see above)
    # "local": a new Ray of our own, even with RAY_ADDRESS set or another Ray on this machine
    # (plain ray.init() would join those, and teardown would then shut down someone else's Serve)
    ray.init(address="local", include_dashboard=False, **extra, **logging)
    return True


def start_http(host: str = LOCAL_HOST, port: int = DEFAULT_PORT) -> tuple[str, int]:
    """Start Serve with its HTTP proxies on ``host:port``; returns where they really listen (a
    Serve already running on the cluster keeps its first options)."""
    from ray import serve
    serve.start(http_options={"host": host, "port": port})
    return proxy_address(host, port)


def proxy_address(host: str, port: int) -> tuple[str, int]:
    """Where Serve's HTTP proxies really listen (a running Serve keeps its first options)."""
    try:
        from ray.serve.context import _get_global_client
        config = _get_global_client().http_config
        return config.host, config.port
    except Exception:  # a private API: fall back to what was asked for
        return host, port


DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


def enable_direct_ingress(first_port: int) -> None:
    """Before ``connect`` starts a local Ray: Serve's replicas will also serve HTTP themselves,
    on ports from ``first_port`` up (Ray Serve's direct ingress, experimental in Ray 2.60)."""
    os.environ[DIRECT_INGRESS_ENV] = "1"
    os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] = str(first_port)
    os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] = str(first_port + 999)
    # a replica stays open this long when it stops, for a load balancer to deregister it: none here
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")


def direct_urls(app_name: str, host: str, num_replicas: int, timeout_s: float = 60.0) -> list[tuple[str, str]]:
    """(replica id, base URL) of each replica that serves HTTP itself (direct ingress), once all
    ``num_replicas`` have their port; [] when direct ingress is off or Serve's (alpha) API fails."""
    import ray
    try:
        from ray.serve._private.common import RequestProtocol
        from ray.serve.context import _get_global_client
        controller = _get_global_client()._controller
        deadline = time.monotonic() + timeout_s
        while True:
            groups = ray.get(controller.get_target_groups.remote(app_name))
            targets = [t for g in groups if g.protocol == RequestProtocol.HTTP and g.app_name == app_name
                       for t in g.targets]
            if len(targets) >= num_replicas or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - a private handle and an alpha API: say nothing rather than fail
        return []
    loopback = host in (LOCAL_HOST, "localhost")
    return [(t.name.rsplit("#", 1)[-1], f"http://{LOCAL_HOST if loopback else t.ip}:{t.port}") for t in targets]


def api_server_urls(app_name: str, num_replicas: int, timeout_s: float = 60.0) -> list[tuple[str, str]]:
    """(replica id, base URL) of each replica's own API servers (``api_servers``), as the replicas
    reported them to the planner, once all ``num_replicas`` have."""
    import ray

    from mtpserve.actors.planner import get_planner
    deadline = time.monotonic() + timeout_s
    urls: dict[str, str] = {}
    while time.monotonic() < deadline:
        planner = get_planner(app_name)
        urls = ray.get(planner.http_urls.remote()) if planner is not None else {}
        if len(urls) >= num_replicas:
            break
        time.sleep(0.2)
    return sorted(urls.items())


def client_url(host: str, port: int) -> str:
    """Where a client reaches Serve's proxy on the head node: ``host`` itself, or for a wildcard
    bind (0.0.0.0, ::) the head node's address (on a cluster that is not this machine)."""
    if host in ("0.0.0.0", "::", ""):
        host = _head_node_ip() or LOCAL_HOST
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def _head_node_ip() -> str | None:
    import ray
    try:
        from ray._common.constants import HEAD_NODE_RESOURCE_NAME
        return next((n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"] and HEAD_NODE_RESOURCE_NAME in
                     n["Resources"]), None)
    except Exception:  # noqa: BLE001 - a private constant; a URL guess is not worth failing over
        return None


# ---------------------------------------------------------------------------- the app
def refuse_clash(app_name: str, route_prefix: str = "/") -> None:
    """Before deploying onto a cluster we did not start: RuntimeError if an application of that
    name runs there (serve.run would replace it) or another one serves ``route_prefix`` (it would
    lose its URL); nothing on the cluster is touched."""
    from ray import serve
    if app_name in serve.status().applications:
        raise RuntimeError(f"an application named {app_name!r} already runs on this Ray cluster (serving would "
                           f"replace it): choose another --app-name")
    try:   # the route prefixes are in the controller's details (a private API: without it, names only)
        from ray.serve.context import _get_global_client
        details = _get_global_client().get_serve_details()
        prefixes = {name: app.get("route_prefix") for name, app in details.get("applications", {}).items()}
    except Exception:  # noqa: BLE001
        prefixes = {}
    for name, prefix in prefixes.items():
        if prefix == route_prefix:
            raise RuntimeError(f"the application {name!r} already serves the route prefix {route_prefix} on this "
                               f"Ray cluster: stop it first (mtpserve serves at {route_prefix})")


def deploy(options, app_name: str, route_prefix: str = "/") -> None:
    """``serve.run`` of ``build_app(options)`` as ``app_name`` at ``route_prefix`` (returns once
    Serve runs the app; its replicas may still be reporting to the planner)."""
    from ray import serve

    from mtpserve.cluster.app import build_app
    serve.run(build_app(options), name=app_name, route_prefix=route_prefix, blocking=False)


def failure_reason(app_name: str) -> str | None:
    """Why the app's replicas could not start: the exception line that ends each failed
    deployment's message (Serve keeps the replica constructor's traceback there), or None."""
    from ray import serve
    try:
        app = serve.status().applications.get(app_name)
    except Exception:  # noqa: BLE001 - a status we cannot read leaves Serve's own error to say it
        return None
    if app is None:
        return None
    reasons = []
    for d in app.deployments.values():
        lines = [line.strip() for line in (d.message or "").splitlines() if line.strip()]
        if lines and lines[-1] not in reasons and str(d.status).endswith("DEPLOY_FAILED"):
            reasons.append(lines[-1])
    return "; ".join(reasons) or None


def placement(app_name: str):
    """The app's planner's placement view, or None while the planner is missing or restarting."""
    import ray

    from mtpserve.actors.planner import get_planner
    planner = get_planner(app_name)
    try:
        return ray.get(planner.placement.remote(), timeout=10) if planner is not None else None
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
        return None


def wait_for_view(app_name: str, predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """The first placement view satisfying ``predicate``; RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = placement(app_name)
        if view is not None and predicate(view):
            return view
        time.sleep(interval_s)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting until {what}")


def wait_for_replicas(app_name: str, num_replicas: int, timeout_s: float = 600.0):
    """The placement view once ``num_replicas`` replicas report to the app's planner."""
    return wait_for_view(app_name, lambda v: len(v.replicas) == num_replicas, timeout_s,
                         f"{num_replicas} replicas report to the planner")


def delete(app_name: str) -> None:
    """Delete the app and its planner (a detached actor: deleting the app leaves it running)."""
    from ray import serve

    from mtpserve.actors.planner import shutdown_planner
    serve.delete(app_name)
    shutdown_planner(app_name)


def teardown(app_name: str | None) -> None:
    """``delete(app_name)`` (when given: Serve drains its replicas), then Ray's shutdown, which
    takes a Ray we started down with its Serve (``serve.shutdown()`` first only added Ray's
    warning that the controller's graceful-shutdown task "failed" when it was killed); a joined
    cluster keeps running, this process only disconnects."""
    import ray
    try:
        if app_name is not None:
            delete(app_name)
    finally:
        ray.shutdown()


@contextmanager
def connected(address: str | None = None, **connect_options):
    """Ray for the block (``connect``'s options); yields whether we started it. Afterwards only
    ``ray.shutdown()``: a local Ray takes its Serve down with it (faster and quieter than
    ``serve.shutdown()`` first); a joined cluster keeps its Serve."""
    import ray
    started = connect(address, **connect_options)
    try:
        yield started
    finally:
        ray.shutdown()


@contextmanager
def deployed(options, app_name: str, route_prefix: str = "/", timeout_s: float = 600.0):
    """The app with ``options`` on the running Serve (``start_http`` first), every replica
    reporting to its planner; yields that placement view. The app and its planner are deleted
    afterwards."""
    deploy(options, app_name, route_prefix)
    try:
        yield wait_for_replicas(app_name, options.num_replicas, timeout_s)
    finally:
        delete(app_name)


# ---------------------------------------------------------------------------- replicas
def replica_actor_name(app_name: str, replica_id: str) -> str:
    """Serve's actor name of one of the app's LLMServer replicas."""
    return f"SERVE_REPLICA::{app_name}#LLMServer#{replica_id}"


def kill_replica(app_name: str, replica_id: str) -> str:
    """Kill a replica's process without letting it clean up; returns how."""
    import ray
    actor = ray.get_actor(replica_actor_name(app_name, replica_id), namespace="serve")
    try:   # Serve's replica actor answers its pid and node (a private method: fall back on ray.kill)
        pid, _, _, node_id = ray.get(actor.is_allocated.remote(), timeout=10)[:4]
    except Exception:   # noqa: BLE001
        pid = node_id = None
    if pid and node_id == ray.get_runtime_context().get_node_id():
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL pid {pid}"
    ray.kill(actor, no_restart=False)
    return "ray.kill"


def stop_replica(app_name: str, replica_id: str, timeout_s: float = 60.0) -> None:
    """Stop one chosen replica as Serve's controller stops one it scales down or replaces: its
    graceful shutdown (Serve's drain, then the deployment's ``__del__``, which hands its sessions
    over), waited for, then its actor killed; Serve then starts a replacement (the deployment's
    replica count is unchanged). Serve has no public call that stops a chosen replica: this calls
    the replica actor's ``perform_graceful_shutdown``, the method the controller calls (Ray 2.60)."""
    import ray
    actor = ray.get_actor(replica_actor_name(app_name, replica_id), namespace="serve")
    ray.get(actor.perform_graceful_shutdown.remote(), timeout=timeout_s)
    ray.kill(actor, no_restart=True)


def serve_replica_ids(app_name: str) -> set[str]:
    """Replica ids of the app's live Serve replica actors."""
    import ray
    prefix = replica_actor_name(app_name, "")
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def num_running(app_name: str) -> int:
    """Replicas Serve reports RUNNING for the app, over its deployments."""
    from ray import serve
    app = serve.status().applications.get(app_name)
    return sum(d.replica_states.get("RUNNING", 0) for d in app.deployments.values()) if app else 0
