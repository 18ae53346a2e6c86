"""scripts/bench.py's commands that run models side by side: pair (AR, the chain and DDTree on a trained pair),
official (our DDTree beside the official loop), moe (a MoE target beside the dense one), hybrid (the verify forward
through a hybrid target beside the dense one), memory (one request's peak memory, greedy beside sampled),
calibrate (budget auto's calibration, stored) and moe-parallel (one MoE layer split two ways over torchrun's ranks).
Each command is a pair: its options, and its run, whose docstring is
the command's --help.
"""

import argparse
import collections
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from benchlib import (ROOT, batched_run, best_of, cpu_name, held_out_code, in_fresh_process, interleaved,
                      interleaved_runs, long_windows, reset_peak, round_header, round_row, round_split,
                      positive_int, save_random_pair, status_mb, tree_verify, verify_ms, write_json)
import ddtree
import gated_delta
from budget import AutoBudget, auto_budgets, cache_file, device_name, load_costs, save_costs
from checkpoints import dflash_config, moe_config, qwen3_config, random_dflash_weights, random_qwen3_weights, \
    save_checkpoint
from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET, Engine, cache_length, generate
from drafter import DFlashDrafter
from model import Qwen3
from moe import SparseMoE, device_capability, expert_path
from families import position_limit
from sampler import Sampling
from cli import grouped
from settings import Speculation, check_int, check_models, check_request, check_settings
from text import Text
import tp

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------------ pair


def pair_options(p):
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--budgets", type=positive_int, nargs="+", default=[4, 16, 64, 256, 512])
    p.add_argument("--denoise", type=positive_int, nargs="+", default=[1, 2])
    p.add_argument("--prompts", type=positive_int, default=8)
    p.add_argument("--contexts", type=positive_int, default=60)
    p.add_argument("--new-tokens", type=positive_int, default=128)
    p.add_argument("--passes", type=positive_int, default=3, help="passes over the prompts (every method runs each "
                   "prompt in turn)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--max-autotune", action="store_true", help="compile as ddtree.py --max-autotune does (every "
                   "method: AR too)")
    p.add_argument("--batches", type=positive_int, nargs="*", default=[1, 4, 16],
                   help="batch sizes for the batched section (generate_batch; greedy ddtree at --batch-budget)")
    p.add_argument("--batch-budget", type=positive_int, default=16)
    p.add_argument("--batch-prompts", type=positive_int, default=16)
    p.add_argument("--only-batches", action="store_true", help="run the batched section alone")
    p.add_argument("--only-auto", action="store_true", help="run budget auto beside the fixed choices, alone")
    p.add_argument("--auto-passes", type=positive_int, default=2)
    p.add_argument("--recalibrate", action="store_true", help="--only-auto: auto's warm-up calibrates anew instead of "
                   "reading the stored calibration")
    p.add_argument("--plant-costs", type=planting_factor, default=None, metavar="FACTOR",
                   help="--only-auto: after a fresh calibration, also run 'auto-planted': budget auto with the stored "
                        "round times of the chain and every tree at FACTOR times the calibration's (plain decoding's "
                        "as calibrated), stored again before each of its runs")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="every method runs in it")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_pair")


def planting_factor(text: str) -> float:
    """argparse's type for --plant-costs: a finite number above 0, refused while the options are parsed."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {value}")
    return value


def pair(a):
    """AR vs DFlash chain vs DDTree on a trained pair (default: the bundled tiny pair) over held-out prompts: tau,
    tokens/s, speedup over AR, the per-round time split; a table, a JSON file and PNG plots.

        python scripts/bench.py pair [--budgets 4 16 64 256 512] [--denoise 1 2] [--compile | --max-autotune]
                                     [--dtype bfloat16] [--out runs/bench_pair]
        python scripts/bench.py pair --compile --only-batches [--batches 1 4 16] [--batch-budget 16]
        python scripts/bench.py pair [--compile] --only-auto [--budgets 4 16 64 256 512] [--auto-passes 2]
                                     [--recalibrate] [--plant-costs 2]

    tau is reported two ways: over whole greedy generations from held-out code, and one speculative step from many real
    held-out contexts (greedy generations of a tiny model fall into loops a drafter learns to copy, which inflates tau
    over generations). All methods run in one process, side by side: one engine each, all alive together, and every
    prompt run by each method in turn (benchlib.interleaved_runs), so that the machine's drift lands on all of them
    alike; the table says for how many prompts each method's tokens equal plain decoding's.
    """
    if a.max_autotune:
        a.compile = "max-autotune"
    torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    target = Qwen3.from_pretrained(a.target, device="cpu", dtype=getattr(torch, a.dtype))
    drafter = DFlashDrafter.from_pretrained(a.draft, device="cpu", dtype=getattr(torch, a.dtype)).bind(target)
    check_pair_runs(target, drafter, a)
    text = Text(target.path)
    prompts = held_out_code(text, a.prompts, 64, 160, a.seed)
    contexts = held_out_code(text, a.contexts, 32, 256, a.seed + 1)
    if a.only_auto:
        auto = auto_section(target, drafter, text, a)
        write_json(os.path.join(a.out, "bench_pair_auto.json"), dict(args=vars(a), auto=auto))
        return
    batched = batch_section(target, drafter, text, a) if a.batches else None
    if a.only_batches and a.batches:
        write_json(os.path.join(a.out, "bench_pair_batches.json"), dict(args=vars(a), batches=batched))
        return
    rows = method_table(target, drafter, prompts, contexts, a)
    splits = split_table(target, drafter, a)
    chain_key = "dflash-1-T1"
    best_key = max((k for k in rows if k.startswith("ddtree") and k.endswith("T1")), key=lambda k: rows[k]["tau"])
    plots(rows, a.out, chain_key, best_key)
    write_json(os.path.join(a.out, "bench_pair.json"), dict(args=vars(a), rows=rows, round_split=splits,
                                                            batches=batched))
    print(f"\nbest tree {best_key}: tau {rows[best_key]['tau']:.2f} = "
          f"{rows[best_key]['tau'] / rows[chain_key]['tau']:.2f}x the chain's {rows[chain_key]['tau']:.2f}; wrote "
          f"{a.out}/bench_pair.json, tau_speedup.png, committed_per_round.png")


def check_pair_runs(target, drafter, a):
    """Every run's settings (each budget, the batches' budget, each --denoise; the longest prompt) checked as
    generate() checks them, before anything is measured."""
    if max(a.denoise) > drafter.block_size - 1:
        raise ValueError(f"--denoise {max(a.denoise)} exceeds the drafter's {drafter.block_size - 1} draft positions "
                         f"(each pass decides at least one)")
    for budget in a.budgets + [a.batch_budget]:
        _, spec = check_settings("ddtree", Sampling(), budget, None)
        check_request(target, drafter, [[0] * 256], [0], [], "ddtree", a.new_tokens, spec, a.compile, None,
                      max(a.batches or [1]))


def method_table(target, drafter, prompts, contexts, a) -> dict:
    """AR, the chain and DDTree per budget, at each --denoise, interleaved over the prompts: one row each."""
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
    return rows


def split_table(target, drafter, a) -> dict:
    """benchlib.round_split per budget on the pair, a table row each."""
    splits = {}
    cols = ["draft", "tree", "verify", "walk", "compact", "context"]
    print(f"\nround split (ms, stages eager{' but the forwards compiled' if a.compile else ''}):")
    print(round_header(cols, a.compile))
    for budget in a.budgets:
        splits[budget] = round_split(target, drafter, budget, a.compile, repeats=5, prompt_len=128)
        print(round_row(budget, splits[budget], cols))
    return splits


def one_step_tau(target, drafter, contexts, method, budget, denoise):
    """Tokens the first speculative round after each real context accepted (its path length: drafts accepted + the
    bonus), uncut by the token limit of 2."""
    spec = Speculation(denoise_steps=denoise)
    per = [generate(target, drafter, c, method=method, budget=budget if method == "ddtree" else None,
                    max_new_tokens=2, stop_ids=[], speculation=spec).stats["path_lengths"][0] for c in contexts]
    return sum(per) / len(per)


def compiled_as(a) -> str:
    return {False: "eager", True: "compiled", "max-autotune": "compiled with max-autotune"}[a.compile]


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
    beside the measured ones; a plot of tau(B), cost(B) and tokens/s(B) with auto's choice marked. Every auto run
    is a new engine that reads the cost cache, as a new process does. --plant-costs F adds "auto-planted": the
    same runs from a stored calibration whose chain and trees cost F times what the fresh one measured (plain
    decoding as measured), as a calibration taken while another job loaded the machine does (issue 65); it is
    stored again before each of its runs, so that only what a run measures itself can correct it."""
    prompts = held_out_code(text, a.prompts, 64, 160, a.seed)
    configs = {"ar": dict(method="ar"), "chain": dict(method="dflash")}
    configs.update({str(b): dict(method="ddtree", budget=b) for b in a.budgets})
    configs["auto"] = dict(method="ddtree", budget="auto")
    if a.plant_costs:
        configs["auto-planted"] = dict(method="ddtree", budget="auto")
    load = os.getloadavg()
    print(f"budget auto: {a.prompts} held-out prompts x {a.new_tokens} new tokens (greedy), "
          f"{compiled_as(a)}, {a.auto_passes} interleaved passes; load average {load[0]:.2f} at the start")
    warm, totals, reports, planted = auto_runs(target, drafter, prompts, configs, a)
    rows = {name: dict(tokens_per_s=t["tokens"] / t["seconds"], tau=(t["tokens"] - 1) / t["rounds"],
                       round_ms=1e3 * t["seconds"] / t["rounds"], warm_up_s=warm[name]) for name, t in totals.items()}
    fixed = {k: v for k, v in rows.items() if not k.startswith("auto")}
    best = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
    ran, estimates = auto_estimates(reports["auto"])
    print_auto_table(rows, estimates, ran)
    out = dict(rows=rows, best_fixed=best, estimates=estimates, rounds_run=ran, load_average=[load, os.getloadavg()])
    for name, runs in reports.items():
        ratio = rows[name]["tokens_per_s"] / rows[best]["tokens_per_s"]
        probes = sum(r["probe_rounds"] for r in runs)
        overhead = sum(r["probe_overhead_seconds"] for r in runs)
        renewals = sum(r["calibration"]["renew"] is not None for r in runs)
        print(f"{name} {rows[name]['tokens_per_s']:.1f} tokens/s = {ratio:.2f}x the best fixed choice ({best}, "
              f"{rows[best]['tokens_per_s']:.1f}); {probes} probe rounds of {totals[name]['rounds']}, overhead "
              f"{overhead:.3f} s of {totals[name]['seconds']:.2f} s; rounds run: {auto_estimates(runs)[0]}; "
              f"{renewals} of {len(runs)} runs marked the calibration for renewal", flush=True)
        out[name] = dict(over_best=ratio, probe_rounds=probes, probe_overhead_seconds=overhead,
                         rounds_run=auto_estimates(runs)[0], renewals=renewals)
    out["auto_over_best"] = out["auto"]["over_best"]
    if planted:
        out["planted_ms"] = {c: None if v is None else 1e3 * v for c, v in planted["round_s"].items()}
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    auto_plot(rows, estimates, ran, a.budgets, os.path.join(a.out, "auto.png"))
    return out


def auto_runs(target, drafter, prompts, configs, a) -> tuple:
    """(warm-up seconds, totals, auto's reports per auto config, the planted calibration or None) of every config
    over the prompts, interleaved prompt by prompt. Each auto config's runs start from its own stored calibration:
    "auto" from what its own runs left (a calibration they renewed included), "auto-planted" from the planted one."""
    common = dict(max_new_tokens=a.new_tokens, stop_ids=[], compile=a.compile)
    stored, key = {}, None

    def run(name, kw, prompt, **extra):
        nonlocal key
        if name.startswith("auto"):
            ddtree._ENGINES.clear()  # a new engine reads the cost cache, as a new process does
            if name in stored:
                save_costs(key, stored[name])
        res = generate(target, None if kw["method"] == "ar" else drafter, prompt,
                       **grouped(dict(common, **kw, **extra)))
        if name == "auto":
            engine = next(e for e in ddtree._ENGINES.values() if isinstance(e, AutoBudget))
            if key is not None and engine.key != key:
                raise ValueError("the prompts' budget-auto runs have different cost keys: give prompts of one cache "
                                 "size")
            key = engine.key
            stored["auto"] = load_costs(key)
        return res

    fresh = a.recalibrate or bool(a.plant_costs)
    warm = {name: run(name, kw, prompts[0], **(dict(recalibrate=True) if name == "auto" and fresh else {}))
            .stats["compile_seconds"] for name, kw in configs.items() if name != "auto-planted"}
    if a.plant_costs:
        stored["auto-planted"] = dict(stored["auto"], renew=None, round_s={
            c: v if c == "ar" or v is None else a.plant_costs * v for c, v in stored["auto"]["round_s"].items()})
        warm["auto-planted"] = run("auto-planted", configs["auto-planted"], prompts[0]).stats["compile_seconds"]
    totals = {name: dict(tokens=0, seconds=0.0, rounds=0) for name in configs}
    reports = {name: [] for name in configs if name.startswith("auto")}
    for _ in range(a.auto_passes):
        for prompt in prompts:
            for name, kw in configs.items():
                res = run(name, kw, prompt)
                t = totals[name]
                t["tokens"] += res.stats["new_tokens"]
                t["seconds"] += res.stats["seconds"]
                t["rounds"] += res.stats["rounds"]
                if name in reports:
                    reports[name].append(res.stats["auto"])
    return warm, totals, reports, stored.get("auto-planted")


def auto_estimates(reports) -> tuple:
    """(rounds each candidate ran, auto's estimates per candidate averaged over its runs)."""
    ran = {}
    for r in reports:
        for c, n in r["rounds_per_candidate"].items():
            ran[c] = ran.get(c, 0) + n
    estimates = {c: dict(tokens_per_round=mean([r["candidates"][c]["tokens_per_round"] for r in reports]),
                         round_ms=mean([r["candidates"][c]["round_ms"] for r in reports]),
                         calibrated_ms=reports[-1]["candidates"][c]["calibrated_ms"])
                 for c in reports[-1]["candidates"]}
    return ran, estimates


def print_auto_table(rows, estimates, ran):
    print(f"{'':>6s} {'tau':>6s} {'ms/round':>9s} {'tok/s':>8s}   auto's estimates: {'tau':>6s} {'ms/round':>9s} "
          f"{'calibrated':>10s} {'rounds run':>10s}")
    for name, r in rows.items():
        e = estimates.get(name, {})
        fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
        print(f"{name:>6s} {r['tau']:6.2f} {r['round_ms']:9.2f} {r['tokens_per_s']:8.1f}   {'':17s}"
              f"{fmt(e.get('tokens_per_round'), '6.2f'):>6s} {fmt(e.get('round_ms'), '9.2f'):>9s} "
              f"{fmt(e.get('calibrated_ms'), '10.2f'):>10s} {'' if name.startswith('auto') else ran.get(name, 0):>10}")


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


# --------------------------------------------------------------------------------------------------- context


def context_options(p):
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[512, 1024, 1920, 4096, 8000])
    p.add_argument("--windows", type=int, nargs="+", default=[0, 256],
                   help="the drafter's context windows (0: the whole context)")
    p.add_argument("--budget", type=positive_int, default=16)
    p.add_argument("--prompts", type=positive_int, default=4)
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--yarn", type=float, default=4.0, help="the YaRN factor of the scaled copy")
    p.add_argument("--passes", type=positive_int, default=1)
    p.add_argument("--threads", type=positive_int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_context")


def context(a):
    """Acceptance against prompt length: greedy DDTree at --budget over --prompts windows of held-out code of each
    length, the drafter seeing the whole context or only its last W tokens (--windows), beside plain decoding
    (every run must give its tokens); and the prefill's tokens/s at each length (an AR engine's start, timed alone:
    the median over the prompts of each one's fastest of three).
    Two versions of the pair: as the checkpoints are (lengths whose request fits their max_position_embeddings),
    and a copy whose configs add YaRN (--yarn times the checkpoint's window as original_max_position_embeddings,
    the edit long-context instructions ask for), at every length. A table, a JSON file and a plot.

        python scripts/bench.py context [--lengths 512 1024 1920 4096 8000] [--windows 0 256] [--budget 16]
    """
    torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    check_int("--budget", a.budget, 1)
    if min(a.lengths) < 1 or min(a.windows) < 0 or a.yarn <= 1 or a.prompts < 1 or a.new_tokens < 1:
        raise ValueError("--lengths and --prompts must be positive, --windows at least 0, --yarn above 1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for version, (target_path, draft_path) in [("as is", (a.target, a.draft)),
                                                   (f"yarn x{a.yarn:g}", yarn_copies(a.target, a.draft, a.yarn,
                                                                                     tmp))]:
            target = Qwen3.from_pretrained(target_path, device="cpu", dtype=torch.float32)
            drafter = DFlashDrafter.from_pretrained(draft_path, device="cpu", dtype=torch.float32).bind(target)
            text = Text(target.path)
            for length in a.lengths:
                limit = position_limit(target.config)[0]
                if length + a.new_tokens > limit:
                    print(f"{version}, {length} tokens: past the target's {limit} positions, not run")
                    continue
                rows.append(context_row(target, drafter, text, version, length, a))
                print(context_line(rows[-1], a.windows), flush=True)
    write_json(os.path.join(a.out, "bench_context.json"), dict(args=vars(a), machine=cpu_name(), rows=rows))
    context_plot(rows, a.windows, os.path.join(a.out, "tau_vs_length.png"))
    print(f"wrote {a.out}/bench_context.json, tau_vs_length.png")


def yarn_copies(target: str, draft: str, factor: float, root: str) -> tuple:
    """Copies of the pair's folders (files linked) whose configs add YaRN over the target's window."""
    out = []
    for name, path in (("target", target), ("draft", draft)):
        here = os.path.join(root, name)
        os.makedirs(here)
        for f in os.listdir(path):
            if f != "config.json":
                os.symlink(os.path.abspath(os.path.join(path, f)), os.path.join(here, f))
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        if name == "target":
            window = config["max_position_embeddings"]
        config["rope_scaling"] = dict(rope_type="yarn", factor=factor, original_max_position_embeddings=window)
        with open(os.path.join(here, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        out.append(here)
    return tuple(out)


def context_row(target, drafter, text, version, length, a) -> dict:
    """One version and length: tau per drafter window and the prompts whose tokens equal plain decoding's; the
    prefill's tokens/s (the median over the prompts)."""
    prompts = long_windows(text, a.prompts, length, a.seed + length)
    configs = {"ar": (target, None, "ar", None, 1)}
    for w in a.windows:
        configs[f"W{w}"] = (target, drafter, "ddtree", a.budget, 1, w or None)
    runs = interleaved_runs(configs, prompts, a.new_tokens, False, a.passes)
    spec = Speculation()
    engine = Engine(target, None, "ar", Sampling(), spec, cache_length(length, 1, "ar", spec, None), False)
    with torch.inference_mode():  # as generate() runs: no autograd graph kept over the prompt
        engine.start([prompts[0][:64]], [0])  # first-call costs stay out of the timing
        seconds = []
        for prompt in prompts:  # a prompt's fastest of three starts: a busy machine only ever slows one down
            seconds.append(best_of(lambda: engine.start([prompt], [0]), 3)[0])
    return dict(version=version, length=length, prefill_tokens_per_s=length / statistics.median(seconds),
                ar_tokens_per_s=runs["ar"]["tokens_per_s"],
                windows={w: dict(tau=runs[f"W{w}"]["tau"], same_tokens=runs[f"W{w}"]["same_tokens"],
                                 tokens_per_s=runs[f"W{w}"]["tokens_per_s"]) for w in a.windows},
                prompts=len(prompts))


def context_line(row, windows) -> str:
    taus = ", ".join(f"{'whole context' if w == 0 else f'window {w}'} tau {row['windows'][w]['tau']:.2f} "
                     f"({row['windows'][w]['same_tokens']}/{row['prompts']} equal to ar)" for w in windows)
    return (f"{row['version']}, {row['length']} tokens: {taus}; prefill {row['prefill_tokens_per_s']:,.0f} "
            f"tokens/s")


def context_plot(rows, windows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for version in dict.fromkeys(r["version"] for r in rows):
        mine = [r for r in rows if r["version"] == version]
        for w in windows:
            ax.plot([r["length"] for r in mine], [r["windows"][w]["tau"] for r in mine], marker="o",
                    label=f"{version}, {'whole context' if w == 0 else f'drafter window {w}'}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("tau (tokens per round)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -------------------------------------------------------------------------------------------------- official

MODES = {"eager": False, "compiled": True, "max-autotune": "max-autotune"}


def official_options(p):
    p.add_argument("--official", required=True, help="a checkout of github.com/liranringel/ddtree")
    p.add_argument("--target", default=os.path.join(ROOT, "assets", "tiny-target"))
    p.add_argument("--draft", default=os.path.join(ROOT, "assets", "tiny-draft"))
    p.add_argument("--budgets", type=positive_int, nargs="+", default=[4, 16, 64])
    p.add_argument("--prompts", type=positive_int, default=4)
    p.add_argument("--new-tokens", type=positive_int, default=128)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--passes", type=positive_int, default=3,
                   help="passes over the prompts per side; the fastest counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["eager", "compiled"],
                   help="how ours runs: eager, compiled (--compile, as the CLI), max-autotune (--max-autotune)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def official(a):
    """Our DDTree beside the official DDTree loop (github.com/liranringel/ddtree) on the same weights and prompts, on
    the CPU: greedy tokens compared, tokens/s side by side per budget.

        git clone https://github.com/liranringel/ddtree /path/to/official   # not a dependency of this project
        pip install loguru                                                   # the official code logs with it
        python scripts/bench.py official --official /path/to/official [--budgets 4 16 64] [--prompts 4]

    The official code targets CUDA and transformers 4; it runs here, in a child process of its own (its `ddtree.py`,
    `dflash.py` and `model` package are named as our modules), with four in-process patches, none of which touches its
    algorithm: its CUDA-synchronizing timer becomes time.perf_counter; `datasets` (imported only to load benchmark data)
    is stubbed; DynamicCache.crop(length) is translated to transformers 5's crop(-tokens_to_remove); and the models load
    in float32 on the CPU. Both sides run the bundled pair by default (our checkpoints are in the formats the official
    code reads: a Hugging Face Qwen3 and a z-lab DFlash drafter), greedy, prefill included in the time, after one
    warm-up call per budget, the fastest of --passes passes; ours in each of --modes (eager, compiled as the CLI's
    `--compile`, and max-autotune as its `--max-autotune`). Note: the official loop drops every generated token equal to
    the drafter's mask token id from its output (`output_ids[0] != mask_token_id`), so its token list can be shorter
    where that id is generated.
    """
    a.official = os.path.abspath(a.official)  # the child runs inside the checkout
    if not os.path.isfile(os.path.join(a.official, "ddtree.py")):
        raise ValueError(f"--official {a.official} is not a checkout of github.com/liranringel/ddtree (no ddtree.py)")
    if a.child:
        return print(json.dumps(official_child(a.official, json.load(sys.stdin))))
    torch.set_num_threads(a.threads)
    prompts = held_out_code(Text(a.target), a.prompts, 64, 160, a.seed)
    request = dict(target=a.target, draft=a.draft, budgets=a.budgets, prompts=prompts, new_tokens=a.new_tokens,
                   threads=a.threads, passes=a.passes)
    try:
        runs = {"official": in_fresh_process("official", "--official", a.official, "--child",
                                             input=json.dumps(request), cwd=a.official)}
    except RuntimeError as e:
        raise SystemExit(f"the official loop failed:\n{e}") from None
    for mode in a.modes:
        runs[f"ours {mode}"] = ours(a.target, a.draft, prompts, a.budgets, a.new_tokens, MODES[mode], a.passes)
    print_official_table(runs, a)


def print_official_table(runs, a):
    print(f"greedy DDTree, {a.prompts} held-out prompts x {a.new_tokens} new tokens, {a.threads} threads, CPU; "
          f"tokens/s (prefill included, the fastest of {a.passes} passes), speedup over the official loop, "
          f"tokens equal to the official loop's")
    print(f"{'B':>5s} " + " ".join(f"{name:>22s}" for name in runs))
    for budget in map(str, a.budgets):
        cells = []
        base = runs["official"][budget]
        for name, r in runs.items():
            tps = sum(map(len, r[budget]["tokens"])) / r[budget]["seconds"]
            same = sum(x == y for x, y in zip(r[budget]["tokens"], base["tokens"]))
            speed = tps / (sum(map(len, base["tokens"])) / base["seconds"])
            cells.append(f"{tps:8.1f} {speed:5.2f}x {same}/{a.prompts} eq")
        print(f"{budget:>5s} " + " ".join(f"{c:>22s}" for c in cells), flush=True)


def forget_our_modules():
    """This process's modules of the repository out of sys.modules and their folders off sys.path: the official
    code's own ddtree, dflash and model modules are named as ours, and its imports must find its own."""
    folders = {ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "cpu")}
    for name, module in list(sys.modules.items()):
        if name != "__main__" and os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or os.sep)) \
                in folders:
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) not in folders]


def official_child(path: str, request: dict) -> dict:
    """Runs in the child process: the official ddtree_generate over the prompts, per budget."""
    import types
    forget_our_modules()
    sys.modules["datasets"] = types.SimpleNamespace(load_dataset=None, Features=None, Sequence=None, Value=None)
    sys.path.insert(0, path)
    from transformers import AutoModelForCausalLM, DynamicCache
    torch.set_num_threads(request["threads"])
    import dflash as off_dflash  # noqa: the official modules
    import ddtree as off_ddtree
    from model import DFlashDraftModel
    off_dflash.cuda_time = off_ddtree.cuda_time = time.perf_counter
    DynamicCache.crop = crop_to_length(DynamicCache.crop)
    target = AutoModelForCausalLM.from_pretrained(request["target"], dtype=torch.float32).eval()
    drafter = DFlashDraftModel.from_pretrained(request["draft"], dtype=torch.float32).eval()
    with torch.inference_mode():
        return {str(b): official_budget(off_ddtree, target, drafter, request, b) for b in request["budgets"]}


def crop_to_length(crop):
    """transformers 4's DynamicCache.crop(max_length), which the official loop calls, on transformers 5's crop
    (whose positive argument means otherwise; a negative one removes that many tokens)."""
    def crop_to(self, max_length):
        if max_length < 0:
            return crop(self, max_length)
        extra = self.get_seq_length() - max_length
        if extra > 0:
            crop(self, -extra)
    return crop_to


def official_budget(off_ddtree, target, drafter, request, budget) -> dict:
    """The official loop over the prompts at one budget: the fastest of the passes, after one warm-up call."""
    def run(ids):
        return off_ddtree.ddtree_generate(drafter, target, torch.tensor([ids]), drafter.mask_token_id,
                                          request["new_tokens"], drafter.block_size, [], 0.0, tree_budget=budget)

    run(request["prompts"][0])  # warm-up
    best = None
    for _ in range(request["passes"]):
        tokens, seconds = [], 0.0
        for ids in request["prompts"]:
            t0 = time.perf_counter()
            res = run(ids)
            seconds += time.perf_counter() - t0
            tokens.append(res.output_ids[0, res.num_input_tokens:].tolist())
        if best is None or seconds < best["seconds"]:
            best = dict(tokens=tokens, seconds=seconds)
    return best


def ours(target_path, draft_path, prompts, budgets, new_tokens, compile, passes) -> dict:
    target = Qwen3.from_pretrained(target_path, device="cpu")
    drafter = DFlashDrafter.from_pretrained(draft_path, device="cpu")
    out = {}
    for budget in budgets:
        kw = dict(method="ddtree", budget=budget, max_new_tokens=new_tokens, stop_ids=[], compile=compile)
        generate(target, drafter, prompts[0], **grouped(kw))  # warm-up (compile)
        best = None
        for _ in range(passes):
            runs = [generate(target, drafter, p, **grouped(kw)) for p in prompts]
            seconds = sum(r.stats["seconds"] for r in runs)
            if best is None or seconds < best["seconds"]:
                best = dict(tokens=[r.tokens for r in runs], seconds=seconds)
        out[str(budget)] = best
    return out


# ------------------------------------------------------------------------------------------------------- moe


def moe_options(p):
    p.add_argument("--vocab", type=positive_int, default=4096)
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--experts", type=positive_int, default=16)
    p.add_argument("--top-k", type=positive_int, default=2)
    p.add_argument("--expert-width", type=positive_int, default=128)
    p.add_argument("--block", type=positive_int, default=8)
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 64, 256], help="0: a decode step")
    p.add_argument("--tree-budget", type=positive_int, default=16, help="DDTree's budget for tokens/s")
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=7)
    p.add_argument("--threads", type=positive_int, default=os.cpu_count())
    p.add_argument("--json", default=None)


def moe(a):
    """A Qwen3-MoE target beside the dense target of the same active size, measured side by side in one run: compiled AR
    and DDTree tokens/s, and the verify forward's cost against the budget (a MoE verify touches more experts as the tree
    grows, the number that moves the best budget down on MoE targets).

        python scripts/bench.py moe [--experts 16 --top-k 2 --expert-width 128] [--budgets 0 16 64 256]

    Both targets are random, written in the real checkpoint formats and loaded through the engine's loader; the dense
    one has intermediate_size = top_k x expert_width, so a decode step computes the same MLP arithmetic on both (the MoE
    one reads top_k experts' weights per layer). Each gets a random DFlash drafter (its tau is ~1: random drafts are
    rarely right, so DDTree's tokens/s here measures its cost, not its gain).
    """
    torch.set_num_threads(a.threads)
    dense = qwen3_config(a.vocab, hidden=a.hidden, inter=a.top_k * a.expert_width, layers=a.layers, heads=4,
                         kv_heads=2, head_dim=a.hidden // 4)
    sparse = moe_config(dense, experts=a.experts, top_k=a.top_k, inter=a.expert_width)
    prompt = torch.randint(0, a.vocab, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {"args": vars(a), "verify_ms": {}, "tokens_per_s": {}}
    with tempfile.TemporaryDirectory() as root, torch.inference_mode():
        pairs = {"dense": write_pair(root, "dense", dense, a.block), "moe": write_pair(root, "moe", sparse, a.block)}
        print(f"targets: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}; dense MLP width "
              f"{a.top_k * a.expert_width} vs {a.experts} experts of width {a.expert_width}, top {a.top_k}; "
              f"{torch.get_num_threads()} threads, compiled, median of {a.repeats}")
        print(f"{'rows':>6s} {'dense ms':>9s} {'MoE ms':>9s} {'MoE/dense':>10s}")
        for budget in a.budgets:  # interleaved per budget: a slow spell of the machine hits both alike
            ms = out["verify_ms"][budget] = {k: verify_ms(t, budget, True, a.repeats) for k, (t, _) in pairs.items()}
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


# ---------------------------------------------------------------------------------------------------- hybrid

DENSE = os.path.join(ROOT, "assets", "tiny-target")
# The hybrid's shapes: the bundled target's width and attention, Qwen3.5's layout (3 of every 4 layers linear).
HYBRID = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
              max_position_embeddings=4096, tie_word_embeddings=True)
# Qwen3.5-27B's recurrent layers (its text config: 64 layers, full_attention_interval 4, 48 value heads and
# 16 key heads of 128), for the same arithmetic at full size.
QWEN3_5_27B_LINEAR = dict(layers=48, heads=48, key_dim=128, value_dim=128)


def hybrid_options(p):
    p.add_argument("--budgets", type=positive_int, nargs="+", default=[4, 16, 64, 512])
    p.add_argument("--memory-budgets", type=positive_int, nargs="*", default=None,
                   help="budgets of the memory cases (default: --budgets and 1024, 2048, to show the growth's shape)")
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--memory-repeats", type=positive_int, default=3)
    p.add_argument("--prompt-len", type=positive_int, default=256)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (tiny matmuls: 1 is fastest)")
    p.add_argument("--compile", action="store_true", help="also time the verify compiled")
    p.add_argument("--json", default=None)
    p.add_argument("--memory-case", nargs=3, help=argparse.SUPPRESS)  # path budget prompt_len: one case here


def hybrid(a):
    """The verify forward through a hybrid target (Qwen3.5's layout: Gated DeltaNet layers and gated full attention)
    beside the dense Qwen3 target of the same width, per budget, on the CPU: time, extra peak memory, and the share
    spent in the recurrent layers.

        python scripts/bench.py hybrid [--budgets 4 16 64 512] [--compile] [--json out.json]

    The dense model is the bundled target (assets/tiny-target: hidden 256, 4 layers, 4 heads of 64, 2 KV heads, MLP 768,
    vocabulary 4096, tied embeddings). The hybrid is a random Qwen3.5 of the same width written by transformers
    (checkpoints.random_hybrid_model / save_hybrid) and loaded as the engine loads it: 4 layers with
    full_attention_interval 4, so layers 0-2 are Gated DeltaNet (Hk = 2 key heads, Hv = 4 value heads, Dk = Dv = 64,
    conv kernel 4) and layer 3 is gated full attention (4 heads of 64, 2 KV heads, a quarter of each head roped). Only
    the target's verify forward is measured (no drafter): one forward of R = B + 1 rows of a random tree after
    --prompt-len committed slots, as Engine.verify runs it (benchlib.tree_verify: the recurrent layers in tree mode,
    gated_delta.Recurrent.tree, whose k, u and G the commit would read are returned), its mask built inside it.

    - time: medians over --repeats, the two models called in turn (benchlib.interleaved), eager; with --compile also
      compiled (torch.compile fullgraph, no max-autotune, as benchlib.verify_ms compiles it);
    - share (eager): the seconds inside each layer's token mixer (GatedDeltaNet modules, attention modules) and inside
      the tree rule itself (gated_delta.tree_gated_delta), over the same forwards' seconds, timed by hooks;
    - memory: the growth of a fresh process's peak resident set over one verify at budget B, after the inputs are built
      and a one-node verify has run, median over --memory-repeats processes. Loading these small models peaks higher
      than their verify, so the peak is reset first (VmHWM through /proc/self/clear_refs after malloc_trim) and the
      growth is taken over the resident set at that point. Beside it: one [H, R, R] float32 matrix per recurrent layer
      (the WY form's transient matrices are a few of these), and what keeping one recurrent state per tree row would
      cost (R * the state size per token).
    """
    if a.memory_case:
        return memory_case(a.memory_case[0], int(a.memory_case[1]), int(a.memory_case[2]))
    torch.set_num_threads(a.threads)
    memory_budgets = a.memory_budgets if a.memory_budgets is not None else sorted(set(a.budgets) | {1024, 2048})
    out = dict(machine=dict(cpu=cpu_name(), cores=os.cpu_count(), threads=a.threads, torch=torch.__version__,
                            python=platform.python_version()),
               command="python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
               prompt_len=a.prompt_len, repeats=a.repeats, memory_repeats=a.memory_repeats, cases={})
    modes = ["eager"] + (["compiled"] if a.compile else [])
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"hybrid": save_hybrid_target(os.path.join(tmp, "hybrid")), "dense": DENSE}
        models = {k: Qwen3.from_pretrained(v, device="cpu") for k, v in paths.items()}
        describe_hybrid(models, out)
        with torch.inference_mode():
            for budget in a.budgets:
                time_case(models, budget, modes, out["cases"].setdefault(budget, {}), a)
                torch._dynamo.reset()  # one budget's graphs at a time
        for budget in memory_budgets:
            memory_row(paths, models["hybrid"], budget, out, a)
    time_table(out, a.budgets, modes)
    memory_table(out, memory_budgets)
    if a.json:
        write_json(a.json, out)


def save_hybrid_target(out_dir: str) -> str:
    from checkpoints import hybrid_text_config, random_hybrid_model, save_hybrid
    save_hybrid(random_hybrid_model(hybrid_text_config(**HYBRID), std=0.05), out_dir)
    return out_dir


def describe_hybrid(models, out):
    """The two models' shapes and sizes, and the recurrent state per token (here and at Qwen3.5-27B's size)."""
    hybrid = models["hybrid"]
    state = state_bytes_per_token(hybrid)
    m0 = hybrid.recurrent_layers[0]
    out["hybrid"] = dict(HYBRID, layer_types=list(hybrid.config.hybrid.layer_types), state_bytes_per_token=state,
                         parameters=sum(t.numel() for t in hybrid.parameters()))
    out["dense"] = dict(path=os.path.relpath(DENSE, ROOT),
                        parameters=sum(t.numel() for t in models["dense"].parameters()))
    big = QWEN3_5_27B_LINEAR
    state_27b = big["layers"] * big["heads"] * big["key_dim"] * big["value_dim"] * 4
    out["qwen3_5_27b"] = dict(big, state_bytes_per_token=state_27b)
    print(f"machine: {out['machine']}")
    print(f"hybrid: {hybrid.config.hybrid.layer_types}; Gated DeltaNet Hk={m0.key_heads} Hv={m0.value_heads} "
          f"Dk={m0.key_dim} Dv={m0.value_dim}; {out['hybrid']['parameters'] / 1e6:.2f} M parameters "
          f"(dense: {out['dense']['parameters'] / 1e6:.2f} M); recurrent state per token "
          f"{state / 2**10:.0f} KiB (Qwen3.5-27B: {state_27b / 2**20:.0f} MiB)", flush=True)


def time_case(models, budget, modes, case, a):
    """The verify at one budget through both models, in each mode: medians, and (eager) the mixers' shares."""
    for mode in modes:
        t = time.time()
        fns = [tree_verify(models[k], budget, compile=mode == "compiled", prompt_len=a.prompt_len)
               for k in ("hybrid", "dense")]
        for fn in fns:  # the first call compiles
            fn()
        first_s = time.time() - t
        hy, de = interleaved(fns, CPU, a.repeats)
        case[f"{mode}_ms"] = dict(hybrid=hy, dense=de)
        if mode == "compiled":
            case["compile_seconds_both"] = first_s
        if mode == "eager":
            case["share_pct"] = {k: shares(models[k], fn, max(3, a.repeats // 2))
                                 for k, fn in zip(("hybrid", "dense"), fns)}
        print(f"B={budget:4d} {mode:8s}: hybrid {hy:8.2f} ms, dense {de:8.2f} ms ({hy / de:.2f}x)"
              + (f"; first calls {first_s:.0f} s" if mode == "compiled" else ""), flush=True)


def memory_row(paths, hybrid, budget, out, a):
    """The verify's extra peak memory at one budget, for both models, beside the [H, R, R] matrix and a state per
    tree row (here and at Qwen3.5-27B's size)."""
    rows, state, big = budget + 1, out["hybrid"]["state_bytes_per_token"], QWEN3_5_27B_LINEAR
    case = out["cases"].setdefault(budget, {})
    mem = {k: measure_memory(paths[k], budget, a.prompt_len, a.memory_repeats) for k in ("hybrid", "dense")}
    case["memory_growth_mb"] = {k: statistics.median(v) for k, v in mem.items()}
    case["memory_growth_mb_all"] = mem
    case["rr_matrix_mb"] = rr_bytes(hybrid, rows) / 2**20
    case["state_per_node_mb"] = rows * state / 2**20
    case["qwen3_5_27b"] = dict(rr_matrix_mb=big["heads"] * rows * rows * 4 / 2**20,
                               state_per_node_mb=rows * out["qwen3_5_27b"]["state_bytes_per_token"] / 2**20)
    print(f"B={budget:4d} memory: hybrid +{case['memory_growth_mb']['hybrid']:.1f} MB, dense "
          f"+{case['memory_growth_mb']['dense']:.1f} MB ({mem})", flush=True)


def state_bytes_per_token(target) -> int:
    """Bytes of one token's recurrent states over every Gated DeltaNet layer (float32 [Hv, Dk, Dv] each, the
    state a per-node verifier would keep for every tree row; conv states not counted)."""
    return sum(m.value_heads * m.key_dim * m.value_dim * 4 for m in target.recurrent_layers)


def rr_bytes(target, rows: int) -> int:
    """Bytes of one float32 [H, R, R] matrix of the tree rule (H = the recurrent layers' value heads; 0 for a
    model without recurrent layers)."""
    layers = target.recurrent_layers
    return layers[0].value_heads * rows * rows * 4 if layers else 0


@contextlib.contextmanager
def mixer_timers(target):
    """Seconds inside the token mixers (GatedDeltaNet modules as "recurrent", attention as "attention") and inside
    gated_delta.tree_gated_delta ("tree rule"), accumulated while active (eager only: hooks and a wrapped function;
    eager CPU ops are synchronous, so wall time is their time)."""
    spent, started, handles = collections.defaultdict(float), {}, []
    for layer in target.layers:
        for attr, key in (("linear_attn", "recurrent"), ("self_attn", "attention")):
            m = getattr(layer, attr, None)
            if m is None:
                continue
            handles.append(m.register_forward_pre_hook(lambda mod, args: started.__setitem__(id(mod),
                                                                                           time.perf_counter())))
            handles.append(m.register_forward_hook(
                lambda mod, args, out, key=key: spent.__setitem__(key, spent[key] + time.perf_counter()
                                                                  - started[id(mod)])))
    rule = gated_delta.tree_gated_delta

    def timed_rule(*args, **kwargs):
        t = time.perf_counter()
        out = rule(*args, **kwargs)
        spent["tree rule"] += time.perf_counter() - t
        return out

    gated_delta.tree_gated_delta = timed_rule
    try:
        yield spent
    finally:
        gated_delta.tree_gated_delta = rule
        for h in handles:
            h.remove()


def shares(target, fn, repeats: int) -> dict:
    """Percent of the verify's seconds inside each mixer kind and inside the tree rule, over `repeats` calls."""
    fn()
    with mixer_timers(target) as spent:
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        total = time.perf_counter() - t
    return {k: 100 * v / total for k, v in sorted(spent.items())}


def memory_case(path: str, budget: int, prompt_len: int):
    """In this (fresh) process: load the target, build a verify of `budget` and one of 1 node, run the small one
    (lazy initializations, allocator warm-up), reset the peak, then run the big one once; prints the peak's
    growth over the resident set it started from, in MB."""
    torch.set_num_threads(1)
    target = Qwen3.from_pretrained(path, device="cpu")
    with torch.inference_mode():
        small = tree_verify(target, 1, prompt_len=prompt_len)
        small()
        small()
        big = tree_verify(target, budget, prompt_len=prompt_len)  # inputs and caches: before the measure
        small()
        before = reset_peak()
        big()
        print(json.dumps(dict(growth_mb=status_mb("VmHWM") - before)))


def measure_memory(path: str, budget: int, prompt_len: int, repeats: int) -> list:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return [in_fresh_process("hybrid", "--memory-case", path, str(budget), str(prompt_len), env=env)["growth_mb"]
            for _ in range(repeats)]


def time_table(out, budgets, modes):
    print("\nverify forward, ms (median; hybrid and dense interleaved), and the eager share of the hybrid's verify "
          "in its Gated DeltaNet mixers / in the tree rule alone (dense: share in attention)")
    head = f"{'B':>5s} " + " ".join(f"{m + ' hybrid':>16s} {m + ' dense':>15s} {'ratio':>6s}" for m in modes)
    print(head + f" {'GDN mixers':>11s} {'tree rule':>10s} {'hyb attn':>9s} {'dense attn':>11s}")
    for b in budgets:
        c = out["cases"][b]
        cols = " ".join(f"{c[m + '_ms']['hybrid']:16.2f} {c[m + '_ms']['dense']:15.2f} "
                        f"{c[m + '_ms']['hybrid'] / c[m + '_ms']['dense']:5.2f}x" for m in modes)
        s = c["share_pct"]
        print(f"{b:5d} {cols} {s['hybrid'].get('recurrent', 0):10.1f}% {s['hybrid'].get('tree rule', 0):9.1f}% "
              f"{s['hybrid'].get('attention', 0):8.1f}% {s['dense'].get('attention', 0):10.1f}%")


def memory_table(out, memory_budgets):
    print("\nextra peak memory of one verify (MB; peak RSS growth in a fresh process, median) beside one [H, R, R] "
          "float32 matrix and a state per tree row (R x the state per token); the same two for Qwen3.5-27B")
    print(f"{'B':>5s} {'R':>5s} {'hybrid':>8s} {'dense':>8s} {'hyb-dense':>9s} {'[H,R,R]':>8s} {'growth/':>8s} "
          f"{'state/node':>10s} | {'27B [H,R,R]':>11s} {'27B state/node':>14s}")
    print(f"{'':>5s} {'':>5s} {'':>8s} {'':>8s} {'':>9s} {'':>8s} {'[H,R,R]':>8s} {'':>10s} |")
    prev = None
    for b in memory_budgets:
        c = out["cases"][b]
        g, r = c["memory_growth_mb"], b + 1
        diff = g["hybrid"] - g["dense"]
        print(f"{b:5d} {r:5d} {g['hybrid']:8.1f} {g['dense']:8.1f} {diff:9.1f} {c['rr_matrix_mb']:8.2f} "
              f"{g['hybrid'] / c['rr_matrix_mb']:8.1f} {fmt_mb(c['state_per_node_mb']):>10s} | "
              f"{fmt_mb(c['qwen3_5_27b']['rr_matrix_mb']):>11s} {fmt_mb(c['qwen3_5_27b']['state_per_node_mb']):>14s}")
        if prev is not None:
            for key, now, then in (("hybrid", g["hybrid"], prev[1]), ("hybrid_minus_dense", diff, prev[2])):
                if now > 0 and then > 0:
                    c.setdefault("growth_slope_vs_R", {})[key] = math.log(now / then) / math.log(r / prev[0])
        prev = (r, g["hybrid"], diff)
    slopes = {b: {k: round(v, 2) for k, v in out["cases"][b]["growth_slope_vs_R"].items()} for b in memory_budgets
              if "growth_slope_vs_R" in out["cases"][b]}
    print(f"log-log slope of the growth against R, from the budget before: {slopes} "
          f"(2: grows like R^2; 1: like R x state)")


def fmt_mb(x: float) -> str:
    return f"{x:8.1f}" if x < 1e5 else f"{x / 1024:7.1f}G"


# ---------------------------------------------------------------------------------------------------- memory

VOCAB = 151936  # Qwen3's


def memory_options(p):
    p.add_argument("--json", default=None)
    p.add_argument("--case", nargs=3, help=argparse.SUPPRESS)  # root sampled all_rows: run one case here


def memory(a):
    """Peak memory of one request at the paper's budget over Qwen3's vocabulary, greedy beside sampled: a random 2-layer
    target of vocabulary 151,936 (hidden 64, benchlib.save_random_pair) and a block-16 drafter, eager on the CPU, B =
    512, 4 new tokens, sampled with temperature 1 and top-p 0.95. Each case runs in a fresh process; its cost is the
    growth of the process's peak resident set (ru_maxrss) over what loading the pair took. The third case warps and
    samples every verified row at once (sampler.ROW_CHUNK_ELEMENTS unbounded) instead of a chunk of rows at a time.

        python scripts/bench.py memory [--json out/memory.json]
    """
    if a.case:
        return one_case(a.case[0], a.case[1] == "1", a.case[2] == "1")
    out = {}
    with tempfile.TemporaryDirectory() as root:
        save_random_pair(root, hidden=64, layers=2, vocab=VOCAB, block_size=16)
        for name, sampled, all_rows in (("greedy", 0, 0), ("sampled", 1, 0), ("sampled, all rows at once", 1, 1)):
            out[name] = in_fresh_process("memory", "--case", root, str(sampled), str(all_rows))
            print(f"{name:28s} peak growth {out[name]['growth_mb']:8.0f} MB  tokens {out[name]['tokens']}",
                  flush=True)
    g = out["greedy"]["growth_mb"]
    print(f"sampled / greedy: {out['sampled']['growth_mb'] / g:.2f}x (all rows at once: "
          f"{out['sampled, all rows at once']['growth_mb'] / g:.2f}x); the sampled draws are "
          f"{'identical' if out['sampled']['tokens'] == out['sampled, all rows at once']['tokens'] else 'DIFFERENT'}")
    if a.json:
        write_json(a.json, out)


def one_case(root, sampled, all_rows):
    """In this process: load, then one generate; prints the peak's growth in MB."""
    import resource
    import sampler
    if all_rows:
        sampler.ROW_CHUNK_ELEMENTS = 2**62
    torch.set_num_threads(1)
    target = Qwen3.from_pretrained(os.path.join(root, "target"), device="cpu")
    drafter = DFlashDrafter.from_pretrained(os.path.join(root, "draft"), device="cpu")
    kw = dict(temperature=1.0, top_p=0.95, seed=0) if sampled else {}
    peak_mb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731
    # imports, caches
    generate(target, drafter, list(range(5, 25)), budget=16, max_new_tokens=2, stop_ids=[], **grouped(kw))
    before = peak_mb()
    res = generate(target, drafter, list(range(5, 25)), budget=512, max_new_tokens=4, stop_ids=[], **grouped(kw))
    print(json.dumps(dict(growth_mb=peak_mb() - before, tokens=res.tokens)))


# ------------------------------------------------------------------------------------------------ moe-parallel
# One MoE layer over torchrun's ranks, every expert split (tp.py's way) or expert parallel (docs/tp.md, "Why every
# expert is split").


MOE_CHECK_SIZES = dict(hidden=32, experts=8, inter=16, top_k=2, rows=[2, 9])  # --check's: few pairs, then many


def moe_parallel_options(p):
    p.add_argument("--hidden", type=positive_int, default=3072)
    p.add_argument("--experts", type=positive_int, default=256)
    p.add_argument("--inter", type=positive_int, default=1024, help="each expert's intermediate size")
    p.add_argument("--top-k", type=positive_int, default=8)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[65, 129, 257, 513],
                   help="a verify's rows: budget + 1")
    p.add_argument("--iters", type=positive_int, default=20, help="timed calls per scheme and row count")
    p.add_argument("--check", action="store_true", help="both schemes against the whole layer, small and float64")


def moe_parallel(a):
    """One MoE layer over the ranks of torchrun, on a verify's rows, two ways (docs/tp.md, "Why every expert is
    split"):

    - split: every expert cut by its intermediate dimension, each rank running every pair on its slice (tp.py's
      way);
    - expert parallel: E/n whole experts per rank, the rows replicated on every rank as the attention's all-reduce
      leaves them, each rank running the (row, expert) pairs of its own experts only (selected on the host,
      unpadded: expert parallel's best case, which static shapes and CUDA graphs would have to pad to a capacity);

    each followed by the one all-reduce of [rows, hidden] that the layer needs either way. Both take SparseMoE's
    own path for their pairs (grouped GEMM on an H100). The shared expert, split the same way by both, is left out.
    Prints, per row count, the pairs, the expert weights the busiest rank reads, and the slowest rank's median
    milliseconds.

        torchrun --nproc-per-node 8 scripts/bench.py moe-parallel --hidden 3072 --experts 256 --top-k 8   # 122B-A10B
        torchrun --nproc-per-node 8 scripts/bench.py moe-parallel --hidden 4096 --experts 512 --top-k 10  # 397B-A17B
        torchrun --nproc-per-node 2 scripts/bench.py moe-parallel --check    # both against the whole layer (float64)

    Random weights, seeded per expert, and random rows: the router spreads them about evenly, as a trained router
    does over a verify's rows on average; a skewed routing loads expert parallel's busiest rank more.
    """
    tp.quiet_other_ranks()
    if a.check:
        vars(a).update(MOE_CHECK_SIZES)  # the sizes are checked against the ranks below
    if not tp.enabled():
        raise ValueError("run it under torchrun with 2 ranks or more (torchrun --nproc-per-node N ...)")
    for name in ("experts", "inter"):
        if getattr(a, name) % tp.world_size():
            raise ValueError(f"--{name} ({getattr(a, name)}) does not split over {tp.world_size()} ranks")
    if not 0 < a.top_k <= a.experts or min(a.rows) < 1 or a.hidden < 1 or a.iters < 1:
        raise ValueError("--top-k must be in 1..experts; --rows, --hidden and --iters positive")
    if not a.check:
        moe_parallel_measure(a)
        return 0
    tp.setup(torch.device("cpu"))
    worst = moe_parallel_check(a)
    if worst > 1e-12:
        print(f"error: a scheme differs from the whole layer by {worst:.3g}", file=sys.stderr)
        return 1
    print(f"both schemes give the whole layer (largest difference {worst:.3g})")
    return 0


def expert_weights(e: int, hidden: int, inter: int, device) -> torch.Tensor:
    """Expert e's gate, up and down^T [3, inter, hidden] in float32, from a seed of its own: every rank makes the
    same, whatever share of it it keeps."""
    g = torch.Generator(device).manual_seed(1000 + e)
    return torch.randn(3, inter, hidden, generator=g, device=device) * hidden ** -0.5


def moe_layer(experts: range, inter: slice, a, dtype, device, top_k: int | None = None) -> SparseMoE:
    """The experts `experts` of the layer, each cut to its `inter` slice, and the whole router (replicated); routing
    top_k (default a.top_k) experts per row."""
    with torch.device("meta"):
        moe = SparseMoE(a.hidden, inter.stop - inter.start, a.experts, top_k or a.top_k, norm_topk_prob=True)
    # (each slice copied: a view would keep its whole expert alive until the stack)
    parts = torch.stack([expert_weights(e, a.hidden, a.inter, device)[:, inter].clone() for e in experts], 1).to(dtype)
    moe.experts.gate_proj, moe.experts.up_proj = nn.Parameter(parts[0]), nn.Parameter(parts[1])
    moe.experts.down_proj = nn.Parameter(parts[2].transpose(1, 2).contiguous())
    g = torch.Generator(device).manual_seed(1)
    moe.gate.weight = nn.Parameter(torch.randn(a.experts, a.hidden, generator=g, device=device).to(dtype))
    return moe


def split_forward(moe: SparseMoE, x):
    out = moe(x)
    dist.all_reduce(out)
    return out


def expert_parallel_forward(moe: SparseMoE, router: SparseMoE, first: int, x):
    """This rank's pairs (those of experts first.. first + len) through its whole experts (`moe` routes one expert
    per row: each pair is a row), summed over the ranks."""
    ids, weights = router.route(x)
    local = ids - first
    rows, k = ((local >= 0) & (local < moe.experts.gate_proj.shape[0])).nonzero(as_tuple=True)
    path = expert_path(x.device.type, x.dtype, device_capability(x.device), len(rows), len(moe.experts.gate_proj))
    done = getattr(moe, path)(x[rows], local[rows, k][:, None], weights[rows, k][:, None])
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    out = out.index_add_(0, rows, done.to(out.dtype)).to(x.dtype)
    dist.all_reduce(out)
    return out


def moe_schemes(a, dtype, device) -> tuple:
    """({name: the layer's forward on this rank}: split and expert parallel, the split layer (its router is the
    whole router))."""
    n, r = tp.world_size(), tp.rank()
    share, experts = a.inter // n, a.experts // n
    split = moe_layer(range(a.experts), slice(r * share, (r + 1) * share), a, dtype, device)
    own = moe_layer(range(r * experts, (r + 1) * experts), slice(0, a.inter), a, dtype, device, top_k=1)
    return dict(split=lambda x: split_forward(split, x),
                expert_parallel=lambda x: expert_parallel_forward(own, split, r * experts, x)), split


def moe_rows(a, count: int, dtype, device):
    g = torch.Generator(device).manual_seed(count)
    return torch.randn(count, a.hidden, generator=g, device=device).to(dtype)


def busiest_reads(router: SparseMoE, x, a, itemsize: int) -> dict:
    """Expert weight bytes the busiest rank reads (each touched expert once): split, 1/n of every touched expert;
    expert parallel, the whole of each touched expert of its own."""
    n, per = tp.world_size(), 3 * a.hidden * a.inter * itemsize
    touched = torch.zeros(a.experts, dtype=torch.bool, device=x.device)
    touched[router.route(x)[0].reshape(-1)] = True
    own = touched.view(n, -1).sum(1)
    return dict(split=int(touched.sum()) * per / n, expert_parallel=int(own.max()) * per)


def moe_parallel_check(a) -> float:
    """The largest difference, over a few row counts, between each scheme and the whole layer on one rank, at small
    sizes in float64 (--check)."""
    vars(a).update(MOE_CHECK_SIZES)
    device = torch.device("cpu")
    forwards, _ = moe_schemes(a, torch.float64, device)
    whole = moe_layer(range(a.experts), slice(0, a.inter), a, torch.float64, device)
    worst = 0.0
    for count in a.rows:
        x = moe_rows(a, count, torch.float64, device)
        reference = whole(x)
        for forward in forwards.values():
            worst = max(worst, (forward(x) - reference).abs().max().item())
    return worst


def moe_parallel_measure(a):
    device = tp.setup(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    forwards, router = moe_schemes(a, dtype, device)
    print(f"{tp.world_size()} ranks, hidden {a.hidden}, {a.experts} experts of {a.inter}, top-{a.top_k}, {dtype}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print(f"{'rows':>5} {'pairs':>6} {'split MB':>9} {'EP MB':>9} {'split ms':>9} {'EP ms':>9}")
    for count in a.rows:
        x = moe_rows(a, count, dtype, device)
        reads = busiest_reads(router, x, a, x.element_size())
        # each scheme's median, the two in turn (a slow spell lands on both), then the slowest rank's
        ms = {name: tp.slowest(t, device) for name, t in
              zip(forwards, interleaved([lambda f=f: f(x) for f in forwards.values()], device, a.iters))}
        print(f"{count:5d} {count * a.top_k:6d} {reads['split'] / 1e6:9.1f} {reads['expert_parallel'] / 1e6:9.1f} "
              f"{ms['split']:9.3f} {ms['expert_parallel']:9.3f}")



# ------------------------------------------------------------------------------------------------- calibrate


def calibrate_options(p):
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--batch", type=int, default=1, help="requests per batch (a power of two, as generate_batch runs)")
    p.add_argument("--prompt-len", type=int, default=128, help="sizes the cache as a run of this prompt would")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--denoise-steps", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)


def calibrate(a):
    """Build budget auto's calibration for a pair on this device, store it in the cost cache, and print the curve.

        python scripts/bench.py calibrate [--target PATH] [--draft PATH] [--compile] [--batch N] [--temperature T ...]

    `generate(budget="auto")` calibrates by itself the first time a (device, pair, settings) key is seen; this runs that
    calibration explicitly (again, replacing a stored one) and prints, per candidate, the seconds of a round and the
    rate it would reach accepting every draft (what decides whether it is viable). docs/budget.md. The settings are
    checked as generate(budget="auto") checks a run of them, before anything is stored.
    """
    check_int("--batch", a.batch, 1)
    check_int("--prompt-len", a.prompt_len, 1)
    if a.threads is not None:
        check_int("--threads", a.threads, 1)
    sampling, spec = check_settings("ddtree", Sampling(a.temperature, a.top_k, a.top_p, a.min_p), None,
                                    Speculation(budget="auto", denoise_steps=a.denoise_steps))
    if a.threads:
        torch.set_num_threads(a.threads)
    target = Qwen3.from_pretrained(a.target, device=a.device, dtype=a.dtype)
    drafter = DFlashDrafter.from_pretrained(a.draft, device=target.device, dtype=target.dtype)
    check_models(target, drafter, "ddtree")
    # A run of these settings: the cache this calibration is for must be one that a run can have.
    check_request(target, drafter, [[0] * a.prompt_len], [0], [], "ddtree", a.max_new_tokens, spec, a.compile,
                  None, a.batch)
    budgets = auto_budgets()
    length = ddtree.cache_length(a.prompt_len, a.max_new_tokens, "ddtree", spec, drafter, budgets)
    with torch.inference_mode():
        engine = ddtree.get_engine(target, drafter, "ddtree", sampling, spec, length, a.compile, a.batch,
                                   auto=budgets)
        engine.renew("asked for (bench.py calibrate)")
        seconds = engine.warm_up()
    print(f"{device_name(target.device)}; torch {torch.__version__}, {target.dtype}, "
          f"{'compiled' if a.compile else 'eager'}, batch {a.batch}, {length} cache slots; calibrated in "
          f"{engine.calibrate_seconds:.1f} s ({seconds:.1f} s with compiling the viable candidates)")
    print(engine.curve_table())
    print(f"stored in {cache_file()}")


COMMANDS = {"pair": (pair_options, pair), "context": (context_options, context),
            "official": (official_options, official), "moe": (moe_options, moe), "hybrid": (hybrid_options, hybrid),
            "memory": (memory_options, memory), "calibrate": (calibrate_options, calibrate),
            "moe-parallel": (moe_parallel_options, moe_parallel)}
