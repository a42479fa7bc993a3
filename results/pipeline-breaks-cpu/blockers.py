"""How often a closed loop's steps could not be launched behind the step in flight, and why, at
C=16 on the bundled model: K=0 against K=2 (one K a step, as under CUDA graphs), with one output
length for all (waves) and with lengths from 128 x [0.5, 1.5]. Step counts and reasons are the
engine's bookkeeping (``Engine.overlap_blockers``), the same on the CPU as on CUDA: no timing.

    python3 results/pipeline-breaks-cpu/blockers.py OUT.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "h200" / "scripts"))
from auto_ab import ClosedLoop  # noqa: E402

from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS, output_lengths, text_workload  # noqa: E402
from mtpserve.engine.bundled import MODEL_DIR  # noqa: E402
from mtpserve.engine.config import EngineConfig, SpecConfig  # noqa: E402
from mtpserve.engine.engine import Engine  # noqa: E402


def main() -> None:
    out = []
    for ratio in (0.0, 0.5):
        for k, after_decode in ((0, False), (2, False), (2, True)):
            e = Engine(EngineConfig(MODEL_DIR, device="cpu", overlap_decode=True, spec=SpecConfig(k)))
            e.scheduler.uniform_drafts = True          # one K a step, as with CUDA graphs
            e.draft_after_decode = after_decode        # a draft step may follow a decode step in flight
            prompts = text_workload(BUNDLED_PROMPTS, e.tokenizer.encode, 96).prompt_ids
            loop = ClosedLoop(e, prompts, 16, f"k{k}", output_lengths(len(prompts), 128, ratio) or 128)
            loop.advance()
            rec = {"range_ratio": ratio, "k": k, "draft_after_decode": after_decode, "steps": len(loop.times),
                   "tokens": loop.tokens,
                   "launched_alone": loop.pipelined["False"], "continuations": e.num_continuations,
                   "blockers": dict(e.overlap_blockers)}
            out.append(rec)
            print(f"range {ratio} K={k}{' after decode' if after_decode else ''}: {rec['steps']} steps, {rec['tokens']} tokens, launched alone "
                  f"{rec['launched_alone']} ({rec['launched_alone'] / rec['steps']:.0%}); why: {rec['blockers']}",
                  flush=True)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
