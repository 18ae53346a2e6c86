"""DFlash 1 and DFlash 2 drafters against z-lab's own `dflash` package (0.1.0, installed --no-deps): the test
reference for drafters, as transformers is for targets. Random checkpoints written by the reference's modules in
its format (DFlash 2's codebooks stored without `.weight`), a random Qwen3 target written by transformers, all in
float64: our drafter's block outputs and logits equal DFlashDraftModel's / DFlash2DraftModel's, our selector's
laws equal CandidateSelector's along its own sampled path, and generate(method="dflash") drafts what
dflash_generate drafts, round for round."""

import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import cpu
from conftest import float64_kept
from ddtree import generate
from dflash2 import DFlash2Drafter, walk_lattice
from drafter import DFlashDrafter
from model import Qwen3
from tree_attn import PrefixMask

transformers = pytest.importorskip("transformers")
reference = pytest.importorskip("dflash.model", reason="z-lab's dflash package: pip install --no-deps dflash==0.1.0")

VOCAB, HIDDEN, TARGET_LAYERS, BLOCK = 8, 32, 4, 6  # a small vocabulary: random drafts are often right
DFLASH2 = dict(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)

pytestmark = pytest.mark.usefixtures("one_thread")


def perturbed(module, seed: int, std: float):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * std)
    return module.double().eval()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random Qwen3 written by transformers, loaded both ways."""
    path = str(tmp_path_factory.mktemp("target"))
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                                      num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, max_position_embeddings=512, tie_word_embeddings=False,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = perturbed(transformers.Qwen3ForCausalLM(config), seed=0, std=0.4)
    hf.save_pretrained(path)
    return hf, Qwen3.from_pretrained(path, device="cpu", dtype=torch.float64)


def reference_drafter(path: str, two: bool, seed: int, published: bool = True, **extra):
    """The reference's drafter class, random, saved as z-lab publishes it (DFlash 2's codebooks without .weight),
    or (published=False) as its save_pretrained writes it."""
    fields = dict(mask_token_id=VOCAB - 1, target_layer_ids=[1, 2], block_size=BLOCK, **(DFLASH2 if two else {}))
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=512, num_target_layers=TARGET_LAYERS,
                                      dflash_config=fields, attn_implementation="sdpa", **extra)
    cls = reference.DFlash2DraftModel if two else reference.DFlashDraftModel
    torch.manual_seed(seed)  # its own init draws first
    model = perturbed(cls(config), seed=seed, std=0.3)
    if two:
        with torch.no_grad():  # base kernels start empty; keep them at a trained drafter's scale
            for layer in model.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.normal_(0, 0.3)
    model.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    if published:
        weights = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in load_file(file).items()}
        save_file(weights, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == [cls.__name__]
    return model


# Drafters of hybrid targets: a sliding layer (causal unless is_causal is false; windowed only with
# use_sliding_window, as transformers' Qwen3Config keeps sliding_window) and a full one.
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
PAIRS = {"dflash1": (False, {}), "dflash2": (True, {}),
         "dflash2-window": (True, dict(SLIDING, use_sliding_window=True)),
         "dflash1-sliding-no-window": (False, SLIDING),
         "dflash1-window-bidirectional": (False, dict(SLIDING, use_sliding_window=True, is_causal=False)),
         "dflash1-causal": (False, dict(is_causal=True))}


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request, target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    two, extra = PAIRS[request.param]
    ref = reference_drafter(path, two, seed=1, **extra)
    ours = DFlashDrafter.from_pretrained(path, device="cpu", dtype=torch.float64).bind(target[1])
    return ref, ours


def test_dflash2_codebooks_load_from_their_published_names(pair):
    ref, ours = pair
    if not isinstance(ours, DFlash2Drafter):
        pytest.skip("DFlash 1 has no selector")
    assert torch.equal(ours.candidate_selector.predecessor_codebook,
                       ref.candidate_selector.predecessor_codebook.weight)


def test_dflash2_codebooks_load_as_the_package_saves_them(tmp_path):
    """The package's save_pretrained writes the codebooks with `.weight` and its from_pretrained reads both names:
    so do we; a file holding a codebook under both names is refused."""
    ref = reference_drafter(str(tmp_path), True, seed=1, published=False)
    file = os.path.join(tmp_path, "model.safetensors")
    assert "candidate_selector.successor_codebook.weight" in load_file(file)
    ours = DFlashDrafter.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float64)
    for name in ("predecessor_codebook", "successor_codebook"):
        assert torch.equal(getattr(ours.candidate_selector, name), getattr(ref.candidate_selector, name).weight)
    weights = load_file(file)
    weights["candidate_selector.successor_codebook"] = weights["candidate_selector.successor_codebook.weight"].clone()
    save_file(weights, file)
    with pytest.raises(ValueError, match="both hold candidate_selector.successor_codebook"):
        DFlashDrafter.from_pretrained(str(tmp_path), device="cpu")


def block_outputs(ref, ours, target, context_len=9, seed=2):
    """One drafted block after a random context, through both drafters: (theirs, ours) final hidden states of the
    block's draft rows [1, BLOCK - 1, H], their logits, and the bonus."""
    hf, target_ours = target
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (1, context_len + 1), generator=gen)
    with torch.no_grad(), float64_kept():  # the reference's RoPE angles in float64, as ours for a float64 model
        hidden = hf(ids[:, :context_len], output_hidden_states=True).hidden_states
    features = reference.extract_context_feature(hidden, ref.target_layer_ids)
    bonus, start = ids[:, context_len], context_len
    block = torch.cat([bonus[:, None], torch.full((1, BLOCK - 1), VOCAB - 1)], 1)
    noise = hf.get_input_embeddings()(block) * float(ours.config.input_embedding_scale)
    with torch.no_grad(), float64_kept():
        theirs = ref(target_hidden=features, noise_embedding=noise,
                     position_ids=torch.arange(context_len + BLOCK)[None])[:, 1:]
    with torch.no_grad():
        ours.setup_cache(128)
        positions = torch.arange(context_len)[None]
        ours.append_context(features, positions, positions)
        cpu.use_cpu_classes(ours)  # as an eager CPU engine attends
        masks = {kind: PrefixMask(BLOCK, 128, "cpu", 1, *kind).set(start)  # as the engine makes them
                 for kind in ours.config.mask_kinds}
        pos = torch.arange(start, start + BLOCK)[None]
        mine = ours(block, pos, pos, masks, rows=slice(1, None))
    return theirs, mine, ref.compute_logits(theirs, hf.lm_head), ours.logits(mine), bonus


def test_block_outputs_and_logits_equal_the_reference(pair, target):
    """Also for sliding-window and causal drafters: the block's masks as the reference builds them."""
    ref, ours = pair
    theirs, mine, their_logits, our_logits, _ = block_outputs(ref, ours, target)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)
    torch.testing.assert_close(our_logits, their_logits, rtol=0, atol=1e-10)


def test_selector_laws_equal_the_reference_along_its_sampled_path(pair, target):
    """The reference samples a path through its candidates (temperature 0.7) and returns the law q it drew each
    step from; ours, at the same predecessors, gives the same laws token for token; greedy, the same path."""
    ref, ours = pair
    if not isinstance(ours, DFlash2Drafter):
        pytest.skip("DFlash 1 has no selector")
    theirs, mine, their_logits, our_logits, bonus = block_outputs(ref, ours, target, seed=5)
    lattice = ours.candidate_selector.lattice(mine, our_logits, bonus)
    torch.manual_seed(0)
    path, candidates, q = ref.candidate_selector.select(theirs, their_logits, bonus, 0.7)
    assert torch.equal(candidates.sort(-1).values, lattice.tokens.sort(-1).values)
    before = [int(bonus)] + path[0, :-1].tolist()
    for d, prev in enumerate(before):
        state = 0 if d == 0 else lattice.tokens[0, d - 1].tolist().index(prev)
        law = torch.softmax(lattice.scores[0, d, state].double() / 0.7, -1)
        ours_by_token = dict(zip(lattice.tokens[0, d].tolist(), law.tolist()))
        theirs_by_token = dict(zip(candidates[0, d].tolist(), q[0, d].tolist()))
        assert ours_by_token == pytest.approx(theirs_by_token, abs=1e-6)  # their q is float32
    greedy_path, _, _ = ref.candidate_selector.select(theirs, their_logits, bonus, 0.0)
    assert torch.equal(walk_lattice(lattice, BLOCK - 1, VOCAB)[0], greedy_path)


def test_greedy_chain_drafts_what_dflash_generate_drafts(pair, target, monkeypatch):
    """generate(method="dflash") against dflash_generate (greedy): the same tokens, and round for round the same
    accepted lengths while the reference's blocks are whole (it shortens its last blocks to the token limit)."""
    ref, ours = pair
    hf, target_ours = target
    if "sliding_attention" in (ref.config.layer_types or []) and ref.config.sliding_window is None:
        pytest.skip("the reference's cache cannot hold a sliding layer without a window (DynamicCache)")
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # its timer syncs CUDA
    prompt = torch.randint(0, VOCAB - 1, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    new = 40
    with float64_kept():
        out = reference.dflash_generate(ref, hf, torch.tensor([prompt]), new, None, return_stats=True)
    res = generate(target_ours, ours, prompt, method="dflash", max_new_tokens=new, stop_ids=[])
    assert res.tokens == out.output_ids[0, len(prompt):].tolist()
    whole, emitted = [], 1
    for produced in out.acceptance_lengths:
        if emitted + BLOCK > new:
            break
        whole.append(produced)
        emitted += produced
    assert len(whole) >= 3 and res.stats["accepted"][:len(whole)] == whole
    assert max(whole) > 1  # drafts were accepted: the comparison is not of empty chains
