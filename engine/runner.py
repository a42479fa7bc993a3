"""The runner: ONNX Runtime sessions for the main model and the MTP head, and their paged KV pools.

Packed step inputs (the same layout for both graphs), for B requests feeding n_b tokens each:

    input_ids            [T]        tokens of request 0 | request 1 | ...      T = sum n_b
    position_ids         [3, T]     past_b + i for the i-th token of request b (text M-RoPE: 3 equal rows)
    cumulative_sequence_lengths [B+1]   0, n_0, n_0+n_1, ...
    past_sequence_lengths [B]       tokens already in each request's KV
    block_table          [B, MB]    pages of each request, padded with the scratch block 0
    attention_metadata   [3]        [max n_b, max past_b + n_b, min past_b + n_b]

The KV pools are allocated once and bound through IOBinding as both the `past_key_values.L.*`
input and the `present.L.*` output, so ORT writes new K/V rows in place and nothing is copied per
step. Fixed state rows are gathered by the state bank into contiguous [B, ...] buffers.
Arrays are numpy on the CPU (the CUDA path adds device buffers bound by pointer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnxruntime as ort

from mtpserve.engine.manifest import ModelManifest, PagedKVLayer
from mtpserve.engine.state_bank import StepCaptures, StepStates


@dataclass
class PackedRows:
    """One request's rows in a packed forward: tokens at positions [past_len, past_len + len(token_ids))."""
    token_ids: Sequence[int]
    past_len: int
    block_table: Sequence[int]


@dataclass
class MainOutputs:
    logits: np.ndarray            # [T, V]
    hidden: np.ndarray            # [T, H]
    present: StepStates
    captures: StepCaptures | None


@dataclass
class HeadOutputs:
    logits: np.ndarray            # [T, V]
    hidden: np.ndarray            # [T, H] (hidden_states_out: feeds the next chained row)


def pack_rows(rows: Sequence[PackedRows], scratch_block: int = 0) -> dict[str, np.ndarray]:
    """The shared paged inputs for a list of requests' rows (see the module docstring)."""
    lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows))
    past = np.fromiter((r.past_len for r in rows), np.int64, len(rows))
    ids = np.fromiter((t for r in rows for t in r.token_ids), np.int64, int(lens.sum()))
    pos = np.repeat(past - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) + np.arange(ids.size)
    width = max(1, max(len(r.block_table) for r in rows))
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


class _PagedPool:
    """The K/V arrays of one graph's paged layers, with OrtValues aliasing them."""

    def __init__(self, layers: Sequence[PagedKVLayer], num_blocks: int, block_size: int):
        self.layers = tuple(layers)
        self.arrays: dict[str, np.ndarray] = {}
        self.ort_values: dict[str, ort.OrtValue] = {}
        for layer in self.layers:
            for name in (layer.key_input, layer.value_input):
                arr = np.zeros((num_blocks, block_size, layer.num_kv_heads, layer.head_size), layer.dtype)
                self.arrays[name] = arr
                self.ort_values[name] = ort.OrtValue.ortvalue_from_numpy(arr)

    def bind(self, io: ort.IOBinding, output_names: list[str]) -> None:
        for layer in self.layers:
            for name_in, name_out in ((layer.key_input, layer.key_output),
                                      (layer.value_input, layer.value_output)):
                io.bind_ortvalue_input(name_in, self.ort_values[name_in])
                io.bind_ortvalue_output(name_out, self.ort_values[name_in])
                output_names.append(name_out)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class Runner:
    """Runs packed steps of the main model and the MTP head on one device."""

    def __init__(self, manifest: ModelManifest, num_blocks: int, num_threads: int = 0,
                 providers: Sequence[str] = ("CPUExecutionProvider",)):
        self.manifest = manifest
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if num_threads:
            so.intra_op_num_threads = num_threads
            so.inter_op_num_threads = 1
        path = manifest.path
        self.session = ort.InferenceSession(str(path / "model.onnx"), so, providers=list(providers))
        self.kv = _PagedPool(manifest.kv_layers, num_blocks, manifest.block_size)
        self.head_session = None
        self.head_kv = None
        if manifest.mtp is not None:
            self.head_session = ort.InferenceSession(str(path / manifest.mtp.filename), so,
                                                     providers=list(providers))
            self.head_kv = _PagedPool(manifest.mtp.kv_layers, num_blocks, manifest.block_size)
        self._main_inputs = {i.name for i in self.session.get_inputs()}

    def run_main(self, rows: Sequence[PackedRows], states: StepStates,
                 capture_counts: np.ndarray) -> MainOutputs:
        """One packed forward of the main model. capture_counts[b] transitions are captured."""
        m = self.manifest
        io = self.session.io_binding()
        for name, arr in pack_rows(rows).items():
            if name in self._main_inputs:
                io.bind_cpu_input(name, arr)
        capture = bool(capture_counts.any())
        io.bind_cpu_input("state_update_capture_count", capture_counts.astype(np.int32))
        io.bind_cpu_input("state_update_active", np.array([int(capture)], np.int32))
        names = []
        for layer, arr in [(l, states.conv[l.layer_id]) for l in m.conv_layers] + \
                          [(l, states.recurrent[l.layer_id]) for l in m.recurrent_layers]:
            io.bind_cpu_input(layer.state_input, np.ascontiguousarray(arr))
            names += [layer.state_output, layer.capture_output]
        names += [m.logits_output, m.hidden_output]
        for name in names:
            io.bind_output(name)
        self.kv.bind(io, names)
        self.session.run_with_iobinding(io)
        out = dict(zip(names, io.get_outputs()))
        present = StepStates(
            conv={l.layer_id: out[l.state_output].numpy() for l in m.conv_layers},
            recurrent={l.layer_id: out[l.state_output].numpy() for l in m.recurrent_layers})
        captures = None
        if capture:
            captures = StepCaptures(
                conv_value={l.layer_id: out[l.capture_output].numpy() for l in m.conv_layers},
                recurrent_capsule={l.layer_id: out[l.capture_output].numpy() for l in m.recurrent_layers})
        return MainOutputs(out[m.logits_output].numpy(), out[m.hidden_output].numpy(), present, captures)

    def run_head(self, rows: Sequence[PackedRows], hidden: np.ndarray) -> HeadOutputs:
        """One packed forward of the MTP head: row j pairs hidden[j] with input token j."""
        head = self.manifest.mtp
        io = self.head_session.io_binding()
        for name, arr in pack_rows(rows).items():
            io.bind_cpu_input(name, arr)
        io.bind_cpu_input(head.hidden_input, np.ascontiguousarray(hidden, dtype=self.hidden_dtype))
        names = [head.logits_output, head.hidden_output]
        for name in names:
            io.bind_output(name)
        self.head_kv.bind(io, names)
        self.head_session.run_with_iobinding(io)
        out = dict(zip(names, io.get_outputs()))
        return HeadOutputs(out[head.logits_output].numpy(), out[head.hidden_output].numpy())

    @property
    def hidden_dtype(self) -> str:
        return next(t.dtype for t in self.manifest.outputs if t.name == self.manifest.hidden_output)
