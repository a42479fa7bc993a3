"""manifests/: every file is a valid Serve config; the CPU one deploys with `serve run` and answers."""
from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
requests = pytest.importorskip("requests")

from ray.serve.schema import ServeDeploySchema  # noqa: E402

from mtpserve.cluster.app import ROUTES_THREAD_ENV, ServeOptions, build_app, setting_names  # noqa: E402
from mtpserve.cluster.local_cluster import REPLICA_RESOURCE  # noqa: E402
from mtpserve.engine.bundled import BUNDLED_MODEL_REF, MODEL_DIR, resolve_model_dir  # noqa: E402

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"


def _serve_configs() -> dict[str, dict]:
    configs = {p.name: yaml.safe_load(p.read_text()) for p in sorted(MANIFESTS.glob("serve-*.yaml"))}
    rayservice = yaml.safe_load((MANIFESTS / "rayservice.yaml").read_text())
    assert rayservice["kind"] == "RayService"
    configs["rayservice.yaml"] = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    return configs


def test_every_manifest_is_a_valid_serve_config_of_this_package():
    configs = _serve_configs()
    assert {"serve-cpu.yaml", "serve-gpu.yaml", "serve-nodes.yaml", "rayservice.yaml"} <= set(configs)
    fields = set(setting_names())
    for name, config in configs.items():
        schema = ServeDeploySchema.model_validate(config)
        for app in schema.applications:
            module, attr = app.import_path.split(":")
            assert callable(getattr(importlib.import_module(module), attr)), name
            assert set(app.args) <= fields, f"{name}: unknown args {set(app.args) - fields}"
    gpu = configs["serve-gpu.yaml"]["applications"][0]["args"]
    assert gpu["device"] == "cuda" and gpu["num_gpus_per_replica"] == 1
    nodes = configs["serve-nodes.yaml"]["applications"][0]["args"]
    assert nodes["replica_resource"] == REPLICA_RESOURCE     # what `mtpserve bench --nodes` gives each worker node


def test_a_replica_resource_pins_each_replica_and_the_bundled_model_travels_by_reference():
    """On a cluster a replica takes one unit of the node resource, and reads the bundled model from
    its own node's install (the deploying machine's path may not exist there)."""
    app = build_app(ServeOptions.from_flat(replica_resource=REPLICA_RESOURCE, num_replicas=2))
    deployment = app._bound_deployment
    assert deployment.ray_actor_options["resources"] == {REPLICA_RESOURCE: 1}
    assert deployment.init_args[0]["engine"]["model_dir"] == BUNDLED_MODEL_REF
    assert resolve_model_dir(BUNDLED_MODEL_REF) == str(MODEL_DIR)
    plain = build_app(ServeOptions.from_flat(num_replicas=1))._bound_deployment
    assert "resources" not in plain.ray_actor_options


def test_replicas_run_their_routes_on_serves_loop_unless_told_not_to():
    """By default each replica process starts with Serve's switch that runs the HTTP routes on its
    own event loop (no thread hop per streamed chunk); off leaves Serve's default thread."""
    on = build_app(ServeOptions.from_flat(num_replicas=1))._bound_deployment
    assert on.ray_actor_options["runtime_env"]["env_vars"] == {ROUTES_THREAD_ENV: "0"}
    off = build_app(ServeOptions.from_flat(num_replicas=1, routes_on_serve_loop=False))._bound_deployment
    assert "runtime_env" not in off.ray_actor_options


def test_session_handover_flags_reach_the_worker_and_serves_stop_deadline():
    """`mtpserve serve --session-handover-gib/-timeout-s` reach each replica's config; Serve's
    force-kill deadline stays the grace (how long a stop lets streams run), hand-over on or off."""
    import argparse

    from mtpserve.cluster.serve import add_serve_parser, options_from_args
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--session-handover-gib", "0.5", "--session-handover-timeout-s", "3",
                              "--shutdown-grace-s", "2"])
    options = options_from_args(args)
    assert (options.worker.session_handover_gib, options.worker.session_handover_timeout_s) == (0.5, 3.0)
    deployment = build_app(options)._bound_deployment
    assert deployment._deployment_config.graceful_shutdown_timeout_s == 2.0
    assert deployment.init_args[0]["session_handover_gib"] == 0.5
    off = build_app(ServeOptions.from_flat(session_handover_gib=0, shutdown_grace_s=2))._bound_deployment
    assert off._deployment_config.graceful_shutdown_timeout_s == 2.0
    for bad in ({"session_handover_gib": -1}, {"session_handover_timeout_s": 0}):
        with pytest.raises(ValueError, match="session_handover"):
            ServeOptions.from_flat(**bad).validate()


def test_the_cpu_config_deploys_with_serve_run_and_answers(ray_cluster, model_dir, tmp_path):
    from ray import serve

    from mtpserve.actors.planner import shutdown_planner
    config = yaml.safe_load((MANIFESTS / "serve-cpu.yaml").read_text())
    app = config["applications"][0]
    if Path(model_dir).resolve() != Path(MODEL_DIR).resolve():        # the bundled model is not built
        app["args"]["model_dir"] = str(model_dir)
    app["args"]["num_cpus_per_replica"] = 0.5
    path = tmp_path / "serve-cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "ray.serve.scripts", "run", "--non-blocking",
                           "--address", ray_cluster["address"], str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        url = f"{ray_cluster['url']}{app['route_prefix'].rstrip('/')}/v1"
        deadline = time.monotonic() + 120
        while True:
            try:
                models = requests.get(f"{url}/models", timeout=10)
                if models.status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):     # still starting (a loaded machine)
                pass
            assert time.monotonic() < deadline, "the app never answered"
            time.sleep(0.5)
        model = models.json()["data"][0]["id"]
        r = requests.post(f"{url}/completions", json={"model": model, "prompt": "print(", "max_tokens": 5,
                                                       "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        serve.delete(app["name"])
        shutdown_planner(app["name"])
