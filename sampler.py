"""Logits warping, sync-free sampling, and the lossless verification rules.

Everything here runs inside torch.compile'd code (fullgraph=True): no `.item()`, no Python branching on tensor
values (the `Sampling` fields are Python constants, baked into the graph). Warping and sampling act on the last
dim of [..., V]; the verifiers take an optional leading batch dim N. All randomness comes in as tensors drawn
outside compiled code (docs/compile.md, "Randomness drawn outside the graph").

Two verification rules (docs/lossless.md has the proofs):
  - verify_chain_sampled: drafts sampled from q; accept with prob min(1, p/q), on rejection resample from the
    residual max(0, p - q). Output law = p.
  - walk_tree: deterministic candidates (greedy, argmax chains, top-K trees): draw the target's own token at
    every node (argmax, or a warped sample), follow the child equal to it, else emit it and stop. Output law = p.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How the target's tokens are drawn (Hugging Face's names and order; checked by settings.check_settings)."""
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off; must be in (0, 1]
    min_p: float = 0.0  # 0 = off; must be in [0, 1]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# -------------------------------------------------------------------------------------------------- warping


def warp_logits(logits: Tensor, s: Sampling) -> Tensor:
    """Hugging Face order: temperature, top-k, top-p, min-p. float32; tokens outside the support are -inf.

    Needs at least one finite logit per row. Greedy keeps only the argmax (first index on ties), so the
    warped support of a greedy row is exactly the token greedy decoding emits.
    """
    x = logits.float()
    NEG = float("-inf")
    if s.greedy:
        best = x.argmax(-1, keepdim=True)
        return torch.full_like(x, NEG).scatter(-1, best, x.gather(-1, best))
    x = tempered(x, s.temperature)
    V = x.shape[-1]
    top_k = 0 < s.top_k < V
    if top_k:
        # keep everything >= the k-th largest: ties at the threshold stay (same as HF TopKLogitsWarper)
        top = x.topk(s.top_k, dim=-1)
        x = x.masked_fill(x < top.values[..., -1:], NEG)
    if s.top_p < 1:
        probs = x.softmax(-1)
        above = _mass_above_top(probs, top.indices) if top_k else _mass_above(probs)
        x = x.masked_fill(above >= s.top_p, NEG)
    if s.min_p > 0:
        probs = x.softmax(-1)  # renormalized over what the earlier filters kept
        x = x.masked_fill(probs < s.min_p * probs.amax(-1, keepdim=True), NEG)
    return x


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """logits / temperature for any temperature > 0, computed as (logits - max) / temperature with the max set to
    exactly 0: the plain quotient overflows to inf for tiny temperatures (then softmax gives NaN), and the shift
    changes no softmax or filter. Temperature 1 returns logits as they are."""
    if temperature == 1:
        return logits
    top = logits.amax(-1, keepdim=True)
    return torch.where(logits == top, 0.0, (logits - top) / temperature)


def _mass_above(probs: Tensor) -> Tensor:
    """Total probability of the tokens strictly more probable than each token.

    A top-p token is kept iff this is < top_p; the top token (mass 0 above it) is always kept. Tokens with
    exactly equal probability count as one rank, so a tied group at the boundary is kept or dropped together:
    the filter does not depend on how the sort orders ties (HF's does; it is the only place the two differ).
    """
    sp, order = probs.sort(-1, descending=True)
    return torch.empty_like(probs).scatter(-1, order, _sums_above_sorted(sp))


def _mass_above_top(probs: Tensor, top: Tensor) -> Tensor:
    """_mass_above after a top-k filter, from the k kept positions `top` (the logits' topk indices, so their
    probabilities are in non-increasing order) instead of a sort of the whole row of V: every other token is
    either filtered (probability 0, already -inf) or tied with the k-th, sharing its run and its mass above."""
    sp = probs.gather(-1, top)
    above = _sums_above_sorted(sp)
    tied = torch.where(probs == sp[..., -1:], above[..., -1:], torch.full_like(probs, math.inf))
    return tied.scatter(-1, top, above)


def _sums_above_sorted(sp: Tensor) -> Tensor:
    """For probabilities sorted in non-increasing order, the mass of the entries strictly greater than each."""
    before = torch.cat([torch.zeros_like(sp[..., :1]), sp.cumsum(-1)[..., :-1]], -1)  # exclusive prefix sums
    # Inside a tied run use the value at the run's first element: prefix sums never decrease, so a running max
    # over "value at run starts, 0 elsewhere" carries the run start's value along the run.
    start = torch.ones_like(sp, dtype=torch.bool)
    start[..., 1:] = sp[..., 1:] != sp[..., :-1]
    return torch.where(start, before, torch.zeros_like(before)).cummax(-1).values


def warp_probs(logits: Tensor, s: Sampling) -> Tensor:
    """softmax(warp_logits): for greedy this is the one-hot of the argmax (first max index)."""
    return warp_logits(logits, s).softmax(-1)


# ------------------------------------------------------------------------------------------------- sampling


def draw_noise(shape, generator: torch.Generator, device) -> Tensor:
    """Uniform[0, 1) float64 numbers for `sample`, one per categorical draw (shape: the draws', without V). Call
    outside compiled code, with a generator on `device`."""
    return torch.rand(shape, dtype=torch.float64, generator=generator, device=device)


def sample(probs: Tensor, noise: Tensor) -> Tensor:
    """Categorical draw over the last dim of probs [..., V] (unnormalized, at least one positive entry per row)
    without a host sync, by inversion with one uniform per row, noise [...]: token i iff C[i-1] <= u * C[-1] < C[i]
    for the float64 running sums C. The threshold stays below C[-1], so a draw always has positive probability
    (docs/lossless.md, "Sampling without a host sync"; docs/compile.md, "A draw's threshold stays below the total").
    """
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1:]
    threshold = torch.minimum(noise.double().unsqueeze(-1) * total, total * (1 - 2.0 ** -52))
    return (cdf <= threshold).sum(-1)


# Rows warped and sampled at a time (sample_rows): about this many logits, so that a verify of B + 1 rows over a
# large vocabulary never holds its sorts and float64 CDFs for every row at once.
ROW_CHUNK_ELEMENTS = 2**23


def sample_rows(logits: Tensor, noise: Tensor, s: Sampling):
    """The target's warped sample at every row of logits [N, R, V] with noise [N, R]: tokens [N, R], and whether
    every drawn token of request n had a positive, finite probability [N]. Rows go a chunk at a time
    (ROW_CHUNK_ELEMENTS): the same draws as all at once."""
    n, r, v = logits.shape
    flat, u = logits.reshape(n * r, v), noise.reshape(n * r)
    step = max(1, ROW_CHUNK_ELEMENTS // v)
    tokens, chosen = [], []
    for i in range(0, n * r, step):  # static bounds: unrolled into the compiled round, no host read
        probs = warp_probs(flat[i:i + step], s)
        drawn = sample(probs, u[i:i + step])
        tokens.append(drawn)
        chosen.append(probs.gather(-1, drawn[:, None])[:, 0])
    tokens, chosen = torch.cat(tokens).view(n, r), torch.cat(chosen).view(n, r)
    return tokens, (chosen > 0).all(1) & torch.isfinite(chosen).all(1)


# ------------------------------------------------------------------------------------------- verification


def verify_chain_sampled(p: Tensor, q: Tensor, drafts: Tensor, accept_u: Tensor, noise: Tensor,
                         room: Tensor | None = None):
    """Speculative sampling (rejection + residual) on a chain of L sampled drafts.

    p: [L+1, V] warped target probs (row i: after i drafts), q: [L, V] warped draft probs, drafts: [L] long with
    drafts[i] ~ q[i], accept_u: [L] and noise: [L+1] Uniform[0, 1). Returns (n_accepted, next_token), 0-d long
    ([N] with a leading batch dim N on every input): drafts[:n_accepted] are accepted and next_token follows.

    Draft i is accepted iff accept_u[i] * q_i(x) < p_i(x) (= prob min(1, p/q)), in float64, where the product of
    two float32 numbers is exact. Rejection at j: next_token ~ max(0, p_j - q_j) with noise[j], or p_j if that
    residual is all zero (only through rounding). All L accepted: next_token ~ p_L with noise[L]. room (0-d or
    [N], optional): the call on the first `room` drafts only (the positions left before the limit).
    """
    L = drafts.shape[-1]
    drafted = torch.ones_like(drafts, dtype=torch.bool) if room is None else \
        torch.arange(L, device=drafts.device) < room.unsqueeze(-1)
    # A draft past the room is none: never accepted, and the residual at its row is p itself (q = 0 there).
    q = torch.where(drafted.unsqueeze(-1), q, 0)
    d = drafts.unsqueeze(-1)
    p_drafted = p[..., :L, :]
    px = p_drafted.gather(-1, d).squeeze(-1).double()
    qx = q.gather(-1, d).squeeze(-1).double()
    accept = (accept_u.double() * qx < px) & drafted
    n = accept.long().cumprod(-1).sum(-1)  # length of the leading run of accepts
    resid = (p_drafted - q).clamp_min(0)
    # sum > 0 iff some entry is positive, whatever the summation order: the fallback is the same batched or not
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_drafted)
    # Draw a candidate at every position (static shapes) and pick the one where the chain stopped.
    cand = sample(torch.cat([resid, p[..., L:, :]], -2), noise)
    # gather, not cand[n]: indexing with a 0-d tensor would become .item() under torch.compile
    return n, cand.gather(-1, n.unsqueeze(-1)).squeeze(-1)


def walk_tree(parents: Tensor, tokens: Tensor, target: Tensor, max_depth: int):
    """Follow the target's own tokens down a draft tree.

    Rows 0..B: row 0 is the root (the bonus token), row i+1 is node i, with token tokens[i] and parent row
    parents[i] (< i+1; siblings have distinct tokens; padded nodes have parent -1 and are never accepted), as
    draft_tree builds them. target: [B+1] the target's token at each row (argmax or warped sample). Nodes deeper
    than max_depth are never accepted. Returns path [max_depth+1] (accepted rows from the root down, padded with
    0), length (0-d, 1 + accepted nodes) and next_token = target[last accepted row]; all long, with a leading N
    on every input and output for N trees.
    """
    B = parents.shape[-1]
    real = parents >= 0
    par = parents.clamp_min(0)
    match = real & (tokens == target.gather(-1, par))  # node's token is what the target chose at its parent
    acc = torch.zeros(target.shape, dtype=torch.bool, device=parents.device)
    acc[..., 0] = True
    # Round k settles every node of depth <= k: accepted iff its parent is accepted and it matches.
    for _ in range(max_depth):
        acc = torch.cat([acc[..., :1], acc.gather(-1, par) & match], -1)
    rows = torch.arange(B + 1, device=parents.device).expand(target.shape)
    # Parents precede children, so the accepted rows in index order are the path in depth order.
    slot = torch.where(acc, acc.long().cumsum(-1) - 1, max_depth + 1)  # rejected rows go to a scratch slot
    path = torch.zeros(*target.shape[:-1], max_depth + 2, dtype=torch.long, device=parents.device)
    path = path.scatter(-1, slot, rows)
    last = torch.where(acc, rows, 0).amax(-1, keepdim=True)
    return path[..., : max_depth + 1], acc.long().sum(-1), target.gather(-1, last).squeeze(-1)
