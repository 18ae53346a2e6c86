"""One MoE layer over the ranks of torchrun, on a verify's rows, two ways (docs/tp.md, "Why every expert is split"):

- split: every expert cut by its intermediate dimension, each rank running every pair on its slice (tp.py's way);
- expert parallel: E/n whole experts per rank, the rows replicated on every rank as the attention's all-reduce leaves
  them, each rank running the (row, expert) pairs of its own experts only (selected on the host, unpadded: expert
  parallel's best case, which static shapes and CUDA graphs would have to pad to a capacity);

each followed by the one all-reduce of [rows, hidden] that the layer needs either way. Both take SparseMoE's own
path for their pairs (grouped GEMM on an H100). The shared expert, split the same way by both, is left out. Prints,
per row count, the pairs, the expert weights the busiest rank reads, and the slowest rank's median milliseconds.

    torchrun --nproc-per-node 8 scripts/moe_parallel.py --hidden 3072 --experts 256 --top-k 8      # 122B-A10B
    torchrun --nproc-per-node 8 scripts/moe_parallel.py --hidden 4096 --experts 512 --top-k 10     # 397B-A17B
    torchrun --nproc-per-node 2 scripts/moe_parallel.py --check      # both against the whole layer (float64)

Random weights, seeded per expert, and random rows: the router spreads them about evenly, as a trained router does
over a verify's rows on average; a skewed routing loads expert parallel's busiest rank more. Bad options are one
`error:` line and exit status 2.
"""

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tp  # noqa: E402
from cli import one_line_errors  # noqa: E402
from moe import SparseMoE, expert_path, device_capability  # noqa: E402


def expert_weights(e: int, hidden: int, inter: int, device) -> torch.Tensor:
    """Expert e's gate, up and down^T [3, inter, hidden] in float32, from a seed of its own: every rank makes the
    same, whatever share of it it keeps."""
    g = torch.Generator(device).manual_seed(1000 + e)
    return torch.randn(3, inter, hidden, generator=g, device=device) * hidden ** -0.5


def layer(experts: range, inter: slice, a, dtype, device) -> SparseMoE:
    """The experts `experts` of the layer, each cut to its `inter` slice, and the whole router (replicated)."""
    with torch.device("meta"):
        moe = SparseMoE(a.hidden, inter.stop - inter.start, a.experts, a.top_k, norm_topk_prob=True)
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
    """This rank's pairs (those of experts first.. first + len) through its whole experts, summed over the ranks."""
    ids, weights = router.route(x)
    local = ids - first
    rows, k = ((local >= 0) & (local < moe.experts.gate_proj.shape[0])).nonzero(as_tuple=True)
    pairs = SimpleNamespace(experts=moe.experts, top_k=1)  # each pair a row of one expert
    path = expert_path(x.device.type, x.dtype, device_capability(x.device), len(rows), len(moe.experts.gate_proj))
    done = getattr(SparseMoE, path)(pairs, x[rows], local[rows, k][:, None], weights[rows, k][:, None])
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    out = out.index_add_(0, rows, done.to(out.dtype)).to(x.dtype)
    dist.all_reduce(out)
    return out


def schemes(a, dtype, device) -> tuple:
    """({name: the layer's forward on this rank}: split and expert parallel, the split layer (its router is the
    whole router))."""
    n, r = tp.world_size(), tp.rank()
    share, experts = a.inter // n, a.experts // n
    split = layer(range(a.experts), slice(r * share, (r + 1) * share), a, dtype, device)
    own = layer(range(r * experts, (r + 1) * experts), slice(0, a.inter), a, dtype, device)
    return dict(split=lambda x: split_forward(split, x),
                expert_parallel=lambda x: expert_parallel_forward(own, split, r * experts, x)), split


def rows_of(a, count: int, dtype, device):
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


def timed_ms(forward, x, device, iters: int) -> float:
    """The slowest rank's median milliseconds of `forward` (after 3 untimed calls)."""
    times = []
    for i in range(3 + iters):
        sync(device)
        t0 = time.perf_counter()
        forward(x)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * tp.slowest(statistics.median(times[3:]), device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check(a) -> float:
    """The largest difference, over the row counts, between each scheme and the whole layer on one rank (float64)."""
    device = torch.device("cpu")
    forwards, _ = schemes(a, torch.float64, device)
    whole = layer(range(a.experts), slice(0, a.inter), a, torch.float64, device)
    worst = 0.0
    for count in a.rows:
        x = rows_of(a, count, torch.float64, device)
        reference = whole(x)
        for forward in forwards.values():
            worst = max(worst, (forward(x) - reference).abs().max().item())
    return worst


def measure(a):
    device = tp.setup(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    forwards, router = schemes(a, dtype, device)
    print(f"{tp.world_size()} ranks, hidden {a.hidden}, {a.experts} experts of {a.inter}, top-{a.top_k}, {dtype}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print(f"{'rows':>5} {'pairs':>6} {'split MB':>9} {'EP MB':>9} {'split ms':>9} {'EP ms':>9}")
    for count in a.rows:
        x = rows_of(a, count, dtype, device)
        reads = busiest_reads(router, x, a, x.element_size())
        ms = {name: timed_ms(forward, x, device, a.iters) for name, forward in forwards.items()}
        print(f"{count:5d} {count * a.top_k:6d} {reads['split'] / 1e6:9.1f} {reads['expert_parallel'] / 1e6:9.1f} "
              f"{ms['split']:9.3f} {ms['expert_parallel']:9.3f}")


def parse(argv=None):
    p = one_line_errors(argparse.ArgumentParser(description=__doc__,
                                                formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--inter", type=int, default=1024, help="each expert's intermediate size")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rows", type=int, nargs="+", default=[65, 129, 257, 513], help="a verify's rows: budget + 1")
    p.add_argument("--iters", type=int, default=20, help="timed calls per scheme and row count")
    p.add_argument("--check", action="store_true", help="both schemes against the whole layer, small and float64")
    a = p.parse_args(argv)
    if a.check:
        a.hidden, a.experts, a.inter, a.top_k, a.rows = 32, 8, 16, 2, [2, 9]  # few pairs, then many
    if not tp.enabled():
        raise ValueError("run it under torchrun with 2 ranks or more (torchrun --nproc-per-node N ...)")
    for name in ("experts", "inter"):
        if getattr(a, name) % tp.world_size():
            raise ValueError(f"--{name} ({getattr(a, name)}) does not split over {tp.world_size()} ranks")
    if not 0 < a.top_k <= a.experts or min(a.rows) < 1 or a.hidden < 1 or a.iters < 1:
        raise ValueError("--top-k must be in 1..experts; --rows, --hidden and --iters positive")
    return a


def main(argv=None) -> int:
    tp.quiet_other_ranks()
    try:
        a = parse(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not a.check:
        measure(a)
        return 0
    tp.setup(torch.device("cpu"))
    worst = check(a)
    if worst > 1e-12:
        print(f"error: a scheme differs from the whole layer by {worst:.3g}", file=sys.stderr)
        return 1
    print(f"both schemes give the whole layer (largest difference {worst:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
