"""Hybrid targets end to end (Gated DeltaNet + gated attention, Qwen3.5's layout written by transformers): greedy
ar equals transformers' greedy decoding; greedy dflash and ddtree equal ar token for token while accepting deep
paths (so trees really run through the recurrent layers and commit their states); a batch equals its lone runs,
greedy and seeded; compiled equals eager with one host read per round and no recompile; budget auto gives AR's
tokens through every switch."""

import os
import sys

import pytest
import torch

from conftest import random_prompts
from ddtree import generate, generate_batch
from drafter import DFlashDrafter
from model import Qwen3

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from checkpoints import dflash_config, random_dflash_weights, save_checkpoint  # noqa: E402
from cli import grouped

transformers = pytest.importorskip("transformers")

VOCAB = 4  # tiny, and a drafter of nearly flat laws: its trees hold most short paths, so deep ones get accepted


def hybrid_config(interval: int = 2, layers: int = 4) -> "transformers.Qwen3_5TextConfig":
    return transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=interval,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def random_hybrid(config, seed: int, std: float):
    """transformers' model with every parameter random (norm weights and decay parameters away from their
    initial values), in float64."""
    torch.manual_seed(seed)
    hf = transformers.Qwen3_5ForCausalLM(config).double().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, std)
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)  # decays exp(-exp(A_log) softplus(.)) from strong to mild
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    hf = random_hybrid(hybrid_config(), seed=0, std=0.35)
    hf.save_pretrained(str(root / "target"))
    tc = hf.config.to_dict()
    dc = dflash_config({**tc, "rope_theta": 10000.0}, layers=2, block_size=6, target_layer_ids=[0, 1, 2])
    save_checkpoint(str(root / "draft"), dc, random_dflash_weights(dc, seed=3, std=0.05))
    target = Qwen3.from_pretrained(str(root / "target"), device="cpu", dtype=torch.float64)
    drafter = DFlashDrafter.from_pretrained(str(root / "draft"), device="cpu", dtype=torch.float64)
    return hf, target, drafter, root


def prompts(n, seed=0):
    return random_prompts(n, VOCAB, 20, seed)


def greedy(target, drafter, prompt, **kw):
    return generate(target, drafter, prompt, max_new_tokens=kw.pop("max_new_tokens", 24), stop_ids=[], **grouped(kw))


def transformers_greedy(hf, prompt, n):
    """Greedy tokens from full forwards without a cache: the reference's plainest path (its `generate` would take
    token 0 of these 4-token prompts for padding unless given an attention mask)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_hybrid_greedy_ar_equals_transformers(pair):
    hf, target, _, _ = pair
    for prompt in prompts(3, seed=1):
        assert greedy(target, None, prompt, method="ar").tokens == transformers_greedy(hf, prompt, 24), prompt


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 4), ("ddtree", 64)])
def test_hybrid_greedy_speculation_equals_ar_and_accepts_deep_paths(pair, method, budget):
    _, target, drafter, _ = pair
    deepest, rounds, new = 0, 0, 0
    for prompt in prompts(3, seed=2):
        ar = greedy(target, None, prompt, method="ar").tokens
        res = greedy(target, drafter, prompt, method=method, budget=budget)
        assert res.tokens == ar, (method, budget, prompt)
        deepest, rounds, new = max(deepest, max(res.stats["accepted"])), rounds + res.stats["rounds"], \
            new + res.stats["new_tokens"]
    # a test whose trees never accept beyond the root would prove nothing about the recurrent commit
    assert deepest >= 4, (method, budget, deepest)
    print(f"{method} B={budget}: tau {new / rounds:.2f}, deepest path {deepest}")


def test_hybrid_batch_equals_lone_runs(pair, monkeypatch):
    """Requests of different lengths, ending at different rounds, in one batch that shrinks as they end (moving
    their recurrent states with their cache rows) give their lone runs' tokens, greedy and seeded."""
    import batch as batching
    import ddtree
    _, target, drafter, _ = pair
    resumed = []
    move = batching.move_to_smaller

    def moved(*args):
        smaller, rows, seconds = move(*args)
        resumed.append(smaller.batch)
        return smaller, rows, seconds

    monkeypatch.setattr(batching, "move_to_smaller", moved)
    init, warmed = ddtree.Engine.__init__, []

    def cold(engine, *args, **kwargs):  # every engine starts as a compiled one does: needing its warm-up, whose
        init(engine, *args, **kwargs)   # dummy request runs in every row of the smaller engine mid-run
        engine.warm = False
        warm_up = engine.warm_up
        engine.warm_up = lambda: (warmed.append(engine.batch), warm_up())[1]

    ps = prompts(4, seed=4)
    for kw in (dict(), dict(temperature=1.0, top_p=0.9)):
        seeds = list(range(10, 14))
        common = dict(method="ddtree", budget=8, max_new_tokens=30, stop_ids=[2], **kw)
        lone = [generate(target, drafter, p, seed=s, **grouped(common)).tokens for p, s in zip(ps, seeds)]
        assert len({len(t) for t in lone}) > 1, lone  # they end at different rounds
        for cold_engines in (False, True):
            ddtree._ENGINES.clear()
            if cold_engines:
                monkeypatch.setattr(ddtree.Engine, "__init__", cold)
            batch = generate_batch(target, drafter, ps, seeds=seeds, max_batch=4, **grouped(common))
            assert [r.tokens for r in batch] == lone, (kw, cold_engines)
        monkeypatch.setattr(ddtree.Engine, "__init__", init)
    assert resumed, "the batch never shrank"
    assert len(warmed) > 2, warmed  # smaller engines were warmed up mid-run


def test_hybrid_budget_auto_equals_ar_through_every_switch(pair, monkeypatch):
    """Budget auto forced through plain decoding, the chain and trees mid-request: AR's tokens. (Plain decoding
    keeps the drafter's context as it goes: a catch-up would run tokens through the recurrent state twice.)"""
    import itertools
    import budget
    _, target, drafter, _ = pair
    monkeypatch.setattr(budget, "AUTO_BUDGETS", (2, 6))
    # the schedule is forced: the calibration's timings would choose nothing here
    monkeypatch.setattr(budget, "calibrate",
                        lambda engines, *_: dict(budget.UNKNOWN_HOW, round_s={budget.name(c): 0.01 for c in engines}))
    cycle = itertools.cycle(["ar", "chain", 6, "ar", "ar", 2, "chain", "ar", 6, 6, 2])
    monkeypatch.setattr(budget.AutoBudget, "choose", lambda self: (next(cycle), False))
    ps = prompts(3, seed=5)
    ar = generate_batch(target, None, ps, method="ar", max_new_tokens=24, stop_ids=[])
    auto = generate_batch(target, drafter, ps, budget="auto", max_new_tokens=24, stop_ids=[], max_batch=2)
    assert [r.tokens for r in auto] == [r.tokens for r in ar]
    assert {c for r in auto for c in r.stats["auto"]["schedule"]} == {"ar", "chain", "2", "6"}


def test_hybrid_compiled_equals_eager_without_recompiles(pair, one_thread):
    """The compiled round (trees through the recurrent layers, the commit inside it) gives eager's tokens, with one
    host read per round, no graph break and no new graph after the first run."""
    from conftest import compiled_equals_eager
    root = pair[3]  # float32: compiled FlexAttention on the CPU takes no float64
    target = Qwen3.from_pretrained(str(root / "target"), device="cpu")
    drafter = DFlashDrafter.from_pretrained(str(root / "draft"), device="cpu")
    cases = prompts(3, seed=6)
    runs = compiled_equals_eager(lambda p, compile: greedy(target, drafter, p, method="ddtree", budget=16,
                                                           compile=compile), cases)
    assert max(max(r.stats["accepted"]) for r in runs) >= 3


def test_hybrid_moe_in_the_hub_layout_speculation_equals_ar(tmp_path):
    """A Qwen3.5-MoE target (shared expert; attention every second layer) saved as the hub saves it
    (Qwen3_5ForConditionalGeneration: text weights under model.language_model.*, a vision tower): greedy dflash
    and ddtree give AR's tokens and accept paths several drafts deep."""
    import json
    from checkpoints import hybrid_text_config, random_hybrid_model, save_hybrid
    hf = random_hybrid_model(hybrid_text_config(moe=True, vocab_size=VOCAB, full_attention_interval=2), moe=True,
                             seed=2, std=0.35)
    save_hybrid(hf, str(tmp_path / "target"), layout="conditional_generation")
    tc = json.load(open(tmp_path / "target" / "config.json"))["text_config"]
    dc = dflash_config({**tc, "rope_theta": 10000.0, "intermediate_size": 48}, layers=2, block_size=6,
                       target_layer_ids=[0, 1, 3])
    save_checkpoint(str(tmp_path / "draft"), dc, random_dflash_weights(dc, seed=3, std=0.05))
    target = Qwen3.from_pretrained(str(tmp_path / "target"), device="cpu", dtype=torch.float64)
    drafter = DFlashDrafter.from_pretrained(str(tmp_path / "draft"), device="cpu", dtype=torch.float64)
    deepest = 0
    for prompt in prompts(2, seed=7):
        ar = greedy(target, None, prompt, method="ar").tokens
        for kw in (dict(method="dflash"), dict(method="ddtree", budget=64)):
            res = greedy(target, drafter, prompt, **kw)
            assert res.tokens == ar, (kw, prompt)
            deepest = max(deepest, max(res.stats["accepted"]))
    assert deepest >= 4


def test_hybrid_steps_read_no_stale_output(pair, monkeypatch):
    """Under the CUDA graph output emulation (conftest.GraphPool), a shrinking batch of sampled ddtree requests on
    the hybrid target gives the same tokens: nothing of the recurrent commit reads a step's output after the next
    step ran."""
    import ddtree
    from conftest import GraphPool
    _, target, drafter, _ = pair
    ps, seeds = prompts(4, seed=8), [1, 2, 3, 4]
    run = lambda: [r.tokens for r in generate_batch(target, drafter, ps, method="ddtree", budget=8, max_new_tokens=20,
                                                    seeds=seeds, stop_ids=[3], max_batch=4,
                                                    temperature=1.0)]
    plain = run()
    assert len({len(t) for t in plain}) > 1 and max(map(len, plain)) >= 10, plain  # they end at different rounds
    ddtree._ENGINES.clear()
    pool = GraphPool().install(monkeypatch)
    assert run() == plain and pool.poisoned > 0


def test_hybrid_series_solve_in_the_engine_equals_ar(pair, monkeypatch):
    """With the tree rule's solve as the finite series (gated_delta.TREE_SOLVE = "series", sized by the engine's
    depth bound), greedy ddtree still gives AR's tokens while accepting deep paths."""
    import gated_delta
    _, target, drafter, _ = pair
    monkeypatch.setattr(gated_delta, "TREE_SOLVE", "series")
    steps, series = [], gated_delta._solve_series
    monkeypatch.setattr(gated_delta, "_solve_series",
                        lambda A, rhs, depth: steps.append(depth) or series(A, rhs, depth))
    deepest = 0
    for prompt in prompts(3, seed=2):
        res = greedy(target, drafter, prompt, method="ddtree", budget=64)
        assert res.tokens == greedy(target, None, prompt, method="ar").tokens, prompt
        deepest = max(deepest, max(res.stats["accepted"]))
    assert deepest >= 5
    assert set(steps) == {drafter.block_size - 1}  # the series ran, as deep as a draft can go


def test_bf16_hybrid_moe_ddtree_equals_ar(tmp_path, one_thread):
    """In bf16, where one rounding can flip an argmax, greedy ddtree gives ar's tokens on a random hybrid MoE:
    the tree's conv sums each row's taps in the chain's order, in float32, so a tree row's conv output is the
    chain's bit for bit (with the taps summed in bf16 in the tree's own order, ddtree left ar on the first prompt
    here; on 16 of 16 runs of 48 tokens at B = 16 and 64, docs/benchmarks.md)."""
    from checkpoints import hybrid_text_config, random_hybrid_model, save_hybrid
    hf = random_hybrid_model(hybrid_text_config(moe=True), moe=True, seed=0)
    save_hybrid(hf, str(tmp_path / "target"))
    tc = dict(hf.config.to_dict(), rope_theta=10000.0, intermediate_size=96)
    dc = dflash_config(tc, layers=1, block_size=8, target_layer_ids=[1, 2])
    save_checkpoint(str(tmp_path / "draft"), dc, random_dflash_weights(dc, seed=3, std=0.05))
    target = Qwen3.from_pretrained(str(tmp_path / "target"), device="cpu", dtype=torch.bfloat16)
    drafter = DFlashDrafter.from_pretrained(str(tmp_path / "draft"), device="cpu", dtype=torch.bfloat16)
    for prompt in random_prompts(2, 256, 20, seed=1):
        ar = greedy(target, None, prompt, method="ar", max_new_tokens=24)
        tree = greedy(target, drafter, prompt, budget=16, max_new_tokens=24)
        assert tree.tokens == ar.tokens


class OnlyTarget:
    """A target that shows the engine only the members ddtree.Target lists, and a recurrent model's `recurrent` and
    hooks (settings.RECURRENT_HOOKS): any other is an AttributeError."""

    def __init__(self, model):
        import ddtree
        import settings
        self.model = model
        self.members = {n for n in [*vars(ddtree.Target), *ddtree.Target.__annotations__] if not n.startswith("_")}
        if model.recurrent:
            self.members |= {"recurrent", *settings.RECURRENT_HOOKS}

    def __getattr__(self, name):
        if name not in self.members:
            raise AttributeError(f"the engine asked the target for {name!r}, which ddtree.Target does not list")
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def test_the_engine_asks_of_a_target_only_what_ddtree_target_lists(pair, monkeypatch):
    """A batch that shrinks as its requests end (moving caches and recurrent states), on a hybrid target seen
    through ddtree.Target's members alone, gives the tokens of the real target's run."""
    import batch as batching
    import ddtree
    _, target, drafter, _ = pair
    seen = OnlyTarget(target)
    ps, stop = prompts(3, seed=9), {0}  # one request ends at its first round, the two others run on
    moved, move = [], batching.move_to_smaller
    monkeypatch.setattr(batching, "move_to_smaller", lambda *args: moved.append(args[0].batch) or move(*args))
    for method, budget in (("ddtree", 8), ("dflash", None), ("ar", None)):
        spec = ddtree.Speculation(budget=budget)
        d = drafter if method != "ar" else None

        def engine_for(longest, size, method=method, spec=spec, d=d):
            length = ddtree.cache_length(longest, 30, method, spec, d)
            return ddtree.get_engine(seen, d, method, ddtree.Sampling(), spec, length, False, size)

        real = generate_batch(target, d, ps, method=method, budget=budget, max_new_tokens=30, stop_ids=[0])
        with torch.inference_mode():  # the drafter is bound to the target (its embedding and head) by now
            results = batching.run(engine_for, ps, [0, 1, 2], stop, 30, max_batch=4)
        assert [r.tokens for r in results] == [r.tokens for r in real], method
        assert moved.count(4) == 2, "the batch never shrank"  # the real run and the one through ddtree.Target
        moved.clear()
