"""A Qwen3-MoE target beside the dense target of the same active size, measured side by side in one run: compiled
AR and DDTree tokens/s, and the verify forward's cost against the budget (a MoE verify touches more experts as
the tree grows, the number that moves the best budget down on MoE targets).

    python scripts/bench_moe.py [--experts 16 --top-k 2 --expert-width 128] [--budgets 0 16 64 256]

Both targets are random, written in the real checkpoint formats and loaded through the engine's loader; the
dense one has intermediate_size = top_k x expert_width, so a decode step computes the same MLP arithmetic on both
(the MoE one reads top_k experts' weights per layer). Each gets a random DFlash drafter (its tau is ~1: random
drafts are rarely right, so DDTree's tokens/s here measures its cost, not its gain).
"""

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from benchlib import verify_ms, write_json  # noqa: E402
from checkpoints import (dflash_config, moe_config, qwen3_config, random_dflash_weights,  # noqa: E402
                         random_qwen3_weights, save_checkpoint)
from ddtree import generate  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from model import Qwen3  # noqa: E402
from settings import grouped  # noqa: E402


def write_pair(root, name, config, block):
    save_checkpoint(os.path.join(root, name), config, random_qwen3_weights(config, seed=1, std=0.05))
    dc = dflash_config(config, layers=1, block_size=block, target_layer_ids=[1, config["num_hidden_layers"] - 2])
    save_checkpoint(os.path.join(root, name + "-draft"), dc, random_dflash_weights(dc, seed=2, std=0.05))
    target = Qwen3.from_pretrained(os.path.join(root, name), device="cpu")
    return target, DFlashDrafter.from_pretrained(os.path.join(root, name + "-draft"), device="cpu")


def tokens_per_s(target, drafter, method, budget, prompt, new_tokens):
    """Compiled generate(), greedy: the best of two runs after a warm-up (compile time excluded)."""
    kw = dict(method=method, budget=budget if method == "ddtree" else None, max_new_tokens=new_tokens,
              stop_ids=[], compile=True)
    d = drafter if method != "ar" else None
    generate(target, d, prompt, **grouped(kw))
    return max(generate(target, d, prompt, **grouped(kw)).stats["tokens_per_s"] for _ in range(2))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=128)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 64, 256], help="0: a decode step")
    p.add_argument("--tree-budget", type=int, default=16, help="DDTree's budget for tokens/s")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dense = qwen3_config(a.vocab, hidden=a.hidden, inter=a.top_k * a.expert_width, layers=a.layers, heads=4,
                         kv_heads=2, head_dim=a.hidden // 4)
    moe = moe_config(dense, experts=a.experts, top_k=a.top_k, inter=a.expert_width)
    prompt = torch.randint(0, a.vocab, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {"args": vars(a), "verify_ms": {}, "tokens_per_s": {}}
    with tempfile.TemporaryDirectory() as root, torch.inference_mode():
        pairs = {"dense": write_pair(root, "dense", dense, a.block), "moe": write_pair(root, "moe", moe, a.block)}
        print(f"targets: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}; dense MLP width "
              f"{a.top_k * a.expert_width} vs {a.experts} experts of width {a.expert_width}, top {a.top_k}; "
              f"{torch.get_num_threads()} threads, compiled, median of {a.repeats}")
        print(f"{'rows':>6s} {'dense ms':>9s} {'MoE ms':>9s} {'MoE/dense':>10s}")
        for budget in a.budgets:  # interleaved per budget: a slow spell of the machine hits both alike
            ms = {k: verify_ms(t, budget, True, a.repeats) for k, (t, _) in pairs.items()}
            out["verify_ms"][budget] = ms
            print(f"{budget + 1:6d} {ms['dense']:9.2f} {ms['moe']:9.2f} {ms['moe'] / ms['dense']:9.2f}x", flush=True)
        print(f"\ngenerate(), compiled, greedy, prompt 64, {a.new_tokens} new tokens (tokens/s):")
        for method in ("ar", "ddtree"):
            row = {k: tokens_per_s(t, d, method, a.tree_budget, prompt, a.new_tokens) for k, (t, d) in pairs.items()}
            out["tokens_per_s"][method] = row
            label = method if method == "ar" else f"ddtree B={a.tree_budget}"
            print(f"{label:14s} dense {row['dense']:8.1f}   MoE {row['moe']:8.1f}   MoE/dense "
                  f"{row['moe'] / row['dense']:.2f}x", flush=True)
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
