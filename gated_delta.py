"""Gated DeltaNet math for verifying a draft tree: the short convolution and the gated delta rule, over a chain
(prefill, decode) and over a tree (one verify pass), as pure functions. docs/recurrent_tree.md derives them.

The rule, per head, on a state S [Dk, Dv], for each token t in order (the semantics of transformers'
torch_recurrent_gated_delta_rule, which the tests compare against):

    S     = exp(g_t) * S                     g_t <= 0 is the log decay
    delta = beta_t * (v_t - S^T k_t)         the correction the state still lacks for key k_t
    S     = S + k_t delta^T
    o_t   = S^T q_t                          read AFTER the update: a token sees its own write

q and k come in already prepared: `normalize_qk` does what transformers does inside its rules with
use_qk_l2norm_in_kernel=True (l2norm both, then scale q by Dk ** -0.5). Every rule computes in the dtype it is
given (transformers upcasts to float32 inside; a caller in bf16 should do the same); the convolution sums its
taps in float32 whatever the model dtype.

Shapes (N requests first; H value heads, Hk key heads with Hk dividing H: key head h serves value heads
h * H / Hk .. (h + 1) * H / Hk - 1, and q . k products are formed once per key head; T tokens or R = B + 1 tree
rows: row 0 the root, the last committed token not yet run; rows 1..B the drafts in topological order):
    q, k [N, T, Hk, Dk]   v [N, T, H, Dv]   g, beta [N, T, H]   state [N, H, Dk, Dv]
    conv input x [N, T, C]   conv weight [C, K]   conv state [N, C, K - 1] (the last K - 1 inputs, oldest first)

Every function is fixed-shape and free of host reads and data-dependent Python branches, so it traces whole
under torch.compile(fullgraph=True).
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import Linear, compute_dtype


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim: the FLA convention transformers follows (eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def normalize_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q and k every rule below expects: both l2-normalized, q also scaled by 1 / sqrt(Dk). Done once outside
    the rules so that chain, tree and commit all see the very same vectors."""
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


# ---------------------------------------------------------------------------------------------------------------
# The short causal convolution (depthwise, kernel K, SiLU), over the concatenated q/k/v projection.


def _extended(x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """[N, K - 1 + T, C]: the committed inputs then the new ones, one time axis, so that the old state is just
    positions 0 .. K - 2 and new input t is position K - 1 + t."""
    return torch.cat([conv_state.transpose(1, 2).to(x.dtype), x], 1)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor):
    """Depthwise causal conv + SiLU of T new inputs continuing from conv_state -> (out [N, T, C], new state).

    out_t = silu(sum_j weight[:, j] * input_{t - (K - 1) + j}): weight[:, K - 1] multiplies the current input, as
    in torch's conv1d. A prefill is the call from a zero state; a decode step is T = 1. The new state is the last
    K - 1 inputs of [old state, x], which reaches into the old state when T < K - 1. The taps are summed in
    float32 and rounded once (conv_output), as a bf16 conv1d on a GPU accumulates."""
    K = weight.shape[-1]
    T = x.shape[1]
    ext = _extended(x, conv_state)
    f = compute_dtype(x.dtype)
    acc = sum(weight[:, j].to(f) * ext[:, j:j + T].to(f) for j in range(K))
    return conv_output(acc, x.dtype), ext[:, T:].transpose(1, 2)


def conv_output(acc: torch.Tensor, dtype) -> torch.Tensor:
    """SiLU of the summed taps, rounded to the model dtype first: transformers' torch path (F.conv1d in the model
    dtype, then SiLU)."""
    return F.silu(acc.to(dtype))


def _tree_pointers(parents: torch.Tensor, K: int) -> torch.Tensor:
    """Parent pointers on the extended axis of `_extended` [N, K - 1 + R]: row i's parent p is K - 1 + p; the
    root's predecessor is the newest committed input (K - 2); a committed input's is the one before it. A padded
    row (-1) hangs off the committed state like the root does: the same start as the recurrence gives it, so it
    is an ordinary, finite one-node path that no other row reads."""
    N = parents.shape[0]
    up_nodes = torch.where(parents < 0, torch.full_like(parents, K - 2), parents + (K - 1))
    up_root = torch.full((N, 1), K - 2, dtype=parents.dtype, device=parents.device)
    up_state = (torch.arange(K - 1, device=parents.device) - 1).clamp(min=0).expand(N, K - 1)
    return torch.cat([up_state.to(parents.dtype), up_root, up_nodes], 1)


def tree_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, parents: torch.Tensor):
    """The causal conv of every tree row along its own root-to-row path -> out [N, R, C].

    x [N, R, C] (R = B + 1, row 0 the root), parents [N, B] (or [B]) as draft_tree gives them. Row i reads its
    ancestors at distance 1 .. K - 1 by chasing parent pointers K - 1 times (fixed count, one gather each), and
    the committed inputs once the chase passes the root; so siblings never see each other, and a chain gives
    causal_conv's output."""
    if parents.dim() == 1:
        parents = parents.expand(x.shape[0], -1)
    K = weight.shape[-1]
    R, C = x.shape[1], x.shape[2]
    ext = _extended(x, conv_state)
    f = compute_dtype(x.dtype)
    idx = torch.arange(K - 1, K - 1 + R, device=x.device).expand(x.shape[0], R)
    inputs = [x]  # the inputs at distance 0, 1, .., K - 1 up each row's path
    up = _tree_pointers(parents, K) if K > 1 else None
    for _ in range(1, K):
        idx = up.gather(1, idx)
        inputs.append(ext.gather(1, idx.unsqueeze(-1).expand(-1, -1, C)))
    # summed oldest first, as causal_conv sums: a chain's rows get its values bit for bit
    acc = sum(weight[:, j].to(f) * inputs[K - 1 - j].to(f) for j in range(K))
    return conv_output(acc, x.dtype)


def conv_state_along(x: torch.Tensor, conv_state: torch.Tensor, path: torch.Tensor, length: torch.Tensor):
    """The conv state after committing an accepted path -> [N, C, K - 1].

    path [N, L] (rows, path[:, 0] = 0 the root, entries past `length` ignored), length [N] (>= 1, counts the
    root). The new state is the last K - 1 inputs of [old state, x[path[0]], ..., x[path[length - 1]]]: state
    column c is path position p = length - (K - 1) + c when p >= 0, else the old column K - 1 + p."""
    K = conv_state.shape[-1] + 1
    N, L = path.shape
    C = x.shape[-1]
    ext = _extended(x, conv_state)
    p = length.unsqueeze(1) - (K - 1) + torch.arange(K - 1, device=x.device)  # [N, K - 1]
    from_path = path.gather(1, p.clamp(0, L - 1)) + (K - 1)
    idx = torch.where(p >= 0, from_path, p + (K - 1))
    return ext.gather(1, idx.unsqueeze(-1).expand(-1, -1, C)).transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------------
# The gated delta rule.


def to_value_heads(x: torch.Tensor, heads: int, dim: int = 2) -> torch.Tensor:
    """x with its key-head dimension `dim` repeated to `heads` value heads (key head h serves value heads
    h * r .. h * r + r - 1, r = heads / key heads); x itself when they are as many."""
    r = heads // x.shape[dim]
    if r == 1:
        return x
    # expand + flatten is repeat_interleave's result without its index search (slow on the CPU); with one key head
    # the flatten is a view whose repeats share memory (stride 0), which the rules' in-place products refuse: a copy
    return x.unsqueeze(dim + 1).expand(*x.shape[:dim + 1], r, *x.shape[dim + 1:]).flatten(dim, dim + 1).contiguous()


def recurrent_gated_delta(q, k, v, g, beta, state):
    """The rule one token at a time -> (out [N, T, H, Dv], new state): the reference every other form equals,
    and the decode path (T = 1)."""
    q, k = (to_value_heads(x, v.shape[2]) for x in (q, k))
    outs = []
    S = state
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhkv,nhk->nhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("nhkv,nhk->nhv", S, q[:, t]))
    return torch.stack(outs, 1) if outs else v.new_zeros(v.shape), S


def _decays(G: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(G_i - G_j) where mask[i, j], else 0. G [N, H, R], mask [N, R, R] -> [N, H, R, R]. Masked to -inf
    BEFORE the exp: for a non-ancestor j, G_i - G_j can be large and positive, and its exp would overflow. In
    place on the one [N, H, R, R] difference: at a large budget these matrices are what a verify's memory holds."""
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)
    return diff.masked_fill_(~mask.unsqueeze(1), float("-inf")).exp_()


# How tree_gated_delta solves (I + A) u = rhs. "triangular": forward substitution (LAPACK trtrs / cuBLAS trsm),
# R^2 Dv work per head, one row after another. "series": u = rhs - A u repeated `depth` times, exact because A
# links a row only to its strict ancestors, so A^(depth + 1) = 0 on a tree at most `depth` deep: depth R^2 Dv
# work per head in plain matmuls, for a GPU where the substitution is slow or cannot be captured in a CUDA graph
# (scripts/gpu_check.py times both). Read while tracing.
TREE_SOLVE = "triangular"


def _solve_series(A: torch.Tensor, rhs: torch.Tensor, depth: int) -> torch.Tensor:
    """(I + A)^{-1} rhs for A's strictly lower triangle on a tree at most `depth` deep (A's diagonal is ignored):
    the finite Neumann series sum_{k <= depth} (-A)^k rhs, as `depth` steps of u = rhs - A u."""
    A = A.tril(-1)
    u = rhs
    for _ in range(depth):
        u = rhs - A @ u
    return u


def _solve_unit_lower(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """(I + A)^{-1} rhs for A's strictly lower triangle (rows in topological order, so an ancestor's index is
    smaller); A's diagonal and upper triangle are never read (unitriangular), so A may hold anything there.
    Forward substitution (triangular solve, LAPACK trtrs / cuBLAS trsm): exact in the sense that it performs the
    recurrence's own dependency order, needs no pivoting (unit diagonal) and no inverse."""
    return torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)


def tree_gated_delta(q, k, v, g, beta, state, anc, depth: int | None = None):
    """Every row of a tree through the rule along its own root-to-row path, in one shot -> (out, u, G).

    q, k [N, R, Hk, Dk], v [N, R, H, Dv], g, beta [N, R, H], state [N, H, Dk, Dv] (the committed state),
    anc [N, R, R] (or [R, R]; bool or uint8) from draft_tree.ancestor_matrix: anc[i, j] = j is i or an ancestor.

    Along a path the state after row i is S_i = exp(G_i) S0 + sum_{j <= i on the path} exp(G_i - G_j) k_j u_j^T,
    G_i the decays summed over the path up to and including i, and u_j the delta row j writes. u_j depends only on
    j's ancestors, so one u per row serves every path through it, and no per-row state is ever formed:
        (I + A) u = beta * (v - exp(G) k S0),  A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j), j a strict ancestor
        out_i = exp(G_i) q_i S0 + sum_{j ancestor or i} (q_i . k_j) exp(G_i - G_j) u_j
    Memory: [N, H, R, R] for the masks and dots, [N, R, H, Dv] for u; never R states of Dk x Dv. `depth`: the
    tree's depth bound (draft positions), for TREE_SOLVE = "series".
    Returns out [N, R, H, Dv], u [N, R, H, Dv], G [N, R, H] (u and G are what commit_state needs)."""
    if anc.dim() == 2:
        anc = anc.expand(q.shape[0], -1, -1)
    anc = anc.bool()
    H = v.shape[2]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [N, heads, R, D]
    G = torch.einsum("nij,njh->nhi", anc.to(g.dtype), g)  # [N, H, R]
    bh = beta.transpose(1, 2).unsqueeze(-1)  # [N, H, R, 1]
    decay = _decays(G, anc)  # ancestors and the row itself; the solve reads only the strict (ancestor) part
    # the R x R dot products once per key head, then shared by its value heads
    kk, qk = (to_value_heads(x @ kh.transpose(-1, -2), H, 1) for x in (kh, qh))
    qh, kh = (to_value_heads(x, H, 1) for x in (qh, kh))
    rhs = bh * (vh - G.exp().unsqueeze(-1) * (kh @ state))
    A = kk.mul_(decay).mul_(bh)
    series = TREE_SOLVE == "series" and depth is not None
    u = _solve_series(A, rhs, depth) if series else _solve_unit_lower(A, rhs)
    attn = qk.mul_(decay)
    out = G.exp().unsqueeze(-1) * (qh @ state) + attn @ u
    return out.transpose(1, 2), u.transpose(1, 2), G.transpose(1, 2)


def commit_state(state, k, u, G, mask):
    """The state after the accepted path whose last row is r -> [N, H, Dk, Dv].

    mask [N, R] is anc[n, r] (the path's rows: r and its ancestors); k, u, G as tree_gated_delta took and gave
    them. S = exp(G_r) S0 + sum_{j in mask} exp(G_r - G_j) k_j u_j^T. r is the largest row in the mask (rows are
    topological), found with a max, not a host read."""
    mask = mask.bool()
    k = to_value_heads(k, u.shape[2])
    R = mask.shape[-1]
    r = (mask * torch.arange(R, device=mask.device)).amax(-1)  # [N]
    G_r = G.gather(1, r[:, None, None].expand(-1, 1, G.shape[-1]))  # [N, 1, H]
    w = (G_r - G).masked_fill(~mask.unsqueeze(-1), float("-inf")).exp()  # [N, R, H]
    write = torch.einsum("nrh,nrhk,nrhv->nhkv", w, k, u)
    return G_r[:, 0].exp()[..., None, None] * state + write


def chunk_gated_delta(q, k, v, g, beta, state, chunk: int = 64):
    """The rule over T tokens in chunks (the WY / UT form) -> (out [N, T, H, Dv], new state).

    Each chunk is the tree form with the causal mask: a chain is the tree whose ancestors are all earlier rows.
    The chunk-local solves are done for all chunks at once, split into the part that needs the incoming state
    and the part that does not: u = W - Kc S with W = (I + A)^{-1} beta v and Kc = (I + A)^{-1} beta exp(G) k;
    then a scan over chunks carries S. T is padded to a multiple of `chunk` with beta = 0 and g = 0 rows, which
    write nothing and decay nothing."""
    N, T, H = v.shape[:3]
    pad = (-T) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    M = (T + pad) // chunk

    def chunks(x):  # [N, T, heads, ...] -> [N, M, heads, chunk, ...]
        return x.reshape(N, M, chunk, x.shape[2], *x.shape[3:]).transpose(2, 3)

    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g, beta))
    # the chunk x chunk dot products once per key head, then shared by its value heads
    kk, qk = (to_value_heads(x @ kc.transpose(-1, -2), H) for x in (kc, qc))
    qc, kc = (to_value_heads(x, H) for x in (qc, kc))
    G = gc.cumsum(-1)  # [N, M, H, chunk]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)
    decay = diff.masked_fill(~causal, float("-inf")).exp()
    strict_decay = diff.masked_fill(~causal.tril(-1), float("-inf")).exp()
    b = bc.unsqueeze(-1)
    A = b * kk * strict_decay
    W = _solve_unit_lower(A, b * vc)
    Kc = _solve_unit_lower(A, b * G.exp().unsqueeze(-1) * kc)
    attn = qk * decay
    q_dec = qc * G.exp().unsqueeze(-1)
    k_to_end = kc * (G[..., -1:] - G).exp().unsqueeze(-1)
    S = state
    outs = []
    for m in range(M):
        u = W[:, m] - Kc[:, m] @ S
        outs.append(q_dec[:, m] @ S + attn[:, m] @ u)
        S = G[:, m, :, -1].exp()[..., None, None] * S + k_to_end[:, m].transpose(-1, -2) @ u
    out = torch.stack(outs, 1).transpose(2, 3).reshape(N, M * chunk, H, -1)[:, :T]
    return out, S


# ---------------------------------------------------------------------------------------------------------------
# The layer: what a forward tells the recurrent layers about its rows, and the Gated DeltaNet module.


@dataclass
class Recurrent:
    """What the recurrent layers need to know about the rows of one forward (hybrid.Qwen3_5.forward's `recurrent`).

    Causal mode (a prefill chunk, a decode step): `valid` [N], rows >= valid[n] are padding and leave request n's
    state alone (beta = 0 and g = 0 there; the conv state is the last K - 1 inputs among the valid rows; valid
    may be 0); None: every row is valid. Each layer updates its state in place.
    Tree mode (a verify): `parents` [N, B] as draft_tree gives them (rows [root, nodes...], -1 = padded node) and
    `anc` [N, B + 1, B + 1] (uint8 or bool) = draft_tree.ancestor_matrix(parents). The committed state is left
    untouched; each layer puts into `pending` (keyed by its layer index) what hybrid.Qwen3_5.commit_recurrent needs: its
    conv inputs and the k, u, G of the tree rule."""
    valid: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    anc: torch.Tensor | None = None
    depth: int | None = None  # tree mode: how deep the tree can be (a bound known before the round)
    pending: dict = field(default_factory=dict)

    @classmethod
    def chain(cls, valid) -> "Recurrent":
        return cls(valid=valid)

    @classmethod
    def tree(cls, parents, anc, depth: int | None = None) -> "Recurrent":
        return cls(parents=parents, anc=anc, depth=depth)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def clone(self) -> "Recurrent":
        """A copy holding its own tensors (a CUDA graph's next replay overwrites its outputs: scripts/ keep them)."""
        own = lambda t: None if t is None else t.clone()  # noqa: E731
        return Recurrent(own(self.valid), own(self.parents), own(self.anc), self.depth,
                         {i: tuple(map(own, p)) for i, p in self.pending.items()})


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32 (float64 for a float64 model),
    cast back at the end; the weight starts at 0."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        f = compute_dtype(x.dtype)
        h = x.to(f)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1 + self.weight.to(f))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The norm inside Gated DeltaNet (not zero-centred): rms-normalize in float32, cast back, scale by w, then
    multiply by silu(z) in float32 and cast back (transformers' Qwen3_5RMSNormGated, step for step)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, z):
        f = compute_dtype(x.dtype)
        h = x.to(f)
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(z.to(f))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer (transformers' Qwen3_5GatedDeltaNet; the names are its tensor names).

    in_proj_qkv gives one channel block [q (Hk * Dk), k (Hk * Dk), v (Hv * Dv)] that runs through the depthwise
    causal conv (kernel K, no bias, SiLU); in_proj_z the output gate, in_proj_b beta = sigmoid(b), in_proj_a the
    log decay g = -exp(A_log) * softplus(a + dt_bias). q and k are l2-normalized (normalize_qk) and each of the
    Hk key heads serves Hv / Hk consecutive value heads (the rules form q . k once per key head). The rule runs
    and the state is kept in float32 (float64 for a float64 model) whatever the model dtype; the conv's input and
    state stay in the model dtype, as in transformers, its taps summed in float32. Then the gated norm with z, and
    out_proj.

    forward(x, recurrent): a chain (recurrent None or Recurrent.chain) advances `state` / `conv_state` in place
    over the valid rows (chunked rule; the one-step rule for a single row); a tree (Recurrent.tree) leaves them
    alone and puts (conv inputs, k, u, G) into recurrent.pending[index] for hybrid.Qwen3_5.commit_recurrent."""

    def __init__(self, hidden: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int,
                 eps: float, index: int):
        super().__init__()
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = key_heads, value_heads, key_dim, value_dim
        self.kernel, self.index = kernel, index
        self.channels = 2 * key_heads * key_dim + value_heads * value_dim
        self.in_proj = Linear(hidden, parts={"in_proj_qkv": self.channels, "in_proj_z": value_heads * value_dim,
                                             "in_proj_b": value_heads, "in_proj_a": value_heads})
        self.conv1d = nn.Module()  # only its weight [C, 1, K], as transformers' depthwise nn.Conv1d names it
        self.conv1d.weight = nn.Parameter(torch.empty(self.channels, 1, kernel))
        self.dt_bias = nn.Parameter(torch.ones(value_heads))
        self.A_log = nn.Parameter(torch.zeros(value_heads))
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = Linear(value_heads * value_dim, hidden)
        # Per-request states, (non-persistent) buffers at fixed addresses for CUDA graphs, updated with copy_.
        self.register_buffer("conv_state", None, persistent=False)  # [N, C, K - 1], model dtype
        self.register_buffer("state", None, persistent=False)  # [N, Hv, Dk, Dv], compute_dtype(model dtype)
        self.state_rows = None  # the buffers the states are the first rows of (allocate)

    def allocate(self, batch: int, dtype, device):
        """The states for `batch` requests, zeroed when new. As model.allocate_kv_caches: buffers of at least
        `batch` rows with the same trailing shape, dtype and device are kept, and a smaller batch gets a view of
        their first rows."""
        shapes = ((self.channels, self.kernel - 1), (self.value_heads, self.key_dim, self.value_dim))
        dtypes = (dtype, compute_dtype(dtype))
        full = self.state_rows
        with torch.inference_mode(False):
            if full is None or full[0].shape[0] < batch or any(
                    t.shape[1:] != s or t.dtype != d or t.device != torch.device(device)
                    for t, s, d in zip(full, shapes, dtypes)):
                full = self.state_rows = tuple(torch.zeros((batch, *s), dtype=d, device=device)
                                               for s, d in zip(shapes, dtypes))
            if self.state is None or self.state.shape[0] != batch or self.state.data_ptr() != full[1].data_ptr():
                self.conv_state, self.state = (t if t.shape[0] == batch else t[:batch] for t in full)

    def forward(self, x, recurrent=None):
        N, T, _ = x.shape
        f = compute_dtype(x.dtype)
        Hk, Hv, Dk, Dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        mixed, z, b, a = self.in_proj.split(self.in_proj(x))  # mixed [N, T, C]: the conv's inputs
        z = z.reshape(N, T, Hv, Dv)
        beta = b.sigmoid().to(f)
        g = -self.A_log.to(f).exp() * F.softplus(a.to(f) + self.dt_bias.to(f))
        weight = self.conv1d.weight[:, 0]
        tree = recurrent is not None and recurrent.is_tree
        if tree:
            conv = tree_conv(mixed, weight, self.conv_state, recurrent.parents)
        else:
            conv, new_conv = causal_conv(mixed, weight, self.conv_state)
            valid = None if recurrent is None else recurrent.valid
            if valid is not None:  # padding rows write nothing and decay nothing; the conv state ends at valid
                valid = torch.as_tensor(valid, device=x.device).reshape(N)
                live = (torch.arange(T, device=x.device) < valid[:, None]).to(f)[..., None]  # [N, T, 1]
                beta, g = beta * live, g * live
                rows = torch.arange(T, device=x.device).expand(N, T)
                new_conv = conv_state_along(mixed, self.conv_state, rows, valid)
        q, k, v = conv.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        q, k = normalize_qk(q.reshape(N, T, Hk, Dk).to(f), k.reshape(N, T, Hk, Dk).to(f))  # the rules share them
        v = v.reshape(N, T, Hv, Dv).to(f)
        if tree:
            out, u, G = tree_gated_delta(q, k, v, g, beta, self.state, recurrent.anc, recurrent.depth)
            recurrent.pending[self.index] = (mixed, k, u, G)
        else:
            rule = recurrent_gated_delta if T == 1 else chunk_gated_delta
            out, S = rule(q, k, v, g, beta, self.state)
            self.state.copy_(S)
            self.conv_state.copy_(new_conv)
        out = self.norm(out.to(x.dtype), z)
        return self.out_proj(out.reshape(N, T, Hv * Dv))


def commit_tree(layers, recurrent: Recurrent, path, length):
    """After a tree verify (recurrent.pending filled): each of the recurrent `layers` takes its state after the
    accepted path, and its conv state the last K - 1 inputs along it (hybrid.Qwen3_5.commit_recurrent)."""
    if not layers:
        return
    anc = recurrent.anc  # [N, R, R]
    last = path.gather(1, (length - 1)[:, None])  # [N, 1]: the last accepted row
    mask = anc.gather(1, last[:, :, None].expand(-1, 1, anc.shape[-1]))[:, 0]  # [N, R]: its path's rows
    for m in layers:
        mixed, k, u, G = recurrent.pending[m.index]
        m.state.copy_(commit_state(m.state, k, u, G, mask))
        m.conv_state.copy_(conv_state_along(mixed, m.conv_state, path, length))
