"""Correctness pyramid level 3 (docs/stat_test.md), CI-sized: sampled dflash / ddtree output follows the target's law.

For a tiny random pair (vocab 4, drafter block 3) the exact joint law of the first 4 new tokens under the warped
target is enumerated; samples from generate(seed=i) must pass a chi-square test against it (failure below
p = 1e-6), and a planted bug in the verification (scripts/stat_test.py's controls) must be rejected (p < 1e-6)
on the same seeds, so the test demonstrably has the power to see a wrong law. Drafts must be accepted often
enough for the verification rule to matter. Greedy runs must reproduce AR greedy exactly.

Sampling runs the engine's eager CPU attention (the mask materialized for SDPA, cpu.EAGER_CPU_ATTENTION);
test_dense_attention_matches_flex_and_the_kernel checks that it gives the engine the same tokens as eager
FlexAttention and as the CPU attention kernel of compiled engines. Seeds are
fixed, so every p-value here is deterministic on a given build.
"""

import itertools
import os
import sys

import numpy as np
import pytest

import ddtree
import sampler
from ddtree import generate
from dflash2 import DFlash2Drafter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import stat_test as st  # noqa: E402
from cli import grouped  # noqa: E402

PICK = ddtree.Engine.pick

VOCAB, N_TOKENS = 4, 4  # 4 tokens: a round after a round that committed a compacted path
PROMPT = [1, 2, 3]
WARP = dict(temperature=1.0, top_k=3, top_p=0.95, min_p=0.0)
ALPHA = st.ALPHA
MIN_DRAFTS_PER_ROUND = 0.4  # measured: 0.68 (dflash argmax chain) .. 0.98 (sampled chain), 1.03 (ddtree budget 5)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    paths = st.write_random_pair(str(tmp_path_factory.mktemp("stat")), VOCAB, seed=2, target_std=0.4,
                                 draft_std=0.4, block_size=3)
    return st.load_pair(*paths)


@pytest.fixture(scope="module")
def law(pair):
    target, _ = pair
    with st.attention("dense"):
        return st.exact_law(target, PROMPT, N_TOKENS, st.Sampling(**WARP))


def test_the_law_is_worth_testing(law):
    probs, margin = law.probs, law.margin
    assert abs(probs.sum() - 1) < 1e-12
    assert (probs > 0).sum() >= 12 and probs.max() < 0.4  # several sequences with real mass
    assert margin > 1e-5  # no warping threshold near a flip: last-bit logit differences cannot move the support


def test_chi_square_helper():
    probs = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
    p, cells, outside, tv = st.chi_square(np.array([500, 300, 150, 50, 0]), probs)
    assert p > 0.99 and cells == 4 and outside == 0 and tv < 1e-12
    assert st.chi_square(np.array([500, 300, 150, 49, 1]), probs)[:3] == (0.0, 0, 1)  # outside the support
    p, cells, _, _ = st.chi_square(np.array([60, 30, 8, 2, 0]), probs)  # 0.05 * 100 = 5: kept; nothing pooled
    assert cells == 4
    p, cells, _, _ = st.chi_square(np.array([30, 15, 4, 1, 0]), probs)  # 7.5 and 2.5 pooled into one cell
    assert cells == 3
    assert st.chi_square(np.array([900, 50, 30, 20, 0]), probs)[0] < ALPHA


def test_dense_attention_matches_flex_and_the_kernel(pair, monkeypatch):
    """The engine's dense eager path gives the same tokens as eager flex_attention and as the CPU kernel, over
    several rounds (and each kind really runs: FlexAttention is called under 'flex' only, the kernel under 'kernel'
    only)."""
    import cpu
    import model
    target, drafter = pair
    calls = {"flex": [], "kernel": []}
    flex, kernel = model.flex_attention, cpu.cpu_attention
    monkeypatch.setattr(model, "flex_attention", lambda *a, **k: calls["flex"].append(1) or flex(*a, **k))
    monkeypatch.setattr(cpu, "cpu_attention", lambda *a, **k: calls["kernel"].append(1) or kernel(*a, **k))
    for kw in (dict(method="ddtree", budget=5), dict(method="dflash", draft_sampling=True), dict(method="ar")):
        runs = {}
        for kind in ("flex", "dense", "kernel"):
            for c in calls.values():
                c.clear()
            with st.attention(kind):
                runs[kind] = [generate(target, drafter if kw["method"] != "ar" else None, PROMPT, max_new_tokens=8,
                                       seed=s, stop_ids=[], **grouped(kw), **grouped(WARP)).tokens for s in range(6)]
            assert {k: len(c) > 0 for k, c in calls.items()} == {"flex": kind == "flex", "kernel": kind == "kernel"}
        assert runs["dense"] == runs["flex"] == runs["kernel"], kw


def test_ar_samples_follow_the_exact_law(pair, law):
    """Checks the exact-law computation itself against plain sampling."""
    target, _ = pair
    with st.attention("dense"):
        samples, _ = st.draw_samples(target, None, PROMPT, N_TOKENS, 800, seed0=0, method="ar", **WARP)
    p, _, outside, tv = st.chi_square(law.counts(samples), law.probs)
    assert outside == 0 and p >= ALPHA, (p, tv)


CASES = [
    # (id, generate kwargs, samples, [(planted bug, samples)]). Sizes: the real runs' p-values are 0.3-0.9 here;
    # the controls' are below 1e-14 (residual_p is the weakest: 1.5e-6 at 300 samples, 4e-15 at 800).
    ("dflash-argmax-chain", dict(method="dflash"), 1000, [("own_row", 300)]),
    ("dflash-sampled-chain", dict(method="dflash", draft_sampling=True), 1000, [("residual_p", 800)]),
    ("ddtree-budget2", dict(method="ddtree", budget=2), 1000, [("own_row", 300)]),
    ("ddtree-budget5", dict(method="ddtree", budget=5), 1000, [("own_row", 300), ("shared_noise", 500)]),
]


@pytest.mark.parametrize("kw, samples, controls", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_sampled_output_follows_the_target_law(pair, law, kw, samples, controls):
    target, drafter = pair
    probs = law.probs
    draft_sampling = kw.get("draft_sampling", False)
    with st.attention("dense"):
        drawn, stats = st.draw_samples(target, drafter, PROMPT, N_TOKENS, samples, seed0=0, **kw, **WARP)
        p, cells, outside, tv = st.chi_square(law.counts(drawn), probs)
        assert stats["drafts_per_round"] > MIN_DRAFTS_PER_ROUND, stats
        assert outside == 0 and p >= ALPHA, f"{kw}: p = {p:.3e}, TV = {tv:.4f}, {outside} outside the support"
        for control, n in controls:
            with st.planted(control, kw["method"], draft_sampling):
                bad, bad_stats = st.draw_samples(target, drafter, PROMPT, N_TOKENS, n, seed0=0, **kw, **WARP)
            bp, _, _, btv = st.chi_square(law.counts(bad), probs)
            assert bad_stats["drafts_per_round"] > MIN_DRAFTS_PER_ROUND, (control, bad_stats)
            assert bp < ALPHA, f"planted bug {control} not detected: p = {bp:.3e}, TV = {btv:.4f}"
    # the planted bug is gone again
    assert (ddtree.walk_tree, ddtree.verify_chain_sampled, ddtree.draw_noise) == \
        (sampler.walk_tree, sampler.verify_chain_sampled, sampler.draw_noise)
    assert ddtree.Engine.pick is PICK


@pytest.mark.parametrize("kw", [dict(method="dflash"), dict(method="ddtree", budget=2),
                                dict(method="ddtree", budget=5)], ids=["dflash", "ddtree-2", "ddtree-5"])
def test_greedy_samples_equal_ar_greedy(pair, kw):
    target, drafter = pair
    with st.attention("dense"):
        ar = generate(target, None, PROMPT, method="ar", max_new_tokens=8, stop_ids=[]).tokens
        for seed in range(4):
            res = generate(target, drafter, PROMPT, max_new_tokens=8, seed=seed, stop_ids=[],
                           temperature=0.0, **grouped(kw))
            assert res.tokens == ar, (kw, seed)


def test_support_enumeration_equals_the_product_over_every_sequence(pair):
    """exact_law's depth-by-depth enumeration over the support (batched forwards, here several per depth) gives
    the law of the product over all V^n sequences, each context run alone."""
    target, _ = pair
    s = st.Sampling(**WARP)
    with st.attention("dense"):
        law = st.exact_law(target, PROMPT, 3, s, batch=5)
        full = {}
        for seq in itertools.product(range(VOCAB), repeat=3):
            pr = 1.0
            for k in range(3):
                w = sampler.warp_probs(st.last_logits(target, [PROMPT + list(seq[:k])], batch=1), s)[0].double()
                pr *= float(w[seq[k]] / w.sum())
            if pr > 0:
                full[seq] = pr
    assert law.sequences == sorted(full)
    total = sum(full.values())
    # float32 logits of a context differ in the last bits between a batched forward and a lone one: ~1e-7 relative
    np.testing.assert_allclose(law.probs[:-1], [full[q] / total for q in law.sequences], rtol=1e-5, atol=0)
    assert law.probs[-1] == 0  # the cell for samples outside the support


def test_a_real_sized_vocabulary_through_its_support(tmp_path):
    """Vocab 512 (512^3 sequences: no full enumeration): top-k 4 keeps the law at most 64 sequences; batched ddtree
    samples follow it, and the unwarped control (the round's rows drawn without top-k) is rejected."""
    target, drafter = st.load_pair(*st.write_random_pair(str(tmp_path), 512, seed=2, block_size=4))
    warp = dict(temperature=1.0, top_k=4)
    with st.attention("dense"):
        out = st.run_check(target, drafter, PROMPT, 3, 1200, warp, "ddtree", budget=6, control="unwarped",
                           control_samples=400, log=lambda *a: None)
    assert 4 < len(out["law"].sequences) <= 64
    assert out["real"]["ok"] and out["control"]["ok"], (out["real"]["p"], out["control"]["p"])


def test_budget_auto_switching_mid_request_follows_the_target_law(pair, law, two_passes):
    """budget auto, its candidates (plain decoding, the chain, trees of 2 and 5) switched round by round in a
    cycle that carries on across batches (stat_test.switching_auto), so samples see every kind of switch
    mid-request: the law holds, and the own_row control (tree rounds drawing the target's choice at the child's row)
    is rejected."""
    target, drafter = pair
    kw = dict(method="ddtree", budget="auto")
    with st.attention("dense"), st.switching_auto():
        drawn, stats = st.draw_samples(target, drafter, PROMPT, N_TOKENS, 1000, seed0=0, batch=16, **kw, **WARP)
        p, cells, outside, tv = st.chi_square(law.counts(drawn), law.probs)
        assert stats["drafts_per_round"] > MIN_DRAFTS_PER_ROUND / 2, stats  # ar rounds draft nothing
        assert outside == 0 and p >= ALPHA, f"p = {p:.3e}, TV = {tv:.4f}, {outside} outside the support"
        with st.planted("own_row", "ddtree", False):
            bad, _ = st.draw_samples(target, drafter, PROMPT, N_TOKENS, 400, seed0=0, batch=16, **kw, **WARP)
        bp, _, _, btv = st.chi_square(law.counts(bad), law.probs)
        assert bp < ALPHA, f"planted bug own_row not detected: p = {bp:.3e}, TV = {btv:.4f}"


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    paths = st.write_random_pair(str(tmp_path_factory.mktemp("stat-hybrid")), VOCAB, seed=2, target_std=0.4,
                                 draft_std=0.4, block_size=3, hybrid=True)
    return st.load_pair(*paths)


def test_sampled_ddtree_on_a_hybrid_target_follows_the_law(hybrid_pair):
    """A hybrid target (Gated DeltaNet + gated attention): sampled ddtree follows the exact law of the first 4 new
    tokens (4, so that later rounds stand on committed recurrent states), and the planted bugs are rejected: a tree
    walk reading its own row's noise, and recurrent layers that drop the accepted drafts from their state."""
    target, drafter = hybrid_pair
    n, kw = N_TOKENS, dict(method="ddtree", budget=5)
    with st.attention("dense"):
        law = st.exact_law(target, PROMPT, n, st.Sampling(**WARP))
        drawn, stats = st.draw_samples(target, drafter, PROMPT, n, 1000, seed0=0, **kw, **WARP)
        p, _, outside, tv = st.chi_square(law.counts(drawn), law.probs)
        assert stats["drafts_per_round"] > MIN_DRAFTS_PER_ROUND, stats
        assert outside == 0 and p >= ALPHA, f"p = {p:.3e}, TV = {tv:.4f}, {outside} outside the support"
        print(f"hybrid ddtree: p = {p:.3f}, TV = {tv:.4f}, drafts per round {stats['drafts_per_round']:.2f}")
        for control, samples in (("stale_commit", 400), ("own_row", 300)):
            with st.planted(control, "ddtree", False):
                bad, _ = st.draw_samples(target, drafter, PROMPT, n, samples, seed0=0, **kw, **WARP)
            bp, _, _, btv = st.chi_square(law.counts(bad), law.probs)
            print(f"  planted {control}: p = {bp:.2e}, TV = {btv:.3f}")
            assert bp < ALPHA, f"planted bug {control} not detected: p = {bp:.3e}, TV = {btv:.4f}"


@pytest.mark.parametrize("args, message", [
    (["--alpha", "1.5"], "--alpha must be in (0, 1)"),
    (["--alpha", "0"], "--alpha must be in (0, 1)"),
    (["--method", "dflash", "--budget", "4"], "--budget does not apply to method 'dflash'"),
    (["--method", "ddtree", "--draft-sampling"], "--draft-sampling does not apply to method 'ddtree'"),
    (["--budget", "x"], "--budget"),
    (["--block-size", "1"], "--block-size must be in [2, "),
    (["--threads", "0"], "--threads must be in [1, "),
    (["--samples", "0"], "--samples must be in [1, "),
    (["--prompt", "99999"], "--prompt: token ids must lie in [0, 4)"),
    (["--prompt", "1,x"], "--prompt must be token ids separated by commas"),
    (["--json", "/no/such/dir/out.json"], "--json /no/such/dir/out.json: no directory /no/such/dir"),
])
def test_bad_arguments_are_one_error_line_before_the_run(args, message, capsys):
    code = st.main(args + ["--samples", "8"] if "--samples" not in args else args)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1 and message in err, \
        (code, out, err)


@pytest.fixture(scope="module")
def dflash2_pair(tmp_path_factory):
    """The pair's target with a DFlash 2 drafter: its selector keeps 3 of the 4 tokens, so its laws are zero off
    its candidates."""
    paths = st.write_random_pair(str(tmp_path_factory.mktemp("stat-dflash2")), VOCAB, seed=2, target_std=0.4,
                                 draft_std=0.4, block_size=3, dflash2=True)
    return st.load_pair(*paths)


@pytest.mark.parametrize("kw, control", [(dict(method="dflash", draft_sampling=True), ("residual_p", 800)),
                                         (dict(method="ddtree", budget=5), ("own_row", 300))],
                         ids=["sampled-chain", "ddtree-budget5"])
def test_dflash2_sampled_output_follows_the_target_law(pair, dflash2_pair, law, kw, control):
    """A DFlash 2 drafter's sampled chain (q over the selector's candidates, min(1, p/q) with the residual) and its
    lattice trees (the tree walk) give the target's law; the planted bug is rejected on the same seeds."""
    target, drafter = dflash2_pair
    assert isinstance(drafter, DFlash2Drafter)
    with st.attention("dense"):
        drawn, stats = st.draw_samples(target, drafter, PROMPT, N_TOKENS, 1000, seed0=0, **kw, **WARP)
        p, _, outside, tv = st.chi_square(law.counts(drawn), law.probs)
        assert stats["drafts_per_round"] > MIN_DRAFTS_PER_ROUND, stats
        assert outside == 0 and p >= ALPHA, f"{kw}: p = {p:.3e}, TV = {tv:.4f}, {outside} outside the support"
        name, n = control
        with st.planted(name, kw["method"], kw.get("draft_sampling", False)):
            bad, _ = st.draw_samples(target, drafter, PROMPT, N_TOKENS, n, seed0=0, **kw, **WARP)
        bp, _, _, btv = st.chi_square(law.counts(bad), law.probs)
        assert bp < ALPHA, f"planted bug {name} not detected: p = {bp:.3e}, TV = {btv:.4f}"


@pytest.fixture(scope="module")
def gemma4_pair(tmp_path_factory):
    """A Gemma 4 target written by transformers (a sliding layer of window 2, a full one whose values are its keys)
    with a Gemma-style drafter; std 0.2 and seed 3 spread its law (52 sequences of 4 tokens, none above 0.18)."""
    paths = st.write_random_pair(str(tmp_path_factory.mktemp("stat-gemma4")), VOCAB, seed=3, target_std=0.2,
                                 draft_std=0.4, block_size=3, gemma=True)
    return st.load_pair(*paths)


def test_sampled_ddtree_on_a_gemma4_target_follows_the_law(gemma4_pair):
    """A Gemma 4 target: the prompt and the 4 new tokens cross its sliding window (2) in every round, so tree
    nodes past their depth must count the window along their path. Sampled ddtree follows the exact law, and the
    planted bugs are rejected: the window counted in cache slots, and a tree walk reading its own row's noise."""
    target, drafter = gemma4_pair
    assert target.config.sliding_window < len(PROMPT) + N_TOKENS
    kw = dict(method="ddtree", budget=5)
    with st.attention("dense"):
        law = st.exact_law(target, PROMPT, N_TOKENS, st.Sampling(**WARP))
        assert len(law.sequences) >= 12 and law.probs.max() < 0.4 and law.margin > 1e-5
        drawn, stats = st.draw_samples(target, drafter, PROMPT, N_TOKENS, 1000, seed0=0, **kw, **WARP)
        p, _, outside, tv = st.chi_square(law.counts(drawn), law.probs)
        assert stats["drafts_per_round"] > MIN_DRAFTS_PER_ROUND, stats
        assert outside == 0 and p >= ALPHA, f"p = {p:.3e}, TV = {tv:.4f}, {outside} outside the support"
        for control, samples in (("window_slots", 400), ("own_row", 300)):
            with st.planted(control, "ddtree", False):
                bad, _ = st.draw_samples(target, drafter, PROMPT, N_TOKENS, samples, seed0=0, **kw, **WARP)
            bp, _, _, btv = st.chi_square(law.counts(bad), law.probs)
            assert bp < ALPHA, f"planted bug {control} not detected: p = {bp:.3e}, TV = {btv:.4f}"
