"""The one FlexAttention mask (prefix + allow matrix) against dense SDPA with the explicit boolean mask, eager and
compiled, without recompiles as trees and prefixes change; KV compaction."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.nn.attention.flex_attention import flex_attention

from conftest import causal
from cpu import dense_mask
from draft_tree import ancestor_matrix, build_tree
from tree_attn import BLOCK, PrefixMask, compact_kv, flex_kernel_options

KV_LEN = 256


def random_tree(budget, depth, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logq = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 2, -1)
    tokens, parents, depths = build_tree(logq, budget)
    return parents, ancestor_matrix(parents, depth)


def qkv(q_len, seed, heads=4, kv_heads=2, dim=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, q_len, dim, generator=g), torch.randn(1, kv_heads, KV_LEN, dim, generator=g),
            torch.randn(1, kv_heads, KV_LEN, dim, generator=g))


def sdpa_reference(q, k, v, dense):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)


def mask_everywhere(block_mask):
    """A BlockMask's mask_mod over every slot of the cache: [batch, 1, q_len, kv_len]."""
    q_len, kv_len = block_mask.seq_lengths
    b = torch.arange(block_mask.kv_indices.shape[0])[:, None, None, None]
    return block_mask.mask_mod(b, 0, torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :])


def explicit_mask(prefix, anc, q_len):
    """The intended mask written out by hand: committed slots < prefix, then the tree's ancestor-or-self rows."""
    dense = torch.zeros(q_len, KV_LEN, dtype=torch.bool)
    dense[:, :prefix] = True
    dense[:, prefix:prefix + q_len] = anc
    return dense


@settings(deadline=None, max_examples=25)
@given(budget=st.integers(1, 40), depth=st.integers(1, 6), vocab=st.integers(2, 6), prefix=st.integers(0, 200),
       seed=st.integers(0, 10**6))
def test_tree_mask_equals_dense_sdpa(budget, depth, vocab, prefix, seed):
    parents, anc = random_tree(budget, depth, vocab, seed)
    mask = PrefixMask(budget + 1, KV_LEN, "cpu")
    block_mask = mask.set(prefix, anc)
    dense = explicit_mask(prefix, anc, budget + 1)
    assert torch.equal(mask_everywhere(block_mask)[0, 0], dense)
    # eager CPU attention hands SDPA the same mask over the KV blocks it visits, and nothing is visible past them
    as_sdpa = dense_mask(block_mask, budget + 1)[0, 0]
    assert torch.equal(as_sdpa, dense[:, :as_sdpa.shape[1]]) and not dense[:, as_sdpa.shape[1]:].any()
    q, k, v = qkv(budget + 1, seed)
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(out, sdpa_reference(q, k, v, dense), atol=1e-5, rtol=1e-5)


def test_eager_cpu_mask_is_materialized_again_after_each_set():
    """cpu.dense_mask keeps the mask it materialized on the BlockMask, for the layers of one forward, and makes it
    again once the PrefixMask's tensors are written again: a new allow under the same prefix, a new prefix, an
    allow written in place."""
    with torch.inference_mode():  # as the engine makes and sets its masks
        mask = PrefixMask(4, KV_LEN, "cpu")
        first = dense_mask(mask.set(10, causal(4)), 4)
        assert dense_mask(mask.block_mask, 4) is first
        for prefix, allow in ((10, torch.ones(4, 4, dtype=torch.bool)), (200, None)):
            again = dense_mask(mask.set(prefix, allow), 4)
            assert torch.equal(again, mask_everywhere(mask.block_mask)[..., :again.shape[-1]])
            assert not torch.equal(again[..., :first.shape[-1]], first)
        mask.allow.zero_()
        assert not dense_mask(mask.block_mask, 4)[..., 200:].any()


def test_mask_rows_see_only_prefix_and_ancestors():
    # root 0 -> a(1) -> b(2); root -> c(3)
    parents = torch.tensor([0, 1, 0])
    anc = ancestor_matrix(parents)
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(anc, expected)
    mask = PrefixMask(4, KV_LEN, "cpu")
    mask.set(10, anc)
    dense = mask_everywhere(mask.block_mask)[0, 0]
    assert dense[:, :10].all() and not dense[:, 14:].any()
    assert torch.equal(dense[:, 10:14], expected)


def test_compiled_tree_attention_matches_sdpa_without_recompiles():
    from torch._dynamo.utils import counters
    budget, depth = 24, 5
    mask = PrefixMask(budget + 1, KV_LEN, "cpu")
    attend = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=mask.block_mask, enable_gqa=True),
                           dynamic=False, fullgraph=True)
    with torch.inference_mode():
        for round_ in range(21):
            if round_ == 1:
                counters.clear()  # round 0 compiles; the next 20 trees and prefixes must reuse the graph
            parents, anc = random_tree(budget, depth, 3 + round_ % 4, seed=round_)
            prefix = 11 * round_ + round_ % 3  # 0 to 222: no full block, then one (the kernel skips its mask)
            mask.set(prefix, anc)
            q, k, v = qkv(budget + 1, seed=round_)
            out = attend(q, k, v)
            torch.testing.assert_close(out, sdpa_reference(q, k, v, explicit_mask(prefix, anc, budget + 1)),
                                       atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    assert not counters["recompiles"] and not counters["graph_break"]


@pytest.mark.parametrize("depth", [5, 15])
def test_tree_mask_built_inside_the_compiled_graph_matches_sdpa(depth):
    # As Engine.round does it: the ancestor matrix is computed and written into the mask in the same graph as the
    # FlexAttention call that reads it. (A scatter-built matrix passed the eager tests and gave wrong outputs
    # here; the same values must reach the kernel, every round.) Depths 5 and 15 take 3 and 4 pointer doublings:
    # torch 2.11's CPU lowering failed on even counts until PrefixMask.set made the matrix a stored buffer.
    budget = 24
    mask = PrefixMask(budget + 1, KV_LEN, "cpu")
    _, k, v = qkv(budget + 1, seed=0)

    def attend(q, prefix, parents):
        block_mask = mask.set(prefix, ancestor_matrix(parents, depth, dtype=torch.uint8))
        return flex_attention(q * 1.0, k, v, block_mask=block_mask, enable_gqa=True)

    attend = torch.compile(attend, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        for round_ in range(6):
            parents, anc = random_tree(budget, depth, 3 + round_ % 4, seed=round_)
            prefix = 41 * round_ + round_ % 3  # 0 to 207: full blocks from round 4 on
            q, _, _ = qkv(budget + 1, seed=round_)
            out = attend(q, torch.tensor([prefix]), parents[None])  # per request: see PrefixMask.set
            torch.testing.assert_close(out, sdpa_reference(q, k, v, explicit_mask(prefix, anc, budget + 1)),
                                       atol=1e-5, rtol=1e-5)


def test_prefix_mask_visits_only_needed_kv_blocks():
    # (full blocks, masked blocks, the first masked block): blocks wholly below the prefix are full, those from
    # the prefix's block to the last new row's are masked, none past it are visited.
    mask = PrefixMask(3, 4 * 128, "cpu")

    def visited(prefix):
        mask.set(prefix, causal(3))
        return int(mask.full_num), int(mask.kv_num_blocks), int(mask.kv_indices.flatten()[0])

    assert visited(0) == (0, 1, 0)
    assert visited(126) == (0, 2, 0)  # the new rows straddle blocks 0 and 1
    assert visited(128) == (1, 1, 1)
    assert visited(500) == (3, 1, 3)


def test_compact_kv_moves_the_path_to_contiguous_slots():
    cache = torch.arange(2 * 40, dtype=torch.float32).view(1, 2, 40, 1).repeat(1, 1, 1, 3)
    before = cache.clone()
    prefix, path = 10, torch.tensor([0, 2, 5, 6, 0, 0])  # rows 0, 2, 5, 6 accepted; the rest is padding
    compact_kv([cache], prefix, path)
    assert torch.equal(cache[:, :, :prefix], before[:, :, :prefix])  # the committed prefix is untouched
    assert torch.equal(cache[:, :, prefix:prefix + 4], before[:, :, [10, 12, 15, 16]])


def test_batched_mask_gives_each_request_its_own_prefix_and_tree():
    # Three requests, each with its own prefix and tree: row n of the batched mask is request n's own mask, in the
    # BlockMask's mask_mod, in the dense form, and in what FlexAttention computes.
    budget, depth = 9, 4
    trees = [random_tree(budget, depth, 3, seed) for seed in (1, 2, 3)]
    prefixes = torch.tensor([0, 130, 57])
    mask = PrefixMask(budget + 1, KV_LEN, "cpu", batch=3)
    block_mask = mask.set(prefixes, torch.stack([anc.to(torch.uint8) for _, anc in trees]))
    dense = mask_everywhere(block_mask)
    assert mask.kv_num_blocks.flatten().tolist() == [1, 1, 1]
    assert mask.full_num.flatten().tolist() == [0, 1, 0]
    q, k, v = (torch.cat(parts) for parts in zip(*(qkv(budget + 1, seed=s) for s in (5, 6, 7))))
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    for n, (_, anc) in enumerate(trees):
        expected = explicit_mask(int(prefixes[n]), anc, budget + 1)
        assert torch.equal(dense[n, 0], expected)
        torch.testing.assert_close(out[n:n + 1], sdpa_reference(q[n:n + 1], k[n:n + 1], v[n:n + 1], expected),
                                   atol=1e-5, rtol=1e-5)
    as_sdpa = dense_mask(block_mask, budget + 1)
    assert torch.equal(as_sdpa, dense[..., :as_sdpa.shape[-1]])


def test_compact_kv_moves_each_requests_path_in_its_own_row():
    cache = torch.arange(3 * 2 * 40, dtype=torch.float32).view(3, 2, 40, 1).repeat(1, 1, 1, 3)
    before = cache.clone()
    prefixes = torch.tensor([10, 0, 25])
    paths = torch.tensor([[0, 2, 5, 0], [0, 1, 2, 3], [0, 3, 0, 0]])
    compact_kv([cache], prefixes, paths)
    for n, (prefix, path) in enumerate(zip(prefixes.tolist(), paths.tolist())):
        single = before[n:n + 1].clone()
        compact_kv([single], prefix, torch.tensor(path))
        assert torch.equal(cache[n:n + 1], single)


def test_flex_kernel_options_send_every_multi_row_cuda_call_to_the_main_kernel():
    # Every query length the engine runs: decode, draft blocks (the bundled drafter's 8, z-lab's 16), B + 1 for
    # every budget it accepts, the prefill chunk. Inductor's decoding kernel takes CUDA queries of fewer than BLOCK
    # rows; under our masks it is measured right for one row only (tree_attn.flex_kernel_options), and the main
    # kernel's option must be one this torch accepts.
    from torch._inductor.runtime.runtime_utils import next_power_of_2
    from torch.nn.attention.flex_attention import FlexKernelOptions
    from ddtree import PREFILL_CHUNK
    lengths = {1, 8, 16, PREFILL_CHUNK} | {budget + 1 for budget in range(1, 1025)}
    for q_len in sorted(lengths):
        options = flex_kernel_options(q_len, "cuda")
        assert flex_kernel_options(q_len, "cpu") is None
        if 1 < q_len < BLOCK:
            assert options is not None and set(options) <= set(FlexKernelOptions.__annotations__), q_len
            assert options.get("BACKEND", "TRITON") == "TRITON" and options.get("FORCE_USE_FLEX_ATTENTION", True)
        else:
            assert options is None, q_len
            if q_len == 1:  # the decoding kernel's tile (inductor's rule) fits the mask's query block
                for group in (1, 2, 4, 8):
                    assert BLOCK % max(next_power_of_2(q_len * group), 16) == 0


def explicit_window_mask(prefix, allow, q_len, window):
    """A sliding-window layer's mask by hand: row i (slot prefix + i) sees slot s when the plain mask lets it and
    |s - (prefix + i)| < window (flash-attention's window_size = (window - 1, window - 1))."""
    slot = torch.arange(KV_LEN)[None, :]
    own = prefix + torch.arange(q_len)[:, None]
    return explicit_mask(prefix, allow, q_len) & ((slot - own).abs() < window)


@settings(deadline=None, max_examples=30)
@given(q_len=st.integers(1, 16), window=st.integers(1, 300), prefix=st.integers(0, 230), seed=st.integers(0, 10**6))
def test_sliding_window_mask_equals_dense_sdpa(q_len, window, prefix, seed):
    prefix = min(prefix, KV_LEN - q_len)
    allow = torch.ones(q_len, q_len, dtype=torch.bool)  # the drafter's block sees itself
    mask = PrefixMask(q_len, KV_LEN, "cpu", window=window)
    block_mask = mask.set(prefix, allow)
    dense = explicit_window_mask(prefix, allow, q_len, window)
    assert torch.equal(mask_everywhere(block_mask)[0, 0], dense)
    # the blocks visited hold every visible slot, and the dense path covers them
    as_sdpa = dense_mask(block_mask, q_len)[0, 0]
    assert torch.equal(as_sdpa, dense[:, :as_sdpa.shape[1]]) and not dense[:, as_sdpa.shape[1]:].any()
    q, k, v = qkv(q_len, seed)
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(out, sdpa_reference(q, k, v, dense), atol=1e-5, rtol=1e-5)


def test_compiled_sliding_window_attention_matches_sdpa_without_recompiles():
    from torch._dynamo.utils import counters
    q_len, window = 8, 150
    mask = PrefixMask(q_len, KV_LEN, "cpu", window=window)
    attend = torch.compile(lambda q, k, v, prefix: flex_attention(q, k, v, block_mask=mask.set(prefix),
                                                                  enable_gqa=True), dynamic=False, fullgraph=True)
    with torch.inference_mode():
        for round_, prefix in enumerate((0, 5, 140, 149, 151, 200, 248)):  # windows reaching block 0, then past it
            if round_ == 1:
                counters.clear()
            q, k, v = qkv(q_len, seed=round_)
            out = attend(q, k, v, torch.tensor([prefix]))
            ref = sdpa_reference(q, k, v, explicit_window_mask(prefix, torch.ones(q_len, q_len, dtype=torch.bool),
                                                               q_len, window))
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 0 and not counters["recompiles"], dict(counters["stats"])
