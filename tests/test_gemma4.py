"""Gemma 4 targets (gemma4.py) against transformers 5.24's gemma4, in float64 (transformers' float32 casts kept
float64: conftest.float64_kept): random checkpoints written by transformers itself, in the text-only layout
(Gemma4ForCausalLM), the hub's multimodal one (Gemma4ForConditionalGeneration, a tiny vision tower that is not
read) and with the 26B-A4B's MoE block beside the MLP, with sliding window 8, full layers of their own head size
whose values are their keys, and prompts of three windows. Logits of a prefill, of cached decode steps and of a
tree verify (each node against transformers run on its own path) equal transformers'; greedy ar equals
transformers' greedy; dflash and ddtree with a Gemma-style drafter written by z-lab's `dflash` package (embedding
scale, softcap, a sliding layer) equal ar."""

import json
import os

import pytest
import torch

import gemma4
from model import Qwen3
from conftest import float64_kept
from drafter import DFlashDrafter
from ddtree import generate
from tree_attn import PrefixMask

transformers = pytest.importorskip("transformers")
reference = pytest.importorskip("dflash.model", reason="z-lab's dflash package: pip install --no-deps dflash==0.1.0")

VOCAB, HIDDEN, WINDOW = 16, 32, 8
PROMPT = [int(t) for t in torch.randint(0, VOCAB, (3 * WINDOW,), generator=torch.Generator().manual_seed(5))]
TEXT = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=WINDOW, final_logit_softcapping=4.0, hidden_size_per_layer_input=0,
            max_position_embeddings=512, eos_token_id=None,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                         "sliding_attention", "full_attention"])

pytestmark = pytest.mark.usefixtures("one_thread")


def randomized(module, seed: int):
    """Weights far from transformers' init (norms around 1, a layer scale), so that every part shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
        for name, b in module.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.8)
    return module.double().eval()


MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)


def write_target(path: str, layout: str):
    text = transformers.Gemma4TextConfig(**TEXT, **(MOE if layout == "moe" else {}), experts_implementation="eager")
    if layout in ("text", "moe"):
        hf = transformers.Gemma4ForCausalLM(text)
    else:
        vision = transformers.models.gemma4.configuration_gemma4.Gemma4VisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=8)
        hf = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
            text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None))
    randomized(hf, seed=0).save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=["text", "hub", "moe"])
def pair(request, tmp_path_factory):
    """(transformers' model, ours) of one layout."""
    path = str(tmp_path_factory.mktemp(f"gemma4-{request.param}"))
    hf = write_target(path, request.param)
    ours = Qwen3.from_pretrained(path, device="cpu", dtype=torch.float64)  # the public loader hands it over
    assert isinstance(ours, gemma4.Gemma4)
    assert ours.eos_ids == []  # runs as long as asked, as transformers' greedy
    return hf, ours


def hf_logits(hf, ids: list) -> torch.Tensor:
    with torch.no_grad(), float64_kept():
        return hf(torch.tensor([ids])).logits[0]


def test_prefill_and_decode_logits_equal_transformers_past_the_window(pair):
    hf, ours = pair
    ref = hf_logits(hf, PROMPT)
    ours.setup_cache(128)
    n = len(PROMPT)
    pos = torch.arange(n)
    with torch.no_grad():
        whole = ours(torch.tensor(PROMPT), pos, pos, PrefixMask(n, 128, "cpu", causal=True).set(0))[0]
        assert torch.allclose(whole, ref, rtol=0, atol=1e-10), (whole - ref).abs().max()
        head = 2 * WINDOW  # then a cached decode step per token past two windows
        ours(torch.tensor(PROMPT[:head]), pos[:head], pos[:head], PrefixMask(head, 128, "cpu", causal=True).set(0))
        step = PrefixMask(1, 128, "cpu")
        for i in range(head, n):
            logits = ours(torch.tensor(PROMPT[i:i + 1]), pos[i:i + 1], pos[i:i + 1], step.set(i))[0][0]
            assert torch.allclose(logits, ref[i], rtol=0, atol=1e-10), (i, (logits - ref[i]).abs().max())


def test_tree_verify_counts_each_nodes_window_along_its_path(pair):
    """A verify after three windows of prompt: nodes whose row is past their depth (branches) see the committed
    tokens within the window of their own position, as transformers sees their path alone."""
    hf, ours = pair
    parents = [-1, 0, 0, 1, 2, 3, 3, 5, 6]
    tokens = [3, 7, 1, 9, 4, 11, 2, 5, 14]
    depth = [0] * len(parents)
    for i, p in enumerate(parents[1:], 1):
        depth[i] = depth[p] + 1
    allow = torch.zeros(len(parents), len(parents), dtype=torch.uint8)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            allow[i, j], j = 1, parents[j]
    prefix = PROMPT[:-1]
    start = len(prefix)
    ours.setup_cache(128)
    pos = torch.arange(start)
    with torch.no_grad():
        ours(torch.tensor(prefix), pos, pos, PrefixMask(start, 128, "cpu", causal=True).set(0))
        mask = PrefixMask(len(parents), 128, "cpu")
        logits = ours(torch.tensor(tokens), start + torch.tensor(depth), start + torch.arange(len(parents)),
                      mask.set(start, allow))[0]
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path, j = [tokens[j]] + path, parents[j]
        ref = hf_logits(hf, prefix + path)[-1]
        assert torch.allclose(logits[i], ref, rtol=0, atol=1e-10), (i, (logits[i] - ref).abs().max())


@pytest.fixture(scope="module")
def drafter(pair, tmp_path_factory):
    """A Gemma-style DFlash drafter written by z-lab's package: the target's embeddings scaled by sqrt(hidden), a
    softcap, a sliding layer and a full one."""
    path = str(tmp_path_factory.mktemp("gemma4-drafter"))
    fields = dict(mask_token_id=VOCAB - 1, target_layer_ids=[1, 4], block_size=6,
                  input_embedding_scale=HIDDEN ** 0.5, final_logit_softcapping=4.0)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=512, num_target_layers=6, dflash_config=fields,
                                      layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                                      use_sliding_window=True, attn_implementation="sdpa")
    torch.manual_seed(1)
    randomized(reference.DFlashDraftModel(config), seed=1).save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dflash_config"]["input_embedding_scale"] == HIDDEN ** 0.5
    return DFlashDrafter.from_pretrained(path, device="cpu", dtype=torch.float64).bind(pair[1])


NEW = 20


def test_greedy_ar_equals_transformers_greedy(pair):
    hf, ours = pair
    with torch.no_grad(), float64_kept():
        ids = torch.tensor([PROMPT])  # (an explicit mask: generate would take the prompt's 0s for padding)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    assert out.shape[1] == len(PROMPT) + NEW
    expected = out[0, len(PROMPT):].tolist()
    assert generate(ours, None, PROMPT, method="ar", max_new_tokens=NEW).tokens == expected


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_speculative_greedy_equals_ar(pair, drafter, method):
    ours = pair[1]
    ar = generate(ours, None, PROMPT, method="ar", max_new_tokens=NEW)
    run = generate(ours, drafter, PROMPT, method=method, max_new_tokens=NEW,
                   **(dict(budget=8) if method == "ddtree" else {}))
    assert run.tokens == ar.tokens
    assert run.stats["rounds"] < NEW  # the drafts were read: some round accepted more than one token


def config_dir(path, **fields) -> str:
    with open(path / "config.json", "w") as f:
        json.dump(dict(TEXT, model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], **fields), f)
    return str(path)


def test_small_models_are_refused(tmp_path):
    with pytest.raises(ValueError, match="per-layer input embeddings"):
        gemma4.from_pretrained(config_dir(tmp_path, hidden_size_per_layer_input=8), device="cpu")



AUTO_GRID = (2, 6, 12)  # tree sizes for the tiny drafter (block 6: 5 draft positions)
SWITCHES = ["ar", "chain", 12, 2, "ar", 6, "chain", "ar", 12, 12, 6, 2, "chain", 6]


def test_budget_auto_equals_ar_through_every_switch(pair, drafter, monkeypatch):
    """budget auto on a Gemma 4 target, its choice forced through a cycle of every candidate (plain decoding, the
    chain, trees of 2, 6 and 12), so that each switch happens mid-request past the sliding window: AR's tokens."""
    import budget
    monkeypatch.setattr(budget, "AUTO_BUDGETS", AUTO_GRID)
    cycle = iter(SWITCHES * 10)
    monkeypatch.setattr(budget.AutoBudget, "choose", lambda self: (next(cycle), False))
    ours = pair[1]
    ar = generate(ours, None, PROMPT, method="ar", max_new_tokens=2 * NEW)
    auto = generate(ours, drafter, PROMPT, budget="auto", max_new_tokens=2 * NEW)
    assert auto.tokens == ar.tokens
    assert set(auto.stats["auto"]["schedule"]) == {"ar", "chain", "2", "6", "12"}


def test_budget_auto_equals_ar_as_it_chooses(pair, drafter, monkeypatch):
    """Unforced, from a planted calibration (every candidate viable, no renewal, plain decoding the dearest, so
    that the weak random drafter's trees still win rounds; how many follows the round times measured on the way):
    the choice follows the estimates, and the tokens are AR's."""
    import budget
    import ddtree
    monkeypatch.setattr(budget, "AUTO_BUDGETS", AUTO_GRID)
    monkeypatch.setattr(budget, "RENEW_BELOW", 0.0)
    ours = pair[1]
    spec = ddtree.Speculation(budget="auto")
    with torch.inference_mode():
        length = ddtree.cache_length(len(PROMPT), 2 * NEW, "ddtree", spec, drafter, AUTO_GRID)
        key = ddtree.get_engine(ours, drafter, "ddtree", ddtree.Sampling(), spec, length, False, 1,
                                auto=AUTO_GRID).key
    budget.save_costs(key, dict(round_s={"ar": 1.5e-3, "chain": 1e-3, "2": 1e-3, "6": 1.05e-3, "12": 1.1e-3}))
    ar = generate(ours, None, PROMPT, method="ar", max_new_tokens=2 * NEW)
    res = generate(ours, drafter, PROMPT, budget="auto", max_new_tokens=2 * NEW)
    assert res.tokens == ar.tokens
    a = res.stats["auto"]
    assert len(a["schedule"]) == res.stats["rounds"] and a["choice"] in a["candidates"]
    assert a["schedule"][0] == "12" and 1 <= a["probe_rounds"] <= res.stats["rounds"]


# A chat template in the structure of Gemma 4's (<|turn>role ... <turn|> turns, the assistant as 'model', a system
# turn that opens with <|think|> when thinking is on, contents trimmed, a list of parts read for its text).
GEMMA_TEMPLATE = """{{- bos_token -}}
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content | trim -}}
    {%- else -%}
        {%- for part in content if part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(system=false) -%}
{%- if enable_thinking or messages[0]['role'] == 'system' -%}
    {{- '<|turn>system\\n' -}}
    {%- if enable_thinking -%}{{- '<|think|>' -}}{%- endif -%}
    {%- if messages[0]['role'] == 'system' -%}
        {{- render_content(messages[0]['content']) -}}{%- set ns.system = true -%}
    {%- endif -%}
    {{- '<turn|>\\n' -}}
{%- endif -%}
{%- set loop_messages = messages[1:] if ns.system else messages -%}
{%- for message in loop_messages -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<|turn>' + role + '\\n' + render_content(message['content']) + '<turn|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}
"""
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|think|>"]


def test_gemma_chat_template_renders_like_transformers(tmp_path):
    """A tiny tokenizer with a Gemma-4-style chat template: Text.render_chats (the template sandboxed in a child
    process, thinking off) renders what transformers' apply_chat_template renders, a system turn and a
    conversation included, and the turn markers encode as their special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from text import Text
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x * 2", "user model system Why? hello"] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=GEMMA_SPECIALS, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<bos>", eos_token="<turn|>", pad_token="<pad>",
        chat_template=GEMMA_TEMPLATE)))
    hf, ours = PreTrainedTokenizerFast.from_pretrained(str(tmp_path)), Text(str(tmp_path))
    chats = ["def f(x):  ",
             [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "hello"}],
             [{"role": "user", "content": [{"type": "text", "text": "def f(x):"}]},
              {"role": "assistant", "content": "    return x"}, {"role": "user", "content": "Why?"}]]
    rendered = ours.render_chats(chats)
    for chat, text in zip(chats, rendered):
        messages = [{"role": "user", "content": chat}] if isinstance(chat, str) else chat
        assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              enable_thinking=False)
    assert rendered[0] == "<bos><|turn>user\ndef f(x):<turn|>\n<|turn>model\n"
    ids = ours.encode(rendered[2])
    assert ids[:2] == [tok.token_to_id("<bos>"), tok.token_to_id("<|turn>")] and \
        ids.count(tok.token_to_id("<turn|>")) == 3 and tok.token_to_id("<|think|>") not in ids
    assert ids == hf.encode(rendered[2], add_special_tokens=False)
