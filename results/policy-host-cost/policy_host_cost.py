"""The draft policy's own host time per engine step, at one load, in one process: an engine that
never drafts (FixedDraftPolicy(0)), and --draft-tokens auto with its fits solved every 8 fitted
steps for ever (before session 18) and settled (every 32 once a fit has 256 steps). The engine
steps are real (the bundled model on this machine's CPU); only the time inside the policy's
methods is counted (each call timed), so the figure is the policy's, not the model's.

On the H200 at 16 requests a step is ~0.45 ms, and auto, which drafted on 1 step of ~1,000 there,
ran 0.86x K=0 where the MTP engine that never drafts ran 0.93x (results/h200 session 18): the
policy's host time is the difference's first suspect.

    python3 results/policy-host-cost/policy_host_cost.py OUT.json [--concurrency 16] [--requests 400]
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import time

from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS
from mtpserve.engine.bundled import MODEL_DIR
from mtpserve.engine.config import EngineConfig, SpecConfig
from mtpserve.engine.draft_policy import AdaptiveDraftPolicy, FixedDraftPolicy
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.step_costs import StepCostEstimator, batch_class

METHODS = ("step_drafts", "observe_step", "observe_verified", "forget")


class UnsettledPolicy(AdaptiveDraftPolicy):
    """Auto whose fits solve every 8 fitted steps for ever (the behaviour before session 18)."""

    def fit_for(self, num_requests: int) -> StepCostEstimator:
        c = batch_class(num_requests)
        if c not in self.fits:
            self.fits[c] = StepCostEstimator(pipelined_only=self.fit_pipelined_only, settled_solve_every=8)
        return super().fit_for(num_requests)


class JudgedOnAcceptances(AdaptiveDraftPolicy):
    """Auto before session 23: every step reads its requests' acceptances (``_judge``'s
    acceptance key), with no first check that the step's requests and versions are the last one's."""

    def _judge(self, judge, requests, caps, top, uniform):
        self._same_step = None
        return super()._judge(judge, requests, caps, top, uniform)


def timed(policy, clock: dict) -> None:
    """Wrap the policy's engine-facing methods so their wall time adds up in ``clock``."""
    for name in METHODS:
        method = getattr(policy, name)

        def call(*a, _m=method, _n=name, **k):
            t = time.perf_counter()
            try:
                return _m(*a, **k)
            finally:
                clock[_n] = clock.get(_n, 0.0) + time.perf_counter() - t
        functools.update_wrapper(call, method)
        setattr(policy, name, call)


def run(engine: Engine, prompts, concurrency: int, tag: str) -> int:
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    queue, flying, steps = list(enumerate(prompts)), set(), 0
    while queue or flying:
        while queue and len(flying) < concurrency:
            i, p = queue.pop(0)
            engine.add_request(f"{tag}-{i}", p, params)
            flying.add(f"{tag}-{i}")
        for ev in engine.step():
            if ev.finish_reason is not None:
                flying.discard(ev.request_id)
        steps += 1
    return steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    policies = {"never drafts": lambda m: FixedDraftPolicy(0), "auto, solved every 8": UnsettledPolicy,
                "auto, settled, judged on acceptances": JudgedOnAcceptances, "auto, settled": AdaptiveDraftPolicy}
    engines, clocks = {}, {}
    for name, make in policies.items():
        e = Engine(EngineConfig(MODEL_DIR, device="cpu", spec=SpecConfig("auto")), draft_policy=make(4))
        clocks[name] = {}
        timed(e.draft_policy, clocks[name])
        engines[name] = e
    texts = [engines["never drafts"].tokenizer.encode(t) for t in BUNDLED_PROMPTS]
    prompts = [texts[i % len(texts)] for i in range(args.requests)]
    rounds = []
    for r in range(args.rounds):
        rec = {}
        for name, e in engines.items():
            clocks[name].clear()
            steps = run(e, prompts, args.concurrency, f"r{r}")
            rec[name] = {"steps": steps, "us_per_step": {k: round(v / steps * 1e6, 2) for k, v in clocks[name].items()},
                         "policy_us_per_step": round(sum(clocks[name].values()) / steps * 1e6, 2),
                         "depths": dict(getattr(e.draft_policy, "depths", {}))}
            print(f"round {r} {name}: {steps} steps, policy {rec[name]['policy_us_per_step']:.1f} us a step "
                  f"{rec[name]['us_per_step']}", flush=True)
        rounds.append(rec)
    with open(args.out, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "concurrency": args.concurrency,
                   "requests": args.requests, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
