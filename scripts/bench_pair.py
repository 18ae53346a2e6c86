"""AR vs DFlash chain vs DDTree on a trained pair (default: the bundled tiny pair) over held-out prompts:
tau, tokens/s, speedup over AR, the per-round time split; a table, a JSON file and PNG plots.

    python scripts/bench_pair.py [--budgets 4 16 64 256 512] [--denoise 1 2] [--compile | --max-autotune]
                                 [--dtype bfloat16] [--out runs/bench_pair]
    python scripts/bench_pair.py --compile --only-batches [--batches 1 4 16] [--batch-budget 16]
    python scripts/bench_pair.py [--compile] --only-auto [--budgets 4 16 64 256 512] [--auto-passes 2]

tau is reported two ways (issue 5): over whole greedy generations from held-out code, and one speculative step
from many real held-out contexts (greedy generations of a tiny model fall into loops a drafter learns to copy,
which inflates tau over generations). All methods run in one process, side by side: one engine each, all alive
together, and every prompt run by each method in turn (benchlib.interleaved_runs), so that the machine's drift
lands on all of them alike; the table says for how many prompts each method's tokens equal plain decoding's.
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
from benchlib import (batched_run, held_out_code, interleaved_runs, round_header, round_row, round_split,  # noqa: E402
                      write_json)
from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET, generate  # noqa: E402
from text import Text  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from model import Qwen3  # noqa: E402
from settings import Speculation, grouped  # noqa: E402


def one_step_tau(target, drafter, contexts, method, budget, denoise):
    """Tokens the first speculative round after each real context verified (drafts accepted + the bonus), uncut
    by the token limit of 2."""
    per = [generate(target, drafter, c, method=method, budget=budget if method == "ddtree" else None,
                    max_new_tokens=2, stop_ids=[], speculation=Speculation(denoise_steps=denoise)).stats["verified"][0]
            for c in contexts]
    return sum(per) / len(per)


def plots(rows, out_dir, chain_key, best_key):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    trees = sorted((r for r in rows.values() if r["method"] == "ddtree" and r["denoise"] == 1),
                   key=lambda r: r["budget"])
    chain = rows[chain_key]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, label in ((axes[0], "tau", "tau over generations"), (axes[1], "tau_one_step", "tau, one step"),
                           (axes[2], "speedup", "speedup over AR")):
        ax.plot([r["budget"] for r in trees], [r[key] for r in trees], "o-", label="DDTree")
        ax.axhline(chain[key], color="C1", linestyle="--", label="DFlash chain")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tree nodes)")
        ax.set_title(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "tau_speedup.png"), dpi=100)
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max(max(rows[k]["accepted"]) for k in (chain_key, best_key))
    bins = [i + 0.5 for i in range(top + 1)]
    ax.hist([rows[chain_key]["accepted"], rows[best_key]["accepted"]], bins=bins,
            label=["DFlash chain", f"DDTree B={rows[best_key]['budget']}"])
    ax.set_xlabel("tokens committed per round")
    ax.set_ylabel("rounds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "committed_per_round.png"), dpi=100)


def compiled_as(a) -> str:
    return {False: "eager", True: "compiled", "max-autotune": "compiled with max-autotune"}[a.compile]


def batch_section(target, drafter, text, a) -> dict:
    """Greedy DDTree at --batch-budget over --batch-prompts held-out prompts, --batches requests at a time (batch 1:
    one request after another, as generate() runs them), side by side: tokens/s of the whole set."""
    prompts = held_out_code(text, a.batch_prompts, 64, 160, a.seed + 2)
    print(f"batched: greedy ddtree B={a.batch_budget}, {a.batch_prompts} held-out prompts x {a.new_tokens} new "
          f"tokens, {compiled_as(a)}; tokens/s of the whole set")
    out = {}
    for batch in a.batches:
        out[batch] = batched_run(target, drafter, prompts, "ddtree", a.batch_budget, a.new_tokens, a.compile, batch)
        print(f"  batch {batch:3d}: {out[batch]:8.1f} tokens/s  ({out[batch] / out[a.batches[0]]:.2f}x batch "
              f"{a.batches[0]})", flush=True)
    return out


def auto_section(target, drafter, text, a) -> dict:
    """budget auto beside every fixed choice it picks among (AR, the chain, each budget) on held-out prompts, in one
    run, interleaved prompt by prompt over --auto-passes passes (after one warm-up call each: compiling, and auto's
    calibration): tokens/s over all prompts (auto's probing included), tau, seconds per round; auto's own estimates
    beside the measured ones; a plot of tau(B), cost(B) and tokens/s(B) with auto's choice marked."""
    prompts = held_out_code(text, a.prompts, 64, 160, a.seed)
    configs = {"ar": dict(method="ar"), "chain": dict(method="dflash")}
    configs.update({str(b): dict(method="ddtree", budget=b) for b in a.budgets})
    configs["auto"] = dict(method="ddtree", budget="auto")
    common = dict(max_new_tokens=a.new_tokens, stop_ids=[], compile=a.compile)
    print(f"budget auto: {a.prompts} held-out prompts x {a.new_tokens} new tokens (greedy), "
          f"{compiled_as(a)}, {a.auto_passes} interleaved passes")
    warm = {}
    for name, kw in configs.items():
        res = generate(target, None if kw["method"] == "ar" else drafter, prompts[0], **grouped(dict(common, **kw)))
        warm[name] = res.stats["compile_seconds"]
    totals = {name: dict(tokens=0, seconds=0.0, rounds=0) for name in configs}
    reports = []
    for _ in range(a.auto_passes):
        for prompt in prompts:
            for name, kw in configs.items():
                res = generate(target, None if kw["method"] == "ar" else drafter, prompt,
                               **grouped(dict(common, **kw)))
                t = totals[name]
                t["tokens"] += res.stats["new_tokens"]
                t["seconds"] += res.stats["seconds"]
                t["rounds"] += res.stats["rounds"]
                if name == "auto":
                    reports.append(res.stats["auto"])
    rows = {}
    for name, t in totals.items():
        rows[name] = dict(tokens_per_s=t["tokens"] / t["seconds"], tau=(t["tokens"] - 1) / t["rounds"],
                          round_ms=1e3 * t["seconds"] / t["rounds"], warm_up_s=warm[name])
    fixed = {k: v for k, v in rows.items() if k != "auto"}
    best = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
    ran = {}
    for r in reports:
        for c, n in r["rounds_per_candidate"].items():
            ran[c] = ran.get(c, 0) + n
    estimates = {c: dict(tokens_per_round=mean([r["candidates"][c]["tokens_per_round"] for r in reports]),
                         round_ms=mean([r["candidates"][c]["round_ms"] for r in reports]),
                         calibrated_ms=reports[-1]["candidates"][c]["calibrated_ms"])
                 for c in reports[-1]["candidates"]}
    print(f"{'':>6s} {'tau':>6s} {'ms/round':>9s} {'tok/s':>8s}   auto's estimates: {'tau':>6s} {'ms/round':>9s} "
          f"{'calibrated':>10s} {'rounds run':>10s}")
    for name, r in rows.items():
        e = estimates.get(name, {})
        fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
        print(f"{name:>6s} {r['tau']:6.2f} {r['round_ms']:9.2f} {r['tokens_per_s']:8.1f}   {'':17s}"
              f"{fmt(e.get('tokens_per_round'), '6.2f'):>6s} {fmt(e.get('round_ms'), '9.2f'):>9s} "
              f"{fmt(e.get('calibrated_ms'), '10.2f'):>10s} {ran.get(name, 0) if name != 'auto' else '':>10}")
    ratio = rows["auto"]["tokens_per_s"] / rows[best]["tokens_per_s"]
    probes = sum(r["probe_rounds"] for r in reports)
    overhead = sum(r["probe_overhead_seconds"] for r in reports)
    print(f"auto {rows['auto']['tokens_per_s']:.1f} tokens/s = {ratio:.2f}x the best fixed choice ({best}, "
          f"{rows[best]['tokens_per_s']:.1f}); {probes} probe rounds of {totals['auto']['rounds']}, overhead "
          f"{overhead:.3f} s of {totals['auto']['seconds']:.2f} s; warm-up (calibrate + compile) "
          f"{warm['auto']:.1f} s", flush=True)
    auto_plot(rows, estimates, ran, a.budgets, os.path.join(a.out, "auto.png"))
    return dict(rows=rows, best_fixed=best, auto_over_best=ratio, estimates=estimates, rounds_run=ran,
                probe_rounds=probes, probe_overhead_seconds=overhead)


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def auto_plot(rows, estimates, ran, budgets, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    chosen = max(ran, key=ran.get)
    panels = (("tau", "tokens_per_round", "tokens per round (tau)"), ("round_ms", "round_ms", "ms per round"),
              ("tokens_per_s", None, "tokens/s"))
    for ax, (key, est_key, title) in zip(axes, panels):
        ax.plot(budgets, [rows[str(b)][key] for b in budgets], "o-", label="DDTree, measured")
        if est_key is not None:
            xs = [b for b in budgets if estimates.get(str(b), {}).get(est_key) is not None]
            ax.plot(xs, [estimates[str(b)][est_key] for b in xs], "x--", label="auto's estimate")
        for name, color in (("ar", "C2"), ("chain", "C1")):
            ax.axhline(rows[name][key], color=color, linestyle=":", label=name)
        if key == "tokens_per_s":
            ax.axhline(rows["auto"][key], color="C3", label="auto")
        if chosen not in ("ar", "chain"):
            ax.plot([int(chosen)], [rows[chosen][key]], "*", color="C3", markersize=16,
                    label=f"auto's most run ({chosen})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tree nodes)")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 16, 64, 256, 512])
    p.add_argument("--denoise", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--contexts", type=int, default=60)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--passes", type=int, default=3, help="passes over the prompts (every method runs each prompt "
                   "in turn)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--max-autotune", action="store_true", help="compile as ddtree.py --max-autotune does (every "
                   "method: AR too)")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16],
                   help="batch sizes for the batched section (generate_batch; greedy ddtree at --batch-budget)")
    p.add_argument("--batch-budget", type=int, default=16)
    p.add_argument("--batch-prompts", type=int, default=16)
    p.add_argument("--only-batches", action="store_true", help="run the batched section alone")
    p.add_argument("--only-auto", action="store_true", help="run budget auto beside the fixed choices, alone")
    p.add_argument("--auto-passes", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="every method runs in it")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_pair")
    a = p.parse_args()
    if a.max_autotune:
        a.compile = "max-autotune"
    torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    target = Qwen3.from_pretrained(a.target, device="cpu", dtype=getattr(torch, a.dtype))
    drafter = DFlashDrafter.from_pretrained(a.draft, device="cpu", dtype=getattr(torch, a.dtype)).bind(target)
    text = Text(target.path)
    prompts = held_out_code(text, a.prompts, 64, 160, a.seed)
    contexts = held_out_code(text, a.contexts, 32, 256, a.seed + 1)

    if a.only_auto:
        write_json(os.path.join(a.out, "bench_pair_auto.json"), dict(args=vars(a),
                                                                     auto=auto_section(target, drafter, text, a)))
        return
    if a.batches:
        batched = batch_section(target, drafter, text, a)
        if a.only_batches:
            write_json(os.path.join(a.out, "bench_pair_batches.json"), dict(args=vars(a), batches=batched))
            return
    configs = {"ar": (target, None, "ar", 1, 1)}
    configs.update({f"dflash-1-T{d}": (target, drafter, "dflash", 1, d) for d in a.denoise})
    configs.update({f"ddtree-{b}-T{d}": (target, drafter, "ddtree", b, d) for d in a.denoise for b in a.budgets})
    print(f"pair: {a.target} + {a.draft}; {a.prompts} held-out prompts x {a.new_tokens} new tokens (greedy), "
          f"{a.passes} passes with the methods interleaved prompt by prompt, {a.contexts} one-step contexts; "
          f"{compiled_as(a)}, {a.dtype}, {a.threads} threads")
    rows = interleaved_runs(configs, prompts, a.new_tokens, a.compile, a.passes)
    print(f"{'method':8s} {'B':>5s} {'T':>2s} {'tau gen':>8s} {'tau 1-step':>10s} {'tok/s':>8s} {'speedup':>8s} "
          f"{'same as AR':>10s} {'agree':>6s}")
    for key, (_, _, method, budget, denoise) in configs.items():
        r = rows[key]
        r.pop("tokens")
        r["tau_one_step"] = 1.0 if method == "ar" else one_step_tau(target, drafter, contexts, method, budget,
                                                                   denoise)
        r.update(method=method, budget=budget, denoise=denoise,
                 speedup=r["tokens_per_s"] / rows["ar"]["tokens_per_s"])
        print(f"{method:8s} {budget if method == 'ddtree' else '':>5} {denoise:2d} {r['tau']:8.2f} "
              f"{r['tau_one_step']:10.2f} {r['tokens_per_s']:8.1f} {r['speedup']:7.2f}x "
              f"{r['same_tokens']:4d} / {len(prompts):<3d} {r['common_prefix']:6.1f}", flush=True)
    print(f"(same as AR: prompts whose tokens equal plain decoding's; agree: mean tokens before the first "
          f"difference, of {a.new_tokens})")

    splits = {}
    cols = ["draft", "tree", "mask", "verify", "walk", "compact", "context"]
    print(f"\nround split (ms, stages eager{' but the forwards compiled' if a.compile else ''}):")
    print(round_header(cols, a.compile))
    for budget in a.budgets:
        ms = round_split(target, drafter, budget, a.compile, repeats=5, prompt_len=128)
        splits[budget] = ms
        print(round_row(budget, ms, cols))
    chain_key = "dflash-1-T1"
    best_key = max((k for k in rows if k.startswith("ddtree") and k.endswith("T1")), key=lambda k: rows[k]["tau"])
    plots(rows, a.out, chain_key, best_key)
    write_json(os.path.join(a.out, "bench_pair.json"), dict(args=vars(a), rows=rows, round_split=splits,
                                                            batches=batched if a.batches else None))
    print(f"\nbest tree {best_key}: tau {rows[best_key]['tau']:.2f} = {rows[best_key]['tau'] / rows[chain_key]['tau']:.2f}x "
          f"the chain's {rows[chain_key]['tau']:.2f}; wrote {a.out}/bench_pair.json, tau_speedup.png, "
          f"committed_per_round.png")


if __name__ == "__main__":
    main()
