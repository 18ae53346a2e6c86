"""RoPE scaling read and computed as transformers 5.24 does it, for Qwen3, Qwen3-MoE, Qwen3.5 targets and DFlash
drafters: the config shapes (v4 `rope_scaling`, v5 `rope_parameters`, the first replacing the second), linear,
yarn (its attention factor, original length, betas, truncate, mscale), llama3 and proportional; dynamic, longrope
and unknown types refused with one line naming the type and the file.

The frequencies are compared bit for bit with transformers' rotary modules built from the same dicts; the logits
of tiny random checkpoints written by transformers and read back by it from the same files, in float64, at
positions 40,000 and up (past every original window here, so the scaling decides the result), within 1e-10; and a
DFlash drafter's block at those positions against z-lab's `dflash` reference."""

import copy
import json
import os

import pytest
import torch
import transformers
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

import cpu
from conftest import causal, float64_kept, written_once
from ddtree import generate
from drafter import DFlashDrafter
from model import Qwen3, Qwen3Config
from rope import rope_frequencies, rope_inv_freq
from scripts.checkpoints import hybrid_text_config, random_hybrid_model, save_hybrid
from tree_attn import PrefixMask

FAR = 40_000  # the first position of every sequence below
THETA = 10000.0
TOL = 1e-10
ORIGINAL = 16384  # the pretraining length of the yarn and llama3 configs; max_position_embeddings is 4x

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------------------------
# 1. The frequencies and attention factor, bit for bit, for each config shape


QWEN3 = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4 * ORIGINAL)
QWEN3_MOE = dict(QWEN3, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
del QWEN3_MOE["head_dim"]  # hidden / heads = 8: transformers' yarn reads it so for Qwen3-MoE
HYBRID_TEXT = hybrid_text_config(max_position_embeddings=4 * ORIGINAL)  # Qwen3_5TextConfig kwargs
HYBRID = dict(HYBRID_TEXT, model_type="qwen3_5_text")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}

# name -> (the base config, what the file says about RoPE)
SHAPES = {
    "v4 linear": (QWEN3, dict(rope_theta=THETA, rope_scaling={"type": "linear", "factor": 4.0})),
    "v5 linear": (QWEN3, dict(rope_parameters={"rope_type": "linear", "rope_theta": THETA, "factor": 2.5})),
    "v4 yarn": (QWEN3, dict(rope_theta=5e5, rope_scaling=YARN)),
    "v5 yarn": (QWEN3, dict(rope_parameters=dict(YARN, rope_theta=THETA))),
    # Qwen's long-context edit to a v5 file: rope_scaling replaces rope_parameters whole, theta from the top level.
    "precedence": (QWEN3, dict(rope_theta=THETA, rope_parameters={"rope_type": "default", "rope_theta": THETA},
                               rope_scaling=YARN)),
    "precedence, theta from transformers' default": (QWEN3, dict(rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": THETA},
                                                                 rope_scaling=YARN)),
    "no rope_theta anywhere": (QWEN3, dict(rope_scaling={"type": "linear", "factor": 2})),
    "rope_type over type": (QWEN3, dict(rope_theta=THETA, rope_scaling=dict(YARN, type="linear"))),
    "yarn original from max_position_embeddings": (QWEN3, dict(rope_theta=THETA, rope_scaling={"type": "yarn",
                                                                                                "factor": 4})),
    "yarn original from the top level": (QWEN3, dict(rope_theta=THETA, rope_scaling=YARN,
                                                     original_max_position_embeddings=2048)),
    "yarn null factor": (QWEN3, dict(rope_theta=THETA, rope_scaling=dict(YARN, factor=None))),
    "yarn betas, no truncation": (QWEN3, dict(rope_theta=THETA, rope_scaling=dict(YARN, beta_fast=16, beta_slow=2,
                                                                                  truncate=False))),
    "yarn attention_factor": (QWEN3, dict(rope_theta=THETA, rope_scaling=dict(YARN, attention_factor=1.3))),
    "yarn mscale": (QWEN3, dict(rope_theta=THETA, rope_scaling=dict(YARN, mscale=0.707, mscale_all_dim=1.0))),
    "llama3": (QWEN3, dict(rope_theta=5e5, rope_scaling=LLAMA3)),
    "proportional": (QWEN3, dict(rope_parameters={"rope_type": "proportional", "rope_theta": THETA, "factor": 2})),
    "moe yarn, no head_dim": (QWEN3_MOE, dict(rope_theta=THETA, rope_scaling=YARN)),
    "hybrid yarn": (HYBRID, dict(rope_parameters=dict(YARN, rope_theta=THETA, partial_rotary_factor=0.25))),
    "hybrid yarn, partial from the default": (HYBRID, dict(rope_parameters=dict(YARN, rope_theta=THETA))),
    "hybrid linear, partial at the top level": (HYBRID, dict(rope_parameters={"rope_type": "linear", "factor": 4,
                                                                              "rope_theta": THETA},
                                                             partial_rotary_factor=0.5)),
    "hybrid proportional": (HYBRID, dict(rope_parameters={"rope_type": "proportional", "rope_theta": THETA,
                                                          "partial_rotary_factor": 0.25})),
    "hybrid precedence, mrope keys": (HYBRID, dict(rope_parameters={"rope_type": "default", "rope_theta": THETA,
                                                                    "partial_rotary_factor": 0.25,
                                                                    "mrope_section": [2, 1, 1],
                                                                    "mrope_interleaved": True},
                                                   rope_scaling=dict(YARN, rope_theta=THETA))),
}


def file_config(name: str) -> dict:
    base, rope = SHAPES[name]
    d = {k: v for k, v in base.items() if k not in ("rope_parameters", "rope_theta")}
    return copy.deepcopy(dict(d, **rope))


def transformers_rope(d: dict):
    """(inv_freq, attention scaling) of transformers' rotary module for the config dict, read as from a file."""
    kinds = {"qwen3": (transformers.Qwen3Config, Qwen3RotaryEmbedding),
             "qwen3_moe": (transformers.Qwen3MoeConfig, Qwen3MoeRotaryEmbedding),
             "qwen3_5_text": (transformers.Qwen3_5TextConfig, Qwen3_5TextRotaryEmbedding)}
    config_class, rotary = kinds[d["model_type"]]
    module = rotary(config_class.from_dict(copy.deepcopy(d)))
    return module.inv_freq, module.attention_scaling


@pytest.mark.parametrize("name", list(SHAPES))
def test_frequencies_and_attention_factor_equal_transformers(name):
    d = file_config(name)
    theirs, their_factor = transformers_rope(d)
    ours, our_factor = rope_frequencies(Qwen3Config.from_dict(copy.deepcopy(d)))
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape
    assert torch.equal(ours, theirs), (ours, theirs)
    assert our_factor == their_factor


# ----------------------------------------------------------------------------------------------------------------
# 2. Logits at positions 40,000 and up, from files transformers wrote and reads back


def qwen3_file(path: str, seed: int, rope: dict):
    """A tiny random Qwen3 saved by transformers, its config.json's RoPE keys then replaced by `rope`."""
    config = transformers.Qwen3Config(**{k: v for k, v in QWEN3.items() if k != "model_type"},
                                      attn_implementation="eager")
    torch.manual_seed(seed)
    hf = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(path)
    rewrite_rope(path, rope)


def hybrid_file(path: str, seed: int, rope: dict):
    """A tiny random Qwen3.5 hybrid (3 Gated DeltaNet layers, 1 gated attention) saved by transformers, its
    config.json's RoPE keys then replaced by `rope`."""
    save_hybrid(random_hybrid_model(HYBRID_TEXT, seed=seed, std=0.3), path)
    rewrite_rope(path, rope)


def rewrite_rope(path: str, rope: dict):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        c = json.load(f)
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"):
        c.pop(key, None)
    c.update(copy.deepcopy(rope))
    with open(file, "w") as f:
        json.dump(c, f, indent=2)


# name -> (writer, the file's RoPE keys)
CHECKPOINTS = {
    "qwen3 linear (v4)": (qwen3_file, SHAPES["v4 linear"][1]),
    "qwen3 yarn (v5)": (qwen3_file, SHAPES["v5 yarn"][1]),
    "qwen3 yarn (v4, no truncation)": (qwen3_file, SHAPES["yarn betas, no truncation"][1]),
    "qwen3 precedence": (qwen3_file, SHAPES["precedence"][1]),
    "qwen3 llama3": (qwen3_file, SHAPES["llama3"][1]),
    "hybrid yarn (partial rotary)": (hybrid_file, SHAPES["hybrid yarn"][1]),
    "hybrid precedence": (hybrid_file, SHAPES["hybrid precedence, mrope keys"][1]),
    "hybrid proportional": (hybrid_file, SHAPES["hybrid proportional"][1]),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return written_once(tmp_path_factory.mktemp("rope_ckpts"),
                        lambda name, path: CHECKPOINTS[name][0](path, list(CHECKPOINTS).index(name),
                                                                CHECKPOINTS[name][1]))


def our_logits(m: Qwen3, ids: torch.Tensor, first: int) -> torch.Tensor:
    """One causal chunk of ids at RoPE positions first.., in cache slots 0.. (the engine's prefill, far out)."""
    Q = len(ids)
    m.setup_cache(128)
    if m.recurrent:
        m.reset_recurrent()
    cpu.use_cpu_classes(m)  # as an eager CPU engine attends
    mask = PrefixMask(Q, 128, "cpu").set(torch.zeros(1, dtype=torch.long), causal(Q)[None])
    with torch.no_grad():
        logits, _ = m(ids, first + torch.arange(Q), torch.arange(Q), mask)
    return logits


def their_logits(path: str, ids: torch.Tensor, first: int) -> torch.Tensor:
    """transformers reading the same files, in float64 (its float32 upcasts kept at float64, as ours)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).to(torch.float64).eval()
    with torch.no_grad(), float64_kept():
        return hf(ids[None], position_ids=first + torch.arange(len(ids))[None], use_cache=False).logits[0]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_past_the_original_window_equal_transformers(ckpt, name):
    path, _ = ckpt(name)
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(5))
    m = Qwen3.from_pretrained(path, device="cpu", dtype=torch.float64)
    assert m.config.rope_scaling["rope_type"] != "default"
    theirs = their_logits(path, ids, FAR)
    ours = our_logits(m, ids, FAR)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=TOL)
    m.inv_freq, m.rope_attention_factor = rope_inv_freq(m.config.rotary_dim, m.config.rope_theta, None), 1.0
    assert (our_logits(m, ids, FAR) - theirs).abs().max() > 1e-3  # plain RoPE would be far off here


# ----------------------------------------------------------------------------------------------------------------
# 3. A DFlash drafter with yarn: its block at positions 40,000 and up equals the dflash reference's


def test_drafter_block_with_yarn_equals_the_reference(tmp_path):
    reference = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=4 * ORIGINAL, num_target_layers=4,
                                      rope_parameters=dict(YARN, rope_theta=THETA),
                                      dflash_config=dict(mask_token_id=63, target_layer_ids=[1, 2], block_size=6),
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = reference.DFlashDraftModel(config)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    ref = ref.double().eval()
    ref.save_pretrained(str(tmp_path))
    rewrite_rope(str(tmp_path), SHAPES["v4 yarn"][1])  # the v4 shape, as the reference's config then reads it
    ref.config = transformers.Qwen3Config.from_pretrained(str(tmp_path))
    ref.rotary_emb = type(ref.rotary_emb)(ref.config).double()
    ours = DFlashDrafter.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float64)
    assert ours.rope_attention_factor == ref.rotary_emb.attention_scaling > 1
    gen = torch.Generator().manual_seed(1)
    context, block = 9, 6
    features = torch.randn(1, context, 2 * 32, generator=gen, dtype=torch.float64)
    noise = torch.randn(1, block, 32, generator=gen, dtype=torch.float64)
    with torch.no_grad(), float64_kept():
        theirs = ref(target_hidden=features, noise_embedding=noise,
                     position_ids=FAR + torch.arange(context + block)[None])
    ours.target_parts = (lambda tokens: noise, None)  # the block's embeddings: the reference's noise
    with torch.no_grad():
        ours.setup_cache(128)
        ours.append_context(features, FAR + torch.arange(context)[None], torch.arange(context)[None])
        cpu.use_cpu_classes(ours)  # as an eager CPU engine attends
        masks = {kind: PrefixMask(block, 128, "cpu", 1, *kind).set(context) for kind in ours.config.mask_kinds}
        mine = ours(torch.zeros(1, block, dtype=torch.long), FAR + context + torch.arange(block)[None],
                    context + torch.arange(block)[None], masks)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=TOL)


# ----------------------------------------------------------------------------------------------------------------
# 4. What is refused: one line naming the type (or key) and the file


def write_config(tmp_path, d: dict) -> str:
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f)
    return str(tmp_path)


def refused(load, path, *words):
    with pytest.raises(ValueError) as e:
        load(path, device="cpu")
    message = str(e.value)
    assert "\n" not in message and os.path.join(path, "config.json") in message
    for w in words:
        assert w in message, (w, message)


# name -> (the file's RoPE keys, words the error must hold)
REFUSALS = {
    "dynamic": (dict(rope_theta=THETA, rope_scaling={"type": "dynamic", "factor": 2.0}),
                ("rope scaling type 'dynamic'", "rope_scaling", "how the calls were chunked")),
    "longrope": (dict(rope_parameters={"rope_type": "longrope", "rope_theta": THETA, "short_factor": [1.0] * 8,
                                       "long_factor": [2.0] * 8, "original_max_position_embeddings": 1024}),
                 ("rope scaling type 'longrope'", "rope_parameters", "how the calls were chunked")),
    "unknown type": (dict(rope_theta=THETA, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                     ("rope scaling type 'mrope'", "not one transformers 5.24 knows")),
    # Qwen's long-context edit to a file transformers 5 wrote: transformers would drop rope_theta=1e6 and run 10000.
    "rope_theta dropped": (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_scaling=YARN),
                           ("rope_scaling replaces rope_parameters", "rope_theta=1000000.0 would be ignored")),
    "rope type and keys dropped": (dict(rope_parameters=dict(YARN, rope_theta=THETA),
                                        rope_scaling={"type": "linear", "factor": 2.0, "rope_theta": THETA}),
                                   ("rope_type='yarn'", "factor=4.0", "would be ignored")),
    "yarn without factor": (dict(rope_theta=THETA, rope_scaling={"type": "yarn"}),
                            ("rope scaling type 'yarn' needs factor",)),
    "llama3 without its factors": (dict(rope_theta=THETA, rope_scaling={"type": "llama3", "factor": 8.0}),
                                   ("needs low_freq_factor, high_freq_factor",)),
    "factor not a number": (dict(rope_theta=THETA, rope_scaling={"type": "linear", "factor": "4"}),
                            ("(rope_scaling): factor must be a positive number",)),
    "truncate not a bool": (dict(rope_theta=THETA, rope_scaling=dict(YARN, truncate="no")),
                            ("truncate must be true or false",)),
    "null original length": (dict(rope_theta=THETA, rope_scaling=dict(YARN, original_max_position_embeddings=None)),
                             ("original_max_position_embeddings must be a positive integer",)),
    "negative beta_fast": (dict(rope_theta=THETA, rope_scaling=dict(YARN, beta_fast=-4)),  # no log of it
                           ("(rope_scaling): beta_fast must be a positive number (0 or null: the default), got -4",)),
    "negative beta_slow": (dict(rope_theta=THETA, rope_scaling=dict(YARN, beta_slow=-0.5)),
                           ("(rope_scaling): beta_slow must be a positive number (0 or null: the default), got -0.5",)),
    "rope_scaling not an object": (dict(rope_theta=THETA, rope_scaling=[1, 2]),
                                   ("rope_scaling must be a JSON object",)),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refused_with_one_line_naming_the_type_and_the_file(tmp_path, name):
    rope, words = REFUSALS[name]
    d = dict(QWEN3, **rope)
    refused(Qwen3.from_pretrained, write_config(tmp_path, d), *words)


def test_drafter_refuses_as_a_target_does(tmp_path):
    d = dict(QWEN3, architectures=["DFlashDraftModel"], num_target_layers=2, block_size=4,
             dflash_config={"mask_token_id": 63, "target_layer_ids": [0]}, rope_theta=THETA,
             rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    refused(DFlashDrafter.from_pretrained, write_config(tmp_path, d), "rope scaling type 'dynamic'",
            "how the calls were chunked")


def test_hybrid_rope_beside_text_config_is_refused(tmp_path):
    """transformers builds a Qwen3_5ForConditionalGeneration's text RoPE from text_config alone."""
    d = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
         "text_config": dict(HYBRID, model_type="qwen3_5_text"), "rope_scaling": YARN}
    refused(Qwen3.from_pretrained, write_config(tmp_path, d), "rope_scaling at the top level would be ignored")


# ----------------------------------------------------------------------------------------------------------------
# 5. The positions a request may reach: the scaled window, refused past it with one line naming where it comes from


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=THETA, tie_word_embeddings=False)


@pytest.mark.parametrize("stated, rope, limit, source", [
    (1280, {"rope_type": "default"}, 1280, "the target's max_position_embeddings"),
    # Qwen's long-context edit: a yarn block beside an unchanged max_position_embeddings
    (1280, dict(YARN, original_max_position_embeddings=1024), 4096,
     "the target's RoPE scaling: yarn factor 4 x original_max_position_embeddings 1024"),
    (1024, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 256}, 1024,
     "the target's max_position_embeddings"),  # a null factor is max_position_embeddings / the original
    (1024, {"rope_type": "linear", "factor": 2.0}, 2048,
     "the target's RoPE scaling: linear factor 2 x max_position_embeddings 1024"),
    (8192, dict(LLAMA3), 8192, "the target's max_position_embeddings"),  # 8 x 1024 reaches no further
])
def test_a_request_past_the_scaled_window_is_refused_naming_it(stated, rope, limit, source):
    target = Qwen3(Qwen3Config(**SMALL, max_position_embeddings=stated, rope_scaling=rope)).eval()
    assert len(generate(target, None, [1] * (limit - 2), method="ar", max_new_tokens=2, stop_ids=[]).tokens) == 2
    with pytest.raises(ValueError) as e:
        generate(target, None, [1] * (limit - 2), method="ar", max_new_tokens=3)
    assert str(e.value) == (f"prompt ({limit - 2} tokens) + max_new_tokens (3) exceeds the {limit} positions the "
                            f"target reaches ({source})")
