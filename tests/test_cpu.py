"""The CPU seam (cpu/). The attention kernel (cpu/attention.cpp) against SDPA with the mask written out by
hand: shapes, per-request prefixes and trees, rows that see little or nothing, NaNs; inside a compiled graph
without recompiles; as the attention CpuAttention runs; and the fallback to FlexAttention where it cannot be built.
CpuLinear's one-row reduction and its oneDNN copies in frozen graphs; CpuAttention's copy of the K/V rows there."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import model
import rope
import cpu
from draft_tree import ancestor_matrix, build_tree
from cpu import cpu_attention, load_cpu_kernel
from tree_attn import PrefixMask

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert load_cpu_kernel(), "the CPU attention kernel did not build (see the warning)"


def random_allow(q_len, g, kind):
    if kind == "tree" and q_len > 1:
        logq = torch.log_softmax(torch.randn(6, 4, generator=g) * 2, -1)
        _, parents, _ = build_tree(logq, q_len - 1)
        return ancestor_matrix(parents, 6)
    if kind == "causal":
        return torch.ones(q_len, q_len, dtype=torch.bool).tril()
    return torch.ones(q_len, q_len, dtype=torch.bool)  # the drafter's block


def reference(q, k, v, prefix, allow, scale):
    """SDPA under the mask written out per request: slots below prefix[n], then allow[n] over the new rows."""
    n, _, q_len, _ = q.shape
    dense = torch.zeros(n, 1, q_len, k.shape[2], dtype=torch.bool)
    for i in range(n):
        p = int(prefix[i])
        dense[i, 0, :, :p] = True
        dense[i, 0, :, p:p + q_len] = allow[i].bool()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=True).transpose(1, 2)


def case(n, kv_heads, group, head_dim, q_len, slots, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    # q as the model hands it over: [N, Q, H, D] memory seen as [N, H, Q, D]
    q = torch.randn(n, q_len, heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(n, kv_heads, slots, head_dim, generator=g).to(dtype)
    v = torch.randn(n, kv_heads, slots, head_dim, generator=g).to(dtype)
    return q, k, v


@settings(deadline=None, max_examples=40)
@given(n=st.integers(1, 3), kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from(cpu.KERNEL_HEAD_DIMS), q_len=st.integers(1, 20), blocks=st.integers(1, 3),
       kind=st.sampled_from(["tree", "causal", "block"]), dtype=st.sampled_from(cpu.KERNEL_DTYPES),
       seed=st.integers(0, 10**6), data=st.data())
def test_kernel_equals_sdpa_with_the_explicit_mask(n, kv_heads, group, head_dim, q_len, blocks, kind, dtype, seed,
                                                   data):
    """bf16 inputs: the kernel sums in float32 and rounds its output once, so it is within half a bf16 step (2^-8
    relative) of float32 SDPA over the same (bf16) values."""
    slots = 128 * blocks
    q, k, v = case(n, kv_heads, group, head_dim, q_len, slots, seed, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    allow = torch.stack([random_allow(q_len, g, kind) for _ in range(n)])
    # each request its own prefix, up to the last one that leaves room for its rows
    prefix = [data.draw(st.integers(0, slots - q_len)) for _ in range(n)]
    mask = PrefixMask(q_len, slots, "cpu", batch=n)
    block_mask = mask.set(prefix, allow.to(torch.uint8))
    scale = head_dim ** -0.5
    out = cpu_attention(q, k, v, block_mask, scale)
    assert out.dtype == dtype
    expected = reference(q.float(), k.float(), v.float(), torch.tensor(prefix), allow, scale)
    tol = 2e-5 if dtype == torch.float32 else 2.0**-8 + 2e-5
    torch.testing.assert_close(out.float(), expected, atol=2e-5, rtol=tol)


def test_row_that_sees_nothing_is_zero_and_nans_reach_the_rows_that_see_them():
    q, k, v = case(1, 2, 2, 64, 4, 128, seed=0)
    allow = torch.ones(1, 4, 4, dtype=torch.uint8).tril()
    allow[0, 2] = 0  # row 2 sees no new row
    mask = PrefixMask(4, 128, "cpu")
    out = cpu_attention(q, k, v, mask.set(0, allow), 0.125)
    assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2]))  # as FlexAttention gives a row with no visible slot
    torch.testing.assert_close(out[0, [0, 1, 3]], reference(q, k, v, [0], allow, 0.125)[0, [0, 1, 3]])
    # a NaN in new slot 1's V: rows 1 and 3 see it, row 0 does not
    v[0, :, 1, 5] = float("nan")
    out = cpu_attention(q, k, v, mask.set(0, allow), 0.125)
    assert out[0, [1, 3]].isnan().any(-1).all() and not out[0, 0].isnan().any()
    # a NaN in one query row stays in that row (never turned into a finite answer)
    q, k, v = case(1, 2, 2, 64, 4, 128, seed=1)
    q[0, 1, 2, 0] = float("nan")
    out = cpu_attention(q, k, v, mask.set(30, torch.ones(1, 4, 4, dtype=torch.uint8)), 0.125)
    assert out[0, 2, 1].isnan().all() and not out[0, [0, 1, 3]].isnan().any()


def test_compiled_kernel_follows_the_mask_without_recompiles():
    from torch._dynamo.utils import counters
    budget, depth, slots = 12, 5, 256
    mask = PrefixMask(budget + 1, slots, "cpu")
    _, k, v = case(1, 2, 2, 64, budget + 1, slots, seed=0)

    def attend(q, prefix, parents):  # as a round does it: the mask written in the graph that reads it
        block_mask = mask.set(prefix, ancestor_matrix(parents, depth, dtype=torch.uint8))
        return cpu_attention(q * 1.0, k, v, block_mask, 0.125)

    attend = torch.compile(attend, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        for round_ in range(8):
            if round_ == 1:
                counters.clear()
            g = torch.Generator().manual_seed(round_)
            _, parents, _ = build_tree(torch.log_softmax(torch.randn(depth, 4, generator=g) * 2, -1), budget)
            prefix = 29 * round_ + round_ % 3  # 0 to 205
            q, _, _ = case(1, 2, 2, 64, budget + 1, slots, seed=round_)
            out = attend(q, torch.tensor([prefix]), parents[None])
            torch.testing.assert_close(out, reference(q, k, v, [prefix], ancestor_matrix(parents, depth)[None], 0.125),
                                       atol=2e-5, rtol=2e-5)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    assert not counters["recompiles"] and not counters["graph_break"]


@pytest.mark.parametrize("dtype", cpu.KERNEL_DTYPES)
def test_attention_layer_runs_the_kernel_where_it_applies(monkeypatch, dtype):
    attn = cpu.CpuAttention(64, 4, 2, 64, 1e-6).to(dtype)
    model.allocate_kv_caches([SimpleNamespace(self_attn=attn)], 256, dtype, "cpu")
    x = torch.randn(1, 5, 64, dtype=dtype)
    cos, sin = (t[:, None] for t in model.rope_cos_sin(torch.arange(40, 45)[None], rope.rope_inv_freq(64, 1e6, None),
                                                       1.0, dtype))
    mask = PrefixMask(5, 256, "cpu")
    block_mask = mask.set(40, torch.ones(5, 5, dtype=torch.bool).tril())
    attn.k_cache.normal_(), attn.v_cache.normal_()
    calls = []
    monkeypatch.setattr(cpu, "cpu_attention", lambda *a: calls.append(1) or cpu_attention(*a))
    monkeypatch.setattr(cpu, "EAGER_CPU_ATTENTION", "kernel")  # eager, as compiled rounds attend
    with torch.inference_mode():
        ours = attn(x, cos, sin, torch.arange(40, 45)[None], block_mask)
        monkeypatch.setattr(cpu, "USE_CPU_KERNEL", False)
        flex = attn(x, cos, sin, torch.arange(40, 45)[None], block_mask)
    assert calls == [1] and ours.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2  # bf16: the two round at different steps
    torch.testing.assert_close(ours, flex, atol=tol, rtol=tol)
    # float64 is not the kernel's: FlexAttention
    monkeypatch.setattr(cpu, "USE_CPU_KERNEL", True)
    assert not cpu.cpu_kernel_applies(torch.zeros(1, 4, 5, 64, dtype=torch.float64), attn.k_cache, block_mask)


def test_a_kernel_that_cannot_be_built_warns_once_and_flex_runs(tmp_path):
    code = ("import warnings, cpu\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    ok = cpu.load_cpu_kernel(); cpu.load_cpu_kernel()\n"
            "print(ok, cpu.cpu_kernel_loaded, len(w), 'could not be built' in str(w[0].message))\n")
    env = dict(os.environ, CXX="false", TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["False", "False", "1", "True"], out.stdout + out.stderr


def test_linear_one_row_fast_path_is_taken_and_matches_matmul():
    """Compiled on the CPU, one row goes through the fused multiply-reduce (no matmul call in the generated code)
    and several rows through the matmul; both equal F.linear to float32 rounding, in fp32 and bf16."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        lin = cpu.CpuLinear(96, 300).to(dtype)
        compiled = torch.compile(lin, dynamic=False, fullgraph=True)
        for rows, uses_matmul in ((1, False), (3, True)):
            x = torch.randn(rows, 96, dtype=dtype)
            with torch.no_grad():
                out, code = run_and_get_code(compiled, x)
                ref = torch.nn.functional.linear(x.float(), lin.weight.float())
            assert out.shape == (rows, 300) and out.dtype == dtype
            assert torch.allclose(out.float(), ref, rtol=tol, atol=tol), (dtype, rows)
            assert ("extern_kernels.mm" in "".join(code)) == uses_matmul, (dtype, rows)


def test_prepacked_linear_runs_onednn_in_frozen_graphs_and_follows_its_weight():
    """prepack_linears gives each Linear a oneDNN copy of its weight, once: kept while the weight is unchanged (a
    new copy would recompile every graph that holds the old one), made again after an in-place change. Frozen
    graphs multiply several rows by it through oneDNN and equal F.linear; one row keeps the fused reduce, and
    graphs without freezing (and eager code) keep the matmul on the weight, in fp32 and, where oneDNN packs bf16
    on this CPU, bf16 (elsewhere a bf16 Linear gets no copy and frozen graphs keep their own matmul)."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    assert torch.float32 in cpu.prepack_dtypes()  # fp32 weights are packed on every CPU
    if torch.bfloat16 not in cpu.prepack_dtypes():
        lin = cpu.CpuLinear(96, 300).to(torch.bfloat16)
        cpu.prepack_linears(lin)
        assert lin.packed is None
        x = torch.randn(3, 96, dtype=torch.bfloat16)
        compiled = torch.compile(lambda t: lin(t), dynamic=False, fullgraph=True)
        with torch.no_grad(), torch._inductor.config.patch(freezing=True):
            out, code = run_and_get_code(compiled, x)
        assert "mkldnn._linear_pointwise" not in "".join(code)
        assert torch.allclose(out.float(), torch.nn.functional.linear(x, lin.weight.detach()).float(), rtol=2e-2,
                              atol=2e-2)
        torch._dynamo.reset()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        if dtype not in cpu.prepack_dtypes():
            continue
        lin = cpu.CpuLinear(96, 300).to(dtype)
        cpu.prepack_linears(torch.nn.Sequential(lin))
        packed = lin.packed
        cpu.prepack_linears(lin)
        assert lin.packed is packed
        for freezing, rows, onednn in ((True, 3, True), (True, 1, False), (False, 3, False)):
            x = torch.randn(rows, 2, 96, dtype=dtype)[:, 0]  # strided rows: the packed path reshapes them
            compiled = torch.compile(lambda t: lin(t), dynamic=False, fullgraph=True)
            with torch.no_grad(), torch._inductor.config.patch(freezing=freezing):
                out, code = run_and_get_code(compiled, x)
            ref = torch.nn.functional.linear(x.float(), lin.weight.detach().float())
            assert out.shape == (rows, 300) and out.dtype == dtype
            assert torch.allclose(out.float(), ref, rtol=tol, atol=tol), (dtype, freezing, rows)
            assert ("mkldnn._linear_pointwise" in "".join(code)) == onednn, (dtype, freezing, rows)
            torch._dynamo.reset()
        with torch.no_grad():
            lin.weight.mul_(2)
        cpu.prepack_linears(lin)
        x = torch.randn(4, 96, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [], "")
        assert lin.packed is not packed
        assert torch.allclose(out.float(), torch.nn.functional.linear(x, lin.weight.detach()).float(), rtol=tol,
                              atol=tol)
    with torch.inference_mode():  # weights made in inference mode have no version counter: packed all the same
        lin = cpu.CpuLinear(8, 4)
        cpu.prepack_linears(lin)
    assert lin.packed is not None


def test_frozen_context_kv_equal_eager_through_either_matmul():
    """A drafter's context rows are projected by the K/V rows of the stacked qkv weight alone (Attention.kv_proj).
    Inductor's C++ GEMM template (forced here; autotuning picks it at a few rows) reads a frozen weight that is a
    view into another from that one's first row, the Q rows, so frozen graphs multiply by a copy of the K/V rows
    (cpu.copy_kv_rows): through its oneDNN copy or through the template on the copy, the K/V equal eager's. The
    copy follows an in-place change of the weight."""
    torch.manual_seed(0)
    attn = cpu.CpuAttention(64, 4, 2, 16, 1e-6)
    cpu.copy_kv_rows(attn)
    x = torch.randn(1, 5, 64)
    eager = attn.kv_proj(x)
    assert attn.kv_packed is not None  # float32: packed on every CPU
    for packed in (attn.kv_packed, None):  # None: as a bf16 weight on a CPU where oneDNN packs no bf16
        attn.kv_packed = packed
        compiled = torch.compile(lambda t: attn.kv_proj(t), dynamic=False, fullgraph=True)
        with torch.no_grad(), torch._inductor.config.patch(freezing=True, max_autotune=True,
                                                           max_autotune_gemm_backends="CPP"):
            out = compiled(x)
        for o, e in zip(out, eager):
            torch.testing.assert_close(o, e, atol=1e-5, rtol=1e-5)
        torch._dynamo.reset()
    copy = attn.kv_weight
    cpu.copy_kv_rows(attn)
    assert attn.kv_weight is copy
    with torch.no_grad():
        attn.qkv_proj.weight.mul_(2)
    cpu.copy_kv_rows(attn)
    assert torch.equal(attn.kv_weight, attn.qkv_proj.weight[attn.q_rows:].detach())
