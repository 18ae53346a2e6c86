"""Where a DDTree round's time goes, per budget, on a random pair (CPU or GPU), and tree construction alone at
the paper's size. Prints tables and writes JSON.

    python scripts/bench.py [--budgets 16 64 256 512 1024] [--compile] [--threads 2] [--json out/bench.json]
    python scripts/bench.py --compile --scorecard    # also the fast path's three CPU goals, side by side

--scorecard adds, in the same run: compiled AR beside transformers' generate on the random target's weights
(goal >= 1.5x), and compiled AR, DFlash chain and DDTree per budget in tokens/s on the bundled trained pair
(goal: DDTree at its best budget >= the chain); the round table gives the third goal (compiled overhead <= 10%).

Each round stage is the engine's own method (Engine.draft, propose, tree_mask, verify, accept; commit split into
compact_kv and the drafter's append_context), timed with a device sync around it; with --compile the forwards
(draft, context, verify) run compiled, as the engine runs them, and the small-op stages stay eager so each is
timed on its own (compiled, they fuse into the round's graph and cost less). `round` is the whole compiled round
(Engine.round) when --compile is given.
"""

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from benchlib import (compare, held_out_code, interleaved_runs, print_rows, round_header, round_row,  # noqa: E402
                      round_split, save_random_target, tree_alone, write_json)
from checkpoints import dflash_config, random_dflash_weights, save_checkpoint  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from model import Qwen3  # noqa: E402


def random_pair(vocab, hidden, layers, block, draft_layers, device, path=None):
    path = path or tempfile.mkdtemp()
    tc = save_random_target(os.path.join(path, "t"), vocab, hidden, layers)
    dc = dflash_config(tc, layers=draft_layers, block_size=block,
                       target_layer_ids=[min(i, layers - 2) for i in range(1, 1 + draft_layers)])
    save_checkpoint(os.path.join(path, "d"), dc, random_dflash_weights(dc))
    target = Qwen3.from_pretrained(os.path.join(path, "t"), device=device)
    return target, DFlashDrafter.from_pretrained(os.path.join(path, "d"), device=device).bind(target)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 512, 1024])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--skip-tree-alone", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--scorecard", action="store_true", help="also the compiled fast path's CPU goals (see above)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    results = {"args": vars(a), "rounds": {}}
    with torch.inference_mode():
        tmp = tempfile.mkdtemp()
        target, drafter = random_pair(a.vocab, a.hidden, a.layers, a.block, a.draft_layers, dev, tmp)
        print(f"random pair: target {a.layers} layers hidden {a.hidden} vocab {a.vocab}; drafter {a.draft_layers} "
              f"layer(s), block {a.block}; {dev}, {torch.get_num_threads()} threads, "
              f"{'forwards compiled' if a.compile else 'eager'}; median of {a.repeats}, ms")
        cols = ["draft", "tree", "mask", "verify", "walk", "compact", "context", "sum"] + (
            ["round", "tree_work"] if a.compile else [])
        print(round_header(cols, a.compile))
        for budget in a.budgets:
            ms = round_split(target, drafter, budget, a.compile, a.repeats)
            results["rounds"][budget] = ms
            print(round_row(budget, ms, cols), flush=True)
        print("overhead = (tree + mask + walk + compact) / sum of stages, each stage eager; compiled = (round - "
              "draft - context - verify) / round, the whole round compiled (draft and context: the drafter's forward"
              " in two parts); tree_work = tree + mask + walk compiled together")
        if not a.skip_tree_alone:
            t = tree_alone(151936, 15, 512, dev, a.repeats)
            results["tree_alone"] = t
            print(f"tree build alone, V=151936, depth 15, B=512: heap {t['heap_ms']:.1f} ms, tensor eager "
                  f"{t['tensor_eager_ms']:.1f} ms, tensor compiled {t['tensor_compiled_ms']:.1f} ms, "
                  f"identical trees: {t['equal']}")
        if a.scorecard:
            results["scorecard"] = scorecard(os.path.join(tmp, "t"), a.vocab, a.repeats)
    if a.json:
        write_json(a.json, results)


def scorecard(target_path: str, vocab: int, repeats: int, new: int = 128):
    """The CPU goals of the compiled fast path, measured side by side in this process."""
    from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET
    from text import Text
    out = {}
    prompt = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = compare(target_path, prompt, new, repeats)
    print(f"\nAR on the random target's weights (greedy, prompt 32, {new} new tokens, best of {repeats}):")
    print_rows(rows, new)
    out["ar_tokens_per_s"] = {name: new / sec for name, sec, _ in rows}
    ar_ratio = rows[0][1] / rows[2][1]

    target = Qwen3.from_pretrained(DEFAULT_TARGET, device="cpu")
    drafter = DFlashDrafter.from_pretrained(DEFAULT_DRAFT, device="cpu").bind(target)
    prompts = held_out_code(Text(target.path), 4, 64, 160, seed=0)  # as bench_pair.py
    configs = {"ar-1": (target, None, "ar", 1, 1), "dflash-1": (target, drafter, "dflash", 1, 1)}
    configs.update({f"ddtree-{b}": (target, drafter, "ddtree", b, 1) for b in (4, 16, 64, 256)})
    passes = 3
    print(f"\nbundled pair, compiled, greedy, 4 held-out prompts x {new} new tokens; {passes} passes, the methods "
          f"interleaved prompt by prompt:")
    print(f"{'method':8s} {'B':>5s} {'tau':>6s} {'tok/s':>8s} {'same as AR':>11s}")
    pair = interleaved_runs(configs, prompts, new, True, passes)
    for key, (_, _, method, budget, _) in configs.items():
        r = pair[key]
        print(f"{method:8s} {budget if method == 'ddtree' else '':>5} {r['tau']:6.2f} {r['tokens_per_s']:8.1f} "
              f"{r['same_tokens']:>7d} / {len(prompts)}")
    best = max((k for k in pair if k.startswith("ddtree")), key=lambda k: pair[k]["tokens_per_s"])
    tree_ratio = pair[best]["tokens_per_s"] / pair["dflash-1"]["tokens_per_s"]
    out["pair"] = {k: {f: v[f] for f in ("tau", "tokens_per_s", "same_tokens")} for k, v in pair.items()}
    print(f"\ncompiled AR / transformers generate: {ar_ratio:.2f}x (goal >= 1.5x)")
    print(f"compiled DDTree at its best budget ({best}) / compiled chain: {tree_ratio:.2f}x (goal >= 1)")
    out.update(ar_ratio=ar_ratio, best_tree=best, tree_over_chain=tree_ratio)
    return out


if __name__ == "__main__":
    main()
