"""CPU adapter: turn the paged fp16 CUDA export into a model ONNX Runtime's CPU EP can run.

`adapt_for_cpu(export_dir)` converts once and caches the result on disk (under ~/.cache/mtpserve or
$MTPSERVE_CACHE, keyed by the export's content hash):

1. fp16 -> fp32 everywhere (initializers, graph I/O, value_info, Cast targets, Constant tensors,
   tensor attributes). KV pools and conv carries become fp32; recurrent state already is.
2. Each `com.microsoft.PagedAttention` node (no CPU kernel) becomes standard ONNX: ScatterND of
   the new K/V into the pool, Gather of pages by block table, ONNX Attention (opset 23) with a
   causal mask. Input and output names stay those of the export, so the engine binds CPU and CUDA
   models alike; `attention_metadata` stays an (unused) input. The ScatterND output *is* the
   `present.L.*` graph output: bind the same OrtValue as `past_key_values.L.*` and the write
   happens in that buffer, no copy.

Attention layout: packed tokens are cut into rows of `Qc = min(max_query_len, query_chunk)`
query slots; each row belongs to one request and gathers that request's pages once:

    packed tokens  | a0 a1 a2 a3 a4 | b0 | c0 c1 |        (cu = [0, 5, 6, 8], query_chunk = 3)
    rows (Qc = 3)  [a0 a1 a2] [a3 a4 .] [b0 . .] [c0 c1 .]  row r -> request b_r, chunk c_r
    query slot j of row r = local token c_r*Qc + j, position past[b_r] + c_r*Qc + j
    K/V of row r   = pool[block_table[b_r]] -> [MB*BS, Hkv*D]; mask key l <= position
    token t (request b, local i) reads row rstart[b] + i // Qc, slot i % Qc

Memory per layer is R*MB*BS*Hkv*D for K and V (R = number of rows <= B + T/Qc) and R*H*Qc*MB*BS
for the scores: a 512-token prefill chunk costs 512/Qc rows, not 512, and decodes cost one row of
width 1 each, however long the prefill beside them. Masked keys get zero weight, but the pools
must hold finite numbers (allocate them with zeros): 0 * NaN is NaN. As with the CUDA op, each
request's block-table row must cover every position it writes (the flat index b*MB + pos//BS
would otherwise run into the next row); padding entries may point at the scratch block.

Unsupported PagedAttention features (rotary inside the op, sliding window, quantised or rotated
KV, head sinks, fused Q/K norms, softcap) raise `CpuAdapterError`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ADAPTER_VERSION = 1
DEFAULT_QUERY_CHUNK = 64
CONFIG_FILE = "genai_config.json"
INFO_FILE = "cpu_adapter.json"
_ALIGN = 64
_ATTENTION_OPSET = 23
_F32, _F16, _I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64
_PA_SUPPORTED_INPUTS = {0, 1, 2, 3, 4, 5, 6, 7, 16}  # q k v kpool vpool cu past block_table metadata


class CpuAdapterError(ValueError):
    """The export cannot be adapted for the CPU; the message says why."""


def default_cache_root() -> Path:
    """$MTPSERVE_CACHE, else ~/.cache/mtpserve."""
    return Path(os.environ.get("MTPSERVE_CACHE") or "~/.cache/mtpserve").expanduser()


def adapt_for_cpu(export_dir: str | os.PathLike, cache_root: str | os.PathLike | None = None,
                  query_chunk: int = DEFAULT_QUERY_CHUNK) -> Path:
    """Return a folder holding the CPU-runnable copy of `export_dir`, building it on first use.

    The folder (``<cache_root>/cpu/<key>``) holds the adapted ``*.onnx`` graphs and their data,
    a copy of every other file of the export (genai_config.json, tokenizer files) and
    ``cpu_adapter.json``. The key hashes the bytes of every file of the export, the adapter
    version and `query_chunk`. It is built in a temporary folder and renamed into place, so
    concurrent callers never see a partial copy; the loser of a race discards its build.
    """
    export_dir = Path(export_dir).expanduser().resolve()
    if not (export_dir / CONFIG_FILE).is_file():
        raise CpuAdapterError(f"{export_dir} is not an onnxruntime-genai export (no {CONFIG_FILE})")
    if query_chunk < 1:
        raise CpuAdapterError(f"query_chunk must be >= 1, got {query_chunk}")
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    key = export_key(export_dir, root, query_chunk)
    final = root / "cpu" / key
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
    try:
        started = time.perf_counter()
        _build(export_dir, tmp, query_chunk)
        info = {"source": str(export_dir), "key": key, "adapter_version": ADAPTER_VERSION,
                "query_chunk": query_chunk, "build_seconds": round(time.perf_counter() - started, 3)}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------- cache key
def export_key(export_dir: Path, cache_root: Path, query_chunk: int = DEFAULT_QUERY_CHUNK) -> str:
    """Content key of an export: sha256 over (name, sha256 of bytes) of its files + adapter settings."""
    h = hashlib.sha256(f"mtpserve-cpu-adapter v{ADAPTER_VERSION} query_chunk={query_chunk}\n".encode())
    for path in sorted(p for p in Path(export_dir).iterdir() if p.is_file()):
        h.update(f"{path.name}\0{file_digest(path, cache_root)}\n".encode())
    return h.hexdigest()[:32]


def file_digest(path: Path, cache_root: Path) -> str:
    """sha256 of a file's bytes, remembered under cache_root keyed by (path, size, mtime, inode)."""
    st = path.stat()
    stamp = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    memo = Path(cache_root) / "hashes" / (hashlib.sha256(stamp["path"].encode()).hexdigest()[:32] + ".json")
    try:
        saved = json.loads(memo.read_text())
        if {k: saved.get(k) for k in stamp} == stamp:
            return saved["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix=".memo.")
    with os.fdopen(fd, "w") as f:
        json.dump({**stamp, "sha256": digest}, f)
    os.replace(tmp, memo)
    return digest


# ---------------------------------------------------------------------------------- building
def _build(src: Path, dst: Path, query_chunk: int) -> None:
    graphs = {p.name: onnx.load(str(p), load_external_data=False) for p in sorted(src.glob("*.onnx"))}
    if not graphs:
        raise CpuAdapterError(f"{src} holds no .onnx graph")
    data_files = {ed for m in graphs.values() for ed in _locations(m)}
    # owners first: a graph whose data lives only in its own file is written before graphs that borrow it
    order = sorted(graphs, key=lambda n: any(loc != n + ".data" for loc in _locations(graphs[n])))
    moved: dict[tuple[str, int, int], dict] = {}   # (location, offset, length) in src -> new external_data
    for name in order:
        model = graphs[name]
        _to_fp32(model.graph)
        _rewrite_initializers(model, src, dst, name + ".data", moved)
        _replace_paged_attention(model, query_chunk)
        (dst / name).write_bytes(model.SerializeToString())
    for path in src.iterdir():
        if path.is_file() and path.name not in graphs and path.name not in data_files:
            shutil.copyfile(path, dst / path.name)
    _rewrite_shared_initializers(dst / CONFIG_FILE, moved)


def _locations(model: onnx.ModelProto) -> set[str]:
    return {_external(t)["location"] for t in model.graph.initializer
            if t.data_location == TensorProto.EXTERNAL}


def _external(t: TensorProto) -> dict:
    return {e.key: e.value for e in t.external_data}


def _rewrite_initializers(model, src: Path, dst: Path, own_data: str, moved: dict) -> None:
    """fp32 initializers, external data written to dst/own_data; tensors another graph's data file
    holds and that were already rewritten there keep pointing at that file (shared initializers)."""
    if len(model.graph.sparse_initializer):
        raise CpuAdapterError("sparse initializers are not supported")
    with open(dst / own_data, "ab") as out:
        for t in model.graph.initializer:
            if t.data_location != TensorProto.EXTERNAL:
                if t.data_type == _F16:
                    t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
                continue
            ext = _external(t)
            where = (ext["location"], int(ext.get("offset", 0)), int(ext.get("length", -1)))
            if where not in moved:
                raw = _read_external(src / ext["location"], where[1], where[2], t)
                data = raw.view(np.float16).astype(np.float32).tobytes() if t.data_type == _F16 else raw.tobytes()
                out.write(b"\0" * (-out.tell() % _ALIGN))
                moved[where] = {"location": own_data, "offset": out.tell(), "length": len(data)}
                out.write(data)
            if t.data_type == _F16:
                t.data_type = _F32
            del t.external_data[:]
            for k, v in moved[where].items():
                t.external_data.add(key=k, value=str(v))
    if (dst / own_data).stat().st_size == 0:
        (dst / own_data).unlink()


def _read_external(path: Path, offset: int, length: int, t: TensorProto) -> np.ndarray:
    if t.data_type in (TensorProto.BFLOAT16, TensorProto.STRING):
        raise CpuAdapterError(f"initializer {t.name}: {TensorProto.DataType.Name(t.data_type)} is not supported "
                              "(export with -p fp16)")
    raw = np.fromfile(path, dtype=np.uint8, count=length, offset=offset)
    if length >= 0 and raw.size != length:
        raise CpuAdapterError(f"{path.name} is truncated: {t.name} needs bytes {offset}..{offset + length}")
    return raw


def _to_fp32(graph: onnx.GraphProto) -> None:
    """Retype every fp16 value, Cast target, Constant and tensor attribute of `graph` (recursively)."""
    for vi in (*graph.input, *graph.output, *graph.value_info):
        if vi.type.tensor_type.elem_type == _F16:
            vi.type.tensor_type.elem_type = _F32
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype") and attr.i == _F16 \
                    and node.domain in ("", "ai.onnx"):
                attr.i = _F32
            elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == _F16:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
            elif attr.type == onnx.AttributeProto.TENSORS:
                for t in attr.tensors:
                    if t.data_type == _F16:
                        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
            elif attr.type == onnx.AttributeProto.GRAPH:
                _to_fp32(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _to_fp32(g)


def _rewrite_shared_initializers(config_path: Path, moved: dict) -> None:
    """Point genai_config.json's shared_initializers at the adapted bytes (offset, length, fp32)."""
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())

    def visit(node):
        if isinstance(node, dict):
            for entry in node.get("shared_initializers", []):
                where = (entry["data_file"], int(entry["offset"]), int(entry["length"]))
                if where in moved:
                    new = moved[where]
                    entry.update(data_file=new["location"], offset=str(new["offset"]), length=str(new["length"]))
                    if entry.get("data_type") == _F16:
                        entry["data_type"] = _F32
            for value in node.values():
                visit(value)

    visit(config)
    config_path.write_text(json.dumps(config, indent=4) + "\n")


# ---------------------------------------------------------------------------------- attention
class _Nodes:
    """Appends nodes and int64 constants under one name prefix; `op` returns the output name."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes, self.initializers, self._n = prefix, [], [], 0

    def const(self, value) -> str:
        name = f"{self.prefix}/const_{len(self.initializers)}"
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=np.int64), name))
        return name

    def op(self, op_type: str, *inputs: str, output: str | None = None, **attrs) -> str:
        self._n += 1
        name = f"{self.prefix}/{op_type}_{self._n}"
        output = output or name + "/output_0"
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=name, **attrs))
        return output


def _index_maps(g: _Nodes, cu: str, past: str, block_table: str, pool: str, query_chunk: int) -> dict:
    """Per-step index arithmetic shared by every attention layer of a graph (see the module diagram).

    The block size is read from the pool's shape at run time; all layers share one block table,
    hence one block size.
    """
    c = g.const
    block_size = g.op("Shape", pool, start=1, end=2)                                      # [1]
    cu64, past64 = g.op("Cast", cu, to=_I64), g.op("Cast", past, to=_I64)
    starts = g.op("Slice", cu64, c([0]), c([-1]))
    ends = g.op("Slice", cu64, c([1]), c([2**62]))
    qlen = g.op("Sub", ends, starts)
    num_tokens = g.op("Slice", cu64, c([-1]), c([2**62]))
    tok = g.op("Range", c(0), g.op("Squeeze", num_tokens), c(1))

    def owner(index: str, range_ends: str) -> str:   # which request's range [start, end) holds index
        ge = g.op("GreaterOrEqual", g.op("Unsqueeze", index, c([1])), g.op("Unsqueeze", range_ends, c([0])))
        return g.op("ReduceSum", g.op("Cast", ge, to=_I64), c([1]), keepdims=0)

    b_t = owner(tok, ends)
    i_t = g.op("Sub", tok, g.op("Gather", starts, b_t))
    pos_t = g.op("Add", g.op("Gather", past64, b_t), i_t)
    bt64 = g.op("Cast", block_table, to=_I64)
    max_blocks = g.op("Shape", bt64, start=1, end=2)
    blk_t = g.op("Gather", g.op("Reshape", bt64, c([-1])),
                 g.op("Add", g.op("Mul", b_t, max_blocks), g.op("Div", pos_t, block_size)))
    slots = g.op("Concat", g.op("Unsqueeze", blk_t, c([1])),
                 g.op("Unsqueeze", g.op("Mod", pos_t, block_size), c([1])), axis=1)   # [T, 2]

    qc = g.op("Min", g.op("ReduceMax", qlen, c([0]), keepdims=1), c([query_chunk]))      # [1]
    nrows = g.op("Div", g.op("Add", qlen, g.op("Sub", qc, c([1]))), qc)
    rends = g.op("CumSum", nrows, c(0))
    rstarts = g.op("Sub", rends, nrows)
    rows = g.op("Range", c(0), g.op("ReduceSum", nrows, c([0]), keepdims=0), c(1))
    b_r = owner(rows, rends)
    chunk_r = g.op("Sub", rows, g.op("Gather", rstarts, b_r))
    local = g.op("Add", g.op("Unsqueeze", g.op("Mul", chunk_r, qc), c([1])),
                 g.op("Unsqueeze", g.op("Range", c(0), g.op("Squeeze", qc), c(1)), c([0])))  # [R, Qc]
    src = g.op("Min", g.op("Add", g.op("Unsqueeze", g.op("Gather", starts, b_r), c([1])), local),
               g.op("Sub", num_tokens, c([1])))
    qpos = g.op("Add", g.op("Unsqueeze", g.op("Gather", past64, b_r), c([1])), local)
    kv_len = g.op("Mul", max_blocks, block_size)
    keys = g.op("Range", c(0), g.op("Squeeze", kv_len), c(1))
    mask = g.op("LessOrEqual", keys, g.op("Unsqueeze", qpos, c([2])))                   # [R, Qc, L]
    out_idx = g.op("Add", g.op("Mul", g.op("Add", g.op("Gather", rstarts, b_t), g.op("Div", i_t, qc)), qc),
                   g.op("Mod", i_t, qc))
    return {"slots": slots, "src": src, "mask": g.op("Unsqueeze", mask, c([1])),
            "row_blocks": g.op("Gather", bt64, b_r), "out_idx": out_idx}


def _replace_paged_attention(model: onnx.ModelProto, query_chunk: int) -> None:
    graph = model.graph
    layers = [n for n in graph.node if n.op_type == "PagedAttention"]
    if not layers:
        return
    inputs = {vi.name: vi for vi in graph.input}
    g = _Nodes("/cpu_adapter")
    maps = None
    new_nodes: dict[int, list] = {}
    for node in layers:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        _check_supported(node, attrs)
        q, k, v, kpool, vpool, cu, past, block_table = node.input[:8]
        pool = inputs.get(kpool)
        if pool is None or len(pool.type.tensor_type.shape.dim) != 4:
            raise CpuAdapterError(f"{node.name}: the KV pool {kpool} must be a 4-D graph input")
        dims = pool.type.tensor_type.shape.dim
        num_kv_heads, head_size = dims[2].dim_value, dims[3].dim_value
        if not (num_kv_heads and head_size):
            raise CpuAdapterError(f"{node.name}: the KV pool {kpool} needs fixed head count and head size")
        if maps is None:
            maps, step_inputs = _index_maps(g, cu, past, block_table, kpool, query_chunk), (cu, past, block_table)
        if (cu, past, block_table) != step_inputs:
            raise CpuAdapterError(f"{node.name}: all PagedAttention nodes of a graph must share one block table")
        layer = _Nodes(f"{node.name}/cpu")
        c = layer.const
        out, kout, vout = node.output
        for new, pool_in, pool_out in ((k, kpool, kout), (v, vpool, vout)):
            rows = layer.op("Reshape", new, c([-1, num_kv_heads, head_size]))
            layer.op("ScatterND", pool_in, maps["slots"], rows, output=pool_out)
        gathered = [layer.op("Reshape", layer.op("Gather", p, maps["row_blocks"], axis=0),
                             c([0, -1, num_kv_heads * head_size])) for p in (kout, vout)]
        query = layer.op("Gather", q, maps["src"], axis=0)
        att = {"q_num_heads": attrs["num_heads"], "kv_num_heads": attrs["kv_num_heads"]}
        if attrs.get("scale", 0.0):
            att["scale"] = attrs["scale"]
        o = layer.op("Attention", query, *gathered, maps["mask"], **att)
        layer.op("Gather", layer.op("Reshape", o, c([-1, attrs["num_heads"] * head_size])), maps["out_idx"],
                 axis=0, output=out)
        new_nodes[id(node)] = layer.nodes
        graph.initializer.extend(layer.initializers)
    shared_done = False
    nodes = []
    for node in graph.node:
        if id(node) not in new_nodes:
            nodes.append(node)
            continue
        if not shared_done:
            nodes.extend(g.nodes)
            shared_done = True
        nodes.extend(new_nodes[id(node)])
    graph.initializer.extend(g.initializers)
    del graph.node[:]
    graph.node.extend(nodes)
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, _ATTENTION_OPSET)
    model.ir_version = max(model.ir_version, 10)


def _check_supported(node: onnx.NodeProto, attrs: dict) -> None:
    extra = [i for i, name in enumerate(node.input) if name and i not in _PA_SUPPORTED_INPUTS]
    problems = [f"optional input {i} ({node.input[i]})" for i in extra]
    if attrs.get("do_rotary", 0):
        problems.append("do_rotary=1")
    if attrs.get("local_window_size", -1) not in (-1, 0):
        problems.append(f"local_window_size={attrs['local_window_size']}")
    if attrs.get("softcap", 0.0):
        problems.append(f"softcap={attrs['softcap']}")
    for name in ("k_quant_type", "v_quant_type", "k_cache_dtype", "v_cache_dtype", "qk_rotation", "v_rotation",
                 "sliding_window_cache"):
        if name in attrs:
            problems.append(name)
    if len(node.output) != 3 or not all(node.output):
        problems.append("outputs other than (output, present_key, present_value)")
    if problems:
        raise CpuAdapterError(f"{node.name}: PagedAttention features the CPU adapter does not support: "
                              + ", ".join(problems))

