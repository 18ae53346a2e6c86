"""The speculative methods end to end on random pairs: greedy dflash and ddtree equal greedy ar token for token,
compiled equals eager without recompiles and with one host read per round, the drafter's loader and pair checks,
bad input."""

import json
import os
import re
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn.attention.flex_attention import create_block_mask

import compiling
import cpu
from conftest import (PAIR_VOCAB, HostReads, compiled_equals_eager, pair_config, random_prompts, write_drafter,
                      write_target)
from ddtree import Engine, Speculation, generate, generate_batch
from drafter import DFlashDrafter
from loading import default_target_layer_ids
from model import Attention, Linear, Qwen3

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from checkpoints import checkpoint_tensors, dflash_config, random_dflash_weights, save_checkpoint  # noqa
from sampler import Sampling
from cli import grouped

VOCAB = PAIR_VOCAB  # small, so random drafts are often right and paths get accepted, compacted and extended


@pytest.fixture(scope="module")
def files(random_pair_files, tmp_path_factory):
    """The shared pair (its drafter: block 5) and drafters of blocks 3 and 8 for its target."""
    root, tc = tmp_path_factory.mktemp("drafters"), pair_config()
    paths = {"target": random_pair_files["target"], 5: random_pair_files["draft"]}
    for block in (3, 8):
        paths[block] = str(root / f"draft{block}")
        write_drafter(paths[block], tc, block_size=block, seed=block)
    return paths, tc


@pytest.fixture(scope="module")
def models(files):
    paths, _ = files
    target = Qwen3.from_pretrained(paths["target"], device="cpu")
    return target, {b: DFlashDrafter.from_pretrained(paths[b], device="cpu") for b in (3, 5, 8)}


def prompts(n, seed=0):
    return random_prompts(n, VOCAB, 30, seed)


def greedy(target, drafter, prompt, **kw):
    return generate(target, drafter, prompt, max_new_tokens=kw.pop("max_new_tokens", 30), stop_ids=[], **grouped(kw))


_AR = {}


def ar_tokens(target, prompt, max_new_tokens=30):
    """Greedy AR reference, computed once per prompt (eager decoding is the slow part of these tests)."""
    key = (tuple(prompt), max_new_tokens)
    if key not in _AR:
        _AR[key] = greedy(target, None, prompt, method="ar", max_new_tokens=max_new_tokens).tokens
    return _AR[key]


def test_greedy_dflash_equals_ar(models):
    target, drafters = models
    for block, drafter in drafters.items():
        for prompt in prompts(3, seed=block):
            ar = ar_tokens(target, prompt)
            res = greedy(target, drafter, prompt, method="dflash")
            assert res.tokens == ar, (block, prompt)
            assert res.stats["new_tokens"] == len(ar) and sum(res.stats["accepted"]) == len(ar) - 1


@pytest.mark.parametrize("budget", [1, 2, 7, 64, 512])
def test_greedy_ddtree_equals_ar(models, budget):
    target, drafters = models
    accepted = 0
    for prompt in prompts(3):
        ar = ar_tokens(target, prompt)
        res = greedy(target, drafters[5], prompt, method="ddtree", budget=budget)
        assert res.tokens == ar, prompt
        accepted += sum(res.stats["accepted"]) - res.stats["rounds"]
    if budget >= 7:
        assert accepted > 0  # drafts were accepted: compaction and context appends were exercised


def test_trees_accept_more_than_the_chain(models):
    target, drafters = models
    tau = {}
    for method, budget in (("dflash", None), ("ddtree", 64)):
        runs = [greedy(target, drafters[5], p, method=method, budget=budget) for p in prompts(3)]
        tau[method] = sum(sum(r.stats["accepted"]) for r in runs) / sum(r.stats["rounds"] for r in runs)
    assert tau["ddtree"] > tau["dflash"] >= 1.0


def test_stop_ids_and_limits_with_speculation(models):
    target, drafters = models
    prompt = prompts(1, seed=3)[0]
    ar = ar_tokens(target, prompt)
    stop = ar[12]
    res = generate(target, drafters[8], prompt, method="ddtree", budget=64, max_new_tokens=30, stop_ids=[stop])
    assert res.tokens == ar[:ar.index(stop) + 1]
    for n in (1, 2, 5):
        assert greedy(target, drafters[8], prompt, method="ddtree", budget=64, max_new_tokens=n).tokens == ar[:n]


def test_denoise_steps_run_and_stay_lossless(models):
    target, drafters = models
    prompt = prompts(1, seed=4)[0]
    ar = ar_tokens(target, prompt)
    for steps in (2, 3):
        assert greedy(target, drafters[8], prompt, method="ddtree", budget=16, denoise_steps=steps).tokens == ar
        assert greedy(target, drafters[5], prompt, method="dflash", denoise_steps=steps).tokens == ar


def test_show_tree_records_rounds(models):
    from cli import format_tree
    target, drafters = models
    res = greedy(target, drafters[5], [2, 3, 4], method="ddtree", budget=10, max_new_tokens=8, show_tree=True)
    tokens, parents, depths, path, length = res.trees[0]
    picture = format_tree(tokens, parents, accepted_rows=path[:length])
    assert picture.count("\n") >= 10 and "✓" in picture


# ----------------------------------------------------------------------------------------------------------------
# The position limit: every method reaches it, the last rounds drafting only the positions left


@pytest.fixture(scope="module")
def stating(files, tmp_path_factory):
    """stating(limit): the pair's target (same weights) stating `limit` positions (max_position_embeddings)."""
    _, tc = files
    targets = {}

    def target(limit):
        if limit not in targets:
            root = tmp_path_factory.mktemp(f"limit-{limit}")
            write_target(str(root), dict(tc, max_position_embeddings=limit))
            targets[limit] = Qwen3.from_pretrained(str(root), device="cpu")
        return targets[limit]
    return target


@pytest.mark.parametrize("limit, block, kw", [
    (48, 5, dict(method="dflash")), (128, 8, dict(method="dflash")), (128, 8, dict(method="ddtree", budget=1)),
    (48, 5, dict(method="ddtree", budget=4)), (128, 8, dict(method="ddtree", budget=64)),
    (48, 3, dict(method="ddtree", budget=7)), (48, 8, dict(method="dflash", temperature=0.8, draft_sampling=True)),
    (128, 8, dict(method="ddtree", budget=16, temperature=0.8)), (128, 8, dict(method="ddtree", budget="auto"))])
def test_every_method_reaches_the_position_limit(stating, models, monkeypatch, limit, block, kw):
    """prompt + max_new_tokens = the limit is served by every method, as ar serves it: a round near the limit
    drafts only the positions left (as z-lab's loop shortens its last blocks), so no verified row lies past the
    limit; greedy output equals ar's. The batch's second request stops short of the limit."""
    target, drafter = stating(limit), models[1][block]
    seen, verify = [], Engine.verify

    def spy(self, *args):
        out = verify(self, *args)
        seen.append(int(out[1].max()))
        return out

    monkeypatch.setattr(Engine, "verify", spy)
    n = 18
    long, short = (prompts(1, seed=block)[0] * limit)[:limit - n], prompts(1, seed=block)[0][:20]

    def run():
        return generate_batch(target, drafter, [long, short], max_new_tokens=n, stop_ids=[], seeds=[2, 3],
                              **grouped(kw))
    if kw.get("budget") == "auto":  # calibrate first: its dummy requests run where the run's requests do not
        run()
    seen.clear()
    res = run()
    assert [len(r.tokens) for r in res] == [n, n]
    assert max(seen, default=0) <= limit - 1 and (seen or kw.get("budget") == "auto")  # auto may choose ar
    if not kw.get("temperature"):
        assert [r.tokens for r in res] == [generate(target, None, p, method="ar", max_new_tokens=n, stop_ids=[]).tokens
                                           for p in (long, short)]


def test_compiled_equals_eager_without_recompiles(models):
    target, drafters = models
    cases = list(zip(prompts(3, seed=11), (20, 150, 150)))  # a short warm-up run, then 100+ rounds
    for method, budget in (("ddtree", 7), ("dflash", None)):
        runs = compiled_equals_eager(lambda c, compile: greedy(target, drafters[5], c[0], method=method, budget=budget,
                                                               max_new_tokens=c[1], compile=compile), cases)
        assert sum(r.stats["rounds"] for r in runs) >= 100, [r.stats["rounds"] for r in runs]


@pytest.fixture(scope="module")
def frozen_pair(tmp_path_factory):
    """For the max-autotune test: the shared pair's recipe with fewer layers (target 2, drafter 1; the same shapes
    per layer), its drafter of block 4 (the rows of the target's verify at B = 3: one set of matmul shapes for
    both to autotune) and of a seed whose drafts are often accepted, and a second target of that shape with other
    weights. A frozen graph inlines every layer and is compiled per engine, so its compiling grows with the layers."""
    root, tc = tmp_path_factory.mktemp("frozen-pair"), pair_config(layers=2)
    for name, seed in (("target", 0), ("other", 5)):
        write_target(str(root / name), tc, seed=seed)
    write_drafter(str(root / "draft"), tc, layers=1, block_size=4, seed=35)
    return (Qwen3.from_pretrained(str(root / "target"), device="cpu"),
            Qwen3.from_pretrained(str(root / "other"), device="cpu"),
            DFlashDrafter.from_pretrained(str(root / "draft"), device="cpu"))


def test_max_autotune_equals_eager_and_runs_its_own_models(frozen_pair, monkeypatch):
    # compile="max-autotune" on the CPU: frozen weights and autotuned matmuls (inductor's C++ GEMM templates or
    # oneDNN on prepacked weights, whichever wins), the same tokens as eager, one host read per round, nothing
    # recompiled; then the same settings on another target of the same shape (its weights frozen into graphs of its
    # own): its own eager tokens, and the options never left in inductor's global config.
    import torch._inductor.config as inductor
    target, other, drafter = frozen_pair
    cases = list(zip(prompts(3, seed=13), (10, 60, 60)))
    kw = dict(method="ddtree", budget=3)
    runs = compiled_equals_eager(lambda c, compile: greedy(target, drafter, c[0], max_new_tokens=c[1],
                                                           compile=compile, **kw), cases, "max-autotune")
    # Drafts were accepted (the acceptance compared is not only the bonus): the frozen drafter's context appends
    # and trees decide the rounds.
    assert sum(sum(r.stats["accepted"]) - r.stats["rounds"] for r in runs) >= 20
    # Its few-row matmuls ran on the linears' oneDNN copies (cpu.prepack_linears), the drafter's included.
    linears = [m for model in (target, drafter) for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    eager = greedy(other, drafter, cases[1][0], max_new_tokens=30, **kw).tokens
    assert eager != greedy(target, drafter, cases[1][0], max_new_tokens=30, **kw).tokens
    assert greedy(other, drafter, cases[1][0], max_new_tokens=30, compile="max-autotune", **kw).tokens == eager
    assert not inductor.freezing and not inductor.max_autotune
    # A run's first step, the one that can compile, checks every guard under the autotune options; the later
    # ones skip the guards and set nothing (compiling.guards).
    calls, guards = [], compiling.guards
    monkeypatch.setattr(compiling, "guards", lambda options, check: calls.append((options, check)) or
                        guards(options, check))
    res = greedy(other, drafter, cases[1][0], max_new_tokens=30, compile="max-autotune", **kw)
    assert res.tokens == eager
    options = cpu.AUTOTUNE_OPTIONS
    assert calls == [(options, True)] + [(options, False)] * (res.stats["rounds"] - 1)


def test_engine_decides_tree_builder_and_attention_once(models, monkeypatch):
    """Eager engines build trees with the paper's heap, compiled engines with the tensor builder; every engine hands
    its layers BlockMasks, and on the CPU gives its models' layers the CPU classes, which attend eagerly with SDPA
    over the mask materialized and in compiled rounds with our CPU kernel (float32 and bf16; FlexAttention
    otherwise); the CPU's prefill stays eager: chosen in the constructor, the same for every call."""
    from torch.nn.attention.flex_attention import BlockMask
    from draft_tree import build_tree, build_tree_heap
    target, drafters = models
    cpu.start_cpu_isa_probe.cache_clear()
    dense_attention, dense_calls = cpu.dense_attention, []
    monkeypatch.setattr(cpu, "dense_attention", lambda *a: dense_calls.append(1) or dense_attention(*a))
    for compile, builder in ((False, build_tree_heap), (True, build_tree)):
        for model in (target, drafters[5]):  # the models' own classes, before the engine
            for m in model.modules():
                m.__class__ = {cpu.CpuAttention: Attention, cpu.CpuLinear: Linear}.get(type(m), type(m))
        engine = Engine(target, drafters[5], "ddtree", Sampling(), Speculation(budget=4), 1024, compile)
        masks = (engine.prefill_mask, engine.decode_mask, *engine.draft_masks.values(), engine.verify_mask)
        assert engine.build_tree is builder and all(isinstance(m.set(3), BlockMask) for m in masks)
        assert not engine.prefill_compiled and engine.prefill_step.__func__ is Engine.prefill_step
        assert cpu.start_cpu_isa_probe.cache_info().currsize == int(bool(compile))  # started by compiled engines
        for model in (target, drafters[5]):
            assert {type(m) for m in model.modules() if isinstance(m, (Attention, Linear))} == {cpu.CpuAttention,
                                                                                                 cpu.CpuLinear}
    # compiled CPU engines load the attention kernel, and their float32 rounds run it (cpu.cpu_kernel_applies)
    assert cpu.cpu_kernel_loaded
    q = torch.zeros(1, 4, 5, target.config.head_dim)
    assert cpu.cpu_kernel_applies(q, target.layers[0].self_attn.k_cache, engine.verify_mask.block_mask)
    # an eager step (the prefill, eager in both) attends with SDPA over the mask materialized, on the prompt's rows:
    # materialized once for the forward's layers, its extent read once (apart from the first token's read)
    with torch.inference_mode(), HostReads() as reads:
        engine.start([[5, 6, 7]], [0])
    assert len(dense_calls) == len(target.layers) and engine.prefill_mask.q_len == 3
    assert (reads.count, reads.mask_extents) == (1, 1)


def test_compiled_sampling_equals_eager_without_recompiles(models):
    # The sampled paths compiled whole (warping, per-node samples from the seeded noise, the tree walk; the
    # chain's min(1, p/q) rule with its residual): the same tokens as eager for the same seed, across prompts.
    target, drafters = models
    settings = [dict(method="ddtree", budget=9, temperature=0.9, top_p=0.9),
                dict(method="dflash", temperature=1.1, top_k=6, draft_sampling=True)]
    for kw in settings:
        compiled_equals_eager(lambda p, compile: generate(target, drafters[5], p, max_new_tokens=40, stop_ids=[],
                                                          seed=3, compile=compile, **grouped(kw)), prompts(3, seed=12))


# ---- drafter loading and pair checks ---------------------------------------------------------------------------


def test_default_target_layer_ids_follow_dflash():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]


def test_real_shaped_drafter_config_gives_the_right_shapes():
    """Qwen3-8B-DFlash-b16's config, built on the meta device: the module shapes z-lab's tensors have."""
    from drafter import DFlashConfig
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
           "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
           "block_size": 16, "num_target_layers": 36,
           "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}
    with torch.device("meta"):
        d = DFlashDrafter(DFlashConfig.from_dict(raw))
    shapes = {k: tuple(v.shape) for k, v in checkpoint_tensors(d).items()}
    assert len(shapes) == 58
    assert shapes["fc.weight"] == (4096, 5 * 4096)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (8 * 128, 4096)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["hidden_norm.weight"] == (4096,) and shapes["norm.weight"] == (4096,)


def rewrite(path, config_edit=None, tensor_edit=None):
    if config_edit:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        config_edit(c)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(c, f)
    if tensor_edit:
        w = load_file(os.path.join(path, "model.safetensors"))
        tensor_edit(w)
        save_file(w, os.path.join(path, "model.safetensors"))


def broken_copy(tmp_path, files, block=5, **edits):
    import shutil
    paths, _ = files
    dst = str(tmp_path / "broken")
    shutil.copytree(paths[block], dst)
    rewrite(dst, **edits)
    return dst


@pytest.mark.parametrize("edit, message", [
    (dict(config_edit=lambda c: c.update(architectures=["Qwen3ForCausalLM"])), "not a DFlash drafter"),
    (dict(config_edit=lambda c: c.pop("block_size")), "block_size"),
    (dict(config_edit=lambda c: c["dflash_config"].pop("mask_token_id")), "mask_token_id"),
    (dict(tensor_edit=lambda w: w.pop("fc.weight")), "lacks"),
    (dict(tensor_edit=lambda w: w.update({"embed_tokens.weight": torch.zeros(2, 2)})), "unexpected tensor"),
    (dict(tensor_edit=lambda w: w.update({"norm.weight": torch.zeros(3)})), "shape"),
])
def test_broken_drafter_files_are_clear_errors(tmp_path, files, edit, message):
    with pytest.raises(ValueError, match=message):
        DFlashDrafter.from_pretrained(broken_copy(tmp_path, files, **edit), device="cpu")


def test_default_target_layer_ids_below_four_target_layers_are_named(tmp_path, files):
    """DFlash's default spreads the ids over target layers 1 .. num_target_layers - 3, a span empty below 4 layers:
    the ids it gives there are named (refused where out of range) with the file, not taken in silence."""
    def without_ids(c, **more):
        c["dflash_config"].pop("target_layer_ids", None)
        c.pop("target_layer_ids", None)
        c.update(more)

    said = "config.json: dflash_config gives no target_layer_ids, and DFlash's default for a {}-layer target"
    with pytest.warns(UserWarning, match=re.escape(said.format(3)) + r".* is \[1, 0\]"):
        DFlashDrafter.from_pretrained(broken_copy(tmp_path / "a", files, config_edit=without_ids), device="cpu")
    with pytest.raises(ValueError, match=re.escape(said.format(2)) + r".* is \[1, -1\]: out of range"):
        DFlashDrafter.from_pretrained(broken_copy(tmp_path / "b", files, config_edit=lambda c: without_ids(
            c, num_target_layers=2)), device="cpu")


@pytest.mark.parametrize("config_edit, message", [
    (lambda c: c["dflash_config"].update(mask_token_id=VOCAB), "mask_token_id 16 is not below the target vocab"),
    (lambda c: c.update(num_target_layers=4), "num_target_layers 4 != target num_hidden_layers 3"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 3]), "out of range"),
    (lambda c: c.update(vocab_size=32), "vocab_size 32 != target vocab_size 16"),
])
def test_mismatched_pairs_are_clear_errors(tmp_path, files, models, config_edit, message):
    target, _ = models
    drafter = DFlashDrafter.from_pretrained(broken_copy(tmp_path, files, config_edit=config_edit), device="cpu")
    with pytest.raises(ValueError, match=message):
        generate(target, drafter, [1, 2], method="ddtree", budget=4, max_new_tokens=4)


def test_hidden_size_mismatch_is_a_clear_error(tmp_path, files, models):
    target, _ = models
    _, tc = files
    other = dict(tc, hidden_size=32, head_dim=8)
    dc = dflash_config(other, layers=1, block_size=4, target_layer_ids=[0])
    save_checkpoint(str(tmp_path / "d"), dc, random_dflash_weights(dc))
    drafter = DFlashDrafter.from_pretrained(str(tmp_path / "d"), device="cpu")
    with pytest.raises(ValueError, match="drafter hidden_size 32 != target hidden_size 64"):
        generate(target, drafter, [1, 2], method="dflash", max_new_tokens=4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="ddtree", budget=0), "budget"),
    (dict(method="ddtree", budget=-3), "budget"),
    (dict(method="ddtree", budget=3.5), "budget must be an integer"),
    (dict(method="ddtree", budget=10**9), "budget 1000000000 is more than the tree builder can order over 16 tokens "
                                          "per depth"),
    (dict(method="ddtree", denoise_steps=0), "denoise_steps"),
    (dict(method="ddtree", draft_temperature=0.0), "draft_temperature"),
])
def test_bad_speculative_input(models, kwargs, message):
    target, drafters = models
    with pytest.raises((ValueError, TypeError), match=message):
        generate(target, drafters[5], [1, 2], max_new_tokens=4, **grouped(kwargs))


def test_method_needs_a_drafter(models):
    target, _ = models
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, None, [1, 2], method="dflash")


def test_compiled_engines_run_their_own_models(files, models, tmp_path, mode=True):
    # Compiled engines share graphs (compile=True: the weights are graph inputs; compile="max-autotune" on the CPU
    # holds them as constants, frozen, per engine): an engine must run its own models. Two targets of one shape
    # with different weights, alternated: each compiled output equals its own eager output, and once both
    # engines are warm, switching targets compiles nothing new. The settings are test_compiled_equals_eager's
    # ddtree ones (its graph, when it ran first in this process: this test then compiles nothing).
    from torch._dynamo.utils import counters
    _, tc = files
    write_target(str(tmp_path / "other"), tc, seed=5)
    target, drafters = models
    other = Qwen3.from_pretrained(str(tmp_path / "other"), device="cpu")
    prompt = prompts(1, seed=21)[0]
    kw = dict(method="ddtree", budget=7, max_new_tokens=12)
    eager = {id(t): greedy(t, drafters[5], prompt, **kw).tokens for t in (target, other)}
    assert eager[id(target)] != eager[id(other)]
    for t in (target, other):
        assert greedy(t, drafters[5], prompt, compile=mode, **kw).tokens == eager[id(t)]
    counters.clear()
    for t in (target, other, target):
        assert greedy(t, drafters[5], prompt, compile=mode, **kw).tokens == eager[id(t)]
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])


def test_compiled_batch_equals_eager_reuses_graphs_and_reads_once_per_round(models, monkeypatch):
    # A compiled batch (each request's prefix and [N, q, q] matrix read by the mask inside the graph) gives eager's
    # tokens. Run again with its requests in another order, it shrinks the same way (2 -> 1 when one request ends),
    # to the graph the first run compiled, compiles nothing new and reads the host once per round of the batch. The
    # settings are test_compiled_equals_eager's ddtree ones: a batch of one runs its graph.
    from torch._dynamo.utils import counters
    from test_batch import STOP, moves, ragged_prompts
    target, drafters = models
    resumed = moves(monkeypatch)
    run = lambda prompts, compile: generate_batch(target, drafters[5], prompts, method="ddtree", budget=7,
                                                  max_new_tokens=16, stop_ids=[STOP], compile=compile)
    first = ragged_prompts(2, seed=3)
    second = first[::-1]
    eager = [[r.tokens for r in run(prompts, False)] for prompts in (first, second)]
    assert [r.tokens for r in run(first, True)] == eager[0]
    counters.clear()
    resumed.clear()
    with HostReads() as reads:
        compiled = run(second, True)
    assert [r.tokens for r in compiled] == eager[1]
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    assert [b for b, _ in resumed] == [1], "the compiled batch did not shrink"
    # One read per round of the batch (the batch runs until its longest request ends) and one for the prefill.
    assert reads.count == max(r.stats["rounds"] for r in compiled) + 1


def test_guards_are_checked_at_each_runs_first_step(files, models, tmp_path, monkeypatch):
    # After a run's first step, a compiled engine's steps check only the guards that tell graphs apart
    # (Engine.step). Two targets with the same weights whose graphs differ only in a constant (the norms'
    # eps, folded into the graph; the weights are graph inputs, shared): each run's first step checks every guard,
    # so each compiled run recompiles or picks its own graph and gives its own eager tokens, alternated; once both
    # are compiled nothing recompiles. A run of R rounds skips the guards at R - 1 of them, and eager runs never.
    from torch._dynamo.utils import counters
    _, tc = files
    write_target(str(tmp_path / "eps"), dict(tc, rms_norm_eps=0.5))  # the shared target's weights
    target, _ = models
    other = Qwen3.from_pretrained(str(tmp_path / "eps"), device="cpu")
    prompt = prompts(1, seed=23)[0]
    eager = {id(t): greedy(t, None, prompt, method="ar", max_new_tokens=16).tokens for t in (target, other)}
    assert eager[id(target)] != eager[id(other)]
    skipped, set_stance = [], torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: skipped.append(k) or set_stance(*a, **k))
    for t in (target, other):
        assert greedy(t, None, prompt, method="ar", max_new_tokens=16, compile=True).tokens == eager[id(t)]
    counters.clear()
    for t in (target, other, target, other):
        skipped.clear()
        res = greedy(t, None, prompt, method="ar", max_new_tokens=16, compile=True)
        assert res.tokens == eager[id(t)]
        assert skipped == [{"skip_guard_eval_unsafe": True}] * (res.stats["rounds"] - 1)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    skipped.clear()
    greedy(other, None, prompt, method="ar", max_new_tokens=16)
    assert skipped == []


def test_sliding_window_drafter_layers_see_only_their_window(files, models, tmp_path):
    """A z-lab config whose layer_types name sliding_attention layers (drafters of hybrid targets), with
    use_sliding_window: as z-lab's `dflash` package masks them, those layers' block rows see the slots within
    sliding_window - 1 before their own and none after (causal, the default without is_causal), the others
    everything, as masks written by hand give; the window changes the drafts once the context outgrows it;
    generation stays lossless."""
    paths, tc = files
    target, _ = models
    window = 6
    dc = dflash_config(tc, layers=2, block_size=5, target_layer_ids=[0, 2])
    weights = random_dflash_weights(dc, seed=11, std=0.35)
    save_checkpoint(str(tmp_path / "plain"), dc, weights)
    save_checkpoint(str(tmp_path / "windowed"), {**dc, "layer_types": ["sliding_attention", "full_attention"],
                                                 "sliding_window": window, "use_sliding_window": True}, weights)
    plain, windowed = (DFlashDrafter.from_pretrained(str(tmp_path / name), device="cpu") for name in ("plain",
                                                                                                       "windowed"))
    assert windowed.config.attention == ((window, True), (None, False)) and plain.config.attention == ()
    prompt = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    drafts = {}
    with torch.inference_mode():
        for name, drafter in (("plain", plain), ("windowed", windowed)):
            drafter.bind(target)
            engine = Engine(target, drafter, "ddtree", Sampling(), Speculation(budget=4), 1024, False)
            bonus = torch.tensor(engine.start([prompt], [0]))
            start = torch.tensor([len(prompt)])
            drafts[name] = engine.draft(bonus, start)
        # the reference: the block's masks written out, as BlockMasks of those matrices (eager FlexAttention)
        bs = windowed.block_size
        slots, own = torch.arange(1024)[None, :], len(prompt) + torch.arange(bs)[:, None]
        full = (slots < len(prompt) + bs).expand(bs, -1)
        near = full & (own - slots >= 0) & (own - slots < window)
        written = {kind: create_block_mask(lambda b, h, q, kv, m=m: m[q, kv], None, None, bs, 1024, device="cpu")
                   for kind, m in (((window, True), near), ((None, False), full))}
        tokens = torch.cat([bonus[:, None], torch.full((1, bs - 1), windowed.config.mask_token_id)], 1)
        ref = windowed.logits(windowed(tokens, own.T, own.T, written, rows=slice(1, None)))
    torch.testing.assert_close(drafts["windowed"], ref[:, :drafts["windowed"].shape[1]], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(drafts["windowed"], drafts["plain"], atol=1e-3)
    ar = ar_tokens(target, prompt)
    assert greedy(target, windowed, prompt, method="ddtree", budget=8).tokens == ar
