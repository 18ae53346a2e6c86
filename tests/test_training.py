"""The training code on tiny configs: the training forwards equal the inference forwards (target and drafter),
the drafter's block masks and labels are right, the losses decrease, and the scripts write checkpoints that our
loaders read and that decode (greedy dflash / ddtree == ar), resuming where they stopped."""

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import cpu
from conftest import causal, pair_config, write_drafter, write_target
from ddtree import generate
from dflash2 import DFlash2Drafter
from drafter import DFlashDrafter
from model import Qwen3
from tree_attn import PrefixMask

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import train  # noqa: E402
from checkpoints import qwen3_config, save_checkpoint  # noqa: E402
from train import (block_inputs, block_labels, dense_block_mask, dflash_loss, diffusion_loss,  # noqa: E402
                   flex_block_mask, training_logits, training_mask)

VOCAB = 64
CACHE = 256
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random 3-layer target and a random 2-layer drafter (block 4) reading layers 0 and 2 (2 is the last
    layer: its feature is taken after the final norm, as in Hugging Face, so both forwards must agree on that)."""
    root, tc = tmp_path_factory.mktemp("train-pair"), pair_config(vocab=VOCAB, inter=96)
    write_target(str(root / "target"), tc, std=0.3)
    write_drafter(str(root / "draft"), tc, block_size=4, seed=1, std=0.3, mask_token_id=VOCAB - 1)
    target = Qwen3.from_pretrained(str(root / "target"), device="cpu")
    drafter = DFlashDrafter.from_pretrained(str(root / "draft"), device="cpu").bind(target)
    return target, drafter


def inference_forward(target, ids, feature_layers=()):
    n = ids.numel()
    target.setup_cache(CACHE)
    pos = torch.arange(n)
    cpu.use_cpu_classes(target)  # as an eager CPU engine attends
    mask = PrefixMask(n, CACHE, "cpu")
    with torch.no_grad():
        return target(ids, pos, pos, mask.set(0, causal(n)), feature_layers=feature_layers)


# ----------------------------------------------------------------------------------------------------------------
# Target


def test_target_training_forward_equals_inference(pair):
    target, _ = pair
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, VOCAB, (2, 37), generator=g)
    with torch.no_grad():
        logits, feats = train.forward_batch(target, batch, feature_layers=(0, 2))
    for b in range(2):
        ref_logits, ref_feats = inference_forward(target, batch[b], feature_layers=(0, 2))
        assert (logits[b] - ref_logits).abs().max() < TOL
        assert (feats[b] - ref_feats).abs().max() < TOL


def test_batched_greedy_decoder_equals_ar_generate(pair):
    target, _ = pair
    prompts = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    new = train.greedy_continue(target, prompts, 12)
    for b in range(3):
        ref = generate(target, None, prompts[b].tolist(), method="ar", max_new_tokens=12, stop_ids=[]).tokens
        assert new[b].tolist() == ref


def test_target_loss_decreases():
    c = qwen3_config(VOCAB, hidden=32, inter=64, layers=2, heads=2, kv_heads=1, head_dim=16, eos=(1, 0))
    model = train.build_target(c, seed=0)
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, 8, (40,), generator=g).repeat(20)  # a repeated pattern: learnable
    windows = train.random_crops(stream, 4, 32, g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = train.lm_loss(model, windows).item()
    for _ in range(15):
        loss = train.lm_loss(model, windows)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert train.lm_loss(model, windows).item() < 0.7 * first


def test_hf_weights_round_trip(pair, tmp_path):
    target, _ = pair
    with open(os.path.join(target.path, "config.json")) as f:
        config = json.load(f)
    save_checkpoint(str(tmp_path), config, train.hf_weights(target), eos_ids=[1])
    again = Qwen3.from_pretrained(str(tmp_path), device="cpu")
    ids = torch.arange(10) % VOCAB
    assert torch.equal(inference_forward(target, ids)[0], inference_forward(again, ids)[0])


def test_function_samples_and_chat_text():
    src = 'class A:\n    def f(self, x):\n        """Add one.\n\n        More."""\n        return x + 1\n'
    (prompts, body), = train.function_samples(src)
    assert prompts == ["def f(self, x):", "Add one."]
    assert body.startswith("def f(self, x):\n    \"\"\"Add one.") and body.endswith("return x + 1\n")
    assert train.chat_text("q", "a") == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"


# ----------------------------------------------------------------------------------------------------------------
# Drafter: masks, labels, training forward == inference


def test_block_mask_sees_context_before_anchor_and_its_block_only():
    bs, C = 4, 12
    anchors = torch.tensor([[1, 5, 9], [2, 3, 10]])  # overlapping blocks too
    mask = dense_block_mask(anchors, C, bs)
    assert mask.shape == (2, 1, 3 * bs, C + 3 * bs)
    for b in range(2):
        for q in range(3 * bs):
            j = q // bs
            for kv in range(C + 3 * bs):
                want = kv < anchors[b, j] if kv < C else (kv - C) // bs == j
                assert bool(mask[b, 0, q, kv]) == bool(want), (b, q, kv)


def test_flex_block_mask_matches_dense_mask():
    """The same mask_mod as a FlexAttention BlockMask (what CUDA training runs) attends like SDPA with the dense
    mask (forward only: FlexAttention has no backward on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention
    bs, C = 4, 40
    anchors = torch.tensor([[1, 17, 30], [5, 6, 39]])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3 * bs, 8, generator=g)
    k, v = torch.randn(2, 2, C + 3 * bs, 8, generator=g), torch.randn(2, 2, C + 3 * bs, 8, generator=g)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_mask(anchors, C, bs))
    with torch.no_grad():
        flex = flex_attention(q, k, v, block_mask=flex_block_mask(anchors, C, bs))
    assert (dense - flex).abs().max() < 1e-5
    assert not isinstance(training_mask(anchors, C, bs), type(flex_block_mask(anchors, C, bs)))  # CPU: dense


def test_block_labels_follow_the_greedy_path():
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    greedy = torch.tensor([[0, 6, 7, 8, 1, 10, 2, 12, 13]])  # greedy[p] follows tokens[:p]; C + 1 entries
    anchors = torch.tensor([[1, 5]])
    labels, valid = block_labels(tokens, greedy, anchors, block_size=4)
    # anchor 1: positions 2, 3, 4 -> labels 7, 8, 1; the sequence takes 7 (on path), 8 (on path): all valid
    assert labels[0, 0].tolist() == [7, 8, 1] and valid[0, 0].tolist() == [True, True, True]
    # anchor 5: positions 6, 7, 8 -> labels 2, 12, 13; the sequence takes 11 != 2 at 6: only position 6 valid
    assert labels[0, 1].tolist() == [2, 12, 13] and valid[0, 1].tolist() == [True, False, False]
    # the end of the window: a label exists up to position C (= 8), not beyond
    labels, valid = block_labels(tokens, torch.tensor([[0, 6, 7, 8, 9, 10, 11, 12, 13]]), torch.tensor([[6]]), 4)
    assert labels[0, 0, :2].tolist() == [12, 13] and valid[0, 0].tolist() == [True, True, False]


def test_drafter_training_forward_equals_draft(pair):
    target, drafter = pair
    bs = drafter.block_size
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB - 1, (2, 30), generator=g)
    anchors = torch.tensor([[1, 9, 11, 26], [3, 4, 17, 20]])
    ids = tuple(drafter.config.target_layer_ids)
    with torch.no_grad():
        _, features = train.forward_batch(target, tokens, feature_layers=ids)
        blocks, positions = block_inputs(tokens, anchors, bs, drafter.config.mask_token_id)
        logits = training_logits(drafter, target.embed_tokens, target.lm_head, features, blocks, positions,
                                 training_mask(anchors, tokens.shape[1], bs))
    drafter.setup_cache(CACHE)
    cpu.use_cpu_classes(drafter)
    draft_mask = PrefixMask(bs, CACHE, "cpu")
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            _, ctx = inference_forward(target, tokens[b, :a], feature_layers=ids)  # the inference path throughout
            with torch.no_grad():
                drafter.append_context(ctx[None], torch.arange(a)[None], torch.arange(a)[None])  # a batch of one
                ref = drafter.draft(tokens[b, a:a + 1], torch.tensor([a]), {(None, False): draft_mask.set(a)})[0]
            assert (logits[b, j * bs + 1:(j + 1) * bs] - ref).abs().max() < TOL, (b, a)
            with torch.no_grad():  # the first `length` positions alone (a small budget's): the same logits
                for length in range(1, bs - 1):
                    first = drafter.draft(tokens[b, a:a + 1], torch.tensor([a]), {(None, False): draft_mask.set(a)},
                                          length=length)
                    assert first.shape[1] == length and (first[0] - ref[:length]).abs().max() < TOL, (b, a, length)


def drafter_args(objective, **kw):
    a = dict(objective=objective, anchors=4, gamma=2.0, kl_weight=1.0 if objective == "diffusion" else 0.0,
             bf16=False)
    a.update(kw)
    return SimpleNamespace(**a)


@pytest.mark.parametrize("objective,kl", [("dflash", 0.0), ("dflash", 0.5), ("diffusion", 1.0)])
def test_drafter_loss_decreases(pair, objective, kl):
    target, loaded = pair
    drafter = DFlashDrafter(loaded.config)
    drafter.load_state_dict(loaded.state_dict())
    drafter.bind(target)
    for p in target.parameters():
        p.requires_grad_(False)
    a = drafter_args(objective, kl_weight=kl)
    tokens = torch.randint(0, VOCAB - 1, (2, 24), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)

    def loss_at(seed):
        return train.batch_loss(a, drafter, target, tokens, torch.Generator().manual_seed(seed),
                                        drafter.block_size, drafter.config.mask_token_id)[0]

    first = loss_at(0).item()
    for step in range(12):
        loss = loss_at(step % 3)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss_at(0).item() < 0.8 * first
    for p in target.parameters():
        p.requires_grad_(True)


def test_losses_weights():
    """dflash_loss: positions weighted exp(-(k-1)/gamma) over valid ones; diffusion_loss: 1/t on masked ones."""
    V = 5
    labels = torch.tensor([[[1, 2, 3]]])
    logits = torch.randn(1, 4, V)
    logq = logits[0, 1:].log_softmax(-1)
    ce = -logq[torch.arange(3), labels[0, 0]]
    valid = torch.tensor([[[True, True, False]]])
    w = torch.exp(-torch.arange(3.) / 2.0) * valid[0, 0]
    assert torch.allclose(dflash_loss(logits, labels, valid, 2.0), (ce * w).sum() / w.sum())
    masked = torch.tensor([[[False, True, True]]])
    t = torch.tensor([[0.5]])
    assert torch.allclose(diffusion_loss(logits, labels, valid, masked, t), ce[1] / 0.5 / 2)


# ----------------------------------------------------------------------------------------------------------------
# The scripts end to end: tiny target, tiny drafter, reload, decode, resume


def test_scripts_train_save_reload_decode_and_resume(tmp_path):
    tdir, ddir = str(tmp_path / "target"), str(tmp_path / "draft")
    common = ["--files", "6", "--threads", "1", "--seed", "0"]
    train.main(["target", "--out", tdir, "--vocab", "300", "--hidden", "64", "--inter", "96", "--layers", "3",
                "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--seq", "64", "--batch", "2",
                "--steps", "3", "--eval-every", "3", "--save-every", "3"] + common)
    final_t = os.path.join(tdir, "final")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert os.path.isfile(os.path.join(final_t, name)), name
    with open(os.path.join(final_t, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]
    target = Qwen3.from_pretrained(final_t, device="cpu")
    assert target.eos_ids == [train_target_token(final_t, "<|im_end|>"), train_target_token(final_t,
                                                                                           "<|endoftext|>")]
    args = ["--target", final_t, "--out", ddir, "--layers", "1", "--block-size", "4", "--target-layers", "0,1",
            "--seq", "48", "--batch", "2", "--anchors", "4", "--greedy-seqs", "4", "--prompt-len", "16",
            "--eval-contexts", "4", "--eval-lengths", "16,24", "--eval-every", "2", "--save-every", "2"] + common
    train.main(["drafter"] + args + ["--steps", "2"])
    state = json.load(open(os.path.join(ddir, "state.json")))
    assert state["step"] == 2 and [e["step"] for e in state["log"]] == [0, 2]
    train.main(["drafter"] + args + ["--steps", "4"])  # resumes at step 2
    state = json.load(open(os.path.join(ddir, "state.json")))
    assert state["step"] == 4 and [e["step"] for e in state["log"]] == [0, 2, 4]
    config = json.load(open(os.path.join(ddir, "final", "config.json")))
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [0, 1]
    assert config["dflash_config"]["mask_token_id"] == train_target_token(final_t, "<|mask|>")
    drafter = DFlashDrafter.from_pretrained(os.path.join(ddir, "final"), device="cpu")
    prompt = list(range(5, 25))
    ar = generate(target, None, prompt, method="ar", max_new_tokens=12, stop_ids=[]).tokens
    for method in ("dflash", "ddtree"):
        res = generate(target, drafter, prompt, method=method, budget=8 if method == "ddtree" else None,
                       max_new_tokens=12, stop_ids=[])
        assert res.tokens == ar, method
    # --init fine-tunes from the exported drafter: its shape is the checkpoint's (not these defaults), and its
    # step-0 evaluation (same seed, so the same held-out contexts) is the source run's last one
    tuned = str(tmp_path / "tuned")
    train.main(["drafter", "--target", final_t, "--out", tuned, "--init", os.path.join(ddir, "final"), "--seq", "48",
                "--batch", "2", "--anchors", "4", "--greedy-seqs", "4", "--prompt-len", "16",
                "--eval-contexts", "4", "--eval-lengths", "16,24", "--eval-every", "2", "--save-every",
                "2", "--steps", "2"] + common)
    log = json.load(open(os.path.join(tuned, "state.json")))["log"]
    assert (log[0]["acc"], log[0]["eval_ce"]) == (state["log"][-1]["acc"], state["log"][-1]["eval_ce"])
    tuned_config = json.load(open(os.path.join(tuned, "final", "config.json")))
    assert {k: v for k, v in tuned_config.items() if k != "torch_dtype"} == \
        {k: v for k, v in config.items() if k != "torch_dtype"}
    # --dflash2 upgrades it to a DFlash 2 drafter: its layers copied, its convolutions the identity at first (the
    # step-0 logits, so the held-out cross-entropy, are the source's), trained with the selector, lossless
    two = str(tmp_path / "dflash2")
    train.main(["drafter", "--target", final_t, "--out", two, "--init", os.path.join(ddir, "final"), "--dflash2",
                "--conv-group", "16", "--selector-rank", "8", "--selector-top-k", "4", "--seq", "48",
                "--batch", "2", "--anchors", "4", "--greedy-seqs", "4", "--prompt-len", "16",
                "--eval-contexts", "4", "--eval-lengths", "16,24", "--eval-every", "2", "--save-every",
                "2", "--steps", "2"] + common)
    log = json.load(open(os.path.join(two, "state.json")))["log"]
    assert log[0]["eval_ce"] == pytest.approx(state["log"][-1]["eval_ce"], abs=1e-4) and len(log) == 2
    drafter2 = DFlashDrafter.from_pretrained(os.path.join(two, "final"), device="cpu")
    assert isinstance(drafter2, DFlash2Drafter) and drafter2.config.selector_top_k == 4
    for method in ("dflash", "ddtree"):
        res = generate(target, drafter2, prompt, method=method, budget=8 if method == "ddtree" else None,
                       max_new_tokens=12, stop_ids=[])
        assert res.tokens == ar, method


def train_target_token(path, token):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(path, "tokenizer.json")).token_to_id(token)


# ----------------------------------------------------------------------------------------------------------------
# The bundled pair (assets/): it loads, fits, speculates, and greedy decoding is the same by every method


ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def test_bundled_pair_greedy_methods_agree_and_speculate():
    from text import Text
    target = Qwen3.from_pretrained(os.path.join(ASSETS, "tiny-target"), device="cpu")
    drafter = DFlashDrafter.from_pretrained(os.path.join(ASSETS, "tiny-draft"), device="cpu")
    text = Text(target.path)
    for prompt in (text.encode(text.render_chat("def fibonacci(n):")),
                   text.encode("import os\n\n\ndef walk(top):\n    \"\"\"Yield the files under top.\"\"\"\n")):
        ar = generate(target, None, prompt, method="ar", max_new_tokens=48, stop_ids=[]).tokens
        chain = generate(target, drafter, prompt, method="dflash", max_new_tokens=48, stop_ids=[])
        tree = generate(target, drafter, prompt, method="ddtree", budget=64, max_new_tokens=48, stop_ids=[])
        assert chain.tokens == ar and tree.tokens == ar
        assert tree.stats["tau"] > chain.stats["tau"] > 1.2  # real speculation, and the tree adds to it


def test_bundled_dflash2_drafter_is_lossless_and_speculates():
    """assets/tiny-draft2: tiny-draft upgraded to DFlash 2 and trained on (docs/benchmarks.md): its chain (the
    selector's walk) and its lattice trees give plain decoding's tokens and accept drafts."""
    target = Qwen3.from_pretrained(os.path.join(ASSETS, "tiny-target"), device="cpu")
    drafter = DFlashDrafter.from_pretrained(os.path.join(ASSETS, "tiny-draft2"), device="cpu")
    assert isinstance(drafter, DFlash2Drafter)
    prompt = list(range(100, 140))
    ar = generate(target, None, prompt, method="ar", max_new_tokens=48, stop_ids=[]).tokens
    chain = generate(target, drafter, prompt, method="dflash", max_new_tokens=48, stop_ids=[])
    tree = generate(target, drafter, prompt, method="ddtree", budget=64, max_new_tokens=48, stop_ids=[])
    assert chain.tokens == ar and tree.tokens == ar
    assert tree.stats["tau"] > chain.stats["tau"] > 1.2


def test_checkpoints_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    # A save that fails midway (disk full, Ctrl-C) leaves the previous checkpoint as it was, and no stray file.
    import checkpoints
    c = checkpoints.qwen3_config(16, hidden=32, inter=64, layers=1, heads=2, kv_heads=1, head_dim=16)
    checkpoints.save_checkpoint(str(tmp_path), c, checkpoints.random_qwen3_weights(c))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def failing(tensors, path, metadata=None):
        open(path, "wb").write(b"half a file")
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoints, "save_file", failing)
    with pytest.raises(OSError):
        checkpoints.save_checkpoint(str(tmp_path), dict(c, hidden_size=64), checkpoints.random_qwen3_weights(c))
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after == before
