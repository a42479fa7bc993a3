"""A replica's own HTTP servers: N processes beside its engine process serve its direct URL.

    client --TCP--> the replica's listening socket (the first free port from ``api_port`` up)
                      | acceptor thread: accept, then hand the connection to the next API server
                      v (round robin; the socket's descriptor crosses a Unix socket, SCM_RIGHTS)
    API server process i: uvicorn + the OpenAI routes (``ingress.OpenAIRoutes``) on its own GIL
                      | its own pipe (``EngineProcess.attach``): submits, aborts, its events
                      v
    engine process (``engine_process``): steps every client's requests in one batch

Why: one replica process streams every token of every request of its direct URL; at 16 streams
on the H200 its GIL was the limit (the HTTP routes, JSON and socket writes: about 50 us a token,
results/h200/serving/), so a second front process halves what each one does, as vLLM's
``--api-server-count``. The routes are the replica's own (the same FastAPI app, bound to an
``ApiServer`` instead of the Serve replica), so answers, errors and limits do not differ.

Metrics: each process records its own requests; each sends its ``MetricsSnapshot`` to the engine
process every ``METRICS_INTERVAL_S``, which passes every pipe's latest to every other one with its
snapshots, so /metrics on any of them (and the planner's reports) counts the whole replica.

Lifetimes: the API servers start with the replica (``ApiServers.start`` waits until each serves)
and stop with it; an API server whose replica or engine process is gone exits; one that exits
has its requests aborted by the engine process (its pipe closed).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

METRICS_INTERVAL_S = 0.5       # how often each process's request metrics go to the engine process
START_TIMEOUT_S = 120.0        # the longest an API server may take to start serving
PORT_RANGE = 1000              # ports tried from api_port up


class ApiServers:
    """The replica side: the listening socket, the acceptor thread and the N processes.

    ``worker``: the replica (``worker.Worker``) whose engine process was started with
    ``num_clients=num_servers`` (one pipe per API server)."""

    def __init__(self, worker, num_servers: int, host: str, first_port: int):
        self.worker, self.num_servers, self.host, self.first_port = worker, num_servers, host, first_port
        self.port: int | None = None
        self._listener: socket.socket | None = None
        self._procs: list[subprocess.Popen] = []
        self._handoffs: list[socket.socket] = []        # our end of each server's descriptor socket
        self._acceptor: threading.Thread | None = None
        self._stopping = False

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::", "") else socket.gethostbyname(socket.gethostname())
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def start(self) -> ApiServers:
        """Bind the port, start the processes and wait until each one serves (RuntimeError if not)."""
        self._listener, self.port = _bind(self.host, self.first_port)
        conns = self.worker.loop.client_conns
        setup = {"config": self.worker.config, "info": self.worker.loop.info, "replica_id": self.worker.replica_id}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for i in range(self.num_servers):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            fds = [conns[i].fileno(), theirs.fileno()]
            proc = subprocess.Popen([sys.executable, "-m", "mtpserve.actors.api_servers", ",".join(map(str, fds))],
                                    env=env, stdin=subprocess.PIPE, pass_fds=fds)
            proc.stdin.write(pickle.dumps(setup))
            proc.stdin.close()
            theirs.close()
            conns[i].close()                  # the server's now: its closing must reach the engine
            self._procs.append(proc)
            self._handoffs.append(ours)
        deadline = time.monotonic() + START_TIMEOUT_S
        for i, (proc, ours) in enumerate(zip(self._procs, self._handoffs)):
            ours.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                ready = ours.recv(1)
            except TimeoutError:
                ready = b""
            if ready != b"R":
                self.stop()
                raise RuntimeError(f"API server {i} did not start (exit code {proc.poll()}); its log is the "
                                   "replica's stderr")
            ours.settimeout(None)
        self._acceptor = threading.Thread(target=self._accept, name="mtpserve-api-acceptor", daemon=True)
        self._acceptor.start()
        return self

    def failed(self) -> str | None:
        """Why the API servers cannot serve (one exited), or None."""
        for i, proc in enumerate(self._procs):
            if proc.poll() is not None:
                return f"API server {i} exited with code {proc.returncode}"
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, then stop the processes (their open requests are aborted)."""
        self._stopping = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)     # wakes the acceptor's accept()
            except OSError:
                pass
            self._listener.close()
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for ours in self._handoffs:
            ours.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout)

    def _accept(self) -> None:
        turn = 0
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return                                 # the listener closed: stopping
            with conn:
                for _ in range(self.num_servers):      # the next live server takes it
                    ours = self._handoffs[turn]
                    turn = (turn + 1) % self.num_servers
                    try:
                        socket.send_fds(ours, [b"C"], [conn.fileno()])
                        break
                    except OSError:
                        continue                       # that server is gone (the health check says so)


def _bind(host: str, first_port: int) -> tuple[socket.socket, int]:
    """A listening socket on the first free port from ``first_port`` up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in range(first_port, first_port + PORT_RANGE):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            continue
        sock.listen(2048)
        return sock, port
    raise RuntimeError(f"no free port for the API servers in {first_port}..{first_port + PORT_RANGE - 1} on {host}")


# ---------------------------------------------------------------------- an API server process
def _api_server_class():
    from mtpserve.actors.ingress import OpenAIRoutes
    from mtpserve.actors.worker import Worker

    class ApiServer(OpenAIRoutes, Worker):
        """The replica's routes in an API server process: ``Worker``'s serving side over an
        attached engine pipe; no planner, no session hand-over (the replica does those)."""

        def __init__(self, setup: dict, engine_conn: Connection):
            from mtpserve.actors.engine_process import EngineProcess
            cfg = self.config = setup["config"]
            self.replica_id, self.app_name = setup["replica_id"], None
            self._init_serving(cfg, EngineProcess.attach(engine_conn, setup["info"], cfg.max_pending))

    return ApiServer


def _bind_routes(server) -> None:
    """Route the FastAPI app's class-based views (bound by ``serve.ingress`` to the Serve replica
    instance) to ``server``: FastAPI's dependency override of Serve's instance dependency."""
    from fastapi.routing import APIRoute

    from mtpserve.actors.ingress import api
    try:
        from fastapi.routing import _IncludedRouter
    except ImportError:            # FastAPI < 0.137 flattens included routes
        _IncludedRouter = None

    def walk(routes):
        for route in routes:
            if isinstance(route, APIRoute):
                yield route
            elif _IncludedRouter is not None and isinstance(route, _IncludedRouter):
                yield from walk(route.original_router.routes)
    found = set()
    for route in walk(api.routes):
        instance = inspect.signature(route.endpoint).parameters.get("self")   # Depends(<the instance>)
        if instance is not None and hasattr(instance.default, "dependency"):
            found.add(instance.default.dependency)
    if not found:
        raise RuntimeError("Serve's class-based view dependency was not found: this Ray Serve binds "
                           "ingress routes differently; run without --api-servers")
    for call in found:
        api.dependency_overrides[call] = lambda: server


def _server_main(fds: str) -> int:
    from mtpserve.actors.engine_process import run_at_normal_priority
    run_at_normal_priority("an API server")          # first: before anything starts a thread
    import uvicorn

    from mtpserve.actors.ingress import api
    engine_fd, handoff_fd = map(int, fds.split(","))
    setup = pickle.loads(sys.stdin.buffer.read())
    handoff = socket.socket(fileno=handoff_fd)
    server = _api_server_class()(setup, Connection(engine_fd))
    _bind_routes(server)
    config = uvicorn.Config(api, log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=60, loop="auto", http="auto")
    config.load()
    web = uvicorn.Server(config)

    def protocol():
        return config.http_protocol_class(config=config, server_state=web.server_state, app_state={})

    async def serve():
        loop = asyncio.get_running_loop()
        handoff.setblocking(False)

        def take_connection():
            try:
                _, fds, _, _ = socket.recv_fds(handoff, 1, 1)
            except BlockingIOError:
                return
            except OSError:
                fds = None
            if not fds:                                # the replica is gone
                loop.remove_reader(handoff.fileno())
                web.should_exit = True
                return
            for fd in fds:
                sock = socket.socket(fileno=fd)
                sock.setblocking(False)
                loop.create_task(loop.connect_accepted_socket(protocol, sock))

        async def report_metrics():
            while not web.should_exit:
                if server.loop.failed is not None:     # the engine process is gone: so are we
                    web.should_exit = True
                    return
                server.loop.send_metrics(server.recorder.snapshot())
                await asyncio.sleep(METRICS_INTERVAL_S)
        loop.add_reader(handoff.fileno(), take_connection)
        reporter = loop.create_task(report_metrics())
        handoff.send(b"R")
        await web.serve(sockets=[])
        reporter.cancel()
    factory = config.get_loop_factory()              # uvloop when installed, as uvicorn's own
    loop = factory() if factory is not None else asyncio.new_event_loop()
    try:
        loop.run_until_complete(serve())
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(_server_main(sys.argv[1]))
