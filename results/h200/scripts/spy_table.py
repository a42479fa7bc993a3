"""Where a profiled loop's wall time goes, from py-spy's raw stacks (``spy_loop.py``): the
samples of the measured run only, each function's own share (the innermost Python frame: a C
call's time, ORT's, CuPy's or a wait, goes to the line that made it) and its cumulative share,
as a fraction of the run and in microseconds a step.

    python3 spy_table.py K2.txt --ms-per-step 1.02 [--top 40] [--json out.json]

(``--ms-per-step``: the measured run's wall time a step, which spy_loop prints; a sample's
share of the run times it is that part's time a step.)
"""
from __future__ import annotations

import argparse
import collections
import json
import re

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def frame_key(frame: str, with_line: bool) -> str:
    m = FRAME.match(frame)
    if not m:
        return frame
    name = m["file"].rsplit("/", 1)[-1]
    return f"{name}:{m['func']}" + (f":{m['line']}" if with_line and m["line"] else "")


def table(path: str, marker: str = "measured"):
    own, own_lines, cumulative, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for raw in open(path):
        raw = raw.rstrip("\n")
        if not raw:
            continue
        stack, _, count = raw.rpartition(" ")
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith(marker + " ")), None)
        if at is None:
            continue
        n = int(count)
        total += n
        inner = frames[at + 1:]
        if not inner:
            continue
        own[frame_key(inner[-1], False)] += n
        own_lines[frame_key(inner[-1], True)] += n
        for key in {frame_key(f, False) for f in inner}:
            cumulative[key] += n
    return total, own, own_lines, cumulative


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("raw")
    p.add_argument("--ms-per-step", type=float, required=True, help="the measured run's ms a step (spy_loop prints it)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    total, own, own_lines, cumulative = table(args.raw)
    per_step = args.ms_per_step * 1e3 / max(total, 1)    # us a step per sample
    print(f"{total} samples of the measured run, {args.ms_per_step * 1e3:.1f} us a step")
    out = {"samples": total, "ms_per_step": args.ms_per_step}
    for name, counter in (("own", own), ("own by line", own_lines), ("cumulative", cumulative)):
        print(f"{name} (us a step, share):")
        rows = counter.most_common(args.top)
        for key, n in rows:
            print(f"  {n * per_step:8.1f}  {n / total:6.1%}  {key}")
        out[name] = [(key, round(n * per_step, 2)) for key, n in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
