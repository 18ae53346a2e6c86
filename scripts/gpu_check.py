"""One-call GPU check, sized for a 10-minute device run (not yet run on a GPU): Qwen3-8B-shaped target and
8B-shaped DFlash drafter with random weights in bf16, built directly on the device (no 16 GB checkpoint to write).

    python scripts/gpu_check.py --json out/gpu_check.json          # on the GPU machine
    python scripts/gpu_check.py --small --device cpu                # a smoke test of the script itself

Prints and writes, most important first: the measured device copy bandwidth and the AR step's bandwidth floor
(weight bytes / bandwidth) beside the measured AR step (eager, compiled, CUDA graphs); the round split at the
paper's budget (draft, tree, mask, verify, walk, compact, context: benchlib.round_split), the whole compiled
round, and tree + mask + walk compiled with and without CUDA graphs; generate() end to end as users run it
(compiled, CUDA graphs on the GPU: AR and DDTree, each twice); the other budgets; generate_batch at B = 64 and 512
with batches of 1, 4 and 16; budget auto's calibration curve (seconds per round of AR, the chain and each tree) and
one auto run; tree build alone at the paper's size; then a Qwen3-30B-A3B-shaped MoE target (48
layers, 128 experts, top 8): the grouped-GEMM expert path checked against the all-experts one, its AR step beside
the floor of the weights a token reads, and its verify forward per budget. Every section compiles 8B-shaped graphs afresh, so the first compiled AR step's time is taken
as the cost of one graph, and a section starts only if its graphs fit before --deadline (else it is listed as
skipped). The JSON is rewritten after each section: a device run cut short still brings back what it measured.
"""

import argparse
import contextlib
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
from benchlib import (batched_run, round_header, round_row, round_split, sync, timed, tree_alone,  # noqa: E402
                      verify_ms, write_json)
import ddtree  # noqa: E402
from ddtree import Engine, Speculation, cache_length, generate  # noqa: E402
from drafter import DFlashConfig, DFlashDrafter  # noqa: E402
from model import Qwen3, Qwen3Config, SparseMoE, grouped_mm_supported, rope_inv_freq  # noqa: E402
from sampler import Sampling  # noqa: E402
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


def random_init(module, device, dtype, config):
    """Materialize a meta-built module on the device with small random weights (norm weights 1)."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    module.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, device)
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


def moe_section(a, device, dtype, bandwidth, out, section, t0):
    """The 30B-A3B-shaped target: the AR step beside the floor of its active weights' bytes, and the verify
    forward per budget, whose growth with B (more experts touched) decides the best budget on MoE targets."""
    target, active = build_moe_target(SMALL_MOE if a.small else QWEN3_30B_A3B, device, dtype)
    floor_ms = active / bandwidth * 1e3
    moe = out["moe"] = dict(active_weight_gb=active / 1e9, ar_floor_ms=floor_ms, verify_ms={})
    print(f"MoE target ({'small' if a.small else '30B-A3B-shaped'}): active weights {active / 1e9:.2f} GB per "
          f"token -> AR floor {floor_ms:.2f} ms", flush=True)
    mlp = next(layer.mlp for layer in target.layers if isinstance(layer.mlp, SparseMoE))
    x = torch.randn(64, target.config.hidden_size, device=device, dtype=dtype)
    ids, weights = mlp.route(x)
    paths = {"all_experts": mlp.all_experts(x, ids, weights), "gathered": mlp.gathered(x, ids, weights)}
    if grouped_mm_supported(x):
        paths["grouped"] = mlp.grouped(x, ids, weights)
    ref = paths["all_experts"].float()
    moe["expert_paths_max_diff"] = {k: float((v.float() - ref).abs().max()) for k, v in paths.items()}
    print(f"MoE expert paths, max |difference| from all experts over 64 rows: {moe['expert_paths_max_diff']} "
          f"(output scale {float(ref.abs().max()):.3g})", flush=True)
    mode = "cudagraphs" if device.type == "cuda" else "compiled"
    if section("MoE AR step", graphs=1):
        ms, first_s = ar_steps(target, device, mode)
        moe["ar_ms"], moe["ar_first_call_s"] = ms, first_s
        print(f"MoE AR step {mode}: {ms:7.2f} ms ({ms / floor_ms:.2f}x the active floor); first call "
              f"{first_s:.1f} s  [{time.time() - t0:.0f} s]", flush=True)
    for budget in a.moe_budgets:
        if section(f"MoE verify B={budget}", graphs=1):
            moe["verify_ms"][budget] = ms = verify_ms(target, budget, True, a.repeats, prompt_len=512)
            print(f"MoE verify B={budget:4d}: {ms:8.2f} ms ({ms / moe.get('ar_ms', ms):.1f}x the AR step)  "
                  f"[{time.time() - t0:.0f} s]", flush=True)


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


def flex_check(device, dtype, out):
    """Compiled FlexAttention under a PrefixMask against SDPA with the mask written out, per query length and GQA
    ratio: the lengths the engine runs (decode, draft block, B + 1, prefill chunk), with the engine's kernel
    options and, at some lengths, inductor's defaults. The `write` cases do as the engine's layers do: float32,
    the rows' K/V written into the cache inside the same graph, then attended."""
    res = out["flex_vs_sdpa"] = {}
    kv_len, dim = 1024, 128
    torch._dynamo.config.recompile_limit = 64  # one graph per case below
    cases = [(4, q, True, False) for q in (1, 16, 17, 33, 65, 128, 257, 513)]
    cases += [(8, 17, True, False), (8, 65, True, False), (2, 65, True, False), (4, 65, False, False)]
    cases += [(g, q, ours, True) for g, q in ((2, 8), (2, 17), (4, 16)) for ours in (True, False)]
    for g, q_len, ours, write in cases:
        key = f"G{g}-q{q_len}" + ("" if ours else "-default-options") + ("-write-f32" if write else "")
        options = flex_kernel_options(q_len, device.type) if ours else None
        try:
            res[key] = dict(status="ok", options=options,
                            max_diff=flex_case(device, torch.float32 if write else dtype, g, q_len, kv_len, dim,
                                               options, write))
        except Exception:  # noqa: BLE001
            res[key] = dict(status="error", options=options, error=traceback.format_exc()[-1500:])
        print(f"FlexAttention {key}: {res[key].get('status')} max|diff| {res[key].get('max_diff')} "
              f"options {res[key].get('options')} {res[key].get('error', '')[-300:]}", flush=True)


def flex_case(device, dtype, g, q_len, kv_len, dim, options, write):
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

    attend = torch.compile(attend, dynamic=False, fullgraph=True)
    worst = 0.0
    for prefix in (0, 130, kv_len - q_len - 1):
        gen = torch.Generator().manual_seed(q_len + prefix)
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q_len)]
        anc = torch.zeros(q_len, q_len, dtype=torch.bool)
        for i in range(q_len):  # ancestor-or-self rows of a random tree, written out
            j = i
            while j >= 0:
                anc[i, j] = True
                j = parents[j]
        anc = anc.to(device)
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


def bundled_pair_check(device, out, budgets, modes, save):
    """The bundled tiny pair in float32 on this device: dflash and ddtree at each budget, eager, compiled without
    CUDA graphs and compiled as users run it (CUDA graphs on the GPU), every token against eager AR (trained
    weights: greedy ties are rare, so the tokens must match), run twice; where they differ, the first differing
    position says which mode breaks."""
    target = Qwen3.from_pretrained(os.path.join(ROOT, "assets", "tiny-target"), device=device, dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(os.path.join(ROOT, "assets", "tiny-draft"), device=device,
                                            dtype=torch.float32).bind(target)
    prompt = list(range(5, 45))
    ref = generate(target, None, prompt, method="ar", max_new_tokens=96, stop_ids=[]).tokens
    res = out["bundled_pair"] = {}
    plain_compile = torch.compile
    for mode in modes:
        ddtree._ENGINES.clear()
        torch._dynamo.reset()
        if mode == "compiled-no-graphs":  # the engine's compiles without CUDA graphs
            torch.compile = lambda fn, **kw: plain_compile(fn, **dict(kw, mode=None))
        try:
            for method, budget in [("ar", None), ("dflash", None)] + [("ddtree", b) for b in budgets]:
                if mode == "eager" and method == "ar":
                    continue
                key = f"{mode}/{method}" + ("" if budget is None else f"-B{budget}")
                t = time.time()
                try:
                    runs = [generate(target, drafter if method != "ar" else None, prompt, method=method,
                                     budget=budget, max_new_tokens=96, compile=mode != "eager", stop_ids=[])
                            for _ in range(2)]
                    first_diff = next((i for i, (x, y) in enumerate(zip(runs[1].tokens, ref)) if x != y), None)
                    res[key] = dict(status="ok", equal_to_eager_ar=runs[1].tokens == ref, first_diff=first_diff,
                                    repeat_equal=runs[0].tokens == runs[1].tokens, tau=runs[1].stats["tau"],
                                    tokens_per_s=runs[1].stats["tokens_per_s"], seconds=time.time() - t)
                except Exception:  # noqa: BLE001
                    res[key] = dict(status="error", error=traceback.format_exc()[-3000:], seconds=time.time() - t)
                save()
                print(f"bundled pair {key}: { {k: v for k, v in res[key].items() if k != 'error'} } "
                      f"{res[key].get('error', '')[-400:]}", flush=True)
        finally:
            torch.compile = plain_compile
    ddtree._ENGINES.clear()


def copy_bandwidth(device, gib=1.0):
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    ms, _ = timed(lambda: b.copy_(a), device, 5)
    return 2 * a.numel() * a.element_size() / (ms / 1e3)


def ar_steps(target, device, compile_mode, repeats=20):
    """Milliseconds per AR decode step at ~context 512 (eager, compiled, or compiled + CUDA graphs)."""
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


def end_to_end(target, drafter, budget, new_tokens=64, prompt_len=128):
    """generate() compiled, as the CLI runs it (CUDA graphs on the GPU, the next token fed back every round), AR and
    DDTree, twice each: the replays must repeat themselves exactly. Random weights have near-tied argmaxes, so
    DDTree's tokens are set beside AR's for information only (bf16 rounding differs between 1 and B + 1 rows)."""
    prompt = torch.randint(0, 1000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    for method in ("ar", "ddtree"):
        runs = [generate(target, drafter, prompt, method=method, budget=budget if method == "ddtree" else None,
                         max_new_tokens=new_tokens, compile=True, stop_ids=[]) for _ in range(2)]
        out[method] = dict(repeatable=runs[0].tokens == runs[1].tokens, tokens=runs[1].tokens,
                           tokens_per_s=runs[1].stats["tokens_per_s"], tau=runs[1].stats["tau"])
    ar, tree = out["ar"]["tokens"], out["ddtree"]["tokens"]
    out["agree_prefix"] = next((i for i, (x, y) in enumerate(zip(ar, tree)) if x != y), min(len(ar), len(tree)))
    return out


def batched_section(a, target, drafter, out, section, t0):
    """generate_batch compiled, greedy DDTree: tokens/s of 16 requests (prompt 128, 64 new tokens) run --batches at
    a time, per budget; each batch size is 2 new graphs (prefill and round), and so is each smaller power of two
    that a batch moves to as its requests end."""
    prompts = [torch.randint(0, 1000, (128,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(16)]
    out["batched"] = {}
    for budget in a.batch_budgets:
        compiled = set()  # batch sizes with graphs at this budget (at most: a batch may not shrink)
        for batch in a.batches:
            sizes = {1 << k for k in range(batch.bit_length())} | {batch}  # itself and each power of two below
            if not section(f"batched B={budget} batch {batch}", graphs=2 * len(sizes - compiled)):
                continue
            compiled |= sizes
            tps = batched_run(target, drafter, prompts, "ddtree", budget, 64, True, batch, passes=1)
            out["batched"][f"B{budget}-batch{batch}"] = tps
            print(f"generate_batch ddtree B={budget:4d} batch {batch:3d}: {tps:9.1f} tok/s over 16 requests"
                  f"  [{time.time() - t0:.0f} s]", flush=True)


def auto_section(a, target, drafter, out, section, t0):
    """budget auto on this device (compiled, batch 1, greedy): its calibration (seconds per round of each candidate,
    and the rate each would reach accepting every draft, which decides whether it is viable), then one
    generate(budget="auto") (random weights accept little, so auto should settle on plain decoding)."""
    budgets = ddtree.auto_budgets(128, 64, target)
    if not section("budget auto", graphs=len(budgets) + 3):  # a round per candidate and a prefill
        return
    spec = ddtree.Speculation(budget="auto")
    length = ddtree.cache_length(128, 64, "ddtree", spec, drafter, budgets)
    engine = ddtree.auto_engine(target, drafter, ddtree.Sampling(), spec, length, True, False, 1, budgets)
    warm_up = engine.warm_up(recalibrate=True)
    print(f"budget auto calibration ({engine.calibrate_seconds:.0f} s, {warm_up:.0f} s with compiling):\n"
          f"{engine.curve_table()}", flush=True)
    prompt = torch.randint(0, 1000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    res = generate(target, drafter, prompt, budget="auto", max_new_tokens=64, compile=True, stop_ids=[])
    report = res.stats["auto"]
    out["auto"] = dict(curve=engine.curve(), calibrate_seconds=engine.calibrate_seconds, warm_up_seconds=warm_up,
                       tokens_per_s=res.stats["tokens_per_s"], tau=res.stats["tau"], choice=report["choice"],
                       rounds_per_candidate=report["rounds_per_candidate"],
                       probe_overhead_seconds=report["probe_overhead_seconds"])
    print(f"generate budget=auto: {res.stats['tokens_per_s']:.1f} tok/s, tau {res.stats['tau']:.2f}, best "
          f"{report['choice']}, rounds {report['rounds_per_candidate']}  [{time.time() - t0:.0f} s]", flush=True)


def run_round(a, budget, target, drafter, out, section, t0, graphs, cols):
    """One budget's round split (benchlib.round_split), as a table row."""
    if not section(f"round B={budget}", graphs):
        return
    ms = round_split(target, drafter, budget, compile=True, repeats=a.repeats, prompt_len=512)
    out["rounds"][budget] = ms
    print(round_row(budget, ms, cols, width=9) + f"  [{time.time() - t0:.0f} s]", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="a small model (to smoke-test the script on a CPU)")
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 64, 1024, 256, 16])  # the paper's first
    p.add_argument("--e2e-budget", type=int, default=64)
    p.add_argument("--pair-budgets", type=int, nargs="*", default=[4, 16, 64],
                   help="ddtree budgets of the bundled pair's float32 check (compiled vs eager AR)")
    p.add_argument("--moe-budgets", type=int, nargs="*", default=[16, 64, 256, 512],
                   help="verify budgets on the 30B-A3B-shaped MoE target (none: skip the MoE section)")
    p.add_argument("--pair-modes", nargs="+", default=["cudagraphs"],
                   choices=["eager", "compiled-no-graphs", "cudagraphs"],
                   help="how the bundled pair runs: eager, compiled without CUDA graphs, or as users run it")
    p.add_argument("--parts", nargs="+", default=["flex", "pair", "8b"], choices=["flex", "pair", "8b"],
                   help="which parts run (8b: the 8B-shaped pair, then the MoE target)")
    p.add_argument("--batch-budgets", type=int, nargs="*", default=[64, 512],
                   help="generate_batch at these budgets, batches of --batches (none: skip the batched section)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--deadline", type=float, default=540,
                   help="seconds: a section starts only if its compiles, at the measured time per graph, end before")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "small": a.small,
           "skipped": []}
    t0 = time.time()
    per_graph = {"s": 0.0}  # seconds to compile one model graph, measured on the first compiled AR step

    def section(name, graphs=0):
        """Whether to run a section that compiles `graphs` model graphs: no if that would end past the deadline
        (noted in the JSON). Saves what was measured so far either way."""
        out["seconds"] = time.time() - t0
        if a.json:
            write_json(a.json, out)
        if out["seconds"] + graphs * per_graph["s"] > a.deadline:
            out["skipped"].append(name)
            print(f"skipped ({graphs} graphs at {per_graph['s']:.0f} s each would end past {a.deadline:.0f} s): "
                  f"{name}", flush=True)
            return False
        return True

    def run(name, fn, graphs=0):
        """fn() as one guarded section, if its graphs fit before the deadline."""
        if section(name, graphs):
            with guarded(out, name, device):
                fn()

    with torch.inference_mode():
        out["versions"] = versions(device)
        print(f"versions: {out['versions']}", flush=True)
        if "flex" in a.parts:
            run("flex vs sdpa", lambda: flex_check(device, dtype, out))
        if "pair" in a.parts:
            run("bundled pair", lambda: bundled_pair_check(device, out, a.pair_budgets, a.pair_modes,
                                                                   lambda: a.json and write_json(a.json, out)))
        if "8b" not in a.parts:
            write_json(a.json, out) if a.json else None
            return
        target, drafter = build(SMALL if a.small else QWEN3_8B, device, dtype)
        weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
        bandwidth = copy_bandwidth(device, 0.25 if a.small else 2.0)
        floor_ms = weight_bytes / bandwidth * 1e3
        out.update(weight_gb=weight_bytes / 1e9, copy_bandwidth_gbs=bandwidth / 1e9, ar_floor_ms=floor_ms)
        print(f"{out['device']}: target weights {weight_bytes / 1e9:.2f} GB, copy bandwidth "
              f"{bandwidth / 1e9:.0f} GB/s -> AR floor {floor_ms:.2f} ms/token", flush=True)
        modes = ["eager", "compiled"] + (["cudagraphs"] if device.type == "cuda" else [])

        def ar_mode(mode):
            ms, first_s = ar_steps(target, device, None if mode == "eager" else mode)
            if mode == "compiled":
                per_graph["s"] = out["compile_s_per_graph"] = first_s
            out[f"ar_{mode}_ms"] = ms
            print(f"AR step {mode:10s}: {ms:7.2f} ms  ({ms / floor_ms:.2f}x the floor); first call "
                  f"{first_s:.1f} s  [{time.time() - t0:.0f} s]", flush=True)

        for mode in modes:
            run(f"AR step {mode}", lambda: ar_mode(mode), graphs=0 if mode == "eager" else 1)
        out["rounds"] = {}
        cols = ["draft", "tree", "mask", "verify", "walk", "compact", "context", "round", "tree_work"] + (
            ["tree_work_nograph"] if device.type == "cuda" else [])
        print(round_header(cols, compiled=True, width=9) + "  (ms; stages eager except the forwards (draft, verify,"
              " context), compiled as the engine runs them (CUDA graphs on the GPU); tree_work: tree + mask + walk"
              " compiled together, with and without CUDA graphs; overhead: tree + mask + walk + compact share of the"
              " stages; compiled: (round - draft - context - verify) / round)", flush=True)

        def e2e():
            res = end_to_end(target, drafter, a.e2e_budget)
            out["end_to_end"] = {m: {k: v for k, v in res[m].items() if k != "tokens"} for m in ("ar", "ddtree")}
            out["end_to_end"]["agree_prefix"] = res["agree_prefix"]
            for m in ("ar", "ddtree"):
                r = res[m]
                print(f"generate {m:6s} compiled{' + CUDA graphs' if device.type == 'cuda' else ''}: "
                      f"{r['tokens_per_s']:8.1f} tok/s, tau {r['tau']:.2f}, two runs identical: {r['repeatable']}"
                      f"  [{time.time() - t0:.0f} s]", flush=True)
            print(f"DDTree B={a.e2e_budget} and AR agree on the first {res['agree_prefix']} of "
                  f"{len(res['ar']['tokens'])} tokens (random weights: near ties)", flush=True)

        def one_round(budget, graphs):
            with guarded(out, f"round B={budget}", device):
                run_round(a, budget, target, drafter, out, section, t0, graphs, cols)

        def tree():
            t = tree_alone(target.config.vocab_size, 15, 512, device, a.repeats)
            out["tree_alone"] = t
            print(f"tree build alone (V={target.config.vocab_size}, depth 15, B=512): heap {t['heap_ms']:.2f} ms, "
                  f"tensor eager {t['tensor_eager_ms']:.2f} ms, compiled {t['tensor_compiled_ms']:.2f} ms, "
                  f"identical: {t['equal']}")

        # The paper's budget first (draft, verify, context and round, plus two small tree-work graphs), then
        # generate() end to end (3 new graphs: AR prefill, DDTree prefill and round), then the other budgets
        # (verify and round, plus the tree work).
        one_round(a.budgets[0], 5)
        run("end to end", e2e, graphs=3)
        for budget in a.budgets[1:]:
            one_round(budget, 3)
        with guarded(out, "batched", device):
            batched_section(a, target, drafter, out, section, t0)
        with guarded(out, "budget auto", device):
            auto_section(a, target, drafter, out, section, t0)
        run("tree alone", tree)
        if a.moe_budgets:
            del target, drafter  # the 30B-shaped target (61 GB in bf16) takes the 8B pair's place
            if device.type == "cuda":
                torch.cuda.empty_cache()
            with guarded(out, "moe", device):
                moe_section(a, device, dtype, bandwidth, out, section, t0)
    sync(device)
    # Graphs that CUDA graph trees refused (mutated inputs they cannot pin, CPU ops, ...) ran uncaptured; the
    # reasons are in the log lines above ("skipping cudagraphs due to ...").
    out["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    print(f"graphs refused by CUDA graphs: {out['cudagraph_skips']}")
    out["seconds"] = time.time() - t0
    print(f"total {out['seconds']:.0f} s")
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
