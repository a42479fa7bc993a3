"""The runner: ONNX Runtime sessions for the main model and the MTP head, and their paged KV pools.

Packed step inputs (the same layout for both graphs), for B requests feeding n_b tokens each:

    input_ids            [T]        tokens of request 0 | request 1 | ...      T = sum n_b
    position_ids         [3, T]     past_b + i for the i-th token of request b (text M-RoPE: 3 equal rows)
    cumulative_sequence_lengths [B+1]   0, n_0, n_0+n_1, ...
    past_sequence_lengths [B]       tokens already in each request's KV
    block_table          [B, MB]    pages of each request, padded with the scratch block 0
    attention_metadata   [3]        [max n_b, max past_b + n_b, min past_b + n_b]   (host memory)

Every array is bound through IOBinding by pointer, on the session's device: the KV pools are
allocated once and bound as both the `past_key_values.L.*` input and the `present.L.*` output, so
ORT writes new K/V rows in place; outputs go into buffers allocated here with their known shapes.
The fixed states and captures of all linear-attention layers are stacked `[L, B, ...]` buffers
(see state_bank): each layer's input and outputs are bound to its contiguous slice `[i]`.
Arrays come from an array module `xp`: numpy on the CPU, cupy on CUDA (nothing else changes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from mtpserve.engine import launches
from mtpserve.engine.manifest import ModelManifest, PagedKVLayer
from mtpserve.engine.state_bank import StepCaptures, StepStates

Array = Any   # numpy or cupy ndarray
HOST_INPUTS = {"attention_metadata", "state_update_active"}   # read on the host by the CUDA kernels


@dataclass
class PackedRows:
    """One request's rows in a packed forward: tokens at positions [past_len, past_len + len(token_ids)).
    ``block_table``: a list, or the pool's read-only ``KVPool.block_array`` (an engine step's rows):
    read it by length, index and slice only (``+`` or truth on an array do not mean a list's)."""
    token_ids: Sequence[int]
    past_len: int
    block_table: Sequence[int] | np.ndarray


@dataclass
class MainOutputs:
    logits: Array                 # [T, V]
    hidden: Array                 # [T, H]
    present: StepStates
    captures: StepCaptures | None
    staging: object = None        # a captured step's ``cuda_graphs.StagedStep`` (what its inputs held)


@dataclass
class HeadOutputs:
    logits: Array                 # [T, V]
    hidden: Array                 # [T, H] (hidden_states_out: feeds the next chained row)


def pack_rows(rows: Sequence[PackedRows], scratch_block: int = 0, min_width: int = 1) -> dict[str, np.ndarray]:
    """The shared paged inputs for a list of requests' rows (see the module docstring); the block
    table has at least ``min_width`` columns (padded with the scratch block)."""
    lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows))
    past = np.fromiter((r.past_len for r in rows), np.int64, len(rows))
    ids = np.fromiter((t for r in rows for t in r.token_ids), np.int64, int(lens.sum()))
    pos = np.repeat(past - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) + np.arange(ids.size)
    width = max(min_width, max(len(r.block_table) for r in rows))
    table = np.full((len(rows), width), scratch_block, np.int32)
    for i, r in enumerate(rows):
        table[i, :len(r.block_table)] = r.block_table
    total = past + lens
    return {
        "input_ids": ids,
        "position_ids": np.broadcast_to(pos, (3, ids.size)).copy(),
        "cumulative_sequence_lengths": np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        "past_sequence_lengths": past.astype(np.int32),
        "block_table": table,
        "attention_metadata": np.array([lens.max(), total.max(), total.min()], np.int32),
    }


class _Binding:
    """One session's IOBinding, kept across steps: arrays are bound by pointer, the static KV
    pools once, everything else each step; a name whose pointer, shape and dtype are what it
    is bound to already is not bound again (a steady batch re-binds almost nothing)."""

    def __init__(self, session: ort.InferenceSession, xp, device: str):
        self.io = session.io_binding()
        self.xp, self.device = xp, device
        self.outputs: dict[str, Array] = {}
        self._keep: list = []
        on_device = device if xp is not np else "cpu"
        self._devices = {d: ort.OrtDevice.make(d, 0)._get_c_device() for d in {"cpu", on_device}}
        self._on_device = on_device
        self._raw = self.io._iobinding          # the binding itself, without per-call wrapper checks
        self._bound: dict[str, tuple] = {}      # name -> (device, dtype, shape, pointer) bound now
        self._reused: dict[str, Array] = {}     # output name -> its buffer, for outputs reused across steps

    def begin_step(self) -> None:
        self.outputs = {}
        self._keep = []

    @staticmethod
    def _ptr(arr) -> int:
        return arr.ctypes.data if isinstance(arr, np.ndarray) else arr.data.ptr

    def _bind(self, name: str, device: str, dtype, shape: tuple, ptr: int, output: bool = False) -> None:
        key = (device, dtype, shape, ptr)
        if self._bound.get(name) == key:
            return
        bind = self._raw.bind_output if output else self._raw.bind_input
        bind(name, self._devices[device], dtype, list(shape), ptr)
        self._bound[name] = key

    def input(self, name: str, arr) -> None:
        """Bind one input: host arrays stay on the host for HOST_INPUTS (and on the CPU), device
        arrays are bound where they are, other host arrays are copied to the device."""
        if name in HOST_INPUTS or self.xp is np:
            arr, device = np.ascontiguousarray(arr), "cpu"
        else:
            arr, device = self.xp.ascontiguousarray(self.xp.asarray(arr)), self._on_device
        self._bind_input(name, arr, device)

    def host_inputs(self, arrays: dict[str, np.ndarray]) -> None:
        """Bind several host arrays; on a device they travel in ONE host -> device copy::

            host bytes   | input_ids | position_ids | cu_seqlens |..| block_table |
                         0          a            b            c   (each offset 8-byte aligned)
            device       the same bytes; each input is bound at base pointer + its offset
        """
        if self.xp is np:
            for name, arr in arrays.items():
                self.input(name, arr)
            return
        on_host = {n: np.ascontiguousarray(a) for n, a in arrays.items() if n in HOST_INPUTS}
        for name, arr in on_host.items():
            self._bind_input(name, arr, "cpu")
        sent = [(n, np.ascontiguousarray(a)) for n, a in arrays.items() if n not in HOST_INPUTS]
        offsets, end = [], 0
        for _, arr in sent:
            offsets.append(end)
            end += -(-arr.nbytes // 8) * 8
        packed = np.empty(max(end, 8), np.uint8)
        for (_, arr), at in zip(sent, offsets):
            packed[at:at + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        device = self.xp.asarray(packed)
        self._keep.append(device)
        base = device.data.ptr
        for (name, arr), at in zip(sent, offsets):
            self._bind(name, self._on_device, arr.dtype.type, arr.shape, base + at)

    def bind_at(self, name: str, arr, output: bool = False) -> None:
        """Bind ``arr`` itself, by pointer (a host numpy array on the CPU, a device array where it
        is): no copy is made, so a captured graph sees this very buffer on every replay."""
        if not arr.flags.c_contiguous:
            raise AssertionError(f"{name} must be one contiguous block to be bound by pointer")
        device = "cpu" if isinstance(arr, np.ndarray) else self._on_device
        self._bind(name, device, arr.dtype.type, arr.shape, self._ptr(arr), output=output)

    def _bind_input(self, name: str, arr, device: str) -> None:
        self._keep.append(arr)
        self._bind(name, device, arr.dtype.type, arr.shape, self._ptr(arr))

    def output(self, name: str, shape: tuple, dtype, into=None, reuse: bool = False) -> Array:
        """Bind an output: ``into``, or a new buffer; ``reuse``: the buffer this name had last
        step when its shape matches (only for outputs nobody holds beyond the step)."""
        arr = into
        if arr is None:
            arr = self._reused.get(name) if reuse else None
            if arr is None or arr.shape != tuple(shape) or arr.dtype != np.dtype(dtype):
                arr = self.xp.empty(shape, dtype)
                if reuse:
                    self._reused[name] = arr
        if not arr.flags.c_contiguous:
            raise AssertionError(f"output {name} must be one contiguous block to be bound by pointer")
        self._bind(name, self._on_device, arr.dtype.type, arr.shape, self._ptr(arr), output=True)
        self.outputs[name] = arr
        return arr

    def run(self, session: ort.InferenceSession, run_options: ort.RunOptions | None = None) -> dict[str, Array]:
        session.run_with_iobinding(self.io, run_options)
        return self.outputs


class _PagedPool:
    """The K/V arrays of one graph's paged layers (zero-filled: masked keys must be finite)."""

    def __init__(self, layers: Sequence[PagedKVLayer], num_blocks: int, block_size: int, xp):
        self.layers = tuple(layers)
        self.arrays: dict[str, Array] = {}
        for layer in self.layers:
            for name in (layer.key_input, layer.value_input):
                self.arrays[name] = xp.zeros((num_blocks, block_size, layer.num_kv_heads, layer.head_size),
                                             layer.dtype)

    def bind(self, b: _Binding) -> None:
        """Bind each pool as its layer's past input and present output (once: they never move)."""
        for layer in self.layers:
            for name_in, name_out in ((layer.key_input, layer.key_output),
                                      (layer.value_input, layer.value_output)):
                b.input(name_in, self.arrays[name_in])
                b.output(name_out, None, None, into=self.arrays[name_in])
        b.begin_step()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class Runner:
    """Runs packed steps of the main model and the MTP head on one device."""

    def __init__(self, manifest: ModelManifest, num_blocks: int, num_threads: int = 0,
                 device: str = "cpu", xp=np, with_head: bool = True, cuda_stream: int | None = None,
                 cuda_graphs: bool = False):
        """cuda_stream: the raw pointer of the CUDA stream ORT must run on (CUDA only). The engine
        passes the one its CuPy work runs on, so state gathers, forwards and commits are ordered
        on a single stream without host synchronisation. cuda_graphs: make the main and head
        sessions able to capture steps (cuda_graphs.StepGraphs, HeadGraphs); their eager runs then
        pass graph id -1."""
        self.manifest, self.xp, self.device = manifest, xp, device
        self.cuda_graphs = cuda_graphs and device == "cuda"
        self.eager_options = None       # a session's run without its graphs (None: no graphs to avoid)
        if self.cuda_graphs:
            self.eager_options = ort.RunOptions()
            self.eager_options.add_run_config_entry("gpu_graph_id", "-1")    # ORT: no capture, no replay
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_session_config_entry("session.set_denormal_as_zero", "1")   # decayed recurrent state
        if num_threads:
            so.intra_op_num_threads = num_threads
            so.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        # CUDA: the block table always has its full width (context / block size). PagedAttention's
        # decode path (one query token per request) pays 45-85 ms the first time it sees an input
        # shape (H200, onnxruntime-gpu 1.31); a fixed width leaves only the batch size to vary,
        # and the engine's warm-up pays for each batch size once, at start.
        self.table_width = 1
        if device == "cuda":
            self.table_width = -(-manifest.context_length // manifest.block_size)
            # ORT's memory patterns are planned per input shape; with shapes that change every
            # step they cost more than they save (H200: main step 3.3 -> 2.1 ms, head 1.1 -> 0.65)
            so.enable_mem_pattern = False
            ort.preload_dlls()          # the CUDA 13 libraries that come with the nvidia-* wheels
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise RuntimeError("CUDA requested but onnxruntime has no CUDAExecutionProvider: "
                                   "install onnxruntime-gpu instead of onnxruntime (see README)")
            options = {"device_id": 0}
            if cuda_stream:
                options["user_compute_stream"] = str(cuda_stream)
            providers = [("CUDAExecutionProvider", options)]
        self.providers = providers          # eager sessions on this device and stream (gemm_warmup)
        session_providers = providers
        if self.cuda_graphs:
            session_providers = [("CUDAExecutionProvider", {**providers[0][1], "enable_cuda_graph": "1"})]
        self.session = ort.InferenceSession(str(manifest.path / "model.onnx"), so, providers=session_providers)
        self.kv = _PagedPool(manifest.kv_layers, num_blocks, manifest.block_size, xp)
        self.main_input_names = {i.name for i in self.session.get_inputs()}
        self._main_binding = _Binding(self.session, xp, device)
        self.kv.bind(self._main_binding)
        self.head_session = self.head_kv = None
        if manifest.mtp is not None and with_head:
            # the head runs between main-model steps: its threads must not spin after a run and
            # steal the cores the main model needs next; a one-layer head runs best on one thread
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            so.intra_op_num_threads = 1
            self.head_session = ort.InferenceSession(str(manifest.path / manifest.mtp.filename), so,
                                                     providers=session_providers)
            self.head_kv = _PagedPool(manifest.mtp.kv_layers, num_blocks, manifest.block_size, xp)
            self.head_input_names = {i.name for i in self.head_session.get_inputs()}
            self._head_binding = _Binding(self.head_session, xp, device)
            self.head_kv.bind(self._head_binding)
        self.hidden_dtype = next(t.dtype for t in manifest.outputs if t.name == manifest.hidden_output)
        self._linear_layer_ids = {l.layer_id for l in manifest.recurrent_layers}
        self._captures: StepCaptures | None = None       # the last step's capture buffers
        assert self._linear_layer_ids == {l.layer_id for l in manifest.conv_layers}, "conv/recurrent layers differ"

    def run_main(self, rows: Sequence[PackedRows], states: StepStates, capture_counts: np.ndarray,
                 present_into: StepStates | None = None) -> MainOutputs:
        """One packed forward of the main model; capture_counts[b] transitions are captured.
        The fixed states are read from ``states`` and written to ``present_into`` (e.g. the
        state bank's rows, in place) or to new buffers."""
        launches.escape()           # (an eager forward runs now: a deferred step's launches go first)
        m, xp = self.manifest, self.xp
        b = self._main_binding
        capture = bool(capture_counts.any())
        num_tokens = self._begin(b, rows, self.main_input_names, self.table_width, {
            "state_update_capture_count": capture_counts.astype(np.int32),
            "state_update_active": np.array([int(capture)], np.int32)})
        batch = len(rows)
        C, ids = m.capture_capacity, states.layer_ids
        if set(ids) != self._linear_layer_ids:
            raise AssertionError(f"step states of layers {ids} for a model with linear-attention "
                                 f"layers {sorted(self._linear_layer_ids)}")
        index = {layer_id: i for i, layer_id in enumerate(ids)}
        # stacked [L, B, ...] outputs, allocated once; layer i's name is bound to the slice [i]
        present = present_into or StepStates(ids, xp.empty_like(states.conv), xp.empty_like(states.recurrent))
        if present.conv.shape != states.conv.shape or present.recurrent.shape != states.recurrent.shape:
            raise AssertionError(f"present buffers {present.conv.shape}/{present.recurrent.shape} for past "
                                 f"{states.conv.shape}/{states.recurrent.shape}")
        captures = self._captures                      # read by this step's commit only: reused
        if captures is None or captures.layer_ids != ids or captures.conv_value.shape[1] != batch:
            conv0, rec0 = m.conv_layers[0], m.recurrent_layers[0]
            captures = StepCaptures(ids, xp.empty((len(ids), batch, C, conv0.conv_dim), conv0.dtype),
                                    xp.empty((len(ids), batch, C * rec0.capsule_width_per_token), np.float32))
            self._captures = captures
        for layer in m.conv_layers:
            i = index[layer.layer_id]
            b.input(layer.state_input, states.conv[i])
            b.output(layer.state_output, None, None, into=present.conv[i])
            b.output(layer.capture_output, None, None, into=captures.conv_value[i])
        for layer in m.recurrent_layers:
            i = index[layer.layer_id]
            b.input(layer.state_input, states.recurrent[i])
            b.output(layer.state_output, None, None, into=present.recurrent[i])
            b.output(layer.capture_output, None, None, into=captures.recurrent_capsule[i])
        self._bind_logits_hidden(b, num_tokens, m.logits_output, m.hidden_output)
        out = b.run(self.session, self.eager_options)
        return MainOutputs(out[m.logits_output], out[m.hidden_output], present,
                           captures if capture else None)

    def run_head(self, rows: Sequence[PackedRows], hidden: Array) -> HeadOutputs:
        """One packed forward of the MTP head: row j pairs hidden[j] with input token j."""
        launches.escape()
        head = self.manifest.mtp
        b = self._head_binding
        num_tokens = self._begin(b, rows, self.head_input_names, self.table_width)
        b.input(head.hidden_input, hidden.astype(self.hidden_dtype, copy=False))
        self._bind_logits_hidden(b, num_tokens, head.logits_output, head.hidden_output)
        out = b.run(self.head_session, self.eager_options)
        return HeadOutputs(out[head.logits_output], out[head.hidden_output])

    @staticmethod
    def _begin(b: _Binding, rows: Sequence[PackedRows], graph_inputs: set[str], table_width: int,
               extra: dict[str, np.ndarray] | None = None) -> int:
        """Start a step on a binding with the packed paged inputs (and any extra host inputs),
        all sent in one copy; the number of tokens."""
        b.begin_step()
        packed = pack_rows(rows, min_width=table_width)
        packed.update(extra or {})
        b.host_inputs({name: arr for name, arr in packed.items() if name in graph_inputs})
        return packed["input_ids"].size

    def _bind_logits_hidden(self, b: _Binding, num_tokens: int, logits: str, hidden: str) -> None:
        m = self.manifest
        # logits are read within the step only; hidden rows are kept until the head catches up
        b.output(logits, (num_tokens, m.vocab_size), m.compute_dtype, reuse=True)
        b.output(hidden, (num_tokens, m.hidden_size), self.hidden_dtype)
