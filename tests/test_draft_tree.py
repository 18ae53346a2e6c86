"""Draft-tree construction: optimality against brute force, the device builder against the heap, ancestor matrices,
batches against their rows.

Brute force here is independent of draft_tree.py: ranks from Python's stable sort, float32 scores from numpy,
the order key (-score, depth, parent's place, rank) from plain tuple sorting, depth by depth.
"""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cli import format_tree
from draft_tree import ancestor_matrix, build_tree, build_tree_heap, candidate_pairs, order_key, ranked_topk

INF = math.inf
SETTINGS = settings(max_examples=80, deadline=None)


# ----------------------------------------------------------------------------------------------- generators

@st.composite
def logq_cases(draw, max_len=3, max_vocab=4):
    """[L, V] log-probabilities: smooth, heavily tied, with zero-probability tokens, or raw values chosen so that
    float32 rounding makes different parent scores equal once a child's log-prob is added."""
    return draw(logq_of_shape(draw(st.integers(1, max_len)), draw(st.integers(1, max_vocab))))


@st.composite
def logq_of_shape(draw, L, V):
    kind = draw(st.sampled_from(["smooth", "ties", "zeros", "rounding"]))
    values = {
        "smooth": st.floats(-4, 4, width=32),
        "ties": st.sampled_from([0.0, 1.0, 2.0]),
        "zeros": st.sampled_from([-INF, -INF, 0.0, 1.0]),
        "rounding": st.sampled_from([0.0, -0.0, -1e-8, -2e-8, -1e-7, -1.0, -4.0, -INF]),
    }[kind]
    x = torch.tensor(draw(st.lists(st.lists(values, min_size=V, max_size=V), min_size=L, max_size=L)))
    if kind == "rounding":  # used as log-probs directly (the builders need <= 0, not normalization)
        return x
    x[:, 0] = torch.where(torch.isinf(x).all(-1), 0.0, x[:, 0])  # every row needs some mass
    return x.log_softmax(-1)


def n_prefixes(L, V):
    return sum(V ** d for d in range(1, L + 1))


@st.composite
def cases_with_budget(draw, **kw):
    logq = draw(logq_cases(**kw))
    L, V = logq.shape
    return logq, draw(st.integers(1, n_prefixes(L, V) + 3))


@st.composite
def batches_with_budget(draw, max_batch=4, max_len=3, max_vocab=4):
    """[N, L, V]: each row of its own kind (so one batch mixes ties, -inf and rounding ties), and a budget up to
    past the number of prefixes (padded trees)."""
    N, L, V = draw(st.integers(1, max_batch)), draw(st.integers(1, max_len)), draw(st.integers(1, max_vocab))
    logq = torch.stack([draw(logq_of_shape(L, V)) for _ in range(N)])
    return logq, draw(st.integers(1, n_prefixes(L, V) + 3))


# ----------------------------------------------------------------------------------------------- references

def ranked_tokens(logq):
    """Per depth, token ids in rank order: log-prob descending, ties by id (Python's sort is stable)."""
    return [sorted(range(len(row)), key=lambda t: -row[t]) for row in logq.tolist()]


def all_prefixes_in_order(logq):
    """Every nonempty prefix (as a token tuple) sorted by (-score, depth, parent's place in the order, rank):
    each depth sorted on its own using the previous depth's order, then all depths merged by (-score, depth)."""
    L, V = logq.shape
    q = logq.numpy().astype(np.float32)
    ranked = ranked_tokens(logq)
    rank = [{t: r for r, t in enumerate(order)} for order in ranked]
    place = {(): 0}  # a prefix's place in its own depth's order
    score = {(): np.float32(0.0)}
    items = []
    with np.errstate(all="ignore"):
        for d in range(1, L + 1):
            depth = []
            for parent in [p for p in place if len(p) == d - 1]:
                for t in range(V):
                    s = np.float32(score[parent] + q[d - 1, t])
                    depth.append(((-float(s), place[parent], rank[d - 1][t]), parent + (t,), s))
            depth.sort()
            for i, (_, toks, s) in enumerate(depth):
                place[toks], score[toks] = i, s
                items.append(((-float(s), d, i), toks))
    return [toks for _, toks in sorted(items)]


def prefixes_of(tokens, parents, depths):
    """The token tuple of each real node, by chasing parents; checks the layout on the way."""
    tokens, parents, depths = tokens.tolist(), parents.tolist(), depths.tolist()
    out = []
    for i, (t, p, d) in enumerate(zip(tokens, parents, depths)):
        if p < 0:
            assert (t, d) == (0, 0), "padding is token 0, parent -1, depth 0"
            assert all(q < 0 for q in parents[i:]), "padding only at the tail"
            break
        assert p <= i, "parents precede children (node i is row i + 1)"
        assert d == (1 if p == 0 else depths[p - 1] + 1)
        out.append((out[p - 1] if p else ()) + (t,))
    return out


def ancestors_by_chasing(parents):
    B = len(parents)
    anc = torch.zeros(B + 1, B + 1, dtype=torch.bool)
    anc[0, 0] = True
    for i, p in enumerate(parents.tolist(), start=1):
        anc[i, i] = True
        while p >= 0:
            anc[i, p] = True
            p = -1 if p == 0 else parents[p - 1].item()
    return anc


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y), (a, b)


# ----------------------------------------------------------------------------------------------- tests

@SETTINGS
@given(cases_with_budget())
def test_heap_is_the_top_budget_prefixes(case):
    logq, budget = case
    tree = build_tree_heap(logq, budget)
    assert all(t.shape == (budget,) for t in tree)
    got = prefixes_of(*tree)  # also: parents first, depths consistent, padding at the tail
    want = all_prefixes_in_order(logq)[:budget]
    assert got == want  # the same set, popped in the order of the key
    assert len(set(got)) == len(got)
    assert all(p[:-1] in set(got) or len(p) == 1 for p in got)  # prefix-closed


@SETTINGS
@given(cases_with_budget())
def test_build_tree_equals_heap(case):
    logq, budget = case
    assert_same(build_tree(logq, budget), build_tree_heap(logq, budget))


@pytest.mark.parametrize("seed", range(3))
def test_build_tree_equals_heap_larger(seed):
    # Frontiers truncated at every depth, K < V, and many exact ties (quantized logits).
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 4, (6, 40), generator=g).float() if seed else torch.randn(6, 40, generator=g)
    logq = logits.log_softmax(-1)
    for budget in (1, 7, 33):
        assert_same(build_tree(logq, budget), build_tree_heap(logq, budget))


@pytest.mark.parametrize("budget, ties", [(64, False), (256, False), (256, True), (300, True)])
def test_build_tree_equals_heap_at_real_sizes(budget, ties):
    # The paper's shape scaled down: depth 15, budget up to past V, so the candidate pairs are pruned hard at
    # every depth (sharp logits: long chains; ties: many equal scores across parents).
    g = torch.Generator().manual_seed(budget)
    logits = torch.randint(0, 3, (15, 200), generator=g).float() if ties else torch.randn(15, 200, generator=g) * 4
    logq = logits.log_softmax(-1)
    assert_same(build_tree(logq, budget), build_tree_heap(logq, budget))


@SETTINGS
@given(batches_with_budget())
def test_batched_tree_equals_each_row(case):
    logq, budget = case
    N, L, _ = logq.shape
    tree = build_tree(logq, budget)
    assert all(t.shape == (N, budget) for t in tree)
    assert_same(build_tree_heap(logq, budget), tree)
    anc = ancestor_matrix(tree[1], max_depth=L, dtype=torch.uint8)
    assert anc.shape == (N, budget + 1, budget + 1) and anc.dtype == torch.uint8
    assert torch.equal(ancestor_matrix(tree[1]), anc.bool())
    for n in range(N):
        assert_same([t[n] for t in tree], build_tree(logq[n], budget))
        assert torch.equal(anc[n], ancestor_matrix(tree[1][n], max_depth=L, dtype=torch.uint8))


def test_batched_tree_equals_each_row_at_real_sizes():
    # Rows as different as a batch of requests gets: sharp, tied, mostly zero-probability, and -inf-heavy ties.
    g = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.randn(15, 200, generator=g) * 4, torch.randint(0, 3, (15, 200), generator=g).float(),
                          torch.randn(15, 200, generator=g), torch.randint(0, 2, (15, 200), generator=g).float()])
    logits[2, :, 3:] = -INF
    logits[3] = logits[3].masked_fill(logits[3] == 0, -INF)
    logq = logits.log_softmax(-1)
    for budget in (1, 64, 300):
        tree = build_tree(logq, budget)
        for n in range(len(logq)):
            assert_same([t[n] for t in tree], build_tree_heap(logq[n], budget))


@given(st.integers(1, 40), st.integers(1, 40), st.integers(-3, 60))
def test_candidate_pairs_are_every_pair_under_the_bound(F, K, limit):
    parent, child, sizes = candidate_pairs(F, K, limit, "cpu")
    want = [(p, k) for p in range(F) for k in range(K) if p * (k + 2) + k <= limit]
    assert list(zip(parent.tolist(), child.tolist())) == want
    assert sizes == [sum(p < f for p, _ in want) for f in range(F + 1)]


def test_build_tree_equals_heap_when_rounding_ties_children_of_different_parents():
    # Float32 sums of the same log-probs in different orders round differently, so children of parents with
    # different scores tie; the order then goes by the parents' places, not by the rank tuples.
    logq = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]).log_softmax(-1)
    tree = build_tree_heap(logq, 18)
    assert prefixes_of(*tree) == all_prefixes_in_order(logq)[:18]
    assert_same(build_tree(logq, 18), tree)


@pytest.mark.parametrize("budget", [25, 26, 30])
def test_build_tree_equals_heap_when_a_later_parents_children_tie_first(budget):
    # Depth-2 prefixes in key order: (0,0), (1,0), (0,1), (1,1); every depth-3 child rounds to -4.0, so the ties
    # go by the parents' places and (1,0,*) precede (0,1,*) although their rank tuples come later. Under a
    # rank-tuple tie-break the bound pi * (k + 2) + k <= budget - depth would drop (0,1,8) at budget 25 and 26.
    logq = torch.full((3, 10), -INF)
    logq[0, :2] = torch.tensor([0.0, -1e-8])
    logq[1, :2] = torch.tensor([0.0, -1e-7])
    logq[2] = -4.0
    tree = build_tree_heap(logq, budget)
    got = prefixes_of(*tree)
    assert got == all_prefixes_in_order(logq)[:budget]
    depth3 = [parent + (t,) for parent in [(0, 0), (1, 0), (0, 1), (1, 1)] for t in range(10)]
    assert got[6:] == depth3[:budget - 6]
    assert_same(build_tree(logq, budget), tree)


def test_budget_one_and_padding():
    logq = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]).log()
    assert_same(build_tree_heap(logq, 1), (torch.tensor([1]), torch.tensor([0]), torch.tensor([1])))
    # 3 + 9 prefixes, budget 15: all of them, then 3 padded entries.
    tokens, parents, depths = build_tree_heap(logq, 15)
    assert sorted(prefixes_of(tokens, parents, depths)) == sorted(all_prefixes_in_order(logq))
    assert tokens[12:].tolist() == [0] * 3 and parents[12:].tolist() == [-1] * 3 and depths[12:].tolist() == [0] * 3
    assert_same(build_tree(logq, 15), (tokens, parents, depths))


@SETTINGS
@given(logq_cases())
def test_ranked_topk_is_a_stable_sort(logq):
    V = logq.shape[1]
    values, ids = ranked_topk(logq, V)
    assert ids.tolist() == ranked_tokens(logq)
    want = logq.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(ids, want.indices) and torch.equal(values, want.values)


@SETTINGS
@given(cases_with_budget(max_len=4, max_vocab=3))
def test_ancestor_matrix_matches_parent_chasing(case):
    logq, budget = case
    _, parents, _ = build_tree_heap(logq, budget)
    want = ancestors_by_chasing(parents)
    assert torch.equal(ancestor_matrix(parents, max_depth=logq.shape[0]), want)
    assert torch.equal(ancestor_matrix(parents), want)
    assert torch.equal(ancestor_matrix(parents, logq.shape[0], dtype=torch.uint8), want.to(torch.uint8))


def closed_sets(L, V):
    """All prefix-closed sets of prefixes of length <= L over V tokens, as a bool matrix [n_sets, n_prefixes]."""
    prefixes = [p for d in range(1, L + 1) for p in itertools.product(range(V), repeat=d)]
    index = {p: i for i, p in enumerate(prefixes)}
    parent = [index.get(p[:-1], -1) for p in prefixes]
    rows = []
    for mask in range(1 << len(prefixes)):
        if all(parent[i] < 0 or mask >> parent[i] & 1 for i in range(len(prefixes)) if mask >> i & 1):
            rows.append([bool(mask >> i & 1) for i in range(len(prefixes))])
    return prefixes, torch.tensor(rows)


CLOSED = {(L, V): closed_sets(L, V) for L, V in [(2, 3), (3, 2)]}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(CLOSED)), st.data())
def test_tree_maximizes_the_surrogate(shape, data):
    # Prop. 1-2: the tree's expected acceptance length under Q (sum of its prefix probabilities) is the best of
    # any prefix-closed set of the same size.
    L, V = shape
    prefixes, sets = CLOSED[shape]
    logits = data.draw(st.lists(st.floats(-3, 3, width=32), min_size=L * V, max_size=L * V))
    logq = torch.tensor(logits).view(L, V).log_softmax(-1)
    q = logq.double().exp()
    mass = torch.tensor([math.prod(q[i, t].item() for i, t in enumerate(p)) for p in prefixes], dtype=torch.float64)
    best = torch.full((len(prefixes) + 1,), -1.0, dtype=torch.float64)
    best.scatter_reduce_(0, sets.sum(-1), (sets.double() * mass).sum(-1), reduce="amax")
    for budget in range(1, len(prefixes) + 1):
        tree = prefixes_of(*build_tree(logq, budget))
        index = {p: i for i, p in enumerate(prefixes)}
        value = mass[[index[p] for p in tree]].sum()
        assert value >= best[budget] - 1e-6, (budget, value, best[budget])  # float32 scores: near-ties may swap


def test_compiled_build_tree_traces_fully_and_matches():
    from torch._dynamo.utils import counters

    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    fn = torch.compile(build_tree, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    for logits in (torch.randn(2, 4, generator=g), torch.randint(0, 2, (2, 4), generator=g).float()):
        logq = logits.log_softmax(-1)
        assert_same(fn(logq, 6), build_tree_heap(logq, 6))
    assert sum(counters["graph_break"].values()) == breaks
    assert counters["stats"]["unique_graphs"] == graphs + 1  # traced (not skipped), and no recompile


def test_compiled_batch_traces_fully_and_matches():
    # A batched round's tree stages in one graph: build, ancestor masks, the walk; N = 3 rows (sharp, tied, with
    # zero-probability tokens), budget past the 3 + 9 prefixes so every tree is padded.
    from torch._dynamo.utils import counters

    from sampler import walk_tree

    def tree_stages(logq, target):
        tokens, parents, depths = build_tree(logq, 14)
        anc = ancestor_matrix(parents, logq.shape[-2], dtype=torch.uint8)
        return tokens, parents, depths, anc, *walk_tree(parents, tokens, target, logq.shape[-2])

    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    fn = torch.compile(tree_stages, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        logits = torch.stack([torch.randn(2, 3, generator=g) * 4, torch.randint(0, 2, (2, 3), generator=g).float(),
                              torch.tensor([[0.0, -INF, 1.0], [-INF, 0.0, -INF]])])
        logq = logits.log_softmax(-1)
        target = torch.randint(0, 3, (3, 15), generator=g)
        tokens, parents, _ = build_tree_heap(logq, 14)
        for n, row in enumerate((3, 7, 12)):  # the target follows the tree down to a real row: long paths
            while row > 0:
                target[n, parents[n, row - 1]] = tokens[n, row - 1]
                row = int(parents[n, row - 1])
        got, want = fn(logq, target), tree_stages(logq, target)
        assert len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))
        assert (want[-2] > 1).all()  # every walk went past the root
    assert sum(counters["graph_break"].values()) == breaks
    assert counters["stats"]["unique_graphs"] == graphs + 1  # traced (not skipped), and no recompile


def test_format_tree():
    tokens, parents = torch.tensor([5, 6, 7, 0]), torch.tensor([0, 1, 0, -1])
    text = format_tree(tokens, parents, accepted_rows=[0, 1], decode=lambda t: f"t{t}",
                       probs=torch.tensor([0.5, 0.25, 0.125, 0.0]), root="b")
    assert text == "\n".join([
        "b  ✓",
        "├── t5  0.500  ✓",
        "│   └── t6  0.250  ·",
        "└── t7  0.125  ·",
    ])
    assert format_tree(tokens, parents).splitlines()[1:] == ["├── 5", "│   └── 6", "└── 7"]


def test_order_key_tie_half_fits_int32():
    # Where the tie is an arange, inductor folds (constant - tie) into an index expression that Triton types as
    # int32: the constant must fit (2**32 - 1 failed to compile on an H200, benchmarks/2026-12-04-h200-*). The keys
    # still order by score descending, then tie ascending.
    score = torch.tensor([0.5, 0.5, -1.0, 0.0, -0.0, 0.5])
    tie = torch.tensor([0, 7, 3, 2**31 - 1, 4, 2**20])
    key = order_key(score, tie)
    low = key & (2**32 - 1)
    assert (low < 2**31).all() and (low >= 0).all()
    assert key.argsort(descending=True).tolist() == [0, 1, 5, 4, 3, 2]  # -0.0 ties 0.0
