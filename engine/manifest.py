"""The model contract: an onnxruntime-genai paged export, read and validated once at load.

`load_manifest(dir)` reads `genai_config.json` and the graphs' own inputs and outputs (never the
weights) into a frozen `ModelManifest`. Everything the engine needs to size pools, pack steps and
bind state comes from here. A model that is not a paged export, lacks the state-capture outputs,
or is malformed raises `ModelLoadError` naming the problem, so nothing fails later inside a step.

Names in the config are templates (`past.%d.conv`); the graph is the authority: every name the
manifest hands out was checked to exist in the session's real inputs/outputs (the config's
`mtp.inputs` lists an `attention_mask` that the paged `mtp.onnx` does not have, for instance).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx

CONFIG_FILE = "genai_config.json"
TOKENIZER_FILE = "tokenizer.json"

# ONNX element type -> numpy dtype name
_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
           onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.INT64: "int64",
           onnx.TensorProto.INT32: "int32"}
_PAGED_INPUTS = ("block_table", "cumulative_sequence_lengths", "past_sequence_lengths")


class ModelLoadError(ValueError):
    """The model directory is not a servable paged export; the message names the problem."""


@dataclass(frozen=True)
class TensorSpec:
    """A graph input/output: name, shape (ints, or str for symbolic dims) and numpy dtype name."""
    name: str
    shape: tuple
    dtype: str


@dataclass(frozen=True)
class PagedKVLayer:
    """One full-attention layer's paged cache: pool shape [num_blocks, block_size, kv_heads, head_size]."""
    layer_id: int
    key_input: str
    value_input: str
    key_output: str
    value_output: str
    num_kv_heads: int
    head_size: int
    dtype: str


@dataclass(frozen=True)
class ConvLayer:
    """A linear-attention layer's conv carry: row shape [conv_dim, kernel_size - 1]."""
    layer_id: int
    state_input: str
    state_output: str
    capture_output: str          # state_update.L.conv_value [B, C, conv_dim]
    conv_dim: int
    kernel_size: int
    dtype: str


@dataclass(frozen=True)
class RecurrentLayer:
    """A Gated DeltaNet layer's state: row shape [Hv, Dv, Dk] (V-major), float32.

    Capture capsule row, C = capacity:  [decay C*Hv | key C*Hk*Dk | delta C*Hv*Dv]
    """
    layer_id: int
    state_input: str
    state_output: str
    capture_output: str          # state_update.L.recurrent_capsule [B, C*(Hv + Hk*Dk + Hv*Dv)]
    num_value_heads: int
    value_head_size: int
    key_head_size: int
    num_key_heads: int
    dtype: str

    @property
    def capsule_width_per_token(self) -> int:
        return self.num_value_heads + self.num_key_heads * self.key_head_size \
            + self.num_value_heads * self.value_head_size


@dataclass(frozen=True)
class MtpHead:
    """The MTP head graph (mtp.onnx): one full-attention layer with its own paged KV pool."""
    filename: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    kv_layers: tuple[PagedKVLayer, ...]
    hidden_input: str            # main model hidden states in
    hidden_output: str           # the head's own hidden states out (feeds the next chained row)
    logits_output: str


@dataclass(frozen=True)
class ModelManifest:
    """Everything the engine needs to know about a paged export, validated."""
    path: Path
    model_type: str
    vocab_size: int
    hidden_size: int
    context_length: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    num_hidden_layers: int
    num_attention_heads: int
    block_size: int
    capture_capacity: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    kv_layers: tuple[PagedKVLayer, ...]
    conv_layers: tuple[ConvLayer, ...]
    recurrent_layers: tuple[RecurrentLayer, ...]
    mtp: MtpHead | None
    logits_output: str
    hidden_output: str
    compute_dtype: str           # dtype of logits / hidden states in the export (float16 for the paged build)
    num_parameters: int
    files: dict = field(default_factory=dict)   # file name -> size in bytes

    def to_dict(self) -> dict:
        """A JSON-ready summary (what `mtpserve info --json` prints)."""
        def layer_ids(layers):
            return [l.layer_id for l in layers]
        groups = [
            {"kind": "paged_kv", "layer_ids": layer_ids(self.kv_layers),
             "num_kv_heads": self.kv_layers[0].num_kv_heads if self.kv_layers else 0,
             "head_size": self.kv_layers[0].head_size if self.kv_layers else 0,
             "dtype": self.kv_layers[0].dtype if self.kv_layers else None,
             "block_size": self.block_size},
            {"kind": "fixed_conv", "layer_ids": layer_ids(self.conv_layers),
             "row_shape": [self.conv_layers[0].conv_dim, self.conv_layers[0].kernel_size - 1]
             if self.conv_layers else [], "dtype": self.conv_layers[0].dtype if self.conv_layers else None,
             "capture_capacity": self.capture_capacity},
            {"kind": "fixed_recurrent", "layer_ids": layer_ids(self.recurrent_layers),
             "row_shape": [self.recurrent_layers[0].num_value_heads, self.recurrent_layers[0].value_head_size,
                           self.recurrent_layers[0].key_head_size] if self.recurrent_layers else [],
             "num_key_heads": self.recurrent_layers[0].num_key_heads if self.recurrent_layers else 0,
             "dtype": self.recurrent_layers[0].dtype if self.recurrent_layers else None,
             "capture_capacity": self.capture_capacity},
        ]
        return {
            "path": str(self.path),
            "model_type": self.model_type,
            "num_parameters": self.num_parameters,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "context_length": self.context_length,
            "num_hidden_layers": self.num_hidden_layers,
            "layers_by_kind": {"full_attention": len(self.kv_layers),
                               "linear_attention": len(self.recurrent_layers)},
            "num_attention_heads": self.num_attention_heads,
            "eos_token_ids": list(self.eos_token_ids),
            "block_size": self.block_size,
            "capture_capacity": self.capture_capacity,
            "compute_dtype": self.compute_dtype,
            "state_groups": groups,
            "mtp": None if self.mtp is None else {
                "filename": self.mtp.filename,
                "num_layers": len(self.mtp.kv_layers),
                "inputs": [t.name for t in self.mtp.inputs],
                "outputs": [t.name for t in self.mtp.outputs],
            },
            "files": dict(self.files),
            "total_bytes": sum(self.files.values()),
        }


# --------------------------------------------------------------------------- loading

def load_manifest(model_dir: str | os.PathLike) -> ModelManifest:
    """Read and validate an onnxruntime-genai paged export; raise ModelLoadError on any problem."""
    path = Path(model_dir).expanduser().resolve()
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    config = _read_config(path)
    decoder = _require(config, ("model", "decoder"), path)
    model_cfg = config["model"]

    main_file = decoder.get("filename", "model.onnx")
    where = f"{path.name}/{main_file}"
    main_graph = _read_graph(path, main_file)
    inputs = _tensor_specs(main_graph.input)
    outputs = _tensor_specs(main_graph.output)
    _refuse_unservable_dtypes(inputs + outputs, where)
    in_by_name = {t.name: t for t in inputs}
    out_by_name = {t.name: t for t in outputs}

    missing_paged = [n for n in _PAGED_INPUTS if n not in in_by_name]
    if missing_paged:
        raise ModelLoadError(
            f"{where} is not a paged export (no {', '.join(missing_paged)} input); "
            "export it with `mtpserve export` or the builder's "
            "--extra_options use_paged_attention=true state_update_capacity=4")

    names_in, names_out = decoder.get("inputs", {}), decoder.get("outputs", {})
    groups = {g.get("kind"): g for g in decoder.get("state_groups", [])}
    for kind in ("paged_kv", "fixed_conv", "fixed_recurrent"):
        if kind not in groups:
            raise ModelLoadError(f"{path.name}/{CONFIG_FILE}: decoder.state_groups has no '{kind}' group; "
                                 "this is not a hybrid paged export")

    capacity = int(decoder.get("state_update_capacity", 0))
    if capacity < 1:
        raise ModelLoadError(
            f"{path.name}: state_update_capacity is {capacity}; speculative decoding needs the state "
            "capture outputs: re-export with --extra_options state_update_capacity=4")

    kv_layers = tuple(_kv_layer(l, names_in, names_out, in_by_name, out_by_name, where)
                      for l in groups["paged_kv"]["layer_ids"])
    block_sizes = {l_spec.shape[1] for l_spec in (in_by_name[k.key_input] for k in kv_layers)}
    cfg_block = _require(config, ("engine", "dynamic_batching", "block_size"), path)
    if any(isinstance(b, int) and b != cfg_block for b in block_sizes):
        raise ModelLoadError(f"{path.name}: KV pool block size {block_sizes} disagrees with the config's {cfg_block}")

    conv_layers = tuple(_conv_layer(l, names_in, names_out, in_by_name, out_by_name, capacity, where)
                        for l in groups["fixed_conv"]["layer_ids"])
    num_key_heads = int(groups["fixed_recurrent"].get("state_update", {}).get("key_head_count", 0))
    if num_key_heads < 1:
        raise ModelLoadError(f"{path.name}/{CONFIG_FILE}: fixed_recurrent.state_update.key_head_count is missing")
    recurrent_layers = tuple(_recurrent_layer(l, names_in, names_out, in_by_name, out_by_name, capacity,
                                              num_key_heads, where)
                             for l in groups["fixed_recurrent"]["layer_ids"])

    logits_name = names_out.get("logits", "logits")
    hidden_name = names_out.get("hidden_states", "hidden_states")
    for name in (logits_name,):
        if name not in out_by_name:
            raise ModelLoadError(f"{where} has no '{name}' output")
    vocab_size = int(model_cfg.get("vocab_size", 0))
    if out_by_name[logits_name].shape[-1] != vocab_size:
        raise ModelLoadError(f"{path.name}: logits width {out_by_name[logits_name].shape[-1]} "
                             f"!= vocab_size {vocab_size}")

    mtp = None
    mtp_cfg = model_cfg.get("mtp") or {}
    if mtp_cfg.get("enabled"):
        mtp = _mtp_head(path, mtp_cfg, hidden_name, out_by_name)

    if not (path / TOKENIZER_FILE).is_file():
        raise ModelLoadError(f"{path.name} has no {TOKENIZER_FILE}")

    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    eos = model_cfg.get("eos_token_id", [])
    eos = tuple(eos) if isinstance(eos, list) else (eos,)
    return ModelManifest(
        path=path,
        model_type=str(model_cfg.get("type", "unknown")),
        vocab_size=vocab_size,
        hidden_size=int(decoder.get("hidden_size", 0)),
        context_length=int(model_cfg.get("context_length", 0)),
        bos_token_id=model_cfg.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos),
        pad_token_id=model_cfg.get("pad_token_id"),
        num_hidden_layers=int(decoder.get("num_hidden_layers", 0)),
        num_attention_heads=int(decoder.get("num_attention_heads", 0)),
        block_size=int(cfg_block),
        capture_capacity=capacity,
        inputs=inputs,
        outputs=outputs,
        kv_layers=kv_layers,
        conv_layers=conv_layers,
        recurrent_layers=recurrent_layers,
        mtp=mtp,
        logits_output=logits_name,
        hidden_output=hidden_name,
        compute_dtype=out_by_name[logits_name].dtype,
        num_parameters=_count_parameters(main_graph, mtp, path),
        files=files,
    )


def _paged_layers(manifest: ModelManifest) -> tuple[PagedKVLayer, ...]:
    """The main model's paged attention layers and the MTP head's."""
    return manifest.kv_layers + (manifest.mtp.kv_layers if manifest.mtp is not None else ())


def flash_block_multiple(manifest: ModelManifest) -> int | None:
    """The block sizes at which ORT's CUDA PagedAttention reads multi-token steps (prompts, MTP
    verifies, the head's catch-up) in place with its flash kernel: multiples of this many tokens
    (256 / 128 / 64 for head sizes up to 64 / 128 / 256: ``flash_min_block_size`` in ORT's
    paged_attention.cc; sm80+ and fp16), or None where no block size does. At other sizes it
    gathers each request's KV into dense K and V per step (results/h200/README.md, "Nineteenth
    session": what made the 1.4 B model's MTP captures take ~30 GiB)."""
    heads = {l.head_size for l in _paged_layers(manifest)}
    if not heads or max(heads) > 256:
        return None
    size = max(heads)
    return 256 if size <= 64 else 128 if size <= 128 else 64


def flash_block_size_to_try(manifest: ModelManifest) -> int | None:
    """The ``--kv-block-size`` to suggest for ORT's flash kernel: ``flash_block_multiple`` when the
    served block size is not a multiple of it and the export's graphs take it; else None.
    (On the H200 at such a size MTP on parted from off once: results/h200/README.md, session 20.)"""
    flash = flash_block_multiple(manifest)
    if not flash or manifest.block_size % flash == 0:
        return None
    try:
        with_block_size(manifest, flash)
    except ValueError:
        return None
    return flash


def with_block_size(manifest: ModelManifest, block_size: int | None) -> ModelManifest:
    """``manifest`` served with ``block_size``-token KV blocks instead of the export's (None: as
    exported). The builder's paged graphs leave the pools' block dimension symbolic and
    PagedAttention reads it from the pools' shape at run time (the export's config is the only
    place its block size is written), so the engine may choose it, e.g. one its flash kernel
    takes (``flash_block_multiple``). An export whose graphs fix the dimension serves only that."""
    if block_size is None or block_size == manifest.block_size:
        return manifest
    if block_size < 1:
        raise ValueError(f"kv_block_size must be >= 1, got {block_size}")
    specs = {t.name: t for t in manifest.inputs}
    if manifest.mtp is not None:
        specs.update({t.name: t for t in manifest.mtp.inputs})
    fixed = {specs[n].shape[1] for l in _paged_layers(manifest) for n in (l.key_input, l.value_input)
             if n in specs and isinstance(specs[n].shape[1], int)}
    if fixed:
        raise ModelLoadError(f"{manifest.path.name}: its graphs fix the KV block size at {sorted(fixed)} tokens; "
                             f"serve it with that kv_block_size (or none), not {block_size}")
    return replace(manifest, block_size=block_size)


def _read_config(path: Path) -> dict:
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path} is not an onnxruntime-genai export: {CONFIG_FILE} is missing")
    try:
        return json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from None


def _require(config: dict, keys: tuple, path: Path):
    node = config
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            raise ModelLoadError(f"{path.name}/{CONFIG_FILE} has no {'.'.join(keys)}")
        node = node[k]
    return node


def _read_graph(path: Path, filename: str) -> onnx.GraphProto:
    """Load a graph without its weights and check that every external-data file covers its tensors."""
    file = path / filename
    if not file.is_file():
        raise ModelLoadError(f"{path.name}/{filename} is missing")
    try:
        model = onnx.load(str(file), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError / various on garbage
        raise ModelLoadError(f"{path.name}/{filename} is truncated or not an ONNX model ({type(e).__name__}: {e})") from None
    if len(model.graph.node) == 0:
        raise ModelLoadError(f"{path.name}/{filename} is truncated or empty: the graph has no nodes")
    needed: dict[str, int] = {}
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in init.external_data}
            end = int(info.get("offset", 0)) + int(info.get("length", 0))
            loc = info["location"]
            needed[loc] = max(needed.get(loc, 0), end)
    for loc, end in needed.items():
        data = path / loc
        if not data.is_file():
            raise ModelLoadError(f"{path.name}/{filename} needs weights file {loc}, which is missing")
        size = data.stat().st_size
        if size < end:
            raise ModelLoadError(f"{path.name}/{loc} is truncated: {filename} needs {end} bytes, the file has {size}")
    return model.graph


SERVABLE_DTYPES = ("float32", "float16", "int64", "int32")


def _refuse_unservable_dtypes(specs: tuple[TensorSpec, ...], where: str) -> None:
    """The engine's pools and step buffers are numpy / CuPy arrays, which have no bfloat16 (nor
    any type outside SERVABLE_DTYPES): refuse such an export here, by name, not inside a step."""
    bad = [t for t in specs if t.dtype not in SERVABLE_DTYPES]
    if bad:
        raise ModelLoadError(
            f"{where}: input/output {bad[0].name!r} is {bad[0].dtype}; mtpserve serves fp16 or fp32 exports "
            f"(the inputs and outputs may be {', '.join(SERVABLE_DTYPES)}): re-export with -p fp16 "
            "(`mtpserve export --precision fp16`)")


def _tensor_specs(values) -> tuple[TensorSpec, ...]:
    specs = []
    for v in values:
        tt = v.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim)
        specs.append(TensorSpec(v.name, shape, _DTYPES.get(tt.elem_type, str(tt.elem_type))))
    return tuple(specs)


def _name(template: str | None, layer: int, default: str) -> str:
    return (template or default) % layer


def _need(name: str, table: dict, what: str, where: str, hint: str = "") -> TensorSpec:
    if name not in table:
        raise ModelLoadError(f"{where} lacks the {what} '{name}'{hint}")
    return table[name]


_CAPTURE_HINT = "; re-export with --extra_options state_update_capacity=4 (capture outputs are needed for rollback)"


def _kv_layer(layer, names_in, names_out, ins, outs, where) -> PagedKVLayer:
    k_in = _name(names_in.get("past_key_names"), layer, "past_key_values.%d.key")
    v_in = _name(names_in.get("past_value_names"), layer, "past_key_values.%d.value")
    k_out = _name(names_out.get("present_key_names"), layer, "present.%d.key")
    v_out = _name(names_out.get("present_value_names"), layer, "present.%d.value")
    spec = _need(k_in, ins, "paged KV input", where)
    _need(v_in, ins, "paged KV input", where)
    _need(k_out, outs, "paged KV output", where)
    _need(v_out, outs, "paged KV output", where)
    if len(spec.shape) != 4 or not isinstance(spec.shape[2], int) or not isinstance(spec.shape[3], int):
        raise ModelLoadError(f"{where}: {k_in} has shape {list(spec.shape)}, expected a paged pool "
                             "[num_blocks, block_size, kv_heads, head_size]; this is not a paged export")
    return PagedKVLayer(layer, k_in, v_in, k_out, v_out, spec.shape[2], spec.shape[3], spec.dtype)


def _conv_layer(layer, names_in, names_out, ins, outs, capacity, where) -> ConvLayer:
    s_in = _name(names_in.get("past_conv_names"), layer, "past.%d.conv")
    s_out = _name(names_out.get("present_conv_names"), layer, "present.%d.conv")
    cap = _name(names_out.get("state_update_conv_value_names"), layer, "state_update.%d.conv_value")
    spec = _need(s_in, ins, "conv state input", where)
    _need(s_out, outs, "conv state output", where)
    cap_spec = _need(cap, outs, "conv capture output", where, _CAPTURE_HINT)
    if len(spec.shape) != 3 or not all(isinstance(d, int) for d in spec.shape[1:]):
        raise ModelLoadError(f"{where}: {s_in} has shape {list(spec.shape)}, expected [batch, conv_dim, kernel-1]")
    if isinstance(cap_spec.shape[1], int) and cap_spec.shape[1] != capacity:
        raise ModelLoadError(f"{where}: {cap} holds {cap_spec.shape[1]} tokens, config capacity is {capacity}")
    return ConvLayer(layer, s_in, s_out, cap, spec.shape[1], spec.shape[2] + 1, spec.dtype)


def _recurrent_layer(layer, names_in, names_out, ins, outs, capacity, num_key_heads, where) -> RecurrentLayer:
    s_in = _name(names_in.get("past_recurrent_names"), layer, "past.%d.recurrent")
    s_out = _name(names_out.get("present_recurrent_names"), layer, "present.%d.recurrent")
    cap = _name(names_out.get("state_update_recurrent_capsule_names"), layer, "state_update.%d.recurrent_capsule")
    spec = _need(s_in, ins, "recurrent state input", where)
    _need(s_out, outs, "recurrent state output", where)
    cap_spec = _need(cap, outs, "recurrent capture output", where, _CAPTURE_HINT)
    if len(spec.shape) != 4 or not all(isinstance(d, int) for d in spec.shape[1:]):
        raise ModelLoadError(f"{where}: {s_in} has shape {list(spec.shape)}, expected [batch, Hv, Dv, Dk]")
    _, hv, dv, dk = spec.shape
    result = RecurrentLayer(layer, s_in, s_out, cap, hv, dv, dk, num_key_heads, spec.dtype)
    width = cap_spec.shape[1] if len(cap_spec.shape) == 2 else None
    if isinstance(width, int) and width != capacity * result.capsule_width_per_token:
        raise ModelLoadError(f"{where}: {cap} is {width} wide, expected capacity {capacity} x "
                             f"(Hv + Hk*Dk + Hv*Dv) = {capacity * result.capsule_width_per_token}")
    return result


def _mtp_head(path: Path, mtp_cfg: dict, main_hidden: str, main_outs: dict) -> MtpHead:
    filename = mtp_cfg.get("filename", "mtp.onnx")
    graph = _read_graph(path, filename)
    ins, outs = _tensor_specs(graph.input), _tensor_specs(graph.output)
    _refuse_unservable_dtypes(ins + outs, f"{path.name}/{filename}")
    in_by, out_by = {t.name: t for t in ins}, {t.name: t for t in outs}
    names_in, names_out = mtp_cfg.get("inputs", {}), mtp_cfg.get("outputs", {})
    hid_in = names_in.get("hidden_states", "hidden_states")
    hid_out = names_out.get("hidden_states", "hidden_states_out")
    logits = names_out.get("logits", "logits")
    for name, table, what in ((hid_in, in_by, "input"), ("input_ids", in_by, "input"),
                              (hid_out, out_by, "output"), (logits, out_by, "output")):
        if name not in table:
            raise ModelLoadError(f"{path.name}/{filename} has no '{name}' {what}")
    for n in _PAGED_INPUTS:
        if n not in in_by:
            raise ModelLoadError(f"{path.name}/{filename} is not a paged MTP head (no {n} input)")
    if main_hidden not in main_outs:
        raise ModelLoadError(f"{path.name}/model.onnx has no '{main_hidden}' output to feed the MTP head")
    if in_by[hid_in].shape[-1] != main_outs[main_hidden].shape[-1]:
        raise ModelLoadError(f"{path.name}: MTP head hidden width {in_by[hid_in].shape[-1]} != main model's "
                             f"{main_outs[main_hidden].shape[-1]}")
    num_layers = int(mtp_cfg.get("num_hidden_layers", 1))
    kv = tuple(_kv_layer(l, names_in, names_out, in_by, out_by, f"{path.name}/{filename}")
               for l in range(num_layers))
    return MtpHead(filename, ins, outs, kv, hid_in, hid_out, logits)


def _count_parameters(main_graph, mtp: MtpHead | None, path: Path) -> int:
    """Weights of the main graph plus the MTP head's own (shared embedding / LM head counted once)."""
    skip = {"cos_cache", "sin_cache"}

    def numel(init):
        n = 1
        for d in init.dims:
            n *= d
        return n
    def key(graph_index, init):   # shared initializers point at the same bytes of model.onnx.data
        if init.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in init.external_data}
            return info["location"], info.get("offset", "0")
        return graph_index, init.name
    seen = set()
    total = 0
    graphs = [main_graph]
    if mtp is not None:
        graphs.append(onnx.load(str(path / mtp.filename), load_external_data=False).graph)
    for index, g in enumerate(graphs):
        for init in g.initializer:
            if init.name in skip or key(index, init) in seen or init.data_type not in (
                    onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
                continue
            seen.add(key(index, init))
            total += numel(init)
    return total
