"""CPU-only speed, behind one seam: what a CPU engine adds to the GPU path, and nothing a GPU run uses. A reader of
the round can skip this file. An engine built on a CPU makes one call, `compile_round`: it gives the models' linears
and attention layers their CPU classes (CpuLinear, CpuAttention) and, for a compiled engine, compiles the round
(`prepare`; frozen and autotuned for compile="max-autotune": `compile_frozen`).

- Eager attention by SDPA over the BlockMask's mask_mod evaluated densely (`dense_mask`): eager FlexAttention on the
  CPU runs a vmapped math fallback, far slower (docs/compile.md, "Eager CPU attention uses SDPA").
- The attention kernel (cpu/attention.cpp): a round's few query rows under a PrefixMask, several times faster than
  FlexAttention's CPU template at these sizes (docs/compile.md, "CPU attention kernel").
- Frozen max-autotune graphs with oneDNN copies of the weights (docs/compile.md, "Few-row matmuls on CPU"), and
  the drafter's K/V rows as a weight of their own (docs/compile.md, "Weight views in frozen graphs").
- One-row matmuls of compiled graphs as a fused multiply-and-sum (docs/compile.md, "one-row Linear on CPU").
- Inductor's ISA probe started early (docs/compile.md, "ISA probe").
"""

import contextlib
import functools
import hashlib
import os
import subprocess
import tempfile
import threading
import time
import warnings

import torch
import torch._inductor.config  # read while tracing: the prepacked copies serve frozen graphs only
import torch.nn as nn
import torch.nn.functional as F

import regions
from model import Attention, Linear


# How eager CPU layers attend under a PrefixMask: "sdpa" (the mask materialized, dense_attention), "kernel" (the
# compiled rounds' kernel where it applies, else FlexAttention) or "flex" (eager FlexAttention, which on the CPU
# runs a vmapped math fallback, far slower). Compiled graphs run the kernel where it applies.
EAGER_CPU_ATTENTION = "sdpa"


def torch_release() -> tuple:
    """torch's (major, minor): where releases differ, what this one needs."""
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def compile_round(step, target, drafter, compile) -> tuple:
    """A CPU engine's round: (the step, compiled unless compile is False, the inductor options its compiling calls
    run under, the seconds spent building the attention kernel). The models get their CPU classes first, eager
    or compiled; compile="max-autotune" freezes the weights into autotuned graphs (compile_frozen), compile=True is
    a plain fullgraph compile (no CUDA graphs to ask for; the prefill stays eager: docs/compile.md, "Eager prefill
    on CPU")."""
    if not compile:
        use_cpu_classes(target, drafter)
        return step, {}, 0.0
    frozen = compile == "max-autotune"
    seconds = prepare(target, drafter, frozen)
    if frozen:
        return compile_frozen(step), AUTOTUNE_OPTIONS, seconds
    return torch.compile(step, dynamic=False, fullgraph=True), PLAIN_OPTIONS, seconds


# compile=True on the CPU: inductor's defaults, except that from torch 2.14 its scheduler fuses a pointwise epilogue
# (a gated attention's output gate) into the C++ FlexAttention template, whose code generation then refuses it
# (NotImplementedError: "Unsupported for `epilogue_nodes` in CppFlexAttentionTemplate"); without GEMM templates
# (no max-autotune) epilogue fusion concerns only that template here.
PLAIN_OPTIONS = {"epilogue_fusion": False} if torch_release() >= (2, 14) else {}


def prepare(target, drafter, frozen: bool) -> float:
    """A compiled CPU engine's needs before its graphs are traced: the models' CPU classes, the ISA probe started,
    the attention kernel loaded, and for frozen graphs the linears prepacked. Returns the seconds spent building
    the kernel (counted as compiling)."""
    models = [m for m in (target, drafter) if m is not None]
    use_cpu_classes(*models)
    start_cpu_isa_probe()
    t0 = time.perf_counter()
    load_cpu_kernel()  # the rounds' attention, where it applies (cpu_kernel_applies)
    seconds = time.perf_counter() - t0
    if frozen:
        for model in models:
            prepack_linears(model)
        if drafter is not None:  # the drafter's context rows are projected to K/V alone (Attention.kv_proj)
            copy_kv_rows(drafter)
    return seconds


def use_cpu_classes(*models):
    """Every model.Linear and model.Attention of `models` becomes a CpuLinear / CpuAttention, in place (same weights
    and caches, the CPU forward): what every engine on the CPU runs, eager or compiled. Anything else (None, a target
    that shows only what ddtree.Target lists) keeps its layers."""
    for model in (m for m in models if isinstance(m, nn.Module)):
        for m in model.modules():
            m.__class__ = cpu_class(type(m))


@functools.cache
def cpu_class(cls):
    """The CPU class of a module's class: CpuLinear for model.Linear, CpuAttention for model.Attention, and for a
    family's own attention (a subclass, such as hybrid.GatedAttention) one that is both: its forward,
    CpuAttention's attend and kv_proj."""
    if cls is Linear:
        return CpuLinear
    if cls is Attention:
        return CpuAttention
    if issubclass(cls, Attention) and not issubclass(cls, CpuAttention):
        return type(f"Cpu{cls.__name__}", (CpuAttention, cls), {})
    return cls


# The one-row switch (docs/compile.md, "one-row Linear on CPU"). Decoding one token only streams the weights, and
# MKL's matrix-vector path streams them well below memory bandwidth, while a multiply-and-sum that inductor fuses
# into one vectorized reduction comes close to it (docs/benchmarks.md). So compiled code on the CPU computes a
# single row that way. Several rows stay on the matmul (inside a full layer inductor turns the multi-row form into
# loops slower than MKL), and eager code keeps F.linear (eager would materialize the product). False: plain
# F.linear everywhere.
CPU_ONE_ROW_REDUCTION = True


class CpuLinear(Linear):
    """model.Linear on the CPU: in compiled graphs, one row as a fused reduction (see the switch above), and in
    frozen graphs several rows through oneDNN on the prepacked weight when `prepack_linears` gave it one; eager,
    F.linear."""
    packed = None  # the weight in oneDNN's layout (prepack_linears); an attribute, not state
    packed_from = None  # (data_ptr, version) of the weight it was packed from

    def forward(self, x):
        return cpu_linear(x, self.weight, self.packed)


def cpu_linear(x, weight, packed):
    """x times `weight` (and, in frozen graphs, its oneDNN copy `packed`, or None) as CpuLinear computes it."""
    if torch.compiler.is_compiling():
        rows = x.shape[:-1].numel()
        if CPU_ONE_ROW_REDUCTION and rows == 1:
            return (x[..., None, :] * weight).sum(-1)
        # freezing first: graphs without it never read (so never guard on) the packed copy
        if torch._inductor.config.freezing and packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, -1), packed, None, "none", [], "")
            return out.view(*x.shape[:-1], -1)
    return F.linear(x, weight)


class CpuAttention(Attention):
    """model.Attention on the CPU: in compiled graphs the CPU kernel wherever it applies (cpu_kernel_applies), eager
    as EAGER_CPU_ATTENTION says; FlexAttention elsewhere. In frozen graphs a drafter's context K/V come from a copy
    of the stacked weight's K/V rows (copy_kv_rows)."""
    kv_weight = None  # qkv_proj's K/V rows as a tensor of their own (copy_kv_rows); an attribute, not state
    kv_packed = None  # kv_weight in oneDNN's layout, where prepack_dtypes() allows
    kv_from = None  # (data_ptr, version) of the qkv_proj weight they were copied from

    def kv_proj(self, x):
        # A frozen graph must not multiply by the K/V rows as a view into qkv_proj's weight: inductor's C++ GEMM
        # template reads a frozen weight view from its storage's first row, the Q rows (docs/compile.md, "Weight
        # views in frozen graphs").
        if torch.compiler.is_compiling() and torch._inductor.config.freezing and self.kv_weight is not None:
            return cpu_linear(x, self.kv_weight, self.kv_packed).chunk(2, dim=-1)
        return super().kv_proj(x)

    def attend(self, q, mask, scale):
        how = "kernel" if torch.compiler.is_compiling() else EAGER_CPU_ATTENTION
        if how == "kernel" and cpu_kernel_applies(q, self.k_cache, mask):
            return cpu_attention(q, self.k_cache, self.v_cache, mask, scale).flatten(2)
        if how == "sdpa" and hasattr(mask, "prefix_tensors"):
            return dense_attention(q, self.k_cache, self.v_cache, mask, scale).transpose(1, 2).flatten(2)
        return super().attend(q, mask, scale)


def dense_attention(q, k_cache, v_cache, mask, scale: float) -> torch.Tensor:
    """Attention of q [N, H, Q, D] over the caches [N, KVH, S, D] under a PrefixMask's BlockMask by SDPA, over the
    KV slots the mask visits (dense_mask), as [N, H, Q, D]."""
    dense = dense_mask(mask, q.shape[2])
    kv = dense.shape[-1]
    return F.scaled_dot_product_attention(q, k_cache[:, :, :kv], v_cache[:, :, :kv], attn_mask=dense, scale=scale,
                                          enable_gqa=q.shape[1] != k_cache.shape[1])


def dense_mask(block_mask, q_len: int) -> torch.Tensor:
    """A PrefixMask's BlockMask as a boolean [batch, 1, q_len, slots] tensor for SDPA: its mask_mod evaluated by
    broadcasting (plain elementwise tensor code) over its first q_len rows and the slots up to the last KV block
    any request visits (one host read). Kept beside the PrefixMask's `allow` tensor (each layer's region rebuilds
    the BlockMask from the same tensors: regions.run_layer) while its prefix and allow hold the same values, so that
    the layers of one forward evaluate it once."""
    prefix, allow = block_mask.prefix_tensors[4:]
    kept = getattr(allow, "dense", None)
    if kept is not None and kept[0] == q_len and torch.equal(kept[1], prefix) and torch.equal(kept[2], allow):
        return kept[3]
    visited = block_mask.kv_num_blocks.long()
    last = block_mask.kv_indices.gather(-1, (visited - 1).clamp(min=0)[..., None])[..., 0] + 1
    blocks = torch.maximum(torch.where(visited > 0, last, 0), block_mask.full_kv_num_blocks)
    kv_len = min(block_mask.seq_lengths[1], int(blocks.max()) * block_mask.BLOCK_SIZE[1])
    device = prefix.device
    b = torch.arange(prefix.shape[0], device=device)[:, None, None, None]
    dense = block_mask.mask_mod(b, 0, torch.arange(q_len, device=device)[:, None],
                                torch.arange(kv_len, device=device)[None, :])
    allow.dense = (q_len, prefix.clone(), allow.clone(), dense)
    return dense


# compile="max-autotune" on the CPU: the engine freezes its weights into its own graphs and lets inductor's autotuner
# give each matmul its C++ GEMM template (weights prepacked, register-blocked for the row count) where that beats
# aten's sgemm: the few rows of a draft or a small verify run ~3x faster, at the price of longer compiles
# (docs/compile.md, "Few-row matmuls on CPU"). The graphs' kernels are called from C++ (cpp_wrapper), not from
# a Python function: a round calls many small kernels. On CUDA it is torch.compile's mode of that name.
AUTOTUNE_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                    "cpp_wrapper": True}


def compile_frozen(step):
    """`step` compiled to run under AUTOTUNE_OPTIONS, its weights frozen into its graphs. It is compiled as a
    closure: dynamo then reaches the weights through the closure, inlines them as constants and guards on this
    engine's step, so no other engine reuses these graphs. Dynamo reads `freezing` while it traces, at the first
    call (and at any recompile), not when torch.compile is called, and torch.compile(options=...) does not freeze
    (torch 2.13): so a caller sets the options around each call that may compile (compiling.guards), and
    nothing else in the process sees them. Every call runs with the layers inlined (layers_inlined)."""
    compiled = torch.compile(lambda *args: step(*args), dynamic=False, fullgraph=True)

    def frozen(*args):
        with layers_inlined():
            return compiled(*args)
    return frozen


@contextlib.contextmanager
def layers_inlined():
    """regions.COMPILE_LAYERS_ONCE off while a frozen graph is traced (and called: dynamo guards on it). Freezing
    prepacks weights that are graph constants, which a compiled region's arguments are not."""
    saved, regions.COMPILE_LAYERS_ONCE = regions.COMPILE_LAYERS_ONCE, False
    try:
        yield
    finally:
        regions.COMPILE_LAYERS_ONCE = saved


@functools.cache
def start_cpu_isa_probe():
    """Start inductor's probe of the CPU's vector ISAs in a thread, once per process. Inductor's first CPU kernel
    waits for it: per ISA, a test compile and a child Python that loads it (torch 2.13: about 9 s on a fresh
    inductor cache, 1.2 s on a warm one, on this 2-core machine). The probe runs in subprocesses, so here it
    overlaps dynamo's tracing of the round instead of following it (docs/compile.md, "ISA probe")."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa  # cached: the compile reads the same answer
    threading.Thread(target=pick_vec_isa, name="cpu-isa-probe", daemon=True).start()


# Few-row matmuls of frozen CPU graphs (docs/compile.md, "Few-row matmuls on CPU"). Inductor lowers a frozen fp32
# matmul to MKL's packed sgemm or its C++ GEMM template, whichever it measures faster, and both read the weights well
# below memory bandwidth at 5-17 rows, while oneDNN on a prepacked weight reads them near it (bf16 weights already go
# to oneDNN where the CPU has its bf16 instructions: prepack_dtypes). A weight prepacked outside the graph is a graph
# constant under freezing, and inductor then autotunes oneDNN against its template for each shape. So
# compile="max-autotune" engines on the CPU prepack their models' linears once (the packed copies are kept beside the
# weights and reused by every engine while the weights are unchanged), and CpuLinear uses them only inside frozen
# graphs.
@functools.cache
def prepack_dtypes() -> tuple:
    """The weight dtypes oneDNN can prepack on this CPU, asked once per process: bf16 needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and without them the reorder fails (an AVX2-only EPYC here); such bf16 weights keep the matmul
    inductor picks."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def prepack_linears(module: nn.Module):
    """Give every CpuLinear of `module` (on the CPU, in a dtype of prepack_dtypes()) its weight in oneDNN's blocked
    layout, unless the copy it has was packed from the same, unchanged weight (a new copy would make other engines'
    graphs recompile: dynamo guards on it)."""
    for m in module.modules():
        w = m.weight if isinstance(m, CpuLinear) else None
        if w is None or w.device.type != "cpu" or w.dtype not in prepack_dtypes():
            continue
        if m.packed is None or m.packed_from != weight_source(w):
            m.packed, m.packed_from = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None), weight_source(w)


def copy_kv_rows(module: nn.Module):
    """Give every CpuAttention of `module` (on the CPU) the K/V rows of its qkv_proj weight as a tensor of their own,
    with its oneDNN copy where prepack_dtypes() allows, unless it has them from the same, unchanged weight: frozen
    graphs multiply by these instead of a view into the stacked weight (CpuAttention.kv_proj)."""
    for m in module.modules():
        w = m.qkv_proj.weight if isinstance(m, CpuAttention) else None
        if w is None or w.device.type != "cpu" or m.kv_from == weight_source(w):
            continue
        rows = w.detach()[m.q_rows:].clone()
        packed = torch.ops.mkldnn._reorder_linear_weight(rows, None) if w.dtype in prepack_dtypes() else None
        m.kv_weight, m.kv_packed, m.kv_from = rows, packed, weight_source(w)


def weight_source(w: torch.Tensor) -> tuple:
    """(data_ptr, version) of a weight: a copy made from it is current while these are unchanged (inference tensors
    keep no version)."""
    return w.data_ptr(), None if w.is_inference() else w._version


KERNEL_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention.cpp")
KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)  # the head sizes cpu/attention.cpp is instantiated for
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the element types it is instantiated for
USE_CPU_KERNEL = True  # False: CPU attention under PrefixMasks stays FlexAttention (read while tracing)
cpu_kernel_loaded = False  # set by load_cpu_kernel; read while tracing, so each graph is built for one or the other


@functools.cache
def load_cpu_kernel() -> bool:
    """Build cpu/attention.cpp (once per machine: about 8 s, kept in inductor's cache directory) and load it, which
    registers torch.ops.ddtree.tree_attention; returns whether it is loaded. Each CPU engine calls it once, before
    its graphs are traced; from then on CpuAttention runs the kernel wherever it applies (cpu_kernel_applies).
    Where it cannot be built or loaded: one warning, and CPU engines run FlexAttention."""
    global cpu_kernel_loaded
    try:
        torch.ops.load_library(build_cpu_kernel())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        warnings.warn(f"the CPU attention kernel could not be built, FlexAttention runs instead: {detail[-2000:]}")
        return False
    torch.library.register_fake("ddtree::tree_attention")(_tree_attention_shape)
    cpu_kernel_loaded = True
    return True


def build_cpu_kernel() -> str:
    """The shared library of cpu/attention.cpp, compiled if this source, torch and CPU have none yet."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    torch_dir = os.path.dirname(torch.__file__)
    include, lib = os.path.join(torch_dir, "include"), os.path.join(torch_dir, "lib")
    # torch 2.14's headers use C++20 (requires-clauses); earlier ones build as C++17, as they were tested
    std = "-std=c++20" if torch_release() >= (2, 14) else "-std=c++17"
    flags = ["-O3", "-march=native", "-fopenmp", std, "-shared", "-fPIC",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-I{include}",
             f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
    compiler = os.environ.get("CXX", "g++")
    with open(KERNEL_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), compiler.encode(), " ".join(flags).encode(),
                                      cpu_flags()])).hexdigest()[:20]
    out_dir = os.path.join(cache_dir(), "ddtree")
    path = os.path.join(out_dir, f"cpu_attention_{key}.so")
    if not os.path.exists(path):
        os.makedirs(out_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)  # built aside, then renamed: concurrent runs are safe
        os.close(fd)
        try:
            subprocess.run([compiler, KERNEL_SOURCE, "-o", tmp, *flags], check=True, capture_output=True, text=True)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return path


def cpu_flags() -> bytes:
    """The CPU's feature flags (Linux), part of the kernel's cache key: it is built for the CPU it runs on."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _tree_attention_shape(q, k_cache, v_cache, prefix, allow, scale):
    n, heads, q_len, head_dim = q.shape
    return q.new_empty(n, q_len, heads, head_dim)


def cpu_kernel_applies(q: torch.Tensor, k_cache: torch.Tensor, mask) -> bool:
    """Whether attention of q [N, H, Q, D] over this cache under `mask` runs the CPU kernel: float32 or bfloat16 on
    the CPU, a PrefixMask's BlockMask without a window or context, a head size it is built for, and the kernel loaded
    (load_cpu_kernel). Decided from shapes and types alone, so once per compiled graph."""
    return (cpu_kernel_loaded and USE_CPU_KERNEL and q.device.type == "cpu" and q.dtype in KERNEL_DTYPES
            and k_cache.dtype == q.dtype and q.shape[-1] in KERNEL_HEAD_DIMS and hasattr(mask, "prefix_tensors")
            and mask.window is None and mask.context is None)


def cpu_attention(q, k_cache, v_cache, mask, scale: float) -> torch.Tensor:
    """The CPU kernel's attention of q [N, H, Q, D] over the caches [N, KVH, S, D] under a PrefixMask's BlockMask,
    as [N, Q, H, D] (the layout the output projection reads)."""
    prefix, allow = mask.prefix_tensors[4:]
    return torch.ops.ddtree.tree_attention(q, k_cache, v_cache, prefix, allow, scale)
