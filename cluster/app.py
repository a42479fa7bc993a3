"""Building the Serve application from options (the CLI, Serve config files and tests use this).

    build_app(ServeOptions(...))          -> a bound ``LLMServer`` deployment, ready for serve.run
    app_builder({"model_dir": ..., ...})  -> the same, for Serve config files:

        applications:
          - name: mtpserve
            import_path: mtpserve.cluster.app:app_builder
            args: {num_replicas: 2, device: cpu, draft_tokens: auto}   (any setting_names())

(``num_replicas: auto`` there is one replica per GPU of the cluster with ``device: cuda``.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from mtpserve.actors.prefix_routing import DEFAULT_MAX_IMBALANCE
from mtpserve.actors.worker_config import WorkerConfig
from mtpserve.engine.bundled import BUNDLED_MODEL_REF, MODEL_DIR
from mtpserve.engine.config import config_fields, from_flat, setting


@dataclass(frozen=True)
class ServeOptions:
    """How to deploy: the replicas, and the worker config each of them runs (which holds the
    engine config). Build one from flat setting names with ``ServeOptions.from_flat``."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    num_replicas: int = setting(1, "engine replicas (mtpserve serve: one per GPU of the Ray cluster with "
                                   "device cuda, else 1)")
    num_cpus_per_replica: float = setting(1.0, "Ray CPUs reserved per replica")
    num_gpus_per_replica: float | None = setting(None, "Ray GPUs per replica (default: 1 with device cuda, else 0)")
    replica_resource: str | None = setting(None, "a custom Ray resource each replica takes one unit of: give each "
                                                 "node `ray start --resources '{\"NAME\": 1}'` to place one "
                                                 "replica per node (as num_gpus_per_replica 1 places one per GPU)")
    shutdown_grace_s: float = setting(5.0, "seconds a stopping replica has for its in-flight requests and then "
                                           "its session hand-over before it is stopped (streams still running then "
                                           "end, and a replica busy until then hands nothing over)")
    prefix_routing: bool = setting(True, "prefix-aware routing: a request without a session goes to the replica "
                                         "whose prefix cache holds the longest prefix of its prompt, unless that "
                                         "replica is busier than the least loaded by more than "
                                         "prefix_max_imbalance; off: to the least loaded")
    routes_on_serve_loop: bool = setting(True, "run each replica's HTTP routes on Serve's own event loop, not on a "
                                               "thread of their own (Ray Serve's default): one thread hop less per "
                                               "streamed chunk; on the H200 a replica at 16 streams served 1.40x "
                                               "the tokens at a quarter less CPU a token")
    prefix_max_imbalance: float = setting(DEFAULT_MAX_IMBALANCE, "prefix-aware routing: how many more active requests than the least "
                                               "loaded replica a replica holding the prompt's prefix may have and "
                                               "still be preferred")

    @staticmethod
    def from_flat(**values) -> ServeOptions:
        """Options from flat setting names (``model_dir=..., num_replicas=2, draft_tokens="auto"``);
        ValueError naming an unknown one."""
        return from_flat(ServeOptions, values)

    def validate(self) -> None:
        engine = self.worker.engine
        engine.validate()
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.worker.session_handover_gib < 0 or self.worker.session_handover_timeout_s <= 0:
            raise ValueError(f"session_handover_gib must be >= 0 and session_handover_timeout_s > 0, got "
                             f"{self.worker.session_handover_gib} / {self.worker.session_handover_timeout_s}")
        if (self.worker.api_servers or 0) < 0:
            raise ValueError(f"api_servers must be >= 0, got {self.worker.api_servers}")
        if self.worker.num_api_servers and not self.worker.uses_engine_process:
            raise ValueError("api_servers needs the engine in a process of its own: engine_process on")
        if self.prefix_max_imbalance < 0:
            raise ValueError(f"prefix_max_imbalance must be >= 0, got {self.prefix_max_imbalance}")
        if not (Path(engine.model_dir) / "genai_config.json").is_file():
            raise ValueError(f"{engine.model_dir} is not a model export (no genai_config.json)")

    @property
    def served_model_name(self) -> str:
        return self.worker.served_model_name


ROUTES_THREAD_ENV = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"   # read by each replica process at start


def build_app(options: ServeOptions):
    """The bound deployment for ``serve.run``."""
    from mtpserve.actors.worker import LLMServer, router_config
    options.validate()
    engine = options.worker.engine
    model_dir = Path(engine.model_dir).resolve()
    # a path as this machine sees it; the bundled model by reference (each node's install has its own copy)
    worker = dataclasses.replace(
        options.worker, model_name=options.served_model_name,
        engine=dataclasses.replace(engine, model_dir=BUNDLED_MODEL_REF if model_dir == MODEL_DIR else str(model_dir)))
    # Serve force-kills a stopping replica this long after asking it to stop: its drain (in-flight
    # requests) and then its __del__, which hands the sessions over (Worker.shutdown) in what is
    # left. Not longer: the grace is the user's bound on how long a stop lets streams run.
    stop_deadline_s = options.shutdown_grace_s
    num_gpus = options.num_gpus_per_replica
    if num_gpus is None:
        num_gpus = 1 if engine.device == "cuda" else 0
    deployment = LLMServer.options(
        num_replicas=options.num_replicas,
        max_ongoing_requests=engine.cache.max_resident_requests + worker.max_pending,
        graceful_shutdown_timeout_s=stop_deadline_s, graceful_shutdown_wait_loop_s=0.5,
        request_router_config=router_config({"model_dir": worker.engine.model_dir,
                                             "kv_block_size": engine.cache.kv_block_size,
                                             "prefix_routing": options.prefix_routing,
                                             "prefix_max_imbalance": options.prefix_max_imbalance}),
        ray_actor_options={"num_cpus": options.num_cpus_per_replica, "num_gpus": num_gpus,
                           **({"resources": {options.replica_resource: 1}} if options.replica_resource else {}),
                           **({"runtime_env": {"env_vars": {ROUTES_THREAD_ENV: "0"}}}
                              if options.routes_on_serve_loop else {})})
    return deployment.bind(worker.to_dict())


def app_builder(args: dict):
    """Serve config entry point: ``args`` holds flat setting names (``config_fields(ServeOptions)``);
    ``num_replicas: auto`` is one replica per GPU of the cluster with ``device: cuda``."""
    args = dict(args or {})
    if str(args.get("num_replicas", "")).lower() == "auto":
        args["num_replicas"] = _num_gpus() if args.get("device") == "cuda" else 1
    return build_app(ServeOptions.from_flat(**args))


def setting_names() -> list[str]:
    """Every setting a Serve config's ``args`` may hold."""
    return sorted(config_fields(ServeOptions))


def _num_gpus() -> int:
    import ray
    num_gpus = int(ray.cluster_resources().get("GPU", 0))
    if num_gpus < 1:
        raise ValueError("num_replicas: auto with device: cuda, but the Ray cluster has no GPU")
    return num_gpus
