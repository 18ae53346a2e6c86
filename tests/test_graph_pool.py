"""Under the CUDA graph output emulation (conftest.GraphPool: every step output is poisoned as soon as any step
runs again), every method, a shrinking batch and budget auto switching through plain decoding give exactly their
runs without it: no output of a compiled call is read after the next one."""

import pytest

import budget
import compiling
import ddtree
from budget import AutoBudget
from conftest import GraphPool, load_pair
from ddtree import generate_batch
from test_batch import STOP, ragged_prompts
from test_budget import GRID, SWITCHES, forced
from sampler import Sampling
from cli import grouped
from settings import Speculation


@pytest.fixture(scope="module")
def pair(random_pair_files, one_thread):
    return load_pair(random_pair_files)


RUNS = [("ar", dict(temperature=1.0)), ("dflash", {}), ("dflash", dict(temperature=0.9, draft_sampling=True)),
        ("ddtree", dict(budget=6)), ("ddtree", dict(budget=6, temperature=0.9, top_p=0.9))]


@pytest.mark.parametrize("method, kw", RUNS, ids=["ar-sampled", "dflash", "dflash-sampled", "ddtree",
                                                  "ddtree-sampled"])
def test_methods_and_shrinking_batches_read_no_stale_output(pair, monkeypatch, method, kw):
    target, drafter = pair[0], None if method == "ar" else pair[1]
    prompts, seeds = ragged_prompts(5, seed=7), list(range(40, 45))
    run = lambda: generate_batch(target, drafter, prompts, method=method, max_new_tokens=24, seeds=seeds,
                                 stop_ids=[STOP], max_batch=4, **grouped(kw))
    plain = [r.tokens for r in run()]
    ddtree._ENGINES.clear()
    pool = GraphPool().install(monkeypatch)
    assert [r.tokens for r in run()] == plain
    assert pool.poisoned > 0


def test_budget_auto_switching_through_plain_decoding_reads_no_stale_output(pair, monkeypatch, two_passes):
    target, drafter = pair
    monkeypatch.setattr(budget, "AUTO_BUDGETS", GRID)
    prompts = ragged_prompts(5, seed=3)
    run = lambda: generate_batch(target, drafter, prompts, budget="auto", max_new_tokens=40, stop_ids=[STOP],
                                 max_batch=4)
    monkeypatch.setattr(AutoBudget, "choose", forced(SWITCHES))
    plain = [r.tokens for r in run()]
    ddtree._ENGINES.clear()
    pool = GraphPool().install(monkeypatch)
    monkeypatch.setattr(AutoBudget, "choose", forced(SWITCHES))
    assert [r.tokens for r in run()] == plain
    assert pool.poisoned > 0


def test_warm_up_runs_each_step_until_cuda_graphs_have_recorded_it(pair, monkeypatch):
    # CUDA graph trees run a step's first call as a warm-up and record on the second: warm_up calls each step as
    # often as graph_warmup_calls says, so that no user's round pays the capture.
    from compiling import graph_warmup_calls
    from ddtree import Engine
    assert [graph_warmup_calls(c, d) for c, d in ((True, "cuda"), ("max-autotune", "cuda"), (True, "cpu"),
                                                 (False, "cuda"))] == [2, 2, 1, 1]
    target, drafter = pair
    monkeypatch.setattr(compiling, "graph_warmup_calls", lambda compile, device_type: 2)
    engine = Engine(target, drafter, "ddtree", Sampling(), Speculation(budget=6), 256, compile=False)
    calls = []
    for name in ("round", "prefill_step"):
        step = getattr(engine, name)
        setattr(engine, name, lambda *args, step=step, name=name: calls.append(name) or step(*args))
    engine.warm = False  # as a compiled engine starts
    engine.warm_up()
    assert calls.count("round") == 2 and calls.count("prefill_step") == 2, calls
