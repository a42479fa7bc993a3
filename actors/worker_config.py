"""What a replica runs: its engine's config and the serving edge's settings (no Ray in here, so
the CLI and Serve config builders can import it cheaply)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from mtpserve.actors.handover import DEFAULT_HANDOVER_GIB
from mtpserve.engine.bundled import MODEL_DIR
from mtpserve.engine.config import EngineConfig, SpecConfig, from_flat, setting

BUNDLED_MODEL_NAME = "mtpserve-bundled"


def _flatten(values: dict) -> dict:
    """Nested dicts of config values -> flat leaf names (leaf names are unique, see engine.config)."""
    flat = {}
    for k, v in values.items():
        flat.update(_flatten(v) if isinstance(v, dict) else {k: v})
    return flat


def _serving_engine() -> EngineConfig:
    return EngineConfig(spec=SpecConfig("auto"))        # a server drafts adaptively unless told K


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a replica needs: its engine's config and the serving edge's settings."""
    engine: EngineConfig = field(default_factory=_serving_engine)
    model_name: str | None = setting(None, "the name clients pass as `model` (default: the model folder's "
                                           "name, mtpserve-bundled for the bundled model)")
    max_pending: int = setting(1024, "requests waiting for admission on a replica before it answers 429")
    api_key: str | None = setting(None, "require `Authorization: Bearer KEY` on every POST route and /v1/models "
                                        "(else $MTPSERVE_API_KEY on the replica, else none)")
    report_interval_s: float = setting(0.2, "seconds between a replica's reports to the planner actor")
    allowed_origins: str | None = setting(None, "CORS for browser clients: comma-separated origins allowed "
                                                "(* for any); default none (no CORS headers, preflights 405)")
    max_request_bytes: int = setting(8 << 20, "the largest request body a replica reads (HTTP 413 above it; "
                                              "checked, with the API key, before the body is parsed)")

    session_handover_gib: float = setting(DEFAULT_HANDOVER_GIB, "a replica that stops gracefully (scale-down, "
                                          "redeploy) hands its sessions' cached prefixes, the most recently used "
                                          "first, up to this many GiB, to the planner, and the replica that serves "
                                          "each session next starts from them; the planner holds at most this much "
                                          "(the oldest dropped); 0 = off")
    session_handover_timeout_s: float = setting(10.0, "the longest a stopping replica spends handing its sessions "
                                                      "over, within what shutdown_grace_s leaves after its drain")

    proxy_chunks_per_s: float = setting(2000.0, "the most stream chunks a replica sends a second through Serve's "
                                                "proxy and to Python handle streams, over all its streams (never on "
                                                "--direct-port URLs): each chunk is a Ray message, dearer than a "
                                                "step of a small model, so above this rate a chunk carries the "
                                                "tokens of several steps (a stream is read at most every open "
                                                "streams / this many seconds); 0: every step's tokens at once")
    engine_process: bool | None = setting(None, "run the engine in a process of its own, so the replica's HTTP "
                                                "serving and the engine's steps do not share one GIL (default: "
                                                "on for CUDA, off for CPU)")

    api_servers: int | None = setting(None, "with --direct-port: each replica serves its direct URL from this many "
                                             "HTTP processes of its own beside its engine process (needs the engine "
                                             "process; vLLM's --api-server-count), instead of from the replica "
                                             "itself through Ray Serve's direct ingress; 0 = Serve's direct ingress "
                                             "(default: 2 when the engine runs in its own process, as on CUDA, else 0)")
    api_port: int | None = setting(None, "the first port the API servers try (serve sets it from --direct-port)")
    api_host: str = setting("127.0.0.1", "the API servers' bind address (serve sets it from --host)")
    stall_phases: bool = setting(False, "a diagnostic: time each engine step by phase, so every stall a replica's "
                                        "status lists (a turn of its engine loop of 25 ms and 4x its average "
                                        "step) says where its step's time went; costs microseconds a phase")

    @property
    def num_api_servers(self) -> int:
        """The API server processes a replica runs (``api_servers`` resolved; 0 without ``api_port``)."""
        if self.api_port is None:
            return 0
        if self.api_servers is not None:
            return self.api_servers
        return 2 if self.uses_engine_process else 0

    @property
    def uses_engine_process(self) -> bool:
        return self.engine_process if self.engine_process is not None else self.engine.device == "cuda"

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        path = Path(self.engine.model_dir).resolve()
        return BUNDLED_MODEL_NAME if path == Path(MODEL_DIR).resolve() else path.name

    def to_dict(self) -> dict:
        """Plain nested values (what travels inside the Serve config)."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(values: dict) -> WorkerConfig:
        return from_flat(WorkerConfig, _flatten(values))
