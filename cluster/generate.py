"""`mtpserve generate`: run the engine in process on one or more prompts (continuous batching)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

from mtpserve.cluster.flags import add_setting_flags, given_settings
from mtpserve.engine.config import EngineConfig, config_fields, from_flat
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.speculative import SpecDecodeStats

ENGINE_SETTINGS = config_fields(EngineConfig)


@dataclass
class GenerationResult:
    prompt: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SpecDecodeStats | None = None

    def to_dict(self) -> dict:
        s = self.stats
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": {
                "target_forwards": s.num_target_forwards,
                "draft_tokens": s.num_draft_tokens,
                "accepted_tokens": s.num_accepted_tokens,
                "acceptance_rate": round(s.acceptance_rate, 4),
                "tokens_per_target_forward": round(s.tokens_per_target_forward, 4),
            },
        }


def run_prompts(engine: Engine, prompts: list[str], params: list[SamplingParams]) -> list[GenerationResult]:
    """Submit every prompt at once and step the engine until all finish."""
    results = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"gen-{i}", prompt, p)
        results.append(GenerationResult(prompt))
    by_id = {f"gen-{i}": r for i, r in enumerate(results)}
    requests = {rid: engine.scheduler.requests[rid] for rid in by_id}
    while engine.has_work:
        for event in engine.step():
            r = by_id[event.request_id]
            r.text += event.text
            r.token_ids.extend(event.token_ids)
            if event.finish_reason is not None:
                r.finish_reason = event.finish_reason.value
                r.stats = requests[event.request_id].stats
    return results


def add_generate_parser(sub) -> None:
    from mtpserve.engine.bundled import MODEL_DIR
    p = sub.add_parser("generate", help="generate text in process (no Ray), for one prompt or a file of prompts")
    p.add_argument("--model", default=str(MODEL_DIR), help="paged export directory (default: the bundled model)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line, all run concurrently")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", default="2",
                   help="MTP draft tokens per step: K (0 = off) or auto (each step's depth from its requests' measured "
                        "acceptance and the measured step cost); default 2")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_setting_flags(p.add_argument_group("engine settings"), ENGINE_SETTINGS,
                      names=["num_threads", "num_blocks", "max_resident_requests", "max_tokens_per_step",
                             "max_requests_per_step", "max_model_len", "kv_block_size"])
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from mtpserve.engine.manifest import ModelLoadError
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    if not prompts:
        print("mtpserve: error: give --prompt TEXT or --prompts-file FILE", file=sys.stderr)
        return 2
    try:
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                 seed=None if args.seed is None else args.seed + i,
                                 max_tokens=args.max_tokens) for i in range(len(prompts))]
        config = from_flat(EngineConfig, {"model_dir": args.model, "device": args.device,
                                          "draft_tokens": args.draft_tokens,
                                          **given_settings(args, ENGINE_SETTINGS)})
        engine = Engine(config)
        start = time.perf_counter()
        results = run_prompts(engine, prompts, params)
    except (ValueError, ModelLoadError) as e:
        print(f"mtpserve: error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    for r in results:
        if args.json:
            print(json.dumps(r.to_dict()))
        else:
            print(r.prompt + r.text)
            print(f"--- {len(r.token_ids)} tokens, finish: {r.finish_reason}, tokens/target forward "
                  f"{r.stats.tokens_per_target_forward:.2f}, acceptance {r.stats.acceptance_rate:.2f}")
    total = sum(len(r.token_ids) for r in results)
    print(f"{len(results)} prompts, {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s), "
          f"{engine.num_steps} steps", file=sys.stderr)
    return 0
