"""The Qwen3-MoE family (Qwen3-Coder-30B-A3B and kin; the MLP of Qwen3.5-MoE too): its config fields, the sparse MLP
that families.py swaps into the sparse layers of a dense Qwen3 after it is built, routing, and three ways for rows to
meet their experts, chosen per compiled graph from shapes and the device alone."""

import itertools
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loading import positive
from model import MLP, Linear


# What transformers 5.24 takes when config.json has no head_dim (None: hidden_size / num_attention_heads, as
# Qwen3-MoE's attention reads an absent one) / num_key_value_heads.
DEFAULTS = dict(head_dim=None, num_key_value_heads=4)


@dataclass
class MoEConfig:
    """Layer i is sparse iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; its MLP routes each
    row to num_experts_per_tok of num_experts experts of width moe_intermediate_size (dense layers keep the
    intermediate_size MLP). A Qwen3.5-MoE MLP adds a shared expert of shared_expert_intermediate_size."""
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    shared_expert_intermediate_size: int = 0

    def sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def moe_fields(d: dict, where: str) -> dict:
    """The Qwen3-MoE fields of a config: transformers 4.x writes num_experts, 5.x num_local_experts."""
    key = "num_experts" if "num_experts" in d else "num_local_experts"
    experts = positive(where, d, key)
    top_k = positive(where, d, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok={top_k} exceeds {key}={experts}")
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"{where}: mlp_only_layers must be a list of layer indices, got {only!r}")
    if not isinstance(d.get("norm_topk_prob", False), bool):
        raise ValueError(f"{where}: norm_topk_prob must be true or false, got {d['norm_topk_prob']!r}")
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=positive(where, d, "moe_intermediate_size"),
                norm_topk_prob=d.get("norm_topk_prob", False),
                decoder_sparse_step=positive(where, d, "decoder_sparse_step", default=1),
                mlp_only_layers=tuple(only))


def qwen3_5_moe_fields(d: dict, where: str) -> dict:
    """Qwen3.5-MoE: every layer sparse, top-k always renormalized, plus a shared expert gated by
    sigmoid(shared_expert_gate(x)). transformers ignores decoder_sparse_step, mlp_only_layers and norm_topk_prob
    here; a file that sets them to something else is refused rather than guessed at."""
    if d.get("decoder_sparse_step", 1) != 1 or d.get("mlp_only_layers") or d.get("norm_topk_prob", True) is not True:
        raise ValueError(f"{where}: decoder_sparse_step / mlp_only_layers / norm_topk_prob other than 1 / [] / true "
                         f"are not supported for qwen3_5_moe (transformers ignores them: every layer is sparse, "
                         f"top-k renormalized)")
    fields = moe_fields(dict(d, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]), where)
    fields["shared_expert_intermediate_size"] = positive(where, d, "shared_expert_intermediate_size", default=512)
    return fields


def apply(model, c: MoEConfig):
    """The sparse MLP in place of the dense one in each sparse layer of a target built on meta, and the loader's
    hook for the experts' checkpoint names."""
    model.checkpoint_places = checkpoint_places
    hidden = model.config.hidden_size
    for i, layer in enumerate(model.layers):
        if c.sparse(i):
            layer.mlp = SparseMoE(hidden, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                                  c.norm_topk_prob, shared_inter=c.shared_expert_intermediate_size)


EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d{1,18})\.(gate_proj|up_proj|down_proj)\.weight$")
FUSED_GATE_UP = re.compile(r"^(.*\.experts)\.gate_up_proj$")


def checkpoint_places(names: dict, wanted: dict, path: str) -> tuple:
    """The loader's hook (loading.place_tensors) for stacked [E, out, in] expert weights: ({name: (places, shape,
    covers) as loading.tensor_place gives them} of each per-expert tensor (its expert's slice) and each fused
    experts.gate_up_proj [E, 2I, H] (gate: the first I rows; up: the rest), and a function giving the stacked
    weights whose every expert is given, else raising). names: {name, prefix stripped: (file, name as stored)}."""
    places, read = {}, {}
    for name, (file, key) in names.items():
        fused, expert = FUSED_GATE_UP.match(name), EXPERT_TENSOR.match(name)
        if fused and f"{fused[1]}.gate_proj" in wanted:
            gate, up = f"{fused[1]}.gate_proj", f"{fused[1]}.up_proj"
            E, inter, hidden = wanted[gate]
            halves = [(gate, None, (slice(None), slice(0, inter))), (up, None, (slice(None), slice(inter, None)))]
            places[name] = halves, (E, 2 * inter, hidden), (gate, up)
        elif expert and f"{expert[1]}.{expert[3]}" in wanted:  # slice e of layers.{i}.mlp.experts.{proj}
            stacked, index = f"{expert[1]}.{expert[3]}", int(expert[2])
            if index >= wanted[stacked][0]:
                raise ValueError(f"{file}: tensor {key!r} names expert {index}, config.json has "
                                 f"{wanted[stacked][0]} experts")
            places[name] = [(stacked, index, None)], wanted[stacked][1:], (f"expert {index} of {stacked}",)
            read.setdefault(stacked, set()).add(index)

    def complete() -> set:  # called once every tensor's shape is checked: a shape error is the clearer one
        for stacked, indices in read.items():
            count = wanted[stacked][0]
            if len(indices) < count:
                absent = list(itertools.islice((i for i in range(count) if i not in indices), 8))
                raise ValueError(f"{path}: checkpoint lacks experts {absent} of {stacked} ({count - len(indices)} "
                                 f"of {count})")
        return set(read)
    return places, complete


class SparseMoE(nn.Module):
    """Qwen3-MoE's MLP: a router picks num_experts_per_tok SwiGLU experts per row (softmax in float32, top-k,
    optionally renormalized), and the row's output is their routing-weighted sum. The experts' weights are stacked,
    one [experts, out, in] tensor per projection (the loader fills them expert by expert from the per-expert
    tensors of the checkpoint). Qwen3.5-MoE (shared_inter > 0) adds a shared SwiGLU expert that every row goes
    through, scaled by sigmoid(shared_expert_gate(x)).

    How rows meet their experts depends only on shapes, so it is fixed per compiled graph:
    - grouped GEMM (torch._grouped_mm: bf16 on CUDA sm90 / sm100): the (row, expert) pairs sorted by expert, two grouped
      matmuls over the stacked weights; no weight is copied, each touched expert is read once;
    - few pairs (rows x top-k <= experts: a decode step, a small verify): each pair's expert weights gathered, so
      only the chosen experts are read;
    - otherwise (a large verify or prefill on the CPU): every expert over every row, weighted by the routing
      (zero where not chosen): each expert read once, at experts / top-k times the arithmetic of the pairs.
    """

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, norm_topk_prob: bool, shared_inter: int = 0):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(hidden, experts)  # the router
        self.experts = nn.Module()
        self.experts.gate_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.experts.up_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.experts.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        if shared_inter:  # Qwen3.5-MoE: a shared SwiGLU expert for every row, scaled by sigmoid(shared_expert_gate(x))
            self.shared_expert = MLP(hidden, shared_inter)
            self.shared_expert_gate = Linear(hidden, 1)

    def route(self, x):
        """(expert ids [R, top_k], weights [R, top_k] in x's dtype), as Qwen3-MoE routes."""
        probs = self.gate(x).float().softmax(-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])  # rows of any leading shape (training runs batches)
        ids, weights = self.route(x)
        path = expert_path(x.device.type, x.dtype, device_capability(x.device), x.shape[0] * self.top_k,
                           self.experts.gate_proj.shape[0])
        out = getattr(self, path)(x, ids, weights)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)

    def gathered(self, x, ids, weights):
        e = self.experts
        flat = ids.reshape(-1)
        xr = x.repeat_interleave(self.top_k, dim=0)  # [R * k, H], pair j = (row j // k, its j % k-th expert)
        h = F.silu(torch.einsum("ph,pih->pi", xr, e.gate_proj[flat])) * torch.einsum("ph,pih->pi", xr, e.up_proj[flat])
        out = torch.einsum("pi,phi->ph", h, e.down_proj[flat]) * weights.reshape(-1, 1)
        return out.view(x.shape[0], self.top_k, -1).to(torch.promote_types(x.dtype, torch.float32)).sum(1).to(x.dtype)

    def all_experts(self, x, ids, weights):
        e = self.experts
        h = F.silu(torch.einsum("rh,eih->rei", x, e.gate_proj)) * torch.einsum("rh,eih->rei", x, e.up_proj)
        out = torch.einsum("rei,ehi->reh", h, e.down_proj)  # [R, experts, H]
        dense_weights = torch.zeros(out.shape[:2], dtype=x.dtype, device=x.device).scatter(1, ids, weights)
        return (out * dense_weights[..., None]).sum(1)

    def grouped(self, x, ids, weights):
        e = self.experts
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # pairs grouped by expert
        rows = order // self.top_k
        counts = torch.zeros(e.gate_proj.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        xs = x[rows]
        h = F.silu(torch._grouped_mm(xs, e.gate_proj.transpose(1, 2), offs=offs)) * \
            torch._grouped_mm(xs, e.up_proj.transpose(1, 2), offs=offs)
        out = torch._grouped_mm(h, e.down_proj.transpose(1, 2), offs=offs) * weights.reshape(-1)[order, None]
        return combine_pairs(out, order, x.shape[0], self.top_k).to(x.dtype)


def combine_pairs(out, order, rows: int, top_k: int):
    """Row sums [rows, H] (float32) of pair outputs sorted by expert (out [rows * top_k, H], order: the sort):
    the pairs go back to row order, then each row's top_k are summed in a fixed order, in float32. An index_add_
    into the rows would sum them with atomics on CUDA, in whatever order the threads arrive: bits that change
    from run to run."""
    pairs = torch.empty_like(out)
    pairs[order] = out  # a permutation: every slot written once
    return pairs.view(rows, top_k, -1).to(torch.promote_types(out.dtype, torch.float32)).sum(1)


def expert_path(device_type: str, dtype, capability, pairs: int, experts: int) -> str:
    """Which SparseMoE path serves a forward of `pairs` (row, expert) pairs. torch._grouped_mm in bf16 on CUDA
    has its fast kernels on sm90 and sm100 only; elsewhere (an A100: sm80) it loops over the groups with a
    device-to-host sync, which breaks CUDA graph capture (pytorch/pytorch#186620). Then, and off CUDA, few pairs
    gather their experts' weights and many run every expert."""
    if hasattr(torch, "_grouped_mm") and device_type == "cuda" and dtype == torch.bfloat16 and \
            capability is not None and capability[0] in (9, 10):
        return "grouped"
    return "gathered" if pairs <= experts else "all_experts"


@torch.compiler.assume_constant_result
def device_capability(device) -> tuple | None:
    """A CUDA device's compute capability (None off CUDA), a constant inside compiled graphs."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def grouped_mm_supported(x) -> bool:
    """Whether SparseMoE takes the grouped-GEMM path for rows like x (expert_path)."""
    return expert_path(x.device.type, x.dtype, device_capability(x.device), 1, 0) == "grouped"
