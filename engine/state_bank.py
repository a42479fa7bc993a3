"""Fixed-state bank for the recurrent (Gated DeltaNet) layers, double-banked (DESIGN §3).

One row per resident request, shared by every fixed group (conv and recurrent, all layers).
Each layer holds ``conv [2, max_rows, conv_dim, K-1]`` and ``recurrent [2, max_rows, Hv, Dv, Dk]``
(float32, V-major); the leading axis is the bank. Each row has its own **active bank**: within one
step some requests publish the op's present state, some replay a prefix, and the rest of the
bank is not in the step at all, so a global flip would force copying rows nobody touched.

A step, for the requests ``rids`` in batch order::

    past = bank.gather_step_inputs(rids)        # active rows -> contiguous [B, ...] buffers
    ... run the model on past, get present + captures ...
    bank.commit_step(rids, present, num_fed, num_kept, captures)

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

from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

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


@dataclass(frozen=True)
class FixedStateSpec:
    """All fixed-state layers of a model and the capture capacity C of its state_update outputs."""
    layers: tuple[FixedLayerSpec, ...]
    capacity: int

    def bytes_per_row(self, num_banks: int = 2) -> int:
        """Device bytes one resident request costs in the bank."""
        per_bank = sum(int(np.prod(s.conv_shape)) * np.dtype(s.conv_dtype).itemsize
                       + int(np.prod(s.recurrent_shape)) * 4 for s in self.layers)
        return num_banks * per_bank


@dataclass
class StepStates:
    """Per-layer ``[B, ...]`` state buffers of one step, rows in the step's request order."""
    conv: dict[int, Array]        # layer_id -> [B, conv_dim, K-1]
    recurrent: dict[int, Array]   # layer_id -> [B, Hv, Dv, Dk] float32


@dataclass
class StepCaptures:
    """The op's ``state_update.L.*`` outputs of one step, rows in the step's request order."""
    conv_value: dict[int, Array]         # layer_id -> [B, C, conv_dim]
    recurrent_capsule: dict[int, Array]  # layer_id -> [B, C*(Hv + Hk*Dk + Hv*Dv)] float32


def split_capsule(capsule: Array, layer: FixedLayerSpec, capacity: int):
    """Views ``(decay [B,C,Hv], key [B,C,Hk,Dk], delta [B,C,Hv,Dv])`` of ``capsule [B, C*W]``.

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
    B = capsule.shape[0]
    k0, d0 = C * Hv, C * Hv + C * Hk * Dk
    if capsule.shape[1] != d0 + C * Hv * Dv:
        raise AssertionError(f"layer {layer.layer_id}: capsule width {capsule.shape[1]} != "
                             f"C*(Hv + Hk*Dk + Hv*Dv) = {d0 + C * Hv * Dv}")
    return (capsule[:, :k0].reshape(B, C, Hv), capsule[:, k0:d0].reshape(B, C, Hk, Dk),
            capsule[:, d0:].reshape(B, C, Hv, Dv))


def replay_recurrent(xp, state: Array, decay: Array, key: Array, delta: Array,
                     num_kept: np.ndarray) -> Array:
    """State after the first ``j = num_kept[b]`` captured transitions of each request.

    ``state [B, Hv, Dv, Dk]`` is the state before the step. For t < j and each value head h,
    ``S[h] = decay[t,h] * S[h] + outer(delta[t,h], key[t, h*Hk//Hv])``, unrolled:

        S_j[h] = (prod_{t<j} decay[t,h]) * S_0[h] + sum_{t<j} w[t,h] * outer(delta[t,h], key[t,h'])
        w[t,h] = prod_{t<u<j} decay[u,h]

    which is one scale and one batched matmul over [B, Hv] (no loop over steps or heads).
    Slots t >= j are masked with ``where`` (they may hold anything, NaN included).
    """
    B, Hv = state.shape[:2]
    T, Hk = decay.shape[1], key.shape[2]
    live = xp.asarray(np.arange(T)[None, :] < num_kept[:, None])[:, :, None]     # [B, T, 1]
    d = xp.where(live, decay, 1).astype(xp.float32)                              # [B, T, Hv]
    after = xp.cumprod(d[:, ::-1], axis=1)[:, ::-1]                 # after[t] = prod_{u>=t} d[u]
    w = xp.concatenate([after[:, 1:], xp.ones_like(after[:, :1])], axis=1)      # prod_{u>t} d[u]
    wd = xp.where(live[..., None], w[..., None] * delta, 0).astype(xp.float32)  # [B, T, Hv, Dv]
    k = xp.where(live[..., None], key[:, :, xp.asarray(np.arange(Hv) * Hk // Hv)], 0)
    outer_sum = wd.transpose(0, 2, 3, 1) @ k.astype(xp.float32).transpose(0, 2, 1, 3)
    return after[:, 0, :, None, None] * state.astype(xp.float32) + outer_sum


def replay_conv(xp, state: Array, conv_value: Array, num_kept: np.ndarray) -> Array:
    """Conv carry after the first ``j = num_kept[b]`` inputs of each request (exact).

    ``concat(state [B, D, K-1], conv_value[:, :j].T, axis=-1)[:, :, -(K-1):]``, i.e. the
    window of K-1 columns starting at column j of ``ext = [state | conv_value^T]``::

        ext columns:  s0 s1 s2 | x0 x1 x2 x3      (K-1 = 3, C = 4)
        j = 2:              s2   x0 x1            -> columns [j, j + K-1)
    """
    ext = xp.concatenate([state, conv_value.transpose(0, 2, 1).astype(state.dtype)], axis=-1)
    cols = xp.asarray(num_kept[:, None] + np.arange(state.shape[2]))             # [B, K-1]
    return xp.take_along_axis(ext, cols[:, None, :], axis=-1)


class StateBank:
    """Rows of fixed (conv + recurrent) state for resident requests; see the module docstring."""

    def __init__(self, spec: FixedStateSpec, max_rows: int, xp=np):
        if max_rows <= 0 or spec.capacity < 0:
            raise ValueError(f"bad bank shape: max_rows={max_rows} capacity={spec.capacity}")
        self.spec, self.max_rows, self.xp = spec, max_rows, xp
        self.conv = {s.layer_id: xp.zeros((2, max_rows, *s.conv_shape), dtype=s.conv_dtype)
                     for s in spec.layers}
        self.recurrent = {s.layer_id: xp.zeros((2, max_rows, *s.recurrent_shape), xp.float32)
                          for s in spec.layers}
        # [2 * max_rows, ...] views: (bank, row) is flat index bank * max_rows + row
        self._flat = [(L, self.conv[L].reshape(2 * max_rows, *self.conv[L].shape[2:]),
                       self.recurrent[L].reshape(2 * max_rows, *self.recurrent[L].shape[2:]))
                      for L in self.conv]
        self._rows: dict[str, int] = {}
        self._free_rows: deque[int] = deque(range(max_rows))
        self._active = np.zeros(max_rows, np.int8)
        self._committed = np.zeros(max_rows, np.int64)

    # ---- residency ----------------------------------------------------------------------
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
        row = self._free_rows.popleft()
        for arr in (*self.conv.values(), *self.recurrent.values()):
            arr[:, row] = 0
        self._active[row], self._committed[row] = 0, 0
        self._rows[request_id] = row
        return row

    def release(self, request_id: str) -> bool:
        """Free the request's row (finish, cancel, preempt); False if it held none."""
        row = self._rows.pop(request_id, None)
        if row is None:
            return False
        self._free_rows.append(row)
        return True

    def row(self, request_id: str) -> int:
        self._require(request_id)
        return self._rows[request_id]

    def active_bank(self, request_id: str) -> int:
        return int(self._active[self.row(request_id)])

    def committed_len(self, request_id: str) -> int:
        """Tokens folded into the request's state."""
        return int(self._committed[self.row(request_id)])

    # ---- a step -------------------------------------------------------------------------
    def gather_step_inputs(self, request_ids: Sequence[str]) -> StepStates:
        """Copies of the requests' active rows, contiguous ``[B, ...]``, for ``past.L.*``."""
        src = self.xp.asarray(self._flat_index(request_ids, inactive=False)[1])
        take = self.xp.take
        return StepStates(conv={L: take(c, src, axis=0) for L, c, _ in self._flat},
                          recurrent={L: take(r, src, axis=0) for L, _, r in self._flat})

    def commit_step(self, request_ids: Sequence[str], present: StepStates,
                    num_fed: Sequence[int], num_kept: Sequence[int],
                    captures: StepCaptures | None = None) -> None:
        """Commit the first ``num_kept[i]`` of the ``num_fed[i]`` tokens request i fed this step.

        - ``num_kept == num_fed``: the op's present row is published as is;
        - ``0 < num_kept < num_fed``: the row is replayed from the pre-step (active) state and
          the captures, which must hold those transitions (``num_kept <= capacity``);
        - ``num_kept == 0``: the row is left as it was.
        New rows are written into the inactive bank, then flipped active; committed lengths
        advance by ``num_kept``. Nothing visible changes if an argument is rejected.
        """
        xp, C = self.xp, self.spec.capacity
        fed, kept = np.asarray(num_fed, np.int64), np.asarray(num_kept, np.int64)
        if not len(request_ids) == len(fed) == len(kept):
            raise AssertionError("request_ids, num_fed and num_kept differ in length")
        if ((kept < 0) | (kept > fed)).any():
            raise AssertionError(f"need 0 <= num_kept <= num_fed, got {kept} of {fed}")
        rows, dst = self._flat_index(request_ids, inactive=True)
        src = (dst + self.max_rows) % (2 * self.max_rows)
        full = np.flatnonzero((kept == fed) & (kept > 0))
        part = np.flatnonzero((kept > 0) & (kept < fed))
        if len(part) and (captures is None or kept[part].max() > C):
            raise AssertionError(f"replaying {kept[part]} tokens needs captures of capacity "
                                 f">= that (capacity {C}, captures given: {captures is not None})")
        for s in self.spec.layers:
            L = s.layer_id
            for pool, new in ((self.conv[L], present.conv[L]),
                              (self.recurrent[L], present.recurrent[L])):
                if new.shape != (len(request_ids), *pool.shape[2:]):
                    raise AssertionError(f"layer {L}: present {new.shape} for "
                                         f"{len(request_ids)} rows of {pool.shape[2:]}")
        layers = {s.layer_id: s for s in self.spec.layers}
        if len(full):
            fi = slice(None) if len(full) == len(kept) else xp.asarray(full)
            fd = xp.asarray(dst[full])
            for L, conv, rec in self._flat:
                conv[fd] = present.conv[L][fi]
                rec[fd] = present.recurrent[L][fi]
        if len(part):
            pi, pd, ps, pk = xp.asarray(part), xp.asarray(dst[part]), xp.asarray(src[part]), kept[part]
            for L, conv, rec in self._flat:
                conv[pd] = replay_conv(xp, conv[ps], captures.conv_value[L][pi], pk)
                decay, key, delta = split_capsule(captures.recurrent_capsule[L][pi], layers[L], C)
                rec[pd] = replay_recurrent(xp, rec[ps], decay, key, delta, pk)
        self._active[rows[kept > 0]] ^= 1
        self._committed[rows] += kept

    # ---- checks -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + resident rows == max_rows with no row used twice,
        active-bank flags are 0/1 and committed lengths are non-negative."""
        used = list(self._rows.values()) + list(self._free_rows)
        if sorted(used) != list(range(self.max_rows)):
            raise AssertionError(f"rows: {len(self._rows)} resident + {len(self._free_rows)} free "
                                 f"!= {self.max_rows}, or a row is held twice")
        if not np.isin(self._active, (0, 1)).all():
            raise AssertionError(f"active-bank flags not in {{0, 1}}: {self._active}")
        if (self._committed < 0).any():
            raise AssertionError(f"negative committed length: {self._committed}")

    def _require(self, request_id: str) -> None:
        if request_id not in self._rows:
            raise AssertionError(f"request {request_id!r} holds no state row")

    def _host_rows(self, request_ids: Sequence[str]) -> np.ndarray:
        for r in request_ids:
            self._require(r)
        rows = np.fromiter((self._rows[r] for r in request_ids), np.int64, len(request_ids))
        if len(set(rows.tolist())) != len(rows):
            raise AssertionError(f"a request appears twice in the step: {list(request_ids)}")
        return rows

    def _flat_index(self, request_ids: Sequence[str], inactive: bool):
        """Host arrays: the requests' rows, and the flat indices of their active/inactive rows."""
        rows = self._host_rows(request_ids)
        banks = self._active[rows].astype(np.int64) ^ int(inactive)
        return rows, banks * self.max_rows + rows
