"""A real multi-node Ray cluster on one machine: a head and worker nodes started with `ray start`.

    with LocalCluster(num_workers=2, workdir=tmp) as cluster:    # head 127.0.0.1, workers .2, .3
        cluster.env                       # environment for drivers: RAY_ADDRESS, the auth token
        cluster.proxy_urls                # Serve's HTTP proxy of each node, once Serve runs
        cluster.kill_node(1)              # SIGKILL worker 1's raylet (the node is lost)
        cluster.start_node(1)             # worker 1 joins again (a new node id, same IP and ports)

Each node is its own `ray start --block` process group with its own node IP (127.0.0.x: the
whole 127/8 answers on Linux loopback, so every node's Ray and Serve ports are its own), its own
ports, one shared temp dir (Ray keeps one session per machine) and the environment a real node
needs:

- ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``: the proxy middleware (OpenAI errors when a
  replica dies), on every node, as a KubeRay pod sets it;
- ``RAY_SERVE_WORKER_PROXY_HTTP_PORT``: worker node i's Serve proxy binds ``http_port + i``
  (Serve's per-node override; the head keeps ``http_options.port``). On a real cluster every
  node has its own IP and this is not needed;
- token authentication (Ray 2.60 turns it on for new clusters) with a token of this cluster's
  own, ``RAY_AUTH_TOKEN_PATH`` in its workdir, so ``~/.ray/auth_token`` is never read or written;
- ``resources``: worker nodes get one unit of ``replica_resource`` each, so a deployment that
  asks for it places one replica per worker node (as ``num_gpus: 1`` does per GPU).

Nothing here uses `ray stop` (it would stop every Ray of the machine): each node's process group
is signalled by its own id, and ``stop()`` runs in every outcome of the ``with`` block.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mtpserve.actors.proxy_middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV

REPLICA_RESOURCE = "mtpserve_replica"
WORKER_PROXY_PORT_ENV = "RAY_SERVE_WORKER_PROXY_HTTP_PORT"
NODE_PORTS = ("node-manager-port", "object-manager-port", "metrics-export-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "runtime-env-agent-port")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


RAY_WORKER_PORTS = range(10002, 20000)     # Ray's default --min/--max-worker-port (another Ray's workers)
MAX_NODES = 8
WORKER_PORTS_PER_START, STARTS_PER_NODE = 200, 5
# each node's workers get ports of their own, fresh for each of its last 5 starts:
#   node i, start s: [20000 + 1000 i + 200 (s % 5), ... + 199]        (i < MAX_NODES)
NODE_WORKER_PORTS = range(RAY_WORKER_PORTS.stop,
                          RAY_WORKER_PORTS.stop + MAX_NODES * STARTS_PER_NODE * WORKER_PORTS_PER_START)


def node_worker_ports(index: int, start: int) -> range:
    """The --min/--max-worker-port range of node ``index``'s ``start``-th start (see above)."""
    lo = NODE_WORKER_PORTS.start + WORKER_PORTS_PER_START * (STARTS_PER_NODE * index + start % STARTS_PER_NODE)
    return range(lo, lo + WORKER_PORTS_PER_START)


def _quiet_ports() -> range:
    """Ports no process is handed by the OS on its own: below the ephemeral range (where every
    ``bind(0)`` and outgoing connection draws its port) and above every worker port, Ray's default
    ones and our nodes' (CI once had a node's agent drawn a port inside its own worker range, and
    `ray start` refused it)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(NODE_WORKER_PORTS.stop, low)


def free_ports(n: int, host: str = "127.0.0.1", avoid=()) -> list[int]:
    """``n`` distinct free ports on ``host``, none in ``avoid``: bound all at once, then let go.

    (One at a time, the OS may hand out the same port twice: CI once had a node's node manager
    and runtime-env agent given one port, and `ray start` refused it.) They are drawn from the
    ports below the OS's ephemeral range where it has one: a port the OS picked for ``bind(0)``
    can be handed to any other process's socket before ours binds it again (CI once had Serve's
    direct-ingress port taken that way, and Serve moved the replica to the next port)."""
    quiet = _quiet_ports()
    candidates = random.sample(quiet, len(quiet)) if len(quiet) >= 4 * n else []
    sockets, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            sockets.append(s)
            want = candidates.pop() if candidates else 0
            if want in avoid:
                continue
            try:
                s.bind((host, want))
            except OSError:
                continue
            port = s.getsockname()[1]
            if port not in avoid:
                ports.append(port)
        return ports
    finally:
        for s in sockets:
            s.close()


@dataclass
class Node:
    """One `ray start --block` process (the leader of its own process group)."""
    index: int                        # 0 = head
    ip: str
    ports: dict[str, int]
    http_port: int                    # where this node's Serve proxy listens
    resources: dict[str, float]
    num_cpus: float
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    starts: int = 0

    @property
    def is_head(self) -> bool:
        return self.index == 0

    @property
    def proxy_url(self) -> str:
        """Serve binds every proxy to http_options.host (127.0.0.1 here), each node on its own port."""
        return f"http://127.0.0.1:{self.http_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class LocalCluster:
    """A head and ``num_workers`` worker nodes on this machine (see the module docstring)."""
    num_workers: int
    workdir: Path
    http_port: int = 0                        # 0: a free port, then +i for worker i
    cpus_per_node: float = 1.0
    head_cpus: float = 1.0
    replica_resource: str = REPLICA_RESOURCE
    include_dashboard: bool = False           # `serve deploy` needs the dashboard's REST API on the head
    extra_env: dict[str, str] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self):
        if not 0 <= self.num_workers < MAX_NODES:
            raise ValueError(f"a local cluster has 1 to {MAX_NODES} nodes (a head and up to {MAX_NODES - 1} "
                             f"workers); got {self.num_workers} workers")
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.temp_dir = self.workdir / "ray"       # Ray's socket paths must stay short: keep workdir short
        self.token_path = self.workdir / "auth_token"
        if not self.token_path.exists():
            self.token_path.write_text(secrets.token_hex(32))
            self.token_path.chmod(0o600)
        # the head's ports and node 0's share 127.0.0.1 (and the proxies bind 127.0.0.1 at http_port + i):
        # all chosen at once, so no two components get one port
        self.http_port = self.http_port or free_port()
        proxies = {self.http_port + i for i in range(self.num_workers + 1)}
        ports = free_ports(3 + len(NODE_PORTS), avoid=proxies)
        self.gcs_port, self.client_port = ports[0], ports[1]
        self._gcs = None
        self.dashboard_port = ports[2] if self.include_dashboard else None
        for i in range(self.num_workers + 1):
            ip = f"127.0.0.{i + 1}"
            mine = ports[3:] if i == 0 else free_ports(len(NODE_PORTS), ip, avoid=proxies)
            self.nodes.append(Node(i, ip, dict(zip(NODE_PORTS, mine)), self.http_port + i,
                                   {} if i == 0 else {self.replica_resource: 1},
                                   self.head_cpus if i == 0 else self.cpus_per_node))

    # ------------------------------------------------------------------ addresses and environment
    @property
    def address(self) -> str:
        """The GCS address (``ray.init(address=...)``, ``mtpserve serve --address``)."""
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str | None:
        """The head's dashboard (``serve deploy --address``), when started with one."""
        return f"http://127.0.0.1:{self.dashboard_port}" if self.dashboard_port else None

    @property
    def proxy_urls(self) -> list[str]:
        """Serve's HTTP proxy on each node, head first (Serve runs one per node: EveryNode)."""
        return [n.proxy_url for n in self.nodes]

    @property
    def auth_env(self) -> dict[str, str]:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}

    @property
    def env(self) -> dict[str, str]:
        """os.environ for a driver of this cluster: its address and token, and nothing of another Ray."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
        return {**env, **self.extra_env, **self.auth_env, "RAY_ADDRESS": self.address}

    def _node_env(self, node: Node) -> dict[str, str]:
        from mtpserve.cluster.deploy import WORKER_NICENESS_ENV
        env = {WORKER_NICENESS_ENV: "0", **self.env, PROXY_CALLBACK_ENV: PROXY_CALLBACK}   # see deploy.py
        env.pop("RAY_ADDRESS")
        if not node.is_head:
            env[WORKER_PROXY_PORT_ENV] = str(node.http_port)
        return env

    # ------------------------------------------------------------------ nodes
    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        """Start the head, then every worker node; returns once Ray counts them all alive. This
        process becomes a driver of the cluster: its environment gets the address and the token
        (set before anything here connects to Ray)."""
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ.update({**self.auth_env, "RAY_ADDRESS": self.address})
        for node in self.nodes:        # one at a time: nodes of one session dir pick their socket names in turn
            self.start_node(node.index, timeout_s=timeout_s)
        return self

    def start_node(self, index: int, wait: bool = True, timeout_s: float = 120.0) -> Node:
        """(Re)start node ``index`` (0 = head); with ``wait``, until Ray counts it alive. Then a
        worker node that fails to come up is started once more, on fresh ports: `ray start` gives
        a raylet 30 s to register with the GCS, which a loaded 2-core machine can miss."""
        assert not self.nodes[index].alive(), f"node {index} is already running"
        if not wait or index == 0:
            return self._start_node(index, wait, timeout_s)
        try:
            return self._start_node(index, wait, timeout_s)
        except RuntimeError as e:
            print(f"local cluster: node {index} did not come up ({str(e)[-300:]}); starting it again",
                  file=sys.stderr, flush=True)
            return self._start_node(index, wait, timeout_s)

    def _start_node(self, index: int, wait: bool, timeout_s: float) -> Node:
        node = self.nodes[index]
        if node.starts:           # a rejoin or a second try: reap what is left of the node before, and take fresh
            self.stop_node(index, timeout_s=5)     # ports (an agent of the old one may still hold its own a while)
            taken = {self.gcs_port, self.client_port, self.dashboard_port} if index == 0 else set()
            node.ports = dict(zip(NODE_PORTS, free_ports(len(NODE_PORTS), node.ip,
                                                         avoid=taken | {n.http_port for n in self.nodes})))
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
               f"--node-ip-address={node.ip}", f"--num-cpus={node.num_cpus:g}", "--num-gpus=0",
               f"--resources={json.dumps(node.resources)}", f"--temp-dir={self.temp_dir}",
               *(f"--{name}={port}" for name, port in node.ports.items())]
        if node.is_head:
            cmd += ["--head", f"--port={self.gcs_port}", f"--include-dashboard={self.include_dashboard}",
                    f"--ray-client-server-port={self.client_port}"]
            if self.dashboard_port:
                cmd += ["--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}"]
        else:
            cmd += [f"--address={self.address}"]
        workers = node_worker_ports(index, node.starts)
        cmd += [f"--min-worker-port={workers.start}", f"--max-worker-port={workers.stop - 1}"]
        node.log_path = self.workdir / f"node{index}-{node.starts}.log"
        node.starts += 1
        with open(node.log_path, "w") as log:
            node.proc = subprocess.Popen(cmd, env=self._node_env(node), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        (self.workdir / "process_groups").open("a").write(f"{node.proc.pid}\n")
        if wait:
            self.wait_for_nodes(sum(n.alive() for n in self.nodes), timeout_s)
        return node

    def kill_node(self, index: int) -> int:
        """SIGKILL node ``index``'s raylet, as a lost machine would lose it; returns its pid. Its
        other processes (workers, agents) exit on their own; ``stop_node`` reaps the rest."""
        node = self.nodes[index]
        pid = self._raylet_pid(node)
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop_node(self, index: int, timeout_s: float = 30.0) -> None:
        """End every process of node ``index`` (its own process group)."""
        node = self.nodes[index]
        if node.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(node.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                node.proc.wait(timeout_s if sig == signal.SIGTERM else 10)
                time.sleep(0.5)                     # the group's stragglers get the next signal
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(node.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.proc = None

    def stop(self) -> None:
        """Every node, workers first (the head last: workers would otherwise wait for it)."""
        for node in reversed(self.nodes):
            self.stop_node(node.index, timeout_s=10)

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ inspection
    def wait_for_nodes(self, num_alive: int, timeout_s: float) -> None:
        """Until Ray counts ``num_alive`` alive nodes; RuntimeError (with the node logs' tails) after."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc is not None and node.proc.poll() is not None:
                    raise RuntimeError(f"node {node.index} ({node.ip}) exited: {self.log_tail(node.index)}")
            if self.num_alive_nodes() == num_alive:
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {num_alive} alive Ray nodes; "
                           + " | ".join(self.log_tail(n.index) for n in self.nodes))

    def num_alive_nodes(self) -> int | None:
        """Alive nodes as the GCS counts them (None while the head does not answer)."""
        try:
            socket.create_connection(("127.0.0.1", self.gcs_port), timeout=1).close()
        except OSError:
            return None
        from ray._raylet import GcsClient
        try:
            if self._gcs is None:
                self._gcs = GcsClient(address=self.address)
            infos = self._gcs.get_all_node_info(timeout=10)
        except Exception:  # noqa: BLE001 - the GCS is starting or busy: ask again
            return None
        return sum(info.state == 0 for info in infos.values())       # GcsNodeInfo.ALIVE

    def node_index(self, node_id: str) -> int | None:
        """Which of our nodes a Ray node id is (the head may report the machine's IP, not 127.0.0.1)."""
        if self._gcs is None:
            self.num_alive_nodes()
        try:
            infos = self._gcs.get_all_node_info(timeout=10)
        except Exception:  # noqa: BLE001
            return None
        for nid, info in infos.items():
            if nid.hex() == node_id and info.state == 0:
                if info.is_head_node:
                    return 0
                return next((n.index for n in self.nodes if n.ip == info.node_manager_address), None)
        return None

    def log_tail(self, index: int, num_chars: int = 1500) -> str:
        node = self.nodes[index]
        text = node.log_path.read_text(errors="replace") if node.log_path and node.log_path.exists() else ""
        return f"node {index}: {text[-num_chars:]}"

    def _raylet_pid(self, node: Node) -> int:
        """The raylet among node ``node``'s process group (found through /proc, by group id)."""
        assert node.alive(), f"node {node.index} is not running"
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getpgid(int(entry.name)) != node.proc.pid:
                    continue
                exe = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except (OSError, ProcessLookupError):
                continue
            if exe.endswith(b"/raylet"):
                return int(entry.name)
        raise RuntimeError(f"no raylet found in node {node.index}'s process group {node.proc.pid}")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child, before exec: ``sig`` it when the process that started it dies (Linux), so a
    killed driver leaves nothing behind (a node's `ray start --block` stops its node on SIGTERM)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)     # PR_SET_PDEATHSIG
    except OSError:
        pass
