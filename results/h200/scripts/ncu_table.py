"""ncu's CSV (gpu__time_duration.sum and dram__bytes.sum per kernel) -> time and bytes by kernel.

    python3 ncu_table.py step.csv step.json [HBM_TB_PER_S]

Kernels are grouped by their name's first 90 characters; each group's share of the step's
kernel time, its DRAM bytes and the bandwidth it reached; the whole step's bytes over its
kernel time against the HBM peak (4.8 TB/s on an H200 unless given).
"""
import collections
import csv
import json
import sys

rows = list(csv.reader(open(sys.argv[1])))
peak = float(sys.argv[3]) * 1e12 if len(sys.argv) > 3 else 4.8e12
hdr = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
h = rows[hdr]
kn, mn, mv, idc = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value"), h.index("ID")
unit = h.index("Metric Unit") if "Metric Unit" in h else None
scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1, "usecond": 1e3, "msecond": 1e6}
per = collections.defaultdict(dict)
for r in rows[hdr + 1:]:
    if len(r) <= mv:
        continue
    v = float(r[mv].replace(",", "")) * (scale.get(r[unit], 1) if unit is not None else 1)
    per[(r[idc], r[kn][:90])][r[mn]] = v
time_ns, nbytes, count = collections.Counter(), collections.Counter(), collections.Counter()
for (_, name), m in per.items():
    time_ns[name] += m.get("gpu__time_duration.sum", 0.0)
    nbytes[name] += m.get("dram__bytes.sum", 0.0)
    count[name] += 1
total_t, total_b = sum(time_ns.values()), sum(nbytes.values())
out = {"kernels": sum(count.values()), "kernel_time_us": round(total_t / 1e3, 1),
       "dram_mb": round(total_b / 1e6, 1),
       "bandwidth_tb_s": round(total_b / total_t / 1e3, 3) if total_t else None,
       "share_of_hbm_peak": round(total_b / total_t / (peak / 1e9), 3) if total_t else None,
       "bytes_at_peak_us": round(total_b / peak * 1e6, 1),
       "top": [{"kernel": n, "count": count[n], "us": round(t / 1e3, 1), "share": round(t / total_t, 3),
                "mb": round(nbytes[n] / 1e6, 2),
                "tb_s": round(nbytes[n] / t / 1e3, 3) if t else None}
               for n, t in time_ns.most_common(30)]}
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(json.dumps({k: v for k, v in out.items() if k != "top"}))
for t in out["top"][:20]:
    print(f"{t['share']:6.1%} {t['us']:8.1f} us {t['count']:4d}x {t['mb']:8.2f} MB {t['tb_s'] or 0:6.2f} TB/s  {t['kernel']}")
