"""A seeded random tiny Qwen3.5 checkpoint (GDN + full attention + MTP head) for end-to-end tests.

`make_tiny_checkpoint(out)` writes a Hugging Face `Qwen3_5ForConditionalGeneration` directory that
onnxruntime-genai's builder accepts: a tiny vision tower (the builder refuses text-only configs),
`mtp.*` weights beside the model's, and a byte-level BPE tokenizer. Every weight is rounded to a
float16-representable value, so an fp16 export holds exactly the checkpoint's weights and an fp32
PyTorch forward is an exact reference for the adapted (fp32) model.

`export_paged(ckpt, out)` runs the builder for the paged serving build (DESIGN §2).
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB = 300            # no Linear of the model is 300 wide (the builder takes such a Linear for the LM head)
HIDDEN = 64
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32
BLOCK_SIZE, CAPTURE_CAPACITY = 16, 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def text_config(special_ids: dict) -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
        hidden_act="silu", tie_word_embeddings=False, initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},   # rotary dim 8 = 4 freqs
        bos_token_id=None, eos_token_id=special_ids["<|im_end|>"], pad_token_id=special_ids["<|endoftext|>"],
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)


def _tokenizer(out: Path) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog.",
                             "Multi token prediction drafts tokens that the main model verifies."] * 20, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 1024, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "errors": "replace", "split_special_tokens": False}, indent=2))
    return ids


def _randomize(named_parameters) -> None:
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
                p.copy_(_offset_norm(0.1 * torch.randn_like(p)))
            else:
                p.normal_(0.0, 0.05)
            p.copy_(p.half().float())


def _offset_norm(w):
    return (w * 1024).round() / 1024


def make_tiny_checkpoint(out: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint to `out` (created) and return it."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    ids = _tokenizer(out)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=HIDDEN, num_position_embeddings=16)
    config = Qwen3_5Config(text_config=text_config(ids), vision_config=vision, tie_word_embeddings=False,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    model = Qwen3_5ForConditionalGeneration(config).eval()
    _randomize(model.named_parameters())
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
         "do_sample": False}))

    mtp_config = copy.deepcopy(model.config.text_config)
    mtp_config.num_hidden_layers, mtp_config.layer_types = 1, ["full_attention"]
    layer = Qwen3_5DecoderLayer(mtp_config, layer_idx=0).eval()
    _randomize(layer.named_parameters())
    mtp = {f"mtp.layers.0.{k}": v.detach().clone().contiguous() for k, v in layer.state_dict().items()}
    extra = {"mtp.fc.weight": torch.randn(HIDDEN, 2 * HIDDEN) * 0.05,
             "mtp.pre_fc_norm_embedding.weight": _offset_norm(torch.randn(HIDDEN) * 0.1),
             "mtp.pre_fc_norm_hidden.weight": _offset_norm(torch.randn(HIDDEN) * 0.1),
             "mtp.norm.weight": _offset_norm(torch.randn(HIDDEN) * 0.1)}
    mtp.update({k: v.half().float() for k, v in extra.items()})
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == ["model.safetensors"], shards
    weights = load_file(out / "model.safetensors")
    weights.update(mtp)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def export_paged(checkpoint: str | Path, out: str | Path) -> Path:
    """The paged fp16 serving export of `checkpoint` (builder -e cuda; needs no GPU)."""
    from mtpserve.cluster.export import builder_command

    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="tiny-export-cache-") as cache:
        cmd = builder_command(Path(checkpoint), out, Path(cache), "fp16", BLOCK_SIZE, CAPTURE_CAPACITY)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError("builder failed:\n" + "\n".join(proc.stdout.splitlines()[-30:]))
    return out


if __name__ == "__main__":
    ckpt = make_tiny_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "tiny_ckpt")
    if len(sys.argv) > 2:
        export_paged(ckpt, sys.argv[2])
