"""CUDA kernels the engine runs through CuPy (imported only on the CUDA path).

``FusedRecurrentReplay`` is the commit's partial-keep replay of the recurrent state
(``state_bank.replay_recurrent`` in one kernel): each thread owns one state element
``S[l, row, h, v, k]`` and applies the request's first ``j`` captured transitions in order,

    S <- decay[t, h] * S + delta[t, h, v] * key[t, h // G, k]        t = 0 .. j-1,  G = Hv / Hk

reading the active row and writing the inactive one, so the state is read once and written
once (the array version builds cumulative products, masks and a batched matmul first).
The capsule layout is the one ``state_bank.split_capsule`` draws::

    capsule [L, B, C*W]   one step row:  | decay [C, Hv] | key [C, Hk, Dk] | delta [C, Hv, Dv] |
                          (rows contiguous within a layer; layers may be a stride apart: a
                          captured step's capsule is the first B rows of a larger buffer)
    state   [L, 2*R, Hv, Dv, Dk]          (bank, row) at flat index bank * R + row

    thread index  ((((l * P + p) * Hv + h) * Dv + v) * Dk + k)     p = replayed request
"""

from __future__ import annotations

import numpy as np

_SOURCE = r"""
extern "C" __global__ void replay_recurrent(
        float* __restrict__ state, const float* __restrict__ capsule,
        const long long* __restrict__ step_row, const long long* __restrict__ dst,
        const long long* __restrict__ src, const long long* __restrict__ kept,
        long long num_layers, long long num_parts, long long num_flat_rows, long long layer_stride,
        int capacity, int Hv, int Dv, int Hk, int Dk) {
    const long long total = num_layers * num_parts * Hv * Dv * Dk;
    const long long width = (long long)capacity * (Hv + (long long)Hk * Dk + (long long)Hv * Dv);
    const int G = Hv / Hk;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i;
        const int k = r % Dk; r /= Dk;
        const int v = r % Dv; r /= Dv;
        const int h = r % Hv; r /= Hv;
        const long long p = r % num_parts;
        const long long l = r / num_parts;
        const float* cap = capsule + l * layer_stride + step_row[p] * width;
        const float* decay = cap;                                        // [C, Hv]
        const float* key = cap + (long long)capacity * Hv;               // [C, Hk, Dk]
        const float* delta = key + (long long)capacity * Hk * Dk;        // [C, Hv, Dv]
        const long long elem = ((long long)h * Dv + v) * Dk + k;
        const long long row_size = (long long)Hv * Dv * Dk;
        float s = state[(l * num_flat_rows + src[p]) * row_size + elem];
        const int j = (int)kept[p];
        for (int t = 0; t < j; ++t) {
            s = decay[t * Hv + h] * s
                + delta[((long long)t * Hv + h) * Dv + v] * key[((long long)t * Hk + h / G) * Dk + k];
        }
        state[(l * num_flat_rows + dst[p]) * row_size + elem] = s;
    }
}
"""


class FusedRecurrentReplay:
    """Callable replaying partial-keep rows of a stacked recurrent state in one CUDA kernel."""

    THREADS = 256

    def __init__(self, capacity: int, num_v_heads: int, v_head_dim: int, num_k_heads: int, k_head_dim: int):
        import cupy
        self.cupy = cupy
        self.dims = (capacity, num_v_heads, v_head_dim, num_k_heads, k_head_dim)
        if num_v_heads % num_k_heads:
            raise ValueError(f"{num_v_heads} value heads are not a multiple of {num_k_heads} key heads")
        self.kernel = cupy.RawKernel(_SOURCE, "replay_recurrent")

    def __call__(self, state_flat, capsule, step_row, dst, src, kept) -> None:
        """state_flat [L, 2R, Hv, Dv, Dk] float32 (written in place at rows dst), capsule
        [L, B, C*W] float32 (each layer's [B, C*W] contiguous; the layers any stride apart);
        step_row / dst / src / kept: int64 device arrays [P]."""
        cp = self.cupy
        C, Hv, Dv, Hk, Dk = self.dims
        L, flat_rows = state_flat.shape[:2]
        assert state_flat.dtype == np.float32 and capsule.dtype == np.float32, "float32 state and capsule"
        assert state_flat.flags.c_contiguous, "contiguous state"
        assert capsule.strides[2] == 4 and capsule.strides[1] == 4 * capsule.shape[2], "contiguous capsule rows"
        layer_stride = capsule.strides[0] // 4
        assert state_flat.shape[2:] == (Hv, Dv, Dk), f"state rows {state_flat.shape[2:]} != {(Hv, Dv, Dk)}"
        assert capsule.shape[2] == C * (Hv + Hk * Dk + Hv * Dv), "capsule width"
        num_parts = int(step_row.size)
        if num_parts == 0:
            return
        total = L * num_parts * Hv * Dv * Dk
        blocks = min(-(-total // self.THREADS), 65535 * 8)
        args = [state_flat, capsule] + [cp.ascontiguousarray(a, dtype=cp.int64) for a in (step_row, dst, src, kept)]
        self.kernel((blocks,), (self.THREADS,), (*args, np.int64(L), np.int64(num_parts), np.int64(flat_rows),
                                                 np.int64(layer_stride), np.int32(C), np.int32(Hv), np.int32(Dv),
                                                 np.int32(Hk), np.int32(Dk)))


_MASK_ROWS = None


def mask_rows_by_bitmask(logits, packed, num_rows: int, words_per_row: int) -> None:
    """Set ``logits[rows[r], t] = -inf`` wherever bit ``t`` of bitmask row ``r`` is clear, in
    place, in one kernel. ``packed``: int32 on the device, ``[rows (num_rows) | bitmask
    (num_rows x words_per_row)]`` (one host -> device copy carries both); logits [N, V], any
    float dtype, C-contiguous."""
    global _MASK_ROWS
    import cupy
    if _MASK_ROWS is None:
        _MASK_ROWS = cupy.ElementwiseKernel(
            "raw int32 packed, int32 num_rows, int32 words, int32 vocab", "raw T logits",
            """
            const long long r = i / vocab;
            const int t = (int)(i % vocab);
            const int word = packed[num_rows + r * words + (t >> 5)];
            if (!((word >> (t & 31)) & 1)) {
                logits[(long long)packed[r] * vocab + t] = (T)__int_as_float(0xff800000);   // -inf
            }
            """, "mtpserve_mask_rows")
    assert logits.flags.c_contiguous, "contiguous logits"
    vocab = logits.shape[1]
    _MASK_ROWS(packed, np.int32(num_rows), np.int32(words_per_row), np.int32(vocab), logits,
               size=num_rows * vocab)
