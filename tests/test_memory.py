"""memory.memory_per_token against the buffers the engine allocates: the K/V caches of a dense and a hybrid target
and of a drafter, and a hybrid target's recurrent states, in float32 and bfloat16 (whose recurrent state stays
float32); and the command line's --memory line."""

import re

import pytest
import torch

from conftest import cli, load_pair
from drafter import DFlashDrafter
from memory import memory_per_token
from model import Qwen3
from scripts.checkpoints import hybrid_text_config, random_hybrid_model, save_hybrid

pytestmark = pytest.mark.usefixtures("one_thread")

SLOTS, BATCH = 256, 3


def allocated(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def check_against_buffers(target, drafter, dtype):
    m = memory_per_token(target, drafter, dtype)
    target, drafter = target.to(dtype), drafter.to(dtype) if drafter is not None else None
    target.setup_cache(SLOTS, BATCH)
    assert allocated(t for kv in target.kv_caches() for t in kv) == m["target_kv"] * SLOTS * BATCH
    states = target.state_tensors() if hasattr(target, "state_tensors") else ()  # a family without recurrent state
    assert allocated(states) == m["recurrent"] * BATCH
    if drafter is not None:
        drafter.setup_cache(SLOTS, BATCH)
        assert allocated(t for kv in drafter.kv_caches() for t in kv) == m["drafter_kv"] * SLOTS * BATCH
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_pair_equals_its_buffers(random_pair_files, dtype):
    target, drafter = load_pair(random_pair_files)
    m = check_against_buffers(target, drafter, dtype)
    assert m["recurrent"] == 0 and m["target_kv"] > 0 and m["drafter_kv"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_target_equals_its_buffers(tmp_path, dtype):
    save_hybrid(random_hybrid_model(hybrid_text_config(), seed=0, std=0.3), str(tmp_path))
    target = Qwen3.from_pretrained(str(tmp_path), device="cpu")
    m = check_against_buffers(target, None, dtype)
    assert m["recurrent"] > 0 and m["drafter_kv"] == 0


@pytest.mark.parametrize("method", ["ddtree", "ar"])
def test_cli_prints_the_memory_line_before_generating(method):
    from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET
    target = Qwen3.from_pretrained(DEFAULT_TARGET, device="cpu")
    drafter = DFlashDrafter.from_pretrained(DEFAULT_DRAFT, device="cpu") if method != "ar" else None
    m = memory_per_token(target, drafter)
    code, out, err = cli("--prompt", "def f(x):", "--method", method, "--max-new-tokens", "4", "--memory",
                         "--no-compile")
    assert code == 0 and out, err
    line = err.splitlines()[0]
    assert line.startswith(f"memory: target K/V {m['target_kv']:,} bytes/token, drafter K/V {m['drafter_kv']:,} "
                           f"bytes/token, recurrent states 0 bytes/request; "), line
    tokens = int(re.search(r"; ([\d,]+) tokens of context: ", line)[1].replace(",", ""))
    assert tokens > 4 and line.endswith(f": {(m['target_kv'] + m['drafter_kv']) * tokens / 2**20:,.1f} MiB per request")
    assert (m["drafter_kv"] == 0) == (method == "ar")


GEMMA4_31B = dict(  # google/gemma-4-31B-it's text config: the fields that size its layers
    model_type="gemma4_text", vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
    num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
    attention_k_eq_v=True, sliding_window=1024, final_logit_softcapping=30.0, max_position_embeddings=262144)


def gemma4_target(fields: dict, device: str):
    import gemma4
    with torch.device(device):
        return gemma4.Gemma4(gemma4.gemma4_config(fields, "config.json"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma4_target_equals_its_buffers(dtype):
    """A Gemma 4 target's sliding and full layers each with their own K/V heads and head size; full layers whose
    values are their keys still hold a V cache (the keys value-normed without RoPE, not the K cache's rows)."""
    small = dict(GEMMA4_31B, vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                 num_global_key_value_heads=1, sliding_window=8)
    target = gemma4_target(small, "cpu")
    m = check_against_buffers(target, None, dtype)
    item = torch.empty((), dtype=dtype).element_size()
    assert m["target_kv"] == (5 * 2 * 2 * 8 + 1 * 2 * 1 * 16) * item and m["recurrent"] == 0
    assert all(a.self_attn.v_cache.data_ptr() != a.self_attn.k_cache.data_ptr() for a in target.layers)


def test_gemma4_31b_bytes_per_token():
    """The 31B's layer shapes on the meta device: 50 sliding layers of 16 K/V heads of 256 and 10 full layers of 4
    of 512, K and V each, in bfloat16: 901,120 bytes per token (docs/checkpoints.md)."""
    target = gemma4_target(GEMMA4_31B, "meta").to(torch.bfloat16)
    m = memory_per_token(target)
    target.setup_cache(SLOTS, BATCH)
    assert allocated(t for t in target.kv_caches()) == m["target_kv"] * SLOTS * BATCH
    assert m["target_kv"] == 901_120
