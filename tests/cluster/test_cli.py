"""The `mtpserve` command line as a user runs it, on the bundled model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def mtpserve(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", *args],
                          capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_info_json_reports_the_bundled_hybrid_model():
    info = json.loads(mtpserve("info", "--json").stdout)
    groups = {g["kind"]: g for g in info["state_groups"]}
    assert set(groups) == {"paged_kv", "fixed_conv", "fixed_recurrent"}
    assert groups["fixed_recurrent"]["layer_ids"] == groups["fixed_conv"]["layer_ids"]
    # the real Qwen3.5 pattern: three Gated DeltaNet layers for each full-attention layer
    assert info["layers_by_kind"]["linear_attention"] == 3 * info["layers_by_kind"]["full_attention"]
    assert info["mtp"] is not None and "hidden_states" in info["mtp"]["inputs"]
    assert info["capture_capacity"] >= 4
    assert info["total_bytes"] <= 20 * 10**6, "the bundled export must stay within 20 MB"
    assert info["num_parameters"] > 1_000_000


def test_info_names_the_problem_for_a_bad_model_dir(tmp_path):
    proc = mtpserve("info", "--model", str(tmp_path), check=False)
    assert proc.returncode == 2
    assert "genai_config.json is missing" in proc.stderr and "Traceback" not in proc.stderr


def test_generate_json_runs_prompts_concurrently_with_mtp(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\\nimport sys\\n\ndef main():\\n    \nclass Config:\n")
    proc = mtpserve("generate", "--prompts-file", str(prompts), "--max-tokens", "24",
                    "--draft-tokens", "3", "--json")
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == 3
    for r in results:
        assert len(r["token_ids"]) == 24 and r["finish_reason"] == "length" and r["text"]
        s = r["stats"]
        assert s["draft_tokens"] > 0 and 0 <= s["acceptance_rate"] <= 1
        assert s["tokens_per_target_forward"] == pytest.approx(24 / s["target_forwards"], abs=1e-3)
    off = [json.loads(line) for line in mtpserve("generate", "--prompts-file", str(prompts), "--max-tokens",
                                                  "24", "--draft-tokens", "0", "--json").stdout.splitlines()]
    assert [r["token_ids"] for r in off] == [r["token_ids"] for r in results]


def test_generate_refuses_bad_parameters_cleanly():
    proc = mtpserve("generate", "--prompt", "x", "--temperature", "-1", check=False)
    assert proc.returncode == 2 and "temperature" in proc.stderr and "Traceback" not in proc.stderr


def test_export_turns_a_checkpoint_into_a_servable_model(tiny_checkpoint, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "exported"
    proc = mtpserve("export", "--checkpoint", str(tiny_checkpoint), "--out", str(out))
    assert "MTP head: yes" in proc.stdout
    info = json.loads(mtpserve("info", "--model", str(out), "--json").stdout)
    assert info["block_size"] == 16 and info["capture_capacity"] == 4 and info["mtp"] is not None
    generated = json.loads(mtpserve("generate", "--model", str(out), "--prompt", "hello", "--max-tokens", "4",
                                    "--json").stdout)
    assert len(generated["token_ids"]) == 4


def test_export_refuses_what_is_not_a_qwen35_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    proc = mtpserve("export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2 and "Qwen3.5" in proc.stderr


def test_on_off_settings_take_a_value_a_bare_flag_or_a_no_flag():
    """`--cuda-graphs off` (the documented way to debug the eager path), `--cuda-graphs`, and
    `--no-cuda-graphs` all reach the engine config; a word that is neither is refused."""
    import argparse

    from mtpserve.cluster.flags import add_setting_flags, given_settings
    from mtpserve.engine.config import EngineConfig, config_fields, from_flat
    fields = config_fields(EngineConfig)
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, fields, ["cuda_graphs", "warm_up"])

    def parsed(*argv):
        return from_flat(EngineConfig, given_settings(parser.parse_args(list(argv)), fields))

    assert parsed().cuda_graphs is True
    assert parsed("--cuda-graphs", "off").cuda_graphs is False
    assert parsed("--cuda-graphs", "ON").cuda_graphs is True
    assert parsed("--no-cuda-graphs").cuda_graphs is False
    assert parsed("--cuda-graphs", "--warm-up", "no").cuda_graphs is True
    assert parsed("--cuda-graphs", "--warm-up", "no").warm_up is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graphs", "maybe"])


def test_serve_refuses_a_truncated_model_in_one_line_before_starting_ray(tmp_path):
    import shutil

    from mtpserve.engine.bundled import MODEL_DIR
    model = tmp_path / "truncated"
    shutil.copytree(MODEL_DIR, model)
    data = model / "model.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    proc = mtpserve("serve", "--model", str(model), "--port", "0", check=False)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mtpserve: error:") and "model.onnx.data" in lines[0], proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("flags, error", [
    (("--max-model-len", "999999"), "max_model_len 999999 exceeds the model's context 2048"),
    (("--snapshot-interval", "17"), "snapshot_interval must be a positive multiple of the block size 16, got 17"),
    (("--prefix-snapshot-gib", "1e-7"), "prefix_snapshot_gib 1e-07 holds no state snapshot"),
    (("--draft-tokens", "6"), "draft_tokens 6: this export captures 4 state transitions a step, so a step "
                              "verifies at most 4 drafts"),     # (it ran at 4, every verify eager on CUDA)
])
def test_serve_refuses_settings_the_model_does_not_take_in_one_line_before_starting_ray(flags, error):
    """Settings only a model can judge (its context, block size, state size) are checked against
    it before Ray starts, not by each replica's engine three times over."""
    proc = mtpserve("serve", "--port", "0", *flags, check=False)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"mtpserve: error: {error}"), proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr


def test_the_printed_url_names_a_host_a_client_can_reach():
    """`mtpserve serve --host 0.0.0.0` (a cluster's proxies) prints an address to connect to, not the wildcard."""
    from mtpserve.cluster.deploy import client_url
    assert client_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert client_url("::1", 8001) == "http://[::1]:8001"
    for wildcard in ("0.0.0.0", "::"):
        url = client_url(wildcard, 8000)
        assert url.endswith(":8000") and wildcard not in url.removeprefix("http://").rsplit(":", 1)[0], url
