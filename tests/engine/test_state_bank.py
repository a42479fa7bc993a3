"""StateBank: residency, gather/commit of a step, prefix replay against a direct gated-delta
recurrence, against the real ORT ops, and random traffic together with the KV pool."""
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mtpserve.engine.kv_pool import KVPool
from mtpserve.engine.state_bank import (
    FixedLayerSpec,
    FixedStateSpec,
    StateBank,
    StepCaptures,
    StepStates,
    split_capsule,
)

C = 4
LAYERS = tuple(FixedLayerSpec(L, conv_dim=5, conv_kernel_size=4, num_v_heads=4, v_head_dim=3,
                              num_k_heads=2, k_head_dim=2, conv_dtype="float16") for L in (0, 2))
SPEC = FixedStateSpec(LAYERS, capacity=C)


# ---- a direct reference of the op: one request, float64 -----------------------------------
def ref_gdn(S, k, v, g, beta, capacity):
    """Gated delta rule over n tokens from S [Hv, Dv, Dk] (V-major). k [n, Hk, Dk] raw keys,
    v [n, Hv, Dv], g [n, Hv] log-decay, beta [n, Hv]. Returns the final state and the capsule
    row the op would capture (first min(n, capacity) transitions), laid out as state_bank.split_capsule reads it.
    Slots past n are unspecified in the op; NaN here, so a replay that reads them fails."""
    n, Hk, Dk = k.shape
    Hv, Dv = v.shape[1:]
    kn = k / np.sqrt((k ** 2).sum(-1, keepdims=True) + 1e-6)
    decay, key = np.full((capacity, Hv), np.nan), np.full((capacity, Hk, Dk), np.nan)
    delta = np.full((capacity, Hv, Dv), np.nan)
    S = S.astype(np.float64).copy()
    for t in range(n):
        for h in range(Hv):
            kh = kn[t, h * Hk // Hv]
            d = beta[t, h] * (v[t, h] - np.exp(g[t, h]) * S[h] @ kh)
            S[h] = np.exp(g[t, h]) * S[h] + np.outer(d, kh)
            if t < capacity:
                delta[t, h] = d
        if t < capacity:
            decay[t], key[t] = np.exp(g[t]), kn[t]
    return S, np.concatenate([decay.ravel(), key.ravel(), delta.ravel()])


def ref_conv(history, layer):
    """Conv carry = the last K-1 inputs a request ever kept (zeros before the first)."""
    full = np.zeros((layer.conv_kernel_size - 1 + len(history), layer.conv_dim))
    full[layer.conv_kernel_size - 1:] = np.reshape(history, (-1, layer.conv_dim))
    return full[len(history):].T


def random_tokens(rng, layer, n):
    Hk, Dk, Hv, Dv = layer.num_k_heads, layer.k_head_dim, layer.num_v_heads, layer.v_head_dim
    return dict(k=rng.standard_normal((n, Hk, Dk)), v=rng.standard_normal((n, Hv, Dv)),
                g=-rng.uniform(0.05, 1.0, (n, Hv)), beta=rng.uniform(0, 1, (n, Hv)),
                x=rng.standard_normal((n, layer.conv_dim)))


def run_step(bank, rids, toks_per_rid):
    """What the model does in a step, from the gathered past: present + captures, [B, ...]."""
    past = bank.gather_step_inputs(rids)
    st = {"conv": [], "recurrent": [], "conv_value": [], "recurrent_capsule": []}
    for s in LAYERS:
        L, K = s.layer_id, s.conv_kernel_size
        fin, rows, convs, vals = [], [], [], []
        for i, rid in enumerate(rids):
            tk = toks_per_rid[rid][L]
            S, capsule = ref_gdn(past.recurrent_of(L)[i], tk["k"], tk["v"], tk["g"], tk["beta"], C)
            fin.append(S), rows.append(capsule)
            ext = np.concatenate([past.conv_of(L)[i].astype(np.float64), tk["x"].T], axis=-1)
            convs.append(ext[:, -(K - 1):])
            cv = np.full((C, s.conv_dim), np.nan)
            cv[:min(C, len(tk["x"]))] = tk["x"][:C]
            vals.append(cv)
        st["recurrent"].append(np.array(fin, np.float32))
        st["conv"].append(np.array(convs).astype(s.conv_dtype))
        st["recurrent_capsule"].append(np.array(rows, np.float32))
        st["conv_value"].append(np.array(vals).astype(s.conv_dtype))
    st = {k: np.stack(v) for k, v in st.items()}                  # [L, B, ...]
    return (StepStates(SPEC.layer_ids, st["conv"], st["recurrent"]),
            StepCaptures(SPEC.layer_ids, st["conv_value"], st["recurrent_capsule"]))


def test_admit_release_and_rows_are_zeroed_on_reuse():
    bank = StateBank(SPEC, max_rows=2)
    assert bank.admit("a") == 0 and bank.admit("b") == 1
    assert not bank.can_admit() and bank.admit("c") is None
    toks = {"a": {s.layer_id: random_tokens(np.random.default_rng(0), s, 2) for s in LAYERS}}
    present, caps = run_step(bank, ["a"], toks)
    bank.commit_step(["a"], present, [2], [2], caps)
    assert bank.committed_len("a") == 2 and bank.active_bank("a") == 1
    assert bank.gather_step_inputs(["a"]).recurrent_of(0).any()
    assert bank.release("a") and not bank.release("a")
    assert bank.row("b") == 0                       # the highest resident row moved down
    assert bank.admit("c") == 1
    past = bank.gather_step_inputs(["c"])
    assert bank.committed_len("c") == 0
    assert not past.conv.any() and not past.recurrent.any()
    with pytest.raises(AssertionError, match="already holds"):
        bank.admit("c")
    bank.check_integrity()


def test_gather_returns_contiguous_batch_in_request_order():
    bank = StateBank(SPEC, max_rows=3)
    for r in "abc":
        bank.admit(r)
    bank.recurrent[1, 0, 2] = 7.0                  # layer 2 (index 1), bank 0 (active), row of "c"
    past = bank.gather_step_inputs(["c", "a"])
    assert past.recurrent.shape == (2, 2, 4, 3, 2) and past.layer_ids == (0, 2)
    layer2 = past.recurrent_of(2)
    assert layer2.shape == (2, 4, 3, 2) and layer2.flags.c_contiguous      # bindable by pointer
    assert (layer2[0] == 7).all() and not layer2[1].any() and not past.recurrent_of(0).any()
    assert past.conv_of(2).dtype == np.float16 and past.conv_of(2).shape == (2, 5, 3)
    with pytest.raises(AssertionError, match="twice"):
        bank.gather_step_inputs(["a", "a"])


@pytest.mark.parametrize("chunk", [1, 1 << 30])      # the recurrent replay one layer / all layers at a time
@pytest.mark.parametrize("kept", [[1, 0, 3], [2, 3, 4], [1, 2, 2], [0, 1, 4]])
def test_commit_step_mixed_kept_prefixes_match_running_only_the_kept_tokens(kept, chunk):
    """One batch: a prefill chunk longer than C (all kept), drafts partly kept, discarded rows."""
    rng = np.random.default_rng(sum(kept))
    rids, fed, kept = ["p", "d", "z", "e"], [6, 2, 3, 4], [6, *kept]
    bank = StateBank(SPEC, max_rows=4, replay_chunk_bytes=chunk)
    for r in rids:
        bank.admit(r)
    warm = {r: {s.layer_id: random_tokens(rng, s, 2) for s in LAYERS} for r in rids}
    bank.commit_step(rids, *run_step(bank, rids, warm)[:1], [2] * 4, [2] * 4)   # publish only
    before = bank.gather_step_inputs(rids)
    toks = {r: {s.layer_id: random_tokens(rng, s, n) for s in LAYERS} for r, n in zip(rids, fed)}
    present, caps = run_step(bank, rids, toks)
    bank.commit_step(rids, present, fed, kept, caps)
    bank.check_integrity()
    after = bank.gather_step_inputs(rids)
    for i, (r, j) in enumerate(zip(rids, kept)):
        assert bank.committed_len(r) == 2 + j
        for s in LAYERS:
            L, tk = s.layer_id, {k: a[:j] for k, a in toks[r][s.layer_id].items()}
            want, _ = ref_gdn(before.recurrent_of(L)[i], tk["k"], tk["v"], tk["g"], tk["beta"], C)
            np.testing.assert_allclose(after.recurrent_of(L)[i], want, atol=2e-6)
            ext = np.concatenate([before.conv_of(L)[i], tk["x"].T.astype(s.conv_dtype)], axis=-1)
            np.testing.assert_array_equal(after.conv_of(L)[i], ext[:, ext.shape[1] - (s.conv_kernel_size - 1):])


def test_consecutive_rows_in_one_bank_step_in_place():
    bank = StateBank(SPEC, max_rows=4)
    for r in "abc":
        bank.admit(r)
    io = bank.step_buffers(["a", "b", "c"])
    assert io.present is not None
    assert np.shares_memory(io.past.recurrent, bank.recurrent) and np.shares_memory(io.present.conv, bank.conv)
    assert io.past.recurrent_of(2).flags.c_contiguous and io.present.conv_of(0).flags.c_contiguous
    assert bank.step_buffers(["c", "a"]).present is None, "rows out of order: a gathered copy"
    assert bank.step_buffers(["a", "c"]).present is None, "rows not consecutive: a gathered copy"


def test_in_place_steps_match_copied_steps_under_random_traffic():
    """Twin banks fed the same steps: one binds its rows in place whenever it can (the model
    writes present into the bank), the other always gathers and publishes copies, and replays
    one layer at a time (rows whose active bank is the target replay in place, chunk by chunk)."""
    rng = np.random.default_rng(7)
    twins = StateBank(SPEC, max_rows=5), StateBank(SPEC, max_rows=5, replay_chunk_bytes=1)
    resident, in_place_steps, copied_steps, names = [], 0, 0, iter(range(10 ** 6))
    for _ in range(60):
        if len(resident) < 5 and rng.random() < 0.4:
            rid = f"r{next(names)}"
            assert twins[0].admit(rid) == twins[1].admit(rid)
            resident.append(rid)
        if resident and rng.random() < 0.15:
            rid = resident.pop(rng.integers(len(resident)))
            assert twins[0].release(rid) and twins[1].release(rid)
        if not resident:
            continue
        step = [r for r in resident if rng.random() < 0.8] or resident[:1]
        step.sort(key=twins[0].row)                         # the engine packs in row order
        fed = rng.integers(1, C + 1, len(step))
        kept = np.array([rng.integers(0, n + 1) for n in fed])
        toks = {r: {s.layer_id: random_tokens(rng, s, n) for s in LAYERS} for r, n in zip(step, fed)}
        io = twins[0].step_buffers(step)
        present, caps = run_step(twins[0], step, toks)
        if io.present is not None:                          # the op writes into the bank rows
            io.present.conv[...], io.present.recurrent[...] = present.conv, present.recurrent
            present, in_place_steps = io.present, in_place_steps + 1
        else:
            copied_steps += 1
        twins[0].commit_step(step, present, fed, kept, caps)
        twins[1].commit_step(step, *run_step(twins[1], step, toks)[:1], fed, kept, caps)
        for bank in twins:
            bank.check_integrity()
        a, b = (bank.gather_step_inputs(resident) for bank in twins)
        np.testing.assert_array_equal(a.conv, b.conv)
        np.testing.assert_allclose(a.recurrent, b.recurrent, rtol=1e-6, atol=1e-6)
        assert [twins[0].committed_len(r) for r in resident] == [twins[1].committed_len(r) for r in resident]
    assert in_place_steps > 10 and copied_steps > 5, (in_place_steps, copied_steps)


def test_commit_step_rejects_bad_steps_without_changing_state():
    bank = StateBank(SPEC, max_rows=2)
    bank.admit("a")
    toks = {"a": {s.layer_id: random_tokens(np.random.default_rng(1), s, 6) for s in LAYERS}}
    present, caps = run_step(bank, ["a"], toks)
    with pytest.raises(AssertionError, match="capacity"):
        bank.commit_step(["a"], present, [6], [5], caps)     # 5 kept > C=4 captured
    with pytest.raises(AssertionError, match="captures"):
        bank.commit_step(["a"], present, [6], [2], None)
    with pytest.raises(AssertionError, match="num_kept"):
        bank.commit_step(["a"], present, [6], [7], caps)
    swapped = StepStates((2, 0), present.conv[::-1], present.recurrent[::-1])
    with pytest.raises(AssertionError, match="layers"):
        bank.commit_step(["a"], swapped, [6], [6], caps)
    with pytest.raises(AssertionError, match="shape"):
        bank.commit_step(["a"], StepStates(SPEC.layer_ids, present.conv[:1], present.recurrent), [6], [6])
    assert bank.committed_len("a") == 0 and bank.active_bank("a") == 0
    assert not bank.gather_step_inputs(["a"]).recurrent.any()


def test_a_bank_needs_rows_and_a_capacity_of_zero_or_more():
    with pytest.raises(ValueError, match="bad bank shape"):
        StateBank(SPEC, max_rows=0)
    bank = StateBank(FixedStateSpec(LAYERS, capacity=0), max_rows=1)      # MTP off: nothing to replay
    assert bank.admit("a") == 0 and bank.num_free_rows == 0


def test_spec_requires_one_state_shape_for_all_layers():
    other = FixedLayerSpec(7, conv_dim=5, conv_kernel_size=4, num_v_heads=4, v_head_dim=3,
                           num_k_heads=2, k_head_dim=4, conv_dtype="float16")
    with pytest.raises(ValueError, match="layers 0 and 7 have different state shapes"):
        FixedStateSpec((*LAYERS, other), capacity=C)
    with pytest.raises(ValueError, match="at least one"):
        FixedStateSpec((), capacity=C)
    zero = SPEC.zero_states(3)
    assert zero.conv.shape == (2, 3, 5, 3) and zero.conv.dtype == np.float16
    assert zero.recurrent.shape == (2, 3, 4, 3, 2) and not zero.recurrent.any()


def test_split_capsule_offsets():
    s = LAYERS[0]                                            # Hv 4, Hk 2, Dk 2, Dv 3
    W = s.num_v_heads + s.num_k_heads * s.k_head_dim + s.num_v_heads * s.v_head_dim
    cap = np.arange(2 * C * W, dtype=np.float32).reshape(2, C * W)
    decay, key, delta = split_capsule(cap, s, C)
    assert decay.shape == (2, C, 4) and key.shape == (2, C, 2, 2) and delta.shape == (2, C, 4, 3)
    assert decay[1, 0, 0] == C * W and key[0, 0, 0, 0] == C * 4 and delta[0, 0, 0, 0] == C * 8
    assert key[0, 1, 1, 0] == C * 4 + 4 + 2 and delta[0, C - 1, 3, 2] == C * W - 1
    stacked = split_capsule(np.stack([cap, -cap]), s, C)             # [L, B, ...]: leading axes kept
    assert stacked[2].shape == (2, 2, C, 4, 3) and (stacked[2][1] == -delta).all()
    assert SPEC.bytes_per_row() == 2 * 2 * (5 * 3 * 2 + 4 * 3 * 2 * 4)


# ---- against the real ORT contrib ops (pins the capsule / conv_value layout) ----------------
def _session(op, inputs, outputs, **attrs):
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper
    F, I32 = TensorProto.FLOAT, TensorProto.INT32
    vis = [helper.make_tensor_value_info(n, I32 if n in ("cu", "cap") else F, None) for n in inputs if n]
    node = helper.make_node(op, inputs, outputs, domain="com.microsoft", **attrs)
    g = helper.make_graph([node], op, vis, [helper.make_tensor_value_info(n, F, None) for n in outputs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = 1, 3
    try:
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # an onnxruntime without the op
        pytest.skip(f"{op} unavailable: {e}")


def test_replay_matches_the_real_ops():
    Hk, Hv, Dk, Dv, D, K = 2, 4, 8, 6, 10, 4
    layer = FixedLayerSpec(5, D, K, Hv, Dv, Hk, Dk)
    bank = StateBank(FixedStateSpec((layer,), capacity=4), max_rows=3)
    gdn = _session("GatedDeltaNet", ["q", "k", "v", "cu", "g", "b", "s0", "a_log", "dt", "cap"],
                   ["o", "s1", "su"], qk_l2_norm=1, gate_activation="softplus",
                   beta_activation="sigmoid", update_rule="gated_delta", state_update_capacity=4)
    conv = _session("VarlenCausalConvWithState", ["x", "w", "cu", "bias", "c0", "cap"],
                    ["y", "c1", "cv"], activation="silu", state_update_capacity=4)
    rng = np.random.default_rng(3)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w, bias, a_log, dt = f32(D, 1, K), f32(D), np.log(rng.uniform(1, 8, Hv)).astype(np.float32), f32(Hv)
    rids, fed, kept = ["a", "b", "c"], [4, 2, 3], [2, 2, 0]
    for r in rids:
        bank.admit(r)
    s0, c0 = (0.5 * f32(3, Hv, Dv, Dk)), f32(3, D, K - 1)
    bank.commit_step(rids, StepStates((5,), c0[None], s0[None]), [1] * 3, [1] * 3)   # a pre-state
    cu = np.array([0, 4, 6, 9], np.int32)
    T = int(cu[-1])
    q, k, v, g, b, x = f32(T, Hk, Dk), f32(T, Hk, Dk), f32(T, Hv, Dv), f32(T, Hv), f32(T, Hv), f32(T, D)

    def gdn_run(sl, cu_, S, cap):
        return gdn.run(None, dict(q=q[sl], k=k[sl], v=v[sl], cu=cu_, g=g[sl], b=b[sl], s0=S,
                                  a_log=a_log, dt=dt, cap=cap))

    def conv_run(sl, cu_, c, cap):
        return conv.run(None, dict(x=x[sl], w=w, cu=cu_, bias=bias, c0=c, cap=cap))

    past = bank.gather_step_inputs(rids)
    cap = np.array(fed, np.int32)
    _, s1, su = gdn_run(slice(None), cu, past.recurrent_of(5), cap)
    _, c1, cv = conv_run(slice(None), cu, past.conv_of(5), cap)
    bank.commit_step(rids, StepStates((5,), c1[None], s1[None]), fed, kept,
                     StepCaptures((5,), cv[None], su[None]))
    after = bank.gather_step_inputs(rids)
    for i, j in enumerate(kept):
        sl, one, none = slice(cu[i], cu[i] + j), np.array([0, j], np.int32), np.zeros(1, np.int32)
        want_s = gdn_run(sl, one, s0[i:i + 1], none)[1][0] if j else s0[i]
        want_c = conv_run(sl, one, c0[i:i + 1], none)[1][0] if j else c0[i]
        np.testing.assert_allclose(after.recurrent_of(5)[i], want_s, atol=1e-5)
        np.testing.assert_array_equal(after.conv_of(5)[i], want_c)
        assert bank.committed_len(rids[i]) == 1 + j


# ---- random traffic: the bank and the KV pool together -------------------------------------
class Traffic(RuleBasedStateMachine):
    """Admit, step (reserve, run, keep a prefix, commit both pools), trim, cancel, preempt.
    The bank's state must always equal a reference that only ever saw the kept tokens."""

    @initialize(max_rows=st.integers(1, 3), num_blocks=st.integers(2, 10))
    def make(self, max_rows, num_blocks):
        self.bank, self.kv = StateBank(SPEC, max_rows), KVPool(num_blocks, block_size=2)
        self.ref = {}                # rid -> {layer: (S, conv history)}
        self.next_id = 0

    @rule()
    def admit(self):
        if self.bank.can_admit():
            rid = f"r{self.next_id}"
            self.next_id += 1
            assert self.bank.admit(rid) is not None and self.kv.reserve(rid, 0)
            self.ref[rid] = {s.layer_id: (np.zeros(s.recurrent_shape), []) for s in LAYERS}

    @precondition(lambda self: self.ref)
    @rule(data=st.data(), seed=st.integers(0, 2 ** 16))
    def step(self, data, seed):
        rng = np.random.default_rng(seed)
        rids = data.draw(st.lists(st.sampled_from(sorted(self.ref)), min_size=1, unique=True))
        fed, kept = [], []
        for r in list(rids):
            n = data.draw(st.integers(1, 6))
            if not self.kv.reserve(r, self.kv.committed_len(r) + n):
                rids.remove(r)                                 # no room: the planner drops it
                continue
            fed.append(n)
            kept.append(n if n > C else data.draw(st.integers(0, n)))
        if not rids:
            return
        toks = {r: {s.layer_id: random_tokens(rng, s, n) for s in LAYERS} for r, n in zip(rids, fed)}
        present, caps = run_step(self.bank, rids, toks)
        self.bank.commit_step(rids, present, fed, kept, caps)
        for r, j in zip(rids, kept):
            self.kv.commit(r, self.kv.committed_len(r) + j)
            for s in LAYERS:
                S, hist = self.ref[r][s.layer_id]
                tk = {k: a[:j] for k, a in toks[r][s.layer_id].items()}
                S, _ = ref_gdn(S, tk["k"], tk["v"], tk["g"], tk["beta"], C)
                self.ref[r][s.layer_id] = (S, hist + list(tk["x"].astype(s.conv_dtype)))

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def trim(self, data):
        self.kv.trim(data.draw(st.sampled_from(sorted(self.ref))))

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def cancel_or_preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.ref)))
        assert self.bank.release(rid)
        self.kv.free(rid)
        del self.ref[rid]

    @invariant()
    def consistent(self):
        if not hasattr(self, "bank"):
            return
        self.bank.check_integrity()
        self.kv.check_integrity()
        assert self.bank.num_resident_rows == len(self.ref)
        for rid, layers in self.ref.items():
            assert self.kv.committed_len(rid) == self.bank.committed_len(rid)
            past = self.bank.gather_step_inputs([rid])
            for s in LAYERS:
                S, hist = layers[s.layer_id]
                np.testing.assert_allclose(past.recurrent_of(s.layer_id)[0], S, atol=2e-5)
                np.testing.assert_array_equal(past.conv_of(s.layer_id)[0],
                                              ref_conv(hist, s).astype(s.conv_dtype))

    def teardown(self):
        if not hasattr(self, "bank"):
            return
        for rid in list(self.ref):
            self.bank.release(rid), self.kv.free(rid)
        self.bank.check_integrity(), self.kv.check_integrity()
        assert self.bank.num_free_rows == self.bank.max_rows
        assert self.kv.num_free_blocks == self.kv.num_usable_blocks


TestTraffic = Traffic.TestCase
TestTraffic.settings = settings(max_examples=40, stateful_step_count=15, deadline=None)


def _bank_after_one_step(requests: str, kept: list[int], seed: int) -> StateBank:
    """A 4-row bank whose ``requests`` (one letter each) fed 3 random tokens in one step and kept
    ``kept`` of them."""
    bank = StateBank(SPEC, max_rows=4)
    rng = np.random.default_rng(seed)
    for r in requests:
        bank.admit(r)
    toks = {r: {s.layer_id: random_tokens(rng, s, 3) for s in LAYERS} for r in requests}
    present, caps = run_step(bank, list(requests), toks)
    bank.commit_step(list(requests), present, [3] * len(requests), kept, caps)
    return bank


def test_release_keeps_resident_rows_dense_and_a_moved_row_keeps_its_state():
    """A captured step binds bank rows 0..B-1: a release moves the highest resident row into the
    hole, with its active bank, state and committed length."""
    bank = _bank_after_one_step("abcd", [3, 1, 2, 3], seed=3)
    before = {r: bank.gather_step_inputs([r]) for r in "abcd"}
    lens = {r: bank.committed_len(r) for r in "abcd"}
    bank.release("b")
    assert sorted(bank.row(r) for r in "acd") == [0, 1, 2] and bank.row("d") == 1
    for r in "acd":
        after = bank.gather_step_inputs([r])
        np.testing.assert_array_equal(after.conv, before[r].conv)
        np.testing.assert_array_equal(after.recurrent, before[r].recurrent)
        assert bank.committed_len(r) == lens[r]
    bank.release("c")                                # the highest row itself: nothing moves
    assert bank.row("a") == 0 and bank.row("d") == 1
    assert bank.admit("e") == 2
    bank.check_integrity()


def test_padded_in_place_binds_rows_from_zero_only_when_padding_is_harmless():
    bank = StateBank(SPEC, max_rows=4)
    for r in "abc":
        bank.admit(r)
    assert bank.padded_in_place(["b", "a"], 4) is None               # not in row order
    assert bank.padded_in_place(["b", "c"], 4) is None               # does not start at row 0
    assert bank.padded_in_place(["a", "b", "c"], 5) is None          # more rows than the bank has
    b, present = bank.padded_in_place(["a", "b"], 4)                 # c (row 2) pads: active 0 as well
    assert b == 0 and present.conv.shape[1] == 2
    # the step writes bank 1 rows 0..1 in place: commit publishes them without a copy
    rng = np.random.default_rng(4)
    toks = {r: {s.layer_id: random_tokens(rng, s, 1) for s in LAYERS} for r in "ab"}
    ref, _ = run_step(bank, ["a", "b"], toks)
    present.conv[...] = ref.conv
    present.recurrent[...] = ref.recurrent
    bank.commit_step(["a", "b"], present, [1, 1], [1, 1])
    assert bank.active_bank("a") == bank.active_bank("b") == 1 and bank.active_bank("c") == 0
    np.testing.assert_array_equal(bank.gather_step_inputs(["a", "b"]).recurrent, ref.recurrent)
    # c is now active in bank 0 = the bank a padded step over a, b would write: refused
    assert bank.padded_in_place(["a", "b"], 4) is None
    assert bank.padded_in_place(["a", "b"], 2) is not None
    assert bank.padded_in_place(["a", "b", "c"], 4) is None          # banks differ within the step


def test_a_scratch_row_is_never_admitted_and_pads_a_full_step():
    """``scratch_rows``: the bank's last row is no request's (a captured prompt step's padding
    request reads and writes it when every other row is a request's); a new row starts active
    in row 0's bank, so running and new requests can share one in-place step."""
    bank = StateBank(SPEC, max_rows=3, scratch_rows=1)
    assert bank.admit("a") == 0 and bank.num_free_rows == 1 and bank.num_request_rows == 2
    toks = {"a": {s.layer_id: random_tokens(np.random.default_rng(0), s, 1) for s in LAYERS}}
    present, caps = run_step(bank, ["a"], toks)
    bank.commit_step(["a"], present, [1], [1], caps)
    assert bank.active_bank("a") == 1
    assert bank.admit("b") == 1 and bank.active_bank("b") == 1       # row 0's bank, not bank 0
    assert not bank.gather_step_inputs(["b"]).recurrent.any()          # zero in it
    assert not bank.can_admit() and bank.admit("c") is None           # row 2 is scratch
    b, _ = bank.padded_in_place(["a", "b"], 3)                         # both in bank 1; the scratch row pads
    assert b == 1
    bank.check_integrity()
    plain = StateBank(SPEC, max_rows=3)
    plain.admit("a")
    plain.commit_step(["a"], run_step(plain, ["a"], toks)[0], [1], [1])
    assert plain.admit("b") == 1 and plain.active_bank("b") == 0       # without scratch rows: bank 0, as before
    with pytest.raises(ValueError, match="scratch_rows"):
        StateBank(SPEC, max_rows=2, scratch_rows=2)


def test_warm_up_kernels_changes_no_row():
    """Start-up runs the multi-row gather and scatter once (their first use on the GPU builds a
    kernel): every row, resident or not, in both banks, keeps its state."""
    bank = _bank_after_one_step("ab", [3, 1], seed=5)
    conv, rec = bank._conv_flat.copy(), bank._rec_flat.copy()
    bank.warm_up_kernels(4)
    np.testing.assert_array_equal(bank._conv_flat, conv)
    np.testing.assert_array_equal(bank._rec_flat, rec)
    bank.check_integrity()
