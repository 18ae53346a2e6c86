"""DFlash 2 (z-lab's `DFlash2DraftModel`; docs/checkpoints.md, "DFlash 2"): a DFlash drafter family, applied on top
of the dense core. DFlashDrafter.from_pretrained hands a DFlash 2 checkpoint over to this module, which nothing
else imports, so a DFlash 1 run never reads it.

DFlash 2 keeps DFlash 1's block drafter and adds two things: in every layer a grouped dynamic causal convolution
over the block's rows around the attention and around the MLP (DFlash2Block), and a candidate selector: the
drafter's top-K tokens per position, scored with a low-rank term of the token before them, so that a position's law
depends on its predecessor. A draft is then a Lattice, not per-position logits, and the round's tree stage cuts it
through the drafter's hook (DFlash2Drafter.propose and .chain, which Engine.propose and Engine.chain call for a
draft that is not a tensor): DDTree's best tree of the lattice (build_lattice_tree_heap eager, build_lattice_tree
compiled), or the selector's chain (walk_lattice). docs/round.md, "DFlash 2", walks through it.
"""

import heapq
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from draft_tree import beyond_room, build_tree, f32, order_key, ordered_tree, ranked_topk, within_room
from drafter import DFlashConfig, DFlashDrafter
from loading import dflash_setting, positive
from model import Block, Linear, Qwen3Config
from sampler import sample, tempered


@dataclass
class DFlash2Config(DFlashConfig):
    """DFlashConfig and DFlash 2's own fields: the convolutions' kernel and group sizes, the selector's rank and
    candidates per position."""
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "DFlash2Config":
        """A DFlash 2 drafter's config.json: DFlash 1's fields (DFlashConfig.from_dict), then DFlash 2's, checked."""
        one = DFlashConfig.from_dict(d, where)
        two = {k: positive(where, {k: dflash_setting(d, k)}, k) if dflash_setting(d, k) is not None else
               missing_field(where, f"dflash_config.{k}")
               for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
        if one.model.hidden_size % two["conv_group_size"]:
            raise ValueError(f"{where}: hidden_size={one.model.hidden_size} is not a multiple of conv_group_size="
                             f"{two['conv_group_size']}")
        if two["conv_kernel_size"] > one.block_size + 1:  # its taps reach back over the block's rows only
            raise ValueError(f"{where}: conv_kernel_size={two['conv_kernel_size']} is larger than block_size + 1 = "
                             f"{one.block_size + 1} (a tap past the block's first row)")
        return cls(**vars(one), **two)


def missing_field(where: str, name: str):
    raise ValueError(f"{where}: a DFlash2DraftModel needs {name}")


# ----------------------------------------------------------------------------------------------------------------
# The drafter: convolutions around each layer's attention and MLP, and the candidate selector


def grouped_dynamic_conv(x, dynamic, base, group: int):
    """out[t] = sum_{o < K} (base[o] + dynamic[t, o, g]) * x[t - o] over the rows t of each request's block
    (x[t - o] = 0 before the block's first row: the context is never convolved). x [N, T, C]; dynamic
    [N, T, K, C / group] (one correction per group g of `group` channels, from the row's own input); base [K, C]."""
    N, T, C = x.shape
    K, groups = base.shape[0], C // group
    blocks = x.view(N, T, groups, group)
    out = torch.zeros_like(blocks)
    for o in range(K):
        shifted = blocks if o == 0 else F.pad(blocks[:, :T - o], (0, 0, 0, 0, o, 0))
        out = out + (base[o].view(groups, group) + dynamic[:, :, o, :, None]) * shifted
    return out.view(N, T, C)


class GroupedDynamicConv(nn.Module):
    """DFlash 2's convolution around a sublayer: the sublayer's normed input h gives, through one projection, the
    per-group corrections of two kernels (`prepare`: the first convolves h before the sublayer; `finish`: the
    second convolves the sublayer's output with the corrections computed from h)."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.empty(2, kernel, hidden))
        self.kernel_projection = Linear(hidden, 2 * kernel * (hidden // group))

    def prepare(self, h):
        dynamic = self.kernel_projection(h).view(*h.shape[:-1], 2, self.kernel, h.shape[-1] // self.group)
        return grouped_dynamic_conv(h, dynamic[:, :, 0], self.base_kernel[0], self.group), dynamic[:, :, 1]

    def finish(self, out, dynamic):
        return grouped_dynamic_conv(out, dynamic, self.base_kernel[1], self.group)


class DFlash2Block(Block):
    """A DFlash 2 drafter layer: a Qwen3 layer whose attention and MLP each sit between the two kernels of a
    GroupedDynamicConv."""

    def __init__(self, c: Qwen3Config, kernel: int, group: int):
        super().__init__(c)
        self.attention_conv = GroupedDynamicConv(c.hidden_size, kernel, group)
        self.mlp_conv = GroupedDynamicConv(c.hidden_size, kernel, group)

    def forward(self, x, cos, sin, cache_pos, mask, recurrent=None):
        h, dynamic = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, cache_pos, mask), dynamic)
        h, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), dynamic)


@dataclass
class Lattice:
    """A DFlash 2 draft: at each of L positions K candidate tokens, and their scores after each candidate of the
    position before (the layered graph a tree is cut from; CandidateSelector).

    tokens [N, L, K] (distinct per position); scores [N, L, K, K]: scores[n, d, p, c] scores candidate c
    of position d after candidate p of position d - 1 (position 0 follows the anchor, the round's bonus: its K
    rows are equal and row 0 is the one read), in float32 (float64 for a float64 drafter). The draft law of position
    d after p is softmax(scores[n, d, p])."""
    tokens: torch.Tensor
    scores: torch.Tensor

    def clone(self) -> "Lattice":
        return Lattice(self.tokens.clone(), self.scores.clone())


class CandidateSelector(nn.Module):
    """DFlash 2's selector: the drafter's top-K tokens at each draft position, each scored by its logit plus a
    low-rank term coupling it to the token before it, (P[prev] * W h) . S[token], with P, S the predecessor and
    successor codebooks (published without `.weight`: CODEBOOK_ALIASES) and h the drafter's output at the
    position."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = Linear(hidden, rank)

    def lattice(self, hidden, logits, anchor) -> Lattice:
        """hidden [N, L, H], logits [N, L, V] (float32, or float64) of the L draft positions, anchor [N] (the
        bonus, the token before position 0) -> the Lattice of candidates [N, L, K] (logit order) and scores
        [N, L, K, K]: row p of position d scores the candidates after candidate p of position d - 1 (after the
        anchor for d = 0, whose K rows are equal)."""
        K = min(self.top_k, logits.shape[-1])
        unary, tokens = logits.topk(K, dim=-1)
        before = torch.cat([anchor[:, None, None].expand(-1, 1, K), tokens[:, :-1]], dim=1)  # [N, L, K]
        return Lattice(tokens, self.scores(hidden, before, tokens, unary))

    def scores(self, hidden, before, tokens, unary):
        """The selector's scores [..., P, K] of candidates tokens [..., K] (logits `unary` [..., K]) after each
        of the tokens before [..., P], at positions of drafter outputs hidden [..., H], in the logits' dtype."""
        f = unary.dtype
        h = self.hidden_projection(hidden).to(f)[..., None, :]  # [..., 1, r]
        pred = self.predecessor_codebook[before].to(f) * h  # [..., P, r]
        succ = self.successor_codebook[tokens].to(f)  # [..., K, r]
        return unary[..., None, :] + pred @ succ.transpose(-1, -2)


# z-lab publishes the codebooks without `.weight`, and its package's save_pretrained writes them with it (its
# modules are nn.Embeddings); the package reads both, and so do we.
CODEBOOK_ALIASES = {f"candidate_selector.{name}.weight": f"candidate_selector.{name}"
                    for name in ("predecessor_codebook", "successor_codebook")}


class DFlash2Drafter(DFlashDrafter):
    """A DFlash 2 drafter: DFlashDrafter with DFlash2Blocks for layers and a CandidateSelector; its drafts are
    Lattices, which its propose and chain cut for the engine's round."""
    config_type = DFlash2Config
    weight_aliases = CODEBOOK_ALIASES

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        c = config.model
        self.layers = nn.ModuleList(DFlash2Block(c, config.conv_kernel_size, config.conv_group_size)
                                    for _ in range(c.num_hidden_layers))
        for i, layer in enumerate(self.layers):  # which of draft()'s masks each layer takes
            layer.mask_kind = config.attention_of(i)
        self.candidate_selector = CandidateSelector(c.vocab_size, c.hidden_size, config.selector_rank,
                                                    config.selector_top_k)
        for name in ("fc", "hidden_norm", "norm"):  # after the selector, z-lab's order, which a seeded init follows
            self._modules[name] = self._modules.pop(name)
        self.candidates_per_depth = config.selector_top_k

    def draft(self, bonus, start, masks: dict, denoise_steps: int = 1, length: int | None = None) -> Lattice:
        """DFlashDrafter.draft's one pass, its hidden states and logits made the selector's Lattice. Several
        denoising passes are DFlash 1's alone: the selector scores one pass's outputs."""
        if denoise_steps != 1:
            raise ValueError("denoise_steps > 1 is not supported for DFlash 2 drafters")
        tokens, pos = self.block(bonus, start)
        hidden = self(tokens, pos, pos, masks, rows=slice(1, 1 + (length or self.block_size - 1)))
        return self.candidate_selector.lattice(hidden, self.logits(hidden), bonus)

    def propose(self, engine, lattice: Lattice, draft_noise, room):
        """Engine.propose for a lattice: its best tree (its laws tempered by draft_temperature; the tensor builder
        where the engine builds with draft_tree.build_tree, else the heap), or the selector's chain: greedy, or
        sampled at the target's temperature with q over its candidates."""
        if engine.method == "ddtree":
            logq = torch.log_softmax(tempered(lattice.scores, engine.spec.draft_temperature), dim=-1)
            build = build_lattice_tree if engine.build_tree is build_tree else build_lattice_tree_heap
            return (*within_room(*build(lattice.tokens, beyond_room(logq, room), engine.tree_size), room), None)
        n = lattice.tokens.shape[0]
        chain_parents = torch.arange(engine.draft_len, device=lattice.tokens.device).expand(n, -1)
        temperature = engine.sampling.temperature if engine.spec.draft_sampling else 0.0
        tokens, q = walk_lattice(lattice, engine.draft_len, engine.target.config.vocab_size, temperature,
                                 draft_noise)
        return (*within_room(tokens, chain_parents, chain_parents + 1, room), q)

    def chain(self, lattice: Lattice):
        """The selector's greedy chain over every position of the lattice (Engine.chain: budget auto's tally)."""
        return walk_lattice(lattice, lattice.tokens.shape[1], self.config.model.vocab_size)[0]


# ----------------------------------------------------------------------------------------------------------------
# Trees over a lattice: where a position's law depends on the token before it


def build_lattice_tree_heap(tokens: torch.Tensor, logq: torch.Tensor, budget: int):
    """Algorithm 1 over a lattice: the best-first heap of draft_tree.build_tree_heap, where a node's children are
    ranked by the law after its own token (its candidate index, its "state"). tokens [L, K] or [N, L, K], logq
    [L, K, K] or [N, L, K, K] (log-laws: log_softmax of Lattice.scores); output as build_tree_heap's.

    Why it is the best tree: the expected acceptance length of a tree is still the sum of its nodes' prefix
    probabilities (Prop. 1 of the paper needs only that a node is accepted iff its prefix is), so the best tree is
    the `budget` most probable prefixes, and they are prefix-closed since a child's probability is its parent's
    times a factor <= 1. The heap pops prefixes in the global order of docs/lossless.md, "Two builders, one order"
    (a child never before its parent, nor a sibling before its elder sibling, as log-laws are <= 0 and rounding is
    monotone)."""
    assert budget >= 1
    if tokens.dim() == 3:
        return tuple(torch.stack(t) for t in zip(*(build_lattice_tree_heap(a, b, budget)
                                                     for a, b in zip(tokens, logq))))
    L, K = tokens.shape
    topv, topc = (t.tolist() for t in ranked_topk(logq, K))
    toks = tokens.tolist()
    out_tokens, parents, depths = [0] * budget, [-1] * budget, [0] * budget
    # Heap items: the order key (-score, depth, parent's row, rank), then the parent's score and state.
    heap = [(-f32(0.0 + topv[0][0][0]), 1, 0, 0, 0.0, 0)]
    n = 0
    while n < budget and heap:
        neg_score, d, parent_row, r, parent_score, parent_state = heapq.heappop(heap)
        state = topc[d - 1][parent_state][r]
        out_tokens[n], parents[n], depths[n] = toks[d - 1][state], parent_row, d
        n += 1  # this node is row n
        if r + 1 < K:  # next sibling
            s = f32(parent_score + topv[d - 1][parent_state][r + 1])
            heapq.heappush(heap, (-s, d, parent_row, r + 1, parent_score, parent_state))
        if d < L:  # first child, ranked by the law after this node's token
            s = f32(-neg_score + topv[d][state][0])
            heapq.heappush(heap, (-s, d + 1, n, 0, -neg_score, state))
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=tokens.device)
    return as_tensor(out_tokens), as_tensor(parents), as_tensor(depths)


def build_lattice_tree(tokens: torch.Tensor, logq: torch.Tensor, budget: int):
    """build_lattice_tree_heap's exact output from tensor ops: fixed shapes, no host sync (draft_tree.build_tree's
    method).

    Depth by depth, the kept prefixes of the previous depth (the frontier, in key order) each offer their K
    children, ranked by the law after the prefix's last token; the best of them are kept, then the global best
    `budget` of all kept prefixes are taken. Exact for the reason build_tree is: the answer G is a down-set of the
    order, and a depth's part of G (at most budget - D + 1 nodes: each has its D - 1 ancestors in G) is among the
    depth's best budget - D + 1 candidates. Every child of the frontier is a candidate: build_tree's bound does not
    hold here, as a child's log-law depends on its parent's token (a child of an earlier parent need not score
    higher), so a depth has at most budget * K candidates."""
    if tokens.dim() == 2:
        return tuple(t.squeeze(0) for t in build_lattice_tree(tokens.unsqueeze(0), logq.unsqueeze(0), budget))
    assert budget >= 1 and budget * tokens.shape[-1] < 2**31  # tie-breaks must fit order_key
    batch, L, K = tokens.shape
    dev = tokens.device
    topv, topc = ranked_topk(logq, K)  # [N, L, K (predecessor), K (rank)]
    score = torch.zeros(batch, 1, device=dev)
    state = torch.zeros(batch, 1, dtype=torch.int64, device=dev)  # the root's predecessor row: the anchor's
    scores, ties, toks, parent_idx, depth_of = [], [], [], [], []
    prev_offset, offset = 0, 1
    for d in range(L):
        depth = d + 1
        limit = budget - depth
        if limit < 0:
            break
        F = score.shape[-1]
        pairs = torch.arange(F * K, device=dev)  # pi-major pairs (pi, k)
        parent, child = pairs // K, pairs % K
        ranked = lambda t: t[:, d].gather(1, state[..., None].expand(-1, -1, K)).reshape(batch, F * K)
        cand = score[:, parent] + ranked(topv)
        key = order_key(cand, parent * K + child)
        n = min(limit + 1, F * K)
        keep = key.topk(n, dim=-1).indices  # best first: the next frontier, in key order
        score = cand.gather(-1, keep)
        state = ranked(topc).gather(-1, keep)
        scores.append(score)
        ties.append(offset + torch.arange(n, device=dev))
        toks.append(tokens[:, d].gather(-1, state))
        parent_idx.append(prev_offset + parent[keep])
        depth_of.append(torch.full((n,), depth, device=dev))
        prev_offset, offset = offset, offset + n
    return ordered_tree(scores, ties, toks, parent_idx, depth_of, budget)


def walk_lattice(lattice: Lattice, length: int, vocab: int, temperature: float = 0.0, noise=None):
    """The selector's chain over the first `length` positions: from the anchor, each position's candidate after
    the one before, the argmax of its scores (temperature 0; the first of equal scores) or a draw from
    softmax(scores / temperature) with one uniform of noise [N, length] per position (sampler.sample).
    Returns (tokens [N, length], q [N, length, V]: the law each draft was drawn from, over the vocabulary, in the
    scores' dtype, for the min(1, p/q) rule; None when greedy), V being `vocab`."""
    n = lattice.tokens.shape[0]
    state = torch.zeros(n, 1, dtype=torch.int64, device=lattice.tokens.device)
    tokens, laws = [], []
    for d in range(length):
        scores = lattice.scores[:, d].gather(1, state[..., None].expand(-1, 1, lattice.scores.shape[-1]))[:, 0]
        if temperature > 0:
            law = torch.softmax(scores / temperature, dim=-1)
            state = sample(law, noise[:, d])[:, None]
            laws.append(law.new_zeros(n, vocab).scatter(-1, lattice.tokens[:, d], law))  # the scores' dtype
        else:
            state = scores.argmax(-1, keepdim=True)
        tokens.append(lattice.tokens[:, d].gather(1, state))
    return torch.cat(tokens, 1), (torch.stack(laws, 1) if laws else None)
