"""The drafter's context window (Speculation.draft_window, --draft-window W): the drafter's block sees only the last
W committed tokens, as SGLang's compact draft KV cache (--speculative-dflash-draft-window-size) and z-lab's MLX
draft window keep them: each context row keeps the RoPE position it was written at, so past the window a draft
equals one from a drafter cache holding only those W rows. Sliding-window drafter layers intersect it with their
own window. Generation stays lossless (greedy == AR), eager and compiled; the setting is refused where it does not
apply."""

import os
import sys

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from conftest import assert_one_error_line, cli, pair_config, random_prompts
from ddtree import Engine, generate
from drafter import DFlashDrafter
from model import Qwen3
from sampler import Sampling
from settings import Speculation
import cpu
from test_tree_attn import KV_LEN, explicit_mask, mask_everywhere, qkv, sdpa_reference
from tree_attn import PrefixMask

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from checkpoints import dflash_config, random_dflash_weights, save_checkpoint  # noqa

pytestmark = pytest.mark.usefixtures("one_thread")

SLOTS = 1024


# ----------------------------------------------------------------------------------------------------------------
# The mask: the last `context` slots before the prefix, the block's own rows, a layer's window intersected


@pytest.mark.parametrize("q_len, prefix, context, window", [
    (5, 0, 3, None), (5, 2, 3, None), (5, 140, 3, None), (5, 140, 129, None), (5, 200, 200, None),
    (8, 150, 10, 6), (8, 150, 4, 6), (1, 249, 1, None), (16, 130, 2, 300), (5, 131, 4, None), (5, 133, 6, 3)])
def test_context_mask_equals_dense_sdpa(q_len, prefix, context, window):
    allow = torch.ones(q_len, q_len, dtype=torch.bool)  # the drafter's block sees itself
    slot, own = torch.arange(KV_LEN)[None, :], prefix + torch.arange(q_len)[:, None]
    dense = explicit_mask(prefix, allow, q_len) & (slot >= prefix - context)
    if window is not None:
        dense &= (slot - own).abs() < window
    mask = PrefixMask(q_len, KV_LEN, "cpu", window=window, context=context)
    block_mask = mask.set(prefix, allow)
    assert torch.equal(mask_everywhere(block_mask)[0, 0], dense)
    as_sdpa = cpu.dense_mask(block_mask, q_len)[0, 0]  # eager CPU attention's: the KV blocks visited
    assert torch.equal(as_sdpa, dense[:, :as_sdpa.shape[1]]) and not dense[:, as_sdpa.shape[1]:].any()
    q, k, v = qkv(q_len, seed=prefix)
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)  # the blocks visited hold every slot
    torch.testing.assert_close(out, sdpa_reference(q, k, v, dense), atol=1e-5, rtol=1e-5)


def test_compiled_context_mask_visits_every_visible_block():
    """Compiled FlexAttention skips the KV blocks the mask's tables leave out (eager evaluates every slot): the
    context's first slot may lie in the block below the prefix's."""
    q_len, context = 5, 4
    mask = PrefixMask(q_len, KV_LEN, "cpu", context=context)
    attend = torch.compile(lambda q, k, v, prefix: flex_attention(q, k, v, block_mask=mask.set(prefix),
                                                                  enable_gqa=True), dynamic=False, fullgraph=True)
    slot = torch.arange(KV_LEN)[None, :]
    with torch.inference_mode():
        for prefix in (0, 2, 127, 128, 131, 132, 200):
            q, k, v = qkv(q_len, seed=prefix)
            dense = explicit_mask(prefix, torch.ones(q_len, q_len, dtype=torch.bool), q_len) & \
                (slot >= prefix - context)
            out = attend(q, k, v, torch.tensor([prefix]))
            torch.testing.assert_close(out, sdpa_reference(q, k, v, dense), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# The drafts: past the window, those of a drafter cache holding only the last W context rows


@pytest.fixture(scope="module")
def pair(random_pair_files, tmp_path_factory):
    """The shared target, its drafter, and a drafter of the same weights whose first layer slides (window 6)."""
    root, tc = tmp_path_factory.mktemp("draft-window"), pair_config()
    dc = dflash_config(tc, layers=2, block_size=5, target_layer_ids=[0, 2])
    save_checkpoint(str(root / "sliding"), {**dc, "layer_types": ["sliding_attention", "full_attention"],
                                            "sliding_window": 6, "use_sliding_window": True},
                    random_dflash_weights(dc, seed=11, std=0.35))
    target = Qwen3.from_pretrained(random_pair_files["target"], device="cpu")
    return target, {"plain": DFlashDrafter.from_pretrained(random_pair_files["draft"], device="cpu"),
                    "sliding": DFlashDrafter.from_pretrained(str(root / "sliding"), device="cpu")}


def drafts_of(target, drafter, prompt, spec):
    engine = Engine(target, drafter, "ddtree", Sampling(), spec, SLOTS, False)
    bonus = torch.tensor(engine.start([prompt], [0]))
    return engine.draft(bonus, torch.tensor([len(prompt)])), bonus


def compact_drafts(drafter, bonus, prompt_len: int, window: int, length: int):
    """The drafts of a drafter whose cache holds only the last `window` context rows (moved to slots 0..W-1, each
    keeping the position it was written at, as SGLang's compact draft cache does), its block at positions
    prompt_len on, slots W on."""
    for cache in drafter.kv_caches():
        kept = cache[:, :, prompt_len - window:prompt_len].clone()
        cache.zero_()
        cache[:, :, :window] = kept
    bs = drafter.block_size
    cpu.use_cpu_classes(drafter)  # as an eager CPU engine attends
    masks = {kind: PrefixMask(bs, SLOTS, "cpu", 1, *kind).set(window) for kind in drafter.config.mask_kinds}
    tokens = torch.cat([bonus[:, None], torch.full((1, bs - 1), drafter.config.mask_token_id)], 1)
    positions, slots = prompt_len + torch.arange(bs)[None], window + torch.arange(bs)[None]
    return drafter.logits(drafter(tokens, positions, slots, masks, rows=slice(1, None)))[:, :length]


@pytest.mark.parametrize("name", ["plain", "sliding"])
@pytest.mark.parametrize("window", [1, 7, 20])
def test_drafts_past_the_window_equal_a_drafter_holding_only_the_window(pair, name, window):
    target, drafters = pair
    drafter = drafters[name].bind(target)
    prompt = random_prompts(1, target.config.vocab_size, 40, seed=window)[0]
    prompt = (prompt * 4)[:40]
    with torch.inference_mode():
        full, _ = drafts_of(target, drafter, prompt, Speculation(budget=4))
        windowed, bonus = drafts_of(target, drafter, prompt, Speculation(budget=4, draft_window=window))
        reference = compact_drafts(drafter, bonus, len(prompt), window, windowed.shape[1])
    torch.testing.assert_close(windowed, reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(windowed, full, atol=1e-3)  # the window changes what the drafter sees


def test_a_window_past_the_context_changes_nothing(pair):
    target, drafters = pair
    drafter = drafters["plain"].bind(target)
    prompt = random_prompts(1, target.config.vocab_size, 30, seed=3)[0]
    with torch.inference_mode():
        full, _ = drafts_of(target, drafter, prompt, Speculation(budget=4))
        windowed, _ = drafts_of(target, drafter, prompt, Speculation(budget=4, draft_window=len(prompt)))
    torch.testing.assert_close(windowed, full, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# Lossless: greedy == AR, eager and compiled


def greedy(target, drafter, prompt, method, compile=False, **spec):
    return generate(target, drafter, prompt, method=method, max_new_tokens=30, stop_ids=[], compile=compile,
                    speculation=Speculation(**spec)).tokens


@pytest.mark.parametrize("name", ["plain", "sliding"])
@pytest.mark.parametrize("method, budget", [("ddtree", 4), ("ddtree", 16), ("dflash", None)])
def test_greedy_with_a_draft_window_equals_ar(pair, name, method, budget):
    target, drafters = pair
    for i, prompt in enumerate(random_prompts(2, target.config.vocab_size, 30, seed=7)):
        ar = greedy(target, None, prompt, "ar")
        for window in (1, 3, 16):
            spec = dict(draft_window=window, **({"budget": budget} if budget else {}))
            assert greedy(target, drafters[name], prompt, method, **spec) == ar, (i, window)


def test_compiled_drafts_with_a_draft_window_equal_eager(pair):
    """The compiled round rebuilds each layer's mask from its tensors (regions.run_layer): its trees, the drafts'
    tokens, equal eager's with the window, and differ from those without it; the tokens equal AR's."""
    target, drafters = pair
    prompt = (random_prompts(1, target.config.vocab_size, 30, seed=9)[0] * 2)[:40]
    ar = greedy(target, None, prompt, "ar")

    def trees(compile, **window):
        res = generate(target, drafters["sliding"], prompt, method="ddtree", max_new_tokens=30, stop_ids=[],
                       compile=compile, speculation=Speculation(budget=4, show_tree=True, **window))
        assert res.tokens == ar
        return [t[0].tolist() for t in res.trees]

    windowed = trees(False, draft_window=3)
    assert trees(True, draft_window=3) == windowed and trees(False) != windowed


# ----------------------------------------------------------------------------------------------------------------
# Refused where it does not apply


@pytest.mark.parametrize("method, window, error, message", [
    ("ar", 4, ValueError, "draft_window does not apply to method 'ar'"),
    ("ddtree", 0, ValueError, "draft_window must be in [1, "),
    ("dflash", -3, ValueError, "draft_window must be in [1, "),
    ("ddtree", 2.5, TypeError, "draft_window must be an integer, got 2.5"),
    ("ddtree", True, TypeError, "draft_window must be an integer, got True"),
])
def test_bad_draft_window_is_refused(pair, method, window, error, message):
    target, drafters = pair
    with pytest.raises(error) as e:
        generate(target, None if method == "ar" else drafters["plain"], [1, 2], method=method,
                 speculation=Speculation(draft_window=window))
    assert message in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["--method", "ar", "--draft-window", "4"], "--draft-window does not apply to method 'ar'"),
    (["--draft-window", "0"], "--draft-window must be in [1, "),
    (["--draft-window", "x"], "--draft-window must be an integer, got 'x'"),
])
def test_cli_refuses_a_bad_draft_window(args, message):
    code, out, err = cli("--prompt", "def f(x):", "--max-new-tokens", "4", *args)
    assert_one_error_line(code, err, message)


def test_cli_runs_with_a_draft_window():
    code, out, err = cli("--prompt", "def f(x):", "--max-new-tokens", "8", "--draft-window", "2", "--no-compile")
    assert code == 0 and out, err
