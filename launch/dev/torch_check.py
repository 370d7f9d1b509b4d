#!/usr/bin/env python3
"""The torch side of launch/dev/torch-check.sh (needs torch and the official `moeut` package).

  torch_check.py make --official DIR --args ARGS.json --out STATE.pt
  torch_check.py compare --official DIR --args ARGS.json --data VAL.bin --trained STATE.pt
      --trained_loss L --logits LOGITS.npy --initial STATE.pt --initial_loss L
  torch_check.py formats --state_dict STATE.pt --work DIR

Windows as moeut-eval takes them: window i is tokens [i·1024, i·1024 + 1024], the first 8.
"""
import argparse
import importlib.machinery
import importlib.util
import json
import pathlib
import sys

import numpy as np

CONTEXT, WINDOWS = 1024, 8
ROOT = pathlib.Path(__file__).resolve().parents[2]


def moeut_torch():
    """launch/moeut-torch as a module."""
    loader = importlib.machinery.SourceFileLoader("moeut_torch", str(ROOT / "launch" / "moeut-torch"))
    spec = importlib.util.spec_from_loader("moeut_torch", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def official_model(official, args_path, seed=1):
    """MoEUTLM of the arguments, its parameters drawn after torch.manual_seed(seed)."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products, as moeut-eval's
    torch.backends.cudnn.allow_tf32 = False
    sys.path.insert(0, official)
    from moeut.moeut import MoEUTLM
    args = json.loads(pathlib.Path(args_path).read_text())
    torch.manual_seed(seed)
    return MoEUTLM(**args), torch


def read_tokens(path):
    raw = pathlib.Path(path).read_bytes()
    count = int.from_bytes(raw[24:32], "little")
    width = int.from_bytes(raw[16:20], "little")
    return np.frombuffer(raw, dtype=np.uint16 if width == 2 else np.uint32, offset=32, count=count).astype(np.int64)


def windows(path):
    tokens = read_tokens(path)
    return np.stack([tokens[i * CONTEXT: i * CONTEXT + CONTEXT + 1] for i in range(WINDOWS)])


def evaluate(model, torch, batch):
    """Mean cross-entropy over the windows (fp32, eval mode) and the first window's logits."""
    model = model.cuda().eval()
    x = torch.from_numpy(batch).cuda()
    with torch.no_grad():
        logits = model(x[:, :-1]).outputs.float()
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    return ce.item(), logits[0].cpu().numpy()


def verdict(name, ok, figures):
    print(f"{'PASS' if ok else 'FAIL'}: {name}: {figures}")
    return ok


def make(a):
    model, torch = official_model(a.official, a.args)
    torch.save(model.state_dict(), a.out)


def official_run(a, state_dict, batch):
    """The official model with the state dict loaded (strict) on the windows; None when its
    forward fails (e.g. an odd number of rotated dimensions, which moeut-torch warns of)."""
    model, torch = official_model(a.official, a.args)
    model.load_state_dict(torch.load(state_dict, map_location="cpu", weights_only=True), strict=True)
    try:
        return evaluate(model, torch, batch)
    except RuntimeError as e:
        verdict(f"official forward of {state_dict}", False, str(e).splitlines()[0])
        return None


def loss_verdict(name, official, ours):
    rel = abs(official - ours) / ours
    return verdict(name, rel <= 1e-4, f"official {official:.6f}, moeut-eval {ours:.6f}, relative {rel:.2e} (target 1e-4)")


def compare(a):
    batch = windows(a.data)
    trained, initial = official_run(a, a.trained, batch), official_run(a, a.initial, batch)
    if trained is None or initial is None:
        return False
    ce, logits = trained
    ok = loss_verdict("trained: official loss vs moeut-eval", ce, a.trained_loss)
    ours = np.load(a.logits)
    spread = float(ours.std())
    worst = float(np.abs(ours - logits).max())
    ok &= verdict("trained: first window's logits", worst <= spread / 128,
                  f"largest difference {worst:.3e}, logits' spread {spread:.3e} (bf16 tolerance {spread / 128:.3e})")
    ok &= loss_verdict("official init: official loss vs moeut-eval of to-h5's file", initial[0], a.initial_loss)
    return ok


def formats(a):
    """moeut-torch's reader on torch.save's file, torch.load on moeut-torch's writer: same bits."""
    import torch
    mt = moeut_torch()
    reference = torch.load(a.state_dict, map_location="cpu", weights_only=True)
    ours = mt.read_torch_zip(a.state_dict)
    ok = all(mt.torch_to_numpy(torch, t)[1].tobytes() == ours[n].array.tobytes() for n, t in reference.items())
    ok = verdict("moeut-torch reads torch.save's file", ok and list(ours) == list(reference), f"{len(ours)} tensors")
    for dtype in ("float32", "bfloat16"):
        tensors = {n: mt.torch_to_numpy(torch, t.to(getattr(torch, dtype))) for n, t in reference.items()}
        path = str(pathlib.Path(a.work) / f"written_{dtype}.pt")
        mt.write_torch_zip(path, tensors)
        back = torch.load(path, map_location="cpu", weights_only=True)
        same = all(mt.torch_to_numpy(torch, back[n])[1].tobytes() == v[1].tobytes() for n, v in tensors.items())
        ok &= verdict(f"torch.load reads moeut-torch's {dtype} file", same, f"{len(back)} tensors")
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["make", "compare", "formats"])
    for name in ("official", "args", "out", "data", "trained", "logits", "initial", "state_dict", "work"):
        p.add_argument(f"--{name}")
    p.add_argument("--trained_loss", type=float)
    p.add_argument("--initial_loss", type=float)
    a = p.parse_args()
    result = {"make": make, "compare": compare, "formats": formats}[a.command](a)
    return 0 if result in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
