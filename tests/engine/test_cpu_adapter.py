"""The CPU adapter end to end: the tiny paged fp16 export, adapted, against PyTorch (fp32).

The checkpoint's weights are fp16-exact (tiny_checkpoint.py), so the only differences left are
fp32 rounding and transformers' own l2norm epsilon.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import onnx
import pytest

from mtpserve.engine.cpu_adapter import INFO_FILE, CpuAdapterError, adapt_for_cpu, export_key

from tiny_checkpoint import BLOCK_SIZE

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TOL = 1e-3         # measured: ~4e-6 (main model), ~1e-6 (MTP head)
NUM_BLOCKS = 10


# ------------------------------------------------------------------ feeds for the paged model
@dataclass
class Req:
    """One request's part of a step: its new tokens, tokens already in its KV, its pages."""
    tokens: list[int]
    past_len: int
    blocks: list[int]


def paged_inputs(reqs: list[Req]) -> dict[str, np.ndarray]:
    """Pack requests into the paged graphs' step inputs.

    input_ids    | a0 a1 a2 | b0 |          cumulative_sequence_lengths [0, 3, 4]
    position_ids   past_a+0.. past_a+2, past_b+0 (the same row 3 times, M-RoPE text positions)
    block_table  [B, max_blocks]: each request's pages, padded with the scratch block 0
    """
    max_blocks = max(len(r.blocks) for r in reqs)
    positions = np.concatenate([np.arange(r.past_len, r.past_len + len(r.tokens)) for r in reqs])
    lens = [len(r.tokens) for r in reqs]
    return {
        "input_ids": np.concatenate([np.asarray(r.tokens, np.int64) for r in reqs]),
        "position_ids": np.broadcast_to(positions.astype(np.int64), (3, len(positions))).copy(),
        "cumulative_sequence_lengths": np.cumsum([0] + lens).astype(np.int32),
        "past_sequence_lengths": np.array([r.past_len for r in reqs], np.int32),
        "block_table": np.array([r.blocks + [0] * (max_blocks - len(r.blocks)) for r in reqs], np.int32),
        "attention_metadata": np.array([max(lens), max(r.past_len + len(r.tokens) for r in reqs),
                                        min(r.past_len + len(r.tokens) for r in reqs)], np.int32),
    }


class PagedRunner:
    """An adapted graph whose KV pools are bound in place (same OrtValue as past_* input and present_* output)."""

    def __init__(self, path, num_blocks=NUM_BLOCKS):
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.log_severity_level = 2, 3
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.pools, self._pool_values = {}, {}
        for i in self.session.get_inputs():
            if i.name.startswith("past_key_values."):
                _, _, heads, dim = i.shape
                self.pools[i.name] = np.zeros((num_blocks, BLOCK_SIZE, heads, dim), np.float32)
                self._pool_values[i.name] = ort.OrtValue.ortvalue_from_numpy(self.pools[i.name])
        self.state_inputs = [i for i in self.session.get_inputs() if i.name.startswith("past.")]

    def zero_states(self, batch):
        return {i.name: np.zeros([batch, *i.shape[1:]], np.float32) for i in self.state_inputs}

    def run(self, feeds: dict) -> dict[str, np.ndarray]:
        io = self.session.io_binding()
        for name, value in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(value))
        pool_outputs = {}
        for name, value in self._pool_values.items():
            io.bind_ortvalue_input(name, value)
            pool_outputs[name.replace("past_key_values.", "present.")] = value
        names = [o.name for o in self.session.get_outputs()]
        for name in names:
            if name in pool_outputs:
                io.bind_ortvalue_output(name, pool_outputs[name])
            else:
                io.bind_output(name)
        self.session.run_with_iobinding(io)
        return {name: value.numpy() for name, value in zip(names, io.get_outputs()) if name not in pool_outputs}


def main_step(runner, reqs, states):
    feeds = paged_inputs(reqs) | states
    feeds["state_update_capture_count"] = np.zeros(len(reqs), np.int32)
    feeds["state_update_active"] = np.zeros(1, np.int32)
    out = runner.run(feeds)
    carried = {k.replace("present.", "past."): v for k, v in out.items() if k.endswith((".conv", ".recurrent"))}
    return out, carried


# ------------------------------------------------------------------ PyTorch references
@pytest.fixture(scope="module")
def torch_model(tiny_checkpoint):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def torch_forward(model, tokens):
    """(logits [n, V], post-norm last hidden state [n, H]) of a full, uncached forward."""
    with torch.no_grad():
        ids = torch.tensor([tokens])
        hidden = model.model.language_model(input_ids=ids, use_cache=False).last_hidden_state
        return model.lm_head(hidden)[0].numpy(), hidden[0].numpy()


@pytest.fixture(scope="module")
def torch_mtp(tiny_checkpoint, torch_model):
    """mtp(ids, hidden) -> (logits, hidden_out): the Qwen3.5 MTP head, rows at positions 0..n-1."""
    from safetensors.torch import load_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    weights = load_file(tiny_checkpoint / "model.safetensors")
    config = copy.deepcopy(torch_model.config.text_config)
    config.num_hidden_layers, config.layer_types, config._attn_implementation = 1, ["full_attention"], "eager"
    layer = Qwen3_5DecoderLayer(config, 0).eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in weights.items() if k.startswith("mtp.layers.0.")})
    lm = torch_model.model.language_model

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * (1.0 + w)

    def mtp(ids, hidden):
        with torch.no_grad():
            ids, hidden = torch.tensor([ids]), torch.tensor(hidden)[None]
            x = torch.cat([rms(lm.embed_tokens(ids), weights["mtp.pre_fc_norm_embedding.weight"]),
                           rms(hidden, weights["mtp.pre_fc_norm_hidden.weight"])], -1) @ weights["mtp.fc.weight"].T
            n = ids.shape[1]
            rope = lm.rotary_emb(x, torch.arange(n).view(1, 1, -1).expand(3, 1, -1))
            x = layer(x, position_embeddings=rope, attention_mask=torch.full((n, n), float("-inf")).triu(1)[None, None])
            x = rms(x, weights["mtp.norm.weight"])
            return (x @ weights["lm_head.weight"].T)[0].numpy(), x[0].numpy()

    return mtp


def assert_close(ours, ref, what):
    err = float(np.abs(ours - ref).max())
    print(f"{what}: max abs err {err:.2e}")
    assert err <= TOL, f"{what}: max abs err {err}"
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1), err_msg=what)


# ------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def adapted(tiny_paged_export, tmp_path_factory):
    return adapt_for_cpu(tiny_paged_export, tmp_path_factory.mktemp("cache"))


RNG = np.random.default_rng(7)
PROMPT_A = RNG.integers(12, 300, 29).tolist()   # 29 tokens: pages 0-1, the verify below crosses into page 2
PROMPT_B = RNG.integers(12, 300, 14).tolist()
DECODE_A, DECODE_B = [101, 57], [33, 250]
VERIFY_A, VERIFY_B = [7, 199, 64], [120]
PAGES_A, PAGES_B = [6, 2, 8], [5, 1]            # interleaved, non-contiguous; 0 is the scratch block


@pytest.mark.parametrize("query_chunk", [64, 4])
def test_main_model_matches_torch(tiny_paged_export, torch_model, tmp_path, query_chunk):
    runner = PagedRunner(adapt_for_cpu(tiny_paged_export, tmp_path, query_chunk=query_chunk) / "model.onnx")
    ref_a, hid_a = torch_forward(torch_model, PROMPT_A + DECODE_A + VERIFY_A)
    ref_b, hid_b = torch_forward(torch_model, PROMPT_B + DECODE_B + VERIFY_B)
    na, nb = len(PROMPT_A), len(PROMPT_B)

    out, states = main_step(runner, [Req(PROMPT_A, 0, PAGES_A), Req(PROMPT_B, 0, PAGES_B)], runner.zero_states(2))
    assert_close(out["logits"], np.concatenate([ref_a[:na], ref_b[:nb]]), "packed prefill logits")
    assert_close(out["hidden_states"], np.concatenate([hid_a[:na], hid_b[:nb]]), "packed prefill hidden")
    for step in range(2):
        reqs = [Req([DECODE_A[step]], na + step, PAGES_A), Req([DECODE_B[step]], nb + step, PAGES_B)]
        out, states = main_step(runner, reqs, states)
        assert_close(out["logits"], np.stack([ref_a[na + step], ref_b[nb + step]]), f"decode {step} logits")
    out, states = main_step(runner, [Req(VERIFY_A, na + 2, PAGES_A), Req(VERIFY_B, nb + 2, PAGES_B)], states)
    assert_close(out["logits"], np.concatenate([ref_a[na + 2:], ref_b[nb + 2:]]), "verify 3+1 logits")
    untouched = [b for b in range(NUM_BLOCKS) if b not in PAGES_A + PAGES_B]
    for pool in runner.pools.values():
        assert not pool[untouched].any(), "a write landed outside the requests' pages"


def test_pool_written_in_place(adapted):
    runner = PagedRunner(adapted / "model.onnx")
    before = {name: pool.__array_interface__["data"][0] for name, pool in runner.pools.items()}
    main_step(runner, [Req(PROMPT_A[:18], 0, [7, 3]), Req(PROMPT_B[:2], 0, [4])], runner.zero_states(2))
    for name, pool in runner.pools.items():
        assert pool.__array_interface__["data"][0] == before[name]
        written = np.abs(pool).sum(axis=(2, 3)) > 0          # [num_blocks, block_size]
        expected = np.zeros_like(written)
        expected[7, :], expected[3, :2], expected[4, :2] = True, True, True
        np.testing.assert_array_equal(written, expected, err_msg=f"{name}: slots written in the user's buffer")


def test_mtp_head_matches_torch(adapted, torch_model, torch_mtp):
    runner = PagedRunner(adapted / "mtp.onnx")
    seq_a, seq_b = PROMPT_A + DECODE_A[:1], PROMPT_B + DECODE_B[:1]
    _, hid_a = torch_forward(torch_model, seq_a)
    _, hid_b = torch_forward(torch_model, seq_b)
    na, nb = len(PROMPT_A), len(PROMPT_B)
    # row j: the token at j+1 with the main model's hidden state at j, position j
    rows_a, rows_b = seq_a[1:], seq_b[1:]
    pages_a, pages_b = [3, 9], [4]
    feeds = paged_inputs([Req(rows_a, 0, pages_a), Req(rows_b, 0, pages_b)])
    feeds["hidden_states"] = np.concatenate([hid_a[:na], hid_b[:nb]])
    out = runner.run(feeds)
    ref_a, ref_hid_a = torch_mtp(rows_a, hid_a[:na])
    ref_b, ref_hid_b = torch_mtp(rows_b, hid_b[:nb])
    assert_close(out["logits"], np.concatenate([ref_a, ref_b]), "mtp prefill logits")
    assert_close(out["hidden_states_out"], np.concatenate([ref_hid_a, ref_hid_b]), "mtp prefill hidden_states_out")

    # chained draft: the next row takes the draft as its token and the head's own hidden_states_out
    draft_a, draft_b = int(out["logits"][na - 1].argmax()), int(out["logits"][-1].argmax())
    feeds = paged_inputs([Req([draft_a], na, pages_a), Req([draft_b], nb, pages_b)])
    feeds["hidden_states"] = out["hidden_states_out"][[na - 1, na + nb - 1]]
    out = runner.run(feeds)
    chain_a, _ = torch_mtp(rows_a + [draft_a], np.concatenate([hid_a[:na], ref_hid_a[-1:]]))
    chain_b, _ = torch_mtp(rows_b + [draft_b], np.concatenate([hid_b[:nb], ref_hid_b[-1:]]))
    assert_close(out["logits"], np.stack([chain_a[-1], chain_b[-1]]), "mtp chained draft logits")


def test_adapted_graphs_are_fp32_and_keep_the_io_names(tiny_paged_export, adapted):
    for name in ("model.onnx", "mtp.onnx"):
        src = onnx.load(str(tiny_paged_export / name), load_external_data=False)
        dst = onnx.load(str(adapted / name), load_external_data=False)
        assert [i.name for i in dst.graph.input] == [i.name for i in src.graph.input]
        assert [o.name for o in dst.graph.output] == [o.name for o in src.graph.output]
        types = [v.type.tensor_type.elem_type for v in (*dst.graph.input, *dst.graph.output, *dst.graph.value_info)]
        assert onnx.TensorProto.FLOAT16 not in types + [t.data_type for t in dst.graph.initializer]
        assert not any(n.op_type == "PagedAttention" for n in dst.graph.node)
    mtp = onnx.load(str(adapted / "mtp.onnx"), load_external_data=False)
    locations = {e.value for t in mtp.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"model.onnx.data", "mtp.onnx.data"}, "the MTP head shares the embedding and LM head"
    assert (adapted / "tokenizer.json").read_bytes() == (tiny_paged_export / "tokenizer.json").read_bytes()
    src_config = json.loads((tiny_paged_export / "genai_config.json").read_text())
    config = json.loads((adapted / "genai_config.json").read_text())
    for old, new in zip(src_config["model"]["mtp"]["shared_initializers"], config["model"]["mtp"]["shared_initializers"]):
        count = int(np.prod(old["shape"]))
        before = np.fromfile(tiny_paged_export / old["data_file"], np.float16, count, offset=int(old["offset"]))
        after = np.fromfile(adapted / new["data_file"], np.float32, count, offset=int(new["offset"]))
        assert new["data_type"] == onnx.TensorProto.FLOAT and int(new["length"]) == 4 * count
        np.testing.assert_array_equal(after, before.astype(np.float32), err_msg=old["name"])


def test_cache_reuses_the_folder_and_rekeys_on_change(tiny_paged_export, tmp_path):
    cache = tmp_path / "cache"
    first = adapt_for_cpu(tiny_paged_export, cache)
    info = (first / INFO_FILE).read_text()
    started = time.perf_counter()
    again = adapt_for_cpu(tiny_paged_export, cache)
    assert again == first and time.perf_counter() - started < 0.5
    assert (first / INFO_FILE).read_text() == info, "the second call must not rebuild"

    export = shutil.copytree(tiny_paged_export, tmp_path / "export")
    assert adapt_for_cpu(export, cache).name == first.name, "same bytes elsewhere -> same key"
    os.utime(export / "model.onnx.data", ns=(0, 0))
    assert adapt_for_cpu(export, cache).name == first.name, "a new mtime alone does not change the key"
    data = bytearray((export / "model.onnx.data").read_bytes())
    data[100] ^= 0x01
    (export / "model.onnx.data").write_bytes(bytes(data))
    changed = adapt_for_cpu(export, cache)
    assert changed != first and changed.is_dir()
    assert export_key(export, cache) == changed.name


def test_concurrent_adapters_share_one_complete_folder(tiny_paged_export, tmp_path):
    with ThreadPoolExecutor(4) as pool:
        folders = list(pool.map(lambda _: adapt_for_cpu(tiny_paged_export, tmp_path), range(4)))
    assert len(set(folders)) == 1
    assert sorted(p.name for p in (tmp_path / "cpu").iterdir()) == [folders[0].name], "no temp folder left behind"
    PagedRunner(folders[0] / "model.onnx")


def test_unsupported_paged_attention_is_refused(tiny_paged_export, tmp_path):
    export = shutil.copytree(tiny_paged_export, tmp_path / "export")
    model = onnx.load(str(export / "mtp.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "PagedAttention")
    next(a for a in node.attribute if a.name == "local_window_size").i = 8
    (export / "mtp.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(CpuAdapterError, match="local_window_size=8"):
        adapt_for_cpu(export, tmp_path / "cache")
    assert not any((tmp_path / "cache" / "cpu").iterdir()), "a failed build leaves nothing in the cache"
