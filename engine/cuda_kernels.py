"""CUDA kernels the engine runs through CuPy (imported only on the CUDA path).

``CommitReplay`` is a commit's whole partial-keep replay: the step's index arrays in one
host -> device copy from pinned memory, then one kernel for the conv rows and one for the
recurrent rows (the array code costs ~0.9 ms of host time a step in CuPy's indexing and copies,
measured on the H200's host, against tens of microseconds here).

``FusedRecurrentReplay`` is the commit's partial-keep replay of the recurrent state
(``state_bank.replay_recurrent`` in one kernel): a block owns one head's ``[Dv, Dk]`` matrix of
one layer and request, a thread one column ``k`` of it, and each element ``S[l, row, h, v, k]``
gets the request's first ``j`` captured transitions in order,

    S <- decay[t, h] * S + delta[t, h, v] * key[t, h // G, k]        t = 0 .. j-1,  G = Hv / Hk

reading the active row and writing the inactive one, so the state is read once and written
once (the array version builds cumulative products, masks and a batched matmul first).
The capsule layout is the one ``state_bank.split_capsule`` draws::

    capsule [L, B, C*W]   one step row:  | decay [C, Hv] | key [C, Hk, Dk] | delta [C, Hv, Dv] |
                          (rows contiguous within a layer; layers may be a stride apart: a
                          captured step's capsule is the first B rows of a larger buffer)
    state   [L, 2*R, Hv, Dv, Dk]          (bank, row) at flat index bank * R + row

    block  (l * P + p) * Hv + h   (p = replayed request)      thread  k; it loops over v
    the row's j decays and keys of column k sit in registers (capacity <= MAX_CAPACITY); index
    arithmetic is 32-bit and once a block (64-bit divisions per element made the first version
    of this kernel ~9x slower than the state's bytes need on the H200)
"""

from __future__ import annotations

import math

import numpy as np

from mtpserve.engine import launches

MAX_CAPACITY = 8            # the recurrent kernel keeps a row's captured decays and keys in registers

_SOURCE = f"#define MAX_CAPACITY {MAX_CAPACITY}\n" + r"""extern "C" __global__ void replay_recurrent(
        float* __restrict__ state, const float* __restrict__ capsule,
        const long long* __restrict__ step_row, const long long* __restrict__ dst,
        const long long* __restrict__ src, const long long* __restrict__ kept,
        long long num_layers, long long num_parts, long long num_flat_rows, long long layer_stride,
        int capacity, int Hv, int Dv, int Hk, int Dk, long long full) {
    const int G = Hv / Hk;
    const int heads = (int)(num_layers * num_parts) * Hv;
    const long long width = (long long)capacity * (Hv + (long long)Hk * Dk + (long long)Hv * Dv);
    const long long row_size = (long long)Hv * Dv * Dk;
    for (int lph = blockIdx.x; lph < heads; lph += gridDim.x) {           // one (layer, part, head) a block
        const int h = lph % Hv;
        const int p = (lph / Hv) % (int)num_parts;
        const int l = lph / Hv / (int)num_parts;
        const float* cap = capsule + l * layer_stride + step_row[p] * width;
        const float* decay = cap;                                        // [C, Hv]
        const float* key = cap + (long long)capacity * Hv;               // [C, Hk, Dk]
        const float* delta = key + (long long)capacity * Hk * Dk;        // [C, Hv, Dv]
        if (kept[p] >= full) continue;                                   // keeps every row: present stays
        const int j = (int)kept[p];
        const long long head = (long long)h * Dv * Dk;
        const float* in = state + (l * num_flat_rows + src[p]) * row_size + head;
        float* out = state + (l * num_flat_rows + dst[p]) * row_size + head;
        for (int k = threadIdx.x; k < Dk; k += blockDim.x) {             // a thread: column k, every v
            float a[MAX_CAPACITY], kk[MAX_CAPACITY];
#pragma unroll
            for (int t = 0; t < MAX_CAPACITY; ++t) {
                if (t < j) {
                    a[t] = decay[t * Hv + h];
                    kk[t] = key[((long long)t * Hk + h / G) * Dk + k];
                }
            }
#pragma unroll 4
            for (int v = 0; v < Dv; ++v) {
                float s = in[(long long)v * Dk + k];                     // read before written: in place is safe
#pragma unroll
                for (int t = 0; t < MAX_CAPACITY; ++t) {
                    if (t < j) s = a[t] * s + delta[((long long)t * Hv + h) * Dv + v] * kk[t];
                }
                out[(long long)v * Dk + k] = s;
            }
        }
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
        if capacity > MAX_CAPACITY:
            raise ValueError(f"capture capacity {capacity} > the kernel's {MAX_CAPACITY}")
        self.kernel = cupy.RawKernel(_SOURCE, "replay_recurrent")

    def __call__(self, state_flat, capsule, step_row, dst, src, kept, full: int | None = None) -> None:
        """state_flat [L, 2R, Hv, Dv, Dk] float32 (written in place at rows dst), capsule
        [L, B, C*W] float32 (each layer's [B, C*W] contiguous; the layers any stride apart);
        step_row / dst / src / kept: int64 device arrays [P]. ``full``: rows with kept >= full
        are left as they are (they keep every fed row: the step's present is already there)."""
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
        threads = min(self.THREADS, -(-Dk // 32) * 32)
        args = [state_flat, capsule] + [a if a.dtype == np.int64 and a.flags.c_contiguous   # (CommitReplay's are)
                                        else cp.ascontiguousarray(a, dtype=cp.int64) for a in (step_row, dst, src, kept)]
        launches.kernel(self.kernel, (L * num_parts * Hv,), (threads,),
                        (*args, np.int64(L), np.int64(num_parts), np.int64(flat_rows), np.int64(layer_stride),
                         np.int32(C), np.int32(Hv), np.int32(Dv), np.int32(Hk), np.int32(Dk),
                         np.int64(C + 1 if full is None else full)))


MAX_CONV_WINDOW = 16        # the conv kernel's register window: conv kernel size - 1 at most

_CONV_SOURCE = f"#include <cuda_fp16.h>\n#define MAX_WINDOW {MAX_CONV_WINDOW}\n" + r"""
// One thread per (layer l, replayed request p, channel d): the request's conv carry row
// [D, K1] after its first j = kept[p] captured inputs is steps j .. j+K1-1 of
//     ext = [state^T ; conv_value]      (K1 carried steps, then the C captured ones)
// read whole into registers before it is written, so a row replayed in place is safe.
// index = [step_row (P) | dst (P) | src (P) | kept (P)]; state [L, num_flat_rows, D, K1];
// conv_value layer l at conv_value + l * layer_stride, its step rows [B, C, D] contiguous.
template <typename T>
__device__ void replay_conv(T* __restrict__ state, const T* __restrict__ conv_value,
                            const long long* __restrict__ index, long long num_layers, long long num_parts,
                            long long num_flat_rows, long long layer_stride, int capacity, int D, int K1,
                            long long full) {
    const long long total = num_layers * num_parts * D;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int d = (int)(i % D);
        const long long p = (i / D) % num_parts;
        const long long l = i / D / num_parts;
        const long long j = index[3 * num_parts + p];
        if (j >= full) continue;                  // keeps every row: the step's present stays
        const T* src = state + ((l * num_flat_rows + index[2 * num_parts + p]) * D + d) * K1;
        T* dst = state + ((l * num_flat_rows + index[num_parts + p]) * D + d) * K1;
        const T* cap = conv_value + l * layer_stride + index[p] * (long long)capacity * D + d;
        T window[MAX_WINDOW];
        for (int k = 0; k < K1; ++k) {
            const long long t = j + k;
            window[k] = t < K1 ? src[t] : cap[(t - K1) * D];
        }
        for (int k = 0; k < K1; ++k) dst[k] = window[k];
    }
}

extern "C" __global__ void replay_conv_f16(__half* state, const __half* conv_value, const long long* index,
        long long num_layers, long long num_parts, long long num_flat_rows, long long layer_stride,
        int capacity, int D, int K1, long long full) {
    replay_conv(state, conv_value, index, num_layers, num_parts, num_flat_rows, layer_stride, capacity, D, K1, full);
}
extern "C" __global__ void replay_conv_f32(float* state, const float* conv_value, const long long* index,
        long long num_layers, long long num_parts, long long num_flat_rows, long long layer_stride,
        int capacity, int D, int K1, long long full) {
    replay_conv(state, conv_value, index, num_layers, num_parts, num_flat_rows, layer_stride, capacity, D, K1, full);
}
"""


class CommitReplay:
    """A commit's partial-keep rows replayed on the device, conv and recurrent (see the module
    docstring): ``state_bank.replay_conv`` and ``replay_recurrent`` in two kernels, their index
    arrays in one copy from a pinned staging block::

        pinned host   | step_row (P) | dst (P) | src (P) | kept (P) |   int64, P <= max_parts
        device        the same bytes; each kernel reads its part

    Two pinned blocks, used in turn: a block is rewritten once the copy from it two commits ago
    has read it (an event), so the host preparing step n+1's commit does not wait for the GPU to
    reach step n's (which is queued behind step n's forward). The device block is one: its
    copies and kernels are ordered on the stream. ``double_buffered = False`` uses one block
    (the A/B switch of session 31)."""

    THREADS = 256
    double_buffered = True

    def __init__(self, capacity: int, num_v_heads: int, v_head_dim: int, num_k_heads: int, k_head_dim: int,
                 max_parts: int):
        import cupy
        self.cupy = cupy
        self.recurrent = FusedRecurrentReplay(capacity, num_v_heads, v_head_dim, num_k_heads, k_head_dim)
        self.capacity, self.max_parts = capacity, max_parts
        module = cupy.RawModule(code=_CONV_SOURCE, options=("--std=c++14",))
        self._conv = {np.dtype(np.float16): module.get_function("replay_conv_f16"),
                      np.dtype(np.float32): module.get_function("replay_conv_f32")}
        self._pinned = [cupy.cuda.alloc_pinned_memory(4 * max_parts * 8) for _ in range(2)]
        self._host = [np.frombuffer(p, np.int64, 4 * max_parts) for p in self._pinned]
        self._device = cupy.zeros(4 * max_parts, cupy.int64)
        self._sent = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
        for e in self._sent:
            e.record()
        self._turn = 0
        self._views: dict[int, tuple] = {}      # P -> the index block's [:4P] and its four parts (CuPy views)

    def supports(self, conv_flat, conv_value) -> bool:
        """Whether the conv kernel takes these arrays (else the caller replays conv with arrays)."""
        return (conv_flat.dtype == conv_value.dtype and conv_flat.dtype in self._conv
                and conv_flat.flags.c_contiguous and conv_flat.shape[-1] <= MAX_CONV_WINDOW
                and conv_value.strides[3] == conv_value.itemsize
                and conv_value.strides[2] == conv_value.itemsize * conv_value.shape[3]
                and conv_value.strides[1] == conv_value.strides[2] * conv_value.shape[2])

    def __call__(self, conv_flat, rec_flat, conv_value, capsule, step_row: np.ndarray, dst: np.ndarray,
                 src: np.ndarray, kept, conv: bool = True, full: int | None = None) -> None:
        """conv_flat [L, 2R, D, K1] and rec_flat [L, 2R, Hv, Dv, Dk] written at rows ``dst``;
        conv_value [L, B, C, D] and capsule [L, B, C*W] the step's captures; ``step_row``,
        ``dst`` and ``src`` on the host (int64, one entry per replayed request); ``kept`` on the
        host too, or an int64 device array (a launched step's accepted counts, never read by the
        host: copied on the device into the index block). ``full``: rows with kept >= full are
        skipped (they keep every fed row). ``conv=False``: only the recurrent rows (the caller
        replays conv itself)."""
        cp = self.cupy
        P = len(step_row)
        if P == 0:
            return
        if P > self.max_parts:
            raise AssertionError(f"{P} replayed rows > the staging's {self.max_parts}")
        on_device = not isinstance(kept, np.ndarray)
        turn = self._turn = (1 - self._turn) if self.double_buffered else 0
        self._sent[turn].synchronize()
        host = self._host[turn]
        for i, a in enumerate((step_row, dst, src) if on_device else (step_row, dst, src, kept)):
            host[i * P:(i + 1) * P] = a
        sent = (3 if on_device else 4) * P
        launches.copy(self._device.data.ptr, host.ctypes.data, sent * 8, cp.cuda.runtime.memcpyHostToDevice)
        launches.record(self._sent[turn])
        views = self._views.get(P)
        if views is None:
            index = self._device[:4 * P]
            views = self._views[P] = (index, *(index[i * P:(i + 1) * P] for i in range(4)))
        index = views[0]
        if on_device:
            assert kept.dtype == np.int64 and kept.flags.c_contiguous and kept.size == P, "int64 [P] kept"
            launches.copy(views[4].data.ptr, kept.data.ptr, P * 8, cp.cuda.runtime.memcpyDeviceToDevice)
        full = self.capacity + 1 if full is None else full
        if conv:
            L, flat_rows, D, K1 = conv_flat.shape
            total = L * P * D
            launches.kernel(self._conv[np.dtype(conv_flat.dtype)],
                            (min(-(-total // self.THREADS), 65535 * 8),), (self.THREADS,),
                            (conv_flat, conv_value, index, np.int64(L), np.int64(P), np.int64(flat_rows),
                             np.int64(conv_value.strides[0] // conv_value.itemsize), np.int32(self.capacity),
                             np.int32(D), np.int32(K1), np.int64(full)))
        self.recurrent(rec_flat, capsule, *views[1:], full=full)


_ACCEPT_SOURCE = r"""
// A launched draft step's greedy acceptance and what the step after it reads, on the device.
// accepted [B, K + 2] (int64): row b = the K + 1 tokens the step emits when it keeps all its
// rows (columns past kept - 1 are what a longer acceptance would have emitted), then kept.
extern "C" __global__ void accept_drafts(const long long* target, const long long* drafts,
                                         const long long* synthetic, int B, int K,
                                         long long* accepted, long long* kept) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    const long long* t = target + (long long)b * (K + 1);
    const long long* d = drafts + (long long)b * K;
    int n = 0;
    if (synthetic) n = (int)synthetic[b];                     // benchmarks: accepted without a check
    else while (n < K && d[n] == t[n]) ++n;
    long long* row = accepted + (long long)b * (K + 2);
    for (int i = 0; i <= K; ++i) row[i] = i < n ? d[i] : t[i];
    row[K + 1] = n + 1;
    kept[b] = n + 1;
}

// The rows of the step after it were staged for `staged` kept rows of the accepted step (its
// longest acceptance, K1 = K + 1; or 0: they hold that step's own rows, a steady continuation):
// every position moves by kept - staged, and the first row's id is the last emitted token.
// accepted [B, K1 + 1]; past [B] int32; positions [3, T] int64, n rows a request; ids [T] (null:
// left alone); drafts [B, n - 1] (null: none) go to ids' rows 1 .. n - 1 of each request.
extern "C" __global__ void follow_verify(const long long* accepted, int K1, int staged, int B, int n,
                                         int* past, long long* positions, long long T, long long* ids,
                                         const long long* drafts) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    const long long* row = accepted + (long long)b * (K1 + 1);
    const long long kept = row[K1], shift = kept - staged;
    past[b] += (int)shift;
    for (int i = 0; i < n; ++i)
        for (int r = 0; r < 3; ++r) positions[r * T + (long long)b * n + i] += shift;
    if (ids) ids[(long long)b * n] = row[kept - 1];
    if (ids && drafts)
        for (int i = 1; i < n; ++i) ids[(long long)b * n + i] = drafts[(long long)b * (n - 1) + i - 1];
}

// A decode step's tokens [B] as the acceptance of a draft step with no drafts: [token, 1] a request.
extern "C" __global__ void decode_as_accepted(const long long* tokens, int B, long long* accepted) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    accepted[2 * (long long)b] = tokens[b];
    accepted[2 * (long long)b + 1] = 1;
}

// The head's catch-up on the kept rows: ids of rows b*R .. b*R + K1 - 1 := the emitted tokens
// (rows past kept are padding), the last real row (and the chained start) moved by kept - K1;
// with chained_past (not null) the chained forward's one row a request moves too (its past
// [B] int32 and positions [3, T] int64), as follow_verify with n = 1 moves it.
extern "C" __global__ void follow_catch_up(const long long* accepted, int K1, int B, int R,
                                           long long* ids, long long* last_rows, long long* chain_from,
                                           int* chained_past, long long* chained_positions, long long T) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    const long long* row = accepted + (long long)b * (K1 + 1);
    for (int i = 0; i < K1; ++i) ids[(long long)b * R + i] = row[i];
    const long long shift = row[K1] - K1;
    last_rows[b] += shift;
    chain_from[b] = last_rows[b];
    if (chained_past) {
        chained_past[b] += (int)shift;
        for (int r = 0; r < 3; ++r) chained_positions[r * T + b] += shift;
    }
}
"""
_FUNCTIONS: dict[tuple[str, str], object] = {}
_MODULES: dict[str, object] = {}


def _kernel(source: str, name: str):
    """Kernel ``name`` of the CUDA ``source`` (one of this module's ``_*_SOURCE``), its module
    built with NVRTC on first use and each function looked up once (a lookup per launch would
    be host time on every step)."""
    function = _FUNCTIONS.get((source, name))
    if function is None:
        module = _MODULES.get(source)
        if module is None:
            import cupy
            module = _MODULES[source] = cupy.RawModule(code=source, options=("--std=c++14",))
        function = _FUNCTIONS[source, name] = module.get_function(name)
    return function


def _int64(*arrays) -> None:
    for a in arrays:
        assert a.dtype == np.int64 and a.flags.c_contiguous, "contiguous int64 arrays"


def accept_drafts(target, drafts, synthetic=None):
    """``(accepted [B, K + 2], kept [B])`` int64 on the device from a uniform draft step's target
    argmaxes ``target`` [B, K + 1] and its drafts [B, K] (``pipeline.accept_drafts`` is the
    host's version and the reference); ``synthetic`` [B]: accepted counts given (benchmarks)."""
    import cupy
    B, K = int(drafts.shape[0]), int(drafts.shape[1])
    target, drafts = cupy.ascontiguousarray(target), cupy.ascontiguousarray(drafts)
    _int64(target, drafts)
    accepted, kept = cupy.empty((B, K + 2), cupy.int64), cupy.empty(B, cupy.int64)
    if synthetic is not None:
        synthetic = cupy.asarray(synthetic, cupy.int64)
    launches.kernel(_kernel(_ACCEPT_SOURCE, "accept_drafts"), (-(-B // 64),), (64,),
                    (target, drafts, synthetic if synthetic is not None else np.uint64(0), np.int32(B),
                     np.int32(K), accepted, kept))
    return accepted, kept


def decode_as_accepted(tokens):
    """int64 ``[B, 2]`` on the device: a decode step's tokens ``[B]`` as a draft step's
    acceptance with no drafts (``[token, 1]`` a request), what a draft step after it follows."""
    import cupy
    tokens = cupy.ascontiguousarray(tokens)
    _int64(tokens)
    B = int(tokens.shape[0])
    out = cupy.empty((B, 2), cupy.int64)
    launches.kernel(_kernel(_ACCEPT_SOURCE, "decode_as_accepted"), (-(-B // 64),), (64,), (tokens, np.int32(B), out))
    return out


def warm_up_accept() -> None:
    """Build and run once the accept and follow kernels (NVRTC compiles a module on its first
    use: ~0.1 s, which would otherwise fall on the first live draft step in flight)."""
    import cupy
    accepted, _ = accept_drafts(cupy.zeros((1, 2), cupy.int64), cupy.zeros((1, 1), cupy.int64))
    follow_verify(accepted, 2, 1, cupy.zeros(1, cupy.int32), cupy.zeros((3, 1), cupy.int64), cupy.zeros(1, cupy.int64))
    follow_catch_up(accepted, 2, 2, cupy.zeros(2, cupy.int64), cupy.zeros(1, cupy.int64), cupy.zeros(1, cupy.int64))
    decode_as_accepted(cupy.zeros(1, cupy.int64))
    for dtype in (cupy.float16, cupy.float32):
        accept_logits(cupy.zeros((2, 8), dtype), cupy.zeros((1, 1), cupy.int64))


def follow_verify(accepted, num_kept_staged: int, num_rows: int, past, positions, ids=None, drafts=None,
                  staged: int | None = None) -> None:
    """Move a staged step's first ``B = len(accepted)`` requests (``num_rows`` rows each) from the
    positions staged for ``num_kept_staged`` kept rows (``accepted`` is [B, num_kept_staged + 1])
    to the accepted ones; ``staged``: the kept rows the positions were staged for, when not that
    (0: the accepted step's own positions, moved by its kept counts). ``ids``: row 0 of each
    request := the accepted step's last emitted token (a verify's fed token), and with
    ``drafts`` [B, num_rows - 1] (int64, contiguous) rows 1.. := request b's drafts (what
    ``copy_columns`` would copy, in the same launch)."""
    B = int(accepted.shape[0])
    assert past.dtype == np.int32 and positions.dtype == np.int64 and positions.shape[0] == 3
    _int64(accepted, positions, *(() if ids is None else (ids,)))
    if drafts is not None:
        assert ids is not None and drafts.shape == (B, num_rows - 1), "drafts [B, num_rows - 1] with ids"
        _int64(drafts)
    launches.kernel(_kernel(_ACCEPT_SOURCE, "follow_verify"), (-(-B // 64),), (64,),
                    (accepted, np.int32(num_kept_staged), np.int32(num_kept_staged if staged is None else staged),
                     np.int32(B), np.int32(num_rows), past, positions, np.int64(positions.shape[1]),
                     ids if ids is not None else np.uint64(0), drafts if drafts is not None else np.uint64(0)))


def follow_catch_up(accepted, num_kept_staged: int, rows_per_request: int, ids, last_rows, chain_from,
                    chained_past=None, chained_positions=None) -> None:
    """A head catch-up staged for ``num_kept_staged`` rows a request: its ids := the accepted
    step's emitted tokens, its last real rows (and the chained forward's start rows) moved to
    the accepted counts; with ``chained_past`` (int32 [>= B]) and ``chained_positions`` (int64
    [3, T]) the chained forward's row moves too (``follow_verify`` with one row, same launch)."""
    B = int(accepted.shape[0])
    _int64(accepted, ids, last_rows, chain_from)
    T = 0
    if chained_past is not None:
        assert chained_past.dtype == np.int32 and chained_positions.shape[0] == 3
        _int64(chained_positions)
        T = int(chained_positions.shape[1])
    launches.kernel(_kernel(_ACCEPT_SOURCE, "follow_catch_up"), (-(-B // 64),), (64,), (
        accepted, np.int32(num_kept_staged), np.int32(B), np.int32(rows_per_request), ids, last_rows, chain_from,
        chained_past if chained_past is not None else np.uint64(0),
        chained_positions if chained_positions is not None else np.uint64(0), np.int64(T)))


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


_ARGMAX_SOURCE = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ float as_float(const float x) { return x; }
__device__ __forceinline__ float as_float(const __half x) { return __half2float(x); }

// The argmax of one row (the lowest id among equal maxima), by a block of 256 threads: the
// id in thread 0 (vocab for a row of NaNs only).
template <typename T>
__device__ long long block_argmax(const T* __restrict__ row, long long vocab) {
    __shared__ float best[256];
    __shared__ long long best_id[256];
    float m = -__int_as_float(0x7f800000);      // -inf
    long long id = vocab;
    for (long long t = threadIdx.x; t < vocab; t += blockDim.x) {
        const float x = as_float(row[t]);
        if (x > m) { m = x; id = t; }            // t grows: the first maximum this thread sees
    }
    best[threadIdx.x] = m;
    best_id[threadIdx.x] = id;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float o = best[threadIdx.x + s];
            const long long oid = best_id[threadIdx.x + s];
            if (o > best[threadIdx.x] || (o == best[threadIdx.x] && oid < best_id[threadIdx.x])) {
                best[threadIdx.x] = o;
                best_id[threadIdx.x] = oid;
            }
        }
        __syncthreads();
    }
    return best_id[0];
}

// out[b * out_stride] = argmax over logits[rows[b]] (rows = null: row b), the lowest id among
// equal maxima; also[b] the same when also is not null. One block of 256 threads per row.
template <typename T>
__device__ void argmax_rows(const T* __restrict__ logits, const long long* __restrict__ rows, long long vocab,
                            long long* __restrict__ out, long long out_stride, long long* __restrict__ also) {
    const long long b = blockIdx.x;
    const long long best = block_argmax(logits + (rows ? rows[b] : b) * vocab, vocab);
    if (threadIdx.x == 0) {
        const long long v = best < vocab ? best : 0;
        out[b * out_stride] = v;
        if (also) also[b] = v;
    }
}

// A uniform draft step's greedy acceptance from its logits, in one launch: block x argmaxes row
// x (request b = x / (K + 1)), and the last of a request's K + 1 blocks to finish (a counter a
// request, reset by that block for the next step) accepts its drafts as accept_drafts does:
// accepted [B, K + 2] (the K + 1 tokens it emits when it keeps every row, then kept), kept [B].
template <typename T>
__device__ void accept_logits(const T* __restrict__ logits, long long vocab, const long long* __restrict__ drafts,
                              const long long* __restrict__ synthetic, int K, long long* target,
                              unsigned int* done, long long* __restrict__ accepted, long long* __restrict__ kept) {
    const long long x = blockIdx.x, b = x / (K + 1);
    const long long best = block_argmax(logits + x * vocab, vocab);
    __shared__ bool last;
    if (threadIdx.x == 0) {
        target[x] = best < vocab ? best : 0;
        __threadfence();                                   // the id is seen before the count
        last = atomicAdd(&done[b], 1u) == (unsigned int)K;
    }
    __syncthreads();
    if (threadIdx.x != 0 || !last) return;
    __threadfence();
    const volatile long long* t = target + b * (K + 1);    // (other blocks' writes: not from L1)
    const long long* d = drafts + b * K;
    int n = 0;
    if (synthetic) n = (int)synthetic[b];                 // benchmarks: accepted without a check
    else while (n < K && d[n] == t[n]) ++n;
    long long* row = accepted + b * (K + 2);
    for (int i = 0; i <= K; ++i) row[i] = i < n ? d[i] : (long long)t[i];
    row[K + 1] = n + 1;
    kept[b] = n + 1;
    done[b] = 0;
}

extern "C" __global__ void accept_logits_f16(const __half* logits, long long vocab, const long long* drafts,
                                             const long long* synthetic, int K, long long* target,
                                             unsigned int* done, long long* accepted, long long* kept) {
    accept_logits(logits, vocab, drafts, synthetic, K, target, done, accepted, kept);
}
extern "C" __global__ void accept_logits_f32(const float* logits, long long vocab, const long long* drafts,
                                             const long long* synthetic, int K, long long* target,
                                             unsigned int* done, long long* accepted, long long* kept) {
    accept_logits(logits, vocab, drafts, synthetic, K, target, done, accepted, kept);
}

extern "C" __global__ void argmax_rows_f16(const __half* logits, const long long* rows, long long vocab,
                                           long long* out, long long out_stride, long long* also) {
    argmax_rows(logits, rows, vocab, out, out_stride, also);
}
extern "C" __global__ void argmax_rows_f32(const float* logits, const long long* rows, long long vocab,
                                           long long* out, long long out_stride, long long* also) {
    argmax_rows(logits, rows, vocab, out, out_stride, also);
}
"""
_LOGIT_SUFFIX = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}    # the logits kernels' variants


_ACCEPT_SCRATCH: dict[int, tuple] = {}


def _accept_scratch(rows: int, requests: int):
    """accept_logits' scratch on the current stream: the target ids and each request's count of
    finished blocks (zero between launches: the last block resets it), grown as batches grow.
    One set a stream: each engine runs on a stream of its own, and two engines in one process
    (a benchmark's, a test's) may have draft steps in flight at once."""
    import cupy
    stream = cupy.cuda.get_current_stream()
    target, done = _ACCEPT_SCRATCH.get(stream.ptr, (None, None))
    if target is None or target.size < rows:
        target = cupy.empty(max(rows, 256), cupy.int64)
    if done is None or done.size < requests:
        stream.synchronize()                  # (no launch still counts in the old counters)
        done = cupy.zeros(max(requests, 64), cupy.uint32)
    _ACCEPT_SCRATCH[stream.ptr] = target, done
    return target, done


def accept_logits(logits, drafts, synthetic=None, out=None):
    """``accept_drafts(row argmaxes of logits, drafts, synthetic)`` in one launch: ``(accepted
    [B, K + 2], kept [B])`` int64 on the device from a uniform draft step's logits [B * (K + 1),
    V] (float16 or float32, C-contiguous: request b's rows b*(K+1) ..) and its drafts [B, K]
    (int64, contiguous), in place of an argmax launch, two allocations and the accept launch
    (each CuPy launch ~10-15 us of host time in session 29's py-spy on the H100). ``out``: the
    ``(accepted, kept)`` arrays to write (contiguous int64 of those shapes), else new ones."""
    import cupy
    B, K = int(drafts.shape[0]), int(drafts.shape[1])
    assert logits.flags.c_contiguous and logits.ndim == 2 and logits.shape[0] >= B * (K + 1), "[B * (K + 1), V]"
    if not drafts.flags.c_contiguous:
        drafts = cupy.ascontiguousarray(drafts)
    _int64(drafts)
    kernel = _kernel(_ARGMAX_SOURCE, f"accept_logits_{_LOGIT_SUFFIX[np.dtype(logits.dtype)]}")
    target, done = _accept_scratch(B * (K + 1), B)
    if out is None:
        accepted, kept = cupy.empty((B, K + 2), cupy.int64), cupy.empty(B, cupy.int64)
    else:
        accepted, kept = out
        assert accepted.shape == (B, K + 2) and kept.shape == (B,), "out: accepted [B, K + 2], kept [B]"
        _int64(accepted, kept)
    if synthetic is not None:
        synthetic = cupy.asarray(synthetic, cupy.int64)
    if B:
        launches.kernel(kernel, (B * (K + 1),), (256,), (logits, np.int64(logits.shape[1]), drafts,
                                                         synthetic if synthetic is not None else np.uint64(0),
                                                         np.int32(K), target, done, accepted, kept))
    return accepted, kept


def accept_step_on_device(logits, drafts, synthetic=None, out=None):
    """A uniform draft step's ``(accepted [B, K + 2], kept [B])`` on the device from its logits
    [B * (K + 1), V] and drafts [B, K]: ``accept_logits`` (one launch, into ``out`` when given)
    for float16 / float32 C-contiguous logits, else each row's argmax then ``accept_drafts``
    (new arrays)."""
    if logits.flags.c_contiguous and logits.ndim == 2 and logits.dtype in (np.float16, np.float32):
        return accept_logits(logits, drafts, synthetic, out)
    B, K = int(drafts.shape[0]), int(drafts.shape[1])
    return accept_drafts(logits[:B * (K + 1)].argmax(axis=1).reshape(B, K + 1), drafts, synthetic)


def argmax_rows(logits, rows=None, num_rows: int | None = None, out=None, out_stride: int = 1, also=None):
    """int64 ``[num_rows]``: the argmax of each row of ``logits`` [N, V] (float16 or float32,
    C-contiguous) or of rows ``rows`` (int64 device indices), lowest id on ties (as numpy and
    the sampler break them); one kernel launch, where CuPy's reduction costs several.

    ``out``: where row b's id goes, at ``out[b * out_stride]`` (a column of a [rows, K] buffer
    with out_stride K); ``also``: an int64 [num_rows] array that gets the ids too (the next
    captured forward's input ids, written where it reads them)."""
    import cupy
    assert logits.flags.c_contiguous and logits.ndim == 2, "contiguous [N, V] logits"
    n = int(rows.shape[0]) if rows is not None else (num_rows if num_rows is not None else logits.shape[0])
    if out is None:
        out, out_stride = cupy.empty(n, cupy.int64), 1
    assert out.dtype == np.int64 and out.flags.c_contiguous and out.size >= (n - 1) * out_stride + 1, "int64 out"
    assert also is None or (also.dtype == np.int64 and also.flags.c_contiguous and also.size >= n), "int64 also"
    if n:
        launches.kernel(_kernel(_ARGMAX_SOURCE, f"argmax_rows_{_LOGIT_SUFFIX[np.dtype(logits.dtype)]}"),
                        (n,), (256,), (logits, rows if rows is not None else np.uint64(0), np.int64(logits.shape[1]),
                                       out, np.int64(out_stride), also if also is not None else np.uint64(0)))
    return out


_ROWS_SOURCE = r"""
// dst[index[j]] = src[index[stride + j]] for j in lo .. lo + n - 1, whole rows of `width` words
// (a row's bytes as 4-byte words, or single bytes when a row's size is not a multiple of 4).
template <typename W>
__device__ void gather_rows(W* __restrict__ dst, const W* __restrict__ src, const long long* __restrict__ index,
                            long long lo, long long stride, long long width, long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long j = lo + i / width, c = i % width;
        dst[index[j] * width + c] = src[index[stride + j] * width + c];
    }
}
extern "C" __global__ void gather_rows_u32(unsigned int* dst, const unsigned int* src, const long long* index,
                                           long long lo, long long stride, long long width, long long total) {
    gather_rows(dst, src, index, lo, stride, width, total);
}
extern "C" __global__ void gather_rows_u8(unsigned char* dst, const unsigned char* src, const long long* index,
                                          long long lo, long long stride, long long width, long long total) {
    gather_rows(dst, src, index, lo, stride, width, total);
}

// count slabs of `width` words set to 0, slab i at dst + i * pitch (pitch and width in words:
// 4-byte words, or single bytes when a slab's offset, size or pitch is not a multiple of 4).
template <typename W>
__device__ void zero_slabs(W* __restrict__ dst, long long pitch, long long width, long long count) {
    const long long total = width * count;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        dst[(i / width) * pitch + i % width] = 0;
}
extern "C" __global__ void zero_slabs_u32(unsigned int* dst, long long pitch, long long width, long long count) {
    zero_slabs(dst, pitch, width, count);
}
extern "C" __global__ void zero_slabs_u8(unsigned char* dst, long long pitch, long long width, long long count) {
    zero_slabs(dst, pitch, width, count);
}

// A chained head forward's next position: past[:n] += 1 (int32), positions [3, n] += 1 (int64).
extern "C" __global__ void advance_positions(int* past, long long* positions, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    past[i] += 1;
    positions[i] += 1;
    positions[n + i] += 1;
    positions[2 * n + i] += 1;
}
"""


def gather_rows(dst, src, index, lo: int, hi: int) -> None:
    """``dst[index[0, j]] = src[index[1, j]]`` for j in lo..hi-1, whole rows, in one kernel
    (CuPy's fancy-index assignment costs several launches and index checks; its elementwise
    kernel cost ~20 us of host time a launch in session 29's py-spy, a raw kernel's ~10-15).
    dst, src: [*, H] C-contiguous, one dtype; index: int64 [2, n] on the device, C-contiguous."""
    assert dst.flags.c_contiguous and src.flags.c_contiguous and dst.dtype == src.dtype and index.ndim == 2
    assert index.dtype == np.int64 and index.flags.c_contiguous, "contiguous int64 index"
    row_bytes = math.prod(dst.shape[1:]) * dst.itemsize
    if hi <= lo or not row_bytes:
        return
    name, width = ("gather_rows_u32", row_bytes // 4) if row_bytes % 4 == 0 else ("gather_rows_u8", row_bytes)
    total = (hi - lo) * width
    launches.kernel(_kernel(_ROWS_SOURCE, name), (min(-(-total // 256), 65535 * 8),), (256,),
                    (dst, src, index, np.int64(lo), np.int64(index.shape[1]), np.int64(width), np.int64(total)))


def copy_rows(dst, src, num_rows: int) -> None:
    """``dst[:num_rows] = src[:num_rows]`` (C-contiguous, one dtype and row width) as one
    device-to-device copy on the current stream, without CuPy's elementwise launch."""
    import cupy
    assert dst.flags.c_contiguous and src.flags.c_contiguous and dst.dtype == src.dtype
    assert dst.shape[1:] == src.shape[1:] and num_rows <= min(len(dst), len(src))
    nbytes = num_rows * math.prod(dst.shape[1:]) * dst.itemsize
    if nbytes:
        launches.copy(dst.data.ptr, src.data.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice)


def copy_columns(dst, src, col: int) -> None:
    """``dst[:B, col:col + K] = src`` for ``src`` [B, K] and ``dst`` [*, N] (C-contiguous, one
    dtype) as one 2-D device-to-device copy on the current stream: a verify's draft columns of
    its input ids, ``[B, 1 + K]``, from the drafts ``[B, K]``. CuPy's assignment to the strided
    view built a copy kernel on its first live step (``live_compiles.py``, session 24)."""
    import cupy
    assert dst.flags.c_contiguous and src.flags.c_contiguous and dst.dtype == src.dtype
    assert dst.ndim == src.ndim == 2 and len(src) <= len(dst) and col + src.shape[1] <= dst.shape[1]
    rows, width = int(src.shape[0]), int(src.shape[1]) * src.itemsize
    if rows and width:
        launches.copy_2d(dst.data.ptr + col * dst.itemsize, dst.shape[1] * dst.itemsize, src.data.ptr, width,
                         width, rows, cupy.cuda.runtime.memcpyDeviceToDevice)


def advance_positions(past, positions, num_rows: int) -> None:
    """A chained head forward's next position, in one kernel: ``past[:num_rows] += 1`` (int32)
    and every row of ``positions`` [3, num_rows] += 1 (int64; CuPy's ``+=`` is one launch each)."""
    assert past.dtype == np.int32 and positions.dtype == np.int64 and positions.shape == (3, num_rows)
    assert past.flags.c_contiguous and positions.flags.c_contiguous
    if num_rows:
        launches.kernel(_kernel(_ROWS_SOURCE, "advance_positions"), (-(-num_rows // 64),), (64,),
                        (past, positions, np.int64(num_rows)))


def copy_slabs(dst, dst_offset: int, src, src_offset: int, nbytes: int, count: int, dst_pitch: int,
               src_pitch: int) -> None:
    """``count`` slabs of ``nbytes`` bytes, slab i from ``src`` at byte ``src_offset + i *
    src_pitch`` to ``dst`` at ``dst_offset + i * dst_pitch``, in one 2-D device copy on the
    current stream: a state row of every layer (``[L, 2, R, ...]``: one slab a layer, the
    layer stride apart) without CuPy's strided views and elementwise copy."""
    import cupy
    if nbytes and count:
        launches.copy_2d(dst.data.ptr + dst_offset, dst_pitch, src.data.ptr + src_offset, src_pitch, nbytes, count,
                         cupy.cuda.runtime.memcpyDeviceToDevice)


def zero_slabs(dst, offset: int, nbytes: int, count: int, pitch: int) -> None:
    """``count`` slabs of ``nbytes`` bytes of ``dst`` set to zero, slab i at byte ``offset + i *
    pitch``, in one kernel (written as 4-byte words when offset, size and pitch allow)."""
    if not nbytes or not count:
        return
    word = 4 if offset % 4 == 0 and nbytes % 4 == 0 and pitch % 4 == 0 else 1
    total = nbytes // word * count
    launches.kernel(_kernel(_ROWS_SOURCE, "zero_slabs_u32" if word == 4 else "zero_slabs_u8"),
                    (min(-(-total // 256), 65535 * 8),), (256,),
                    (np.uint64(dst.data.ptr + offset), np.int64(pitch // word), np.int64(nbytes // word),
                     np.int64(count)))
