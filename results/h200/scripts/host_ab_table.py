"""host_ab.py's JSON lines -> each config's tokens/s by label and round, and the new/base ratio
of each round (the rounds alternate the two checkouts, so a round's pair ran back to back).
Then each label's steady step (the steps neither a prompt step nor right after one: ``rest`` of
``seconds_by_step``) against K=0's at the same concurrency in the same round: a ratio the
host's speed, which drifts between rounds, mostly cancels out of."""
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
    if not labels[base] or not labels[new]:
        print(f"K={k} C={c}: no runs of {base if not labels[base] else new}")
        continue
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


def steady_ms(r) -> float | None:
    """ms of a run's steps that are neither a prompt step nor right after one."""
    split = r.get("seconds_by_step")
    if not split:
        return None
    return split["rest"] / max(1, r["steps"] - 2 * r["prompt_steps"]) * 1e3


for (k, c), labels in sorted(by.items()):
    if not k or (0, c) not in by:
        continue
    for label in (base, new):
        pairs = [(steady_ms(a), steady_ms(b)) for a, b in zip(labels[label], by[(0, c)][label])]
        ratios = [a / b for a, b in pairs if a and b]
        if ratios:
            print(f"K={k} C={c} {label}: steady step / K=0's, round by round " + ", ".join(f"{x:.2f}" for x in ratios))
            out.setdefault(f"K={k} C={c}", {})[f"steady_vs_k0_{label}"] = ratios
if len(sys.argv) > 4:
    json.dump(out, open(sys.argv[4], "w"), indent=1)
