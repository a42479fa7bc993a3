"""Fixed-state bank for the recurrent (Gated DeltaNet) layers, double-banked, with exact rollback.

One row per resident request, shared by every linear-attention layer. All those layers have one
state shape, so the bank holds them stacked, layer first::

    conv       [L, 2, max_rows, conv_dim, K-1]     conv dtype
    recurrent  [L, 2, max_rows, Hv, Dv, Dk]        float32, V-major
                |  |  `- a resident request's row
                |  `- bank (0 / 1)
                `- layer, in FixedStateSpec.layers order

and a step's states and captures likewise as ``[L, B, ...]``. Gathering, publishing and replaying
a step are then each one array op over all layers instead of one per layer (on the GPU every op
costs 20-100 us of launch overhead whatever its size), and layer i's ``arr[i]`` is a contiguous
``[B, ...]`` block the runner binds by pointer. Each row has its own **active bank**: within one
step some requests publish the op's present state, some replay a prefix, and the rest of the
bank is not in the step at all, so a global flip would force copying rows nobody touched.

A step, for the requests ``rids`` in batch order::

    io = bank.step_buffers(rids)                # past (inputs) and, in place, present (outputs)
    ... run the model on io.past, writing present (into io.present when given) + captures ...
    bank.commit_step(rids, present, num_fed, num_kept, captures)

**In place** (nothing copied for rows that keep every token): when the step's rows are
consecutive and share one active bank ``b``, ``io.past`` is those rows of bank ``b`` and
``io.present`` the same rows of bank ``1-b``, so the op reads and writes the bank directly::

    bank b      | .. | r0 r0+1 .. r0+B-1 | .. |   -> bound as past.L.*     (read)
    bank 1-b    | .. | r0 r0+1 .. r0+B-1 | .. |   <- bound as present.L.*  (written)

Otherwise ``io.past`` is a gathered copy and the runner allocates present; the commit then writes
every new row into one bank (the other bank of the step's first row), so rows that stepped
together share an active bank again. Rows are handed out lowest first, a release moves the
highest resident row into the freed one (resident rows are always ``0 .. R-1``), and the engine
packs a step in row order, so a steady batch stays consecutive. A captured CUDA-graph step binds
bank rows ``[0, padded batch)`` directly (``padded_in_place``).

``commit_step`` prepares every new row in the **inactive** bank (the op's present row when all fed
tokens were kept, a compact replay from the active row otherwise), then publishes: flips those
rows and advances their committed lengths. A rejected suffix never reaches the active bank.
The engine asserts ``kv_pool.committed_len(r) == bank.committed_len(r)`` after every commit.
A row may keep a strict prefix only if the step captured it: ``state_update_capture_count[i] >=
num_kept[i]`` (speculative rows: capture all ``num_fed <= capacity`` tokens); a row fed more than
``capacity`` tokens (a prefill chunk) must keep them all.

Arrays come from an array module ``xp`` passed in (numpy here, cupy on the GPU); bookkeeping
(rows, active flags, lengths) stays on the host.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Array = Any  # an xp.ndarray


@dataclass(frozen=True)
class FixedLayerSpec:
    """State shapes of one linear-attention layer (from ``past.L.conv`` / ``past.L.recurrent``)."""
    layer_id: int
    conv_dim: int
    conv_kernel_size: int      # K; the conv carry keeps the last K-1 inputs
    num_v_heads: int           # Hv
    v_head_dim: int            # Dv
    num_k_heads: int           # Hk (``key_head_count`` in genai_config's state_groups)
    k_head_dim: int            # Dk
    conv_dtype: str = "float32"

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel_size - 1)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.v_head_dim, self.k_head_dim)

    @property
    def capsule_width_per_token(self) -> int:
        """W = Hv + Hk*Dk + Hv*Dv floats per captured transition."""
        return self.num_v_heads + self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


def _state_shape(s: FixedLayerSpec) -> tuple:
    return (s.conv_dim, s.conv_kernel_size, s.num_v_heads, s.v_head_dim, s.num_k_heads,
            s.k_head_dim, str(np.dtype(s.conv_dtype)))


@dataclass(frozen=True)
class FixedStateSpec:
    """All fixed-state layers of a model and the capture capacity C of its state_update outputs.

    The layers must share one state shape (true of Qwen3.5-style models): the bank stacks them.
    """
    layers: tuple[FixedLayerSpec, ...]
    capacity: int

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a fixed-state spec needs at least one linear-attention layer")
        first = self.layers[0]
        for s in self.layers[1:]:
            if _state_shape(s) != _state_shape(first):
                raise ValueError(
                    f"linear-attention layers {first.layer_id} and {s.layer_id} have different state "
                    f"shapes (conv_dim, K, Hv, Dv, Hk, Dk, conv dtype) {_state_shape(first)} != "
                    f"{_state_shape(s)}; the state bank stacks all layers and needs one shape")
        if len(set(self.layer_ids)) != len(self.layers):
            raise ValueError(f"a layer id appears twice: {self.layer_ids}")
        if first.num_v_heads % first.num_k_heads:
            raise ValueError(f"Hv={first.num_v_heads} is not a multiple of Hk={first.num_k_heads}")

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(s.layer_id for s in self.layers)

    @property
    def layer_shape(self) -> FixedLayerSpec:
        """The per-layer state shapes every layer shares (as the first layer's spec)."""
        return self.layers[0]

    def bytes_per_row(self, num_banks: int = 2) -> int:
        """Device bytes one resident request costs in the bank."""
        s = self.layer_shape
        per_layer = (int(np.prod(s.conv_shape)) * np.dtype(s.conv_dtype).itemsize
                     + int(np.prod(s.recurrent_shape)) * 4)
        return num_banks * len(self.layers) * per_layer

    def zero_states(self, num_rows: int, xp=np) -> StepStates:
        """Zeroed step states of ``num_rows`` requests (fresh requests, or a stateless forward)."""
        s = self.layer_shape
        return StepStates(self.layer_ids,
                          xp.zeros((len(self.layers), num_rows, *s.conv_shape), s.conv_dtype),
                          xp.zeros((len(self.layers), num_rows, *s.recurrent_shape), xp.float32))


@dataclass
class StepStates:
    """Fixed state of a step's requests, all layers stacked; rows in the step's request order."""
    layer_ids: tuple[int, ...]    # axis 0 of both arrays
    conv: Array                   # [L, B, conv_dim, K-1]
    recurrent: Array              # [L, B, Hv, Dv, Dk] float32

    def conv_of(self, layer_id: int) -> Array:
        """Layer ``layer_id``'s conv carry, a contiguous ``[B, conv_dim, K-1]`` view."""
        return self.conv[self.layer_ids.index(layer_id)]

    def recurrent_of(self, layer_id: int) -> Array:
        """Layer ``layer_id``'s recurrent state, a contiguous ``[B, Hv, Dv, Dk]`` view."""
        return self.recurrent[self.layer_ids.index(layer_id)]


@dataclass
class StepBuffers:
    """A step's fixed-state buffers: ``past`` to bind as inputs; ``present`` to bind as outputs
    (views into the bank, in place) or None (the runner allocates them)."""
    past: StepStates
    present: StepStates | None


@dataclass
class StepCaptures:
    """The op's ``state_update.L.*`` outputs of one step, all layers stacked, rows in request order."""
    layer_ids: tuple[int, ...]    # axis 0 of both arrays
    conv_value: Array             # [L, B, C, conv_dim]
    recurrent_capsule: Array      # [L, B, C*(Hv + Hk*Dk + Hv*Dv)] float32


def split_capsule(capsule: Array, layer: FixedLayerSpec, capacity: int):
    """Views ``(decay [..., C, Hv], key [..., C, Hk, Dk], delta [..., C, Hv, Dv])`` of
    ``capsule [..., C*W]`` (any leading axes: rows, or layers and rows).

    ::

        one row, C = capacity, W = Hv + Hk*Dk + Hv*Dv floats per captured transition

        offset 0               C*Hv                 C*Hv + C*Hk*Dk                  C*W
               | decay [C, Hv]  | key [C, Hk, Dk]     | delta [C, Hv, Dv]              |
                 exp(g)           L2-normalised key     beta * (v - exp(g) * S^T k)
        transition t (t-th fed token of the request) is decay[t], key[t], delta[t];
        slots t >= capture_count are unspecified.
    """
    C, Hv, Dv, Hk, Dk = (capacity, layer.num_v_heads, layer.v_head_dim,
                         layer.num_k_heads, layer.k_head_dim)
    lead = capsule.shape[:-1]
    k0, d0 = C * Hv, C * Hv + C * Hk * Dk
    if capsule.shape[-1] != C * layer.capsule_width_per_token:
        raise AssertionError(f"layer {layer.layer_id}: capsule width {capsule.shape[-1]} != "
                             f"C*(Hv + Hk*Dk + Hv*Dv) = {C * layer.capsule_width_per_token}")
    return (capsule[..., :k0].reshape(*lead, C, Hv), capsule[..., k0:d0].reshape(*lead, C, Hk, Dk),
            capsule[..., d0:].reshape(*lead, C, Hv, Dv))


def replay_recurrent(xp, state: Array, decay: Array, key: Array, delta: Array,
                     num_kept: np.ndarray) -> Array:
    """State after the first ``j = num_kept[b]`` captured transitions of each request b.

    ``state [..., B, Hv, Dv, Dk]`` float32 is the state before the step (any leading axes, e.g.
    layers); it is **overwritten** with the result and returned (pass a copy: a gather is one).
    ``decay [..., B, T, Hv]``, ``key [..., B, T, Hk, Dk]``, ``delta [..., B, T, Hv, Dv]``.
    For t < j and each value head h (key head h // G, G = Hv / Hk),
    ``S[h] = decay[t,h] * S[h] + outer(delta[t,h], key[t, h // G])``, unrolled:

        S_j[h] = (prod_{t<j} decay[t,h]) * S_0[h] + sum_{t<j} w[t,h] * outer(delta[t,h], key[t,h//G])
        w[t,h] = prod_{t<u<j} decay[u,h]

    which is one scale and one batched matmul per key head, its G value heads side by side
    (no loop over steps, heads or layers). Slots t >= j are masked with ``where`` (they may hold
    anything, NaN included).
    """
    Hv, Dv = state.shape[-3:-1]
    T, Hk = key.shape[-3:-1]
    live = xp.asarray(np.arange(T)[None, :] < num_kept[:, None])[..., None]       # [B, T, 1]
    d = xp.where(live, decay, 1).astype(xp.float32, copy=False)                   # [..., B, T, Hv]
    after = xp.cumprod(d[..., ::-1, :], axis=-2)[..., ::-1, :]      # after[t] = prod_{u>=t} d[u]
    w = xp.concatenate([after[..., 1:, :], xp.ones_like(after[..., :1, :])], axis=-2)  # prod_{u>t}
    wd = xp.where(live[..., None], w[..., None] * delta, 0).astype(xp.float32, copy=False)
    k = xp.where(live[..., None], key, 0).astype(xp.float32, copy=False)          # [..., B, T, Hk, Dk]
    wd = wd.reshape(*wd.shape[:-2], Hk, (Hv // Hk) * Dv)          # value head h = key head * G + g
    outer_sum = xp.moveaxis(wd, -3, -1) @ xp.moveaxis(k, -3, -2)  # [..., B, Hk, G*Dv, Dk]
    state *= after[..., 0, :, None, None]
    state += outer_sum.reshape(state.shape)
    return state


def replay_conv(xp, state: Array, conv_value: Array, num_kept: np.ndarray) -> Array:
    """Conv carry after the first ``j = num_kept[b]`` inputs of each request b (exact).

    ``state [..., B, D, K-1]``, ``conv_value [..., B, C, D]`` (any leading axes, e.g. layers):
    the K-1 newest of the inputs ``ext = [state^T ; conv_value[:j]]``, i.e. the window of K-1
    time steps starting at step j of ``ext [..., B, K-1+C, D]``::

        ext steps:  s0 s1 s2 | x0 x1 x2 x3      (K-1 = 3, C = 4)
        j = 2:            s2   x0 x1            -> steps [j, j + K-1), each a whole D-vector
    """
    B, K1 = len(num_kept), state.shape[-1]
    ext = xp.concatenate([xp.swapaxes(state, -1, -2), conv_value.astype(state.dtype, copy=False)],
                         axis=-2)
    rows_steps = np.stack(np.broadcast_arrays(np.arange(B)[:, None], num_kept[:, None] + np.arange(K1)))
    b, t = xp.asarray(rows_steps)                                                 # [B, K-1] each
    return xp.swapaxes(ext[..., b, t, :], -1, -2)                                 # [..., B, D, K-1]


def _upload(xp, *host: np.ndarray) -> list[Array]:
    """Device views of several host index arrays, sent in one host -> device copy."""
    dev = xp.asarray(np.concatenate(host))
    ends = np.cumsum([len(h) for h in host]).tolist()
    return [dev[a:b] for a, b in zip([0, *ends[:-1]], ends)]


class StateBank:
    """Rows of fixed (conv + recurrent) state for resident requests; see the module docstring.

    ``replay_chunk_bytes`` bounds the temporaries of a partial-keep commit: the recurrent replay
    runs over as many layers at once as fit in it (it holds two arrays of that size), so a step
    with few replayed rows is one pass and a large one a few, never one per layer.
    """

    def __init__(self, spec: FixedStateSpec, max_rows: int, xp=np, replay_chunk_bytes: int = 512 << 20,
                 fused_replay=None, num_snapshots: int = 0, scratch_rows: int = 0):
        """fused_replay: optional ``cuda_kernels.CommitReplay``, which replays a commit's
        partial-keep rows (conv and recurrent) in two kernels from host index arrays, instead
        of the array code (CuPy's indexing: ~0.9 ms of host time a step).
        num_snapshots: slots for copies of committed rows (the prefix cache's state snapshots).
        scratch_rows: the last rows of the ``max_rows``, never admitted: a captured prompt step's
        padding request reads and writes one when every other row is a request's
        (``cuda_graphs.PromptGraphs``). With them a new row also starts active in row 0's bank,
        not always bank 0 (it is zero in both), so a step of running and new requests can stay
        in one bank (``padded_in_place``)."""
        if max_rows <= 0 or spec.capacity < 0 or not 0 <= scratch_rows < max_rows:
            raise ValueError(f"bad bank shape: max_rows={max_rows} capacity={spec.capacity} "
                             f"scratch_rows={scratch_rows}")
        self.spec, self.max_rows, self.xp = spec, max_rows, xp
        self.replay_chunk_bytes = replay_chunk_bytes
        self.fused_replay = fused_replay
        s, L = spec.layer_shape, len(spec.layers)
        self.conv = xp.zeros((L, 2, max_rows, *s.conv_shape), dtype=s.conv_dtype)
        self.recurrent = xp.zeros((L, 2, max_rows, *s.recurrent_shape), xp.float32)
        # [L, 2 * max_rows, ...] views: (bank, row) is flat index bank * max_rows + row
        self._conv_flat = self.conv.reshape(L, 2 * max_rows, *s.conv_shape)
        self._rec_flat = self.recurrent.reshape(L, 2 * max_rows, *s.recurrent_shape)
        self._rows: dict[str, int] = {}
        self.scratch_rows = scratch_rows
        self._free_rows: list[int] = list(range(max_rows - scratch_rows))    # a heap: the lowest free row first
        self._in_place: StepStates | None = None                  # present of the open in-place step
        self._present_views: dict[tuple[int, int], StepStates] = {}   # (bank, batch) -> padded_in_place's present
        self._active = np.zeros(max_rows, np.int8)
        self._committed = np.zeros(max_rows, np.int64)
        # snapshots: one committed row (conv + recurrent of every layer) per slot
        self.snapshot_conv = xp.zeros((num_snapshots, L, *s.conv_shape), dtype=s.conv_dtype)
        self.snapshot_recurrent = xp.zeros((num_snapshots, L, *s.recurrent_shape), xp.float32)
        self._free_snapshots: list[int] = list(range(num_snapshots))[::-1]
        self._snapshot_len: dict[int, int] = {}                    # slot -> tokens folded into it

    # ---- residency ----------------------------------------------------------------------
    @property
    def num_request_rows(self) -> int:
        """Rows requests can hold (``max_rows`` less the scratch rows)."""
        return self.max_rows - self.scratch_rows

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def num_resident_rows(self) -> int:
        return len(self._rows)

    @property
    def request_ids(self) -> list[str]:
        return list(self._rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def can_admit(self) -> bool:
        return bool(self._free_rows)

    def admit(self, request_id: str) -> int | None:
        """Give the request a zeroed row (both banks, committed length 0); None = no room."""
        if request_id in self._rows:
            raise AssertionError(f"request {request_id!r} already holds row {self._rows[request_id]}")
        if not self._free_rows:
            return None
        row = heapq.heappop(self._free_rows)
        self._zero_row(row)
        bank = int(self._active[0]) if self.scratch_rows and row and self._rows else 0
        self._active[row], self._committed[row] = bank, 0
        self._rows[request_id] = row
        return row

    def release(self, request_id: str) -> bool:
        """Free the request's row (finish, cancel, preempt); False if it held none.

        The resident rows stay a dense prefix ``0 .. R-1`` (what a captured step binds, see
        ``padded_in_place``): the highest resident row moves into the freed one (its active
        bank's conv and recurrent rows, one copy each), so a row moves only when another
        request leaves::

            rows  | a | b | c | d |        release b:   | a | d | c |   (d's row 3 -> 1)
        """
        row = self._rows.pop(request_id, None)
        if row is None:
            return False
        last = max(self._rows.values(), default=-1)
        if last > row:
            moved = next(r for r, at in self._rows.items() if at == last)
            bank = int(self._active[last])
            self._copy_row(bank, row, bank, last)
            self._active[row], self._committed[row] = bank, self._committed[last]
            self._rows[moved] = row
            row = last
        heapq.heappush(self._free_rows, row)
        return True

    def row(self, request_id: str) -> int:
        try:
            return self._rows[request_id]
        except KeyError:
            self._require(request_id)
            raise

    def active_bank(self, request_id: str) -> int:
        return int(self._active[self.row(request_id)])

    def committed_len(self, request_id: str) -> int:
        """Tokens folded into the request's state."""
        return int(self._committed[self.row(request_id)])

    # ---- snapshots ----------------------------------------------------------------------
    @property
    def num_free_snapshots(self) -> int:
        return len(self._free_snapshots)

    def save_snapshot(self, request_id: str) -> int | None:
        """Copy the request's committed state into a free snapshot slot; the slot, or None."""
        if not self._free_snapshots:
            return None
        row, slot = self.row(request_id), self._free_snapshots.pop()
        self._copy_snapshot(slot, int(self._active[row]), row, to_slot=True)
        self._snapshot_len[slot] = int(self._committed[row])
        return slot

    def load_snapshot(self, request_id: str, slot: int) -> int:
        """Start a freshly admitted request from a snapshot: its active row := the slot's state,
        its committed length := the slot's; returns that length."""
        row = self.row(request_id)
        if self._committed[row]:
            raise AssertionError(f"load_snapshot({request_id!r}): the request has committed state")
        self._copy_snapshot(slot, int(self._active[row]), row, to_slot=False)
        self._committed[row] = self._snapshot_len[slot]
        return self._snapshot_len[slot]

    def snapshot_arrays(self, slot: int) -> tuple[Array, Array, int]:
        """(conv [L, ...], recurrent [L, ...], tokens folded in) of a used slot (views)."""
        return self.snapshot_conv[slot], self.snapshot_recurrent[slot], self._snapshot_len[slot]

    def put_snapshot(self, conv: Array, recurrent: Array, length: int) -> int | None:
        """A snapshot from elsewhere (the prefix cache's host tier) into a free slot; None if none."""
        if not self._free_snapshots:
            return None
        slot = self._free_snapshots.pop()
        self.snapshot_conv[slot] = conv
        self.snapshot_recurrent[slot] = recurrent
        self._snapshot_len[slot] = int(length)
        return slot

    def free_snapshot(self, slot: int) -> None:
        if self._snapshot_len.pop(slot, None) is None:
            raise AssertionError(f"snapshot slot {slot} is not in use")
        self._free_snapshots.append(slot)

    # ---- whole rows (on the device: one 2-D copy or kernel an array, see cuda_kernels.copy_slabs)
    #
    #   conv / recurrent [L, 2, R, *row]    (bank, row) of layer l at l * s0 + bank * s1 + row * s2,
    #                                       s = strides, s2 = a row's bytes, s0 = 2 * s1
    #   snapshot_* [S, L, *row]              slot's layer l at slot * t0 + l * t1 (t1 = s2)
    def _zero_row(self, row: int) -> None:
        """Both banks of ``row`` := 0, every layer (2L slabs, the bank stride apart)."""
        if self.xp is np:
            self.conv[:, :, row] = 0
            self.recurrent[:, :, row] = 0
            return
        from mtpserve.engine.cuda_kernels import zero_slabs
        for a in (self.conv, self.recurrent):
            s = a.strides
            zero_slabs(a, row * s[2], s[2], 2 * a.shape[0], s[1])

    def _copy_row(self, dst_bank: int, dst_row: int, src_bank: int, src_row: int) -> None:
        """(dst_bank, dst_row) := (src_bank, src_row), conv and recurrent, every layer."""
        if self.xp is np:
            for a in (self.conv, self.recurrent):
                a[:, dst_bank, dst_row] = a[:, src_bank, src_row]
            return
        from mtpserve.engine.cuda_kernels import copy_slabs
        for a in (self.conv, self.recurrent):
            s = a.strides
            copy_slabs(a, dst_bank * s[1] + dst_row * s[2], a, src_bank * s[1] + src_row * s[2], s[2], a.shape[0],
                       s[0], s[0])

    def _copy_snapshot(self, slot: int, bank: int, row: int, to_slot: bool) -> None:
        """Snapshot ``slot`` := (bank, row) (``to_slot``), or (bank, row) := the slot."""
        pairs = ((self.conv, self.snapshot_conv), (self.recurrent, self.snapshot_recurrent))
        if self.xp is np:
            for a, snap in pairs:
                if to_slot:
                    snap[slot] = a[:, bank, row]
                else:
                    a[:, bank, row] = snap[slot]
            return
        from mtpserve.engine.cuda_kernels import copy_slabs
        for a, snap in pairs:
            s, t = a.strides, snap.strides
            at, slot_at = bank * s[1] + row * s[2], slot * t[0]
            if to_slot:
                copy_slabs(snap, slot_at, a, at, s[2], a.shape[0], t[1], s[0])
            else:
                copy_slabs(a, at, snap, slot_at, s[2], a.shape[0], s[0], t[1])

    # ---- a step -------------------------------------------------------------------------
    def gather_step_inputs(self, request_ids: Sequence[str]) -> StepStates:
        """Copies of the requests' active rows, contiguous ``[L, B, ...]``, for ``past.L.*``."""
        return self._gather(self._host_rows(request_ids))

    def _gather(self, rows: np.ndarray) -> StepStates:
        src = self.xp.asarray(self._active_flat(rows))
        take = self.xp.take
        return StepStates(self.spec.layer_ids, take(self._conv_flat, src, axis=1),
                          take(self._rec_flat, src, axis=1))

    def step_buffers(self, request_ids: Sequence[str]) -> StepBuffers:
        """The step's past states, and where the op should write present (see the module
        docstring): bank views when the rows are consecutive in one bank, else a gathered copy
        and None. Hand ``present`` (the views, when given) back to ``commit_step``."""
        rows = self._host_rows(request_ids)
        banks = self._active[rows]
        first, count = int(rows[0]), len(rows)
        if (banks == banks[0]).all() and (rows == np.arange(first, first + count)).all():
            b, span = int(banks[0]), slice(first, first + count)
            ids = self.spec.layer_ids
            past = StepStates(ids, self.conv[:, b, span], self.recurrent[:, b, span])
            self._in_place = StepStates(ids, self.conv[:, 1 - b, span], self.recurrent[:, 1 - b, span])
            return StepBuffers(past, self._in_place)
        self._in_place = None
        return StepBuffers(self._gather(rows), None)

    def warm_up_kernels(self, largest: int) -> None:
        """Run a step's gather, its commit's scatter and a commit's subset take over 1, 2, 4, ...
        and ``largest`` rows (the most a step can have), writing back what was read: no row
        changes. Call it at start-up.

        Why: CuPy builds an indexing kernel on its first use for each arrangement of its arrays,
        and that includes, per array, whether its offsets fit 32 bits, so the kernel a gather of
        P rows needs changes with P: on the H200 the 1.4 B model's first step with 32 rows to
        gather (decode rows beside new prompts) built cupy_take and cupy_scatter_update in the
        step, 300-400 ms (its signature: 64-bit offsets for the index array's 8-byte view, 32-bit
        for the 4-byte state rows). Each such flag flips once as P grows, where its array's size
        passes 2**31; one kernel's arrays grow in proportion with item sizes of 4 and 8 bytes, so
        its flips are a factor of two or more apart, every range of P between two flips holds a
        power of two, and the passes at the powers of two and at ``largest`` meet every kernel
        a live step can need (unverified on the device; passes over one and two rows alone did
        not, as this explains). The largest pass holds two copies of ``largest`` rows of state
        at once (2.4 GB each for that model at 64 rows), released to CuPy's pool after."""
        xp = self.xp
        largest = max(1, min(largest, self.max_rows))
        for n in sorted({min(1 << i, largest) for i in range(largest.bit_length() + 1)}):
            rows = np.arange(n)
            states = self._gather(rows)                              # a step's gather
            dst = xp.asarray(self._active_flat(rows))
            self._conv_flat[:, dst] = states.conv                    # its commit's scatter
            self._rec_flat[:, dst] = states.recurrent
            for m in sorted({1, max(1, n - 1)}):                    # a commit's subset of the rows
                sub = xp.arange(m)
                _ = states.conv[:, sub], states.recurrent[:, sub]
            del states

    def padded_in_place(self, request_ids: Sequence[str], num_rows: int) -> tuple[int, StepStates] | None:
        """For a captured step over bank rows ``[0, num_rows)``: ``(b, present)`` when the step's
        requests hold rows ``0 .. B-1`` in order, all active in bank ``b``, and no resident row
        in ``[B, num_rows)`` is active in bank ``1-b``; else None (the step runs eagerly)::

            bank b     | r0 r1 .. rB-1 | pad .. num_rows-1 |  -> bound as past.L.*    (read)
            bank 1-b   | r0 r1 .. rB-1 | pad .. num_rows-1 |  <- bound as present.L.* (written)

        A padding row is free, or a resident request outside the step whose bank ``1-b`` is
        inactive: whatever the graph writes there is never read. ``present`` (rows ``0 .. B-1``
        of bank ``1-b``) goes to ``commit_step`` as the in-place present."""
        rows = self._host_rows(request_ids)
        batch = len(rows)
        if num_rows > self.max_rows or batch > num_rows or (rows != np.arange(batch)).any():
            return None
        b = int(self._active[0])
        if (self._active[rows] != b).any():
            return None
        if any(batch <= at < num_rows and self._active[at] != b for at in self._rows.values()):
            return None
        present = self._present_views.get((b, batch))
        if present is None:      # (the same views every step of this shape: no CuPy slicing a step)
            present = self._present_views[b, batch] = StepStates(
                self.spec.layer_ids, self.conv[:, 1 - b, :batch], self.recurrent[:, 1 - b, :batch])
        self._in_place = present
        return b, self._in_place

    def commit_step(self, request_ids: Sequence[str], present: StepStates,
                    num_fed: Sequence[int], num_kept: Sequence[int],
                    captures: StepCaptures | None = None) -> None:
        """Commit the first ``num_kept[i]`` of the ``num_fed[i]`` tokens request i fed this step.

        - ``num_kept == num_fed``: the op's present row is published as is (nothing to copy when
          ``present`` is the in-place views ``step_buffers`` handed out);
        - ``0 < num_kept < num_fed``: the row is replayed from the pre-step (active) state and
          the captures, which must hold those transitions (``num_kept <= capacity``);
        - ``num_kept == 0``: the row is left as it was.
        New rows are written into one target bank (the other bank of the step's first row; for
        a row whose active bank it is, in place) and become active there; committed lengths
        advance by ``num_kept``. Nothing visible changes if an argument is rejected.
        """
        rows, kept = self._commit(request_ids, present, num_fed, num_kept, captures)
        self._committed[rows] += kept

    def commit_step_on_device(self, request_ids: Sequence[str], present: StepStates, num_fed: int, kept,
                              captures: StepCaptures) -> None:
        """``commit_step`` of a step in which every request fed ``num_fed`` rows and keeps
        ``kept[i]`` of them, 1 <= kept <= num_fed, where ``kept`` is an int64 array of the bank's
        module that the host has not read (a launched draft step's acceptance, on the device).
        With the fused replay and the in-place present (a captured step's) nothing here waits
        for the device: the replay kernels skip the rows that keep everything. Otherwise the
        counts are read first (a wait on CUDA; free on the CPU). Every row is active in the
        target bank on return; the committed lengths advance with ``advance_committed`` once the
        host has the counts."""
        fused = self.fused_replay
        if (self.xp is np or fused is None or present is not self._in_place
                or not fused.supports(self._conv_flat, captures.conv_value)):
            from mtpserve.engine.sampler import to_host
            self._commit(request_ids, present, [num_fed] * len(request_ids), to_host(kept), captures)
            return
        rows = self._host_rows(request_ids)
        self._in_place = None
        if len(rows) > fused.max_parts:
            raise AssertionError(f"{len(rows)} rows > the fused replay's {fused.max_parts}")
        self._check_step(len(rows), present, captures, np.array([num_fed - 1]))
        target = 1 - int(self._active[rows[0]])
        fused(self._conv_flat, self._rec_flat, captures.conv_value, captures.recurrent_capsule,
              np.arange(len(rows)), target * self.max_rows + rows, self._active_flat(rows), kept, full=num_fed)
        self._active[rows] = target

    def advance_committed(self, request_ids: Sequence[str], num_kept: Sequence[int]) -> None:
        """A ``commit_step_on_device``'s committed lengths, once the host has the kept counts."""
        self._committed[self._host_rows(request_ids)] += np.asarray(num_kept, np.int64)

    def _commit(self, request_ids: Sequence[str], present: StepStates, num_fed: Sequence[int],
                num_kept: Sequence[int], captures: StepCaptures | None) -> tuple[np.ndarray, np.ndarray]:
        """``commit_step`` but the committed lengths; (the rows, the kept counts)."""
        fed, kept = np.asarray(num_fed, np.int64), np.asarray(num_kept, np.int64)
        if not len(request_ids) == len(fed) == len(kept):
            raise AssertionError("request_ids, num_fed and num_kept differ in length")
        if ((kept < 0) | (kept > fed)).any():
            raise AssertionError(f"need 0 <= num_kept <= num_fed, got {kept} of {fed}")
        rows = self._host_rows(request_ids)
        in_place = present is self._in_place and self._in_place is not None
        self._in_place = None
        target = 1 - int(self._active[rows[0]])           # the bank every new row is written to
        src = self._active_flat(rows)
        dst = target * self.max_rows + rows
        full = np.flatnonzero((kept == fed) & (kept > 0))
        part = np.flatnonzero((kept > 0) & (kept < fed))
        self._check_step(len(request_ids), present, captures, kept[part])
        if len(full) and not in_place:                     # in place: present already sits at dst
            fi, fd = _upload(self.xp, full, dst[full])
            if len(full) == len(kept):
                fi = slice(None)
            self._conv_flat[:, fd] = present.conv[:, fi]
            self._rec_flat[:, fd] = present.recurrent[:, fi]
        if len(part):
            # a row whose active bank is the target replays in place: every read comes first
            if self.fused_replay is not None:
                conv = self.fused_replay.supports(self._conv_flat, captures.conv_value)
                if not conv:
                    self._replay_conv(captures, *_upload(self.xp, part, dst[part], src[part]), kept[part])
                self.fused_replay(self._conv_flat, self._rec_flat, captures.conv_value, captures.recurrent_capsule,
                                  part, dst[part], src[part], kept[part], conv=conv)
            else:
                pi, pd, ps = _upload(self.xp, part, dst[part], src[part])
                self._replay(captures, pi, pd, ps, kept[part])
        self._active[rows[kept > 0]] = target
        return rows, kept

    def _replay(self, captures: StepCaptures, pi, pd, ps, kept: np.ndarray) -> None:
        """Target rows ``pd`` := active rows ``ps`` (possibly the same rows) advanced by the first
        ``kept`` captured transitions of step rows ``pi``; all layers at once (recurrent: in
        layer chunks). Every source is read before its target is written."""
        xp, s, C = self.xp, self.spec.layer_shape, self.spec.capacity
        self._replay_conv(captures, pi, pd, ps, kept)
        capsule = captures.recurrent_capsule[:, pi]                               # [L, P, C*W]
        bytes_per_layer = len(kept) * 4 * int(np.prod(s.recurrent_shape))
        step = max(1, self.replay_chunk_bytes // bytes_per_layer)
        for l0 in range(0, len(self.spec.layers), step):
            ls = slice(l0, l0 + step)
            decay, key, delta = split_capsule(capsule[ls], s, C)
            self._rec_flat[ls, pd] = replay_recurrent(xp, self._rec_flat[ls, ps], decay, key, delta, kept)

    def _replay_conv(self, captures: StepCaptures, pi, pd, ps, kept: np.ndarray) -> None:
        """The conv half of ``_replay`` (array code): rows ``pd`` := rows ``ps`` advanced by the
        first ``kept`` captured inputs of step rows ``pi``."""
        self._conv_flat[:, pd] = replay_conv(self.xp, self._conv_flat[:, ps], captures.conv_value[:, pi], kept)

    def _check_step(self, batch: int, present: StepStates, captures: StepCaptures | None,
                    kept_part: np.ndarray) -> None:
        s, L, C = self.spec.layer_shape, len(self.spec.layers), self.spec.capacity
        want = [(present, "conv", (L, batch, *s.conv_shape)),
                (present, "recurrent", (L, batch, *s.recurrent_shape))]
        if len(kept_part):
            if captures is None or kept_part.max() > C:
                raise AssertionError(f"replaying {kept_part} tokens needs captures of capacity >= that "
                                     f"(capacity {C}, captures given: {captures is not None})")
            want += [(captures, "conv_value", (L, batch, C, s.conv_dim)),
                     (captures, "recurrent_capsule", (L, batch, C * s.capsule_width_per_token))]
        for step_arrays, name, shape in want:
            if tuple(step_arrays.layer_ids) != self.spec.layer_ids:
                raise AssertionError(f"{name}: layers {step_arrays.layer_ids} != the bank's "
                                     f"{self.spec.layer_ids}")
            if getattr(step_arrays, name).shape != shape:
                raise AssertionError(f"{name}: shape {getattr(step_arrays, name).shape}, expected "
                                     f"{shape} (layers, rows, ...)")

    # ---- checks -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + resident + scratch rows == max_rows with no row used
        twice, active-bank flags are 0/1 and committed lengths are non-negative."""
        used = list(self._rows.values()) + list(self._free_rows)
        if sorted(used) != list(range(self.max_rows - self.scratch_rows)):
            raise AssertionError(f"rows: {len(self._rows)} resident + {len(self._free_rows)} free + "
                                 f"{self.scratch_rows} scratch != {self.max_rows}, or a row is held twice")
        if not np.isin(self._active, (0, 1)).all():
            raise AssertionError(f"active-bank flags not in {{0, 1}}: {self._active}")
        if (self._committed < 0).any():
            raise AssertionError(f"negative committed length: {self._committed}")
        if sorted(self._free_snapshots + list(self._snapshot_len)) != list(range(len(self.snapshot_conv))):
            raise AssertionError("snapshot slots: free + used != all, or a slot is both")

    def _require(self, request_id: str) -> None:
        if request_id not in self._rows:
            raise AssertionError(f"request {request_id!r} holds no state row")

    def _host_rows(self, request_ids: Sequence[str]) -> np.ndarray:
        try:
            rows = np.fromiter(map(self._rows.__getitem__, request_ids), np.int64, len(request_ids))
        except KeyError as e:
            self._require(e.args[0])
            raise
        if len(set(rows.tolist())) != len(rows):
            raise AssertionError(f"a request appears twice in the step: {list(request_ids)}")
        return rows

    def _active_flat(self, rows: np.ndarray) -> np.ndarray:
        """Flat indices (bank * max_rows + row) of the rows' active banks, on the host."""
        return self._active[rows].astype(np.int64) * self.max_rows + rows
