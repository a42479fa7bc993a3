"""host_ab.py's JSON lines -> each config's tokens/s by label and round, and the new/base ratio
of each round (the rounds alternate the two checkouts, so a round's pair ran back to back)."""
import collections
import json
import statistics
import sys

runs = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
base, new = sys.argv[2], sys.argv[3]
by = collections.defaultdict(lambda: collections.defaultdict(list))
for r in runs:
    by[(r["k"], r["c"])][r["label"]].append(r)
out = {}
for (k, c), labels in sorted(by.items()):
    pairs = list(zip(labels[base], labels[new]))
    ratios = [b2["tok_s"] / b1["tok_s"] for b1, b2 in pairs]
    line = (f"K={k} C={c}: {base} " + " ".join(f"{r['tok_s']:.0f}" for r in labels[base])
            + f" | {new} " + " ".join(f"{r['tok_s']:.0f}" for r in labels[new])
            + f" tok/s; ms/step {statistics.median(r['ms_per_step'] for r in labels[base]):.3f} -> "
              f"{statistics.median(r['ms_per_step'] for r in labels[new]):.3f}")
    if ratios:
        line += f"; {new}/{base} median {statistics.median(ratios):.3f}x (" + ", ".join(f"{x:.3f}" for x in ratios) + ")"
    print(line)
    out[f"K={k} C={c}"] = {"base": labels[base], "new": labels[new], "ratios": ratios}
if len(sys.argv) > 4:
    json.dump(out, open(sys.argv[4], "w"), indent=1)
