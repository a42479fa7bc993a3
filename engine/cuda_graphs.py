"""Captured main-model steps on CUDA: decode and uniform verify steps replay a CUDA graph.

ORT's CUDA provider (``enable_cuda_graph=1``) captures a session's Run as one CUDA graph per
``gpu_graph_id`` run option and replays it afterwards, with every launch of every node in one
call (DESIGN §9: bundled decode 1.29 -> 0.37 ms, 1.4 B 3.87 -> 2.25 ms). A graph replays the
addresses it was captured with, so a captured step binds everything at a fixed place:

    inputs      one device block per graph, filled by ONE host -> device copy per step from a
                pinned staging block (input_ids, position_ids, past lengths, block table; the
                packed ranges and capture counts are constant per shape and written once)
    host inputs attention_metadata = [tokens per request, table width * block size, 1] and
                state_update_active, fixed per graph (read when the graph is captured)
    KV pools    bound in place, as in every step
    states      the state bank's rows [0, batch) directly (StateBank.padded_in_place):
                past = bank b, present = bank 1-b, so ORT's re-runs at capture are idempotent
    outputs     logits, hidden states and captures: prefixes of buffers shared by all graphs

A graph is keyed by ``GraphShape(batch, tokens, table_width, bank)``. A step of B requests, each
feeding 1 token plus the same number of drafts, runs the graph of the smallest captured batch
>= B and table width >= its longest KV; rows B.. are padding (token 0 at position 0 on the
scratch block 0, state rows that nobody reads). Every other step (prefill chunks, mixed draft
counts, rows not at 0..B-1) runs eagerly on the same session (``gpu_graph_id = -1``), but with
``EngineConfig.prompt_graphs`` a step of prompt chunks (and decode rows), no drafts, replays a
varlen graph (``PromptGraphs``: its ranges staged on the device, ``PromptCatalog``).

Every graph is captured at start-up (``StepGraphs.capture_all``), while the bank is empty: no
live step pays ORT's first-call cost of a new shape (0.5-0.85 s on the 1.4 B model).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from mtpserve.engine import launches
from mtpserve.engine.cuda_kernels import (
    advance_positions,
    argmax_rows,
    copy_columns,
    copy_rows,
    follow_catch_up,
    follow_verify,
    gather_rows,
)
from mtpserve.engine.pipeline import follow_verify_host
from mtpserve.engine.row_gather import gather_into, plan_gather, segment_destinations
from mtpserve.engine.runner import MainOutputs, PackedRows, Runner, _Binding, pack_rows
from mtpserve.engine.state_bank import StateBank, StepCaptures

logger = logging.getLogger("mtpserve")

SMALLEST_KV_BUCKET = 256      # tokens: the first block-table bucket; then powers of two up to the context
# rows a request of the MTP head's captured catch-up fills (HeadGraphs.fill): a new prompt's or a
# resumed request's rows, padded to the next of these; one forward holds at most the largest
HEAD_FILL_ROWS = (16, 64, 256)


class CaptureOutOfMemory(RuntimeError):
    """A graph captured at start-up did not fit the device's memory; the message says which graph,
    what the captures had taken, and which settings make them smaller."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the device running out of memory: ORT's arena ("Failed to allocate
    memory for requested buffer of size ...", session 18's 1.4 B MTP engine), CuPy's
    ``OutOfMemoryError`` (matched by name: no CuPy import here) or a CUDA allocation failure."""
    text = str(error)
    return (type(error).__name__ == "OutOfMemoryError" or "Failed to allocate memory" in text
            or "out of memory" in text.lower() or "cudaErrorMemoryAllocation" in text)


def capture_memory_message(what: str, shape: str, index: int, count: int,
                           taken_bytes: int, free_bytes: int, total_bytes: int, advice: str) -> str:
    """``CaptureOutOfMemory``'s message (``shape``: the catalog's ``describe``; ``advice``: the
    engine's settings to change)."""
    gib = 2 ** 30
    return (f"capturing CUDA graphs ran out of device memory at the {what} graph of {shape} ({index + 1} of "
            f"{count}, largest first): the captures had taken {taken_bytes / gib:.1f} GiB, {free_bytes / gib:.1f} GiB "
            f"of {total_bytes / gib:.1f} GiB is free. {advice}".rstrip())


@dataclass(frozen=True)
class GraphShape:
    """One captured step: ``batch`` padded requests feeding ``tokens`` rows each (1 = decode,
    1 + K = verify of K drafts), block tables ``table_width`` wide, past states in bank ``bank``."""
    batch: int
    tokens: int
    table_width: int
    bank: int


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 8, then ``max_batch`` itself."""
    sizes = {b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8)) | {max_batch}
    return tuple(sorted(sizes))


def table_width_buckets(block_size: int, context_length: int, smallest: int = SMALLEST_KV_BUCKET) -> tuple[int, ...]:
    """Block-table widths (in blocks) of the KV-length buckets: powers of two tokens from
    ``smallest`` up to the context (the last bucket is the whole context). A loose bound is
    not free for multi-token queries (DESIGN §9: a 4-token verify at B=8 took 4.35 -> 8.97 ms
    with max_kv_len 4096 instead of 100), so a step uses the tightest bucket that fits."""
    full = -(-context_length // block_size)
    widths, tokens = set(), smallest
    while tokens < context_length:
        widths.add(-(-tokens // block_size))
        tokens *= 2
    widths.add(full)
    return tuple(sorted(w for w in widths if w <= full))


def prompt_batch_sizes(largest: int) -> tuple[int, ...]:
    """Padded batches of captured prompt steps (``PromptCatalog``): powers of two from 2 below
    ``largest + 1``, then ``largest + 1`` itself. A prompt step of B requests takes a batch of at
    least B + 1: its padding rows go to the slots after them (the last one, at B = ``largest``,
    is the state bank's scratch row)."""
    sizes = {b for b in (2 ** i for i in range(1, largest.bit_length() + 1)) if b < largest + 1} | {largest + 1}
    return tuple(sorted(sizes))


def prompt_row_buckets(budget: int, smallest: int = 64) -> tuple[int, ...]:
    """Total rows of captured prompt steps: powers of two from ``smallest`` below the step's
    token budget, then the budget itself."""
    rows, sizes = smallest, set()
    while rows < budget:
        sizes.add(rows)
        rows *= 2
    sizes.add(budget)
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class PromptCatalog:
    """Which prompt steps are captured, and which one a step uses (no GPU in here). A prompt step
    (a prompt chunk, alone or beside decode rows; no drafts) is *varlen*: its requests feed
    different numbers of rows, their ranges staged on the device, so one graph serves every
    split of up to ``rows`` rows among up to ``batch - 1`` requests. ``GraphShape.tokens`` is the
    step's total rows here (``PromptGraphs``)::

        slots     | r0: 40 rows | r1: 1 | r2: 1 | pad: 11 | pad: 11 |     batch 5, 64 rows
        ranges    0            40      41      42        53        64
        KV        batch x bucket tokens (<= max_slot_tokens): what ORT's varlen attention holds

    ``max_slot_tokens``: the most slots x KV-bucket tokens of a captured shape (None: no bound).
    A shape's device memory goes with it, not with its rows: on the H100 the 1.4 B model's first
    capture, 65 slots at an 8192-token bucket, grew ORT's arena by 16.4 GiB at 2048 rows and
    alike at 512 (session 38), the other shapes then cut from it.
    """
    batch_sizes: tuple[int, ...]
    row_buckets: tuple[int, ...]
    table_widths: tuple[int, ...]
    block_size: int
    banks: tuple[int, ...] = (0, 1)
    max_slot_tokens: int | None = None

    def _within(self, batch: int, width: int) -> bool:
        return self.max_slot_tokens is None or batch * width * self.block_size <= self.max_slot_tokens

    def shapes(self) -> list[GraphShape]:
        """Every (batch, rows, width, bank) whose rows fit its slots: ``batch`` slots of at most
        ``width`` blocks each hold ``rows``, and there are at least as many rows as slots (ORT's
        varlen kernels refuse fewer: "total_tokens must be at least batch_size"), within
        ``max_slot_tokens``. No step ``choose``s a shape that is not one of these."""
        return [GraphShape(b, t, w, bank) for t in self.row_buckets for w in self.table_widths
                for b in self.batch_sizes for bank in self.banks
                if b <= t <= b * w * self.block_size and self._within(b, w)]

    def capture_order(self) -> list[GraphShape]:
        """Largest first (``GraphCatalog.capture_order``: ORT's arena then cuts the later
        shapes' buffers from the first ones' free chunks)."""
        return sorted(self.shapes(), key=lambda s: (s.tokens, s.batch * s.table_width, s.bank), reverse=True)

    def summary(self) -> str:
        bound = "" if self.max_slot_tokens is None else f", slots x KV bucket <= {self.max_slot_tokens} tokens"
        return (f"batch {list(self.batch_sizes)}, rows in all {list(self.row_buckets)}, KV buckets "
                f"{[w * self.block_size for w in self.table_widths]} tokens{bound}, {len(self.banks)} state bank(s)")

    def describe(self, shape: GraphShape) -> str:
        return (f"{shape.batch} requests, {shape.tokens} rows in all, KV bucket "
                f"{shape.table_width * self.block_size} tokens")

    def choose(self, lengths: Sequence[int], kv_lens: Sequence[int]) -> tuple[int, int, int] | None:
        """``(batch, rows, table_width)`` for a step whose request i feeds ``lengths[i]`` rows and
        reaches ``kv_lens[i]`` tokens of KV, or None when no captured shape fits: the smallest
        batch with a slot to spare, the smallest row bucket that holds the rows and no fewer
        rows than slots, and a table width that holds the longest KV and each padding slot's
        rows (they sit at positions 0.. on the scratch block: a row past the table's width would
        write outside it)."""
        B, n = len(lengths), sum(lengths)
        if not B or not n:
            return None
        batch = next((b for b in self.batch_sizes if b >= B + 1), None)
        rows = next((t for t in self.row_buckets if t >= n and t >= (batch or 0)), None)
        if rows is None or batch is None:
            return None
        per_slot = -(-(rows - n) // (batch - B))
        blocks = -(-max(max(kv_lens), per_slot) // self.block_size)
        width = next((w for w in self.table_widths if w >= blocks), None)
        if width is None or not self._within(batch, width):     # (a larger batch or width: larger still)
            return None
        return batch, rows, width


@dataclass(frozen=True)
class GraphCatalog:
    """Which step shapes are captured, and which one a step uses (no GPU in here)."""
    batch_sizes: tuple[int, ...]
    token_counts: tuple[int, ...]
    table_widths: tuple[int, ...]
    block_size: int
    banks: tuple[int, ...] = (0, 1)       # the main model's past-state bank; (0,) for the stateless head
    max_rows: int | None = None           # shapes of more rows (batch x tokens) are not captured

    def shapes(self) -> list[GraphShape]:
        return [GraphShape(b, n, w, bank) for n in self.token_counts for w in self.table_widths
                for b in self.batch_sizes for bank in self.banks
                if self.max_rows is None or b * n <= self.max_rows]

    def capture_order(self) -> list[GraphShape]:
        """``shapes()`` largest first: by batch x table width (what sizes a multi-token step's
        attention buffers: ORT's PagedAttention without flash kernels for 16-token blocks
        gathers each request's whole KV bucket into a dense K and V, batch x width x block x
        heads x head size each), then rows per request. ORT's arena grows in regions of powers
        of two and never merges them: captured smallest first, each larger shape added a region
        beside the free ones, and a 1.4 B model's MTP engine took ~30 GiB of captures (session
        18, captured in growing order). Captured largest first, the later shapes can be cut from
        the first ones' free chunks (not yet measured on the device)."""
        return sorted(self.shapes(), key=lambda s: (s.batch * s.table_width, s.tokens, s.bank), reverse=True)

    def batch_for(self, num_requests: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= num_requests), None)

    def summary(self) -> str:
        return (f"batch {list(self.batch_sizes)}, rows per request {list(self.token_counts)}, KV buckets "
                f"{[w * self.block_size for w in self.table_widths]} tokens, {len(self.banks)} state bank(s)")

    def describe(self, shape: GraphShape) -> str:
        return (f"{shape.batch} requests x {shape.tokens} rows, KV bucket "
                f"{shape.table_width * self.block_size} tokens")

    def fill_groups(self, lengths: Sequence[int], fill_counts: Sequence[int]) -> list[tuple[list[int], int, int]]:
        """Captured forwards for catch-up pieces of ``lengths`` rows, one piece a request:
        ``(pieces, batch, tokens)`` each, ``tokens`` the smallest of ``fill_counts`` that holds its
        longest piece, ``batch x tokens`` within ``max_rows``. Longest pieces first, so pieces of
        like lengths share a forward; a piece longer than every count is left out (eager)::

            lengths 200, 9, 5, 3   fill counts 16, 64, 256   max_rows 256
            -> ([0], 1, 256), ([1, 2, 3], 4, 16)
        """
        order = sorted((i for i, n in enumerate(lengths) if n <= max(fill_counts, default=0)), key=lambda i: -lengths[i])
        groups: list[tuple[list[int], int, int]] = []
        for i in order:
            if groups:
                pieces, _, tokens = groups[-1]
                batch = self.batch_for(len(pieces) + 1)
                if batch is not None and (self.max_rows is None or batch * tokens <= self.max_rows):
                    pieces.append(i)
                    groups[-1] = (pieces, batch, tokens)
                    continue
            tokens = next(t for t in sorted(fill_counts) if t >= lengths[i])
            groups.append(([i], self.batch_for(1), tokens))
        return groups

    def width_for(self, kv_len: int) -> int | None:
        blocks = -(-kv_len // self.block_size)
        return next((w for w in self.table_widths if w >= blocks), None)

    def choose(self, num_rows: Sequence[int], num_tokens: Sequence[int], kv_lens: Sequence[int]) -> tuple[int, int, int] | None:
        """``(batch, tokens, table_width)`` for a step whose request i feeds ``num_tokens[i]`` new
        tokens in ``num_rows[i]`` rows (tokens + drafts) and reaches ``kv_lens[i]`` tokens of KV,
        or None when no captured graph fits: a prompt chunk, draft counts that differ, more
        requests or a longer KV than any graph's."""
        if not num_rows or any(t != 1 for t in num_tokens):
            return None
        n = num_rows[0]
        if n not in self.token_counts or any(r != n for r in num_rows):
            return None
        batch, width = self.batch_for(len(num_rows)), self.width_for(max(kv_lens))
        if batch is None or width is None:
            return None
        return batch, n, width


class _StaticInputs:
    """One graph's device inputs at fixed addresses, and their pinned host staging::

        pinned host  | input_ids | position_ids | cu_seqlens | past | block_table | capture |
        device       the same bytes, one copy per step; each input bound at base + its offset
    """

    def __init__(self, layout: dict[str, tuple[type, tuple[int, ...]]], xp):
        offsets, end = {}, 0
        for name, (dtype, shape) in layout.items():
            offsets[name] = end
            end += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 8) * 8
        self._ranges = {name: (offsets[name], int(np.prod(shape)) * np.dtype(dtype).itemsize)
                        for name, (dtype, shape) in layout.items()}
        self.nbytes = max(end, 8)
        self.on_device = xp is not np
        if self.on_device:
            import cupy
            self._pinned = cupy.cuda.alloc_pinned_memory(self.nbytes)
            self._host_bytes = np.frombuffer(self._pinned, np.uint8, self.nbytes)
            self._host_bytes[:] = 0
            self.device_bytes = xp.zeros(self.nbytes, np.uint8)
        else:                  # (the CPU: one block, staged where it is read; uploads are no-ops)
            self._host_bytes = self.device_bytes = np.zeros(self.nbytes, np.uint8)
        self.host, self.device = {}, {}
        for name, (dtype, shape) in layout.items():
            at, size = offsets[name], int(np.prod(shape)) * np.dtype(dtype).itemsize
            self.host[name] = self._host_bytes[at:at + size].view(dtype).reshape(shape)
            self.device[name] = self.device_bytes[at:at + size].view(dtype).reshape(shape)
        if self.on_device:
            import cupy
            self._sent = cupy.cuda.Event(block=False, disable_timing=True)
            self._sent.record()
        else:
            self._sent = _NoEvent()
        self.staged = _StagedTables()       # the block tables the staging holds

    def writable(self) -> dict[str, np.ndarray]:
        """The host staging views, once the previous step's copy has read them."""
        self._sent.synchronize()
        return self.host

    def upload(self, name: str | None = None) -> None:
        """One host -> device copy of the whole block (or of input ``name`` alone), on the current
        stream (asynchronous)."""
        if not self.on_device:
            return
        import cupy
        at, size = (0, self.nbytes) if name is None else self._ranges[name]
        launches.copy(self.device_bytes.data.ptr + at, self._host_bytes.ctypes.data + at, size,
                      cupy.cuda.runtime.memcpyHostToDevice)
        launches.record(self._sent)


@dataclass
class _Graph:
    binding: _Binding
    inputs: _StaticInputs
    run_options: ort.RunOptions  # carries the graph's gpu_graph_id
    host_arrays: list            # host inputs read at capture: kept alive with the graph
    replay: Callable[[], None]   # ORT's run of this binding and options (a replay once captured)


def _bound_run(session: ort.InferenceSession, binding: _Binding, options: ort.RunOptions) -> Callable[[], None]:
    """``session.run_with_iobinding(binding.io, options)`` as one call: the C++ session's own
    method where the Python wrapper has one (``_sess``; the wrapper re-reads the graph id from
    the options and checks for WebGPU capture on every call, ~10 us of host time a draft step's
    three replays in session 29's py-spy), else the wrapper's."""
    inner, io = getattr(session, "_sess", None), getattr(binding.io, "_iobinding", None)
    if inner is None or io is None or not hasattr(inner, "run_with_iobinding"):
        return functools.partial(session.run_with_iobinding, binding.io, options)
    return functools.partial(inner.run_with_iobinding, io, options)


class _GraphSet:
    """The captured graphs of one session, by shape, and what capturing and replaying them cost."""
    what = "graph"
    graph_id_base = 0
    on_device = True         # False: bindings on the CPU, run eagerly (PromptGraphs' CPU mode, for tests)

    def __init__(self, session: ort.InferenceSession, catalog: GraphCatalog):
        self.session, self.catalog = session, catalog
        self._graphs: dict[GraphShape, _Graph] = {}
        self.num_replays = 0
        self.capture_seconds = 0.0
        self.memory_bytes = 0          # device memory the captures took (graphs + ORT's arena growth)
        self.memory_by_shape: dict[GraphShape, int] = {}     # what each capture took, in capture order

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def capture_all(self, progress: Callable[[str], None] | None = None, advice: str = "") -> None:
        """Capture every shape of the catalog (``_capture`` binds one, ``_add`` captures it);
        ``CaptureOutOfMemory`` (with ``advice``) when one does not fit."""
        seconds, nbytes = _capture_shapes(self.what, self.catalog, self._graphs, self._capture, progress, advice,
                                          on_device=self.on_device, by_shape=self.memory_by_shape)
        self.capture_seconds += seconds
        self.memory_bytes += nbytes

    def _capture(self, shape: GraphShape) -> None:
        raise NotImplementedError

    def _add(self, shape: GraphShape, binding: _Binding, inputs: _StaticInputs, host_arrays: list) -> None:
        """Capture ``binding`` as the graph of ``shape``: ORT's warm-up runs, then the capture."""
        options = ort.RunOptions()
        # 0 is ORT's default id; sets of one session keep apart by their base (PromptGraphs')
        options.add_run_config_entry("gpu_graph_id", str(self.graph_id_base + len(self._graphs) + 1))
        # a replay returns once it is queued: everything after it runs on the same stream, and the
        # host waits only where it reads a result (the step's drafts, its accepted tokens)
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self.session.run_with_iobinding(binding.io, options)
        self._graphs[shape] = _Graph(binding, inputs, options, host_arrays, _bound_run(self.session, binding, options))

    def _replay(self, graph: _Graph) -> None:
        launches.replay(self, graph)
        self.num_replays += 1


class _MainGraphs(_GraphSet):
    """A set of the main model's graphs over the state bank's rows ``[0, batch)`` (``StepGraphs``,
    ``PromptGraphs``): the logits, hidden and capture buffers its graphs write prefixes of, and
    how a graph binds them and the bank."""

    def __init__(self, runner: Runner, bank: StateBank, catalog, xp, max_batch: int, max_rows: int):
        if max_batch > bank.max_rows:
            raise ValueError(f"{self.what} graph batch {max_batch} > the state bank's {bank.max_rows} rows")
        super().__init__(runner.session, catalog)
        self.runner, self.bank, self.xp = runner, bank, xp
        m = runner.manifest
        self.logits = xp.empty((max_rows, m.vocab_size), m.compute_dtype)
        self.hidden = xp.empty((max_rows, m.hidden_size), runner.hidden_dtype)
        conv0, rec0, C = m.conv_layers[0], m.recurrent_layers[0], m.capture_capacity
        ids = bank.spec.layer_ids
        self.captures = StepCaptures(ids, xp.empty((len(ids), max_batch, C, conv0.conv_dim), conv0.dtype),
                                     xp.empty((len(ids), max_batch, C * rec0.capsule_width_per_token), np.float32))

    def capture_all(self, progress: Callable[[str], None] | None = None, advice: str = "") -> None:
        """Capture every shape of the catalog (the bank must be empty: a capture writes rows)."""
        if self.bank.num_resident_rows:
            raise AssertionError("graphs are captured before any request holds a state row")
        super().capture_all(progress, advice)

    def _bind_outputs(self, b: _Binding, shape: GraphShape, rows: int) -> None:
        """Bind a graph's states (bank ``shape.bank``'s rows ``[0, batch)`` past, the other bank's
        present), its captures, and ``rows`` rows of logits and hidden states."""
        m, bank, B = self.runner.manifest, self.bank, shape.batch
        index = {layer_id: i for i, layer_id in enumerate(bank.spec.layer_ids)}
        past, present = shape.bank, 1 - shape.bank
        for layer in m.conv_layers:
            i = index[layer.layer_id]
            b.bind_at(layer.state_input, bank.conv[i, past, :B])
            b.bind_at(layer.state_output, bank.conv[i, present, :B], output=True)
            b.bind_at(layer.capture_output, self.captures.conv_value[i, :B], output=True)
        for layer in m.recurrent_layers:
            i = index[layer.layer_id]
            b.bind_at(layer.state_input, bank.recurrent[i, past, :B])
            b.bind_at(layer.state_output, bank.recurrent[i, present, :B], output=True)
            b.bind_at(layer.capture_output, self.captures.recurrent_capsule[i, :B], output=True)
        b.bind_at(m.logits_output, self.logits[:rows], output=True)
        b.bind_at(m.hidden_output, self.hidden[:rows], output=True)


class StepGraphs(_MainGraphs):
    """Every captured main-model step of one engine, and the buffers they share.

    ``run(request_ids, rows, num_tokens)`` replays the step's graph and returns its outputs, or
    None when the step has no graph (the engine then runs it eagerly). ``num_replays`` and
    ``num_eager`` count the decode-shaped steps of each kind.
    """

    what = "main model"

    def __init__(self, runner: Runner, bank: StateBank, catalog: GraphCatalog, xp):
        if not runner.cuda_graphs:
            raise AssertionError("the runner's main session was made without enable_cuda_graph")
        max_batch = max(catalog.batch_sizes)
        max_tokens = max_batch * max(catalog.token_counts)
        super().__init__(runner, bank, catalog, xp, max_batch, max_tokens)
        m = runner.manifest
        self.hidden_copies = _RowCopies(m.hidden_size, runner.hidden_dtype, max(1024, 4 * max_tokens), xp)
        self.num_eager = 0
        self.num_device_drafts = 0     # verify steps whose drafts came from the device
        self.num_steady = 0            # draft continuations staged from the step before on the device
        self._latest: StagedStep | None = None     # the last replayed step's inputs
        # a steady draft continuation starts from the step before's inputs on the device (off: the
        # host stages every step). Its effect on throughput is within noise: off ran 0.996x on
        # (H100, bundled, K=2, C=16, waves, 3 rounds; results/h200 session 31)
        self.steady_staging = True

    # ------------------------------------------------------------------ capture
    def _capture(self, shape: GraphShape) -> None:
        r, m, xp = self.runner, self.runner.manifest, self.xp
        B, n = shape.batch, shape.tokens
        T = B * n
        b, inputs, host_arrays = _paged_graph_inputs(r.session, r.kv, r.main_input_names, shape, m.block_size, xp,
                                                     {"state_update_active": np.array([int(n > 1)], np.int32)})
        if "state_update_capture_count" in inputs.host:
            inputs.writable()["state_update_capture_count"][:] = n - 1
            inputs.upload()
        self._bind_outputs(b, shape, T)
        self._add(shape, b, inputs, host_arrays)

    # ------------------------------------------------------------------ a step
    def run(self, request_ids: Sequence[str], rows: Sequence[PackedRows], num_tokens: Sequence[int],
            copy_hidden: bool, device_drafts=None, input_tokens=None, after=None,
            follows: StagedStep | None = None) -> MainOutputs | None:
        """Replay the graph of a decode / uniform verify step (rows in the step's order; request
        i feeds ``num_tokens[i]`` new tokens); None if the step has none. ``copy_hidden``: the
        hidden rows are kept past this step (the proposer's catch-up), so they are copied out of
        the shared buffer. ``device_drafts``: ``[B, K]`` on the device, every request's drafts
        (its rows' draft ids are placeholders then): copied into the input ids on the device.
        ``input_tokens``: int64 ``[B]`` on the device, a decode step's input ids (the rows' ids
        are placeholders then; overlapped decoding), copied likewise. ``after``: ``(accepted,
        K1)`` of the launched draft step this verify continues (``pipeline``): the rows were
        staged as if that step kept all its K1 rows (``past_len`` = its base + K1, id 0
        placeholders) and are moved to its accepted counts on the device, the fed token being
        its last emitted one (``cuda_kernels.follow_verify``). ``follows``: with ``after``, the
        ``StagedStep`` of that draft step's own replay: when it is still this set's latest and
        its requests, rows a request and table width are this step's, its inputs on the device
        are this step's moved by the accepted counts, so they are copied from there (one device
        copy; a request's new block table uploaded alone) and moved on the device, with no host
        staging (a steady pipeline of draft steps: ``_steady``)."""
        lens = [len(r.token_ids) for r in rows]
        choice = self.catalog.choose(lens, num_tokens, [r.past_len + n for r, n in zip(rows, lens)])
        if choice is None:
            return None
        batch, n, width = choice
        tables = tuple(r.block_table for r in rows)
        return self._replay_step(request_ids, batch, n, width, tables, copy_hidden,
                                 lambda host, staged: _fill_step(host, rows, n, width, staged),
                                 device_drafts, input_tokens, after, follows)

    def run_after(self, request_ids: Sequence[str], past: np.ndarray, tables: tuple, n: int, copy_hidden: bool,
                  device_drafts, after, follows: StagedStep | None = None) -> MainOutputs | None:
        """``run`` of a draft continuation whose drafts are on the device, without a row object a
        request: request b feeds ``n`` rows (its token and the drafts, ids written on the device)
        from ``past[b]`` (int64, as if ``after`` kept all its rows) with block table ``tables[b]``."""
        if n not in self.catalog.token_counts:
            return None
        batch, width = self.catalog.batch_for(len(request_ids)), self.catalog.width_for(int(past.max()) + n)
        if batch is None or width is None:
            return None
        return self._replay_step(request_ids, batch, n, width, tables, copy_hidden,
                                 lambda host, staged: _stage_uniform(host, past, tables, n, width, staged),
                                 device_drafts, None, after, follows)

    def _replay_step(self, request_ids: Sequence[str], batch: int, n: int, width: int, tables: tuple,
                     copy_hidden: bool, stage: Callable, device_drafts, input_tokens, after,
                     follows: StagedStep | None) -> MainOutputs | None:
        """``run``'s replay of the chosen shape: the bank's rows placed, the inputs staged (``stage(host,
        staged)`` on the host, or from ``follows`` on the device), ids and positions moved on the
        device, the graph replayed, its outputs."""
        placed = self.bank.padded_in_place(request_ids, batch)
        if placed is None:
            self.num_eager += 1
            return None
        bank, present = placed
        graph = self._graphs[GraphShape(batch, n, width, bank)]
        steady = (self.steady_staging and after is not None
                  and (device_drafts is not None or n == 1)       # (else the host's draft ids)
                  and self._steady(follows, request_ids, n, width))
        if steady:                         # follows' inputs, moved below by its accepted counts
            if follows.graph is not graph:
                copy_rows(graph.inputs.device_bytes, follows.graph.inputs.device_bytes, graph.inputs.nbytes)
            if not _same(tables, follows.tables):       # a request took a block: its tables from the host
                _fill_tables(graph.inputs.writable(), tables, width, graph.inputs.staged)
                graph.inputs.upload("block_table")
            self.num_steady += 1
        else:
            stage(graph.inputs.writable(), graph.inputs.staged)
            graph.inputs.upload()
        self._latest = StagedStep(graph, tuple(request_ids), tables, n, width)
        if device_drafts is not None:      # input ids [batch, 1 + K]: columns 1.. are the drafts
            if after is None:              # (with after, follow_verify writes them in its launch)
                copy_columns(graph.inputs.device["input_ids"].reshape(batch, n), device_drafts, 1)
            self.num_device_drafts += 1
        B = len(request_ids)
        if input_tokens is not None:
            if n != 1:
                raise AssertionError("input_tokens feeds a decode step (one row per request)")
            copy_rows(graph.inputs.device["input_ids"], input_tokens, B)
        if after is not None:              # staged for K1 kept rows: moved by kept - K1; steady: by kept
            dev = graph.inputs.device
            follow_verify(after[0], after[1], n, dev["past_sequence_lengths"], dev["position_ids"],
                          dev["input_ids"], drafts=device_drafts, staged=0 if steady else None)
        self._replay(graph)
        T = B * n
        hidden = self.hidden_copies.copy(self.hidden, T) if copy_hidden else self.hidden[:T]
        captures = None
        if n > 1:
            captures = StepCaptures(self.captures.layer_ids, self.captures.conv_value[:, :B],
                                    self.captures.recurrent_capsule[:, :B])
        return MainOutputs(self.logits[:T], hidden, present, captures, staging=self._latest)

    def shares(self, hidden) -> bool:
        """Whether ``hidden`` is rows of the replays' own hidden buffer (a step run with
        ``copy_hidden=False``): valid only until the next replay writes it."""
        return getattr(hidden, "base", None) is self.hidden

    def _steady(self, follows: StagedStep | None, request_ids: Sequence[str], n: int, width: int) -> bool:
        """Whether ``follows`` (the launched step this one continues) is the latest staging and
        holds this step's requests in order, ``n`` rows each, at table width ``width`` (its block
        tables may differ: ``KVPool.block_array`` makes a new one when a request takes a block,
        every ``block_size`` tokens)."""
        return (follows is not None and follows is self._latest and follows.n == n and follows.width == width
                and follows.request_ids == tuple(request_ids))


class PromptGraphs(_MainGraphs):
    """Captured prompt steps (``PromptCatalog``): a step that feeds a prompt chunk, alone or
    beside decode rows, with no drafts, replays the graph of its padded batch, total rows and KV
    bucket instead of running ORT eagerly (~2.3 ms of host time a prompt step on the bundled
    model: session 30's py-spy, results/h200 session 33). The rows are staged varlen
    (``_stage_varlen``); the state rows are the bank's ``[0, batch)``, placed as a decode
    graph's (``StateBank.padded_in_place``), the padding slots' rows free, outside the step or
    the bank's scratch row. Opt-in (``EngineConfig.prompt_graphs``): start-up checks a replay
    against ORT's eager run of the same inputs on new ranges (``check``) and keeps the eager
    path if they differ."""

    what = "prompt"
    graph_id_base = 1_000_000        # after the decode graphs' ids on the same session

    def __init__(self, runner: Runner, bank: StateBank, catalog: PromptCatalog, xp):
        """On the CPU (``xp`` numpy) nothing is captured: each shape's binding runs eagerly, the
        same padded step, so the staging, the placement and the engine's use of them run in
        tests without a GPU (slower than the plain eager step: the padding rows are computed)."""
        self.on_device = xp is not np
        if self.on_device and not runner.cuda_graphs:
            raise AssertionError("the runner's main session was made without enable_cuda_graph")
        super().__init__(runner, bank, catalog, xp, max(catalog.batch_sizes), max(catalog.row_buckets))
        self.num_eager = 0            # prompt steps no captured shape or placement fitted
        self.forward_error = 0.0      # ``check``'s largest logit difference from the unpadded eager forward
        self._moved_buffers: dict[int, object] = {}      # a prompt continuation's gathered acceptance rows

    def _capture(self, shape: GraphShape) -> None:
        r, m = self.runner, self.runner.manifest
        # (not bound: the rows of a draft step's acceptance that a prompt continuation's slots
        # take, ``gather_rows``' [2, batch] index, sent with the step's one copy)
        b, inputs, host_arrays = _paged_graph_inputs(r.session, r.kv, r.main_input_names, shape, m.block_size, self.xp,
                                                     {"state_update_active": np.array([0], np.int32)},
                                                     extra={"moved_rows": (np.int64, (2, shape.batch))}, varlen=True)
        self._bind_outputs(b, shape, shape.tokens)
        self._add(shape, b, inputs, host_arrays)

    def run(self, request_ids: Sequence[str], rows: Sequence[PackedRows], copy_hidden: bool,
            follow=None) -> MainOutputs | None:
        """Replay the graph of a prompt step (rows in the step's order, no drafts); None when no
        captured shape fits or its requests do not hold state rows ``0 .. B-1`` in one bank (the
        step then runs eagerly). ``copy_hidden``: the hidden rows are kept past this step.
        ``follow``: ``(accepted, K1, moved)`` of the launched draft step this prompt step
        continues (``pipeline``, prompt continuations): the step's first ``len(moved)`` requests,
        one row each, are that step's requests ``moved`` (its acceptance rows), staged as if it
        kept all its K1 rows, and moved to its acceptance on the device (``follow_verify``; those
        rows gathered first with ``gather_rows`` when ``moved`` is not ``0 .. B-1``)."""
        lengths = [len(r.token_ids) for r in rows]
        choice = self.catalog.choose(lengths, [r.past_len + n for r, n in zip(rows, lengths)])
        placed = None if choice is None else self.bank.padded_in_place(request_ids, choice[0])
        if placed is None:
            self.num_eager += 1
            return None
        (batch, total, width), (bank, present) = choice, placed
        graph = self._graphs.get(GraphShape(batch, total, width, bank))
        if graph is None:               # (choose takes only shapes whose slots hold the rows: all captured)
            self.num_eager += 1
            return None
        host = graph.inputs.writable()
        _stage_varlen(host, rows, batch, total, width, graph.inputs.staged)
        if follow is not None:
            accepted, k1, moved = follow
            gather = list(moved) != list(range(len(accepted)))       # some of its rows, or in another order
            if gather:
                host["moved_rows"][0, :len(moved)] = np.arange(len(moved))
                host["moved_rows"][1, :len(moved)] = moved
        graph.inputs.upload()
        if follow is not None:
            dev = graph.inputs.device
            if gather:
                accepted = self._moved_acceptance(accepted, dev["moved_rows"], moved)
            move = follow_verify if self.on_device else follow_verify_host
            move(accepted, k1, 1, dev["past_sequence_lengths"], dev["position_ids"], dev["input_ids"])
        self._replay(graph)
        n, B = sum(lengths), len(rows)
        hidden = self.hidden[:n].copy() if copy_hidden else self.hidden[:n]
        captures = StepCaptures(self.captures.layer_ids, self.captures.conv_value[:, :B],
                                self.captures.recurrent_capsule[:, :B])
        return MainOutputs(self.logits[:n], hidden, present, captures)

    def _moved_acceptance(self, accepted, index, moved: Sequence[int]):
        """Rows ``moved`` of a draft step's acceptance ``accepted`` [B, K1 + 1], in a buffer of this
        set (one a width): on the device one ``gather_rows`` by ``index`` (the step's staged
        [2, batch] ``moved_rows``, uploaded with its inputs: no copy of its own to wait on)."""
        n, width = len(moved), accepted.shape[1]
        buffer = self._moved_buffers.get(width)
        if buffer is None:
            buffer = self._moved_buffers[width] = self.xp.empty((max(self.catalog.batch_sizes), width), np.int64)
        if not self.on_device:
            buffer[:n] = accepted[np.asarray(moved)]
        else:
            gather_rows(buffer, accepted, index, 0, n)
        return buffer[:n]

    def check(self, num_blocks: int) -> str | None:
        """Whether a replay computes what ORT's eager run of the same binding computes on new
        ranges (a capture that kept the ranges it was captured with would not), and whether the
        padded step's logits stay near the engine's eager forward of the rows alone
        (``Runner.run_main``: no padding, tight bounds; a kernel may round differently at another
        row count, but a padding row or an empty slot that reached a real row would not round).
        Two steps of prompts from an empty state on free KV blocks ``1 ..`` and state rows ``0 ..``
        of the empty bank, each followed by a mixed step (request 0 a 3-row chunk, the others a
        decode row each): ``batch - 1`` requests over half the shape's rows (one padding slot),
        then ``batch - 3`` over all but one (two empty slots beside the padding one, as live steps
        have them). None when every replay equals its eager run bit for bit and every logit lies
        within ``forward_tolerance`` of the forward's, else what differed (or that the pool is too
        small to check). ``forward_error``: the largest logit difference from the forward seen.
        Call it after ``capture_all``, before any request holds a row."""
        # the fewest rows and the tightest bucket, with as many requests as leave each ~4 rows
        small = min((s.tokens, s.table_width) for s in self._graphs)
        shape = max((s for s in self._graphs if s.bank == 0 and (s.tokens, s.table_width) == small
                     and s.batch - 1 <= s.tokens // 4), key=lambda s: s.batch)
        cases = [(shape.batch - 1, shape.tokens // 2), (max(1, shape.batch - 3), shape.tokens - 1)]
        self.forward_error = 0.0
        try:
            for seed, (B, rows) in enumerate(cases):
                why = self._check(shape, B, rows, seed, num_blocks)
                if why is not None:
                    return why
            return None
        finally:
            self.bank.conv[:] = 0
            self.bank.recurrent[:] = 0

    @staticmethod
    def forward_tolerance(forward) -> float:
        """How far a padded step's logits may lie from the unpadded forward's: 5% of the largest
        logit, plus 0.05 (rounding at another row count moves fp16 logits by hundredths; a real
        row that read a padding row's KV or an empty slot's state moves them by units)."""
        return 0.05 * float(abs(forward).max()) + 0.05

    def _check(self, shape: GraphShape, B: int, first: int, seed: int, num_blocks: int) -> str | None:
        """``check``'s prompts step (``first`` rows among ``B`` requests) and the mixed step after it."""
        from mtpserve.engine.state_bank import StepStates
        xp, m, ids, bs = self.xp, self.runner.manifest, self.bank.spec.layer_ids, self.catalog.block_size
        graph = self._graphs[shape]
        rng = np.random.default_rng(seed)
        more = [3] + [1] * (B - 1)
        split = _split(first, B, seed)
        starts = np.concatenate([[1], 1 + np.cumsum([-(-(k + j) // bs) for k, j in zip(split, more)])])
        if starts[-1] > num_blocks:          # (unchecked is not checked: off, with the reason)
            return f"they could not be checked: the check takes {int(starts[-1])} KV blocks, the pool has {num_blocks}"
        tables = [list(range(int(starts[b]), int(starts[b + 1]))) for b in range(B)]
        past = self.bank.spec.zero_states(B, xp)
        for lengths, past_lens in ((split, [0] * B), (more, split)):
            rows = [PackedRows(rng.integers(1, m.vocab_size, k).tolist(), p, t)
                    for k, p, t in zip(lengths, past_lens, tables)]
            n = sum(lengths)
            forward = self.runner.run_main(rows, past, np.zeros(B, np.int32)).logits[:n].copy()
            self.bank.conv[:, 0, :B] = past.conv
            self.bank.recurrent[:, 0, :B] = past.recurrent
            _stage_varlen(graph.inputs.writable(), rows, shape.batch, shape.tokens, shape.table_width,
                          graph.inputs.staged)
            graph.inputs.upload()
            self.session.run_with_iobinding(graph.binding.io, self.runner.eager_options)
            reference = (self.logits[:n].copy(), self.bank.conv[:, 1, :B].copy(), self.bank.recurrent[:, 1, :B].copy())
            self._replay(graph)
            replayed = (self.logits[:n], self.bank.conv[:, 1, :B], self.bank.recurrent[:, 1, :B])
            for name, a, b in zip(("logits", "conv states", "recurrent states"), replayed, reference):
                if not bool((a == b).all()):
                    err = float(xp.abs(a.astype(np.float32) - b.astype(np.float32)).max())
                    return (f"a replay's {name} differ from ORT's eager run of the same inputs (max error {err:g}) for "
                            f"rows {lengths} at past lengths {past_lens}")
            err = float(xp.abs(reference[0].astype(np.float32) - forward.astype(np.float32)).max())
            self.forward_error = max(self.forward_error, err)
            tolerance = self.forward_tolerance(forward.astype(np.float32))
            if not err <= tolerance:
                return (f"a replay's logits lie {err:g} from the unpadded eager forward (more than {tolerance:g}) for "
                        f"rows {lengths} at past lengths {past_lens} in {shape.batch} slots of {shape.tokens} rows")
            past = StepStates(ids, reference[1], reference[2])
        return None


def _split(rows: int, requests: int, seed: int) -> list[int]:
    """``rows`` rows among ``requests`` requests, each at least one (``PromptGraphs.check``)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, rows), requests - 1, replace=False)) if requests > 1 else np.array([], int)
    return np.diff(np.concatenate([[0], cuts, [rows]])).astype(int).tolist()


def _stage_varlen(host: dict[str, np.ndarray], rows: Sequence[PackedRows], batch: int, total: int, width: int,
                  staged: _StagedTables | None = None) -> None:
    """A prompt step's rows into a varlen graph's staging (``PromptCatalog``): ``pack_rows`` of
    request b's rows in slot b, then the rows left to ``total`` spread over the padding slots
    B .. batch-1 (token 0 at past 0, on the scratch block 0)::

        input_ids      r0: t t .. t | r1: t | .. | pad: 0 .. 0 | pad: 0 .. 0
        ranges         0 .. cumulative lengths .. total
        positions      past_b + i of each row (padding slots: 0 .. their rows - 1)
        block_table    row b: request b's first `width` blocks, then 0 (scratch)
    """
    B, n = len(rows), sum(len(r.token_ids) for r in rows)
    spare = total - n
    if B >= batch or spare < 0:
        raise AssertionError(f"{B} requests of {n} rows do not fit a prompt graph of batch {batch}, {total} rows")
    pads = batch - B
    padding = [PackedRows([0] * (spare // pads + (i < spare % pads)), 0, ()) for i in range(pads)]
    packed = pack_rows([*rows, *padding])
    for name in ("input_ids", "position_ids", "cumulative_sequence_lengths", "past_sequence_lengths"):
        host[name][:] = packed[name]
    _fill_tables(host, tuple(r.block_table for r in rows), width, staged)


@dataclass(eq=False)
class StagedStep:
    """What a replayed main-model step's inputs hold on the device (``StepGraphs.run``'s token:
    the next draft step, if it is steady, starts from them instead of the host's staging)."""
    graph: _Graph
    request_ids: tuple
    tables: tuple
    n: int
    width: int


class _RowCopies:
    """Copies of the first rows of a shared output buffer (the hidden rows a step's head catch-up
    needs later), packed into chunks of ``chunk_rows`` rows::

        chunk   | step n's T rows | step n+1's | ... | (free) |     one D2D memcpy per copy
        a copy  a view of its rows: it keeps its chunk alive, and a chunk goes back to CuPy's pool
                once no copy of it is left

    ``ndarray.copy()`` of the rows cost ~59 us of host time a step on the H200's host, this 9 us
    (cProfile, ``results/h200/scripts/auto_k0_profile.py``): every step of an MTP engine pays it,
    drafting or not (``--draft-tokens auto`` at a load where no depth pays), but a draft
    continuation, whose rows its own continuation's head reads before the next replay (copied
    only when it lands with none, ``Engine._land_drafting``)."""

    def __init__(self, width: int, dtype, chunk_rows: int, xp):
        self.width, self.dtype, self.chunk_rows, self.xp = width, dtype, chunk_rows, xp
        self.row_bytes = width * np.dtype(dtype).itemsize
        self._chunk = None
        self._used = chunk_rows

    def copy(self, source, rows: int):
        """A copy of ``source[:rows]`` (C-contiguous, ``width`` columns), queued on the current stream."""
        import cupy
        if rows > self.chunk_rows:
            return source[:rows].copy()
        if self._used + rows > self.chunk_rows:
            self._chunk, self._used = self.xp.empty((self.chunk_rows, self.width), self.dtype), 0
        at = self._used
        self._used += rows
        copy = self._chunk[at:at + rows]
        launches.copy(copy.data.ptr, source.data.ptr, rows * self.row_bytes, cupy.cuda.runtime.memcpyDeviceToDevice)
        return copy


class _NoEvent:
    """An event or stream that is always done (a CPU ``_StaticInputs``: no copy to wait for)."""
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _capture_shapes(what: str, catalog: GraphCatalog, graphs: dict, capture: Callable[[GraphShape], None],
                    progress: Callable[[str], None] | None, advice: str = "", on_device: bool = True,
                    by_shape: dict | None = None) -> tuple[float, int]:
    """Capture every shape of ``catalog`` not in ``graphs`` with ``capture``, saying how it goes;
    (seconds, device bytes the captures took: graphs and ORT's arena growth). A capture that runs
    out of device memory raises ``CaptureOutOfMemory`` (ORT's own error says only a buffer size).
    ``on_device`` False: bindings on the CPU (nothing captured, no device memory to count).
    ``by_shape``: gets each shape's bytes (the device's free memory before its capture less after:
    ORT keeps a captured graph's buffers for the session's life, so what a catalog costs is the
    sum of its shapes')."""
    if on_device:
        import cupy

        def sync() -> None:
            cupy.cuda.get_current_stream().synchronize()
        memory = cupy.cuda.runtime.memGetInfo
    else:
        def sync() -> None:
            pass

        def memory() -> tuple[int, int]:
            return 0, 0
    shapes = [s for s in catalog.capture_order() if s not in graphs]
    say = progress or logger.info
    say(f"cuda graphs: capturing {len(shapes)} {what} shapes ({catalog.summary()})" if on_device else
        f"cuda graphs: binding {len(shapes)} {what} shapes on the CPU (run eagerly: no capture) ({catalog.summary()})")
    sync()
    free_before = memory()[0]
    started = last = time.perf_counter()
    free = free_before
    for i, shape in enumerate(shapes):
        try:
            capture(shape)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            free, total = memory()
            raise CaptureOutOfMemory(capture_memory_message(what, catalog.describe(shape), i, len(shapes),
                                                            max(0, free_before - free), free, total, advice)) from e
        if by_shape is not None:          # (cudaMalloc is synchronous: no sync needed to see it)
            free, was = memory()[0], free
            by_shape[shape] = max(0, was - free)
        now = time.perf_counter()
        if now - last > 5 and i + 1 < len(shapes):
            say(f"cuda graphs: {i + 1}/{len(shapes)} {what} shapes captured, {now - started:.1f} s")
            last = now
    sync()
    seconds, nbytes = time.perf_counter() - started, max(0, free_before - memory()[0])
    say(f"cuda graphs: {len(shapes)} {what} graphs in {seconds:.1f} s, {nbytes / 2**20:.0f} MiB of device memory")
    return seconds, nbytes


def _paged_graph_inputs(session, pool, input_names: set[str], shape: GraphShape, block_size: int, xp,
                        host_extra: dict[str, np.ndarray], extra: dict | None = None, varlen: bool = False):
    """A new binding of ``session`` for one captured shape, with the paged inputs every graph has
    (packed ranges constant per shape, the rest zero: a step of padding rows on the scratch
    block), the KV ``pool`` in place, and ``attention_metadata`` + ``host_extra`` fixed on the
    host. ``extra``: more entries of the staging block, sent with the step's one copy but not
    bound (e.g. index arrays the step's device ops use). ``varlen``: ``shape.tokens`` rows in all
    (``PromptCatalog``), ranges staged each step (padding spread over every slot until then), and
    the bounds loose: at most all the rows a request. Returns (binding, inputs, host arrays)."""
    B, n, W = shape.batch, shape.tokens, shape.table_width
    T = n if varlen else B * n
    layout = {"input_ids": (np.int64, (T,)), "position_ids": (np.int64, (3, T)),
              "cumulative_sequence_lengths": (np.int32, (B + 1,)), "past_sequence_lengths": (np.int32, (B,)),
              "block_table": (np.int32, (B, W)), "state_update_capture_count": (np.int32, (B,))}
    layout = {k: v for k, v in layout.items() if k in input_names}
    inputs = _StaticInputs({**layout, **(extra or {})}, xp)
    host = inputs.writable()
    if varlen:                 # every slot padding, the rows spread so that each fits its table
        _stage_varlen(host, (), B, T, W)
    else:
        host["cumulative_sequence_lengths"][:] = np.arange(B + 1) * n
        _fill_positions(host, n)
    inputs.upload()
    b = _Binding(session, xp, "cuda")
    pool.bind(b)
    for name in layout:
        b.bind_at(name, inputs.device[name])
    host_arrays = [np.array([n, W * block_size, 1], np.int32), *host_extra.values()]
    for name, arr in zip(("attention_metadata", *host_extra), host_arrays):
        if name in input_names:
            b.bind_at(name, arr)
    return b, inputs, host_arrays


def _fill_positions(host: dict[str, np.ndarray], n: int) -> None:
    """position_ids of every row from past_sequence_lengths: past_b + i for row i of request b
    (all three rows of position_ids alike), without temporaries."""
    past, positions = host["past_sequence_lengths"], host["position_ids"]
    if n == 1:
        positions[:] = past
        return
    global _ROW_OFFSETS
    if n > len(_ROW_OFFSETS):
        _ROW_OFFSETS = np.arange(n)
    np.add(past[:, None], _ROW_OFFSETS[:n], out=positions[0].reshape(len(past), n))
    positions[1:] = positions[0]


_ROW_OFFSETS = np.arange(max(HEAD_FILL_ROWS))      # row i of a request sits at its past length + i


def _fill_step(host: dict[str, np.ndarray], rows: Sequence[PackedRows], n: int, width: int,
               staged: _StagedTables | None = None) -> None:
    """A step's rows into a graph's staging (B real requests, padding rows after them: token 0
    at position 0 on the scratch block 0)::

        input_ids      r0: t d0 .. dK-1 | r1: ... | pad: 0 0 .. 0 | ...
        past lengths   past_0 | past_1 | .. | 0 | 0
        block_table    row b: request b's first `width` blocks, then 0 (scratch)
    """
    B = len(rows)
    ids = host["input_ids"]
    ids[:B * n] = np.fromiter((t for r in rows for t in r.token_ids), np.int64, B * n)
    ids[B * n:] = 0
    _fill_rows(host, rows, n, width, staged)


def _stage_uniform(host: dict[str, np.ndarray], past: np.ndarray, tables: tuple, n: int, width: int,
                   staged: _StagedTables | None = None) -> None:
    """``_fill_step`` of a step whose ids the device writes (ids 0 here), from arrays: request b
    at ``past[b]`` with block table ``tables[b]``, ``n`` rows each, padding after them."""
    host["input_ids"][:] = 0
    _stage_rows(host, past, tables, n, width, staged)


def _fill_padded(host: dict[str, np.ndarray], rows: Sequence[PackedRows], n: int, width: int,
                 staged: _StagedTables | None = None) -> None:
    """``_fill_step`` for rows of at most ``n`` tokens a request (the head's catch-up and fills):
    request b's tokens first in its ``n`` slots, token 0 in the rest (padding past its rows)."""
    ids = host["input_ids"]
    ids[:] = 0
    for b, r in enumerate(rows):
        ids[b * n:b * n + len(r.token_ids)] = r.token_ids
    _fill_rows(host, rows, n, width, staged)


class HeadGraphs(_GraphSet):
    """Captured MTP-head forwards, and greedy drafting chained on the device.

    A drafting step of B greedy requests with up to K drafts each, when it fits a captured shape:

        catch-up   one forward of B x R rows (R = ``catch_up_rows``, the most rows a request keeps
                   from one verify step: 1 + the largest draft count); request b's committed rows
                   [num_head, num_computed) first, padding rows after them
        draft 0    argmax of the logits at each request's last real catch-up row (on the device)
        chained    K-1 forwards of B x 1 rows: row b takes draft i-1 as its token and the head's
                   own hidden state of the row before; positions advance on the device
        drafts     [B, K] token ids in ``self.drafts`` (valid until the next step drafts),
                   copied to the host once

    Both forwards' staging goes to the device before either runs, and each argmax writes its
    column of the drafts and, in the same kernel, the next chained forward's input ids where
    that graph reads them: no copy or index op between the forwards but the hidden rows'.

    ::

        catch-up rows (R = 3)   | r0: t t . | r1: t . . | pad . . . |    t = committed row, . = padding
        last real row           |      ^    |    ^      |  ^        |    -> draft 0 of each request
        chained i = 1 .. K-1    | r0 | r1 | pad |                         one row each, on the device

    A padding row of the catch-up sits at a position past the request's committed ones: the head
    KV it writes there is rewritten by the chained row of that position before any real row reads
    it, and every position stays inside the step's block-table bucket. Sampled requests, prompt
    catch-ups longer than R and shapes not captured draft eagerly (``draft`` returns None).

    Longer catch-ups (a new prompt, a request resuming after a pause: every row but the last,
    ``MTPProposer._catch_up_long``) go through ``fill``: forwards of ``fill_counts`` rows a request
    (the head's KV only; outputs unused), padded the same way. The head keeps no recurrent state,
    so padding rows cost GPU work and nothing else: a padding row's KV lands past the request's
    committed positions, where the real row of that position rewrites it before anything reads
    it, or on the scratch block past the request's blocks. An eager head forward cost ~0.8 ms of
    host time on the H100 (session 26: a drafting step after each arrival); ORT's replay call
    itself ~4 us (session 27), the rest of a fill being its staging and gather.
    """

    what = "MTP head"

    def __init__(self, runner: Runner, catalog: GraphCatalog, xp, catch_up_rows: int):
        """``catalog``'s token counts: 1 (chained drafts), ``catch_up_rows`` (R: a drafting
        step's catch-up) and any larger ones, the fill forwards' (``fill``)."""
        if not runner.cuda_graphs or runner.head_session is None:
            raise AssertionError("the runner's head session was made without enable_cuda_graph")
        if catalog.banks != (0,) or not {1, catch_up_rows} <= set(catalog.token_counts):
            raise AssertionError(f"head graphs are (1 row, catch-up rows, fills) per request, one bank: {catalog}")
        super().__init__(runner.head_session, catalog)
        self.runner, self.xp = runner, xp
        self.catch_up_rows = catch_up_rows
        self.fill_counts = tuple(n for n in catalog.token_counts if n > catch_up_rows)
        self.num_fills = 0
        m = runner.manifest
        max_rows = max(s.batch * s.tokens for s in catalog.shapes())
        # zeros: padding rows read finite hidden states (their KV lands on the scratch block)
        self.hidden_in = xp.zeros((max_rows, m.hidden_size), runner.hidden_dtype)
        self.logits = xp.empty((max_rows, m.vocab_size), m.compute_dtype)
        self.hidden_out = xp.empty((max_rows, m.hidden_size), runner.hidden_dtype)
        # a step's drafts [batch, K] (flat, row-major: the argmax of forward i writes column i)
        self.drafts = xp.zeros(max(catalog.batch_sizes) * max(1, self.catch_up_rows - 1), np.int64)

    def capture_all(self, progress: Callable[[str], None] | None = None, advice: str = "") -> None:
        """Capture every shape, then run once each CuPy kernel a drafting step launches besides
        them (CuPy builds a kernel on its first use: 0.16 s each, seen on a live step)."""
        super().capture_all(progress, advice)
        gather_rows(self.hidden_in, self.hidden_in, self.xp.zeros((2, 1), np.int64), 0, 1)    # row 0 := row 0
        advance_positions(self.xp.zeros(1, np.int32), self.xp.zeros((3, 1), np.int64), 1)

    def _capture(self, shape: GraphShape) -> None:
        r, head = self.runner, self.runner.manifest.mtp
        T = shape.batch * shape.tokens
        b, inputs, host_arrays = _paged_graph_inputs(r.head_session, r.head_kv, r.head_input_names, shape,
                                                     r.manifest.block_size, self.xp, {},
                                                     extra={"last_rows": (np.int64, (shape.batch,)),
                                                            "gather": (np.int64, (2, T)),
                                                            "chain": (np.int64, (2, shape.batch))})
        host = inputs.writable()
        host["chain"][0] = np.arange(shape.batch)     # chained row b starts from the head's hidden row at last_rows[b]
        inputs.upload()
        b.bind_at(head.hidden_input, self.hidden_in[:T])
        b.bind_at(head.logits_output, self.logits[:T], output=True)
        b.bind_at(head.hidden_output, self.hidden_out[:T], output=True)
        self._add(shape, b, inputs, host_arrays)

    def fill(self, rows: Sequence[PackedRows], hidden: Sequence[Sequence[tuple]]) -> list[int]:
        """The head's KV of catch-up ``rows`` (one piece a request, ``hidden[b]`` its hidden rows
        as ``(array, start, count)`` segments) in captured forwards of ``fill_counts`` rows a
        request (``GraphCatalog.fill_groups``); the indices of the rows no captured shape fits
        (longer than every count, or past the largest KV bucket), for an eager forward."""
        groups = self.catalog.fill_groups([len(r.token_ids) for r in rows], self.fill_counts)
        grouped = {i for group, _, _ in groups for i in group}
        left = [i for i in range(len(rows)) if i not in grouped]        # longer than every fill
        for group, batch, n in groups:
            width = self.catalog.width_for(max(rows[i].past_len + n for i in group))
            graph = self._graphs.get(GraphShape(batch, n, width, 0)) if width is not None else None
            if graph is None:
                left += group
                continue
            host = graph.inputs.writable()
            _fill_padded(host, [rows[i] for i in group], n, width, graph.inputs.staged)
            sources = plan_gather((x for b, i in enumerate(group) for x in segment_destinations(hidden[i], b * n)),
                                  host["gather"])
            graph.inputs.upload()
            gather_into(self.hidden_in, sources, graph.inputs.device["gather"], self.xp)
            self._replay(graph)
            self.num_fills += 1
        return sorted(left)

    def draft(self, rows: Sequence[PackedRows], hidden: Sequence[Sequence[tuple]], num_drafts: int, after=None):
        """Greedy drafts ``[B, num_drafts]`` (int64, on the device: nothing here waits for the
        GPU; a view of ``self.drafts``, valid until the next call), or None when no captured
        shape fits.

        rows[b]: request b's catch-up rows (the tokens at positions num_head+1 .. num_computed,
        ``past_len`` = num_head, its head block table); hidden[b]: the main model's hidden rows
        of those positions, as ``(array, start, count)`` segments in order. ``after``:
        ``(accepted, K1)`` of the launched draft step whose rows this catches up on: ``rows``
        and ``hidden`` hold all its K1 rows a request (ids placeholders), and the device takes
        its emitted tokens as the ids and its accepted counts as the real rows
        (``cuda_kernels.follow_catch_up``; rows past them are padding)."""
        R, B = self.catch_up_rows, len(rows)
        fed = [len(r.token_ids) for r in rows]
        batch = self.catalog.batch_for(B)
        if batch is None or not 0 < num_drafts < R or max(fed) > R:
            return None
        kv_len = max(max(r.past_len + R, r.past_len + n + num_drafts - 1) for r, n in zip(rows, fed))
        width = self.catalog.width_for(kv_len)
        catch_up = self._graphs.get(GraphShape(batch, R, width, 0))
        chained = self._graphs.get(GraphShape(batch, 1, width, 0))
        if catch_up is None or chained is None:
            return None
        # both forwards' inputs staged and sent first: the argmax after each forward then writes
        # the next one's input ids on the device, after the copy that would overwrite them
        sources = _stage_catch_up(catch_up.inputs.writable(), rows, hidden, R, width, catch_up.inputs.staged)
        catch_up.inputs.upload()
        if num_drafts > 1:
            _fill_rows(chained.inputs.writable(), [PackedRows((), r.past_len + n, r.block_table)
                                                   for r, n in zip(rows, fed)], 1, width, chained.inputs.staged)
            chained.inputs.upload()
        return self._launch_drafts(catch_up, chained, batch, B, num_drafts, sources, after)

    def draft_after(self, past: np.ndarray, tables: tuple, hidden, starts: Sequence[int], num_drafts: int,
                    after) -> object | None:
        """``draft`` of a draft continuation, staged without a row object a request: request b's
        catch-up is all ``K1 = after[1]`` rows of the launched step ``after`` (``(accepted,
        K1)``) from head position ``past[b]`` (int64, its ``num_head``), its hidden rows
        ``starts[b] .. starts[b] + K1 - 1`` of ``hidden`` (that step's hidden rows, one array),
        its head block table ``tables[b]`` (``KVPool.block_array``'s)."""
        R, B, k1 = self.catch_up_rows, len(past), after[1]
        batch = self.catalog.batch_for(B)
        if batch is None or not 0 < num_drafts < R or k1 > R or not hidden.flags.c_contiguous:
            return None
        width = self.catalog.width_for(int(past.max()) + max(R, k1 + num_drafts - 1))
        catch_up = self._graphs.get(GraphShape(batch, R, width, 0))
        chained = self._graphs.get(GraphShape(batch, 1, width, 0))
        if catch_up is None or chained is None:
            return None
        _stage_catch_up_after(catch_up.inputs.writable(), past, tables, starts, k1, R, width, catch_up.inputs.staged)
        catch_up.inputs.upload()
        if num_drafts > 1:
            _stage_rows(chained.inputs.writable(), past + k1, tables, 1, width, chained.inputs.staged)
            chained.inputs.upload()
        return self._launch_drafts(catch_up, chained, batch, B, num_drafts, [(hidden, 0, B * k1)], after)

    def _launch_drafts(self, catch_up: _Graph, chained: _Graph, batch: int, B: int, num_drafts: int,
                       sources: list, after):
        """A staged catch-up and its chained forwards launched (``draft``'s second half)."""
        R = self.catch_up_rows
        dev = chained.inputs.device
        if after is not None:       # (the chained row moves in the same launch)
            cd = catch_up.inputs.device
            follow_catch_up(after[0], after[1], R, cd["input_ids"], cd["last_rows"], cd["chain"][1],
                            *((dev["past_sequence_lengths"], dev["position_ids"]) if num_drafts > 1 else ()))
        # catch-up: the rows' hidden states (one gather per source array), one replay, draft 0
        gather_into(self.hidden_in, sources, catch_up.inputs.device["gather"], self.xp)
        self._replay(catch_up)
        out = self.drafts[:batch * num_drafts]
        argmax_rows(self.logits, rows=catch_up.inputs.device["last_rows"], out=out, out_stride=num_drafts,
                    also=dev["input_ids"] if num_drafts > 1 else None)
        for i in range(1, num_drafts):      # chained: draft i from draft i-1 and the head's own hidden row
            if i == 1:
                gather_rows(self.hidden_in, self.hidden_out, catch_up.inputs.device["chain"], 0, batch)
            else:                                          # the next position of every row
                advance_positions(dev["past_sequence_lengths"], dev["position_ids"], batch)
                copy_rows(self.hidden_in, self.hidden_out, batch)
            self._replay(chained)
            argmax_rows(self.logits, num_rows=batch, out=out[i:], out_stride=num_drafts,
                        also=dev["input_ids"] if i + 1 < num_drafts else None)
        return out.reshape(batch, num_drafts)[:B]


def _stage_catch_up(host: dict[str, np.ndarray], rows: Sequence[PackedRows], hidden: Sequence[Sequence[tuple]],
                    R: int, width: int, staged: _StagedTables | None) -> list:
    """A head catch-up's staging (``HeadGraphs.draft``): ``_fill_padded`` at ``R`` rows a request,
    each request's last real row (and the chained forward's start row) and the gather of its
    hidden rows; the gather's sources (``plan_gather``)."""
    _fill_padded(host, rows, R, width, staged)
    last = host["last_rows"]
    last[:] = np.arange(len(last)) * R
    last[:len(rows)] += np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows)) - 1
    host["chain"][1] = last
    return plan_gather((x for b, segments in enumerate(hidden) for x in segment_destinations(segments, b * R)),
                       host["gather"])


def _stage_catch_up_after(host: dict[str, np.ndarray], past: np.ndarray, tables: tuple, starts: Sequence[int],
                          k1: int, R: int, width: int, staged: _StagedTables | None) -> None:
    """``_stage_catch_up`` of a draft continuation's catch-up (``HeadGraphs.draft_after``) in
    array operations: request b's ``k1`` rows at head position ``past[b]`` (ids 0: the device
    writes them), its hidden rows ``starts[b] ..`` of one source array (sources ``[(hidden, 0,
    B * k1)]``)::

        catch-up row   b * R + i  (i < k1)         <- hidden row starts[b] + i
        last row       b * R + k1 - 1 (padding: b * R)
    """
    B = len(past)
    _stage_uniform(host, past, tables, R, width, staged)
    last, gather = host["last_rows"], host["gather"]
    key = (len(last), B, R, k1)
    pattern = _CATCH_UP_ROWS.get(key)
    if pattern is None:             # (what depends on the shape alone, made once: a step's numpy calls cost)
        last_rows = np.arange(len(last)) * R
        last_rows[:B] += k1 - 1
        pattern = _CATCH_UP_ROWS[key] = (last_rows, ((np.arange(B) * R)[:, None] + np.arange(k1)).ravel(),
                                         np.arange(k1))
    last[:] = pattern[0]
    host["chain"][1] = pattern[0]
    gather[0, :B * k1] = pattern[1]
    np.add(np.asarray(starts, np.int64)[:, None], pattern[2], out=gather[1, :B * k1].reshape(B, k1))


_CATCH_UP_ROWS: dict[tuple, tuple] = {}     # (batch, B, R, K1) -> last rows, catch-up rows, row offsets


class _StagedTables:
    """The block tables a staging block holds (the rows' ``block_table`` objects and the width):
    a step whose rows carry the same objects (``KVPool.block_array`` keeps one read-only array a
    request until its table changes, a new block every ``block_size`` tokens) skips rewriting
    them, ~1.5 us a request a forward (three forwards a draft step; session 29's py-spy)."""
    __slots__ = ("tables", "width")

    def __init__(self):
        self.tables, self.width = (), -1

    def same(self, tables: tuple, width: int) -> bool:
        return width == self.width and _same(tables, self.tables)


def _same(tables: tuple, others: tuple) -> bool:
    """The same block-table objects, request for request."""
    return len(tables) == len(others) and all(a is b for a, b in zip(tables, others))


def _fill_rows(host: dict[str, np.ndarray], rows: Sequence[PackedRows], n: int, width: int,
               staged: _StagedTables | None = None) -> None:
    """Past lengths, positions and block tables of a uniform step's staging (ids are the caller's);
    padding rows after the B real ones: past 0 on the scratch block 0. ``staged``: what the
    staging's tables hold now (left as they are when the rows' tables are those objects)."""
    _stage_rows(host, np.fromiter((r.past_len for r in rows), np.int32, len(rows)),
                tuple(r.block_table for r in rows), n, width, staged)


def _stage_rows(host: dict[str, np.ndarray], past: np.ndarray, tables: tuple, n: int, width: int,
                staged: _StagedTables | None) -> None:
    """``_fill_rows`` from arrays: request b at ``past[b]`` with block table ``tables[b]``, ``n``
    rows each; padding requests after them at past 0 (their tables on the scratch block 0)."""
    B = len(past)
    host["past_sequence_lengths"][:B] = past
    host["past_sequence_lengths"][B:] = 0
    _fill_positions(host, n)
    _fill_tables(host, tables, width, staged)


def _fill_tables(host: dict[str, np.ndarray], tables: tuple, width: int, staged: _StagedTables | None) -> None:
    """The staging's block tables: row b request b's first ``width`` blocks, then 0 (the scratch
    block); left as they are when ``staged`` says it holds these objects at this width."""
    if staged is not None and staged.same(tables, width):
        return
    table = host["block_table"]
    table[:] = 0
    for i, blocks in enumerate(tables):
        blocks = blocks[:width]
        table[i, :len(blocks)] = blocks
    if staged is not None:
        staged.tables, staged.width = tables, width
