"""The `mtpserve` command line: one subcommand per user job.

    mtpserve info       what a model is
    mtpserve export     a Qwen3.5 checkpoint -> a servable paged export
    mtpserve generate   run the engine in process on prompts
    mtpserve serve      the OpenAI-compatible endpoint on Ray Serve
    mtpserve bench      benchmarks: in-process engine or an HTTP endpoint, against onnxruntime-genai
"""

from __future__ import annotations

import argparse
import json
import sys

from mtpserve.engine.bundled import MODEL_DIR


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(MODEL_DIR),
                   help="paged onnxruntime-genai export directory (default: the bundled model)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtpserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="describe a model: layers, heads, state groups, MTP head, files")
    _add_model_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("export", help="export a Qwen3.5 Hugging Face checkpoint as a paged model "
                                      "(needs: pip install 'mtpserve[export]')")
    p.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"],
                   help="weights and activations of the export (bf16 is not served: numpy and CuPy have no bfloat16)")
    p.add_argument("--block-size", type=int, default=16, help="paged KV block size in tokens")
    p.add_argument("--capture-capacity", type=int, default=4,
                   help="state transitions captured per step; draft tokens per step <= min(7, this)")
    p.set_defaults(func=cmd_export)

    from mtpserve.cluster.bench.cli import add_bench_parser
    from mtpserve.cluster.generate import add_generate_parser
    from mtpserve.cluster.serve import add_serve_parser
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


def _fail(message: str) -> int:
    print(f"mtpserve: error: {message}", file=sys.stderr)
    return 2


def cmd_info(args) -> int:
    from mtpserve.engine.manifest import ModelLoadError, flash_block_multiple, flash_block_size_to_try, load_manifest
    try:
        manifest = load_manifest(args.model)
    except ModelLoadError as e:
        return _fail(str(e))
    info = manifest.to_dict()
    info["flash_block_multiple"] = flash_block_multiple(manifest)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    kinds = info["layers_by_kind"]
    print(f"model        {info['path']}")
    print(f"type         {info['model_type']}, {info['num_parameters'] / 1e6:.2f} M parameters "
          f"({info['compute_dtype']})")
    print(f"layers       {info['num_hidden_layers']}: {kinds['linear_attention']} Gated DeltaNet, "
          f"{kinds['full_attention']} full attention ({info['num_attention_heads']} query heads)")
    print(f"vocab        {info['vocab_size']}, hidden {info['hidden_size']}, "
          f"context {info['context_length']}, eos {info['eos_token_ids']}")
    for g in info["state_groups"]:
        detail = {k: v for k, v in g.items() if k not in ("kind", "layer_ids")}
        print(f"state group  {g['kind']:<16} layers {g['layer_ids']}  {detail}")
    print(f"paged KV     block size {info['block_size']}; capture capacity {info['capture_capacity']}")
    flash = flash_block_size_to_try(manifest)
    if flash:
        print(f"             on CUDA, ORT's flash PagedAttention takes prompts and verifies at multiples of {flash} "
              f"tokens (by ORT's source; --kv-block-size {flash}); at {info['block_size']} it gathers KV for them")
    mtp = info["mtp"]
    print("MTP head     " + ("none" if mtp is None else f"{mtp['filename']} ({mtp['num_layers']} layer)"))
    print(f"files        {info['total_bytes'] / 2**20:.1f} MiB")
    for name, size in info["files"].items():
        print(f"  {size / 2**20:9.2f} MiB  {name}")
    return 0


def cmd_export(args) -> int:
    from mtpserve.cluster.export import ExportError, export_checkpoint
    from mtpserve.engine.manifest import ModelLoadError
    try:
        manifest = export_checkpoint(args.checkpoint, args.out, args.precision, args.block_size,
                                     args.capture_capacity)
    except (ExportError, ModelLoadError) as e:
        return _fail(str(e))
    print(f"exported {manifest.num_parameters / 1e6:.2f} M parameters to {manifest.path} "
          f"(MTP head: {'yes' if manifest.mtp else 'no'}); try: mtpserve info --model {manifest.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
