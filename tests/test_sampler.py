"""Tests for sampler.py: the correctness pyramid's first two levels (docs/lossless.md), plus warping and sampling.

1. Plain-Python reference verifiers written against a two-call RNG interface:
       rng.bernoulli(num, den, key) -> True with probability min(1, num / den)   (num / 0 = inf if num > 0, else 0)
       rng.categorical(weights, key) -> i with probability weights[i] / sum(weights)
   `key` names the independent draw (the chain position, the tree row) so that a replaying RNG can hand the
   reference the same uniforms the vectorized code used; the enumerating RNG ignores it.
   `Enumerator` runs a reference once per branch with exact Fractions and gives its exact output law, which must
   equal the target's law.
2. The vectorized verifiers in sampler.py equal the references exactly given the same randomness (`Replay`).

The references live here, not in sampler.py: the engine never needs them.
"""

import itertools
import math
import random
import sys
from collections import defaultdict
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sampler  # noqa: E402
from sampler import Sampling, draw_noise, sample, verify_chain_sampled, walk_tree, warp_logits, warp_probs  # noqa: E402
from settings import check_sampling

torch.set_num_threads(1)
FAST = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------- RNG interface


def coin_prob(num, den) -> Fraction:
    """min(1, num / den) exactly, with num / 0 = inf for num > 0 and 0 otherwise."""
    num, den = Fraction(num), Fraction(den)
    if den == 0:
        return Fraction(int(num > 0))
    return min(Fraction(1), max(Fraction(0), num / den))


class Enumerator:
    """An RNG that follows one branch of the choice tree: replays `prefix`, then takes the first option at every
    new choice and leaves the other options in `todo`. `weight` is the probability of the branch taken."""

    def __init__(self, prefix):
        self.prefix, self.path, self.weight, self.todo = prefix, [], Fraction(1), []

    def _choose(self, probs):
        if len(self.path) < len(self.prefix):
            k = self.prefix[len(self.path)]
        else:
            options = [i for i, w in enumerate(probs) if w > 0]
            k = options[0]
            self.todo += [self.path + [j] for j in options[1:]]
        self.path.append(k)
        self.weight *= probs[k]
        return k

    def bernoulli(self, num, den, key=None):
        a = coin_prob(num, den)
        return self._choose([1 - a, a]) == 1

    def categorical(self, weights, key=None):
        w = [Fraction(x) for x in weights]
        return self._choose([x / sum(w) for x in w])


def exact_law(run) -> dict:
    """The exact distribution of run(rng)'s (hashable) output: every branch, weighted."""
    law, todo = defaultdict(Fraction), [[]]
    while todo:
        rng = Enumerator(todo.pop())
        law[run(rng)] += rng.weight
        todo += rng.todo
    assert sum(law.values()) == 1
    return dict(law)


class Replay:
    """Hands a reference the randomness the vectorized code consumed: accept_u[key] and the uniform noise[key].

    bernoulli: u * den < num on float32 values in Python floats (float64), where the product is exact, as in
    verify_chain_sampled. categorical: inversion written out in Python floats (float64) on the same float32
    weights: the first token whose running sum exceeds u * total, the threshold kept below the total."""

    def __init__(self, accept_u=None, noise=None):
        self.u = None if accept_u is None else accept_u.tolist()
        self.noise = noise

    def bernoulli(self, num, den, key):
        return self.u[key] * den < num

    def categorical(self, weights, key):
        running = list(itertools.accumulate(float(np.float32(w)) for w in weights))
        threshold = min(float(self.noise[key]) * running[-1], running[-1] * (1 - 2.0 ** -52))
        return next(i for i, c in enumerate(running) if c > threshold)


# ------------------------------------------------------------------------------------------ reference rules


def ref_verify_chain_sampled(p, q, drafts, rng):
    """Speculative sampling on a chain. p: L+1 rows, q: L rows (lists of numbers), drafts[i] ~ q[i]."""
    for i, x in enumerate(drafts):
        if not rng.bernoulli(p[i][x], q[i][x], key=i):  # accept with probability min(1, p/q)
            resid = [max(0, a - b) for a, b in zip(p[i], q[i])]
            if sum(resid) == 0:  # p <= q everywhere: only reachable through rounding
                resid = list(p[i])
            return i, rng.categorical(resid, key=i)
    return len(drafts), rng.categorical(p[len(drafts)], key=len(drafts))


def ref_sample_target(p_rows, rng):
    """The target's own sampled token at every tree row."""
    return [rng.categorical(row, key=r) for r, row in enumerate(p_rows)]


def ref_walk_tree(parents, tokens, target):
    """From the root, step to the child whose token equals the target's token at the current row."""
    path = [0]
    while True:
        cur = path[-1]
        kids = [i + 1 for i, par in enumerate(parents) if par == cur and tokens[i] == target[cur]]
        if not kids:
            return path, target[cur]
        path.append(kids[0])


def ref_warp_probs(logits, s: Sampling):
    """Straightforward float64 warping. Returns (probs, margin): margin is how far the closest keep/drop
    decision was from its threshold, so tests can skip cases that float32 rounding could flip."""
    x = np.asarray(logits, dtype=np.float64)
    V = len(x)
    if s.greedy:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out, math.inf
    x = x / s.temperature
    keep = np.isfinite(x)
    margin = math.inf

    def softmax(keep):
        e = np.where(keep, np.exp(np.where(keep, x, 0) - x[keep].max()), 0.0)
        return e / e.sum()

    if 0 < s.top_k < V:
        kth = sorted(x, reverse=True)[s.top_k - 1]
        keep &= x >= kth
    if s.top_p < 1:
        probs = softmax(keep)
        for i in range(V):
            if keep[i]:
                above = sum(probs[j] for j in range(V) if probs[j] > probs[i])  # ties share a rank
                keep[i] = above < s.top_p
                margin = min(margin, abs(above - s.top_p))
    if s.min_p > 0:
        probs = softmax(keep)
        thr = s.min_p * probs.max()
        for i in range(V):
            if keep[i]:
                keep[i] = probs[i] >= thr
                if probs[i] < probs.max():  # the max itself is always kept exactly, whatever min_p
                    margin = min(margin, abs(probs[i] - thr) / max(probs[i], thr, 1e-300))
    return softmax(keep), margin


# ---------------------------------------------------------------------------------------- random structures


def random_dist(rnd, V):
    """Small integer weights, zeros common enough that q = 0 < p, disjoint supports and one-hots come up."""
    w = [rnd.choice([0, 1, 2, 3, 4, 5, 6]) for _ in range(V)]
    if not sum(w):
        w[rnd.randrange(V)] = 1
    return [Fraction(x, sum(w)) for x in w]


def prefix_model(rnd, V):
    """A random autoregressive law: prefix (tuple of tokens) -> next-token distribution, drawn lazily."""
    table = {}

    def law(prefix):
        if prefix not in table:
            table[prefix] = random_dist(rnd, V)
        return table[prefix]

    return law


def random_tree(rnd, V, B, n_pad=0):
    """B real nodes plus n_pad padded ones (parent -1) at random places. Parents precede children; siblings
    have distinct tokens. Returns (parents, tokens, depth of the deepest row)."""
    kinds = [True] * B + [False] * n_pad
    rnd.shuffle(kinds)
    parents, tokens, depth, used = [], [], [0], {0: set()}
    for real in kinds:
        free = [r for r in used if len(used[r]) < V]
        if real and free:
            par = free[-1] if rnd.random() < 0.4 else rnd.choice(free)  # lean towards deep paths
            tok = rnd.choice([t for t in range(V) if t not in used[par]])
            used[par].add(tok)
            used[len(parents) + 1] = set()
            depth.append(depth[par] + 1)
        else:
            par, tok = -1, rnd.randrange(V)  # padding: token arbitrary, may equal a real sibling's
            depth.append(0)
        parents.append(par)
        tokens.append(tok)
    return parents, tokens, max(depth)


def tree_prefixes(parents, tokens):
    """The token path from the root (excluded) to every row."""
    pre = [()]
    for par, tok in zip(parents, tokens):
        pre.append(pre[par] + (tok,) if par >= 0 else None)
    return pre


# ==================================================================================== 1. exact output laws


def chain_completed_law(P, Q, V, L, verify=ref_verify_chain_sampled):
    """Law of: draft x_1..x_L autoregressively from Q, verify against P, emit accepted drafts + next token,
    then keep sampling from P up to length L+1 (so every outcome has the same length)."""

    def run(rng):
        drafts = []
        for _ in range(L):
            drafts.append(rng.categorical(Q(tuple(drafts))))
        p = [P(tuple(drafts[:i])) for i in range(L + 1)]
        q = [Q(tuple(drafts[:i])) for i in range(L)]
        n, t = verify(p, q, drafts, rng)
        seq = drafts[:n] + [t]
        while len(seq) < L + 1:
            seq.append(rng.categorical(P(tuple(seq))))
        return tuple(seq)

    return exact_law(run)


def autoregressive_law(P, length):
    def run(rng):
        seq = []
        while len(seq) < length:
            seq.append(rng.categorical(P(tuple(seq))))
        return tuple(seq)

    return exact_law(run)


@FAST
@given(seed=st.integers(0, 2**32), V=st.integers(2, 3), L=st.integers(1, 3), same=st.booleans())
def test_chain_rule_output_law_is_target_law(seed, V, L, same):
    assume(V ** L <= 9)
    rnd = random.Random(seed)  # plain pseudo-randomness: hypothesis' own randoms shrink to near one-hot laws
    P = prefix_model(rnd, V)
    Q = P if same else prefix_model(rnd, V)
    law = chain_completed_law(P, Q, V, L)
    assert law == {k: v for k, v in autoregressive_law(P, L + 1).items() if v}
    # the first emitted token alone: law p_0
    first = defaultdict(Fraction)
    for seq, w in law.items():
        first[seq[0]] += w
    assert [first[t] for t in range(V)] == P(())


def _one_step_law(p, q):
    """Exact law of the first emitted token with one draft x ~ q."""
    law = chain_completed_law(lambda pre: p, lambda pre: q, len(p), 1)
    first = defaultdict(Fraction)
    for seq, w in law.items():
        first[seq[0]] += w
    return [first[t] for t in range(len(p))]


F = Fraction
NAMED = {
    "q=0 where p>0": ([F(1, 2), F(1, 2), 0], [1, 0, 0]),
    "disjoint supports": ([0, F(1, 3), F(2, 3)], [F(1, 2), F(1, 2), 0]),
    "p = q": ([F(1, 4), F(3, 4), 0], [F(1, 4), F(3, 4), 0]),
    "one-hot p": ([0, 1, 0], [F(1, 3), F(1, 3), F(1, 3)]),
    "one-hot q, other token": ([F(1, 5), F(4, 5), 0], [0, 0, 1]),
    "V=1": ([1], [1]),
}


@pytest.mark.parametrize("name", NAMED)
def test_chain_rule_named_cases(name):
    p, q = NAMED[name]
    assert _one_step_law([F(x) for x in p], [F(x) for x in q]) == [F(x) for x in p]


def test_article_worked_example():
    """A worked example of the chain rule: vocab (cat, dog, sat, on, mat), draft 'cat'."""
    p = [F(50, 100), F(20, 100), F(15, 100), F(10, 100), F(5, 100)]
    q = [F(70, 100), F(10, 100), F(5, 100), F(10, 100), F(5, 100)]
    bonus = [F(1, 5)] * 5
    law = exact_law(lambda rng: ref_verify_chain_sampled([p, bonus], [q], [0], rng))
    accepted = sum(w for (n, _), w in law.items() if n == 1)
    assert accepted == F(5, 7)  # p/q = 0.50/0.70
    rejected = {t: w / (1 - accepted) for (n, t), w in law.items() if n == 0}
    assert rejected == {1: F(1, 2), 2: F(1, 2)}  # dog/sat 50/50; 'on' (p = q) gets 0, not 0.10/0.50
    assert _one_step_law(p, q) == p  # min(p, q) + max(0, p - q) = p
    # the vectorized verifier: accept iff u < 5/7 = 0.71428...
    P = torch.tensor([[float(x) for x in p], [0.2] * 5])
    Q = torch.tensor([[float(x) for x in q]])
    noise = draw_noise((2,), torch.Generator().manual_seed(0), "cpu")
    for u, n_expected in [(0.7142, 1), (0.7144, 0), (0.0, 1), (0.99, 0)]:
        n, _ = verify_chain_sampled(P, Q, torch.tensor([0]), torch.tensor([u]), noise)
        assert int(n) == n_expected
    seen = set()
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        n, t = verify_chain_sampled(P, Q, torch.tensor([0]), torch.tensor([0.9]), draw_noise((2,), g, "cpu"))
        seen.add(int(t))
    assert seen == {1, 2}


def tree_emitted_law(P, parents, tokens):
    """Law of the emitted tokens (accepted path + next token) when the target samples every row."""
    pre = tree_prefixes(parents, tokens)
    rows = [P(x) if x is not None else [Fraction(1)] + [Fraction(0)] * (len(P(())) - 1) for x in pre]

    def run(rng):
        target = ref_sample_target(rows, rng)
        path, t = ref_walk_tree(parents, tokens, target)
        return pre[path[-1]] + (t,)

    return exact_law(run)


def tree_target_law(P, parents, tokens):
    """Sample the target autoregressively; stop at the first token that is not a child in the tree."""
    kids = defaultdict(set)
    for par, tok in zip(parents, tokens):
        if par >= 0:
            kids[par].add(tok)
    pre = tree_prefixes(parents, tokens)
    row_of = {x: r for r, x in enumerate(pre) if x is not None}

    def run(rng):
        seq = ()
        while True:
            t = rng.categorical(P(seq))
            if t not in kids[row_of[seq]]:
                return seq + (t,)
            seq += (t,)

    return exact_law(run)


@FAST
@given(seed=st.integers(0, 2**32), V=st.integers(2, 3), B=st.integers(1, 5), n_pad=st.integers(0, 2))
def test_tree_walk_output_law_is_target_law(seed, V, B, n_pad):
    assume(V ** (B + n_pad + 1) <= 729)
    rnd = random.Random(seed)
    parents, tokens, _ = random_tree(rnd, V, B, n_pad)
    P = prefix_model(rnd, V)
    assert tree_emitted_law(P, parents, tokens) == tree_target_law(P, parents, tokens)


# ============================================================ 2. vectorized == reference, same randomness


def random_sampling(rnd) -> Sampling:
    if rnd.random() < 0.15:
        return Sampling()
    return Sampling(
        temperature=rnd.choice([0.5, 1.0, 1.5]),
        top_k=rnd.choice([0, 0, 1, 2, 4]),
        top_p=rnd.choice([1.0, 1.0, 0.9, 0.5]),
        min_p=rnd.choice([0.0, 0.0, 0.05, 0.3]),
    )


def test_verify_chain_sampled_equals_reference():
    rnd, g = random.Random(0), torch.Generator().manual_seed(0)
    for case in range(400):
        V, L = rnd.randint(1, 6), rnd.randint(1, 6)
        s = random_sampling(rnd)
        p = warp_probs(3 * torch.randn(L + 1, V, generator=g), s)
        q = p[:L].clone() if case % 7 == 0 else warp_probs(3 * torch.randn(L, V, generator=g), s)
        drafts = sample(q, draw_noise((L,), g, "cpu"))
        if case % 5 == 0:  # arbitrary drafts, q(x) = 0 possible
            drafts = torch.randint(0, V, (L,), generator=g)
        accept_u = torch.rand(L, generator=g)
        if case % 3 == 0:  # push the accept test onto its boundary: u = p/q rounded
            ratio = (p[:L].gather(-1, drafts[:, None]) / q.gather(-1, drafts[:, None])).squeeze(-1)
            accept_u = torch.where(ratio < 1, ratio, accept_u)
        noise = draw_noise((L + 1,), g, "cpu")
        n, t = verify_chain_sampled(p, q, drafts, accept_u, noise)
        assert n.dtype == t.dtype == torch.long and n.shape == t.shape == ()
        ref = ref_verify_chain_sampled(p.tolist(), q.tolist(), drafts.tolist(), Replay(accept_u, noise))
        assert (int(n), int(t)) == ref, case
        assert p[int(n), int(t)] > 0  # residual and bonus draws stay inside the target's warped support


def test_a_chain_cut_by_the_room_is_verified_as_the_shorter_chain():
    """verify_chain_sampled with room r (the positions left before the limit) is the reference rule on the first r
    drafts: past them nothing is accepted, and the token after the r-th comes from the target's own law."""
    rnd, g = random.Random(3), torch.Generator().manual_seed(3)
    for case in range(300):
        N, V, L = 3, rnd.randint(1, 6), rnd.randint(1, 6)
        s = random_sampling(rnd)
        p = warp_probs(3 * torch.randn(N, L + 1, V, generator=g), s)
        q = p[:, :L].clone() if case % 4 == 0 else warp_probs(3 * torch.randn(N, L, V, generator=g), s)
        drafts, accept_u = sample(q, draw_noise((N, L), g, "cpu")), torch.rand(N, L, generator=g)
        noise = draw_noise((N, L + 1), g, "cpu")
        room = torch.randint(0, L + 1, (N,), generator=g)
        n, t = verify_chain_sampled(p, q, drafts, accept_u, noise, room)
        for i, r in enumerate(room.tolist()):
            want = ref_verify_chain_sampled(p[i, :r + 1].tolist(), q[i, :r].tolist(), drafts[i, :r].tolist(),
                                            Replay(accept_u[i, :r], noise[i, :r + 1]))
            assert (int(n[i]), int(t[i])) == want, (case, i, r)


def test_walk_tree_equals_reference():
    rnd, g = random.Random(1), torch.Generator().manual_seed(1)
    for case in range(400):
        V, B = rnd.randint(1, 5), rnd.randint(0, 12)
        chain = case % 4 == 0
        if chain:  # the dflash / greedy-chain case: parents [0, 1, 2, ...]
            parents, tokens, depth = list(range(B)), [rnd.randrange(V) for _ in range(B)], B
        else:
            parents, tokens, depth = random_tree(rnd, V, B, n_pad=rnd.randint(0, 3))
        rows = len(parents) + 1
        p = warp_probs(2 * torch.randn(rows, V, generator=g), random_sampling(rnd))
        noise = draw_noise((rows,), g, "cpu")
        if case % 2:
            target_ref = ref_sample_target(p.tolist(), Replay(noise=noise))
            target = sample(p, noise)
        else:  # greedy target
            target = p.argmax(-1)
            target_ref = target.tolist()
        assert target.tolist() == target_ref
        if rnd.random() < 0.4:  # make the target follow the tree down to a random row: long accepted paths
            target = target.clone()
            follow_tree(target, parents, tokens, rnd.randrange(len(parents) + 1))
        max_depth = depth + rnd.randint(0, 2)
        P, T = torch.tensor(parents, dtype=torch.long), torch.tensor(tokens, dtype=torch.long)
        path, length, nxt = walk_tree(P, T, target, max_depth)
        ref_path, ref_next = ref_walk_tree(parents, tokens, target.tolist())
        assert path.shape == (max_depth + 1,) and length.shape == nxt.shape == ()
        assert path.dtype == length.dtype == nxt.dtype == torch.long
        assert int(length) == len(ref_path), case
        assert path.tolist() == ref_path + [0] * (max_depth + 1 - len(ref_path)), case
        assert int(nxt) == ref_next, case


def follow_tree(target, parents, tokens, row):
    """Make the target choose the tree's tokens on the way down to `row`, so the walk accepts the whole path."""
    while row > 0 and parents[row - 1] >= 0:
        target[parents[row - 1]] = tokens[row - 1]
        row = parents[row - 1]


def test_verify_chain_sampled_batched_equals_each_row():
    rnd, g = random.Random(2), torch.Generator().manual_seed(2)
    for case in range(150):
        N, V, L = rnd.randint(1, 4), rnd.randint(1, 6), rnd.randint(1, 6)
        s = random_sampling(rnd)
        p = warp_probs(3 * torch.randn(N, L + 1, V, generator=g), s)
        q = warp_probs(3 * torch.randn(N, L, V, generator=g), s)
        q[0] = p[0, :L]  # q = p: every draft accepted, and a residual of zeros
        drafts = sample(q, draw_noise((N, L), g, "cpu"))
        drafts[-1] = torch.randint(0, V, (L,), generator=g)  # arbitrary drafts, q(x) = 0 possible
        accept_u = torch.rand(N, L, generator=g)
        ratio = (p[:, :L].gather(-1, drafts[..., None]) / q.gather(-1, drafts[..., None])).squeeze(-1)
        on_boundary = (ratio < 1) & (torch.rand(N, L, generator=g) < 0.3)  # u = p/q rounded
        accept_u = torch.where(on_boundary, ratio, accept_u)
        noise = draw_noise((N, L + 1), g, "cpu")
        n, t = verify_chain_sampled(p, q, drafts, accept_u, noise)
        assert n.dtype == t.dtype == torch.long and n.shape == t.shape == (N,)
        for i in range(N):
            want = verify_chain_sampled(p[i], q[i], drafts[i], accept_u[i], noise[i])
            assert torch.equal(n[i], want[0]) and torch.equal(t[i], want[1]), (case, i)


def test_walk_tree_batched_equals_each_row():
    rnd, g = random.Random(3), torch.Generator().manual_seed(3)
    for case in range(150):
        N, V, B = rnd.randint(1, 4), rnd.randint(1, 5), rnd.randint(0, 12)
        trees = []
        for _ in range(N):  # each row its own shape of tree and padding, all B nodes long
            n_pad = rnd.randint(0, B)
            trees.append(random_tree(rnd, V, B - n_pad, n_pad))
        parents = torch.tensor([t[0] for t in trees], dtype=torch.long).view(N, B)
        tokens = torch.tensor([t[1] for t in trees], dtype=torch.long).view(N, B)
        target = torch.randint(0, V, (N, B + 1), generator=g)
        for row, (par, tok, _) in zip(target, trees):
            follow_tree(row, par, tok, rnd.randrange(B + 1))
        max_depth = max(t[2] for t in trees) + rnd.randint(0, 2)
        path, length, nxt = walk_tree(parents, tokens, target, max_depth)
        assert path.shape == (N, max_depth + 1) and length.shape == nxt.shape == (N,)
        for i in range(N):
            want = walk_tree(parents[i], tokens[i], target[i], max_depth)
            assert all(torch.equal(x, y) for x, y in zip((path[i], length[i], nxt[i]), want)), (case, i)


def test_walk_tree_accepts_whole_matching_chain():
    target = torch.tensor([5, 6, 7, 8])
    path, length, nxt = walk_tree(torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7]), target, 3)
    assert path.tolist() == [0, 1, 2, 3] and int(length) == 4 and int(nxt) == 8
    # a padded node whose token matches is still never accepted
    path, length, nxt = walk_tree(torch.tensor([-1, 0]), torch.tensor([5, 9]), target[:3], 2)
    assert path.tolist() == [0, 0, 0] and int(length) == 1 and int(nxt) == 5


# =========================================================================================== warping


GRID = [x / 4 for x in range(-16, 17)]


@st.composite
def logits_and_sampling(draw, unique=False):
    V = draw(st.integers(1, 8))
    vals = st.sampled_from(GRID + [-math.inf])
    x = draw(st.lists(vals, min_size=V, max_size=V, unique=unique))
    assume(any(math.isfinite(v) for v in x))
    # typical values as well as hypothesis' floats, which lean towards the ends of their range
    s = Sampling(
        temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0.25, 4.0)),
        top_k=draw(st.integers(0, V + 1)),
        top_p=draw(st.sampled_from([1.0, 0.3, 0.6, 0.9]) | st.floats(0.05, 1.0)),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.2, 0.5]) | st.floats(0.0, 1.0)),
    )
    return torch.tensor(x), s


@settings(deadline=None, max_examples=400)
@given(case=logits_and_sampling())
@example(case=(torch.tensor([1.0, 3.0, 3.0, 0.0]), Sampling()))  # greedy tie: first index
@example(case=(torch.tensor([0.0]), Sampling(1.0, 1, 0.5, 1.0)))  # V = 1
@example(case=(torch.tensor([-math.inf, 2.0, -math.inf]), Sampling(2.0, 2, 0.3, 0.9)))
@example(case=(torch.tensor([1.0, 1.0, 0.0]), Sampling(1.0, top_p=0.3)))  # tied group at the top-p boundary
def test_warp_probs_matches_reference(case):
    logits, s = case
    ref, margin = ref_warp_probs(logits.tolist(), s)
    assume(margin > 1e-5)
    got = warp_probs(logits, s)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), ref, atol=1e-6, rtol=0)
    assert torch.equal(torch.isfinite(warp_logits(logits, s)), torch.from_numpy(ref > 0))  # support = finite


@settings(deadline=None, max_examples=150)
@given(case=logits_and_sampling(), seed=st.integers(0, 2**31))
def test_samples_stay_in_warped_support(case, seed):
    logits, s = case
    ref, margin = ref_warp_probs(logits.tolist(), s)
    wl = warp_logits(logits, s)
    noise = draw_noise((64,), torch.Generator().manual_seed(seed), "cpu")
    tok = sample(warp_probs(logits, s).expand(64, -1), noise)
    assert torch.isfinite(wl[tok]).all()
    if margin > 1e-5:
        assert (torch.from_numpy(ref)[tok] > 0).all()
    if s.greedy:
        assert (tok == logits.argmax()).all()


@settings(deadline=None, max_examples=150)
@given(case=logits_and_sampling(unique=True))
def test_warp_probs_matches_transformers(case):
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits, s = case
    assume(not s.greedy)
    _, margin = ref_warp_probs(logits.tolist(), s)
    assume(margin > 1e-5)  # HF and we may round differently right at a threshold
    scores = logits[None].clone()
    warpers = [lp.TemperatureLogitsWarper(s.temperature)]
    warpers += [lp.TopKLogitsWarper(s.top_k)] if s.top_k else []
    warpers += [lp.TopPLogitsWarper(s.top_p)] if s.top_p < 1 else []
    warpers += [lp.MinPLogitsWarper(s.min_p)] if s.min_p else []
    for w in warpers:
        scores = w(None, scores)
    torch.testing.assert_close(warp_probs(logits, s), scores.softmax(-1)[0], atol=1e-6, rtol=0)


def test_warp_and_sample_are_vectorized_over_leading_dims():
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(2, 3, 11, generator=g)
    logits[0, 1, :5] = -math.inf
    for s in [Sampling(), Sampling(0.7, 4, 0.8, 0.1), Sampling(1.3, top_p=0.5), Sampling(1.0, min_p=0.2)]:
        batched = warp_probs(logits, s)
        rows = torch.stack([warp_probs(r, s) for r in logits.reshape(-1, 11)]).reshape(2, 3, 11)
        assert torch.equal(batched, rows)
        noise = draw_noise((2, 3), g, "cpu")
        drawn = torch.stack([sample(r, e) for r, e in zip(rows.reshape(-1, 11), noise.reshape(-1))])
        assert torch.equal(sample(batched, noise), drawn.reshape(2, 3))


def test_warp_hand_computed_cases():
    def support(logits, s):
        return (warp_probs(torch.tensor(logits), s) > 0).long().tolist()

    # HF order: top-k renormalizes before top-p. After top-2 the masses are [0.731, 0.269], so top_p = 0.7 keeps
    # one token; top-p on the full distribution [0.644, 0.237, ...] would have kept two.
    assert support([3.0, 2.0, 1.0, 0.0], Sampling(1.0, top_k=2, top_p=0.7)) == [1, 0, 0, 0]
    assert support([3.0, 2.0, 1.0, 0.0], Sampling(1.0, top_p=0.7)) == [1, 1, 0, 0]
    # min-p after temperature: p1/p0 = exp(-1/2) = 0.61 at T = 2 (kept by min_p 0.5), exp(-1) = 0.37 at T = 1
    assert support([0.0, -1.0], Sampling(2.0, min_p=0.5)) == [1, 1]
    assert support([0.0, -1.0], Sampling(1.0, min_p=0.5)) == [1, 0]
    # top-p right at the boundary: the mass above token 1 equal to top_p drops it (kept iff mass above < top_p)
    top = float(torch.tensor([2.0, 1.0, 0.0]).softmax(-1)[0])
    assert support([2.0, 1.0, 0.0], Sampling(1.0, top_p=top)) == [1, 0, 0]
    above = float(np.nextafter(np.float32(top), np.float32(1)))  # next float32: torch compares in float32
    assert support([2.0, 1.0, 0.0], Sampling(1.0, top_p=above)) == [1, 1, 0]
    # V = 1 and all -inf but one: whatever the settings, the one token stays
    assert support([0.5], Sampling(0.3, 1, 0.1, 1.0)) == [1]
    assert support([-math.inf, 1.0, -math.inf], Sampling(1.0, 3, 0.2, 0.9)) == [0, 1, 0]


def test_top_p_after_top_k_equals_the_full_sort():
    # _mass_above_top reads the k kept positions instead of sorting the row: the same masses wherever a token is
    # kept by top-k (ties at the k-th included), on rows with many ties and with fewer finite logits than k
    g = torch.Generator().manual_seed(3)
    for case in range(300):
        V = 1 + case % 13
        k = 1 + (case // 13) % V
        logits = torch.randint(-3, 3, (4, V), generator=g).float() if case % 2 else 2 * torch.randn(4, V, generator=g)
        logits[0, : V // 2] = -math.inf
        logits[0, -1] = 0.0  # one finite logit at least
        top = logits.topk(k, dim=-1)
        probs = logits.masked_fill(logits < top.values[..., -1:], -math.inf).softmax(-1)
        kept = probs > 0
        fast = sampler._mass_above_top(probs, top.indices)
        assert torch.equal(fast[kept], sampler._mass_above(probs)[kept]), case


def test_top_p_keeps_tied_group_together():
    # three equal tokens, top_p = 0.5: the mass above each is 0, so all stay (HF would drop one by sort order)
    assert (warp_probs(torch.tensor([0.0, 0.0, 0.0, -5.0]), Sampling(1.0, top_p=0.5))[:3] > 0).all()
    # top_k keeps ties at the threshold too
    assert (warp_probs(torch.tensor([2.0, 1.0, 1.0, 0.0]), Sampling(1.0, top_k=2)) > 0).tolist() == [1, 1, 1, 0]


# ============================================================================================ sampling


def test_inversion_chi_square():
    stats = pytest.importorskip("scipy.stats")
    probs = torch.tensor([0.1, 0.25, 0.05, 0.35, 0.25])
    noise = draw_noise((20000,), torch.Generator().manual_seed(0), "cpu")

    def p_value(tokens):
        return stats.chisquare(torch.bincount(tokens, minlength=5).numpy(), 20000 * probs.numpy()).pvalue

    assert p_value(sample(probs.expand(20000, -1), noise)) > 1e-6
    assert p_value(sample(3 * probs.expand(20000, -1), noise)) > 1e-6  # unnormalized weights are fine
    # negative control: inversion with a wrong transform of the uniforms must fail
    assert p_value(sample(probs.expand(20000, -1), noise.sqrt())) < 1e-6


def test_sample_never_picks_zero_probability():
    # u = 0 lands on the first positive token, u = 1 (drawn never, but the padding rows' value) and the largest
    # float64 below 1 on the last positive one: never a leading or trailing zero
    probs = [[0.0, 1.0, 0.0], [0.0, 0.3, 0.0, 0.7, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0]]
    for u, want in [(0.0, [1, 1, 0]), (1.0, [1, 3, 3]), (1 - 2.0 ** -53, [1, 3, 3])]:
        got = [int(sample(torch.tensor(row), torch.tensor(u, dtype=torch.float64))) for row in probs]
        assert got == want, u
    # u = 1 on unnormalized weights with a tiny last positive entry: the threshold stays below the total
    weights = torch.tensor([3.0, 2.0 ** -30, 0.0])
    assert int(sample(weights, torch.tensor(1.0, dtype=torch.float64))) == 1


def test_sample_interval_widths_are_the_probabilities():
    # inversion over the float64 running sums: a token's share of a fine grid of uniforms is its probability
    probs = torch.tensor([0.5, 0.0, 1e-3, 0.25, 0.0, 0.249])
    grid = (torch.arange(200000, dtype=torch.float64) + 0.5) / 200000
    counts = torch.bincount(sample(probs.expand(len(grid), -1), grid), minlength=6).double() / len(grid)
    torch.testing.assert_close(counts, probs.double() / probs.double().sum(), atol=1e-5, rtol=0)


def test_draw_noise_is_seeded():
    a = draw_noise((4, 3), torch.Generator().manual_seed(7), "cpu")
    b = draw_noise((4, 3), torch.Generator().manual_seed(7), "cpu")
    assert torch.equal(a, b) and a.dtype == torch.float64 and ((a >= 0) & (a < 1)).all()


# ========================================================================================== validation


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.01), "min_p"),
        (dict(min_p=math.nan), "min_p"),
    ],
)
def test_sampling_rejects_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        check_sampling(Sampling(**kwargs))


def test_sampling_accepts_good_values():
    assert Sampling().greedy and not Sampling(temperature=0.7).greedy
    assert check_sampling(Sampling(temperature=1, top_k=50, top_p=1, min_p=1)) == Sampling(1.0, 50, 1.0, 1.0)
    check_sampling(Sampling(temperature=0.01, top_k=0, top_p=1e-3, min_p=0))


def test_sample_rows_in_chunks_draws_what_all_rows_at_once_draw(monkeypatch):
    # Rows go through warp and sample a chunk at a time (memory at B = 512 over a real vocabulary); each row's
    # draw and the per-request soundness must not depend on the chunking.
    import sampler
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, 50, generator=g) * 3
    logits[1, 4] = float("nan")  # request 1 is unsound
    noise = torch.rand(3, 7, dtype=torch.float64, generator=g)
    for s in (Sampling(temperature=1.0), Sampling(temperature=0.7, top_p=0.8), Sampling(temperature=1.3, top_k=5,
                                                                                      min_p=0.05)):
        monkeypatch.setattr(sampler, "ROW_CHUNK_ELEMENTS", 2**30)
        whole = sampler.sample_rows(logits, noise, s)
        monkeypatch.setattr(sampler, "ROW_CHUNK_ELEMENTS", 50 * 4)  # 4 rows a chunk: chunks straddle requests
        chunked = sampler.sample_rows(logits, noise, s)
        ok = [0, 2]
        assert torch.equal(whole[0][ok], chunked[0][ok]) and torch.equal(whole[1], chunked[1])
        assert whole[1].tolist() == [True, False, True]
        assert torch.equal(whole[0][ok], sample(warp_probs(logits[ok], s), noise[ok]))
