"""Build mtpserve's bundled demo model: a small trained Qwen3.5-style hybrid (Gated DeltaNet + full
attention, 3:1) with a one-layer MTP head, trained on the Python standard library's own source.

Steps (each a subcommand; see README.md beside this file):
  prepare   CPU. Corpus from this interpreter's stdlib .py files, held-out split, byte-level BPE
            tokenizer, token ids  ->  CORPUS_DIR (.work/corpus, git-ignored)
  train     GPU (or CPU). Trains main model + MTP head, evaluates, writes a sharded fp32 HF
            checkpoint + train_log.json  ->  --out
  evaluate  Held-out main/MTP loss and MTP top-1 agreement of a checkpoint.
  export    onnxruntime-genai builder (paged fp16 CUDA build) -> engine/bundled/model/, then the
            tokenizer_config fix-ups (Qwen2Tokenizer, ChatML chat template).
  verify    CPU fp32 export of the same checkpoint vs PyTorch (main logits, MTP head vs the
            reference in shared/probes/run_ort_cpu.py).

Only train needs a GPU to be quick; everything is seeded (GPU kernels are not bit-deterministic).
"""
import argparse
import ast
import copy
import hashlib
import json
import lzma
import math
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CORPUS_DIR = REPO / ".work" / "corpus"
MODEL_DIR = HERE / "model"
SEED = 1234
VOCAB = 4000  # no Linear in the model is 4000 wide (the builder takes such a Linear for the LM head)
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
                 " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\\n' }}{% endif %}")
HELDOUT_PERCENT = 2


# ----------------------------------------------------------------------------------------- corpus
def is_heldout(rel: str) -> bool:
    """Stable split: ~2% of files, by the sha256 of their path relative to the stdlib root."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def chat(prompt: str, answer: str) -> str:
    """One exchange, exactly as CHAT_TEMPLATE renders it (with add_generation_prompt) + the answer."""
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def def_exchanges(rel: str, text: str) -> list[str]:
    """ChatML exchanges 'write function f of module m' -> its source, for short top-level defs."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    module = rel[:-3].replace("/", ".").removesuffix(".__init__")
    lines = text.splitlines(keepends=True)
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if not 3 <= node.end_lineno - first + 1 <= 60:
            continue
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        prompt = f"Write the Python {kind} `{node.name}` of the module `{module}`."
        doc = ast.get_docstring(node)
        if doc and doc.strip():
            prompt += " " + doc.strip().splitlines()[0].strip()
        out.append(chat(prompt, "".join(lines[first - 1:node.end_lineno]).rstrip("\n")))
    return out


def build_corpus(stdlib: Path) -> dict:
    """Documents of both splits: every stdlib .py file (site-packages excluded, test/ folders kept:
    they are half the text), each ending in <|endoftext|>, plus ChatML def exchanges from non-test
    files. Deterministic: sorted paths, seeded shuffle."""
    docs = {"train": [], "heldout": []}
    files = {"train": [], "heldout": []}
    for p in sorted(stdlib.rglob("*.py")):
        rel = p.relative_to(stdlib).as_posix()
        if rel.startswith("site-packages/") or "__pycache__" in rel:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        split = "heldout" if is_heldout(rel) else "train"
        files[split].append(rel)
        docs[split].append(text + "<|endoftext|>")
        if "test" not in rel.split("/")[0] and "/test" not in rel and "idle_test" not in rel:
            docs[split].extend(d + "<|endoftext|>" for d in def_exchanges(rel, text))
    for split in docs:
        random.Random(SEED).shuffle(docs[split])
    return {"docs": docs, "files": files}


def train_tokenizer(docs: list[str]):
    from mtpserve.engine.tokenizer import train_byte_level_bpe
    tok = train_byte_level_bpe(docs, VOCAB)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def cmd_prepare(args):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = Path(args.corpus)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    c = build_corpus(stdlib)
    tok = train_tokenizer(c["docs"]["train"])
    tok.save(str(out / "tokenizer.json"))
    meta = {"stdlib": str(stdlib), "python": sys.version.split()[0], "seed": SEED}
    for split, docs in c["docs"].items():
        with lzma.open(out / f"{split}.jsonl.xz", "wt", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d) + "\n")
        ids = [i for enc in tok.encode_batch(docs, add_special_tokens=False) for i in enc.ids]
        np.savez_compressed(out / f"{split}_ids.npz", ids=np.asarray(ids, dtype=np.uint16))
        meta[split] = {"files": len(c["files"][split]), "docs": len(docs), "tokens": len(ids),
                       "bytes": sum(len(d.encode()) for d in docs)}
    meta["heldout"]["file_list"] = c["files"]["heldout"]
    meta["tokenizer_sha256"] = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    meta["seconds"] = round(time.time() - t0, 1)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps({k: v for k, v in meta.items() if k != "heldout"}, indent=1),
          {k: v for k, v in meta["heldout"].items() if k != "file_list"})


# ------------------------------------------------------------------------------------------ model
def model_config(tok_path: Path):
    """The bundled architecture: 8 layers [L,L,L,F]x2, hidden 256, ~8M parameters + MTP head."""
    from tokenizers import Tokenizer
    from transformers import Qwen3_5Config
    tok = Tokenizer.from_file(str(tok_path))
    from mtpserve.engine.tokenizer import QWEN_SPECIAL_TOKENS
    sid = {s: tok.token_to_id(s) for s in QWEN_SPECIAL_TOKENS}
    text_cfg = dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=4, linear_num_value_heads=8,
        max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
        initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        bos_token_id=None, eos_token_id=sid["<|im_end|>"], pad_token_id=sid["<|endoftext|>"],
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
    )
    vision_cfg = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=256, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=text_cfg, vision_config=vision_cfg, tie_word_embeddings=False,
                        image_token_id=sid["<|image_pad|>"], video_token_id=sid["<|video_pad|>"],
                        vision_start_token_id=sid["<|vision_start|>"], vision_end_token_id=sid["<|vision_end|>"])
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return cfg, sid


def build_mtp(text_config):
    """The MTP head, parameter names as in Qwen3.5 checkpoints (prefix "mtp."):
       x[t] = fc(cat(rms1p(embed(tok[t+1]), pre_fc_norm_embedding), rms1p(h[t], pre_fc_norm_hidden)))
       x    = layers.0(x)  (full-attention decoder layer, causal, positions t)
       logits[t] = lm_head(rms1p(x, norm))  ~ tok[t+2]
    where h is the main model's post-final-norm hidden state and rms1p(x, w) = x/rms(x) * (1 + w)."""
    import torch
    import torch.nn as nn
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    class MTPHead(nn.Module):
        def __init__(self, tc):
            super().__init__()
            tc = copy.deepcopy(tc)
            tc.num_hidden_layers, tc.layer_types = 1, ["full_attention"]
            H, eps = tc.hidden_size, tc.rms_norm_eps
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps)
            self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps)
            self.layers = nn.ModuleList([Qwen3_5DecoderLayer(tc, layer_idx=0)])
            self.norm = Qwen3_5RMSNorm(H, eps)

        def forward(self, next_embeds, hidden, position_embeddings):
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1))
            x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
            x = x[0] if isinstance(x, tuple) else x
            return self.norm(x)

    return MTPHead(text_config)


def forward_losses(model, mtp, ids):
    """ids [B, T+2] -> dict of scalar tensors: main CE (next token), MTP CE (token t+2), KL of the MTP
    head toward the main model's detached next-next prediction, and top-1 agreement with it.

        ids        i0   i1   i2  ...  iT-1  iT  iT+1
        main in    i0   i1   i2  ...  iT-1             logits[t]  ~ ids[t+1]
        mtp in     (embed(ids[t+1]), h[t]), t < T      mlogits[t] ~ ids[t+2]
        agree      argmax mlogits[t] == argmax logits[t+1],  t < T-1
    """
    import torch
    import torch.nn.functional as F
    lm = model.model.language_model
    T = ids.shape[1] - 2
    h = lm(input_ids=ids[:, :T], use_cache=False).last_hidden_state
    logits = model.lm_head(h).float()
    pos = torch.arange(T, device=ids.device).view(1, 1, -1).expand(3, ids.shape[0], -1)
    x = mtp(lm.embed_tokens(ids[:, 1:T + 1]), h, lm.rotary_emb(h, pos))
    mlogits = model.lm_head(x).float()
    V = logits.shape[-1]
    ce_main = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:T + 1].reshape(-1))
    ce_mtp = F.cross_entropy(mlogits.reshape(-1, V), ids[:, 2:T + 2].reshape(-1))
    teacher = logits[:, 1:].detach().log_softmax(-1)            # main's prediction of tok[t+2]
    student = mlogits[:, :-1].log_softmax(-1)
    kd = F.kl_div(student.reshape(-1, V), teacher.reshape(-1, V), log_target=True, reduction="batchmean")
    agree = (mlogits[:, :-1].argmax(-1) == logits[:, 1:].argmax(-1)).float().mean()
    return {"ce_main": ce_main, "ce_mtp": ce_mtp, "kd": kd, "agree": agree}


def checkpoint_state(model, mtp):
    sd = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    sd.update({f"mtp.{k}": v.detach().float().cpu().contiguous() for k, v in mtp.state_dict().items()})
    return sd


def save_checkpoint(out: Path, model, mtp, cfg, sid, max_shard_bytes=14_000_000):
    """HF layout the builder reads: config.json, generation_config.json, sharded model*.safetensors
    (each < 16 MB so the device tool can bring it back) + model.safetensors.index.json."""
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    sd = checkpoint_state(model, mtp)
    shards, cur, size = [], {}, 0
    for k in sorted(sd):
        n = sd[k].numel() * 4
        if cur and size + n > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = sd[k], size + n
    shards.append(cur)
    wmap = {}
    for i, sh in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(out / name), metadata={"format": "pt"})
        wmap.update({k: name for k in sh})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}, indent=1))
    cfg.save_pretrained(out)
    gen = {"bos_token_id": sid["<|endoftext|>"], "eos_token_id": [sid["<|im_end|>"], sid["<|endoftext|>"]],
           "pad_token_id": sid["<|endoftext|>"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def load_checkpoint(ckpt: Path, device="cpu"):
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3_5ForConditionalGeneration
    model = Qwen3_5ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval().to(device)
    mtp = build_mtp(model.config.text_config)
    sd = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        sd.update({k[4:]: v for k, v in load_file(str(f)).items() if k.startswith("mtp.")})
    mtp.load_state_dict(sd)
    return model, mtp.eval().to(device)


def evaluate(model, mtp, ids: np.ndarray, seq: int, batch: int, max_windows: int, device, autocast):
    """Mean of forward_losses over non-overlapping windows of ids (teacher-forced)."""
    import torch
    n = min((len(ids) - 2) // seq, max_windows)
    starts = np.arange(n) * seq
    tot, count = {}, 0
    model.eval(), mtp.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        for i in range(0, n, batch):
            b = np.stack([ids[s:s + seq + 2] for s in starts[i:i + batch]]).astype(np.int64)
            r = forward_losses(model, mtp, torch.from_numpy(b).to(device))
            for k, v in r.items():
                tot[k] = tot.get(k, 0.0) + float(v) * len(b)
            count += len(b)
    model.train(), mtp.train()
    return {k: round(v / count, 4) for k, v in tot.items()} | {"tokens": count * seq}


# ------------------------------------------------------------------------------------------ train
def cmd_train(args):
    import torch
    import transformers
    from transformers import Qwen3_5ForConditionalGeneration
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    corpus = Path(args.corpus)
    torch.manual_seed(SEED)
    random.seed(SEED)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_float32_matmul_precision("high")  # TF32 for the fp32 GDN chunk math
    autocast = device.type == "cuda"
    cfg, sid = model_config(corpus / "tokenizer.json")
    model = Qwen3_5ForConditionalGeneration(cfg)
    mtp = build_mtp(model.config.text_config)
    mtp.apply(model._init_weights)
    model.model.visual.requires_grad_(False)
    model.to(device).train(), mtp.to(device).train()
    n_main = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"params: main {n_main / 1e6:.2f}M, mtp {n_mtp / 1e6:.2f}M, device {device}", flush=True)
    train_ids = np.load(corpus / "train_ids.npz")["ids"]
    held_ids = np.load(corpus / "heldout_ids.npz")["ids"]
    params = [p for p in list(model.parameters()) + list(mtp.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    rng = np.random.default_rng(SEED)
    T, B = args.seq, args.batch
    total = args.steps or 10**9
    log = {"args": vars(args), "device": torch.cuda.get_device_name() if autocast else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__,
           "params_main": n_main, "params_mtp": n_mtp, "train_tokens_corpus": len(train_ids),
           "heldout_tokens_corpus": len(held_ids), "history": [], "evals": []}
    t0 = t_cal = time.time()
    step = 0
    while step < total:
        if not args.steps and step == args.calibrate_steps:   # size the run by measured speed
            per_step = (time.time() - t_cal) / (args.calibrate_steps - 5)
            total = max(step + 1, int((args.max_seconds - (time.time() - t0)) / per_step) + step)
            log["calibrated_steps"], log["seconds_per_step"] = total, round(per_step, 4)
            print(f"calibrated: {per_step:.3f} s/step -> {total} steps", flush=True)
        if step == 5:
            t_cal = time.time()
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        if step >= args.warmup and total < 10**9:
            lr = args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - args.warmup) / max(1, total - args.warmup))))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train_ids) - T - 2, size=B)
        b = torch.from_numpy(np.stack([train_ids[s:s + T + 2] for s in starts]).astype(np.int64)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            r = forward_losses(model, mtp, b)
            loss = r["ce_main"] + args.w_mtp * r["ce_mtp"] + args.w_kd * r["kd"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 25 == 0 or step == total:
            vals = {k: float(v.detach()) for k, v in r.items()}
            rec = {"step": step, "s": round(time.time() - t0, 1), "lr": round(lr, 6)} | {k: round(v, 4) for k, v in vals.items()}
            log["history"].append(rec)
            print(rec, flush=True)
        if time.time() - t0 > args.max_seconds * 1.05:
            print("wall-time stop", flush=True)
            break
        if args.eval_every and step % args.eval_every == 0:
            ev = evaluate(model, mtp, held_ids, T, B, args.eval_windows, device, autocast) | {"step": step}
            log["evals"].append(ev)
            print("heldout", ev, flush=True)
    log["train_seconds"] = round(time.time() - t0, 1)
    log["steps"] = step
    log["tokens_seen"] = step * B * T
    log["final_train"] = evaluate(model, mtp, train_ids[rng.integers(0, len(train_ids) // 2):], T, B,
                                  args.eval_windows, device, autocast)
    log["final_heldout"] = evaluate(model, mtp, held_ids, T, B, args.eval_windows, device, autocast)
    print("final train", log["final_train"], "\nfinal heldout", log["final_heldout"], flush=True)
    save_checkpoint(Path(args.out), model, mtp, cfg, sid)
    shutil.copy(corpus / "tokenizer.json", Path(args.out) / "tokenizer.json")
    Path(args.out, "train_log.json").write_text(json.dumps(log, indent=1))


def cmd_evaluate(args):
    import torch
    model, mtp = load_checkpoint(Path(args.ckpt))
    held = np.load(Path(args.corpus) / "heldout_ids.npz")["ids"]
    print(json.dumps(evaluate(model, mtp, held, args.seq, 4, args.windows, torch.device("cpu"), False)))


# ----------------------------------------------------------------------------------------- export
def write_tokenizer_files(dst: Path, tok_json: Path, sid: dict):
    shutil.copy(tok_json, dst / "tokenizer.json")
    cfg_path = dst / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    for k in ("is_local", "local_files_only", "merges_file"):
        tc.pop(k, None)
    tc.update({"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 2048,
               "add_prefix_space": False, "clean_up_tokenization_spaces": False, "errors": "replace",
               "split_special_tokens": False, "chat_template": CHAT_TEMPLATE})
    cfg_path.write_text(json.dumps(tc, indent=2))


def run_builder(ckpt: Path, out: Path, precision: str, ep: str, extra: list[str]):
    cache = out.parent / (out.name + "_cache")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
           "-p", precision, "-e", ep, "-c", str(cache)] + (["--extra_options", *extra] if extra else [])
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(cache, ignore_errors=True)
    if r.returncode:
        sys.exit(f"builder failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def cmd_export(args):
    """Paged fp16 CUDA build of ckpt into engine/bundled/model (replaced)."""
    ckpt, dst = Path(args.ckpt), Path(args.out)
    tmp = dst.parent / (dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    run_builder(ckpt, tmp, "fp16", "cuda", ["use_paged_attention=true", "paged_block_size=16", "state_update_capacity=4"])
    _, sid = model_config(ckpt / "tokenizer.json")
    write_tokenizer_files(tmp, ckpt / "tokenizer.json", sid)
    for junk in ("vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja"):
        (tmp / junk).unlink(missing_ok=True)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    import onnxruntime_genai as og
    og.Config(str(dst))  # parses genai_config.json
    gc = json.loads((dst / "genai_config.json").read_text())
    size = sum(f.stat().st_size for f in dst.iterdir())
    print("export:", sorted(f.name for f in dst.iterdir()), f"{size / 1e6:.2f} MB",
          "mtp:", "mtp" in gc["model"],
          "state_groups:", [g["kind"] for g in gc["model"]["decoder"]["state_groups"]])
    assert size <= 20_000_000, size


def cmd_verify(args):
    """CPU fp32 export (not shipped) vs PyTorch: main logits and the MTP head, plus our MTPHead vs
    the hand-written reference of shared/probes/run_ort_cpu.py (eager attention, explicit mask)."""
    import onnxruntime as ort
    import torch
    ckpt = Path(args.ckpt)
    out = Path(args.tmp)
    if not (out / "model.onnx").exists():
        run_builder(ckpt, out, "fp32", "cpu", [])
    model, mtp = load_checkpoint(ckpt)
    lm = model.model.language_model
    held = np.load(Path(args.corpus) / "heldout_ids.npz")["ids"].astype(np.int64)
    S = args.n
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    msess = ort.InferenceSession(str(out / "mtp.onnx"), providers=["CPUExecutionProvider"])
    pos = np.broadcast_to(np.arange(S)[None, None], (3, 1, S)).copy()
    dims = {"batch_size": 1, "kv_cache_dim": model.config.text_config.head_dim}

    def empty(i):  # an empty past (0 tokens) or a zero state for a graph input
        return np.zeros([dims.get(d, 0) if isinstance(d, str) else d for d in i.shape], np.float32)

    def run_ort(window):  # prefill S tokens through model.onnx, then mtp.onnx on (tok[t+1], h[t])
        feeds = {"input_ids": window[None, :S], "attention_mask": np.ones((1, S), np.int64), "position_ids": pos}
        for i in sess.get_inputs():
            feeds.setdefault(i.name, empty(i))
        res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        mfeeds = {"input_ids": window[None, 1:S + 1], "position_ids": pos, "hidden_states": res["hidden_states"]}
        for i in msess.get_inputs():
            mfeeds.setdefault(i.name, np.ones((1, S), np.int64) if i.name == "attention_mask" else empty(i))
        return res, dict(zip([o.name for o in msess.get_outputs()], msess.run(None, mfeeds)))

    starts = np.linspace(0, len(held) - S - 2, args.windows).astype(int)
    agree = [float((m["logits"][:, :-1].argmax(-1) == r["logits"][:, 1:].argmax(-1)).mean())
             for r, m in (run_ort(held[s:s + S + 1]) for s in starts)]
    ids = held[None, starts[0]:starts[0] + S + 1]
    prompt, nxt = ids[:, :S], ids[:, 1:S + 1]
    res, mres = run_ort(ids[0])
    with torch.no_grad():
        h = lm(input_ids=torch.from_numpy(prompt), use_cache=False).last_hidden_state
        logits = model.lm_head(h)
        tpos = torch.arange(S).view(1, 1, -1).expand(3, 1, -1)
        ours = model.lm_head(mtp(lm.embed_tokens(torch.from_numpy(nxt)), h, lm.rotary_emb(h, tpos)))
        # reference, as written in shared/probes/run_ort_cpu.py (mtp_ref)
        tc = copy.deepcopy(model.config.text_config)
        tc.num_hidden_layers, tc.layer_types, tc._attn_implementation = 1, ["full_attention"], "eager"
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
        layer = Qwen3_5DecoderLayer(tc, 0).eval()
        layer.load_state_dict(mtp.layers[0].state_dict())
        sd = {f"mtp.{k}": v for k, v in mtp.state_dict().items()}
        eps = tc.rms_norm_eps
        rms1p = lambda x, w: (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * (1.0 + w)  # noqa: E731
        e = lm.embed_tokens(torch.from_numpy(nxt))
        x = torch.cat([rms1p(e, sd["mtp.pre_fc_norm_embedding.weight"]), rms1p(h, sd["mtp.pre_fc_norm_hidden.weight"])], -1)
        x = x @ sd["mtp.fc.weight"].T
        mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=lm.rotary_emb(x, tpos), attention_mask=mask)
        x = x[0] if isinstance(x, tuple) else x
        ref = rms1p(x, sd["mtp.norm.weight"]) @ model.lm_head.weight.T
    r = {"tokens": S,
         "main_ort_vs_torch_max_abs": float(np.abs(res["logits"] - logits.numpy()).max()),
         "main_argmax_equal": float((res["logits"].argmax(-1) == logits.numpy().argmax(-1)).mean()),
         "mtp_ours_vs_probe_ref_max_abs": float((ours - ref).abs().max()),
         "mtp_ort_vs_ours_max_abs": float(np.abs(mres["logits"] - ours.numpy()).max()),
         "mtp_argmax_equal": float((mres["logits"].argmax(-1) == ours.numpy().argmax(-1)).mean()),
         "logit_scale_max_abs": float(logits.abs().max()),
         # serving-relevant: the exported MTP head's draft for t+2 vs the exported main model's own pick
         "ort_mtp_top1_agreement_mean": round(float(np.mean(agree)), 4),
         "ort_mtp_top1_agreement_windows": [round(a, 3) for a in agree]}
    print(json.dumps(r, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--corpus", default=str(CORPUS_DIR))
    p = sub.add_parser("train")
    p.add_argument("--corpus", default=str(CORPUS_DIR))
    p.add_argument("--out", required=True)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--steps", type=int, default=0, help="fixed step count (else sized by --max-seconds)")
    p.add_argument("--max-seconds", type=float, default=480)
    p.add_argument("--calibrate-steps", type=int, default=30)
    p.add_argument("--w-mtp", type=float, default=0.3)
    p.add_argument("--w-kd", type=float, default=0.3)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=256)
    p = sub.add_parser("evaluate")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--corpus", default=str(CORPUS_DIR))
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--windows", type=int, default=16)
    p = sub.add_parser("export")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", default=str(MODEL_DIR))
    p = sub.add_parser("verify")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--corpus", default=str(CORPUS_DIR))
    p.add_argument("--tmp", default=str(REPO / ".work" / "verify_cpu_fp32"))
    p.add_argument("--n", type=int, default=1024, help="tokens per window")
    p.add_argument("--windows", type=int, default=16, help="held-out windows for the ORT agreement")
    args = ap.parse_args(argv)
    {"prepare": cmd_prepare, "train": cmd_train, "evaluate": cmd_evaluate, "export": cmd_export,
     "verify": cmd_verify}[args.cmd](args)


if __name__ == "__main__":
    main()
