"""Tensor parallel over torch.distributed ranks, for targets that no single device holds (docs/tp.md).

    torchrun --nproc-per-node 8 ddtree.py --target Qwen/Qwen3.5-122B-A10B --draft z-lab/Qwen3.5-122B-A10B-DFlash ...
    python tp.py --nproc-per-node 8 ddtree.py ...    # the same launch, ending as one process does (launch())

Launched by torchrun (WORLD_SIZE > 1 in the environment), Qwen3.from_pretrained joins the process group through
families.parallel_device, the only importer of this module on the load path (gloo on the CPU, nccl on CUDA, one GPU
per local rank), and gives every rank its shard of the target, in the manner of gpt-fast's tp.py: the modules are
resized on the meta device before loading, each rank reads only its rows or columns of each tensor from the
safetensors files (slices, never the whole tensor), and a forward hook all-reduces each sublayer's output. The model
files keep their code; only sizes change:

- attention by heads: q_proj rows (Qwen3.5's gated q_proj keeps each head's query and gate, which are adjacent) and
  the o_proj columns of this rank's heads; k_proj / v_proj by KV head, or, with fewer KV heads than ranks, the one KV
  head this rank's query heads read (replicated on the ranks that share it);
- MLP (and a Qwen3.5-MoE shared expert) by the intermediate dimension; MoE experts likewise, every expert split
  (each rank holds every expert's slice of the intermediate dimension, the router is replicated);
- Gated DeltaNet by heads: this rank's key heads and the value heads they serve, i.e. its q, k and v segments of
  in_proj_qkv and of the conv channels, its rows of in_proj_z / in_proj_b / in_proj_a, its A_log and dt_bias, and
  its columns of out_proj;
- the embedding by vocabulary, each rank looking up the ids in its rows, the rows summed over the ranks (one
  all-reduce per forward; the drafter's forward embeds through the target's embedding: one more);
- the lm_head by the same rows (a tied lm_head is the embedding's own parameter), each rank's logits
  all-gathered, so every rank holds the same full logits and draws the same tokens from the same seeds; a greedy
  pick gathers only each rank's best logit and its index per row (VocabParallelHead.argmax);
- the norms and the drafter replicated.

A sublayer's output on a rank is a partial sum over its heads or intermediate slice: one all-reduce after each
attention / Gated DeltaNet and after each MLP / MoE (2 per layer per forward) makes it whole, plus one all-gather
of the logits per forward (the drafter's forward uses the target's lm_head: one more). The collectives are the
functional ones, which torch.compile traces into the round's graph.
"""

import atexit
import datetime
import functools
import gc
import os
import re
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F


def world_size() -> int:
    """The ranks torchrun started (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


# Set by a data-parallel run (scripts/bench.py datasets under torchrun): every rank holds the whole model and runs
# requests of its own, so nothing is sharded and no rank waits on another's collectives.
DATA_PARALLEL = False


def enabled() -> bool:
    """Whether this process is a rank of a tensor-parallel run: launched by torchrun with 2 ranks or more, not as
    data parallel."""
    return world_size() > 1 and not DATA_PARALLEL


# How long a collective waits for the other ranks before it fails (DDTREE_TP_TIMEOUT_S, seconds): a rank that
# fails or hangs ends the others' wait after this, not after the backend's 10 minutes. It covers the ranks'
# difference in compile time, since every rank compiles its own graphs before their first collective runs.
TIMEOUT_S = float(os.environ.get("DDTREE_TP_TIMEOUT_S", "300"))


def setup(device: torch.device) -> torch.device:
    """Join the process group once (gloo on the CPU, nccl on CUDA, bound to this rank's GPU at once through
    device_id) and give this rank its device: on CUDA the GPU of its local rank, whatever index was asked for. A
    no-op outside torchrun."""
    if not enabled():
        return device
    if device.type == "cuda":
        torch.cuda.set_device(local_rank())
        device = torch.device("cuda", local_rank())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=TIMEOUT_S),
                                device_id=device if device.type == "cuda" else None)
        atexit.register(leave)
    return device


def leave():
    """At exit: the compiled graphs go first (CUDA graphs that captured collectives hold the group's
    communicators), then the process group."""
    ddtree = sys.modules.get("ddtree")  # the engines' cache, where the process made any
    if ddtree is not None:
        ddtree._ENGINES.clear()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.destroy_process_group()


def quiet_other_ranks():
    """Every rank but rank 0 prints nothing on stdout (the command line's text and summary): all ranks compute the
    same tokens, and one copy is the output. Each keeps its stderr, so that a rank's own warning or error line
    (one rank failing alone, say) is seen."""
    if rank() != 0:
        sys.stdout = open(os.devnull, "w")


def same_on_every_rank(values: list) -> list:
    """Rank 0's `values` on every rank (fresh seeds: each rank must draw the same randomness). Outside torchrun no
    process group is initialized: that one check returns them as they are."""
    if not (dist.is_initialized() and enabled()):
        return values
    box = [values]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def slowest(seconds: float, device: torch.device) -> float:
    """The longest of the ranks' `seconds` on every rank: budget auto's timings, from which every rank must make
    the same choices (the ranks run the same collectives); one all-reduce of one number, after the round's host
    read has already waited for the round."""
    if not (dist.is_initialized() and enabled()):
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return t.item()


# ----------------------------------------------------------------------------------------------------------------
# Sharding the modules (on the meta device, before loading)


class Plan(dict):
    """{checkpoint tensor name (prefix stripped): (dim, full size along dim, [(start, stop), ...])}: the rows or
    columns of a tensor this rank reads, several ranges concatenated in order (a fused projection's segments)."""


def split(size: int, what: str) -> tuple[int, int]:
    """This rank's equal share [start, stop) of `size`; an uneven split is an error naming `what`."""
    n = world_size()
    if size % n:
        raise ValueError(f"tensor parallel: {what} ({size}) does not split over {n} ranks")
    share = size // n
    return rank() * share, (rank() + 1) * share


def resize(module: nn.Module, name: str, shape: tuple):
    """module.name becomes a meta parameter of `shape` (the loader fills it)."""
    setattr(module, name, nn.Parameter(torch.empty(shape, device="meta")))


def resize_linear(linear: nn.Module, out_features: int, in_features: int, parts: dict | None = None):
    resize(linear, "weight", (out_features, in_features))
    linear.out_features, linear.in_features = out_features, in_features
    if parts is not None:
        linear.parts = parts


def shard_attention(attn, prefix: str, plan: Plan):
    heads, kv, hd = attn.heads, attn.kv_heads, attn.head_dim
    n, r = world_size(), rank()
    if kv < n and n % kv:
        raise ValueError(f"tensor parallel: num_key_value_heads ({kv}) neither splits over {n} ranks nor divides "
                         f"them (ranks sharing a KV head)")
    q_start, q_stop = split(heads, "num_attention_heads")
    per_head = attn.q_rows // heads  # head_dim, or 2 x head_dim with Qwen3.5's gate (each head's query, then gate)
    local = q_stop - q_start
    kv_start, kv_stop = split(kv, "num_key_value_heads") if kv >= n else (r // (n // kv), r // (n // kv) + 1)
    plan[f"{prefix}.q_proj.weight"] = (0, heads * per_head, [(q_start * per_head, q_stop * per_head)])
    for name in ("k_proj", "v_proj"):
        plan[f"{prefix}.{name}.weight"] = (0, kv * hd, [(kv_start * hd, kv_stop * hd)])
    plan[f"{prefix}.o_proj.weight"] = (1, heads * hd, [(q_start * hd, q_stop * hd)])
    attn.heads, attn.kv_heads, attn.q_rows = local, kv_stop - kv_start, local * per_head
    kv_rows = attn.kv_heads * hd
    hidden = attn.qkv_proj.in_features
    resize_linear(attn.qkv_proj, attn.q_rows + 2 * kv_rows, hidden,
                  {"q_proj": attn.q_rows, "k_proj": kv_rows, "v_proj": kv_rows})
    resize_linear(attn.o_proj, hidden, local * hd)


def shard_gated_delta(m, prefix: str, plan: Plan):
    """Key heads with the value heads they serve (key head h serves value heads h * Hv / Hk ..): splitting both
    evenly keeps every local key head's value heads on its rank, in the same local order."""
    Hk, Hv, Dk, Dv = m.key_heads, m.value_heads, m.key_dim, m.value_dim
    k0, k1 = split(Hk, "linear_num_key_heads")
    v0, v1 = split(Hv, "linear_num_value_heads")
    segments = [(k0 * Dk, k1 * Dk), (Hk * Dk + k0 * Dk, Hk * Dk + k1 * Dk),
                (2 * Hk * Dk + v0 * Dv, 2 * Hk * Dk + v1 * Dv)]  # q, k, v of the fused projection and the conv
    channels = 2 * Hk * Dk + Hv * Dv
    plan[f"{prefix}.in_proj_qkv.weight"] = (0, channels, segments)
    plan[f"{prefix}.conv1d.weight"] = (0, channels, segments)
    plan[f"{prefix}.in_proj_z.weight"] = (0, Hv * Dv, [(v0 * Dv, v1 * Dv)])
    for name in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        plan[f"{prefix}.{name}"] = (0, Hv, [(v0, v1)])
    plan[f"{prefix}.out_proj.weight"] = (1, Hv * Dv, [(v0 * Dv, v1 * Dv)])
    hk, hv = k1 - k0, v1 - v0
    m.key_heads, m.value_heads, m.channels = hk, hv, 2 * hk * Dk + hv * Dv
    hidden = m.in_proj.in_features
    resize_linear(m.in_proj, m.channels + hv * Dv + 2 * hv, hidden,
                  {"in_proj_qkv": m.channels, "in_proj_z": hv * Dv, "in_proj_b": hv, "in_proj_a": hv})
    resize(m.conv1d, "weight", (m.channels, 1, m.kernel))
    resize(m, "dt_bias", (hv,))
    resize(m, "A_log", (hv,))
    resize_linear(m.out_proj, hidden, hv * Dv)


def shard_mlp(mlp, prefix: str, plan: Plan):
    inter = mlp.down_proj.in_features
    start, stop = split(inter, f"{prefix}: intermediate size")
    for name in ("gate_proj", "up_proj"):
        plan[f"{prefix}.{name}.weight"] = (0, inter, [(start, stop)])
    plan[f"{prefix}.down_proj.weight"] = (1, inter, [(start, stop)])
    hidden, local = mlp.down_proj.out_features, stop - start
    resize_linear(mlp.gate_up_proj, 2 * local, hidden, {"gate_proj": local, "up_proj": local})
    resize_linear(mlp.down_proj, hidden, local)


def shard_moe(moe, prefix: str, plan: Plan):
    """Every expert split by its intermediate dimension (not expert parallel: docs/tp.md says why); the router and
    the shared expert's gate replicated, the shared expert split as an MLP."""
    e = moe.experts
    experts, inter, hidden = e.gate_proj.shape
    start, stop = split(inter, f"{prefix}: moe_intermediate_size")
    for name in ("gate_proj", "up_proj"):
        plan[f"{prefix}.experts.{name}"] = (1, inter, [(start, stop)])
    plan[f"{prefix}.experts.down_proj"] = (2, inter, [(start, stop)])
    plan[f"{prefix}.experts.gate_up_proj"] = (1, 2 * inter, [(start, stop), (inter + start, inter + stop)])
    resize(e, "gate_proj", (experts, stop - start, hidden))
    resize(e, "up_proj", (experts, stop - start, hidden))
    resize(e, "down_proj", (experts, hidden, stop - start))
    if hasattr(moe, "shared_expert"):
        shard_mlp(moe.shared_expert, f"{prefix}.shared_expert", plan)


# The gathers' functional collective: torch 2.13 names it all_gather_single (all_gather_tensor warns there as
# deprecated); torch 2.11 has only all_gather_tensor.
all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def all_reduce_output(module, args, output):
    """A sublayer's partial output (this rank's heads or intermediate slice) summed over the ranks."""
    return funcol.all_reduce(output, "sum", dist.group.WORLD)


def vocab_rows(vocab: int) -> tuple[int, int]:
    """This rank's rows [start, stop) of the vocabulary: shares of ceil(vocab / ranks), the last rank's shorter
    when the ranks do not divide it (the embedding and the lm_head take the same rows, so a tied head is the
    embedding's own parameter)."""
    share = -(-vocab // world_size())
    start = min(rank() * share, vocab)
    return start, min(start + share, vocab)


class VocabParallelEmbedding(nn.Module):
    """The embedding by vocabulary: this rank's rows (vocab_rows). A rank looks up the ids in its rows and gives
    zeros for the others; the all-reduce sums the ranks' rows, exactly (each id's row comes from one rank, the
    others add zeros)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab_rows = vocab_rows(vocab)
        self.weight = nn.Parameter(torch.empty(self.vocab_rows[1] - self.vocab_rows[0], hidden, device="meta"))

    def forward(self, ids):
        start, stop = self.vocab_rows
        here = (ids >= start) & (ids < stop)
        local = torch.where(here, ids - start, 0)
        rows = F.embedding(local, self.weight) if stop > start else self.weight.new_zeros(*ids.shape,
                                                                                           self.weight.shape[1])
        return funcol.all_reduce(torch.where(here[..., None], rows, 0), "sum", dist.group.WORLD)


class VocabParallelHead(nn.Module):
    """The lm_head by vocabulary: this rank's rows of the vocabulary (vocab_rows). The forward all-gathers every
    rank's logits, so every rank returns the same full [..., vocab] logits (the last rank's share padded with zero
    logits for the gather and cut off after); argmax gathers only each rank's best logit and its index."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.vocab, self.share = vocab, -(-vocab // world_size())
        self.vocab_rows = vocab_rows(vocab)
        self.weight = nn.Parameter(torch.empty(self.vocab_rows[1] - self.vocab_rows[0], hidden, device="meta"))

    def forward(self, x):
        y = F.linear(x, self.weight)
        if y.shape[-1] < self.share:
            y = F.pad(y, (0, self.share - y.shape[-1]))
        # gathered along a leading dimension (the collective's own layout), then moved back last
        y = all_gather(y.movedim(-1, 0).contiguous(), 0, dist.group.WORLD)
        return y.movedim(0, -1)[..., :self.vocab]

    def argmax(self, x, dtype: torch.dtype):
        """(each row's argmax over the whole vocabulary [...] int64, whether all its logits are finite [...]) of
        the logits in `dtype`, as torch.argmax of the gathered logits gives it, ties to the lowest index included:
        each rank's argmax of its rows (the lowest of its tied indices), one all-gather of (value, global index,
        finite) per rank and row, and the first rank with the greatest value (the lowest global index among equal
        values, the ranks' rows being in order). A NaN is the greatest value, as torch.argmax takes it."""
        y = F.linear(x, self.weight).to(dtype)
        finite = torch.isfinite(y).all(-1)
        if y.shape[-1] < self.share:  # (an empty or short share: -inf never beats a logit of another rank)
            y = F.pad(y, (0, self.share - y.shape[-1]), value=-torch.inf)
        index = y.argmax(-1)
        value = y.gather(-1, index[..., None])[..., 0]
        # (an index is exact in float32 below 2^24, far above any vocabulary's size)
        best = torch.stack([value, (index + self.vocab_rows[0]).to(dtype), finite.to(dtype)])
        best = all_gather(best.contiguous(), 0, dist.group.WORLD).unflatten(0, (world_size(), 3))
        winner = best[:, 0].argmax(0, keepdim=True)
        return best[:, 1].gather(0, winner)[0].long(), best[:, 2].amin(0) > 0


def shard(model) -> Plan:
    """Resize a target built on the meta device to this rank's shard, hook the all-reduces, and return what to
    read of each checkpoint tensor (take). Sizes that do not split over the ranks are a ValueError."""
    plan = Plan()
    for i, block in enumerate(model.layers):
        prefix = f"layers.{i}"
        if hasattr(block, "linear_attn"):  # a hybrid's Gated DeltaNet layer
            shard_gated_delta(block.linear_attn, f"{prefix}.linear_attn", plan)
            mixer = block.linear_attn
        else:
            shard_attention(block.self_attn, f"{prefix}.self_attn", plan)
            mixer = block.self_attn
        if hasattr(block.mlp, "experts"):
            shard_moe(block.mlp, f"{prefix}.mlp", plan)
        else:
            shard_mlp(block.mlp, f"{prefix}.mlp", plan)
        for sublayer in (mixer, block.mlp):
            sublayer.register_forward_hook(all_reduce_output)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    model.embed_tokens = VocabParallelEmbedding(vocab, hidden)
    model.lm_head = VocabParallelHead(hidden, vocab)
    plan["embed_tokens.weight"] = (0, vocab, [model.embed_tokens.vocab_rows])
    plan["lm_head.weight"] = (0, vocab, [model.lm_head.vocab_rows])
    return plan


# ----------------------------------------------------------------------------------------------------------------
# Loading: each rank reads its slices


EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def taker(model):
    """take for loading.load_weights, of this rank's shard of `model` (built on meta: shard resizes it first)."""
    return functools.partial(take, shard(model))


def take(plan: Plan, name: str, stored) -> torch.Tensor:
    """This rank's part of the checkpoint tensor `name` from its safetensors slice `stored` (safe_open's
    get_slice, or a meta tensor of its shape): only those rows or columns are read. A tensor the plan does not name
    is replicated (read whole); one expert's tensor takes the plan of the stacked experts less their leading
    dimension."""
    spec, lead = plan.get(name), 0
    if spec is None:
        expert = EXPERT_TENSOR.match(name)
        if expert:
            spec, lead = plan.get(f"{expert[1]}.{expert[2]}"), 1
    if spec is None:
        return stored[:]
    dim, full, ranges = spec
    dim -= lead
    shape = list(stored.shape) if isinstance(stored, torch.Tensor) else stored.get_shape()  # meta: the header's
    if len(shape) <= dim or shape[dim] != full:
        raise ValueError(f"tensor {name!r} has shape {tuple(shape)}, config.json implies {full} along dimension "
                         f"{dim}")
    index = (slice(None),) * dim
    parts = [stored[index + (slice(a, b),)] for a, b in ranges]
    # safetensors may give a slice as a view of the whole tensor (mapped from the file, only the slice's bytes
    # touched): copied, the shard alone stays in memory.
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim)


# ----------------------------------------------------------------------------------------------------------------
# The launcher: torchrun's, ending as one process does


def launch(argv=None) -> int:
    """torchrun with its own flags (`python tp.py --nproc-per-node 8 ddtree.py ...`), ending as one process does:
    on Ctrl-C or SIGTERM, torchrun hands the signal to the ranks (rank 0 keeps the text it streamed and says where
    it stopped) and then raises its own SignalException, a traceback and exit status 1; here the exit status is
    130 or 143 (128 + the signal's number) and nothing more is printed. A rank that fails (an `error:` line, exit
    2) gives its own exit status instead of torchrun's failure report."""
    import logging
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    # Its notes on shutting the ranks down or on a rank's exit status: the ranks have said what the user needs.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run.main(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        # The first rank that exited by itself (the others may have been stopped by torchrun, a negative code:
        # the signal's number), as a shell reports it.
        codes = [failure.exitcode for _, failure in sorted(e.failures.items())]
        return next((c for c in codes if c > 0), 128 - codes[0])
    return 0


if __name__ == "__main__":
    sys.exit(launch())
