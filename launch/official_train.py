#!/usr/bin/env python3
"""Trains the official PyTorch MoEUT (a local copy of its `moeut` package, never part of this
repository) with the recipe of launch/gpu-seed-sweep.sh on the project's token files, and writes
metrics in moeut-train's format, so that launch/seed_verdicts.py judges both alike.

  python3 launch/official_train.py --package DIR --config configs/126M.cfg --train_data ... \
      --val_data ... --seed 1 --metrics out/seed1.jsonl [--steps 500 --lr 1e-3 ...]

bf16 autocast, AdamW (fused) with weight decay on every parameter, global norm clip, linear
warm-up then cosine to min_lr_ratio (core/schedule.cpp), batches of random windows, final
validation over every whole window of the validation file. Each step's metrics row carries
residual_std as moeut-train's does.

--start project begins from the weights moeut-train draws for the same seed (core/model.cpp,
Model::init) and reads its batches in its order (parallel/trainer.cpp, sample_batch), so that a
run here and one of moeut-train leave from the same point: their first step's loss agrees to
bf16 rounding. --precision fp32 trains without autocast.
"""
import argparse
import json
import math
import pathlib
import sys

import numpy as np
import torch
import torch.nn.functional as F


def read_config(path):
    cfg = {}
    for line in pathlib.Path(path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if "=" in line:
            k, v = (s.strip() for s in line.split("=", 1))
            cfg[k] = v
    return cfg


def read_tokens(path):
    raw = pathlib.Path(path).read_bytes()
    count = int.from_bytes(raw[24:32], "little")
    width = int.from_bytes(raw[16:20], "little")
    return np.frombuffer(raw, dtype=np.uint16 if width == 2 else np.uint32, offset=32, count=count).astype(np.int64)


# The project's random streams (core/rng.h): splitmix64 keyed by (seed, purpose), drawn in bulk.
MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def mix64(z):
    """splitmix64's output function on a uint64 array."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_mix(a, b):
    z = ((a ^ (b * 0xD6E8FEB86659FD93)) + GAMMA) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def hash_string(text):  # FNV-1a
    h = 0xCBF29CE484222325
    for c in text.encode():
        h = ((h ^ c) * 0x100000001B3) & MASK
    return h


def draws(key, count):
    """The first `count` values of Rng(key).next()."""
    i = np.arange(1, count + 1, dtype=np.uint64)
    return mix64(np.full(count, key, dtype=np.uint64) + i * np.uint64(GAMMA))


def uniforms(bits):
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def normals(key, count):
    bits = draws(key, 2 * count)
    u1, u2 = 1.0 - uniforms(bits[0::2]), uniforms(bits[1::2])
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def project_init(model, c, seed):
    """Overwrites model's parameters with the values Model::init draws for `seed`."""
    d, L = int(c["d_model"]), int(c["n_layers"])
    E, es, hd = int(c["ff_n_experts"]), int(c["ff_expert_size"]), int(c["n_heads"]) * int(c["d_head"])
    gain = math.sqrt(2.0 / L)
    with torch.no_grad():
        for name, p in model.named_parameters():
            n, key = p.numel(), hash_mix(seed, hash_string(name))
            if name.endswith("ffn.keys") or name.endswith("ffn.values"):
                std = gain / math.sqrt(E * es) if name.endswith("ffn.values") else gain / math.sqrt(d)
                per = n // E
                x = np.concatenate([std * normals(hash_mix(key, e), per) for e in range(E)])
            elif name == "embedding.weight":
                x = normals(key, n) / math.sqrt(d)
            elif name.startswith("lm_head."):
                x = (2.0 * uniforms(draws(key, n)) - 1.0) / math.sqrt(d)
            elif name.endswith(("norm.weight", "ln1.weight", "ln2.weight")):
                x = np.ones(n)
            elif name.endswith(("norm.bias", "ln1.bias", "ln2.bias")):
                x = np.zeros(n)
            else:
                std = gain / math.sqrt(hd) if name.endswith("attention.o") else gain / math.sqrt(d)
                x = std * normals(key, n)
            x = x.astype(np.float32).astype(np.float64)
            if name.endswith("ffn.expert_sel"):
                rows = x.reshape(p.shape[0], -1)
                before = x.std(ddof=1)
                rows = (rows / np.sqrt((rows ** 2).sum(1, keepdims=True))).astype(np.float32).astype(np.float64)
                x = (rows * (before / rows.std(ddof=1))).ravel()
            elif name.endswith(("attention.sel_v", "attention.sel_o")):
                rows = x.reshape(p.shape[0], -1)
                row_std = rows.std(1, ddof=1, keepdims=True)
                rows = (rows / np.sqrt((rows ** 2).sum(1, keepdims=True))).astype(np.float32).astype(np.float64)
                x = (rows * (row_std / rows.std(ddof=1))).ravel()
            p.copy_(torch.from_numpy(x.astype(np.float32)).view(p.shape))


def project_batch(tokens, seed, step, count, T):
    """The windows moeut-train reads for `step` (0-based) of a one-rank run."""
    starts = len(tokens) - T
    first = [int(draws(hash_mix(hash_mix(seed, step), i), 1)[0]) % starts for i in range(count)]
    return torch.stack([tokens[s:s + T + 1] for s in first])


def learning_rate(step, a):
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    decay = max(1, a.steps - a.warmup_steps - 1)
    progress = min(1.0, (step - a.warmup_steps) / decay)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", required=True, help="folder holding the official `moeut` package")
    p.add_argument("--config", required=True)
    p.add_argument("--train_data", required=True)
    p.add_argument("--val_data", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=50)
    p.add_argument("--min_lr_ratio", type=float, default=0.1)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--grad_clip", type=float, default=0.25)
    p.add_argument("--start", choices=["official", "project"], default="official",
                   help="initial weights and batch order: the official code's for the seed, or moeut-train's")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="bf16 autocast, or none")
    a = p.parse_args()
    sys.path.insert(0, a.package)
    from moeut import MoEUTLM

    c = read_config(a.config)
    T = int(c["context"])
    torch.manual_seed(a.seed)
    model = MoEUTLM(n_tokens=int(c["n_tokens"]), d_model=int(c["d_model"]), n_layers=int(c["n_layers"]),
                    n_heads=int(c["n_heads"]), ff_n_experts=int(c["ff_n_experts"]),
                    att_n_experts=int(c["att_n_experts"]), d_head=int(c["d_head"]), group_size=int(c["group_size"]),
                    ff_k=int(c["ff_k"]), att_k=int(c["att_k"]), ff_expert_size=int(c["ff_expert_size"]),
                    entropy_reg=float(c["entropy_reg"]), att_entropy_reg=float(c["att_entropy_reg"]))
    if a.start == "project":
        project_init(model, c, a.seed)
    model = model.cuda()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16")
    # residual_std as moeut-train logs it: the mean over tokens of the last residual's spread (the
    # output LayerNorm's input), in the last training forward pass.
    spread = {}

    def watch_residual(_module, inputs):
        if model.training:
            x = inputs[0].detach().float()
            spread["std"] = float(torch.sqrt(x.var(dim=-1, unbiased=False) + 1e-5).mean())

    model.out_norm.register_forward_pre_hook(watch_residual)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay,
                            fused=True)
    train = torch.from_numpy(read_tokens(a.train_data))
    val = torch.from_numpy(read_tokens(a.val_data))
    rng = np.random.default_rng(a.seed)
    out = open(a.metrics, "w", buffering=1)  # line by line: a run cut short keeps its rows
    for step in range(a.steps):
        if a.start == "project":
            batch = project_batch(train, a.seed, step, a.batch_size, T).cuda()
        else:
            starts = rng.integers(0, len(train) - T - 1, a.batch_size)
            batch = torch.stack([train[s:s + T + 1] for s in starts]).cuda()
        lr = learning_rate(step, a)
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast:
            res = model(batch[:, :-1])
            ce = F.cross_entropy(res.outputs.flatten(0, 1).float(), batch[:, 1:].flatten())
            loss = ce + res.reg_loss.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip))
        opt.step()
        row = {"step": step + 1, "loss": float(loss), "ce": float(ce), "lr": lr, "grad_norm": norm,
               "residual_std": spread["std"]}
        out.write(json.dumps(row) + "\n")
        if (step + 1) % 50 == 0:
            print(f"step {step + 1} | loss {float(loss):.4f} | grad_norm {norm:.4f} | residual_std {spread['std']:.3g}",
                  flush=True)
    model.eval()
    windows = (len(val) - 1) // T
    total = 0.0
    with torch.no_grad(), autocast:
        for w in range(0, windows, 8):
            chunk = torch.stack([val[i * T:i * T + T + 1] for i in range(w, min(windows, w + 8))]).cuda()
            logits = model(chunk[:, :-1]).outputs.float()
            total += float(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
    val_loss = total / (windows * T)
    out.write(json.dumps({"step": a.steps, "val_loss": val_loss, "val_ppl": math.exp(val_loss), "final": True}) + "\n")
    print(f"final validation step {a.steps} | val_loss {val_loss:.6f}", flush=True)


if __name__ == "__main__":
    main()
