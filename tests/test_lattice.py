"""DDTree over DFlash 2's selector lattice (dflash2.Lattice): the heap builds the best tree (checked by
enumerating every prefix), the tensor builder equals the heap bit for bit, and the engine with a DFlash 2 drafter
is lossless: greedy ddtree and dflash equal ar, sampled runs of a batch equal their lone runs, budget auto gives
ar's tokens, a round traces whole."""

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import cpu
import dflash2
import draft_tree as dt
from conftest import PAIR_VOCAB, REPO_ROOT, pair_config, random_prompts, write_drafter
from ddtree import Engine, Speculation, generate, generate_batch
from drafter import DFlashDrafter
from model import Qwen3

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from checkpoints import DFLASH2  # noqa: E402
from sampler import Sampling  # noqa: E402
from cli import grouped  # noqa: E402

VOCAB = PAIR_VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")


def random_lattice(gen, N, L, K, V=40, ties=False):
    tokens = torch.stack([torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(L)]) for _ in range(N)])
    scores = torch.randn(N, L, K, K, generator=gen) * 2
    if ties:
        scores = scores.round()
    scores[:, 0] = scores[:, 0, :1]  # position 0 follows the anchor alone: its rows are equal
    return tokens, torch.log_softmax(scores, -1)


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 5), K=st.integers(1, 5), budget=st.integers(1, 40), ties=st.booleans(),
       seed=st.integers(0, 10**6))
def test_tensor_builder_equals_the_heap(L, K, budget, ties, seed):
    tokens, logq = random_lattice(torch.Generator().manual_seed(seed), 3, L, K, ties=ties)
    for a, b in zip(dflash2.build_lattice_tree_heap(tokens, logq, budget),
                    dflash2.build_lattice_tree(tokens, logq, budget)):
        assert torch.equal(a, b)


def prefixes(tokens, logq):
    """Every prefix of the lattice with its probability: {(candidate index per depth): p}."""
    L, K = tokens.shape
    out = {}
    for depth in range(1, L + 1):
        for path in itertools.product(range(K), repeat=depth):
            states = (0,) + path
            out[path] = math.exp(sum(float(logq[d, states[d], path[d]]) for d in range(depth)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_heap_tree_is_the_best_tree(seed):
    """The tree's nodes are the `budget` most probable prefixes of the lattice (enumerated), each appearing once
    with its own tokens, parents and depth: the tree of largest expected acceptance."""
    gen = torch.Generator().manual_seed(seed)
    L, K, budget = 3, 3, 11
    tokens, logq = random_lattice(gen, 1, L, K)
    tokens, logq = tokens[0], logq[0]
    tree_tokens, parents, depths = dflash2.build_lattice_tree_heap(tokens, logq, budget)
    all_p = prefixes(tokens, logq)
    best = sorted(all_p.values(), reverse=True)[:budget]
    # each node's token path from the root, matched back to the candidate indices it came from
    paths = []
    for i in range(budget):
        path, row = [], i + 1
        while row:
            path.append(int(tree_tokens[row - 1]))
            row = int(parents[row - 1])
        paths.append(tuple(tokens[d].tolist().index(t) for d, t in enumerate(reversed(path))))
    assert len(set(paths)) == budget and [len(p) for p in paths] == depths.tolist()
    assert sorted((all_p[p] for p in paths), reverse=True) == pytest.approx(best, rel=1e-5)


@pytest.fixture(scope="module")
def models(random_pair_files, tmp_path_factory):
    """The shared pair's target with a DFlash 2 drafter (block 6, a selector over 4 candidates)."""
    draft = str(tmp_path_factory.mktemp("dflash2") / "draft")
    write_drafter(draft, pair_config(), block_size=6, seed=4, dflash2=dict(DFLASH2, selector_top_k=4))
    target = Qwen3.from_pretrained(random_pair_files["target"], device="cpu")
    return target, DFlashDrafter.from_pretrained(draft, device="cpu").bind(target)


def greedy(target, drafter, prompt, **kw):
    return generate(target, drafter, prompt, max_new_tokens=kw.pop("max_new_tokens", 30), stop_ids=[], **grouped(kw))


def test_dflash2_greedy_is_lossless_and_trees_accept_more(models):
    target, drafter = models
    assert isinstance(drafter, dflash2.DFlash2Drafter)
    taus = {}
    for prompt in random_prompts(3, VOCAB, 20, seed=1):
        ar = greedy(target, None, prompt, method="ar").tokens
        for method, budget in (("dflash", None), ("ddtree", 4), ("ddtree", 32)):
            res = greedy(target, drafter, prompt, method=method, budget=budget)
            assert res.tokens == ar, (method, budget)
            taus.setdefault((method, budget), []).append(res.stats["tau"])
    mean = {k: sum(v) / len(v) for k, v in taus.items()}
    assert mean[("ddtree", 32)] > mean[("dflash", None)] > 1, mean


def test_dflash2_sampled_batch_equals_lone_runs(models):
    """Sampled chains (q over the selector's candidates) and trees: request i of a batch is the lone run with its
    seed, draw for draw."""
    target, drafter = models
    prompts = random_prompts(3, VOCAB, 20, seed=2)
    for kw in (dict(method="dflash", draft_sampling=True), dict(method="ddtree", budget=16)):
        batch = generate_batch(target, drafter, prompts, temperature=0.9, seeds=[5, 6, 7], max_new_tokens=20,
                               stop_ids=[], **grouped(kw))
        for prompt, seed, res in zip(prompts, (5, 6, 7), batch):
            lone = generate(target, drafter, prompt, temperature=0.9, seed=seed, max_new_tokens=20, stop_ids=[],
                            **grouped(kw))
            assert res.tokens == lone.tokens, kw


def test_dflash2_budget_auto_gives_ar_tokens(models):
    target, drafter = models
    prompt = random_prompts(1, VOCAB, 20, seed=3)[0]
    ar = greedy(target, None, prompt, method="ar", max_new_tokens=40).tokens
    assert greedy(target, drafter, prompt, budget="auto", max_new_tokens=40).tokens == ar


def test_dflash2_round_traces_whole(models, monkeypatch):
    """A sampled ddtree round with a DFlash 2 drafter (convolutions, selector, lattice tree) traces as one graph
    with no host read (aot_eager: dynamo's and AOT's trace without inductor's minutes of C++ builds) and gives
    eager's round."""
    target, drafter = models
    prompt = random_prompts(1, VOCAB, 20, seed=4)[0]
    monkeypatch.setattr(cpu, "EAGER_CPU_ATTENTION", "kernel")  # the eager round attends as the traced one
    torch._dynamo.reset()  # the nested layer regions traced by earlier compiled tests are not this model's
    engine = Engine(target, drafter, "ddtree", Sampling(temperature=0.8), Speculation(budget=16), 1024,
                    compile=False)
    engine.build_tree = dt.build_tree  # the tensor builders, as a compiled engine's
    outs = []
    for round_fn in (engine.round, torch.compile(engine.round, backend="aot_eager", fullgraph=True)):
        with torch.inference_mode():
            engine.start([prompt], [3])
            outs.append(round_fn(engine.requests.token, engine.requests.position, *engine.randomness()))
    for a, b in zip(outs[0][:4], outs[1][:4]):
        assert torch.equal(a, b)


def test_dflash2_kernel_reaching_past_the_block_is_refused_at_load(random_pair_files, models, tmp_path):
    """A convolution's taps reach back over the block's rows only: conv_kernel_size up to block_size + 1 runs
    (the last tap meets only the zeros before the block; greedy dflash then gives ar's tokens), one more is
    refused when the drafter loads, not in its first round."""
    target = models[0]
    prompt = random_prompts(1, VOCAB, 12, seed=5)[0]
    for kernel in (7, 8):  # block_size 6
        draft = str(tmp_path / f"kernel{kernel}")
        write_drafter(draft, pair_config(), block_size=6, seed=4,
                      dflash2=dict(DFLASH2, conv_kernel_size=kernel, selector_top_k=4))
        if kernel == 8:
            with pytest.raises(ValueError, match=r"config.json: conv_kernel_size=8 is larger than block_size \+ 1"):
                DFlashDrafter.from_pretrained(draft, device="cpu")
            continue
        drafter = DFlashDrafter.from_pretrained(draft, device="cpu").bind(target)
        ar = greedy(target, None, prompt, method="ar", max_new_tokens=12).tokens
        assert greedy(target, drafter, prompt, method="dflash", max_new_tokens=12).tokens == ar


def test_dflash2_sampled_chain_in_float64(random_pair_files, models):
    """Drafts drawn from the selector's laws in a float64 engine: q is kept in the scores' dtype (a float32
    buffer failed to take it), and a batch's requests equal their lone runs."""
    target = Qwen3.from_pretrained(random_pair_files["target"], device="cpu", dtype=torch.float64)
    drafter = DFlashDrafter.from_pretrained(models[1].path, device="cpu", dtype=torch.float64).bind(target)
    gen = torch.Generator().manual_seed(0)
    tokens, scores = random_lattice(gen, 2, 3, 4, V=VOCAB)
    lattice = dflash2.Lattice(tokens, scores.double())
    tokens, q = dflash2.walk_lattice(lattice, 3, VOCAB, temperature=0.7, noise=torch.rand(2, 3, generator=gen))
    assert q.dtype == torch.float64 and torch.allclose(q.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    assert torch.all(q.gather(-1, tokens[..., None]) > 0)
    prompts = random_prompts(2, VOCAB, 12, seed=6)
    kw = dict(method="dflash", temperature=0.9, max_new_tokens=12, stop_ids=[], **grouped(dict(draft_sampling=True)))
    batch = generate_batch(target, drafter, prompts, seeds=[1, 2], **kw)
    assert [r.tokens for r in batch] == [generate(target, drafter, p, seed=s, **kw).tokens
                                         for p, s in zip(prompts, (1, 2))]


def test_a_dflash1_run_never_imports_dflash2():
    """DFlash 2 is a module applied after load: loading the bundled DFlash 1 drafter and decoding with it (greedy
    ddtree and dflash) imports no dflash2, while DFlashDrafter.from_pretrained hands the bundled DFlash 2 checkpoint
    over to it."""
    code = ("import sys\n"
            "from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET, generate\n"
            "from drafter import DFlashDrafter\n"
            "from model import Qwen3\n"
            "target, drafter = Qwen3.from_pretrained(DEFAULT_TARGET), DFlashDrafter.from_pretrained(DEFAULT_DRAFT)\n"
            "for kw in (dict(method='ddtree', budget=8), dict(method='dflash')):\n"
            "    generate(target, drafter, list(range(10, 20)), max_new_tokens=4, **kw)\n"
            "print('dflash2' in sys.modules)\n"
            "two = DFlashDrafter.from_pretrained(DEFAULT_DRAFT + '2')\n"
            "print('dflash2' in sys.modules, type(two).__module__, type(two).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "True", "dflash2", "DFlash2Drafter"], out.stdout + out.stderr[-2000:]
