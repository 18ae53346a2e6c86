"""gated_delta.py: every tree row equals the sequential rule (and conv) run along its own root-to-row path from the
committed state; the chunked and recurrent forms equal transformers' torch reference; the tree verify and the
commit compile whole."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import draft_tree
import gated_delta as gd

K = 4  # Qwen3.5's linear_conv_kernel_dim


def make_inputs(N, R, H, Dk, Dv, C, seed, dtype=torch.float64, decay=2.0):
    gen = torch.Generator().manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q, k = gd.normalize_qk(rn(N, R, H, Dk), rn(N, R, H, Dk))
    v = rn(N, R, H, Dv)
    g = (-decay * torch.rand(N, R, H, generator=gen, dtype=torch.float64)).to(dtype)
    beta = torch.rand(N, R, H, generator=gen, dtype=torch.float64).to(dtype)
    state = rn(N, H, Dk, Dv)
    x = rn(N, R, C)
    weight = rn(C, K)
    conv_state = rn(N, C, K - 1)
    return q, k, v, g, beta, state, x, weight, conv_state


def path_to(parents, i):
    """Rows from the root to row i (a padded row: itself alone, started from the committed state)."""
    if i > 0 and parents[i - 1] < 0:
        return [i]
    rows = [i]
    while rows[-1] != 0:
        rows.append(int(parents[rows[-1] - 1]))
    return rows[::-1]


def random_parents(gen, N, B, pad):
    par = torch.full((N, B), -1, dtype=torch.long)
    for n in range(N):
        for i in range(B - pad):
            par[n, i] = int(torch.randint(0, i + 1, (1,), generator=gen))
    return par


def check_tree(parents, N, H, Dk, Dv, C, seed, dtype=torch.float64, tol=1e-10, decay=2.0):
    """Tree outputs, commit and conv state for every row vs. the sequential forms along its path; returns the max
    difference seen."""
    B = parents.shape[1]
    R = B + 1
    q, k, v, g, beta, state, x, weight, conv_state = make_inputs(N, R, H, Dk, Dv, C, seed, dtype, decay)
    anc = draft_tree.ancestor_matrix(parents)
    out, u, G = gd.tree_gated_delta(q, k, v, g, beta, state, anc)
    cout = gd.tree_conv(x, weight, conv_state, parents)
    worst = 0.0
    for i in range(R):
        for n in range(N):
            p = torch.tensor(path_to(parents[n], i))
            sel = lambda t: t[n:n + 1, p]
            ref_out, ref_S = gd.recurrent_gated_delta(sel(q), sel(k), sel(v), sel(g), sel(beta), state[n:n + 1])
            ref_conv, ref_cs = gd.causal_conv(sel(x), weight, conv_state[n:n + 1])
            worst = max(worst, (out[n, i] - ref_out[0, -1]).abs().max().item(),
                        (cout[n, i] - ref_conv[0, -1]).abs().max().item())
            if i == 0 or parents[n, i - 1] >= 0:  # a real row ends an acceptable path
                S = gd.commit_state(state[n:n + 1], k[n:n + 1], u[n:n + 1], G[n:n + 1], anc[n:n + 1, i])
                path = torch.zeros(1, R + 2, dtype=torch.long)
                path[0, :len(p)] = p
                cs = gd.conv_state_along(x[n:n + 1], conv_state[n:n + 1], path, torch.tensor([len(p)]))
                worst = max(worst, (S - ref_S).abs().max().item(), (cs - ref_cs).abs().max().item())
    assert all(t.isfinite().all() for t in (out, u, G, cout))
    assert worst < tol, worst
    return worst


@settings(max_examples=150, deadline=None)
@given(B=st.integers(0, 20), pad_frac=st.floats(0, 0.5), N=st.integers(1, 2), H=st.integers(1, 2),
       Dk=st.integers(1, 4), Dv=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_tree_equals_sequential_along_each_path(B, pad_frac, N, H, Dk, Dv, seed):
    gen = torch.Generator().manual_seed(seed)
    parents = random_parents(gen, N, B, int(B * pad_frac))
    check_tree(parents, N, H, Dk, Dv, 3, seed)


@pytest.mark.parametrize("shape", ["star", "chain", "root_only", "all_padded", "wide", "full_width"])
def test_tree_edge_shapes(shape):
    """Depth 1, one chain, R = 1, only padding, a random tree of 64, and the widest tree of the default budget
    (512 children of the root)."""
    B = {"star": 9, "chain": 9, "root_only": 0, "all_padded": 5, "wide": 64, "full_width": 512}[shape]
    if shape == "full_width":
        check_tree(torch.zeros(1, B, dtype=torch.long), 1, 2, 3, 2, 2, seed=B)
        return
    if shape == "star":
        parents = torch.zeros(2, B, dtype=torch.long)
    elif shape == "chain":
        parents = torch.arange(B).expand(2, B).clone()
    elif shape == "all_padded":
        parents = torch.full((2, B), -1, dtype=torch.long)
    else:
        parents = random_parents(torch.Generator().manual_seed(1), 2, B, B // 8)
    check_tree(parents, 2, 2, 3, 2, 2, seed=B)


def test_chain_tree_equals_chunk_and_unbatched_parents():
    """A chain through the tree form equals the chunked prefill from the same state; a [B] parents (one tree for
    every request) is the batch of identical trees."""
    N, B, H = 2, 10, 2
    q, k, v, g, beta, state, x, weight, conv_state = make_inputs(N, B + 1, H, 3, 2, 4, seed=5)
    parents = torch.arange(B)
    out, _, _ = gd.tree_gated_delta(q, k, v, g, beta, state, draft_tree.ancestor_matrix(parents))
    ref, _ = gd.chunk_gated_delta(q, k, v, g, beta, state, chunk=4)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(gd.tree_conv(x, weight, conv_state, parents),
                               gd.causal_conv(x, weight, conv_state)[0], rtol=0, atol=1e-12)


def test_float32_tree_and_strong_decay():
    """float32 within 1e-4 of the float64 recurrence, with decays of up to -60 a step: exp(G_i - G_j) for a
    non-ancestor j would overflow float32 (e^{+700}) if it were formed before the mask."""
    gen = torch.Generator().manual_seed(3)
    parents = random_parents(gen, 2, 20, 3)
    q, k, v, g, beta, state, x, weight, conv_state = make_inputs(2, 21, 2, 4, 3, 2, seed=3, decay=60.0)
    anc = draft_tree.ancestor_matrix(parents)
    f = lambda *t: [a.float() for a in t]
    out, u, G = gd.tree_gated_delta(*f(q, k, v, g, beta, state), anc)
    ref, _, _ = gd.tree_gated_delta(q, k, v, g, beta, state, anc)
    assert out.isfinite().all() and u.isfinite().all()
    assert (out.double() - ref).abs().max() < 1e-4
    check_tree(parents, 2, 2, 4, 3, 2, seed=3, dtype=torch.float32, tol=1e-4, decay=60.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("T,chunk", [(1, 4), (13, 4), (37, 16), (70, 64)])
def test_chunk_equals_recurrent(T, chunk, dtype, tol):
    q, k, v, g, beta, state, *_ = make_inputs(2, T, 3, 5, 4, 1, seed=T, dtype=dtype)
    out, S = gd.chunk_gated_delta(q, k, v, g, beta, state, chunk=chunk)
    ref, ref_S = gd.recurrent_gated_delta(q, k, v, g, beta, state)
    assert (out - ref).abs().max() < tol and (S - ref_S).abs().max() < tol


@pytest.mark.parametrize("T", [1, 2, 7])
def test_causal_conv_splits(T):
    """Prefill from a zero state then steps equals one pass; the state after T < K - 1 keeps old columns."""
    *_, x, weight, conv_state = make_inputs(2, T + 5, 1, 1, 1, 6, seed=T)
    full, full_state = gd.causal_conv(x, weight, conv_state)
    a, s = gd.causal_conv(x[:, :T], weight, conv_state)
    b, s = gd.causal_conv(x[:, T:], weight, s)
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=0, atol=1e-13)
    torch.testing.assert_close(s, full_state, rtol=0, atol=0)


# --- transformers' torch reference (imported here only: the engine never imports transformers) ---


@pytest.fixture(scope="module")
def hf():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    return m


@pytest.mark.parametrize("use_l2", [True, False])
@pytest.mark.parametrize("T", [1, 5, 70])
def test_rules_equal_transformers(hf, T, use_l2):
    """float32 (transformers upcasts to it): q/k raw into theirs, normalize_qk'ed (or only scaled) into ours."""
    gen = torch.Generator().manual_seed(T)
    N, Hk, Hv, Dk, Dv = 2, 2, 4, 8, 6
    q, k = torch.randn(N, T, Hk, Dk, generator=gen), torch.randn(N, T, Hk, Dk, generator=gen)
    v = torch.randn(N, T, Hv, Dv, generator=gen)
    g = -torch.rand(N, T, Hv, generator=gen) * 3
    beta = torch.rand(N, T, Hv, generator=gen)
    state = torch.randn(N, Hv, Dk, Dv, generator=gen)
    rq, rk = q.repeat_interleave(Hv // Hk, 2), k.repeat_interleave(Hv // Hk, 2)
    oq, ok = gd.normalize_qk(rq, rk) if use_l2 else (rq * Dk ** -0.5, rk)
    kw = dict(initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=use_l2)
    ref_r, ref_rs = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    ref_c, ref_cs = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, **kw)
    out_r, S_r = gd.recurrent_gated_delta(oq, ok, v, g, beta, state)
    out_c, S_c = gd.chunk_gated_delta(oq, ok, v, g, beta, state)
    for a, b in [(out_r, ref_r), (S_r, ref_rs), (out_c, ref_c), (S_c, ref_cs), (out_c, ref_r)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # measured: 1.2e-7 at most


@pytest.mark.parametrize("T", [1, 2, 6])
def test_conv_equals_transformers(hf, T):
    """causal_conv1d_update with transformers' cache layout (K columns: its oldest is never read) and with ours
    (K - 1 columns); causal_conv1d_fn for a prefill from nothing."""
    gen = torch.Generator().manual_seed(T)
    N, C = 2, 5
    x = torch.randn(N, T, C, generator=gen, dtype=torch.float64)
    weight = torch.randn(C, K, generator=gen, dtype=torch.float64)
    their_state = torch.randn(N, C, K, generator=gen, dtype=torch.float64)
    ours, new_state = gd.causal_conv(x, weight, their_state[..., 1:])
    st = their_state.clone()
    ref = hf.causal_conv1d_update(x.transpose(1, 2), st, weight, None, "silu").transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(new_state, st[..., 1:], rtol=0, atol=0)
    st = their_state[..., 1:].clone()
    ref = hf.causal_conv1d_update(x.transpose(1, 2), st, weight, None, "silu").transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(new_state, st, rtol=0, atol=0)
    prefill = hf.causal_conv1d_fn(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
    torch.testing.assert_close(gd.causal_conv(x, weight, torch.zeros(N, C, K - 1, dtype=x.dtype))[0], prefill,
                               rtol=0, atol=1e-12)


def test_compiled_tree_verify_and_commit():
    """One round's recurrent math (tree conv, tree rule, commit of each request's last row, conv state along the
    path) compiles whole and equals eager."""
    N, B = 2, 6
    parents = torch.tensor([[0, 0, 1, 2, -1, -1], [0, 1, 2, 3, 4, 5]])
    q, k, v, g, beta, state, x, weight, conv_state = make_inputs(N, B + 1, 2, 4, 3, 3, seed=0, dtype=torch.float32)
    last = torch.tensor([4, 3])
    path = torch.tensor([[0, 1, 3, 4, 0, 0, 0], [0, 1, 2, 3, 0, 0, 0]])
    length = torch.tensor([4, 4])

    def verify(q, k, v, g, beta, state, x, conv_state, parents, last, path, length):
        anc = draft_tree.ancestor_matrix(parents)
        c = gd.tree_conv(x, weight, conv_state, parents)
        out, u, G = gd.tree_gated_delta(q, k, v, g, beta, state, anc)
        mask = anc.gather(1, last[:, None, None].expand(-1, 1, anc.shape[-1]))[:, 0]
        return c, out, gd.commit_state(state, k, u, G, mask), gd.conv_state_along(x, conv_state, path, length)

    args = (q, k, v, g, beta, state, x, conv_state, parents, last, path, length)
    compiled = torch.compile(verify, fullgraph=True, dynamic=False)
    for a, b in zip(compiled(*args), verify(*args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(b.abs().max()))


def test_worked_example_of_the_doc():
    """docs/recurrent_tree.md's 4-row tree (root, children 1 and 2, grandchild 3 under 1), Dk = Dv = 1, by hand."""
    one = torch.ones(1, 4, 1, 1, dtype=torch.float64)
    v = torch.tensor([2.0, 4.0, 0.0, 6.0], dtype=torch.float64).view(1, 4, 1, 1)
    g = torch.full((1, 4, 1), math.log(0.5), dtype=torch.float64)
    beta = torch.full((1, 4, 1), 0.5, dtype=torch.float64)
    state = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    anc = draft_tree.ancestor_matrix(torch.tensor([0, 0, 1]))
    out, u, G = gd.tree_gated_delta(one, one, v, g, beta, state, anc)
    torch.testing.assert_close(u.flatten(), torch.tensor([0.75, 1.6875, -0.3125, 2.421875], dtype=torch.float64))
    torch.testing.assert_close(out.flatten(), torch.tensor([1.25, 2.3125, 0.3125, 3.578125], dtype=torch.float64))
    S = gd.commit_state(state, one, u, G, anc[3].unsqueeze(0))
    assert S.item() == pytest.approx(3.578125, abs=1e-14)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 24), pad=st.integers(0, 4), seed=st.integers(0, 10**6))
def test_series_solve_equals_the_triangular_one_at_the_trees_depth(B, pad, seed):
    """TREE_SOLVE = "series" (the finite Neumann series, for GPUs) gives the triangular solve's rows when told the
    tree's depth."""
    gen = torch.Generator().manual_seed(seed)
    pad = min(pad, B - 1)
    parents = random_parents(gen, 2, B, pad)
    anc = draft_tree.ancestor_matrix(parents)
    depth = int(anc.sum(-1).max()) - 1  # the deepest row's ancestors, itself excluded
    q, k, v, g, beta, state, *_ = make_inputs(2, B + 1, 2, 4, 3, 5, seed)
    want = gd.tree_gated_delta(q, k, v, g, beta, state, anc, depth)
    saved, gd.TREE_SOLVE = gd.TREE_SOLVE, "series"
    try:
        got = gd.tree_gated_delta(q, k, v, g, beta, state, anc, depth)
    finally:
        gd.TREE_SOLVE = saved
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_series_solve_needs_the_whole_depth(monkeypatch):
    """On a chain of 6 drafts whose rows all write the same key at full strength (beta 1, no decay), every power of
    A counts: the series with the chain's depth is the triangular solve, one step short is far from it."""
    R, depth = 7, 6
    parents = torch.arange(R - 1)[None]
    anc = draft_tree.ancestor_matrix(parents)
    k = torch.zeros(1, R, 1, 2, dtype=torch.float64)
    k[..., 0] = 1.0
    q, v = k.clone(), torch.randn(1, R, 1, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    g, beta, state = torch.zeros(1, R, 1, dtype=torch.float64), torch.ones(1, R, 1, dtype=torch.float64), \
        torch.zeros(1, 1, 2, 3, dtype=torch.float64)
    want, _, _ = gd.tree_gated_delta(q, k, v, g, beta, state, anc, depth)
    monkeypatch.setattr(gd, "TREE_SOLVE", "series")
    got, _, _ = gd.tree_gated_delta(q, k, v, g, beta, state, anc, depth)
    short, _, _ = gd.tree_gated_delta(q, k, v, g, beta, state, anc, depth - 1)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert (short - want).abs().max() > 0.1


@pytest.mark.parametrize("Hk", [2, 1])
def test_rules_form_q_dot_k_once_per_key_head(Hk):
    """q and k at their Hk key heads (each serving Hv / Hk value heads) give every rule, and the commit, what the
    same q and k repeated to Hv heads give: the R x R dot products are formed once per key head and
    shared, not recomputed per value head. One key head is a tensor-parallel rank's lot (docs/tp.md)."""
    gen = torch.Generator().manual_seed(3)
    N, B, Hv, Dk, Dv = 2, 9, 6, 4, 3
    parents = random_parents(gen, N, B, pad=2)
    anc = draft_tree.ancestor_matrix(parents)
    q, k, v, g, beta, state, *_ = make_inputs(N, B + 1, Hv, Dk, Dv, 3, seed=4)
    q, k = q[:, :, ::Hv // Hk], k[:, :, ::Hv // Hk]  # [N, R, Hk, Dk]
    rq, rk = q.repeat_interleave(Hv // Hk, 2), k.repeat_interleave(Hv // Hk, 2)
    last = anc[:, -3]  # each request's path to row B - 2
    # The two forms multiply matrices of different batch shapes ([N, Hk] against [N, Hv] heads), and a BLAS may
    # sum a dot product in another order for another shape (an AMD EPYC's does): they agree to float64 rounding,
    # not bit for bit. A value head served by the wrong key head is off by far more than the tolerance.
    def same(a, b):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    shared, repeated = gd.tree_gated_delta(q, k, v, g, beta, state, anc), \
        gd.tree_gated_delta(rq, rk, v, g, beta, state, anc)
    for a, b in zip(shared, repeated):
        same(a, b)
    same(gd.commit_state(state, k, *shared[1:], last), gd.commit_state(state, rk, *repeated[1:], last))
    for rule in (gd.recurrent_gated_delta, lambda *a: gd.chunk_gated_delta(*a, chunk=4)):
        for a, b in zip(rule(q, k, v, g, beta, state), rule(rq, rk, v, g, beta, state)):
            same(a, b)


def test_bf16_conv_sums_its_taps_in_float32():
    """In bf16 the conv's taps are summed in float32 and rounded once, then SiLU (transformers' F.conv1d path on
    a GPU), not summed in bf16; tree rows along a chain get the chain's values bit for bit."""
    gen = torch.Generator().manual_seed(0)
    N, T, C = 2, 6, 64
    x, conv_state = torch.randn(N, T, C, generator=gen).bfloat16(), torch.randn(N, C, K - 1, generator=gen).bfloat16()
    weight = torch.randn(C, K, generator=gen).bfloat16()
    ours, _ = gd.causal_conv(x, weight, conv_state)
    ext = torch.cat([conv_state, x.transpose(1, 2)], -1).double()  # products of bf16 values are exact in float64
    summed = torch.nn.functional.conv1d(ext, weight.double()[:, None], groups=C).transpose(1, 2).float()
    assert torch.equal(ours, torch.nn.functional.silu(summed.bfloat16()))
    chain = torch.arange(T - 1)[None].expand(N, -1)
    assert torch.equal(gd.tree_conv(x, weight, conv_state, chain), ours)
