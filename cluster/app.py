"""Building the Serve application from options (the CLI, Serve config files and tests use this).

    build_app(ServeOptions(...))          -> a bound ``LLMServer`` deployment, ready for serve.run
    app_builder({"model_dir": ..., ...})  -> the same, for Serve config files:

        applications:
          - name: mtpserve
            import_path: mtpserve.cluster.app:app_builder
            args: {num_replicas: 2, device: cpu, draft_tokens: auto}

(``num_replicas: auto`` there is one replica per GPU of the cluster with ``device: cuda``.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from mtpserve.engine.bundled import MODEL_DIR
from mtpserve.engine.speculative import MAX_NUM_DRAFTS

BUNDLED_MODEL_NAME = "mtpserve-bundled"


@dataclass(frozen=True)
class ServeOptions:
    """How to deploy: the model, the replicas and their engines, the HTTP edge."""
    model_dir: str = str(MODEL_DIR)
    model_name: str | None = None             # default: the model folder's name
    device: str = "cpu"                       # "cpu" or "cuda" (one replica per GPU)
    num_replicas: int = 1
    draft_tokens: int | None = None           # None = auto: the planner picks K per request
    num_threads: int = 0                      # ORT intra-op threads per replica (0 = ORT default)
    num_blocks: int | None = None
    max_resident_requests: int = 64
    max_tokens_per_step: int = 512
    max_requests_per_step: int = 64
    max_model_len: int | None = None          # longest prompt + output served (default: the model's context)
    max_pending: int = 1024
    api_key: str | None = None
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float | None = None  # default: 1 with device="cuda", else 0

    def validate(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.draft_tokens is not None and not 0 <= self.draft_tokens <= MAX_NUM_DRAFTS:
            raise ValueError(f"draft_tokens must be 'auto' or in 0..{MAX_NUM_DRAFTS}, got {self.draft_tokens}")
        if not (Path(self.model_dir) / "genai_config.json").is_file():
            raise ValueError(f"{self.model_dir} is not a model export (no genai_config.json)")

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        path = Path(self.model_dir).resolve()
        return BUNDLED_MODEL_NAME if path == Path(MODEL_DIR).resolve() else path.name


def parse_draft_tokens(value) -> int | None:
    """'auto' (or None) -> None; otherwise an int K."""
    if value is None or (isinstance(value, str) and value.lower() == "auto"):
        return None
    return int(value)


def build_app(options: ServeOptions):
    """The bound deployment for ``serve.run``."""
    from mtpserve.actors.worker import LLMServer, WorkerConfig
    options.validate()
    worker = WorkerConfig(
        model_dir=str(Path(options.model_dir).resolve()), model_name=options.served_model_name,
        device=options.device, num_threads=options.num_threads, num_blocks=options.num_blocks,
        max_resident_requests=options.max_resident_requests,
        max_tokens_per_step=options.max_tokens_per_step,
        max_requests_per_step=options.max_requests_per_step, max_model_len=options.max_model_len,
        draft_tokens=options.draft_tokens,
        max_pending=options.max_pending, api_key=options.api_key)
    num_gpus = options.num_gpus_per_replica
    if num_gpus is None:
        num_gpus = 1 if options.device == "cuda" else 0
    deployment = LLMServer.options(
        num_replicas=options.num_replicas,
        max_ongoing_requests=options.max_resident_requests + options.max_pending,
        ray_actor_options={"num_cpus": options.num_cpus_per_replica, "num_gpus": num_gpus})
    return deployment.bind(dataclasses.asdict(worker))


def app_builder(args: dict):
    """Serve config entry point: ``args`` holds ServeOptions fields (draft_tokens may be 'auto')."""
    args = dict(args or {})
    if str(args.get("num_replicas", "")).lower() == "auto":
        args["num_replicas"] = _num_gpus() if args.get("device") == "cuda" else 1
    if "draft_tokens" in args:
        args["draft_tokens"] = parse_draft_tokens(args["draft_tokens"])
    known = {f.name for f in dataclasses.fields(ServeOptions)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown mtpserve options {unknown}; known: {sorted(known)}")
    return build_app(ServeOptions(**args))


def _num_gpus() -> int:
    import ray
    num_gpus = int(ray.cluster_resources().get("GPU", 0))
    if num_gpus < 1:
        raise ValueError("num_replicas: auto with device: cuda, but the Ray cluster has no GPU")
    return num_gpus
