#!/usr/bin/env python3
"""Verdicts of a seed sweep (launch/gpu-seed-sweep.sh): reads DIR/seed*.jsonl and DIR/seed*.log.

A seed diverged when its run stopped without a final validation, a loss or gradient norm was not
finite, or its training loss (mean of 10 steps) rose more than RISE above the lowest such mean
before it, or its residual_std (the spread of the last residual) overflowed or grew more than
GROWTH times its first step's: the growth that precedes a collapse to unigram level, which a run
that collapses early, before its loss fell, shows where its loss does not (moeut-train warns at
the same bound). A seed that trained but ended above MAX_VAL is reported as such. Each seed's row
also gives its largest gradient norm and its largest residual_std. Exit status 1 when any seed
diverged or ended above MAX_VAL.
"""
import argparse
import json
import math
import pathlib
import re
import statistics
import sys


def rows_of(path):
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line cut short by a killed run
    return rows


def verdict(path, rise, growth, max_val):
    seed = int(re.search(r"seed(\d+)", path.name).group(1))
    rows = rows_of(path)
    steps = [r for r in rows if "loss" in r]
    finals = [r for r in rows if r.get("final")]
    info = {"seed": seed, "steps": len(steps)}
    if steps:
        losses = [r["loss"] for r in steps]
        norms = [math.inf if r["grad_norm"] is None else r["grad_norm"] for r in steps]
        means = [statistics.fmean(losses[i:i + 10]) for i in range(0, len(losses) - 9)]
        worst_rise, at = 0.0, None
        lowest = math.inf
        for i, m in enumerate(means):
            lowest = min(lowest, m)
            if m - lowest > worst_rise:
                worst_rise, at = m - lowest, steps[i + 9]["step"]
        big = max(range(len(norms)), key=lambda i: norms[i] if math.isfinite(norms[i]) else math.inf)
        info.update(last_loss=statistics.fmean(losses[-10:]), rise=worst_rise, rise_at=at,
                    max_norm=norms[big], max_norm_at=steps[big]["step"],
                    finite=all(math.isfinite(x) for x in losses + norms))
        # moeut-train writes null for a spread that overflowed.
        stds = [(math.inf if r["residual_std"] is None else r["residual_std"], r["step"])
                for r in steps if "residual_std" in r]
        if stds:
            info["max_std"], info["max_std_at"] = max(stds, key=lambda x: x[0] if not math.isnan(x[0]) else math.inf)
            info["growth"] = info["max_std"] / stds[0][0] if not math.isnan(info["max_std"]) else math.inf
    info["val"] = finals[-1]["val_loss"] if finals else math.nan
    if not steps or not finals or not info["finite"] or not math.isfinite(info["val"]):
        info["verdict"] = "diverged (stopped)" if not finals else "diverged (not finite)"
    elif info["rise"] > rise:
        info["verdict"] = f"diverged (loss rose {info['rise']:.2f} by step {info['rise_at']})"
    elif info.get("growth", 0) > growth:
        info["verdict"] = f"collapsed (residual_std grew {info['growth']:.2g} times by step {info['max_std_at']})"
    elif info["val"] > max_val:
        info["verdict"] = f"trained, above {max_val}"
    else:
        info["verdict"] = "trained"
    return info


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("dir", type=pathlib.Path)
    p.add_argument("--rise", type=float, default=1.0)
    p.add_argument("--growth", type=float, default=1e6)
    p.add_argument("--max_val", type=float, default=4.70)
    a = p.parse_args()
    paths = sorted(a.dir.glob("seed*.jsonl"), key=lambda q: int(re.search(r"seed(\d+)", q.name).group(1)))
    if not paths:
        print(f"no seed*.jsonl in {a.dir}")
        return 1
    print(f"{'seed':>4} {'steps':>5} {'final val':>9} {'last loss':>9} {'max grad norm':>17} "
          f"{'max residual std':>17} verdict")
    results = [verdict(q, a.rise, a.growth, a.max_val) for q in paths]
    for r in results:
        norm = f"{r.get('max_norm', math.nan):.3g} @{r.get('max_norm_at', '-')}"
        std = f"{r.get('max_std', math.nan):.3g} @{r.get('max_std_at', '-')}"
        print(f"{r['seed']:>4} {r['steps']:>5} {r['val']:>9.4f} {r.get('last_loss', math.nan):>9.4f} {norm:>17} "
              f"{std:>17} {r['verdict']}")
        log = a.dir / f"seed{r['seed']}.log"
        if r["verdict"].startswith(("diverged", "collapsed")) and log.exists():
            jumps = [l for l in log.read_text().splitlines() if l.startswith("gradient norm jump")]
            for l in jumps[:2]:
                print("       " + l)
    vals = [r["val"] for r in results if math.isfinite(r["val"])]
    bad = [r for r in results if r["verdict"] != "trained"]
    print(f"{len(results) - len(bad)} of {len(results)} trained"
          + (f"; final validation median {statistics.median(vals):.4f}, range {min(vals):.4f}..{max(vals):.4f}"
             if vals else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
