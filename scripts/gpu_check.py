"""One-call GPU check, sized for a 9-minute device run on an H200, every section guarded.

One call answers everything it reaches, whatever fails inside it.

    python scripts/gpu_check.py --json out/gpu_check.json                 # on the GPU machine
    python scripts/gpu_check.py --parts hybrid --json out/hybrid.json     # one part alone (each fits a run)
    python scripts/gpu_check.py --device cpu --small --eager --json PATH   # the script itself, on a CPU (a test)

Parts, in this order (--parts picks some):
- pair: the bundled tiny pair in float32, per mode (eager, compiled without CUDA graphs, as users run it): ar,
  dflash and ddtree at --pair-budgets, budget auto forced through every candidate and a batch that shrinks as its
  requests stop, every token against eager AR; the cudaGraphLaunch calls of a profiled run (proof that graphs
  replay, which no count of refused graphs gives);
- 8b: a Qwen3-8B-shaped target and drafter with random weights in bf16, built on the device: copy bandwidth and
  the AR step beside its floor (eager, compiled, CUDA graphs); the round split per budget (benchlib.round_split:
  random weights accept nothing, so round latencies, not tau); generate() end to end; one sampled round at B = 512
  at batches 1 and 16 (time, peak memory); prefills of long prompts; generate_batch; budget auto's calibration;
  the round with and without layers compiled once; tree building alone;
- moe: a Qwen3-30B-A3B-shaped target (built after the dense pair is freed): the expert paths against each other,
  the AR step beside its active weights' floor, the verify forward per budget;
- hybrid: a Qwen3.5-27B-shaped hybrid target (built after the MoE target and every compiled graph are freed; 54 GB
  in bf16): the AR step beside its floor (weights and recurrent states per token; eager, compiled, CUDA graphs) and
  the verify forward per budget through the Gated DeltaNet layers' tree form (bench_hybrid.tree_verify), with its
  extra peak device memory;
- flex (last, a diagnostic): compiled FlexAttention under the engine's masks against SDPA with the mask written
  out, per query length and GQA ratio, with the engine's kernel options (--flex-all: more lengths, and inductor's
  default options beside ours).

Each section records its status (ok, error with the traceback, skipped with why), seconds, peak device memory and
recompiles; the JSON (with torch, triton, CUDA, driver and device versions) is rewritten after every section, so a
run cut short still brings back what it measured. A section starts only if its graphs, at the measured seconds per
graph (the first compiled AR step's), end before --deadline.
"""

import argparse
import contextlib
import gc
import itertools
import os
import subprocess
import sys
import time
import traceback

import torch
from torch._dynamo.utils import counters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_hybrid import tree_verify  # noqa: E402
from benchlib import (batched_run, round_header, round_row, round_split, sync, timed, tree_alone,  # noqa: E402
                      verify_ms, write_json)
import budget as budget_auto  # noqa: E402 (budget: a loop variable's name here)
import ddtree  # noqa: E402
import gated_delta  # noqa: E402
import model  # noqa: E402
from budget import AutoBudget  # noqa: E402
from ddtree import Engine, Speculation, cache_length, generate, generate_batch  # noqa: E402
from drafter import DFlashConfig, DFlashDrafter  # noqa: E402
from model import Qwen3, Qwen3Config, rope_inv_freq  # noqa: E402
from moe import SparseMoE, grouped_mm_supported  # noqa: E402
from sampler import Sampling  # noqa: E402
from draft_tree import ancestor_matrix  # noqa: E402
from tree_attn import PrefixMask, flex_kernel_options  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=40960, tie_word_embeddings=False)
SMALL = dict(QWEN3_8B, vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
QWEN3_30B_A3B = dict(QWEN3_8B, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
SMALL_MOE = dict(SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)


def hybrid_layer_types(layers: int, interval: int = 4) -> tuple:
    """Qwen3.5's layout: every interval-th layer full attention, the others Gated DeltaNet."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))


# Qwen3.5-27B's text config (Qwen/Qwen3.5-27B, text_config), as public material agrees on it (the Hub itself is
# out of reach here): THUDM/slime's Megatron arguments for it, ports of it and their config fixtures: 64 layers, 48 Gated DeltaNet and 16 gated
# full attention (full_attention_interval 4); hidden 5120, MLP 17408; attention 24 heads of 256, 4 KV heads, a
# quarter of each head roped (theta 1e7), output gate; Gated DeltaNet 16 key heads and 48 value heads of 128, conv
# kernel 4; vocabulary 248320, untied embeddings. 26.9 B parameters: 53.8 GB in bf16. (The MTP head and the
# vision tower of the released checkpoint are not part of the text model's forward.)
QWEN3_5_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                   num_attention_heads=24, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7,
                   max_position_embeddings=262144, tie_word_embeddings=False, layer_types=hybrid_layer_types(64),
                   partial_rotary_factor=0.25, zero_centered_norm=True, attn_output_gate=True,
                   linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_num_key_heads=16, linear_num_value_heads=48)
# --small: the same layout at the bundled pair's width (scripts/bench_hybrid.py's hybrid).
SMALL_HYBRID = dict(QWEN3_5_27B, **{k: SMALL[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                          "num_hidden_layers", "num_attention_heads",
                                                          "num_key_value_heads", "head_dim")},
                    layer_types=hybrid_layer_types(4), linear_key_head_dim=64, linear_value_head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=4)


def random_init(module, device, dtype, config):
    """Materialize a meta-built module on the device with small random weights (norm weights 1: the identity;
    0 for a hybrid's zero-centred norms, x * (1 + w), all but its Gated DeltaNet's own norm)."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if config.zero_centered_norm and "linear_attn." not in name else 1.0)
            else:
                p.normal_(0, 0.02)
    module.inv_freq = rope_inv_freq(config.rotary_dim, config.rope_theta, device)
    return module.to(dtype).eval()


def build(shape, device, dtype, block=16, draft_layers=5):
    c = Qwen3Config(**shape)
    with torch.device("meta"):
        target = Qwen3(c)
    target = random_init(target, device, dtype, c)
    target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach().clone())  # untied, as 8B
    ids = [1, 9, 17, 25, 33] if c.num_hidden_layers == 36 else list(range(min(draft_layers, c.num_hidden_layers)))
    dc = DFlashConfig(model=Qwen3Config(**dict(shape, num_hidden_layers=draft_layers)), block_size=block,
                      num_target_layers=c.num_hidden_layers, target_layer_ids=ids, mask_token_id=c.vocab_size - 1)
    with torch.device("meta"):
        drafter = DFlashDrafter(dc)
    drafter = random_init(drafter, device, dtype, dc.model)
    return target, drafter.bind(target)


def build_moe_target(shape, device, dtype):
    """A Qwen3-MoE target with random weights on the device, and the bytes a decode step reads: every weight but
    the experts a row does not route to (top_k of num_experts per sparse layer)."""
    c = Qwen3Config(**shape)
    with torch.device("meta"):
        target = Qwen3(c)
    target = random_init(target, device, dtype, c)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in target.named_parameters() if ".experts." in n)
    total = sum(p.numel() * p.element_size() for p in target.parameters())
    active = total - expert_bytes * (1 - c.num_experts_per_tok / c.num_experts)
    return target, active


def versions(device):
    """What the run ran on: torch, triton, CUDA, the driver, the device and its compute capability."""
    v = dict(torch=torch.__version__, cuda=torch.version.cuda, python=sys.version.split()[0])
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    if device.type == "cuda":
        v["device_name"] = torch.cuda.get_device_name()
        v["capability"] = list(torch.cuda.get_device_capability())
        try:
            v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            v["driver"] = None
    return v


@contextlib.contextmanager
def guarded(out, name, device):
    """Runs one section's body: its status (ok, or error with the traceback; the run goes on), seconds, peak
    device memory and the recompiles it caused, in out["sections"][name]."""
    rec = out.setdefault("sections", {}).setdefault(name, {})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t, recompiles = time.time(), sum(counters["recompiles"].values())
    try:
        yield rec
        rec["status"] = "ok"
    except Exception:  # noqa: BLE001 (a section's failure is a finding, not the end of the run)
        rec["status"] = "error"
        rec["traceback"] = traceback.format_exc()[-6000:]
        print(f"section {name!r} FAILED:\n{rec['traceback']}", flush=True)
    finally:
        rec["seconds"] = time.time() - t
        rec["recompiles"] = sum(counters["recompiles"].values()) - recompiles
        if device.type == "cuda":
            rec["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9


def flex_check(device, dtype, out, compile=True, every=False):
    """Compiled FlexAttention under a PrefixMask against SDPA with the mask written out, per query length and GQA
    ratio: the lengths the engine runs (decode, draft block, B + 1, prefill chunk), with the engine's kernel
    options (`every`: more lengths and, at some, inductor's defaults beside ours). The `write` cases do as the engine's layers do: float32,
    the rows' K/V written into the cache inside the same graph, then attended."""
    res = out["flex_vs_sdpa"] = {}
    kv_len, dim = 1024, 128
    torch._dynamo.config.recompile_limit = 64  # one graph per case below
    cases = [(4, q, True, False) for q in (1, 17, 65, 128, 513)] + [(2, 8, True, True)]
    if every:
        cases += [(4, q, True, False) for q in (16, 33, 257)]
        cases += [(8, 17, True, False), (8, 65, True, False), (2, 65, True, False), (4, 65, False, False)]
        cases += [(g, q, ours, True) for g, q in ((2, 8), (2, 17), (4, 16)) for ours in (True, False)
                  if (g, q, ours) != (2, 8, True)]
    for g, q_len, ours, write in cases:
        key = f"G{g}-q{q_len}" + ("" if ours else "-default-options") + ("-write-f32" if write else "")
        options = flex_kernel_options(q_len, device.type) if ours else None
        try:
            res[key] = dict(status="ok", options=options,
                            max_diff=flex_case(device, torch.float32 if write else dtype, g, q_len, kv_len, dim,
                                               options, write, compile))
        except Exception:  # noqa: BLE001
            res[key] = dict(status="error", options=options, error=traceback.format_exc()[-1500:])
        print(f"FlexAttention {key}: {res[key].get('status')} max|diff| {res[key].get('max_diff')} "
              f"options {res[key].get('options')} {res[key].get('error', '')[-300:]}", flush=True)


def flex_case(device, dtype, g, q_len, kv_len, dim, options, write, compile=True):
    """The largest |difference| from SDPA over three prefixes (none, one full block, the cache's end) of random
    trees."""
    heads, kv_heads = 4 * g, 4
    mask = PrefixMask(q_len, kv_len, device)
    flex = torch.nn.attention.flex_attention.flex_attention

    def attend(q, k, v, k_new, v_new, slots):
        if write:
            k.index_copy_(2, slots, k_new)
            v.index_copy_(2, slots, v_new)
        return flex(q, k, v, block_mask=mask.block_mask, enable_gqa=True, kernel_options=options)

    if compile:
        attend = torch.compile(attend, dynamic=False, fullgraph=True)
    worst = 0.0
    for prefix in (0, 130, kv_len - q_len - 1):
        gen = torch.Generator().manual_seed(q_len + prefix)
        # a random tree: row i (node i - 1) hangs under a row drawn from those before it
        parents = (torch.rand(q_len - 1, generator=gen) * torch.arange(1, q_len)).long()
        anc = ancestor_matrix(parents).to(device)
        mask.set(prefix, anc)
        q = torch.randn(1, heads, q_len, dim, device=device, dtype=dtype)
        k, v = (torch.randn(1, kv_heads, kv_len, dim, device=device, dtype=dtype) for _ in range(2))
        k_new, v_new = (torch.randn(1, kv_heads, q_len, dim, device=device, dtype=dtype) for _ in range(2))
        slots = torch.arange(prefix, prefix + q_len, device=device)
        if not write:  # the reference sees the new rows either way
            k[:, :, slots], v[:, :, slots] = k_new, v_new
        got = attend(q, k, v, k_new, v_new, slots).float()
        dense = torch.zeros(q_len, kv_len, dtype=torch.bool, device=device)
        dense[:, :prefix] = True
        dense[:, prefix:prefix + q_len] = anc
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=dense,
                                                               enable_gqa=True)
        worst = max(worst, float((got - ref).abs().max()))
    return worst


# ---------------------------------------------------------------------------------------------------- the run


class Check:
    """The run's settings, its JSON, the deadline and the guarded sections."""

    def __init__(self, a):
        self.a, self.device = a, torch.device(a.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.compile = not a.eager
        self.out = {"device": torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu",
                    "small": a.small, "eager": a.eager, "skipped": [], "sections": {}}
        self.t0, self.per_graph = time.time(), 0.0

    def save(self):
        self.out["seconds"] = time.time() - self.t0
        if self.a.json:
            write_json(self.a.json, self.out)

    def fits(self, name, graphs):
        """Whether a section compiling `graphs` model graphs ends before the deadline (else it is noted)."""
        self.save()
        if time.time() - self.t0 + graphs * self.per_graph <= self.a.deadline:
            return True
        self.out["skipped"].append(name)
        self.out["sections"][name] = dict(status="skipped", why=f"{graphs} graphs at {self.per_graph:.0f} s each "
                                                               f"would end past {self.a.deadline:.0f} s")
        print(f"skipped: {name} ({self.out['sections'][name]['why']})", flush=True)
        return False

    def run(self, name, fn, graphs=0):
        """fn() as one guarded section, if its graphs fit before the deadline."""
        if self.fits(name, graphs if self.compile else 0):
            with guarded(self.out, name, self.device):
                fn()
            self.save()

    def say(self, text):
        print(f"{text}  [{time.time() - self.t0:.0f} s]", flush=True)


# ------------------------------------------------------------------------------------------------ bundled pair


def bundled_pair_check(c: Check):
    """The bundled tiny pair in float32 on this device, per mode: ar, dflash and ddtree at each budget, budget auto
    forced through every candidate, a batch that shrinks as its requests stop; every token against eager AR
    (trained weights: greedy ties are rare, so the tokens must match), each run twice. Where tokens differ, the
    first differing position says which mode breaks."""
    target = Qwen3.from_pretrained(os.path.join(ROOT, "assets", "tiny-target"), device=c.device, dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(os.path.join(ROOT, "assets", "tiny-draft"), device=c.device,
                                            dtype=torch.float32).bind(target)
    prompt = list(range(5, 45))
    ref = generate(target, None, prompt, method="ar", max_new_tokens=96, stop_ids=[]).tokens
    res = c.out["bundled_pair"] = {}
    plain_compile = torch.compile
    for mode in c.a.pair_modes:
        ddtree._ENGINES.clear()
        torch._dynamo.reset()
        if mode == "compiled-no-graphs":  # the engine's compiles without CUDA graphs
            torch.compile = lambda fn, **kw: plain_compile(fn, **dict(kw, mode=None))
        compile = mode != "eager"
        graphs_device = c.device if mode == "cudagraphs" and c.device.type == "cuda" else None
        try:
            for method, budget in [("ar", None), ("dflash", None)] + [("ddtree", b) for b in c.a.pair_budgets]:
                if mode == "eager" and method == "ar":
                    continue
                key = f"{mode}/{method}" + ("" if budget is None else f"-B{budget}")
                run = lambda n=96: generate(target, drafter if method != "ar" else None, prompt, method=method,
                                            budget=budget, max_new_tokens=n, compile=compile, stop_ids=[])
                pair_case(c, res, key, lambda: pair_run(run, ref, graphs_device))
            pair_case(c, res, f"{mode}/auto-forced", lambda: pair_auto(target, drafter, prompt, ref, compile))
            pair_case(c, res, f"{mode}/batch-shrinking", lambda: pair_batch(target, drafter, compile))
        finally:
            torch.compile = plain_compile
    ddtree._ENGINES.clear()
    wrong = [k for k, v in res.items() if v["status"] == "error" or v.get("equal_to_eager_ar") is False
             or v.get("graphs_replay") is False]
    if wrong:  # the section reports it (status error) beside each case's own record
        raise AssertionError(f"bundled pair cases failing or unequal to eager AR: {wrong}")


def pair_case(c, res, key, fn):
    t = time.time()
    if t - c.pair_t0 > c.a.pair_seconds:
        res[key] = dict(status="skipped", why=f"past --pair-seconds {c.a.pair_seconds:.0f}")
        c.say(f"bundled pair {key}: skipped ({res[key]['why']})")
        return
    try:
        res[key] = dict(status="ok", **fn())
    except Exception:  # noqa: BLE001 (a case's failure is a finding; the next case runs)
        res[key] = dict(status="error", error=traceback.format_exc()[-3000:])
    res[key]["seconds"] = time.time() - t
    c.save()
    c.say(f"bundled pair {key}: { {k: v for k, v in res[key].items() if k != 'error'} } "
          f"{res[key].get('error', '')[-400:]}")


def pair_run(run, ref, graphs_device):
    """Two runs against eager AR; under CUDA graphs, a third one profiled for its graph launches."""
    runs = [run() for _ in range(2)]
    first_diff = next((i for i, (x, y) in enumerate(zip(runs[1].tokens, ref)) if x != y), None)
    out = dict(equal_to_eager_ar=runs[1].tokens == ref, first_diff=first_diff,
               repeat_equal=runs[0].tokens == runs[1].tokens, tau=runs[1].stats["tau"],
               tokens_per_s=runs[1].stats["tokens_per_s"])
    if graphs_device is not None:
        launches, profiled = graph_launches(lambda: run(32), graphs_device)
        out.update(graph_launches=launches, profiled_rounds=profiled.stats["rounds"],
                   graphs_replay=launches >= profiled.stats["rounds"])
    return out


def graph_launches(fn, device):
    """(cudaGraphLaunch calls while fn() runs, fn's result), from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
        sync(device)
    return sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch"), result


def pair_auto(target, drafter, prompt, ref, compile):
    """budget auto (trees of 4 and 16) with its choice forced through a cycle of every candidate."""
    cycle = itertools.cycle(["ar", "chain", 16, 4, "ar", 16, "chain", "ar"])
    choose, budgets = AutoBudget.choose, budget_auto.AUTO_BUDGETS
    AutoBudget.choose, budget_auto.AUTO_BUDGETS = (lambda self: (next(cycle), False)), (4, 16)
    try:
        r = generate(target, drafter, prompt, budget="auto", max_new_tokens=96, compile=compile, stop_ids=[])
    finally:
        AutoBudget.choose, budget_auto.AUTO_BUDGETS = choose, budgets
    return dict(equal_to_eager_ar=r.tokens == ref, schedule=sorted(set(r.stats["auto"]["schedule"])))


def pair_batch(target, drafter, compile):
    """Four requests in one batch (ddtree, B = 16) that stop at different rounds, so the batch shrinks: each
    request's tokens against its own eager AR run."""
    prompts = [list(range(5 + 7 * i, 45 + 3 * i)) for i in range(4)]
    free = generate(target, None, prompts[0], method="ar", max_new_tokens=48, stop_ids=[]).tokens
    stop = [free[12]]  # a token request 0 emits: some requests stop early, at different rounds
    refs = [generate(target, None, p, method="ar", max_new_tokens=48, stop_ids=stop).tokens for p in prompts]
    batch = generate_batch(target, drafter, prompts, budget=16, max_new_tokens=48, stop_ids=stop, compile=compile,
                           max_batch=4)
    return dict(equal_to_eager_ar=[r.tokens for r in batch] == refs, lengths=[len(t) for t in refs])


# -------------------------------------------------------------------------------------------------- 8B-shaped


def copy_bandwidth(device, gib=1.0):
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    ms, _ = timed(lambda: b.copy_(a), device, 5)
    return 2 * a.numel() * a.element_size() / (ms / 1e3)


def ar_steps(target, device, compile_mode, repeats=20):
    """Milliseconds per AR decode step at ~context 512 (eager, compiled, or compiled + CUDA graphs), and the first
    call's seconds (its compile)."""
    spec = Speculation()
    engine = Engine(target, None, "ar", Sampling(), spec, cache_length(512, 64, "ar", spec, None),
                    compile=compile_mode is not None)  # its masks are those of an engine run this way
    engine.prefill_step = engine._prefill_step  # the prefill only sets up the cache here: eager
    step = engine._decode
    if compile_mode:
        step = torch.compile(engine._decode, dynamic=False, fullgraph=True,
                             mode="reduce-overhead" if compile_mode == "cudagraphs" else None)
    token, start = torch.tensor([1], device=device), torch.tensor([512], device=device)  # a batch of one
    engine.prefill([torch.randint(0, 100, (512,)).tolist()])
    t = time.time()
    step(token, start, None)  # compiles (and captures) on the first call
    sync(device)
    first_s = time.time() - t
    ms, _ = timed(lambda: step(token, start, None), device, repeats)
    return ms, first_s


def dense_sections(c: Check):
    a, out = c.a, c.out
    target, drafter = build(SMALL if a.small else QWEN3_8B, c.device, c.dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    bandwidth = copy_bandwidth(c.device, 0.25 if a.small else 2.0)
    floor_ms = weight_bytes / bandwidth * 1e3
    out.update(weight_gb=weight_bytes / 1e9, copy_bandwidth_gbs=bandwidth / 1e9, ar_floor_ms=floor_ms)
    c.say(f"{out['device']}: target weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e9:.0f} GB/s "
          f"-> AR floor {floor_ms:.2f} ms/token")

    def ar_mode(mode):
        ms, first_s = ar_steps(target, c.device, None if mode == "eager" else mode)
        if mode == "compiled":
            c.per_graph = out["compile_s_per_graph"] = first_s
        out[f"ar_{mode}_ms"] = ms
        c.say(f"AR step {mode:10s}: {ms:7.2f} ms ({ms / floor_ms:.2f}x the floor); first call {first_s:.1f} s")

    modes = ["eager"] + (["compiled"] + (["cudagraphs"] if c.device.type == "cuda" else []) if c.compile else [])
    for mode in modes:
        c.run(f"AR step {mode}", lambda: ar_mode(mode), graphs=0 if mode == "eager" else 1)
    out["rounds"] = {}
    cols = ["draft", "tree", "mask", "verify", "walk", "compact", "context"] + (["round", "tree_work"] + (
        ["tree_work_nograph"] if c.device.type == "cuda" else []) if c.compile else [])
    print(round_header(cols, compiled=c.compile, width=9) + "  (ms; benchlib.round_split)", flush=True)

    def one_round(budget, key=None):
        ms = round_split(target, drafter, budget, compile=c.compile, repeats=a.repeats, prompt_len=512)
        out["rounds"][key or budget] = ms
        c.say(round_row(budget, ms, cols, width=9))

    c.run(f"round B={a.budgets[0]}", lambda: one_round(a.budgets[0]), graphs=5)
    c.run("end to end", lambda: end_to_end(c, target, drafter), graphs=3)
    c.run("sampled B=512", lambda: sampled_rounds(c, target, drafter), graphs=2 * len(a.sampled_batches))
    for budget in a.budgets[1:]:
        c.run(f"round B={budget}", lambda: one_round(budget), graphs=3)
    c.run("long prefill", lambda: long_prefill(c, target), graphs=len(a.prefill_lengths))
    for budget in a.batch_budgets:
        for batch in a.batches:
            c.run(f"batched B={budget} batch {batch}", lambda: batched(c, target, drafter, budget, batch),
                  graphs=2 * batch.bit_length())
    c.run("budget auto", lambda: auto_calibration(c, target, drafter), graphs=len(budget_auto.AUTO_BUDGETS) + 3)
    c.run("layers compiled once A/B", lambda: layers_once_ab(c, one_round), graphs=10)
    if c.compile:  # the tensor builder compiled beside the heap
        c.run("tree alone", lambda: tree_build(c, target), graphs=1)
    return bandwidth


def end_to_end(c, target, drafter, new_tokens=64, prompt_len=128):
    """generate() as the CLI runs it (compiled: CUDA graphs on the GPU), AR and DDTree, twice each: the replays must
    repeat themselves exactly. Random weights have near-tied argmaxes, so DDTree's tokens are set beside AR's for
    information only (bf16 rounding differs between 1 and B + 1 rows)."""
    prompt = torch.randint(0, 1000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    res = c.out["end_to_end"] = {}
    tokens = {}
    for method in ("ar", "ddtree"):
        runs = [generate(target, drafter, prompt, method=method, budget=c.a.e2e_budget if method == "ddtree" else None,
                         max_new_tokens=new_tokens, compile=c.compile, stop_ids=[]) for _ in range(2)]
        tokens[method] = runs[1].tokens
        res[method] = dict(repeatable=runs[0].tokens == runs[1].tokens, tokens_per_s=runs[1].stats["tokens_per_s"],
                           tau=runs[1].stats["tau"], compile_seconds=runs[0].stats.get("compile_seconds"))
        c.say(f"generate {method:6s}: {res[method]['tokens_per_s']:8.1f} tok/s, tau {res[method]['tau']:.2f}, two "
              f"runs identical: {res[method]['repeatable']}")
    ar, tree = tokens["ar"], tokens["ddtree"]
    res["agree_prefix"] = next((i for i, (x, y) in enumerate(zip(ar, tree)) if x != y), min(len(ar), len(tree)))


def sampled_rounds(c, target, drafter):
    """Sampled DDTree at B = 512 (temperature 1, top-p 0.95) at each of --sampled-batches: the seconds of 8 new
    tokens (the first run compiles) and the peak device memory of the second run."""
    res = c.out["sampled_b512"] = {}
    for n in c.a.sampled_batches:
        prompts = [torch.randint(0, 1000, (128,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(n)]
        run = lambda: generate_batch(target, drafter, prompts, budget=512, max_new_tokens=8,
                                     temperature=1.0, top_p=0.95, seeds=list(range(n)), compile=c.compile,
                                     stop_ids=[], max_batch=n)
        t = time.time()
        run()
        first = time.time() - t
        if c.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        results = run()
        res[n] = dict(first_run_seconds=first, seconds=results[0].stats["seconds"],
                      rounds=results[0].stats["rounds"],
                      peak_gb=torch.cuda.max_memory_allocated() / 1e9 if c.device.type == "cuda" else None)
        c.say(f"sampled B=512 batch {n:2d}: {res[n]}")


def long_prefill(c, target):
    """Seconds of one prefill (plain decoding's engine, compiled prefill chunks on CUDA) of each --prefill-lengths
    prompt, the second of two runs."""
    res = c.out["prefill_seconds"] = {}
    for n in c.a.prefill_lengths:
        spec = Speculation()
        engine = Engine(target, None, "ar", Sampling(), spec,
                        cache_length(n, 16, "ar", spec, None, device_type=c.device.type), compile=c.compile)
        prompt = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        engine.start([prompt], [0])
        sync(c.device)
        t = time.time()
        engine.start([prompt], [0])
        sync(c.device)
        res[n] = time.time() - t
        c.say(f"prefill of {n} tokens: {res[n] * 1e3:.1f} ms ({n / res[n]:.0f} tokens/s)")


def batched(c, target, drafter, budget, batch):
    """generate_batch, greedy DDTree: tokens/s of 16 requests (prompt 128, 64 new tokens) `batch` at a time."""
    prompts = [torch.randint(0, 1000, (128,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(16)]
    tps = batched_run(target, drafter, prompts, "ddtree", budget, 64, c.compile, batch, passes=1)
    c.out.setdefault("batched", {})[f"B{budget}-batch{batch}"] = tps
    c.say(f"generate_batch ddtree B={budget:4d} batch {batch:3d}: {tps:9.1f} tok/s over 16 requests")


def auto_calibration(c, target, drafter):
    """budget auto on this device (batch 1, greedy): its calibration curve, then one generate(budget="auto")
    (random weights accept little, so auto should settle on plain decoding)."""
    budgets = budget_auto.auto_budgets(128, 64, target)
    spec = Speculation(budget="auto")
    length = cache_length(128, 64, "ddtree", spec, drafter, budgets)
    engine = ddtree.get_engine(target, drafter, "ddtree", Sampling(), spec, length, c.compile, 1, auto=budgets)
    warm_up = engine.warm_up(recalibrate=True)
    c.say(f"budget auto calibration ({engine.calibrate_seconds:.0f} s, {warm_up:.0f} s with compiling):\n"
          f"{engine.curve_table()}")
    prompt = torch.randint(0, 1000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    res = generate(target, drafter, prompt, budget="auto", max_new_tokens=64, compile=c.compile, stop_ids=[])
    report = res.stats["auto"]
    c.out["auto"] = dict(curve=engine.curve(), calibrate_seconds=engine.calibrate_seconds, warm_up_seconds=warm_up,
                         tokens_per_s=res.stats["tokens_per_s"], tau=res.stats["tau"], choice=report["choice"],
                         rounds_per_candidate=report["rounds_per_candidate"])
    c.say(f"generate budget=auto: {res.stats['tokens_per_s']:.1f} tok/s, best {report['choice']}")


def layers_once_ab(c, one_round):
    """The round split at --e2e-budget with the target's layers compiled once (model.COMPILE_LAYERS_ONCE, as the
    engine runs) and each layer inlined into the round's graph."""
    for once in (False, True):
        model.COMPILE_LAYERS_ONCE = once
        torch._dynamo.reset()
        try:
            one_round(c.a.e2e_budget, key=f"{c.a.e2e_budget}-layers-once-{once}")
        finally:
            model.COMPILE_LAYERS_ONCE = True


def tree_build(c, target):
    t = tree_alone(target.config.vocab_size, 15, 512, c.device, c.a.repeats)
    c.out["tree_alone"] = t
    c.say(f"tree build alone (V={target.config.vocab_size}, depth 15, B=512): heap {t['heap_ms']:.2f} ms, tensor "
          f"eager {t['tensor_eager_ms']:.2f} ms, compiled {t['tensor_compiled_ms']:.2f} ms, identical: {t['equal']}")


# ---------------------------------------------------------------------------------------------------------- MoE


def moe_sections(c: Check, bandwidth):
    """The 30B-A3B-shaped target: the expert paths against each other, the AR step beside the floor of its active
    weights' bytes, and the verify forward per budget, whose growth with B (more experts touched) decides the best
    budget on MoE targets."""
    target, active = build_moe_target(SMALL_MOE if c.a.small else QWEN3_30B_A3B, c.device, c.dtype)
    floor_ms = active / bandwidth * 1e3
    moe = c.out["moe"] = dict(active_weight_gb=active / 1e9, ar_floor_ms=floor_ms, verify_ms={})
    c.say(f"MoE target ({'small' if c.a.small else '30B-A3B-shaped'}): active weights {active / 1e9:.2f} GB per "
          f"token -> AR floor {floor_ms:.2f} ms")

    def paths():
        mlp = next(layer.mlp for layer in target.layers if isinstance(layer.mlp, SparseMoE))
        x = torch.randn(64, target.config.hidden_size, device=c.device, dtype=c.dtype)
        ids, weights = mlp.route(x)
        outs = {"all_experts": mlp.all_experts(x, ids, weights), "gathered": mlp.gathered(x, ids, weights)}
        if grouped_mm_supported(x):
            outs["grouped"] = mlp.grouped(x, ids, weights)
            outs["grouped_again_bitwise_equal"] = torch.equal(outs["grouped"], mlp.grouped(x, ids, weights))
        ref = outs["all_experts"].float()
        moe["expert_paths_max_diff"] = {k: v if isinstance(v, bool) else float((v.float() - ref).abs().max())
                                        for k, v in outs.items()}
        c.say(f"MoE expert paths, max |difference| from all experts over 64 rows: {moe['expert_paths_max_diff']} "
              f"(output scale {float(ref.abs().max()):.3g})")

    def ar():
        mode = "cudagraphs" if c.device.type == "cuda" else "compiled"
        ms, first_s = ar_steps(target, c.device, mode if c.compile else None)
        moe["ar_ms"], moe["ar_first_call_s"] = ms, first_s
        c.say(f"MoE AR step: {ms:7.2f} ms ({ms / floor_ms:.2f}x the active floor); first call {first_s:.1f} s")

    def verify(budget):
        moe["verify_ms"][budget] = ms = verify_ms(target, budget, c.compile, c.a.repeats, prompt_len=512)
        c.say(f"MoE verify B={budget:4d}: {ms:8.2f} ms ({ms / moe.get('ar_ms', ms):.1f}x the AR step)")

    c.run("MoE expert paths", paths)
    c.run("MoE AR step", ar, graphs=1)
    for budget in c.a.moe_budgets:
        c.run(f"MoE verify B={budget}", lambda: verify(budget), graphs=1)


# ------------------------------------------------------------------------------------------------------ hybrid


def free_models(c: Check):
    """The previous part's models and compiled graphs go (cached engines, dynamo's code caches, CUDA graph trees
    and their pools), so that the next part's target takes their place on the device."""
    ddtree._ENGINES.clear()
    torch._dynamo.reset()
    gc.collect()
    if c.device.type == "cuda":
        torch.cuda.empty_cache()
        c.say(f"device memory after freeing: {torch.cuda.memory_allocated() / 1e9:.2f} GB allocated, "
              f"{torch.cuda.memory_reserved() / 1e9:.2f} GB reserved")


def build_hybrid_target(shape, device, dtype):
    """A Qwen3.5 hybrid target with random weights on the device; returns it with its weights' bytes and the bytes
    of its recurrent states per request (float32 states [Hv, Dk, Dv] and the conv states, per Gated DeltaNet layer),
    which a decode step reads and writes back."""
    c = Qwen3Config(**shape)
    with torch.device("meta"):
        target = Qwen3(c)
    target = random_init(target, device, dtype, c)
    target.setup_cache(1024)
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    states = sum(t.numel() * t.element_size() for t in target.state_tensors())
    return target, weights, states


def hybrid_sections(c: Check, bandwidth):
    """The Qwen3.5-27B-shaped hybrid: the AR step beside its floor (weights plus the recurrent states read and
    written back per token, over the copy bandwidth; the attention layers' K/V at context 512, 34 MB, left out),
    eager, compiled and with CUDA graphs as the dense part runs it; then the verify forward per --hybrid-budgets
    (and per --hybrid-series-budgets with the tree rule's solve as a series of matmuls),
    compiled as the engine compiles it, with the recurrent layers in tree mode (the ancestor-masked WY form: a
    few [H, R, R] matrices per layer, no state per tree row), its time beside the AR step and its extra peak
    device memory over what the target and its caches hold."""
    target, weights, states = build_hybrid_target(SMALL_HYBRID if c.a.small else QWEN3_5_27B, c.device, c.dtype)
    floor_ms = (weights + 2 * states) / bandwidth * 1e3
    per_node = sum(m.value_heads * m.key_dim * m.value_dim * 4 for m in target.recurrent_layers())
    hy = c.out["hybrid"] = dict(weight_gb=weights / 1e9, state_gb_per_request=states / 1e9, ar_floor_ms=floor_ms,
                                state_gb_per_tree_row=per_node / 1e9, verify_ms={}, verify_extra_gb={})
    c.say(f"hybrid target ({'small' if c.a.small else 'Qwen3.5-27B-shaped'}): weights {weights / 1e9:.2f} GB, "
          f"recurrent states {states / 1e6:.1f} MB per request (read and written per token) -> AR floor "
          f"{floor_ms:.2f} ms; a state per tree row would take {per_node / 1e6:.1f} MB per row")

    def ar_mode(mode):
        ms, first_s = ar_steps(target, c.device, None if mode == "eager" else mode)
        if mode == "compiled":
            hy["compile_s_per_graph"] = first_s
            c.per_graph = max(c.per_graph, first_s)  # its graphs are its own: 64 layers
        hy[f"ar_{mode}_ms"] = ms
        c.say(f"hybrid AR step {mode:10s}: {ms:7.2f} ms ({ms / floor_ms:.2f}x the floor); first call {first_s:.1f} s")

    def verify(budget, solve="triangular"):
        base = torch.cuda.memory_allocated() if c.device.type == "cuda" else 0
        if c.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        saved, gated_delta.TREE_SOLVE = gated_delta.TREE_SOLVE, solve  # read while tracing
        try:
            ms = timed(tree_verify(target, budget, c.compile, prompt_len=512), c.device, c.a.repeats)[0]
        finally:
            gated_delta.TREE_SOLVE = saved
        key = "" if solve == "triangular" else f"_{solve}"
        hy.setdefault(f"verify{key}_ms", {})[budget] = ms
        extra = (torch.cuda.max_memory_allocated() - base) / 1e9 if c.device.type == "cuda" else None
        hy.setdefault(f"verify{key}_extra_gb", {})[budget] = extra
        ar = hy.get("ar_cudagraphs_ms") or hy.get("ar_compiled_ms") or hy.get("ar_eager_ms") or ms
        c.say(f"hybrid verify B={budget:4d} ({solve}): {ms:8.2f} ms ({ms / ar:.1f}x the AR step)"
              + (f", extra peak {extra:.2f} GB" if extra is not None else ""))

    modes = ["eager"] + (["compiled"] + (["cudagraphs"] if c.device.type == "cuda" else []) if c.compile else [])
    for mode in modes:
        c.run(f"hybrid AR step {mode}", lambda: ar_mode(mode), graphs=0 if mode == "eager" else 1)
    for budget in c.a.hybrid_budgets:
        c.run(f"hybrid verify B={budget}", lambda: verify(budget), graphs=1)
    for budget in c.a.hybrid_series_budgets:  # the tree rule's solve as a series of matmuls instead
        c.run(f"hybrid verify B={budget} series", lambda: verify(budget, "series"), graphs=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="small models (to run the script itself on a CPU)")
    p.add_argument("--eager", action="store_true", help="nothing compiled (the script's own smoke test)")
    p.add_argument("--parts", nargs="+", default=["pair", "8b", "moe", "hybrid", "flex"],
                   choices=["pair", "8b", "moe", "hybrid", "flex"])
    p.add_argument("--flex-all", action="store_true", help="the flex part at every length, with inductor's defaults")
    p.add_argument("--pair-modes", nargs="+", default=["cudagraphs"],
                   choices=["eager", "compiled-no-graphs", "cudagraphs"],
                   help="how the bundled pair runs: eager, compiled without CUDA graphs, or as users run it")
    p.add_argument("--pair-budgets", type=int, nargs="*", default=[4, 16, 64, 512])
    p.add_argument("--pair-seconds", type=float, default=240,
                   help="the bundled pair's cases start only within this many seconds of the part's start")
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 64, 16, 256, 1024])  # the paper's first
    p.add_argument("--e2e-budget", type=int, default=64)
    p.add_argument("--sampled-batches", type=int, nargs="*", default=[1, 16])
    p.add_argument("--prefill-lengths", type=int, nargs="*", default=[8192, 30720])
    p.add_argument("--batch-budgets", type=int, nargs="*", default=[64])
    p.add_argument("--batches", type=int, nargs="*", default=[4, 16])
    p.add_argument("--moe-budgets", type=int, nargs="*", default=[16, 64, 256, 512])
    p.add_argument("--hybrid-budgets", type=int, nargs="*", default=[16, 64, 256, 512])
    p.add_argument("--hybrid-series-budgets", type=int, nargs="*", default=[512],
                   help="budgets whose verify is also timed with gated_delta.TREE_SOLVE = 'series'")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--deadline", type=float, default=520,
                   help="seconds: a section starts only if its compiles, at the measured time per graph, end before")
    p.add_argument("--json", default=None)
    c = Check(p.parse_args())
    parts = c.a.parts
    with torch.inference_mode():
        c.out["versions"] = versions(c.device)
        c.say(f"versions: {c.out['versions']}")
        if "pair" in parts:
            c.pair_t0 = time.time()
            c.run("bundled pair", lambda: bundled_pair_check(c))
        bandwidth = None
        if "8b" in parts:
            with guarded(c.out, "8B-shaped pair", c.device):
                bandwidth = dense_sections(c)
            free_models(c)  # the 30B-shaped target (61 GB in bf16) takes the 8B pair's place
        if ("moe" in parts or "hybrid" in parts) and bandwidth is None:
            bandwidth = copy_bandwidth(c.device, 0.25 if c.a.small else 2.0)
        if "moe" in parts:
            with guarded(c.out, "MoE target", c.device):
                moe_sections(c, bandwidth)
            free_models(c)  # the 27B-shaped hybrid (54 GB in bf16) takes the MoE target's place
        if "hybrid" in parts:
            with guarded(c.out, "hybrid target", c.device):
                hybrid_sections(c, bandwidth)
            free_models(c)
        if "flex" in parts:
            c.run("flex vs sdpa", lambda: flex_check(c.device, c.dtype, c.out, c.compile, c.a.flex_all))
    sync(c.device)
    # Graphs that CUDA graph trees refused (mutated inputs they cannot pin, CPU ops, ...) ran uncaptured; the
    # reasons are in the log lines above ("skipping cudagraphs due to ...").
    c.out["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    c.out["sections_not_ok"] = [k for k, v in c.out["sections"].items() if v.get("status") != "ok"]
    c.say(f"graphs refused by CUDA graphs: {c.out['cudagraph_skips']}; sections not ok: {c.out['sections_not_ok']}")
    c.save()


if __name__ == "__main__":
    main()
