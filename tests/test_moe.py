"""Qwen3-MoE targets: logits equal to transformers' Qwen3MoeForCausalLM on tiny random checkpoints of every layout
(v4 and v5 config files, sparse steps, dense-only layers, top-k renormalized or not, tied, sharded), the three ways
rows meet their experts agree, the loader's errors, and the engine on a MoE target: greedy ar / dflash / ddtree
equal transformers' greedy tokens, compiled equals eager with one host read per round."""

import json
import os
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import cpu
from conftest import causal, compiled_equals_eager
from ddtree import generate
from drafter import DFlashDrafter
from model import Qwen3
from moe import SparseMoE
from tree_attn import PrefixMask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from checkpoints import dflash_config, random_dflash_weights, save_checkpoint  # noqa: E402

VOCAB = 96
TOL = 1e-4
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
            rope_theta=10000.0, max_position_embeddings=2048, eos_token_id=None, tie_word_embeddings=False)
VARIANTS = {
    "v5_step1": (dict(), None),
    "v4_config": (dict(norm_topk_prob=True), "v4"),
    "step2_mlp_only": (dict(decoder_sparse_step=2, mlp_only_layers=[0]), None),
    "norm_topk_tied": (dict(norm_topk_prob=True, tie_word_embeddings=True), None),
    "mha_sharded": (dict(num_key_value_heads=4, num_experts=8, num_experts_per_tok=3), "shard"),
}

pytestmark = pytest.mark.usefixtures("one_thread")


def make_hf(overrides, seed):
    torch.manual_seed(seed)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for p in hf.parameters():  # HF inits norms to 1 and projections small: perturb so mistakes show
            p.add_(torch.randn_like(p) * 0.2)
    return hf


def write(hf, path, how):
    hf.save_pretrained(path, max_shard_size="40KB" if how == "shard" else "5GB")
    if how == "v4":  # transformers 4.x: num_experts and a top-level rope_theta
        file = os.path.join(path, "config.json")
        c = json.load(open(file))
        c["num_experts"] = c.pop("num_local_experts")
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
        json.dump(c, open(file, "w"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, (name, (overrides, how)) in enumerate(VARIANTS.items()):
        path = str(tmp_path_factory.mktemp(name))
        hf = make_hf(overrides, seed=i + 1)
        write(hf, path, how)
        out[name] = (hf, path)
    return out


def ours_rows(m, ids, pos, slots, allow, start):
    cpu.use_cpu_classes(m)  # as an eager CPU engine attends
    mask = PrefixMask(len(ids), m.layers[0].self_attn.k_cache.shape[2], "cpu")
    with torch.no_grad():
        return m(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), mask.set(start, allow))[0]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(checkpoints, name):
    hf, path = checkpoints[name]
    if name == "mha_sharded":
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    m = Qwen3.from_pretrained(path, device="cpu")
    c = m.config
    assert c.moe.num_experts == hf.config.num_experts and c.moe.mlp_only_layers == tuple(hf.config.mlp_only_layers)
    assert [isinstance(layer.mlp, SparseMoE) for layer in m.layers] == \
        [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    m.setup_cache(256)
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # prefill of 14 rows (the all-experts path), then 6 decode steps (the gathered path: 1 row x top-k)
    prefill = ours_rows(m, ids[:14], range(14), range(14), causal(14), 0)
    assert (prefill - ref[:14]).abs().max() < TOL
    for s in range(14, 20):
        step = ours_rows(m, ids[s:s + 1], [s], [s], torch.ones(1, 1, dtype=torch.bool), s)
        assert (step[0] - ref[s]).abs().max() < TOL, s
    # a tree verify: root at 14, two children, a grandchild under the second: rows see their ancestors only
    tokens, parents, depth = [ids[14], 5, 7, 9], [-1, 0, 0, 2], [0, 1, 1, 2]
    allow = torch.eye(4, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            allow[i, p] = True
            p = parents[p]
    tree = ours_rows(m, tokens, [14 + d for d in depth], range(14, 18), allow, 14)
    for i in range(4):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        with torch.no_grad():
            want = hf(torch.tensor([ids[:14] + path[::-1]])).logits[0, -1]
        assert (tree[i] - want).abs().max() < TOL, i


@pytest.mark.parametrize("norm", [False, True])
def test_the_three_expert_paths_agree(norm):
    """Gathered pairs, all experts, and torch._grouped_mm (eager on the CPU in fp32) give the same rows."""
    torch.manual_seed(0)
    moe = SparseMoE(hidden=32, inter=16, experts=8, top_k=3, norm_topk_prob=norm)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        x = torch.randn(11, 32)
        ids, weights = moe.route(x)
        ref = torch.zeros_like(x)  # the definition, pair by pair
        for r in range(11):
            for k in range(3):
                e = moe.experts
                h = torch.nn.functional.silu(e.gate_proj[ids[r, k]] @ x[r]) * (e.up_proj[ids[r, k]] @ x[r])
                ref[r] += weights[r, k] * (e.down_proj[ids[r, k]] @ h)
        paths = [moe.gathered(x, ids, weights), moe.all_experts(x, ids, weights)]
        if hasattr(torch, "_grouped_mm"):
            paths.append(moe.grouped(x, ids, weights))
        for out in paths:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert moe(x[:2]).shape == (2, 32)  # 2 x 3 pairs <= 8 experts: the gathered path


def test_missing_or_misshapen_experts_are_clear_errors(checkpoints, tmp_path):
    _, path = checkpoints["v5_step1"]
    w = load_file(os.path.join(path, "model.safetensors"))
    for edit, message in ((lambda w: w.pop("model.layers.1.mlp.experts.4.up_proj.weight"), r"lacks experts \[4\]"),
                          (lambda w: w.update({"model.layers.0.mlp.experts.2.down_proj.weight": torch.zeros(3, 3)}),
                           "shape"),
                          (lambda w: w.update({"model.layers.0.mlp.experts.6.gate_proj.weight": torch.zeros(24, 48)}),
                           "names expert 6, config.json has 6 experts"),
                          (lambda w: w.pop("model.layers.2.mlp.gate.weight"), "lacks 1 tensors")):
        broken = tmp_path / f"b{len(os.listdir(tmp_path))}"
        broken.mkdir()
        for f in ("config.json", "generation_config.json"):
            if os.path.isfile(os.path.join(path, f)):
                (broken / f).write_text(open(os.path.join(path, f)).read())
        edited = dict(w)
        edit(edited)
        save_file(edited, str(broken / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            Qwen3.from_pretrained(str(broken), device="cpu")


@pytest.mark.parametrize("layout", ["v5_step1", "mha_sharded"])
def test_more_experts_than_the_files_hold_allocate_nothing(checkpoints, tmp_path, layout):
    """The stacked expert weights are sized by config.json: a count past the files' is refused from their headers
    before they are allocated."""
    _, path = checkpoints[layout]
    broken = tmp_path / "b"
    broken.mkdir()
    for f in os.listdir(path):
        os.symlink(os.path.join(path, f), broken / f)
    c = json.load(open(os.path.join(path, "config.json")))
    c["num_experts" if "num_experts" in c else "num_local_experts"] = 2**30
    os.remove(broken / "config.json")
    (broken / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="has shape"):
        Qwen3.from_pretrained(str(broken), device="cpu")


# ---- the engine on a MoE target --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(checkpoints, tmp_path_factory):
    hf, path = checkpoints["step2_mlp_only"]
    target = Qwen3.from_pretrained(path, device="cpu")
    tc = json.load(open(os.path.join(path, "config.json")))
    dc = dflash_config(dict(tc, rope_theta=10000.0), layers=1, block_size=5, target_layer_ids=[1, 0])
    draft_path = str(tmp_path_factory.mktemp("moe_draft"))
    save_checkpoint(draft_path, dc, random_dflash_weights(dc, seed=4, std=0.3))
    return hf, target, DFlashDrafter.from_pretrained(draft_path, device="cpu")


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_greedy_methods_give_transformers_tokens(pair):
    hf, target, drafter = pair
    for prompt in prompts(3):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 6), ("ddtree", 40)):
            res = generate(target, None if method == "ar" else drafter, prompt, method=method, budget=budget,
                           max_new_tokens=24, stop_ids=[])
            assert res.tokens == ref, (method, budget, prompt)


@pytest.mark.parametrize("method, budget", [("ar", None), ("ddtree", 8)])
def test_compiled_equals_eager_on_a_moe_target(pair, method, budget):
    """ar's decode step takes the gathered-experts path, ddtree's verify of 9 rows the all-experts path."""
    _, target, drafter = pair
    cases = list(zip(prompts(3, seed=5), (10, 60, 60)))
    runs = compiled_equals_eager(lambda c, compile: generate(target, drafter if method != "ar" else None, c[0],
                                                             method=method, budget=budget, max_new_tokens=c[1],
                                                             stop_ids=[], compile=compile), cases)
    assert sum(r.stats["rounds"] for r in runs) >= 20


def test_sampled_ddtree_on_a_moe_target_follows_the_law(capsys):
    """scripts/stat_test.py on a random MoE pair: the joint law of 3 sampled tokens (top-k 3 of 4) matches the
    enumerated target law, and the planted bug (each node compared with its own row's token) is rejected."""
    import stat_test
    code = stat_test.main(["--moe", "--method", "ddtree", "--budget", "4", "--temperature", "0.8", "--top-k", "3",
                           "--samples", "2000", "--control-samples", "600"])
    out = capsys.readouterr().out
    assert code == 0 and "RESULT: PASS" in out and "control  [own_row]" in out, out


def test_train_drafter_runs_on_a_moe_target(tmp_path):
    """`scripts/train.py drafter` on a MoE target (its batched feature pass goes through the sparse MLP), and the
    drafter it writes decodes losslessly with that target."""
    import shutil
    import train
    from checkpoints import moe_config, qwen3_config, random_qwen3_weights
    bundled = os.path.join(ROOT, "assets", "tiny-target")
    vocab = json.load(open(os.path.join(bundled, "config.json")))["vocab_size"]
    tc = moe_config(qwen3_config(vocab, hidden=64, inter=96, layers=3, heads=4, kv_heads=2, head_dim=16),
                    experts=4, top_k=2, inter=32)
    target_dir, draft_dir = str(tmp_path / "target"), str(tmp_path / "draft")
    save_checkpoint(target_dir, tc, random_qwen3_weights(tc, std=0.2))
    for f in os.listdir(bundled):
        if f.startswith("tokenizer"):
            shutil.copy(os.path.join(bundled, f), target_dir)
    train.main(["drafter", "--target", target_dir, "--out", draft_dir, "--layers", "1", "--block-size", "4",
                "--target-layers", "2,0", "--seq", "48", "--batch", "2", "--anchors", "4", "--greedy-seqs",
                "4", "--prompt-len", "16", "--eval-contexts", "4", "--eval-lengths", "16,24",
                "--eval-every", "2", "--save-every", "2", "--steps", "2", "--threads", "1"])
    target = Qwen3.from_pretrained(target_dir, device="cpu")
    drafter = DFlashDrafter.from_pretrained(os.path.join(draft_dir, "final"), device="cpu")
    assert drafter.config.target_layer_ids == [2, 0]
    ar = generate(target, None, list(range(5, 25)), method="ar", max_new_tokens=10, stop_ids=[]).tokens
    assert generate(target, drafter, list(range(5, 25)), method="ddtree", budget=6, max_new_tokens=10,
                    stop_ids=[]).tokens == ar


def test_expert_path_follows_the_compute_capability(monkeypatch):
    # torch._grouped_mm's fast path is sm90 / sm100 only; elsewhere it syncs with the host and breaks capture.
    from moe import device_capability, expert_path
    cuda = torch.device("cuda")
    for capability, want in (((8, 0), "gathered"), ((8, 9), "gathered"), ((9, 0), "grouped"), ((10, 0), "grouped"),
                             ((12, 0), "gathered")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        assert expert_path("cuda", torch.bfloat16, device_capability(cuda), 8, 128) == want, capability
        if want == "gathered":  # many pairs: every expert
            assert expert_path("cuda", torch.bfloat16, device_capability(cuda), 256, 128) == "all_experts"
    assert expert_path("cuda", torch.float32, (9, 0), 8, 128) == "gathered"
    assert expert_path("cpu", torch.bfloat16, device_capability(torch.device("cpu")), 8, 128) == "gathered"


def test_pairs_are_combined_in_a_fixed_order_in_float32():
    # Pair outputs sorted by expert go back to their rows and each row's top-k are summed in float32, k in order:
    # the bits of a bf16 sum cannot depend on the order atomics arrive in.
    from moe import combine_pairs
    g = torch.Generator().manual_seed(0)
    rows, top_k, hidden = 37, 8, 64
    pair_out = (torch.randn(rows * top_k, hidden, generator=g) * 3).bfloat16()
    order = torch.randperm(rows * top_k, generator=g)
    got = combine_pairs(pair_out[order], order, rows, top_k)
    want = pair_out.view(rows, top_k, hidden).float()
    total = want[:, 0]
    for k in range(1, top_k):
        total = total + want[:, k]
    assert got.dtype == torch.float32 and torch.equal(got, total)
