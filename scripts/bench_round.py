"""scripts/bench.py's commands on the cost of one round and of its parts, on this machine: round (the stages per
budget), roofline (each stage beside its floor), crossover (a round against plain decoding's step), sampling (a
sampled round's per-row work), kernels (what a compiled decode step launches), callgraph (the functions one round
runs) and ar (our AR beside transformers' generate). Each command is a pair: its options, and its run, whose
docstring is the command's --help.
"""

import collections
import inspect
import os
import re
import sys
import tempfile

import torch
import torch.nn.functional as F

from benchlib import (ROOT, best_of, compare, positive_int, held_out_code, interleaved_runs, print_rows, random_tokens,
                      round_header, round_row, round_split, save_random_pair, save_random_target, target_config, timed,
                      tree_alone, verify_ms, write_json)
import cpu
import ddtree
import model
from checkpoints import dflash_config, random_dflash_weights, save_checkpoint
from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET, Engine, Speculation, cache_length
from drafter import DFlashDrafter
import families
from model import Linear, Qwen3, Qwen3Config
from sampler import Sampling, draw_noise, sample, warp_probs
from text import Text
from tree_attn import PrefixMask

CPU = torch.device("cpu")


def size_of(text: str, flag: str) -> tuple[int, int]:
    """(hidden, layers) of a random pair named HxL, such as 1024x8."""
    try:
        hidden, layers = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"{flag} takes HxL, such as 1024x8, not {text!r}") from None
    if hidden < 1 or layers < 2:  # the random pair's drafter reads target layer 1
        raise ValueError(f"{flag} {text}: the hidden size must be at least 1 and the layers at least 2")
    return hidden, layers


def load_pair(target_path: str, draft_path: str, dtype):
    target = Qwen3.from_pretrained(target_path, device="cpu", dtype=dtype)
    return target, DFlashDrafter.from_pretrained(draft_path, device="cpu", dtype=dtype).bind(target)


# ------------------------------------------------------------------------------------------ round: the stages


def stages_options(p):
    p.add_argument("--budgets", type=positive_int, nargs="+", default=[16, 64, 256, 512, 1024])
    p.add_argument("--vocab", type=positive_int, default=8192)
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--block", type=positive_int, default=16)
    p.add_argument("--draft-layers", type=positive_int, default=1)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--threads", type=positive_int, default=os.cpu_count())
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--skip-tree-alone", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--scorecard", action="store_true", help="also the compiled fast path's CPU goals (see above)")


def stages(a):
    """Where a DDTree round's time goes, per budget, on a random pair (CPU or GPU), and tree construction alone at the
    paper's size. Prints tables and writes JSON.

        python scripts/bench.py round [--budgets 16 64 256 512 1024] [--compile] [--threads 2] [--json out/bench.json]
        python scripts/bench.py round --compile --scorecard    # also the fast path's three CPU goals, side by side

    --scorecard adds, in the same run: compiled AR beside transformers' generate on the random target's weights (goal >=
    1.5x), and compiled AR, DFlash chain and DDTree per budget in tokens/s on the bundled trained pair (goal: DDTree at
    its best budget >= the chain); the round table gives the third goal (compiled overhead <= 10%).

    Each round stage is the engine's own method (Engine.draft, propose, verify, accept; commit split into
    compact_kv and the drafter's append_context), timed with a device sync around it; with --compile the forwards
    (draft, context, verify) run compiled, as the engine runs them, and the small-op stages stay eager so each is timed
    on its own (compiled, they fuse into the round's graph and cost less). `round` is the whole compiled round
    (Engine.round) when --compile is given.
    """
    if a.layers < 2:  # random_pair's drafter reads target layers below the last
        raise ValueError(f"--layers must be at least 2 (the drafter reads a target layer below the last), got "
                         f"{a.layers}")
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    results = {"args": vars(a), "rounds": {}}
    with torch.inference_mode():
        tmp = tempfile.mkdtemp()
        target, drafter = random_pair(a.vocab, a.hidden, a.layers, a.block, a.draft_layers, dev, tmp)
        print(f"random pair: target {a.layers} layers hidden {a.hidden} vocab {a.vocab}; drafter {a.draft_layers} "
              f"layer(s), block {a.block}; {dev}, {torch.get_num_threads()} threads, "
              f"{'forwards compiled' if a.compile else 'eager'}; median of {a.repeats}, ms")
        results["rounds"] = stage_table(target, drafter, a)
        if not a.skip_tree_alone:
            t = results["tree_alone"] = tree_alone(151936, 15, 512, dev, a.repeats)
            print(f"tree build alone, V=151936, depth 15, B=512: heap {t['heap_ms']:.1f} ms, tensor eager "
                  f"{t['tensor_eager_ms']:.1f} ms, tensor compiled {t['tensor_compiled_ms']:.1f} ms, "
                  f"identical trees: {t['equal']}")
        if a.scorecard:
            results["scorecard"] = scorecard(os.path.join(tmp, "t"), a.vocab, a.repeats)
    if a.json:
        write_json(a.json, results)


def random_pair(vocab, hidden, layers, block, draft_layers, device, path):
    """The round command's random pair: benchlib.save_random_target and a drafter of `draft_layers` layers reading
    target layers 1, 2, ... (at most layers - 2)."""
    tc = save_random_target(os.path.join(path, "t"), vocab, hidden, layers)
    dc = dflash_config(tc, layers=draft_layers, block_size=block,
                       target_layer_ids=[min(i, layers - 2) for i in range(1, 1 + draft_layers)])
    save_checkpoint(os.path.join(path, "d"), dc, random_dflash_weights(dc))
    target = Qwen3.from_pretrained(os.path.join(path, "t"), device=device)
    return target, DFlashDrafter.from_pretrained(os.path.join(path, "d"), device=device).bind(target)


def stage_table(target, drafter, a) -> dict:
    """benchlib.round_split per budget, a table row each."""
    cols = ["draft", "tree", "verify", "walk", "compact", "context", "sum"] + (
        ["round", "tree_work"] if a.compile else [])
    print(round_header(cols, a.compile))
    rounds = {}
    for budget in a.budgets:
        rounds[budget] = round_split(target, drafter, budget, a.compile, a.repeats)
        print(round_row(budget, rounds[budget], cols), flush=True)
    print("overhead = (tree + walk + compact) / sum of stages, each stage eager (verify: its mask and forward); "
          "compiled = (round - draft - context - verify) / round, the whole round compiled (draft and context: the "
          "drafter's forward in two parts); tree_work = tree + the verify's mask + walk compiled together")
    return rounds


def scorecard(target_path: str, vocab: int, repeats: int, new: int = 128):
    """The CPU goals of the compiled fast path, measured side by side in this process."""
    rows = compare(target_path, random_tokens(32, vocab), new, repeats)
    print(f"\nAR on the random target's weights (greedy, prompt 32, {new} new tokens, best of {repeats}):")
    print_rows(rows, new)
    out = {"ar_tokens_per_s": {name: new / sec for name, sec, _ in rows}}
    ar_ratio = rows[0][1] / rows[2][1]
    pair = scorecard_pair(new)
    best = max((k for k in pair if k.startswith("ddtree")), key=lambda k: pair[k]["tokens_per_s"])
    tree_ratio = pair[best]["tokens_per_s"] / pair["dflash-1"]["tokens_per_s"]
    out["pair"] = {k: {f: v[f] for f in ("tau", "tokens_per_s", "same_tokens")} for k, v in pair.items()}
    print(f"\ncompiled AR / transformers generate: {ar_ratio:.2f}x (goal >= 1.5x)")
    print(f"compiled DDTree at its best budget ({best}) / compiled chain: {tree_ratio:.2f}x (goal >= 1)")
    out.update(ar_ratio=ar_ratio, best_tree=best, tree_over_chain=tree_ratio)
    return out


def scorecard_pair(new: int, passes: int = 3) -> dict:
    """Compiled AR, chain and DDTree per budget on the bundled pair, interleaved prompt by prompt."""
    target = Qwen3.from_pretrained(DEFAULT_TARGET, device="cpu")
    drafter = DFlashDrafter.from_pretrained(DEFAULT_DRAFT, device="cpu").bind(target)
    prompts = held_out_code(Text(target.path), 4, 64, 160, seed=0)  # as the pair command's
    configs = {"ar-1": (target, None, "ar", 1, 1), "dflash-1": (target, drafter, "dflash", 1, 1)}
    configs.update({f"ddtree-{b}": (target, drafter, "ddtree", b, 1) for b in (4, 16, 64, 256)})
    print(f"\nbundled pair, compiled, greedy, 4 held-out prompts x {new} new tokens; {passes} passes, the methods "
          f"interleaved prompt by prompt:")
    print(f"{'method':8s} {'B':>5s} {'tau':>6s} {'tok/s':>8s} {'same as AR':>11s}")
    pair = interleaved_runs(configs, prompts, new, True, passes)
    for key, (_, _, method, budget, _) in configs.items():
        r = pair[key]
        print(f"{method:8s} {budget if method == 'ddtree' else '':>5} {r['tau']:6.2f} {r['tokens_per_s']:8.1f} "
              f"{r['same_tokens']:>7d} / {len(prompts)}")
    return pair


# ------------------------------------------------------------------------------------------------- roofline


def roofline_options(p):
    p.add_argument("--target", default=os.path.join(ROOT, "assets", "tiny-target"))
    p.add_argument("--draft", default=os.path.join(ROOT, "assets", "tiny-draft"))
    p.add_argument("--budgets", type=positive_int, nargs="+", default=[4, 16])
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 5, 17, 65], help="verify rows (budget + 1)")
    p.add_argument("--prompt-len", type=positive_int, default=200)
    p.add_argument("--repeats", type=positive_int, default=7)
    p.add_argument("--threads", type=positive_int, default=os.cpu_count())
    p.add_argument("--max-autotune", action="store_true", help="compile the rounds and their stages as "
                   "ddtree.py --max-autotune does (frozen graphs, autotuned matmuls, oneDNN weight copies)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the models' dtype (logits "
                   "stay fp32)")
    p.add_argument("--size", default=None, metavar="HxL", help="the random pair of hidden size H and L layers "
                   "in place of --target / --draft (e.g. 1024x8)")
    p.add_argument("--json", default=None)


def roofline(a):
    """A roofline for this machine: each stage of a compiled DDTree round beside its floor.

        python scripts/bench.py roofline [--budgets 4 16] [--rows 1 5 17 65] [--max-autotune] [--dtype bfloat16]
                                         [--size 1024x8] [--json out.json]

    Measured first: the peak GEMM rate (the best of MKL's and oneDNN's large matmul at the engine's dtype, fp32 or bf16
    with --dtype bfloat16: on a CPU with AMX, oneDNN's tile unit) and the read bandwidth at the working-set size of each
    stage's weights (a small pair's weights can sit in the L3 cache, so the floor of a forward is the cache's bandwidth,
    not DRAM's). A stage's floor is max(bytes it must read / bandwidth, FLOPs / peak); the table prints the measured
    time, the floor and their ratio:
    - verify at 1 / 5 / 17 / 65 rows (a decode step, then B = 4 / 16 / 64 trees): every target weight once, the KV
      cache, 2 x rows x weights FLOPs (compiled as --compile; left out with --max-autotune, whose verify the round split
      below times);
    - per budget, the round's stages as the engine runs them (benchlib.round_split): draft (the drafter's block pass and
      the lm_head at block_size rows), tree + walk (its floor: reading the draft and verify logits), compaction
      (moving the accepted rows' K/V), context (the drafter's K/V of the committed tokens);
    - few-row linears alone, at the pair's weight shapes: F.linear (what aten runs: MKL's sgemm for fp32), oneDNN with
      the weight prepacked (torch.ops.mkldnn), and the one-row multiply-reduce the engine compiles
      (cpu.CPU_ONE_ROW_REDUCTION): what a faster few-row path could reach.

    The pair is the bundled one unless --target / --draft name another, or --size HxL asks for the benchmarks' random
    pair of hidden size H and L layers (benchlib.save_random_pair, written to a temporary folder): the larger the pair,
    the less a stage's fixed costs (kernel calls, thread synchronization) weigh beside its bytes.
    """
    if a.size is None:
        return roofline_table(a)
    hidden, layers = size_of(a.size, "--size")
    with tempfile.TemporaryDirectory() as tmp:
        a.target, a.draft = save_random_pair(tmp, hidden, layers)
        roofline_table(a)


def roofline_table(a):
    torch.set_num_threads(a.threads)
    out = {"threads": torch.get_num_threads(), "torch": torch.__version__, "pair": a.size or [a.target, a.draft]}
    with torch.inference_mode():
        dtype = getattr(torch, a.dtype)
        target = Qwen3.from_pretrained(a.target, device="cpu", dtype=dtype)
        drafter = DFlashDrafter.from_pretrained(a.draft, device="cpu", dtype=dtype).bind(target)
        peak = out["gemm_flops"] = peak_flops(a.repeats, dtype)
        out["dtype"] = a.dtype
        print(f"{out['threads']} threads, {a.dtype}. Peak GEMM (2048^3): aten {peak['aten'] / 1e9:.0f} GFLOP/s, "
              f"oneDNN {peak['onednn'] / 1e9:.0f} GFLOP/s")
        floors = Floors(target, drafter, peak["peak"], a.repeats)
        out["bandwidth"], out["stages"] = floors.bw, floors.stages
        print(f"{'stage (compiled)':28s} {'ms':>9s} {'floor ms':>9s} {'ratio':>9s}")
        for rows in [] if a.max_autotune else a.rows:
            floors.verify(rows, verify_ms(target, rows - 1, True, a.repeats, prompt_len=a.prompt_len), a.prompt_len)
        for budget in a.budgets:
            ms = round_split(target, drafter, budget, "max-autotune" if a.max_autotune else True, a.repeats,
                             prompt_len=a.prompt_len)
            out.setdefault("rounds", {})[budget] = ms
            print(f"-- round at B = {budget}: {ms['round']:.3f} ms "
                  f"{'compiled (max-autotune)' if a.max_autotune else 'compiled'}")
            floors.round(budget, ms)
        print(f"\nfew-row linear, ms (rows x weight [out, in], {a.dtype}): aten / oneDNN prepacked / compiled "
              "one-row reduce")
        table = out["linears"] = linear_table(target, a.rows, a.repeats, dtype)
        for row in table:
            extra = f" {row['reduce']:8.3f}" if "reduce" in row else ""
            print(f"{row['rows']:4d} x {str(row['shape']):13s} {row['aten']:8.3f} {row['onednn']:8.3f}{extra}")
    if a.json:
        write_json(a.json, out)


class Floors:
    """The pair's weight bytes and the read bandwidth at their sizes (measured here), then each stage reported
    beside its floor, max(bytes / bandwidth, FLOPs / peak): printed as it comes, kept in `stages`."""

    def __init__(self, target, drafter, peak: float, repeats: int):
        self.target, self.drafter, self.peak, self.stages = target, drafter, peak, []
        c, es = target.config, target.dtype.itemsize  # bytes per weight and per K/V element
        self.es, self.vocab = es, c.vocab_size
        self.wt = linear_bytes(target)
        self.wd = linear_bytes(drafter) + target.lm_head.weight.numel() * es  # its own layers, the target's lm_head
        self.bw = {"target": bandwidth(self.wt, repeats), "draft": bandwidth(self.wd, repeats),
                   "dram_1gib": bandwidth(2**30, 3)}
        print(f"read bandwidth: {self.bw['target'] / 1e9:.0f} GB/s at the target's {self.wt / 1e6:.1f} MB, "
              f"{self.bw['draft'] / 1e9:.0f} GB/s at the draft pass's {self.wd / 1e6:.1f} MB, "
              f"{self.bw['dram_1gib'] / 1e9:.0f} GB/s over 1 GiB\n")
        self.kv_row = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * es  # K and V bytes per position

    def report(self, name, ms, nbytes, flops, bandwidth_):
        f = max(nbytes / bandwidth_, flops / self.peak) * 1e3
        self.stages.append({"stage": name, "ms": ms, "floor_ms": f, "ratio": ms / f})
        print(f"{name:28s} {ms:9.3f} {f:9.3f} {ms / f:8.1f}x", flush=True)

    def verify(self, rows: int, ms: float, prompt_len: int):
        """A verify forward of `rows` rows: every target weight, the K/V of the context, the matmuls' FLOPs."""
        c, ctx = self.target.config, prompt_len + rows
        attn = 4 * rows * ctx * c.num_attention_heads * c.head_dim * c.num_hidden_layers
        self.report(f"verify {rows} rows", ms, self.wt + ctx * self.kv_row, 2 * rows * self.wt / self.es + attn,
                    self.bw["target"])

    def round(self, budget: int, ms: dict):
        """A round's stages (benchlib.round_split's milliseconds) beside their floors."""
        block, es = self.drafter.config.block_size, self.es
        attn = [layer.self_attn for layer in self.drafter.layers]  # fc and the K/V rows of each stacked projection
        ctx_bytes = es * (self.drafter.fc.weight.numel() + sum(a.qkv_proj.weight[a.q_rows:].numel() for a in attn))
        self.report(f"  draft ({block} rows)", ms["draft"], self.wd, 2 * block * self.wd / es, self.bw["draft"])
        self.report(f"  verify ({budget + 1} rows)", ms["verify"], self.wt, 2 * (budget + 1) * self.wt / es,
                    self.bw["target"])
        logits = (block + budget + 1) * self.vocab * 4  # the tree reads the draft's, the walk the verify's
        self.report("  tree + walk (eager)", ms["tree"] + ms["walk"], logits, 0,
                    self.bw["dram_1gib"])
        depth = block  # at most the accepted path's length of rows moves
        self.report("  compact (eager)", ms["compact"], 2 * depth * self.kv_row, 0, self.bw["dram_1gib"])
        self.report("  context", ms["context"], ctx_bytes, 2 * depth * ctx_bytes / es, self.bw["draft"])


def median_ms(fn, repeats: int) -> float:
    return timed(fn, CPU, repeats)[0]


def peak_flops(repeats: int, dtype) -> dict:
    """FLOP/s of a large square matmul at `dtype` through aten (MKL for fp32) and oneDNN (prepacked); the faster is
    the peak."""
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
    out = {"aten": 2 * n**3 / median_ms(lambda: a @ b.T, repeats) * 1e3,
           "onednn": 2 * n**3 / median_ms(lambda: onednn(a, packed), repeats) * 1e3}
    out["peak"] = max(out.values())
    return out


def bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second read by a sum over nbytes of fp32 (repeated: the data stays in whichever cache holds it)."""
    t = torch.randn(max(nbytes // 4, 1024))
    return t.numel() * 4 / median_ms(lambda: t.sum(), 20 * repeats) * 1e3


def onednn(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


def linear_bytes(module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in module.modules() if isinstance(m, Linear))


def linear_table(target, rows_list, repeats, dtype):
    """ms per few-row linear at the target's weight shapes: MKL, oneDNN prepacked, compiled one-row reduce."""
    shapes = sorted({tuple(m.weight.shape) for m in target.modules() if isinstance(m, Linear)},
                    key=lambda s: -s[0] * s[1])
    reduce = torch.compile(lambda x, w: (x[:, None, :] * w[None]).sum(-1), dynamic=False)
    table = []
    for shape in shapes:
        w = torch.randn(shape, dtype=dtype) * 0.02
        for rows in rows_list:
            x = torch.randn(rows, shape[1], dtype=dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            row = {"shape": list(shape), "rows": rows,
                   "aten": median_ms(lambda: torch.nn.functional.linear(x, w), 20 * repeats),
                   "onednn": median_ms(lambda: onednn(x, packed), 20 * repeats)}
            if rows == 1:
                row["reduce"] = median_ms(lambda: reduce(x, w), 20 * repeats)
            table.append(row)
    return table


# ------------------------------------------------------------------------------------------------ crossover


def crossover_options(p):
    p.add_argument("--sizes", nargs="+", default=["bundled", "1024x8"],
                   help="HIDDENxLAYERS per random pair, or bundled")
    p.add_argument("--budgets", type=positive_int, nargs="+", default=[4, 16, 64])
    p.add_argument("--mode", choices=["max-autotune", "compile"], default="max-autotune",
                   help="compile as --max-autotune or as --compile does")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompt-len", type=positive_int, default=200)
    p.add_argument("--steps", type=positive_int, default=25)
    p.add_argument("--passes", type=positive_int, default=2)
    p.add_argument("--threads", type=positive_int, default=os.cpu_count())
    p.add_argument("--json", default=None)


def crossover(a):
    """Where speculation pays on this machine: plain decoding's step beside a DDTree round per budget, compiled, on the
    bundled pair and on random pairs of growing size; a round's cost in plain steps is the tau a pair must reach at that
    budget just to match plain decoding (its break-even tau).

        python scripts/bench.py crossover [--sizes bundled 1024x8] [--budgets 4 16 64]
                                          [--mode max-autotune|compile] [--dtype float32|bfloat16]

    A size HxL is a random Qwen3 target of hidden size H and L layers (MLP 3H, head_dim 64, vocab 4096) with a random
    one-layer DFlash drafter (block 8, reading target layers 1 and L - 2), written in the real checkpoint formats
    (benchlib.save_random_pair); `bundled` is the bundled trained pair. The engine runs them as `generate` does. A round
    costs the same whatever it accepts, up to the few KV rows a commit moves, so random drafts time it as well as
    trained ones. DDTree at budget B beats plain decoding by tau(B) / break-even(B), with tau(B) the pair's measured
    tokens per round (the bundled pair's: the pair command). Whether a pair's weights sit in the L3 cache decides much
    of the answer (docs/benchmarks.md).

    Each engine is compiled first (its compile time is printed apart); then the methods take turns, `--passes` times,
    each turn the median of `--steps` steps after a prefill of `--prompt-len` random tokens; the table keeps each
    method's fastest turn.
    """
    sizes = {size: None if size == "bundled" else size_of(size, "--sizes") for size in a.sizes}  # refused first
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    out = {"args": vars(a), "threads": torch.get_num_threads(), "torch": torch.__version__, "sizes": {}}
    dtype = getattr(torch, a.dtype)
    print(f"{out['threads']} threads, {a.dtype}, compiled as --{a.mode}; break-even tau = round ms / plain step ms")
    print(f"{'pair':>8s} {'params':>8s} {'MB':>6s} {'AR ms':>7s} " +
          " ".join(f"{'B=' + str(b) + ' ms':>9s} {'tau*':>5s}" for b in a.budgets))
    for size, shape in sizes.items():
        r = out["sizes"][size] = crossover_row(shape, dtype, a)
        print(f"{size:>8s} {r['params'] / 1e6:7.1f}M {r['megabytes']:6.0f} {r['ar_ms']:7.2f} " +
              " ".join(f"{r['round_ms'][b]:9.2f} {r['break_even_tau'][b]:5.2f}" for b in a.budgets), flush=True)
        print(f"{'':>8s} compile s: " + ", ".join(f"{k}: {v:.0f}" for k, v in r["compile_s"].items()), flush=True)
    if a.json:
        write_json(a.json, out)


def crossover_row(shape, dtype, a) -> dict:
    """One pair's measures: the bundled pair (shape None) or the random pair of (hidden, layers)."""
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        if shape is None:
            target, drafter = load_pair(DEFAULT_TARGET, DEFAULT_DRAFT, dtype)
        else:
            target, drafter = load_pair(*save_random_pair(tmp, *shape), dtype)
        params = sum(t.numel() for t in target.parameters())
        r = step_times(target, drafter, a.budgets, a.mode, a.prompt_len, a.steps, a.passes)
    r.update(params=params, megabytes=params * dtype.itemsize / 1e6)
    return r


def step_ms(engine: Engine, prompt: list, steps: int) -> float:
    """Median milliseconds of `steps` engine steps (rounds, or plain decoding steps) after a prefill of `prompt`
    and one untimed step (benchlib.timed); a step includes its host read, as in `generate`."""
    engine.start([prompt], seeds=[0])
    return timed(engine.step, CPU, steps)[0]


def step_times(target, drafter, budgets, mode, prompt_len: int, steps: int, passes: int) -> dict:
    compile = True if mode == "compile" else mode
    prompt = torch.randint(0, target.config.vocab_size - 1, (prompt_len,)).tolist()
    spec = {None: Speculation()} | {b: Speculation(budget=b) for b in budgets}
    # Room for one turn (each starts from the prefill): steps + 2 rounds (timed's warm-up and its last call), each
    # committing at most block_size tokens.
    max_len = cache_length(prompt_len, (steps + 2) * drafter.block_size, "ddtree", spec[max(budgets)], drafter)
    engines, compile_s = {}, {}
    for b in spec:  # compile each engine first, so that the turns below time generation alone
        engines[b] = Engine(target, None if b is None else drafter, "ar" if b is None else "ddtree", Sampling(),
                            spec[b], max_len, compile)
        compile_s[b] = engines[b].warm_up()
    ms = {b: float("inf") for b in spec}
    for _ in range(passes):
        for b in spec:
            ms[b] = min(ms[b], step_ms(engines[b], prompt, steps))
    return {"ar_ms": ms[None], "round_ms": {b: ms[b] for b in budgets},
            "break_even_tau": {b: ms[b] / ms[None] for b in budgets},
            "compile_s": {"ar" if b is None else b: s for b, s in compile_s.items()}}


# ------------------------------------------------------------------------------------------------- sampling

SETTINGS = (("T 0.6, top-k 20, top-p 0.95", Sampling(0.6, 20, 0.95)),  # Qwen3's recommended thinking-mode values
            ("T 0.6, top-p 0.95", Sampling(0.6, top_p=0.95)),
            ("T 1", Sampling(1.0)))


def sampling_options(p):
    p.add_argument("--vocab", type=positive_int, default=151936)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[17, 65])
    p.add_argument("--threads", type=positive_int, default=os.cpu_count())
    p.add_argument("--repeats", type=positive_int, default=3)


def sampling(a):
    """What a sampled round's per-row work costs at a real vocabulary: warping (temperature, top-k, top-p), drawing the
    uniforms and the inversion draw, for verify-sized blocks of rows, eager, as a table.

        python scripts/bench.py sampling [--vocab 151936] [--rows 17 65] [--threads 2] [--repeats 3]

    Rows of 17 and 65 are the verify rows of B = 16 and 64 trees; 151936 is Qwen3's vocabulary.
    """
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(f"vocab {a.vocab}, {a.threads} threads, eager, best of {a.repeats} (ms)")
    print(f"{'rows':>5s}  {'setting':30s} {'warp':>8s} {'draw':>8s} {'sample':>8s} {'total':>8s}")
    for rows in a.rows:
        logits = 3 * torch.randn(rows, a.vocab, generator=g)
        for name, s in SETTINGS:
            warp, probs = best_of(lambda: warp_probs(logits, s), a.repeats)
            draw, u = best_of(lambda: draw_noise((rows,), g, "cpu"), a.repeats)
            pick, _ = best_of(lambda: sample(probs, u), a.repeats)
            total, _ = best_of(lambda: sample(warp_probs(logits, s), draw_noise((rows,), g, "cpu")), a.repeats)
            print(f"{rows:5d}  {name:30s} {warp * 1e3:8.2f} {draw * 1e3:8.3f} {pick * 1e3:8.2f} {total * 1e3:8.2f}",
                  flush=True)


# -------------------------------------------------------------------------------------------------- kernels

SMALL_DENSE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
                   tie_word_embeddings=False)
SMALL_HYBRID = dict(SMALL_DENSE, partial_rotary_factor=0.25, zero_centered_norm=True, attn_output_gate=True,
                    linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                    linear_num_value_heads=6)
CALL = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+)(?:\.default)?\(",
                  re.M)


def kernels_options(p):
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--json", default=None)


def kernels(a):
    """What a compiled AR decode step launches: inductor's fused kernels, GEMMs and other calls, per layer.

        python scripts/bench.py kernels [--layers 4] [--json out.json]

    The step is compiled as a GPU engine compiles it (plain modules, every layer inlined, fullgraph) but on the CPU,
    with the mask materialized for SDPA (compiled CPU FlexAttention is the CPU seam's business). Inductor's CPU and GPU
    backends fuse the same pointwise graph, so the counts stand for a GPU step's launches: GEMMs exactly, fused kernels
    closely. Two targets of a few small layers: a dense Qwen3 and a Qwen3.5 hybrid (three Gated DeltaNet layers, then
    gated attention). Each compile takes seconds.
    """
    if a.layers < 4:
        raise ValueError("--layers must be at least 4 (the hybrid's layout: three Gated DeltaNet layers, then "
                         "attention)")
    hybrid_types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(a.layers))
    configs = {"dense": target_config(**SMALL_DENSE, num_hidden_layers=a.layers),
               "hybrid": target_config(**SMALL_HYBRID, num_hidden_layers=a.layers, layer_types=hybrid_types)}
    out = {}
    print(f"{'target':8s} {'layers':>6s} {'gemm':>6s} {'fused':>6s} {'other':>6s} {'total':>6s} {'per layer':>10s}")
    for name, config in configs.items():
        calls = decode_step_calls(config)
        other = sum(v for k, v in calls.items() if k not in ("gemm", "fused"))
        total = sum(calls.values())
        out[name] = dict(layers=a.layers, calls=dict(calls), total=total)
        print(f"{name:8s} {a.layers:6d} {calls['gemm']:6d} {calls['fused']:6d} {other:6d} {total:6d} "
              f"{(total - 1) / a.layers:10.2f}")  # the lm_head's GEMM is the step's own
    if a.json:
        write_json(a.json, dict(torch=torch.__version__, steps=out))


def kind(call: str) -> str:
    if call.startswith(("cpp_fused", "triton_")):
        return "fused"
    if call.startswith("extern_kernels.") and call.split(".")[1] in ("mm", "addmm", "bmm", "baddbmm"):
        return "gemm"
    return call


def decode_step_calls(config: Qwen3Config) -> collections.Counter:
    """The kernel calls of one compiled decode step (one row, context 100) of a random model of this config."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = families.build(Qwen3, config).eval()
    m.setup_cache(1024)
    mask = PrefixMask(1, 1024, "cpu").set(torch.tensor([100]))
    dense = cpu.dense_mask(mask, 1)  # materialized here, outside the graph

    class SdpaAttention(model.Attention):  # SDPA over the materialized mask, a graph input as on a GPU the BlockMask
        def attend(self, q, mask, scale):
            kv = dense.shape[-1]
            out = F.scaled_dot_product_attention(q, self.k_cache[:, :, :kv], self.v_cache[:, :, :kv], attn_mask=dense,
                                                 scale=scale, enable_gqa=self.heads != self.kv_heads)
            return out.transpose(1, 2).flatten(2)

    for module in m.modules():
        if type(module) is model.Attention:
            module.__class__ = SdpaAttention
    token, pos = torch.zeros(1, 1, dtype=torch.long), torch.tensor([[100]])

    def step(token, pos):
        state = m.chain_state(torch.ones(1, dtype=torch.long)) if m.recurrent else None
        return m(token, pos, pos, mask, recurrent=state)[0]

    with torch.inference_mode(), cpu.layers_inlined():  # every layer's calls in the one graph
        _, code = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False), token, pos)
    return collections.Counter(kind(c) for c in CALL.findall("\n".join(code)))


# ------------------------------------------------------------------------------------------------ callgraph


def callgraph_options(p):
    p.add_argument("--budget", type=positive_int, default=16)
    p.add_argument("--eager-tree", action="store_true", help="the heap builder (an eager engine's) instead")
    p.add_argument("--list", action="store_true", help="print every function")
    p.add_argument("--new-tokens", type=positive_int, default=32, help="the whole generate()'s tokens")


def callgraph(a):
    """What one DDTree round crosses: the repository's own functions that one round runs, per file, and the deepest
    chain of calls from generate() to the attention; then the functions a whole greedy generate() runs on a warm
    engine. A reader's measure of how far one round spreads.

        python scripts/bench.py callgraph [--budget 16] [--eager-tree] [--list] [--new-tokens 32]

    The round runs eagerly on the bundled pair (CPU), with the tree builder a compiled engine uses
    (draft_tree.build_tree; --eager-tree: the heap an eager engine uses), so the functions are those a compiled round
    traces. Counted are named functions and methods defined in the repository's .py files (comprehensions and lambdas
    apart), each once, but for cpu/, the CPU seam a reader of the round skips: the layers attend as a GPU round's
    do, through Attention.attend (eager FlexAttention here, cpu.EAGER_CPU_ATTENTION).
    """
    heap, attention = ddtree.build_tree_heap, cpu.EAGER_CPU_ATTENTION  # put back once profiled
    if not a.eager_tree:
        ddtree.build_tree_heap = ddtree.build_tree  # what the engine picks when eager: the compiled round's builder
    cpu.EAGER_CPU_ATTENTION = "flex"
    try:
        target = Qwen3.from_pretrained(DEFAULT_TARGET, device="cpu")
        drafter = DFlashDrafter.from_pretrained(DEFAULT_DRAFT, device="cpu")
        with torch.inference_mode():
            seen, deepest = profile_round(target, drafter, a.budget)
            whole = profile_generate(target, drafter, a.budget, a.new_tokens)
    finally:
        ddtree.build_tree_heap, cpu.EAGER_CPU_ATTENTION = heap, attention
    named = {k: v for k, v in seen.items() if "<" not in k[1]}
    files = collections.Counter(f for f, _ in named)
    print(f"one round (B = {a.budget}): {len(named)} named functions ({sum(named.values())} lines) in {len(files)} "
          f"files: {', '.join(f'{f} {n}' for f, n in files.most_common())}")
    start = deepest.index("generate") if "generate" in deepest else 0
    print(f"generate -> attention: {len(deepest) - start} frames: {' > '.join(deepest[start:])}")
    whole_named = {k: v for k, v in whole.items() if "<" not in k[1]}
    print(f"a whole greedy generate() ({a.new_tokens} tokens, B = {a.budget}) on a warm engine: {len(whole_named)} "
          f"named functions ({len(whole)} with lambdas and comprehensions) in {len({f for f, _ in whole_named})} files")
    if a.list:
        for (f, name), lines in sorted(named.items()):
            print(f"  {f:16s} {name:40s} {lines:4d} lines")
        print("the whole generate() adds:")
        for f, name in sorted(set(whole_named) - set(named)):
            print(f"  {f:16s} {name}")


NOT_OURS = tuple(os.path.join(ROOT, d) + os.sep for d in ("tests", ".venv", "cpu"))


def ours(filename: str) -> bool:
    """Whether a frame's file is the repository's own code (not its tests, its virtual environment, or cpu/). No
    generator here: the profile hook also runs inside frames that dynamo evaluates (eager FlexAttention compiles
    itself), and dynamo refuses to trace one."""
    return filename.startswith(ROOT) and not filename.startswith(NOT_OURS)


def profile_round(target, drafter, budget: int):
    """(functions: {(file, qualified name): source lines}, the deepest stack into Attention.attend)."""
    seen, stack, deepest, inside = {}, [], [], [False]

    def hook(frame, event, arg):
        code = frame.f_code
        if not ours(code.co_filename):
            return
        if event == "call":
            stack.append(code.co_name)
            inside[0] = inside[0] or code.co_qualname == "Engine.round"
            if inside[0]:
                seen[(os.path.relpath(code.co_filename, ROOT), code.co_qualname)] = source_lines(code)
            if code.co_qualname == "Attention.attend" and len(stack) > len(deepest):
                deepest[:] = stack
        elif event == "return":
            if stack:
                stack.pop()
            if code.co_qualname == "Engine.round":
                inside[0] = False

    prompt = list(range(5, 40))
    ddtree.generate(target, drafter, prompt, budget=budget, max_new_tokens=3)  # imports, caches
    sys.setprofile(hook)
    try:
        ddtree.generate(target, drafter, prompt, budget=budget, max_new_tokens=2)  # the prefill, then one round
    finally:
        sys.setprofile(None)
    return seen, deepest


def profile_generate(target, drafter, budget: int, new_tokens: int) -> dict:
    """The repository's functions that a whole greedy generate() runs on a warm engine: {(file, qualified name):
    source lines}."""
    seen = {}

    def hook(frame, event, arg):
        code = frame.f_code
        if event == "call" and ours(code.co_filename):
            seen[(os.path.relpath(code.co_filename, ROOT), code.co_qualname)] = source_lines(code)

    prompt = list(range(5, 40))
    ddtree.generate(target, drafter, prompt, budget=budget, max_new_tokens=new_tokens)  # the engine, warm
    sys.setprofile(hook)
    try:
        ddtree.generate(target, drafter, prompt, budget=budget, max_new_tokens=new_tokens)
    finally:
        sys.setprofile(None)
    return seen


def source_lines(code) -> int:
    try:
        return len(inspect.getsourcelines(code)[0])
    except OSError:
        return 0


# ------------------------------------------------------------------------------------------------------- ar


def ar_options(p):
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--vocab", type=positive_int, default=8192)
    p.add_argument("--new", type=positive_int, default=128)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=os.cpu_count(), help="torch threads for every contender")


def ar_speed(a):
    """Autoregressive decoding speed: our eager and compiled AR beside transformers' generate, on the same random Qwen3
    weights, in one run (ratios are what to read: machines here are noisy).

        python scripts/bench.py ar [--layers 4 --hidden 256 --vocab 8192 --new 128 --repeats 3]
    """
    torch.set_num_threads(a.threads)
    path = tempfile.mkdtemp()
    save_random_target(path, a.vocab, a.hidden, a.layers)
    prompt = torch.randint(0, a.vocab, (a.prompt_len,)).tolist()
    rows = compare(path, prompt, a.new, a.repeats)
    print(f"random Qwen3: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, fp32, CPU "
          f"({torch.get_num_threads()} threads), prompt {a.prompt_len}, {a.new} new tokens, best of {a.repeats}")
    print_rows(rows, a.new)


COMMANDS = {"round": (stages_options, stages), "roofline": (roofline_options, roofline),
            "crossover": (crossover_options, crossover), "sampling": (sampling_options, sampling),
            "kernels": (kernels_options, kernels), "callgraph": (callgraph_options, callgraph),
            "ar": (ar_options, ar_speed)}
