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
    assert allocated(target.state_tensors()) == m["recurrent"] * BATCH
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
