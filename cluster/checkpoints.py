"""Random-weight Qwen3.5 (+MTP) checkpoints for tests and benchmarks, exported with the builder.

The test fixtures (tests/conftest.py, tests/engine/tiny_checkpoint.py) and `mtpserve bench
--make-model` take their models from here.

Two shapes share one recipe:

    TINY   hidden 64, 4 layers (GDN/attn alternating), vocab 300: the test fixture, fp16-exact
           weights so an fp32 PyTorch forward is an exact reference for the adapted CPU model
    MID    hidden 2048, 24 layers in the 3:1 GDN:attention pattern, vocab 32003, about 1.4 B
           parameters with the MTP head: the benchmark model (the shape of DESIGN §6's og.Engine
           figures), made at bench time and never committed

`make_checkpoint(out, shape)` writes a Hugging Face `Qwen3_5ForConditionalGeneration` directory
the onnxruntime-genai builder accepts (a tiny vision tower, since it refuses text-only configs;
`mtp.*` weights beside the model's; a byte-level BPE tokenizer). `make_bench_model(out, "mid")`
adds the paged export. Random MTP heads agree with the model by chance only: benchmark them with
synthetic acceptance (SpecConfig.synthetic_acceptance).
"""
from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

BLOCK_SIZE, CAPTURE_CAPACITY = 16, 4


@dataclass(frozen=True)
class CheckpointShape:
    """Sizes of a random Qwen3.5 checkpoint. Pick a vocab size no projection shares: the builder
    takes any Linear as wide as the vocab for the LM head (DESIGN §2)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    mrope_section: tuple[int, int, int]     # sums to head_dim * partial_rotary_factor(0.25) / 2
    max_position_embeddings: int
    weight_std: float                       # std of the random Linear / embedding weights
    dtype: str = "float32"                  # safetensors dtype written (values are fp16-exact)


TINY = CheckpointShape(
    vocab_size=300, hidden_size=64, intermediate_size=128,
    layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    mrope_section=(2, 1, 1), max_position_embeddings=1024, weight_std=0.05)

MID = CheckpointShape(
    vocab_size=32003, hidden_size=2048, intermediate_size=3072,
    layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention") * 6,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    mrope_section=(11, 11, 10), max_position_embeddings=8192, weight_std=0.02, dtype="float16")

SHAPES = {"tiny": TINY, "mid": MID}


def text_config(shape: CheckpointShape, special_ids: dict) -> dict:
    s = shape
    return dict(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=len(s.layer_types), layer_types=list(s.layer_types),
        num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim, linear_conv_kernel_dim=4, linear_key_head_dim=s.linear_key_head_dim,
        linear_value_head_dim=s.linear_value_head_dim, linear_num_key_heads=s.linear_num_key_heads,
        linear_num_value_heads=s.linear_num_value_heads, max_position_embeddings=s.max_position_embeddings,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, initializer_range=s.weight_std,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": list(s.mrope_section), "mrope_interleaved": True},
        bos_token_id=None, eos_token_id=special_ids["<|im_end|>"], pad_token_id=special_ids["<|endoftext|>"],
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)


def write_tokenizer(out: Path, vocab_size: int, max_length: int) -> dict:
    """A byte-level BPE tokenizer (trained on two sentences, so at most `vocab_size` entries);
    returns the special tokens' ids. Model ids past its vocab decode to nothing."""
    from mtpserve.engine.tokenizer import QWEN_SPECIAL_TOKENS, train_byte_level_bpe
    tok = train_byte_level_bpe(["The quick brown fox jumps over the lazy dog.",
                                "Multi token prediction drafts tokens that the main model verifies."] * 20, vocab_size)
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in QWEN_SPECIAL_TOKENS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": max_length, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "errors": "replace", "split_special_tokens": False}, indent=2))
    return ids


def randomize(named_parameters, std: float) -> None:
    """Non-trivial values everywhere, fp16-exact as the builder stores them.

    Most norm weights are offsets of a (1 + w) RMSNorm and the builder stores 1 + w: w sits on a
    2^-10 grid so that 1 + w is fp16-exact too.
    """
    import torch

    with torch.no_grad():
        for name, p in named_parameters:
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 8.0)))
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("conv1d.weight"):   # keeps GDN outputs well above the gated norm's epsilon
                p.normal_(0.0, 0.5)
            elif "linear_attn.norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "norm" in name and p.dim() == 1:
                p.copy_(offset_norm(0.1 * torch.randn_like(p)))
            else:
                p.normal_(0.0, std)
            p.copy_(p.half().float())


def offset_norm(w):
    return (w * 1024).round() / 1024


def make_checkpoint(out: str | Path, shape: CheckpointShape = TINY, seed: int = 0) -> Path:
    """Write a seeded random checkpoint of `shape` to `out` (created) and return it."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hidden = shape.hidden_size
    ids = write_tokenizer(out, min(shape.vocab_size, 300), min(shape.max_position_embeddings, 1024))
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden, num_position_embeddings=16)
    config = Qwen3_5Config(text_config=text_config(shape, ids), vision_config=vision, tie_word_embeddings=False,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    dtype = getattr(torch, shape.dtype)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    randomize(model.named_parameters(), shape.weight_std)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    del model
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
         "do_sample": False}))

    mtp_config = copy.deepcopy(config.text_config)
    mtp_config.num_hidden_layers, mtp_config.layer_types = 1, ["full_attention"]
    layer = Qwen3_5DecoderLayer(mtp_config, layer_idx=0).eval()
    randomize(layer.named_parameters(), shape.weight_std)
    mtp = {f"mtp.layers.0.{k}": v.detach().clone().contiguous() for k, v in layer.state_dict().items()}
    extra = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden) * shape.weight_std,
             "mtp.pre_fc_norm_embedding.weight": offset_norm(torch.randn(hidden) * 0.1),
             "mtp.pre_fc_norm_hidden.weight": offset_norm(torch.randn(hidden) * 0.1),
             "mtp.norm.weight": offset_norm(torch.randn(hidden) * 0.1)}
    mtp.update({k: v.half().float() for k, v in extra.items()})
    mtp = {k: v.to(dtype) for k, v in mtp.items()}
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == ["model.safetensors"], f"expected one shard, got {shards}"
    weights = load_file(out / "model.safetensors")
    weights.update(mtp)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def export_paged(checkpoint: str | Path, out: str | Path) -> Path:
    """The builder's paged fp16 export of `checkpoint` (-e cuda; needs no GPU), not validated."""
    from mtpserve.cluster.export import builder_command

    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="mtpserve-export-cache-") as cache:
        cmd = builder_command(Path(checkpoint), out, Path(cache), "fp16", BLOCK_SIZE, CAPTURE_CAPACITY)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError("builder failed:\n" + "\n".join(proc.stdout.splitlines()[-30:]))
    return out


def make_bench_model(out: str | Path, shape: str | CheckpointShape = "mid", seed: int = 0,
                     quiet: bool = False) -> Path:
    """A paged fp16 export of a random checkpoint at `out` (reused when already there).

    The checkpoint is written beside it (`<out>.ckpt`) and removed once the export is validated.
    Its 16-token KV blocks are served at another size with ``kv_block_size`` (the graphs read
    the block size from the pools).
    """
    from mtpserve.cluster.export import export_checkpoint

    out = Path(out).expanduser().resolve()
    if (out / "genai_config.json").is_file():
        return out
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown model shape {shape!r}; choose from {sorted(SHAPES)}")
        shape = SHAPES[shape]
    ckpt = out.parent / (out.name + ".ckpt")
    if not quiet:
        print(f"making a random checkpoint ({num_parameters(shape) / 1e9:.2f} B parameters) at {ckpt}",
              file=sys.stderr, flush=True)
    make_checkpoint(ckpt, shape, seed)
    export_checkpoint(ckpt, out, "fp16", BLOCK_SIZE, CAPTURE_CAPACITY, quiet=quiet)
    shutil.rmtree(ckpt, ignore_errors=True)
    return out


def num_parameters(shape: CheckpointShape) -> int:
    """Text model + MTP head parameters (embeddings and LM head included; the vision tower not)."""
    s = shape
    h, v = s.hidden_size, s.vocab_size
    mlp = 3 * h * s.intermediate_size
    attn = h * s.num_attention_heads * s.head_dim * 2 + 2 * h * s.num_key_value_heads * s.head_dim \
        + s.num_attention_heads * s.head_dim * h
    qk, vd = s.linear_num_key_heads * s.linear_key_head_dim, s.linear_num_value_heads * s.linear_value_head_dim
    gdn = h * (2 * qk + 2 * vd) + 2 * h * s.linear_num_value_heads + (2 * qk + vd) * 4 + vd * h
    layers = sum(mlp + (attn if t == "full_attention" else gdn) for t in s.layer_types)
    return 2 * v * h + layers + attn + mlp + 2 * h * h
