"""`mtpserve export`: a Qwen3.5 checkpoint -> a servable paged export, via onnxruntime-genai's builder.

We do not write our own exporter: this runs `python -m onnxruntime_genai.models.builder` with the
options the engine needs (paged attention, a block size, state capture for rollback), then
validates the result with the same loader the server uses, so a bad export fails here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from mtpserve.engine.manifest import ModelManifest, load_manifest


class ExportError(RuntimeError):
    """The builder could not produce a servable model; the message says why."""


def builder_command(checkpoint: Path, out: Path, cache_dir: Path, precision: str = "fp16",
                    block_size: int = 16, capture_capacity: int = 4) -> list[str]:
    """The builder invocation for the paged serving build (DESIGN §2)."""
    return [sys.executable, "-m", "onnxruntime_genai.models.builder",
            "-i", str(checkpoint), "-o", str(out), "-p", precision, "-e", "cuda", "-c", str(cache_dir),
            "--extra_options", "use_paged_attention=true", f"paged_block_size={block_size}",
            f"state_update_capacity={capture_capacity}"]


def export_checkpoint(checkpoint: str | Path, out: str | Path, precision: str = "fp16",
                      block_size: int = 16, capture_capacity: int = 4, quiet: bool = False) -> ModelManifest:
    """Export a Hugging Face Qwen3.5 checkpoint directory to `out` and return its validated manifest."""
    checkpoint, out = Path(checkpoint).expanduser().resolve(), Path(out).expanduser().resolve()
    if not (checkpoint / "config.json").is_file():
        raise ExportError(f"{checkpoint} is not a Hugging Face checkpoint directory (no config.json)")
    arch = json.loads((checkpoint / "config.json").read_text()).get("architectures") or []
    if arch and not any(a.startswith("Qwen3_5") for a in arch):
        raise ExportError(f"{checkpoint} is a {arch[0]}; mtpserve serves Qwen3.5 hybrids "
                          "(Qwen3_5ForConditionalGeneration or Qwen3_5MoeForConditionalGeneration)")
    for module in ("onnxruntime_genai", "torch", "transformers", "onnx_ir"):
        if importlib.util.find_spec(module) is None:
            raise ExportError(f"exporting needs the '{module}' package: pip install 'mtpserve[export]'")
    if capture_capacity < 1 or block_size < 1:
        raise ExportError("block size and capture capacity must be >= 1")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mtpserve-export-") as cache:
        cmd = builder_command(checkpoint, out, Path(cache), precision, block_size, capture_capacity)
        if not quiet:
            print("running:", " ".join(cmd), file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        raise ExportError(f"the onnxruntime-genai builder failed (exit {proc.returncode}):\n{tail}")
    _fix_tokenizer_class(out)
    return load_manifest(out)


def _fix_tokenizer_class(out: Path) -> None:
    """The builder writes tokenizer_class Qwen3_5Tokenizer, which onnxruntime-genai 0.18 cannot load.

    mtpserve reads tokenizer.json directly; the rename keeps the export usable by og.Engine too.
    """
    cfg_path = out / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("tokenizer_class") == "Qwen3_5Tokenizer":
            cfg["tokenizer_class"] = "Qwen2Tokenizer"
            cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
