"""The verify forward through a hybrid target (Qwen3.5's layout: Gated DeltaNet layers and gated full attention)
beside the dense Qwen3 target of the same width, per budget, on the CPU: time, extra peak memory, and the share
spent in the recurrent layers.

The dense model is the bundled target (assets/tiny-target: hidden 256, 4 layers, 4 heads of 64, 2 KV heads, MLP
768, vocabulary 4096, tied embeddings). The hybrid is a random Qwen3.5 of the same width written by transformers
(checkpoints.random_hybrid_model / save_hybrid) and loaded as the engine loads it: 4 layers with
full_attention_interval 4, so layers 0-2 are Gated DeltaNet (Hk = 2 key heads, Hv = 4 value heads, Dk = Dv = 64,
conv kernel 4) and layer 3 is gated full attention (4 heads of 64, 2 KV heads, a quarter of each head roped). Only
the target's verify forward is measured (no drafter): one forward of R = B + 1 rows of a random tree after
--prompt-len committed slots, as Engine.verify runs it (the recurrent layers in tree mode, gated_delta.Recurrent.tree,
whose k, u and G the commit would read are returned), its mask built beforehand (the round's `mask` stage).

- time: medians over --repeats, the two models called in turn (benchlib.interleaved), eager; with --compile also
  compiled (torch.compile fullgraph, no max-autotune, as benchlib.verify_ms compiles it);
- share (eager): the seconds inside each layer's token mixer (GatedDeltaNet modules, attention modules) and inside
  the tree rule itself (gated_delta.tree_gated_delta), over the same forwards' seconds, timed by hooks;
- memory: the growth of a fresh process's peak resident set over one verify at budget B, after the inputs are
  built and a one-node verify has run, median over --memory-repeats processes (as bench_memory.py measures, with
  one change: loading these small models peaks higher than their verify, so the peak is reset first, VmHWM through
  /proc/self/clear_refs after malloc_trim, and the growth is taken over the resident set at that point). Beside it: one [H, R, R] float32 matrix per recurrent layer (the WY form's transient matrices are a
  few of these), and what keeping one recurrent state per tree row would cost (R * the state size per token).

    python scripts/bench_hybrid.py [--budgets 4 16 64 512] [--compile] [--json benchmarks/2026-12-04-cpu-hybrid-verify.json]
"""

import argparse
import collections
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (os.path.join(ROOT, "scripts"), ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)
import gated_delta  # noqa: E402
from draft_tree import ancestor_matrix  # noqa: E402
from gated_delta import Recurrent  # noqa: E402
from model import Qwen3  # noqa: E402
from tree_attn import PrefixMask  # noqa: E402

DENSE = os.path.join(ROOT, "assets", "tiny-target")
# The hybrid's shapes: the bundled target's width and attention, Qwen3.5's layout (3 of every 4 layers linear).
HYBRID = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
              max_position_embeddings=4096, tie_word_embeddings=True)
# Qwen3.5-27B's recurrent layers (its text config: 64 layers, full_attention_interval 4, 48 value heads and
# 16 key heads of 128), for the same arithmetic at full size.
QWEN3_5_27B_LINEAR = dict(layers=48, heads=48, key_dim=128, value_dim=128)


# ---------------------------------------------------------------------------------------------- the verify forward


def random_tree(budget: int, seed: int = 0):
    """(parents [B], depths [B + 1]): node i hangs under a random earlier row (as benchlib.verify_ms draws it)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor([int(torch.randint(0, i + 1, (1,), generator=g)) for i in range(budget)],
                           dtype=torch.long)
    depths = torch.zeros(budget + 1, dtype=torch.long)
    for i in range(budget):
        depths[i + 1] = depths[int(parents[i])] + 1
    return parents, depths


def tree_verify(target, budget: int, compile: bool = False, prompt_len: int = 256, seed: int = 0,
                feature_layers=()):
    """A zero-argument callable running one verify forward of budget + 1 rows (a batch of one request) as
    Engine.verify runs it: a random tree after `prompt_len` committed slots, RoPE positions prompt_len + depth,
    cache slots prompt_len + row, the ancestor mask (built here, once), the outputs of `feature_layers` (a
    drafter's context features, as the round asks for them), and the recurrent layers in tree mode (their pending
    k, u and G, which the commit reads, are returned with the logits, so nothing is left out).
    The caches hold zeros (the values do not change the work). compile: torch.compile fullgraph (CUDA graphs on a
    GPU, as the engine compiles its round)."""
    dev, n = target.device, budget + 1
    kv = -(-(prompt_len + n) // 1024) * 1024
    target.setup_cache(kv)
    parents, depths = random_tree(budget, seed)
    anc = ancestor_matrix(parents[None].to(dev), int(depths.max()), dtype=torch.uint8)  # [1, R, R]
    mask = PrefixMask(n, kv, dev, dense=not compile and dev.type == "cpu")
    block_mask = mask.set(torch.tensor([prompt_len], device=dev), anc)
    tokens = torch.randint(0, target.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed)).to(dev)
    positions = (prompt_len + depths)[None].to(dev)
    slots = (prompt_len + torch.arange(n))[None].to(dev)
    parents = parents[None].to(dev)

    depth = int(depths.max())  # the bound the engine would pass (its draft positions), here the tree's own

    def forward(tokens, positions, slots, block_mask, parents, anc):
        tree = Recurrent.tree(parents, anc, depth)
        logits, features = target(tokens, positions, slots, block_mask, feature_layers=feature_layers,
                                  recurrent=tree)
        return (logits, features, *(t for i in sorted(tree.pending) for t in tree.pending[i][1:]))

    if compile:
        forward = torch.compile(forward, dynamic=False, fullgraph=True,
                                mode="reduce-overhead" if dev.type == "cuda" else None)
    return lambda: forward(tokens, positions, slots, block_mask, parents, anc)


def state_bytes_per_token(target) -> int:
    """Bytes of one token's recurrent states over every Gated DeltaNet layer (float32 [Hv, Dk, Dv] each, the
    state a per-node verifier would keep for every tree row; conv states not counted)."""
    return sum(m.value_heads * m.key_dim * m.value_dim * 4 for m in target.recurrent_layers())


def rr_bytes(target, rows: int) -> int:
    """Bytes of one float32 [H, R, R] matrix of the tree rule (H = the recurrent layers' value heads; 0 for a
    model without recurrent layers)."""
    layers = target.recurrent_layers()
    return layers[0].value_heads * rows * rows * 4 if layers else 0


# ------------------------------------------------------------------------------------------------------- shares


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


# ------------------------------------------------------------------------------------------------------- memory


def status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def reset_peak() -> float:
    """Freed heap pages back to the system (malloc_trim), then the process's peak resident set (VmHWM) reset to
    what it holds now (Linux: /proc/self/clear_refs, 5); returns the resident set it starts from, in MB."""
    import ctypes
    import gc
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mb("VmRSS")


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
    out = []
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, __file__, "--memory-case", path, str(budget), str(prompt_len)],
                              capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        out.append(json.loads(proc.stdout.strip().splitlines()[-1])["growth_mb"])
    return out


# --------------------------------------------------------------------------------------------------------- main


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def save_hybrid_target(out_dir: str) -> str:
    from checkpoints import hybrid_text_config, random_hybrid_model, save_hybrid
    hf = random_hybrid_model(hybrid_text_config(**HYBRID), std=0.05)
    save_hybrid(hf, out_dir)
    return out_dir


def fmt_mb(x: float) -> str:
    return f"{x:8.1f}" if x < 1e5 else f"{x / 1024:7.1f}G"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 16, 64, 512])
    p.add_argument("--memory-budgets", type=int, nargs="*", default=None,
                   help="budgets of the memory cases (default: --budgets and 1024, 2048, to show the growth's shape)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--memory-repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny matmuls: 1 is fastest)")
    p.add_argument("--compile", action="store_true", help="also time the verify compiled")
    p.add_argument("--json", default=None)
    p.add_argument("--memory-case", nargs=3, help=argparse.SUPPRESS)  # path budget prompt_len: one memory case here
    a = p.parse_args()
    if a.memory_case:
        return memory_case(a.memory_case[0], int(a.memory_case[1]), int(a.memory_case[2]))
    torch.set_num_threads(a.threads)
    memory_budgets = a.memory_budgets if a.memory_budgets is not None else sorted(set(a.budgets) | {1024, 2048})
    out = dict(machine=dict(cpu=cpu_name(), cores=os.cpu_count(), threads=a.threads, torch=torch.__version__,
                            python=platform.python_version()),
               command="python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
               prompt_len=a.prompt_len, repeats=a.repeats, memory_repeats=a.memory_repeats, cases={})
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"hybrid": save_hybrid_target(os.path.join(tmp, "hybrid")), "dense": DENSE}
        models = {k: Qwen3.from_pretrained(v, device="cpu") for k, v in paths.items()}
        hybrid = models["hybrid"]
        state = state_bytes_per_token(hybrid)
        m0 = hybrid.recurrent_layers()[0]
        out["hybrid"] = dict(HYBRID, layer_types=list(hybrid.config.layer_types), state_bytes_per_token=state,
                             parameters=sum(t.numel() for t in hybrid.parameters()))
        out["dense"] = dict(path=os.path.relpath(DENSE, ROOT),
                            parameters=sum(t.numel() for t in models["dense"].parameters()))
        big = QWEN3_5_27B_LINEAR
        state_27b = big["layers"] * big["heads"] * big["key_dim"] * big["value_dim"] * 4
        out["qwen3_5_27b"] = dict(big, state_bytes_per_token=state_27b)
        print(f"machine: {out['machine']}")
        print(f"hybrid: {hybrid.config.layer_types}; Gated DeltaNet Hk={m0.key_heads} Hv={m0.value_heads} "
              f"Dk={m0.key_dim} Dv={m0.value_dim}; {out['hybrid']['parameters'] / 1e6:.2f} M parameters "
              f"(dense: {out['dense']['parameters'] / 1e6:.2f} M); recurrent state per token "
              f"{state / 2**10:.0f} KiB (Qwen3.5-27B: {state_27b / 2**20:.0f} MiB)", flush=True)

        modes = ["eager"] + (["compiled"] if a.compile else [])
        with torch.inference_mode():
            for budget in a.budgets:
                case = out["cases"].setdefault(budget, {})
                for mode in modes:
                    t = time.time()
                    fns = [tree_verify(models[k], budget, compile=mode == "compiled", prompt_len=a.prompt_len)
                           for k in ("hybrid", "dense")]
                    for fn in fns:  # the first call compiles
                        fn()
                    first_s = time.time() - t
                    hy, de = interleaved(fns, a.repeats)
                    case[f"{mode}_ms"] = dict(hybrid=hy, dense=de)
                    if mode == "compiled":
                        case["compile_seconds_both"] = first_s
                    if mode == "eager":
                        case["share_pct"] = {k: shares(models[k], fn, max(3, a.repeats // 2))
                                             for k, fn in zip(("hybrid", "dense"), fns)}
                    print(f"B={budget:4d} {mode:8s}: hybrid {hy:8.2f} ms, dense {de:8.2f} ms ({hy / de:.2f}x)"
                          + (f"; first calls {first_s:.0f} s" if mode == "compiled" else ""), flush=True)
                torch._dynamo.reset()  # one budget's graphs at a time
        for budget in memory_budgets:
            rows = budget + 1
            case = out["cases"].setdefault(budget, {})
            mem = {k: measure_memory(paths[k], budget, a.prompt_len, a.memory_repeats) for k in ("hybrid", "dense")}
            case["memory_growth_mb"] = {k: statistics.median(v) for k, v in mem.items()}
            case["memory_growth_mb_all"] = mem
            case["rr_matrix_mb"] = rr_bytes(hybrid, rows) / 2**20
            case["state_per_node_mb"] = rows * state / 2**20
            case["qwen3_5_27b"] = dict(rr_matrix_mb=big["heads"] * rows * rows * 4 / 2**20,
                                       state_per_node_mb=rows * state_27b / 2**20)
            print(f"B={budget:4d} memory: hybrid +{case['memory_growth_mb']['hybrid']:.1f} MB, dense "
                  f"+{case['memory_growth_mb']['dense']:.1f} MB ({mem})", flush=True)
    table(out, a.budgets, memory_budgets, modes)
    if a.json:
        from benchlib import write_json
        write_json(a.json, out)


def interleaved(fns, repeats):
    from benchlib import interleaved as run
    return run(fns, torch.device("cpu"), repeats)


def table(out, budgets, memory_budgets, modes):
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
        print(f"{b:5d} {r:5d} {g['hybrid']:8.1f} {g['dense']:8.1f} {diff:9.1f} "
              f"{c['rr_matrix_mb']:8.2f} {g['hybrid'] / c['rr_matrix_mb']:8.1f} {fmt_mb(c['state_per_node_mb']):>10s} | "
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

if __name__ == "__main__":
    main()
