"""Draft-tree construction: the B most probable prefixes under the drafter's per-position log-laws logq [L, V].

DDTree (paper §4.2-4.3; docs/lossless.md, "The optimal tree"). Two builders with identical output, bit for bit,
as both follow one order of the prefixes (docs/lossless.md, "Two builders, one order", has the order and the proof):

    build_tree_heap  the paper's Algorithm 1, a best-first heap on the host: the readable reference
    build_tree       the same tree from fixed-shape tensor ops without host syncs: torch.compile / CUDA graphs

Output, for the verify input [bonus, node_1, ..., node_B] (row 0 is the bonus, the tree's root, not counted in the
budget; node i, 0-based, is row i + 1), in pop order so parents precede children: tokens (token ids), parents (row
of the parent, 0 = the root) and depths (1 for children of the root), [B] int64 each. When fewer than B prefixes
exist the tail is padding: token 0, parent -1, depth 0. logq [N, L, V] holds N requests: every output gains the
leading N, row n equal to the call on logq[n]. logq holds log-probabilities (<= 0, no NaN; -inf is fine).
"""

import heapq
import itertools
import math
import struct

import torch


def f32(x: float) -> float:
    """Round a Python float to float32. A float32 + float32 sum done in double and then rounded to float32 equals
    the float32 sum (double has more than 2 * 24 + 2 bits), so this reproduces the device's additions exactly."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # finite but past float32's range: float32 rounds it to infinity
        return math.copysign(math.inf, x)


def order_key(score: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    """One distinct int64 per entry, larger = earlier (score descending, then tie ascending): the tie folded into
    the value, as topk is not stable (docs/compile.md, "Unstable topk and sort"). 0 <= tie < 2**31, which Triton
    index expressions need (docs/compile.md, "No int32 overflow in Triton index expressions")."""
    bits = score.contiguous().view(torch.int32)
    # Non-negative floats order like their bits; a negative one is minus its magnitude bits (which also maps
    # -0.0 to 0, as the heap's float comparison has -0.0 == 0.0).
    mono = torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits).to(torch.int64)
    return mono * 2**32 + (2**31 - 1 - tie)


def ranked_topk(logq: torch.Tensor, k: int):
    """The k best entries of logq's last dim in rank order (value descending, index ascending): the top-K tokens
    of each depth (or a DFlash 2 lattice's candidates after each predecessor, dflash2.py). Returns
    (values [..., k] float32, indices [..., k] int64)."""
    logq = logq.float()
    idx = torch.arange(logq.shape[-1], device=logq.device)
    ids = order_key(logq, idx.expand_as(logq)).topk(k, dim=-1).indices
    return logq.gather(-1, ids), ids


def build_tree_heap(logq: torch.Tensor, budget: int):
    """Algorithm 1: best-first search over rank tuples with a heap, O(B log B) after the per-depth top-K.
    logq [L, V] or [N, L, V]: a batch is one heap per row."""
    assert budget >= 1
    if logq.dim() == 3:
        return tuple(torch.stack(t) for t in zip(*(build_tree_heap(row, budget) for row in logq)))
    L, V = logq.shape
    K = min(budget, V)
    topv, topi = (t.tolist() for t in ranked_topk(logq, K))
    tokens, parents, depths = [0] * budget, [-1] * budget, [0] * budget
    # Heap items: (-score, depth, parent's row, rank) is the order key (the parent's row is its place in the pop
    # order, and the four are unique, so the rest is never compared), then what the pushes need: the parent's
    # score (a sibling's score is parent_score + its own log-prob, the same addition build_tree does).
    heap = [(-f32(0.0 + topv[0][0]), 1, 0, 0, 0.0)]
    n = 0
    while n < budget and heap:
        neg_score, d, parent_row, r, parent_score = heapq.heappop(heap)
        tokens[n], parents[n], depths[n] = topi[d - 1][r], parent_row, d
        n += 1  # this node is row n
        if r + 1 < K:  # next sibling
            s = f32(parent_score + topv[d - 1][r + 1])
            heapq.heappush(heap, (-s, d, parent_row, r + 1, parent_score))
        if d < L:  # first child
            s = f32(-neg_score + topv[d][0])
            heapq.heappush(heap, (-s, d + 1, n, 0, -neg_score))
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=logq.device)
    return as_tensor(tokens), as_tensor(parents), as_tensor(depths)


def build_tree(logq: torch.Tensor, budget: int):
    """build_tree_heap's exact output from tensor ops: fixed shapes for a given (N, L, V, budget), no host sync.

    logq [L, V] or [N, L, V] (an unbatched call runs as N = 1). Depth by depth, keep the best children of the
    previous depth's kept prefixes, among the candidate pairs (frontier place pi, rank k) with pi * (k + 2) + k <=
    budget - 1; then take the global best `budget` of all kept prefixes. Why this is exact: docs/lossless.md,
    "Two builders, one order".
    """
    if logq.dim() == 2:
        return tuple(t.squeeze(0) for t in build_tree(logq.unsqueeze(0), budget))
    assert budget >= 1 and budget * min(budget, logq.shape[-1]) < 2**31  # tie-breaks must fit order_key
    batch, L, V = logq.shape
    K = min(budget, V)
    dev = logq.device
    topv, topi = ranked_topk(logq, K)

    # The frontier: the previous depth's kept prefixes in key order (best first), so a child's tie-break is
    # (its parent's position in the frontier, its rank). Depth 0 is the root alone, score 0.
    score = torch.zeros(batch, 1, device=dev)
    scores, ties, toks, parent_idx, depth_of = [], [], [], [], []
    prev_offset, offset = 0, 1  # index of the first kept prefix of a depth in the concatenation (0 = the root)
    all_parents, all_children, sizes = candidate_pairs(budget, K, budget - 1, dev)  # depth 1's bound
    for d in range(L):
        depth = d + 1
        limit = budget - depth
        if limit < 0:  # a node this deep needs more than `budget` nodes: no deeper depth can fit either
            break
        size = sizes[score.shape[-1]]  # the candidate pairs with pi < F
        parent, child = all_parents[:size], all_children[:size]
        cand = score[:, parent] + topv[:, d, child]
        n = min(limit + 1, size)
        keep = order_key(cand, parent * K + child).topk(n, dim=-1).indices  # best first: the next frontier
        score = cand.gather(-1, keep)
        scores.append(score)
        # Global tie-break: depth, then the place in this depth's order = concatenation offset + kept position.
        ties.append(offset + torch.arange(n, device=dev))
        toks.append(topi[:, d].gather(-1, child[keep]))
        parent_idx.append(prev_offset + parent[keep])
        depth_of.append(torch.full((n,), depth, device=dev))
        prev_offset, offset = offset, offset + n

    return ordered_tree(scores, ties, toks, parent_idx, depth_of, budget)


def candidate_pairs(F: int, K: int, limit: int, device):
    """All (pi, k) with pi < F, k < K and pi * (k + 2) + k <= limit (build_tree's bound), pi-major, as int64
    tensors (parent, child); and sizes, F + 1 Python ints: sizes[f] of the pairs have pi < f. Host numbers, so
    the shapes stay static under torch.compile (where this Python runs once, while tracing)."""
    # Entry pi offers the ranks k <= (limit - 2 * pi) / (pi + 1): fewer as pi grows, none past limit / 2.
    counts = [max(0, min(K, (limit - 2 * pi) // (pi + 1) + 1)) for pi in range(F)]
    sizes = list(itertools.accumulate(counts, initial=0))
    rows = sum(c > 0 for c in counts)  # the parents with a pair, which come first
    first = torch.tensor(sizes[:rows], dtype=torch.int64, device=device)  # flat index of each parent's first pair
    # parent = how many parents start at or before each flat index, minus one: a cumsum of start marks
    # (docs/compile.md, "repeat_interleave on CPU").
    starts = torch.zeros(sizes[-1], dtype=torch.int64, device=device).index_fill_(0, first[1:], 1)
    parent = torch.cumsum(starts, 0)
    return parent, torch.arange(sizes[-1], device=device) - first[parent], sizes


def ordered_tree(scores, ties, toks, parent_idx, depth_of, budget: int):
    """The first `budget` of all kept prefixes in the global order (score, then depth, then place within the
    depth), as (tokens, parents, depths) [N, budget]: per depth, the kept prefixes' scores [N, n], places in the
    concatenation [n], tokens [N, n], parents' places [N, n] and depth [n]. If fewer than `budget` prefixes were
    kept, the tail is padding (keys below every real one)."""
    batch, dev = scores[0].shape[0], scores[0].device
    kept = sum(t.shape[-1] for t in scores)
    pad = max(budget - kept, 0)
    key = order_key(torch.cat(scores, -1), torch.cat(ties))
    key = torch.cat([key, torch.full((batch, pad), torch.iinfo(torch.int64).min, device=dev)], -1)
    sel = key.topk(budget, dim=-1).indices  # pop order; padding (sel >= kept) last
    real = sel < kept

    # Row of each concatenation entry in the output (root = row 0; unselected entries are never looked up).
    rows = torch.arange(1, budget + 1, device=dev).expand(batch, budget)
    row_of = torch.zeros(batch, 1 + kept + pad, dtype=torch.int64, device=dev).scatter(-1, 1 + sel, rows)
    zero = torch.zeros(batch, pad, dtype=torch.int64, device=dev)
    tokens = torch.cat(toks + [zero], -1).gather(-1, sel)
    parents = row_of.gather(-1, torch.cat(parent_idx + [zero], -1).gather(-1, sel))
    depths = torch.cat(depth_of + [zero[0]])[sel]  # the same for every row: indexed by place
    return (torch.where(real, tokens, 0), torch.where(real, parents, -1), torch.where(real, depths, 0))


def beyond_room(logq: torch.Tensor, room: torch.Tensor | None) -> torch.Tensor:
    """Draft log-laws [N, D, ...] with every depth past the room [N] at probability 0, so that the best tree's nodes
    within the room are the best tree the room allows (docs/lossless.md, "Two builders, one order")."""
    if room is None:
        return logq
    past = torch.arange(1, logq.shape[1] + 1, device=logq.device) > room[:, None]
    return logq.masked_fill(past.view(*past.shape, *[1] * (logq.dim() - 2)), float("-inf"))


def within_room(tokens, parents, depths, room):
    """A tree's (or chain's) nodes [N, B] deeper than the room [N] made padding (token 0, parent -1, depth 0): their
    positions would lie past the limit. The nodes kept are closed under parents: each one's ancestors are shallower."""
    if room is None:
        return tokens, parents, depths
    kept = depths <= room[:, None]
    return torch.where(kept, tokens, 0), torch.where(kept, parents, -1), torch.where(kept, depths, 0)


def ancestor_matrix(parents: torch.Tensor, max_depth: int | None = None, dtype=torch.bool) -> torch.Tensor:
    """anc[..., i, j] = row j is row i or one of its ancestors, over the B + 1 rows [root, nodes...].

    parents [B] -> [B + 1, B + 1], or [N, B] -> [N, B + 1, B + 1]. Padded nodes (parent -1) see only themselves.
    Pointer doubling, ceil(log2(max_depth + 1)) steps for a depth bound max_depth (default: any tree of B). It
    runs on bytes whatever `dtype` asks (docs/compile.md, "Allow matrix as bytes").
    """
    B = parents.shape[-1]
    rows = torch.arange(B + 1, device=parents.device)
    # The root and padded nodes point at themselves, so chasing past them changes nothing.
    up = torch.cat([rows[:1].expand(*parents.shape[:-1], 1), torch.where(parents < 0, rows[1:], parents)], -1)
    anc = torch.eye(B + 1, dtype=torch.uint8, device=parents.device).expand(*up.shape, B + 1)
    depth = B if max_depth is None else max_depth
    for _ in range(math.ceil(math.log2(depth + 1))):
        anc = anc | anc.gather(-2, up.unsqueeze(-1).expand_as(anc))  # row i |= row up[i], within each tree
        up = up.gather(-1, up)
    return anc.to(dtype).contiguous()  # contiguous: with no step, anc is still the broadcast identity
