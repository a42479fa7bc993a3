"""The varlen padding contract a captured prompt step would rely on, checked with ORT's CPU
kernels (no GPU: the CUDA capture itself is prompt_capture_probe.py's question).

    python3 varlen_contract_cpu.py

The bundled model's forward over a step's real rows alone (``Runner.run_main``: tight
``attention_metadata``) against the same rows with zero-length requests among or after them, one
padding request on the scratch block taking the rows left to a fixed total (128), and the loose
metadata a captured shape would fix ([total rows, the table's tokens, 1]): logits of every real
row and the present conv / recurrent states of every real request, max abs error. Then a mixed
step after those prompts (decode rows at past > 0 and a 20-row chunk), the same way.
Session 33, this CPU: every error 0.0.
"""
import numpy as np

from mtpserve.engine import runner as runner_mod
from mtpserve.engine.config import EngineConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.runner import PackedRows
from mtpserve.engine.state_bank import StepStates

eng = Engine(EngineConfig(device="cpu", max_model_len=512))
r, bank = eng.runner, eng.state_bank
bs = eng.manifest.block_size
rng = np.random.default_rng(0)
lens = [40, 7, 1, 3, 20, 2, 9, 1]
per = -(-512 // bs)
tables = [list(range(1 + b * per, 1 + (b + 1) * per)) for b in range(len(lens))]
rows = [PackedRows(rng.integers(3, 4000, n).tolist(), 0, t) for n, t in zip(lens, tables)]
print("block_size", bs, "pool", eng.kv_pool.num_blocks)

def states(B):
    L = len(bank.spec.layer_ids)
    return StepStates(bank.spec.layer_ids, np.zeros((L, B) + bank.conv.shape[3:], bank.conv.dtype),
                      np.zeros((L, B) + bank.recurrent.shape[3:], bank.recurrent.dtype))

def run(rows, B, loose=None):
    orig = runner_mod.pack_rows
    def packed(rs, scratch_block=0, min_width=1):
        p = orig(rs, scratch_block, min_width)
        if loose is not None:
            p["attention_metadata"] = np.array(loose, np.int32)
        return p
    runner_mod.pack_rows = packed
    try:
        out = r.run_main(rows, states(B), np.zeros(B, np.int32))
    finally:
        runner_mod.pack_rows = orig
    return out

ref = run(rows, len(rows))
n = sum(lens)
T = 128
for label, extra in (("padding only", [PackedRows([0] * (T - n), 0, [0])]),
                     ("zero-length + padding", [PackedRows([], 0, [])] * 3 + [PackedRows([0] * (T - n), 0, [0])]),
                     ("zero-length mid", None)):
    if extra is None:
        rr = rows[:2] + [PackedRows([], 0, [])] + rows[2:] + [PackedRows([0] * (T - n), 0, [0])]
        real_rows = list(range(0, n))
        real_req = [0, 1] + list(range(3, 3 + len(rows) - 2))
    else:
        rr = rows + extra
        real_rows = list(range(n))
        real_req = list(range(len(rows)))
    for loose in (None, [T, per * bs, 1]):
        try:
            out = run(rr, len(rr), loose)
            e_logits = float(np.abs(out.logits[:n].astype(np.float32) - ref.logits[:n].astype(np.float32)).max())
            e_rec = float(np.abs(out.present.recurrent[:, real_req] - ref.present.recurrent).max())
            e_conv = float(np.abs(out.present.conv[:, real_req].astype(np.float32) - ref.present.conv.astype(np.float32)).max())
            print(label, "loose" if loose else "tight", "logits", e_logits, "recurrent", e_rec, "conv", e_conv)
        except Exception as ex:
            print(label, "loose" if loose else "tight", "ERROR", type(ex).__name__, str(ex)[:300])

# a mixed step after the prompts: decode rows at past > 0, one 20-row chunk
def states_from(present, B, pad):
    L = present.conv.shape[0]
    conv = np.zeros((L, B + pad) + present.conv.shape[2:], present.conv.dtype)
    rec = np.zeros((L, B + pad) + present.recurrent.shape[2:], present.recurrent.dtype)
    conv[:, :B], rec[:, :B] = present.conv, present.recurrent
    return StepStates(bank.spec.layer_ids, conv, rec)

mixed = [PackedRows(rng.integers(3, 4000, 20 if b == 4 else 1).tolist(), lens[b], t) for b, t in enumerate(tables)]
m = sum(len(x.token_ids) for x in mixed)
ref2 = r.run_main(mixed, states_from(ref.present, len(mixed), 0), np.zeros(len(mixed), np.int32))
orig = runner_mod.pack_rows
runner_mod.pack_rows = lambda rs, scratch_block=0, min_width=1: {**orig(rs, scratch_block, min_width),
                                                                 "attention_metadata": np.array([T, per * bs, 1], np.int32)}
try:
    rr = mixed + [PackedRows([], 0, [])] * 2 + [PackedRows([0] * (T - m), 0, [0])]
    out2 = r.run_main(rr, states_from(ref.present, len(mixed), 3), np.zeros(len(rr), np.int32))
finally:
    runner_mod.pack_rows = orig
print("mixed loose+padded logits", float(np.abs(out2.logits[:m].astype(np.float32) - ref2.logits[:m].astype(np.float32)).max()),
      "recurrent", float(np.abs(out2.present.recurrent[:, :len(mixed)] - ref2.present.recurrent).max()),
      "conv", float(np.abs(out2.present.conv[:, :len(mixed)].astype(np.float32) - ref2.present.conv.astype(np.float32)).max()))
