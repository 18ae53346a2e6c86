"""A roofline for this machine: each stage of a compiled DDTree round beside its floor.

    python scripts/bench_roofline.py [--budgets 4 16] [--rows 1 5 17 65] [--max-autotune] [--dtype bfloat16]
                                     [--size 1024x8] [--json out.json]

Measured first: the peak GEMM rate (the best of MKL's and oneDNN's large matmul at the engine's dtype, fp32 or
bf16 with --dtype bfloat16: on a CPU with AMX, oneDNN's tile unit) and the read bandwidth at
the working-set size of each stage's weights (the bundled pair's 17 MB fit the L3 cache of most server CPUs, so
the floor of a forward is the cache's bandwidth, not DRAM's). A stage's floor is max(bytes it must read /
bandwidth, FLOPs / peak); the table prints the measured time, the floor and their ratio:
- verify at 1 / 5 / 17 / 65 rows (a decode step, then B = 4 / 16 / 64 trees): every target weight once, the KV
  cache, 2 x rows x weights FLOPs (compiled as --compile; left out with --max-autotune, whose verify the round
  split below times);
- per budget, the round's stages as the engine runs them (benchlib.round_split): draft (the drafter's block
  pass and the lm_head at block_size rows), tree + mask + walk (its floor: reading the draft and verify logits),
  compaction (moving the accepted rows' K/V), context (the drafter's K/V of the committed tokens);
- few-row linears alone, at the pair's weight shapes: F.linear (what aten runs: MKL's sgemm for fp32), oneDNN
  with the weight prepacked (torch.ops.mkldnn), and the one-row multiply-reduce the engine compiles
  (cpu.CPU_ONE_ROW_REDUCTION): what a faster few-row path could reach.

The pair is the bundled one unless --target / --draft name another, or --size HxL asks for the benchmarks' random
pair of hidden size H and L layers (benchlib.save_random_pair, written to a temporary folder): the larger the pair,
the less a stage's fixed costs (kernel calls, thread synchronization) weigh beside its bytes; 1024x8 has 109M
parameters.
"""

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from benchlib import round_split, save_random_pair, timed, verify_ms, write_json  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from model import Linear, Qwen3  # noqa: E402

CPU = torch.device("cpu")
TARGET, DRAFT = os.path.join(ROOT, "assets", "tiny-target"), os.path.join(ROOT, "assets", "tiny-draft")


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


def floor_ms(nbytes: float, flops: float, bw: float, peak: float) -> float:
    return max(nbytes / bw, flops / peak) * 1e3


def linear_table(target, rows_list, repeats, dtype):
    """ms per few-row linear at the target's weight shapes: MKL, oneDNN prepacked, compiled one-row reduce."""
    shapes = sorted({tuple(m.weight.shape) for m in target.modules() if isinstance(m, Linear)}, key=lambda s: -s[0] * s[1])
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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 16])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5, 17, 65], help="verify rows (budget + 1)")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--max-autotune", action="store_true", help="compile the rounds and their stages as "
                   "ddtree.py --max-autotune does (frozen graphs, autotuned matmuls, oneDNN weight copies)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the models' dtype (logits "
                   "stay fp32)")
    p.add_argument("--size", default=None, metavar="HxL", help="the random pair of hidden size H and L layers "
                   "in place of --target / --draft (e.g. 1024x8)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.size is None:
        return roofline(a)
    try:
        hidden, layers = (int(v) for v in a.size.lower().split("x"))
    except ValueError:
        p.error(f"--size takes HxL, such as 1024x8, not {a.size!r}")
    with tempfile.TemporaryDirectory() as tmp:
        a.target, a.draft = save_random_pair(tmp, hidden, layers)
        roofline(a)


def roofline(a):
    compile = "max-autotune" if a.max_autotune else True
    torch.set_num_threads(a.threads)
    out = {"threads": torch.get_num_threads(), "torch": torch.__version__, "pair": a.size or [a.target, a.draft]}
    with torch.inference_mode():
        dtype = getattr(torch, a.dtype)
        es = dtype.itemsize  # bytes per weight and per K/V element
        target = Qwen3.from_pretrained(a.target, device="cpu", dtype=dtype)
        drafter = DFlashDrafter.from_pretrained(a.draft, device="cpu", dtype=dtype).bind(target)
        c = target.config
        peak = out["gemm_flops"] = peak_flops(a.repeats, dtype)
        out["dtype"] = a.dtype
        print(f"{out['threads']} threads, {a.dtype}. Peak GEMM (2048^3): aten {peak['aten'] / 1e9:.0f} GFLOP/s, "
              f"oneDNN {peak['onednn'] / 1e9:.0f} GFLOP/s")
        wt, wl = linear_bytes(target), target.lm_head.weight.numel() * es
        wd = linear_bytes(drafter) + wl  # the drafter's own layers, then the target's lm_head
        bw = out["bandwidth"] = {"target": bandwidth(wt, a.repeats), "draft": bandwidth(wd, a.repeats),
                                 "dram_1gib": bandwidth(2**30, 3)}
        print(f"read bandwidth: {bw['target'] / 1e9:.0f} GB/s at the target's {wt / 1e6:.1f} MB, "
              f"{bw['draft'] / 1e9:.0f} GB/s at the draft pass's {wd / 1e6:.1f} MB, {bw['dram_1gib'] / 1e9:.0f} GB/s "
              f"over 1 GiB\n")
        kv_row = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * es  # K and V bytes per position
        stages = out["stages"] = []

        def report(name, ms, nbytes, flops, bandwidth_):
            f = floor_ms(nbytes, flops, bandwidth_, peak["peak"])
            stages.append({"stage": name, "ms": ms, "floor_ms": f, "ratio": ms / f})
            print(f"{name:28s} {ms:9.3f} {f:9.3f} {ms / f:8.1f}x", flush=True)

        print(f"{'stage (compiled)':28s} {'ms':>9s} {'floor ms':>9s} {'ratio':>9s}")
        for rows in [] if a.max_autotune else a.rows:
            ms = verify_ms(target, rows - 1, True, a.repeats, prompt_len=a.prompt_len)
            ctx = a.prompt_len + rows
            attn = 4 * rows * ctx * c.num_attention_heads * c.head_dim * c.num_hidden_layers
            report(f"verify {rows} rows", ms, wt + ctx * kv_row, 2 * rows * wt / es + attn, bw["target"])
        block = drafter.config.block_size
        attn = [layer.self_attn for layer in drafter.layers]  # fc and the K/V rows of each stacked projection
        ctx_bytes = es * (drafter.fc.weight.numel() + sum(a.qkv_proj.weight[a.q_rows:].numel() for a in attn))
        for budget in a.budgets:
            ms = round_split(target, drafter, budget, compile, a.repeats, prompt_len=a.prompt_len)
            out.setdefault("rounds", {})[budget] = ms
            how = "compiled (max-autotune)" if a.max_autotune else "compiled"
            print(f"-- round at B = {budget}: {ms['round']:.3f} ms {how}")
            report(f"  draft ({block} rows)", ms["draft"], wd, 2 * block * wd / es, bw["draft"])
            report(f"  verify ({budget + 1} rows)", ms["verify"], wt, 2 * (budget + 1) * wt / es, bw["target"])
            logits = (block + budget + 1) * c.vocab_size * 4  # the tree reads the draft's, the walk the verify's
            report("  tree + mask + walk (eager)", ms["tree"] + ms["mask"] + ms["walk"], logits, 0, bw["dram_1gib"])
            depth = block  # at most the accepted path's length of rows moves
            report("  compact (eager)", ms["compact"], 2 * depth * kv_row, 0, bw["dram_1gib"])
            report("  context", ms["context"], ctx_bytes, 2 * depth * ctx_bytes / es, bw["draft"])
        print(f"\nfew-row linear, ms (rows x weight [out, in], {a.dtype}): aten / oneDNN prepacked / compiled "
              "one-row reduce")
        table = out["linears"] = linear_table(target, a.rows, a.repeats, dtype)
        for row in table:
            extra = f" {row['reduce']:8.3f}" if "reduce" in row else ""
            print(f"{row['rows']:4d} x {str(row['shape']):13s} {row['aten']:8.3f} {row['onednn']:8.3f}{extra}")
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
