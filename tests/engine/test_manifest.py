"""The model contract: a good export reads into a validated manifest; bad ones fail at load, clearly."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest

from mtpserve.engine.manifest import (
    ModelLoadError,
    TensorSpec,
    flash_block_multiple,
    flash_block_size_to_try,
    load_manifest,
    with_block_size,
)


def copy_export(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_paged_export_reads_into_state_groups_and_mtp_head(tiny_paged_export):
    m = load_manifest(tiny_paged_export)
    assert m.block_size == 16 and m.capture_capacity == 4
    assert [l.layer_id for l in m.kv_layers] == [1, 3]
    assert [l.layer_id for l in m.recurrent_layers] == [l.layer_id for l in m.conv_layers] == [0, 2]
    rec = m.recurrent_layers[0]
    assert (rec.num_value_heads, rec.value_head_size, rec.key_head_size, rec.num_key_heads) == (4, 16, 16, 2)
    assert m.conv_layers[0].kernel_size == 4 and m.conv_layers[0].dtype == "float16"
    # the config lists an attention_mask for the head that the paged graph does not have
    assert m.mtp is not None and "attention_mask" not in {t.name for t in m.mtp.inputs}
    assert m.mtp.hidden_input == "hidden_states" and m.mtp.hidden_output == "hidden_states_out"
    assert m.num_parameters > 0


def test_the_block_size_is_the_engines_where_the_graphs_leave_it_symbolic(tiny_paged_export):
    """The builder's graphs read the KV block size from the pools' shape: a manifest serves any
    block size; one whose graphs fix it serves only that, and says so."""
    m = load_manifest(tiny_paged_export)
    assert m.block_size == 16 and with_block_size(m, None) is m and with_block_size(m, 16) is m
    assert with_block_size(m, 64).block_size == 64
    kv = {n for l in m.kv_layers for n in (l.key_input, l.value_input)}
    fixed = replace(m, inputs=tuple(TensorSpec(t.name, (t.shape[0], 16, *t.shape[2:]), t.dtype) if t.name in kv else t
                                    for t in m.inputs))
    assert with_block_size(fixed, 16) is fixed
    with pytest.raises(ModelLoadError, match="fix the KV block size at \\[16\\]"):
        with_block_size(fixed, 64)
    # the flash size suggested (serve's log, mtpserve info, a capture's out-of-memory advice): only
    # where the served size is not one already and the graphs take it
    assert flash_block_size_to_try(m) == 256 and flash_block_size_to_try(with_block_size(m, 256)) is None
    assert flash_block_size_to_try(fixed) is None
    with pytest.raises(ValueError, match=">= 1"):
        with_block_size(m, 0)


def test_the_flash_block_multiple_follows_the_largest_attention_head(tiny_paged_export):
    """ORT's flash PagedAttention block minimum: 256 / 128 / 64 tokens for head sizes up to 64 /
    128 / 256 (the head's layer counts too), none past 256."""
    m = load_manifest(tiny_paged_export)
    assert {l.head_size for l in m.kv_layers} == {32} and flash_block_multiple(m) == 256

    def heads(size, head=None):
        layers = tuple(replace(l, head_size=size) for l in m.kv_layers)
        mtp = replace(m.mtp, kv_layers=tuple(replace(l, head_size=head or size) for l in m.mtp.kv_layers))
        return replace(m, kv_layers=layers, mtp=mtp)
    assert [flash_block_multiple(heads(s)) for s in (64, 65, 128, 256, 512)] == [256, 128, 128, 64, None]
    assert flash_block_multiple(heads(64, head=128)) == 128


def test_truncated_weights_fail_at_load_naming_the_file(tiny_paged_export, tmp_path):
    model = copy_export(tiny_paged_export, tmp_path)
    data = model / "model.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.onnx\.data is truncated"):
        load_manifest(model)


def test_truncated_graph_fails_at_load(tiny_paged_export, tmp_path):
    model = copy_export(tiny_paged_export, tmp_path)
    graph = model / "model.onnx"
    graph.write_bytes(graph.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=r"model\.onnx is truncated"):
        load_manifest(model)


def test_missing_config_and_missing_dir_fail_clearly(tiny_paged_export, tmp_path):
    model = copy_export(tiny_paged_export, tmp_path)
    (model / "genai_config.json").unlink()
    with pytest.raises(ModelLoadError, match="genai_config.json is missing"):
        load_manifest(model)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_manifest(tmp_path / "nowhere")


def test_export_without_state_capture_is_refused(tiny_paged_export, tmp_path):
    model = copy_export(tiny_paged_export, tmp_path)
    cfg = json.loads((model / "genai_config.json").read_text())
    cfg["model"]["decoder"]["state_update_capacity"] = 0
    (model / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="state_update_capacity=4"):
        load_manifest(model)


def test_non_paged_export_is_refused(tiny_checkpoint, tmp_path):
    """The builder's ordinary CPU export (no paged attention) is a real model mtpserve cannot serve."""
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "cpu_fp32"
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(tiny_checkpoint),
                    "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(tmp_path / "cache")],
                   check=True, capture_output=True)
    with pytest.raises(ModelLoadError, match="not a paged export"):
        load_manifest(out)


def test_a_bf16_export_is_refused_at_load_with_the_fix(tiny_paged_export, tmp_path):
    import onnx
    model = copy_export(tiny_paged_export, tmp_path)
    graph = onnx.load(model / "model.onnx", load_external_data=False)
    logits = next(o for o in graph.graph.output if o.name == "logits")
    logits.type.tensor_type.elem_type = onnx.TensorProto.BFLOAT16
    onnx.save(graph, model / "model.onnx")
    with pytest.raises(ModelLoadError, match=r"'logits' is bfloat16.*-p fp16"):
        load_manifest(model)
