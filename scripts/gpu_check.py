"""One call on a lent GPU: today's engine checked token for token there, and its speed measured against its floor.

    python scripts/gpu_check.py --json benchmarks/DATE-h100-gpu_check.json 2>&1 | tee benchmarks/DATE-h100-gpu_check.log
    python scripts/gpu_check.py --parts flex hybrid-slice --json out.json    # the named parts, in the order given
    python scripts/gpu_check.py --device cpu --small --json /tmp/x.json      # every part on small shapes: a smoke run

Parts:
  hybrid-tiny    a tiny float32 hybrid target (Qwen3.5's layout) and a drafter, compiled as users run them (CUDA
                 graphs on a GPU): ar, dflash, ddtree B = 16 and 64 against eager ar token for token, on a prompt
                 of two prefill chunks; ddtree B = 64 again with the tree rule's 'series' solve
  pair-smoke     the bundled pair, compiled: ddtree B = 16 and a batch that shrinks as its requests stop, against
                 eager ar; under CUDA graphs, that every round replays a graph
  ar-profile     the Qwen3-8B-shaped AR step in bf16: pipelined (back-to-back steps, one sync) and per call, beside
                 its floor (the bytes a step reads over the measured copy bandwidth), and the profiler's kernel
                 table (kernels per step, their summed time against the wall time, the top kernels)
  round-profile  a DDTree round at --round-budgets (B = 64) on 8B shapes with a random drafter, each stage
                 compiled and timed alone (draft, tree, mask, verify, accept, commit), the whole round, and the
                 step's host read
  verify-curve   the target's verify forward at --verify-budgets (B = 128, 512)
  projection     per budget the paper gives, its acceptance length (Qwen3-8B, MATH-500, T = 0) over our round
                 time against our AR step: the projected speedup over our own AR and tokens/s, beside the paper's
  hybrid-rule    the 27B-shaped tree rule alone (gated_delta.tree_gated_delta, R = 65 / 257 / 513 rows, both
                 solves), per layer and for the 48 layers, eager and captured in a CUDA graph
  hybrid-slice   4 layers of Qwen3.5-27B (3 Gated DeltaNet, 1 gated attention): AR step against its floor
                 (weights plus recurrent states read and written), verify at B = 64 and 512, extra peak memory
  flex           compiled FlexAttention under the engine's masks against SDPA with the mask written out, at
                 Qwen3-8B's G = 4 over the engine's query lengths, Qwen3.5-27B's G = 6 with heads of 256, and
                 Qwen3-30B-A3B's G = 8 at one row

The parts named by --parts run in the order given. Without --parts a device run takes the parts that matter
first, in this order: hybrid-tiny and pair-smoke (whether the engine is right on the device at all: nothing else
means much if it is not), ar-profile, round-profile and verify-curve (the speed figures), projection (right after
its inputs: it compiles nothing when they exist), then hybrid-rule and hybrid-slice. flex is left out: the first
two parts already run the engine's FlexAttention calls compiled against eager tokens, and its dozen small graphs
cost minutes; run it with --parts flex in the device's remaining time. With --small every part runs (the
script's own smoke test, on a CPU).

Each part is priced before it starts from the seconds per compiled graph measured so far in this call, kept apart
for three kinds of graph: one model forward (an AR step, a verify, a draft: "ar"), a whole round ("round"), and a
graph of the tiny models or of a round's small stages ("tiny"); until a kind is measured its default (--device's)
stands in. A part whose price ends past --deadline is skipped, with why. Each part runs under its own alarm
(--part-seconds, never past the deadline): one that overruns ends as "timeout" and the next part starts. Every
part records its status (ok, error with the traceback, timeout, skipped with why), seconds, peak device memory,
recompiles and compile seconds; the JSON, with versions, device, driver and clocks, is rewritten after every part,
so a run cut short keeps what it measured. Exit status: 0 when every requested part is ok, 1 when any errs, times
out or is skipped, 2 for bad arguments.
"""

import time

T0 = time.time()  # the deadline counts from the call's start, imports included

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_hybrid import cpu_name, tree_verify  # noqa: E402
from benchlib import write_json  # noqa: E402
import compiling  # noqa: E402
import ddtree  # noqa: E402
import gated_delta  # noqa: E402
from ddtree import Engine, Speculation, cache_length, generate, generate_batch, prefill_chunk  # noqa: E402
from draft_tree import ancestor_matrix  # noqa: E402
from drafter import DFlashConfig, DFlashDrafter  # noqa: E402
from model import Qwen3, Qwen3Config, rope_inv_freq  # noqa: E402
from sampler import Sampling  # noqa: E402
from tree_attn import PrefixMask, flex_kernel_options  # noqa: E402

# ------------------------------------------------------------------------------------------------------ shapes


def hybrid_layer_types(layers: int, interval: int = 4) -> tuple:
    """Qwen3.5's layout: every interval-th layer full attention, the others Gated DeltaNet."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))


QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=40960, tie_word_embeddings=False)
SMALL = dict(QWEN3_8B, vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
# Qwen3.5-27B's text config as public material agrees on it (the Hub is out of reach here): 64 layers, every 4th
# gated full attention (24 heads of 256, 4 KV heads, a quarter of each head roped, theta 1e7), the others Gated
# DeltaNet (16 key heads and 48 value heads of 128, conv kernel 4); hidden 5120, MLP 17408, vocabulary 248320.
QWEN3_5_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                   num_attention_heads=24, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7,
                   max_position_embeddings=262144, tie_word_embeddings=False, layer_types=hybrid_layer_types(64),
                   partial_rotary_factor=0.25, zero_centered_norm=True, attn_output_gate=True,
                   linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_num_key_heads=16, linear_num_value_heads=48)
HYBRID_SLICE = dict(QWEN3_5_27B, num_hidden_layers=4, layer_types=hybrid_layer_types(4))
SMALL_HYBRID = dict(HYBRID_SLICE, **{k: SMALL[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                           "num_attention_heads", "num_key_value_heads",
                                                           "head_dim")},
                    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                    linear_num_value_heads=4)
# hybrid-tiny: a vocabulary of 8, so that a random drafter's trees (its laws nearly flat) hold the target's choices
# a few levels deep, and commits of accepted paths through the recurrent layers are exercised.
TINY_HYBRID = dict(SMALL_HYBRID, vocab_size=8, hidden_size=128, intermediate_size=256, head_dim=32,
                   linear_key_head_dim=32, linear_value_head_dim=32)
DRAFT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings")
CONTEXT = 512  # committed tokens before every timed step, round and verify
CHAIN_BUDGET = 15  # the 8B drafter's chain (block 16) verifies 16 rows: a tree budget of 15

# DDTree paper (Ringel & Romano), Table 1: Qwen3-8B on MATH-500 at temperature 0, mean acceptance length tau
# (the bonus token included) and speedup over autoregressive decoding; DDTree at its best budget, which Fig. 4
# names (B = 512), and DFlash's chain (block 16). Fig. 3 plots the other budgets without printing their values,
# so these two are all the paper's text gives.
PAPER = dict(budgets={512: dict(tau=10.73, speedup=7.52)}, chain=dict(tau=7.79, speedup=5.56))

# ---------------------------------------------------------------------------------------------- random weights


def materialize(make, device, dtype):
    """make() built on the meta device, converted to dtype there (it holds no memory yet), then given uninitialized
    memory on the device: no float32 copy of the weights ever exists."""
    with torch.device("meta"):
        module = make()
    return module.to(dtype).to_empty(device=device)


def fill_random(module, seed: int, std: float, zero_centred: bool):
    """Every parameter filled in place from a seeded generator (runs repeat): normal(0, std), except the norms'
    weights (the identity: 1 for x * w, 0 for a hybrid's zero-centred x * (1 + w), which Gated DeltaNet's own norm
    is not) and Gated DeltaNet's decay parameters (A in [1, 16] as transformers initializes it; softplus(dt_bias)
    log-uniform in [1e-3, 1e-1] as Mamba does), which normal noise would make decay too fast or not at all."""
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if zero_centred and "linear_attn." not in name else 1.0)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, device=device).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty(p.shape, device=device).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
                p.copy_(dt.expm1().log())  # softplus's inverse
            else:
                p.normal_(0.0, std, generator=gen)


def build_target(shape: dict, device, dtype, seed: int = 0, std: float = 0.02) -> Qwen3:
    c = Qwen3Config(**shape)
    target = materialize(lambda: Qwen3(c), device, dtype)
    if c.tie_word_embeddings:  # to_empty gives each module its own new tensor
        target.lm_head.weight = target.embed_tokens.weight
    fill_random(target, seed, std, c.zero_centered_norm)
    target.inv_freq = rope_inv_freq(c.rotary_dim, c.rope_theta, device)  # float32, as loading makes it
    return target.eval()


def build_drafter(target: Qwen3, block: int, layers: int, seed: int = 1, std: float = 0.02) -> DFlashDrafter:
    """A random DFlash drafter for `target` (plain Qwen3 layers, whatever the target's), reading z-lab's Qwen3-8B
    layers on a 36-layer target and the first three otherwise."""
    t = target.config
    model = Qwen3Config(**{k: getattr(t, k) for k in DRAFT_FIELDS}, num_hidden_layers=layers,
                        tie_word_embeddings=False)
    ids = [1, 9, 17, 25, 33] if t.num_hidden_layers == 36 else list(range(min(3, t.num_hidden_layers)))
    dc = DFlashConfig(model=model, block_size=block, num_target_layers=t.num_hidden_layers, target_layer_ids=ids,
                      mask_token_id=t.vocab_size - 1)
    drafter = materialize(lambda: DFlashDrafter(dc), target.device, target.dtype)
    fill_random(drafter, seed, std, False)
    drafter.inv_freq = rope_inv_freq(model.head_dim, model.rope_theta, target.device)
    return drafter.eval().bind(target)


def random_tokens(n: int, vocab: int, seed: int = 0) -> list:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------------------------------------------ timing


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_ms(fn, device, n: int) -> float:
    """Median milliseconds of fn(), synchronized around every call."""
    times = []
    for _ in range(n):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def pipelined_ms(fn, device, n: int) -> float:
    """Milliseconds per fn() over n calls issued back to back with one synchronization (CUDA events on a GPU):
    what a call costs when the host runs ahead of the device, as in a decoding loop."""
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) * 1e3 / n


def keep(out):
    """Clones of a compiled call's tensors: a CUDA graph's next replay overwrites its outputs."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(keep(t) for t in out)
    return out


def copy_bandwidth(device, gib: float) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    a = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    return 2 * a.numel() * a.element_size() / (per_call_ms(lambda: b.copy_(a), device, 5) / 1e3)


def kernel_table(fn, device, steps: int, top: int = 12) -> dict:
    """The profiler's view of `steps` calls of fn: on a GPU its kernels (CUDA graph replays included), on a CPU its
    operators (nested ones counted too); per step their count and summed time, and the top ones by time."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    rows = [(e.key, e.count, e.self_device_time_total if cuda else e.self_cpu_time_total)
            for e in prof.key_averages() if e.device_type == kind]
    rows.sort(key=lambda r: -r[2])
    total_us = sum(r[2] for r in rows)
    launches = sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch")
    return dict(of="kernels" if cuda else "cpu operators", per_step=sum(r[1] for r in rows) / steps,
                us_per_step=total_us / steps, graph_launches_per_step=launches / steps,
                top=[dict(name=k[:120], per_step=c / steps, us_per_step=us / steps,
                          share=us / total_us if total_us else 0.0) for k, c, us in rows[:top]])


# --------------------------------------------------------------------------------------------------- the run


class PartTimeout(BaseException):
    """The part's alarm: a BaseException, so that code catching Exception lets it through."""



# Seconds per compiled graph until one of its kind is measured in this call: on a GPU, conservative from the
# H200 runs of record (an 8B AR step graph 30-35 s, a tiny pair's round 20 s, a whole 8B round ~100 s); on a CPU,
# the small shapes of --small.
DEFAULT_PER_GRAPH = {"cuda": dict(ar=40.0, round=110.0, tiny=20.0), "cpu": dict(ar=15.0, round=40.0, tiny=20.0)}


@dataclass
class Part:
    run: object  # fn(run, out): measures, fills `out` (the part's results in the JSON), raises on a failure
    graphs: object  # fn(run) -> {kind: compiled graphs the part will make}, for its price
    work: tuple  # seconds besides compiling: (on a GPU at full shapes, with --small)


class Run:
    """The call's settings, its JSON, its clock, the measured seconds per graph, and what parts hand each other
    (models, bandwidth, measured AR step, rounds and verifies)."""

    def __init__(self, a):
        self.a, self.device = a, torch.device(a.device)
        self.cuda, self.compile = self.device.type == "cuda", not a.eager
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.per_graph = dict(DEFAULT_PER_GRAPH[self.device.type])
        self.measured = {kind: [] for kind in self.per_graph}
        self.models, self.results, self.part = {}, {}, None
        self.repeats = a.repeats or (20 if self.cuda else 5)
        self.back_to_back = 100 if self.cuda else 10
        self.out = dict(command="python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
                        started=time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(T0)),
                        settings=dict(device=a.device, small=a.small, eager=a.eager, deadline=a.deadline,
                                      part_seconds=a.part_seconds, parts=a.parts, dtype=str(self.dtype)),
                        versions=versions(self.device), clocks_at_start=clocks(self.device), parts={})

    def elapsed(self) -> float:
        return time.time() - T0

    def say(self, text: str):
        print(f"[{self.elapsed():5.0f} s] {text}", flush=True)

    def save(self):
        self.out["seconds"] = self.elapsed()
        self.out["per_graph_s"] = dict(self.per_graph, measured={k: len(v) for k, v in self.measured.items()})
        if self.a.json:
            write_json(self.a.json, self.out)

    # -- pricing --------------------------------------------------------------------------------------------------

    def graphs_per_engine(self) -> int:
        """Graphs a new compiled engine makes: its round, and on a GPU its prefill chunk (eager on a CPU)."""
        return 2 if self.cuda else 1

    def price(self, part: Part) -> tuple[float, dict]:
        graphs = part.graphs(self) if self.compile else {}
        work = part.work[1] if self.a.small or not self.cuda else part.work[0]
        return sum(n * self.per_graph[kind] for kind, n in graphs.items()) + work, graphs

    def compiled(self, kind: str, seconds: float, graphs: int = 1):
        """A compile measured in this call: the running seconds per graph of its kind, the part's compile seconds."""
        self.measured[kind] += [seconds / graphs] * graphs
        self.per_graph[kind] = statistics.mean(self.measured[kind])
        self.part["compile_s"] += seconds

    # -- one part -------------------------------------------------------------------------------------------------

    def run_part(self, name: str):
        part, rec = PARTS[name], self.out["parts"].setdefault(name, {})
        price, graphs = self.price(part)
        left = self.a.deadline - self.elapsed()
        rec.update(price_s=round(price, 1), graphs=graphs)
        if price > left:
            rec.update(status="skipped", why=f"priced at {price:.0f} s ({graphs} at {self.per_graph} s per graph, "
                                             f"plus the work), {left:.0f} s left before --deadline")
            self.say(f"{name}: skipped ({rec['why']})")
            return self.save()
        self.say(f"{name}: starts (priced at {price:.0f} s, {left:.0f} s left)")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        t, recompiles = time.time(), sum(counters["recompiles"].values())
        rec.update(compile_s=0.0, result={})
        self.part, rang = rec, []

        def alarm(signum, frame):
            rang.append(time.time())
            raise PartTimeout("the part's alarm rang (--part-seconds or --deadline)")

        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, max(0.01, min(self.a.part_seconds, left)))
        try:
            try:
                if name == self.a.plant_failure:
                    raise RuntimeError(f"planted failure in {name} (--plant-failure)")
                part.run(self, rec["result"])
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            rec["status"] = "ok"
        except (PartTimeout, Exception):  # noqa: BLE001 (a part's failure is a finding; the next part runs)
            # torch may wrap the alarm's exception in its own (dynamo, inductor): the alarm's record decides
            rec.update(status="timeout" if rang else "error", traceback=traceback.format_exc()[-6000:])
            if rang:
                rec["why"] = f"stopped after {rang[0] - t:.0f} s"
        rec.update(seconds=time.time() - t, recompiles=sum(counters["recompiles"].values()) - recompiles,
                   peak_gb=torch.cuda.max_memory_allocated(self.device) / 1e9 if self.cuda else None)
        self.say(f"{name}: {rec['status']} in {rec['seconds']:.0f} s (compiling {rec['compile_s']:.0f} s)"
                 + (f"\n{rec['traceback']}" if "traceback" in rec else ""))
        self.forget()
        self.save()

    def forget(self):
        """Engines and compiled graphs go after every part (a part cut short leaves them half made; CUDA graph
        pools hold device memory); the built models stay for the parts after."""
        ddtree._ENGINES.clear()
        torch._dynamo.reset()
        gated_delta.TREE_SOLVE = "triangular"
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    # -- what parts share -----------------------------------------------------------------------------------------

    def pair8b(self):
        """The Qwen3-8B-shaped target and a 5-layer block-16 drafter in bf16 (--small: small shapes), built once."""
        if "8b" not in self.models:
            target = build_target(SMALL if self.a.small else QWEN3_8B, self.device, self.dtype)
            self.models["8b"] = (target, build_drafter(target, block=16, layers=2 if self.a.small else 5))
        return self.models["8b"]

    def drop_models(self):
        self.models.clear()
        self.forget()

    def bandwidth(self) -> float:
        if "bandwidth" not in self.results:
            self.results["bandwidth"] = copy_bandwidth(self.device, 0.25 if self.a.small else 2.0)
        return self.results["bandwidth"]

    def first_calls(self, kind: str, fn, graphs: int = 1):
        """fn()'s first calls, which compile it (and under CUDA graphs record it), as a measured compile of `graphs`
        graphs of `kind`; returns the last call's output, cloned."""
        t = time.perf_counter()
        for _ in range(compiling.graph_warmup_calls(self.compile, self.device.type)):
            out = keep(fn())
        sync(self.device)
        if self.compile:
            self.compiled(kind, time.perf_counter() - t, graphs)
        return out

    def stage(self, fn):
        """fn compiled as the engine compiles its steps (fullgraph, fixed shapes, CUDA graphs on a GPU); each call
        begins a new CUDA graph step, so that the stages replay independently of each other."""
        if not self.compile:
            return fn
        compiled = torch.compile(fn, dynamic=False, fullgraph=True, mode="reduce-overhead" if self.cuda else None)
        if not self.cuda:
            return compiled

        def call(*args):
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args)
        return call


def versions(device) -> dict:
    v = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda, triton=None,
             device_name=None, capability=None, driver=None)
    with contextlib.suppress(ImportError):
        import triton
        v["triton"] = triton.__version__
    if device.type == "cuda":
        v["device_name"] = torch.cuda.get_device_name(device)
        v["capability"] = list(torch.cuda.get_device_capability(device))
        v["driver"] = nvidia_smi("driver_version")
    else:
        v["device_name"] = cpu_name()
    return v


def nvidia_smi(fields: str):
    """The first GPU's answer to nvidia-smi --query-gpu=fields, or None where nvidia-smi cannot answer."""
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None


CLOCKS = "clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu"


def clocks(device):
    """The GPU's clocks, power and temperature now (a throttled device explains a slow figure), or None."""
    line = nvidia_smi(CLOCKS) if device.type == "cuda" else None
    return None if line is None else dict(zip(CLOCKS.split(","), (x.strip() for x in line.split(","))))


# ------------------------------------------------------------------------------------------- correctness parts


def token_case(run, name: str, result, ref: list, out: dict):
    """One compiled run against eager AR's tokens, recorded under out[name]; its warm-up is a measured compile."""
    diff = next((i for i, (x, y) in enumerate(zip(result.tokens, ref)) if x != y), None)
    out[name] = dict(equal_to_eager_ar=result.tokens == ref, first_diff=diff, tau=result.stats["tau"],
                     compile_s=result.stats["compile_seconds"])
    if run.compile:
        run.compiled("tiny", result.stats["compile_seconds"], run.graphs_per_engine())
    run.say(f"  {name}: equal to eager ar {out[name]['equal_to_eager_ar']} (first difference {diff}), "
            f"tau {out[name]['tau']:.2f}, compiling {out[name]['compile_s']:.1f} s")


def require_equal(out: dict):
    wrong = [k for k, v in out.items() if isinstance(v, dict) and v.get("equal_to_eager_ar") is False]
    if wrong:
        raise AssertionError(f"unequal to eager ar: {wrong}")


@contextlib.contextmanager
def tree_solve(solve: str):
    """gated_delta.TREE_SOLVE is read while tracing: engines and graphs go before and after a change."""
    ddtree._ENGINES.clear()
    torch._dynamo.reset()
    gated_delta.TREE_SOLVE = solve
    try:
        yield
    finally:
        gated_delta.TREE_SOLVE = "triangular"
        ddtree._ENGINES.clear()
        torch._dynamo.reset()


def hybrid_tiny(run, out):
    target = build_target(TINY_HYBRID, run.device, torch.float32, std=0.2)  # peaked laws: no near ties
    drafter = build_drafter(target, block=8, layers=2)
    prompt = random_tokens(prefill_chunk(run.device.type) + 37, TINY_HYBRID["vocab_size"])  # two prefill chunks
    new = 48
    ref = generate(target, None, prompt, method="ar", max_new_tokens=new, stop_ids=[]).tokens
    out["prompt_tokens"] = len(prompt)
    for method, budget, solve in [("ar", None, "triangular"), ("dflash", None, "triangular"),
                                  ("ddtree", 16, "triangular"), ("ddtree", 64, "triangular"),
                                  ("ddtree", 64, "series")]:
        with tree_solve(solve) if solve != "triangular" else contextlib.nullcontext():
            res = generate(target, drafter if method != "ar" else None, prompt, method=method, budget=budget,
                           max_new_tokens=new, compile=run.compile, stop_ids=[])
        token_case(run, method + (f"-B{budget}" if budget else "") + (f"-{solve}" if solve != "triangular" else ""),
                   res, ref, out)
    require_equal(out)


def pair_smoke(run, out):
    target = Qwen3.from_pretrained(ddtree.DEFAULT_TARGET, device=run.device, dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(ddtree.DEFAULT_DRAFT, device=run.device,
                                            dtype=torch.float32).bind(target)
    prompt = list(range(5, 45))
    ref = generate(target, None, prompt, method="ar", max_new_tokens=96, stop_ids=[]).tokens
    res = generate(target, drafter, prompt, budget=16, max_new_tokens=96, compile=run.compile, stop_ids=[])
    token_case(run, "ddtree-B16", res, ref, out)
    if run.cuda and run.compile:  # every round replays a graph: the profiler counts the launches
        table = kernel_table(lambda: generate(target, drafter, prompt, budget=16, max_new_tokens=32,
                                              compile=True, stop_ids=[]), run.device, 1)
        out["ddtree-B16"]["graph_launches_in_32_tokens"] = table["graph_launches_per_step"]
    out["batch-shrinking"] = shrinking_batch(run, target, drafter)
    require_equal(out)


def shrinking_batch(run, target, drafter) -> dict:
    """Two requests in one batch (ddtree, B = 16) under a stop token that ends them at different rounds, so the
    batch moves to a smaller engine: each request's tokens against its own eager AR run."""
    prompts = [list(range(5, 45)), list(range(12, 48))]
    free = generate(target, None, prompts[0], method="ar", max_new_tokens=48, stop_ids=[]).tokens
    stop = [free[12]]  # a token request 0 emits: it stops early, the other later or never
    refs = [generate(target, None, p, method="ar", max_new_tokens=48, stop_ids=stop).tokens for p in prompts]
    t = time.perf_counter()
    batch = generate_batch(target, drafter, prompts, budget=16, max_new_tokens=48, stop_ids=stop,
                           compile=run.compile, max_batch=2)
    if run.compile:
        run.compiled("tiny", time.perf_counter() - t, 2 * run.graphs_per_engine())
    lengths = [len(r) for r in refs]
    if len(set(lengths)) < 2:
        raise AssertionError(f"the requests end together ({lengths}): the batch never shrinks")
    return dict(equal_to_eager_ar=[r.tokens for r in batch] == refs, lengths=lengths)


# ------------------------------------------------------------------------------------------------- speed parts


def step_bytes(target: Qwen3, context: int) -> dict:
    """The bytes one decode step reads: every weight but the embedding table, of which it reads one row (a tied
    table is read whole as the lm_head); the K/V of `context` slots per attention layer; each recurrent layer's
    states, read and written back."""
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    table = target.embed_tokens.weight
    if not target.config.tie_word_embeddings:
        weights -= table.numel() * table.element_size()
    weights += table.shape[1] * table.element_size()
    kv = sum(c.shape[1] * context * c.shape[3] * c.element_size() for c in target.kv_caches())
    states = 2 * sum(s[:1].numel() * s.element_size() for s in target.state_tensors())
    return dict(weights=weights, kv=kv, states=states, total=weights + kv + states)


def ar_step(run, target: Qwen3, profile: bool) -> dict:
    """The AR step at CONTEXT committed tokens as the engine runs it (Engine.run_round of a compiled ar engine:
    CUDA graphs on a GPU): pipelined and per call, against the floor of the bytes it reads; the kernel table."""
    spec = Speculation()
    engine = Engine(target, None, "ar", Sampling(), spec, cache_length(CONTEXT, 64, "ar", spec, None),
                    compile=run.compile)
    engine.prefill_step = engine._prefill_step  # the prefill only fills the cache here: eager, no graph
    engine.start([random_tokens(CONTEXT, target.config.vocab_size)], [0])
    args = (engine.token, engine.position, None)
    step = lambda: engine.run_round(*args)  # noqa: E731
    run.first_calls("ar", step)
    read = step_bytes(target, CONTEXT)
    floor = read["total"] / run.bandwidth() * 1e3
    rec = dict(pipelined_ms=pipelined_ms(step, run.device, run.back_to_back),
               per_call_ms=per_call_ms(step, run.device, run.repeats), floor_ms=floor,
               bytes_gb={k: v / 1e9 for k, v in read.items()}, copy_bandwidth_gbs=run.bandwidth() / 1e9)
    rec["pipelined_over_floor"] = rec["pipelined_ms"] / floor
    run.say(f"  AR step: pipelined {rec['pipelined_ms']:.3f} ms, per call {rec['per_call_ms']:.3f} ms; floor "
            f"{floor:.3f} ms ({read['total'] / 1e9:.2f} GB at {run.bandwidth() / 1e9:.0f} GB/s): "
            f"{rec['pipelined_over_floor']:.2f}x")
    if profile:
        rec["profile"] = table = kernel_table(step, run.device, 20)
        run.say(f"  {table['of']} per step {table['per_step']:.0f}, summed {table['us_per_step']:.0f} us against "
                f"{rec['pipelined_ms'] * 1e3:.0f} us of wall time; top: "
                + "; ".join(f"{t['name'][:60]} {t['us_per_step']:.0f} us" for t in table["top"][:5]))
    return rec


def ar_profile(run, out):
    target, _ = run.pair8b()
    out.update(ar_step(run, target, profile=True))
    run.results["ar"] = out


def round_stages(run, target, drafter, budget: int) -> dict:
    """One DDTree round at `budget` after CONTEXT committed tokens, each stage compiled alone as the engine compiles
    its round and timed pipelined; the whole round (Engine.run_round) pipelined and per call; Engine.step, whose
    excess over the round is its one host read and bookkeeping."""
    spec = Speculation(budget=budget)
    length = cache_length(CONTEXT, 16 * (run.repeats + 8), "ddtree", spec, drafter)
    engine = Engine(target, drafter, "ddtree", Sampling(), spec, length, compile=run.compile)
    engine.prefill_step = engine._prefill_step
    engine.start([random_tokens(CONTEXT, target.config.vocab_size)], [0])
    bonus, start = engine.token, engine.position
    ms, n = {}, run.back_to_back

    def measure(name, kind, fn, *args):
        f = run.stage(fn)
        out = run.first_calls(kind, lambda: f(*args))
        ms[name] = pipelined_ms(lambda: f(*args), run.device, n)
        return out

    logits_q = measure("draft", "ar", engine.draft, bonus, start)
    tokens, parents, depths = measure("tree", "tiny", lambda lq: engine.propose(lq, None)[:3], logits_q)
    measure("mask", "tiny", lambda s, p: engine.tree_mask(s, p)[1].anc, start, parents)
    mask, recurrent = engine.tree_mask(start, parents)  # the verify's input, as the round hands it over
    rows, positions, logits, features = measure("verify", "ar", engine.verify, bonus, tokens, depths, start, mask,
                                                recurrent)
    path, length, _, _ = measure("accept", "tiny", lambda lg, t, p: engine.accept(lg, t, p, None, None, None),
                                 logits, tokens, parents)
    measure("commit", "tiny", lambda s, p, ln, pos, f: (engine.commit(s, p, ln, pos, f, recurrent), ln)[1],
            start, path, length, positions, features)
    rec = dict(stages_ms=ms, stages_sum_ms=sum(ms.values()))
    whole = lambda: engine.run_round(bonus, start, None, None, None)  # noqa: E731
    run.first_calls("round", whole)
    rec.update(round_ms=pipelined_ms(whole, run.device, n), round_per_call_ms=per_call_ms(whole, run.device,
                                                                                        run.repeats))
    rec["step_ms"] = per_call_ms(engine.step, run.device, run.repeats)
    rec["host_ms"] = rec["step_ms"] - rec["round_per_call_ms"]
    ar = run.results.get("ar")
    if ar:
        rec["round_over_ar"] = rec["round_ms"] / ar["pipelined_ms"]
    run.say(f"  B={budget}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items())
            + f" ms (sum {rec['stages_sum_ms']:.3f}); whole round {rec['round_ms']:.3f} ms pipelined, "
            f"{rec['round_per_call_ms']:.3f} per call; step {rec['step_ms']:.3f} (host {rec['host_ms']:.3f})"
            + (f"; {rec['round_over_ar']:.2f}x the AR step" if ar else ""))
    return rec


def round_profile(run, out):
    target, drafter = run.pair8b()
    for budget in run.a.round_budgets:
        out[budget] = run.results.setdefault("rounds", {})[budget] = round_stages(run, target, drafter, budget)


def verify_time(run, target, budget: int, feature_layers=()) -> dict:
    """The target's verify forward of budget + 1 rows (a random tree after CONTEXT slots, compiled as the engine
    compiles it: bench_hybrid.tree_verify), pipelined and per call."""
    fn = tree_verify(target, budget, run.compile, prompt_len=CONTEXT, feature_layers=feature_layers)
    run.first_calls("ar", fn)
    return dict(ms=pipelined_ms(fn, run.device, run.back_to_back), per_call_ms=per_call_ms(fn, run.device,
                                                                                          run.repeats))


def verify_8b(run, budget: int) -> float:
    """Verify milliseconds at `budget` on the 8B pair (with the drafter's features, as the round's verify), measured
    once per call."""
    done = run.results.setdefault("verify", {})
    if budget not in done:
        target, drafter = run.pair8b()
        done[budget] = verify_time(run, target, budget, drafter.config.target_layer_ids)
        run.say(f"  verify B={budget}: {done[budget]['ms']:.3f} ms pipelined, {done[budget]['per_call_ms']:.3f} "
                f"per call")
    return done[budget]["ms"]


def verify_curve(run, out):
    for budget in run.a.verify_budgets:
        verify_8b(run, budget)
        out[budget] = run.results["verify"][budget]


def projection_needs(run) -> dict:
    """The graphs projection compiles: what earlier parts of this call left unmeasured."""
    rounds = run.results.get("rounds") or {}
    graphs = dict(ar=0 if "ar" in run.results else 1, tiny=0, round=0)
    if not rounds:  # round-profile's round at B = 64
        graphs = dict(ar=graphs["ar"] + 2, tiny=4, round=1)
    verifies = {CHAIN_BUDGET} | {b for b in PAPER["budgets"] if b not in rounds}
    graphs["ar"] += len(verifies - set(run.results.get("verify", {})))
    return graphs


def projection(run, out):
    """tau x (AR step / round time) per budget: the speedup over our own AR if our drafter accepted as the paper's
    did. A round at a budget this call did not run whole is estimated from the measured round at the base budget
    (round-profile's) with its verify stage replaced by the measured verify at that budget (the same forward:
    the drafter's features included); the chain's also without the tree stage (its drafts are the argmax)."""
    target, drafter = run.pair8b()
    if "ar" not in run.results:
        run.results["ar"] = ar_step(run, target, profile=False)
    if not run.results.get("rounds"):
        run.results["rounds"] = {64: round_stages(run, target, drafter, 64)}
    ar = run.results["ar"]["pipelined_ms"]
    base = min(run.results["rounds"])
    r0 = run.results["rounds"][base]
    rest = r0["round_ms"] - r0["stages_ms"]["verify"]
    if rest <= 0:  # a noisy machine measured the whole round under its verify alone: the other stages' sum instead
        rest = r0["stages_sum_ms"] - r0["stages_ms"]["verify"]
    rows = {}
    for budget, paper in PAPER["budgets"].items():
        if budget in run.results["rounds"]:
            ms, source = run.results["rounds"][budget]["round_ms"], "the whole round, measured"
        else:
            ms, source = rest + verify_8b(run, budget), f"round at B={base} with the verify at B={budget}"
        rows[f"ddtree-B{budget}"] = dict(paper, round_ms=ms, source=source)
    rows["dflash-chain"] = dict(PAPER["chain"], source=f"round at B={base} without its tree stage, with the verify "
                                f"of {CHAIN_BUDGET + 1} rows",
                                round_ms=rest - r0["stages_ms"]["tree"] + verify_8b(run, CHAIN_BUDGET))
    for key, r in rows.items():
        r.update(projected_speedup=r["tau"] * ar / r["round_ms"], tokens_per_s=r["tau"] * 1e3 / r["round_ms"])
        run.say(f"  {key}: tau {r['tau']} (paper) x AR {ar:.3f} ms / round {r['round_ms']:.3f} ms = "
                f"{r['projected_speedup']:.2f}x ({r['tokens_per_s']:.0f} tokens/s); paper {r['speedup']}x "
                f"[{r['source']}]")
    out.update(ar_ms=ar, ar_tokens_per_s=1e3 / ar, rows=rows,
               paper="DDTree paper (Ringel & Romano), Table 1 and Fig. 4: Qwen3-8B, MATH-500, T = 0")


# ------------------------------------------------------------------------------------------------ hybrid parts


def bounded_tree(budget: int, max_depth: int, seed: int = 0):
    """(parents [B], deepest depth): node i hangs under a random earlier row no deeper than max_depth - 1, so the
    tree is at most max_depth deep, as a round's tree is at most L deep."""
    g = torch.Generator().manual_seed(seed)
    depths, parents = [0], []
    for _ in range(budget):
        allowed = [r for r, d in enumerate(depths) if d < max_depth]
        p = allowed[int(torch.randint(0, len(allowed), (1,), generator=g))]
        parents.append(p)
        depths.append(depths[p] + 1)
    return torch.tensor(parents), max(depths)


def captured(fn, device):
    """fn as a CUDA graph's replay (captured after warm-up calls on a side stream), or the error capturing gave."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, None
    except Exception as e:  # noqa: BLE001 (whether capture works is the finding)
        return None, f"{type(e).__name__}: {e}"[:500]


def hybrid_rule(run, out):
    """gated_delta.tree_gated_delta at Qwen3.5-27B's recurrent shapes (q and k from 16 key heads, repeated to the 48
    value heads as the layer hands them over; 128-dim heads; float32), one request, trees of R rows at most 15
    deep (the drafter's 15 positions), per layer and for the 48 layers."""
    hk, hv, dim, layers = (2, 4, 32, 48) if run.a.small else (16, 48, 128, 48)
    gen = torch.Generator().manual_seed(0)
    for rows in (65, 257, 513):
        parents, _ = bounded_tree(rows - 1, 15)
        anc = ancestor_matrix(parents[None], 15, dtype=torch.uint8).to(run.device)
        rand = lambda *s: torch.randn(*s, generator=gen).to(run.device)  # noqa: E731
        q, k = (gated_delta.l2norm(rand(1, rows, hk, dim)).repeat_interleave(hv // hk, dim=2) for _ in range(2))
        v, g = rand(1, rows, hv, dim), -torch.rand(1, rows, hv, generator=gen).to(run.device)
        beta, state = torch.rand(1, rows, hv, generator=gen).to(run.device), 0.1 * rand(1, hv, dim, dim)
        for solve in ("triangular", "series"):
            gated_delta.TREE_SOLVE = solve  # read at each eager call
            try:
                rule = lambda: gated_delta.tree_gated_delta(q, k, v, g, beta, state, anc, 15)  # noqa: E731
                rec = dict(eager_ms=pipelined_ms(rule, run.device, run.repeats))
                if run.cuda:
                    replay, error = captured(rule, run.device)
                    rec.update(captured=error is None, capture_error=error)
                    if replay is not None:
                        rec["graph_ms"] = pipelined_ms(replay, run.device, run.back_to_back)
            finally:
                gated_delta.TREE_SOLVE = "triangular"
            best = rec.get("graph_ms", rec["eager_ms"])
            rec[f"{layers}_layers_ms"] = best * layers
            out[f"R{rows}-{solve}"] = rec
            run.say(f"  R={rows} {solve}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                        for k, v in rec.items() if v is not None))


def hybrid_slice(run, out):
    """Four layers of Qwen3.5-27B (--small: of the small hybrid) in bf16, the 8B pair freed first."""
    run.drop_models()
    target = build_target(SMALL_HYBRID if run.a.small else HYBRID_SLICE, run.device, run.dtype)
    out["weights_gb"] = sum(p.numel() * p.element_size() for p in target.parameters()) / 1e9
    out["ar"] = ar_step(run, target, profile=False)
    for budget in (64, 512):
        base = torch.cuda.memory_allocated(run.device) if run.cuda else 0
        if run.cuda:
            torch.cuda.reset_peak_memory_stats(run.device)
        out[f"verify_B{budget}"] = rec = verify_time(run, target, budget)
        rec["extra_peak_gb"] = (torch.cuda.max_memory_allocated(run.device) - base) / 1e9 if run.cuda else None
        run.say(f"  verify B={budget}: {rec['ms']:.3f} ms ({rec['ms'] / out['ar']['pipelined_ms']:.1f}x the AR "
                f"step), extra peak {rec['extra_peak_gb']} GB")
    del target
    run.drop_models()


# -------------------------------------------------------------------------------------------------------- flex


# (heads, kv heads, head size, query rows, K/V written in the graph in float32 as the engine's layers do): Qwen3-8B's
# G = 4 at the engine's lengths (decode, verify rows, a block, a prefill chunk), the drafter's block at G = 2,
# Qwen3.5-27B's G = 6 with heads of 256, Qwen3-30B-A3B's G = 8 at one row. --small: one case per shape.
FLEX_CASES = [(16, 4, 128, q, False) for q in (1, 17, 65, 128, 513)] + [(8, 4, 128, 8, True)] + \
             [(24, 4, 256, q, False) for q in (1, 17, 65, 513)] + [(32, 4, 128, 1, False)]
SMALL_FLEX_CASES = [(16, 4, 128, 17, False), (8, 4, 128, 8, True), (24, 4, 256, 65, False), (32, 4, 128, 1, False)]


def flex(run, out):
    """Each case's largest |difference| from SDPA over three prefixes of random trees; the part fails on an error
    or a difference beyond the dtype's rounding."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # a graph per case
    for heads, kv_heads, dim, rows, write in SMALL_FLEX_CASES if run.a.small else FLEX_CASES:
        key = f"G{heads // kv_heads}-d{dim}-q{rows}" + ("-write-f32" if write else "")
        dtype = torch.float32 if write else run.dtype
        t = time.perf_counter()
        try:
            diff = flex_case(run, dtype, heads, kv_heads, dim, rows, write)
            out[key] = dict(max_diff=diff, ok=diff <= (1e-4 if dtype == torch.float32 else 2e-2))
        except Exception:  # noqa: BLE001 (the next case runs)
            out[key] = dict(ok=False, error=traceback.format_exc()[-1500:])
        if run.compile:
            run.compiled("tiny", time.perf_counter() - t)
        run.say(f"  {key}: {out[key]}")
    bad = [k for k, v in out.items() if not v["ok"]]
    if bad:
        raise AssertionError(f"FlexAttention cases failing or off SDPA: {bad}")


def flex_case(run, dtype, heads, kv_heads, dim, q_len, write, kv_len=1024) -> float:
    device = run.device
    mask = PrefixMask(q_len, kv_len, device)
    options = flex_kernel_options(q_len, device.type)
    flex_attention = torch.nn.attention.flex_attention.flex_attention

    def attend(q, k, v, k_new, v_new, slots):
        if write:
            k.index_copy_(2, slots, k_new)
            v.index_copy_(2, slots, v_new)
        return flex_attention(q, k, v, block_mask=mask.block_mask, enable_gqa=True, kernel_options=options)

    if run.compile:
        attend = torch.compile(attend, dynamic=False, fullgraph=True)
    worst = 0.0
    for prefix in (0, 130, kv_len - q_len - 1):
        gen = torch.Generator().manual_seed(q_len + prefix)
        parents = (torch.rand(q_len - 1, generator=gen) * torch.arange(1, q_len)).long()  # row i under a row before
        anc = ancestor_matrix(parents).to(device)
        mask.set(prefix, anc)
        q = torch.randn(1, heads, q_len, dim, generator=gen).to(device, dtype)
        k, v = (torch.randn(1, kv_heads, kv_len, dim, generator=gen).to(device, dtype) for _ in range(2))
        k_new, v_new = (torch.randn(1, kv_heads, q_len, dim, generator=gen).to(device, dtype) for _ in range(2))
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


# -------------------------------------------------------------------------------------------------------- main


PARTS = {
    "hybrid-tiny": Part(hybrid_tiny, lambda r: dict(tiny=5 * r.graphs_per_engine()), (20, 30)),
    "pair-smoke": Part(pair_smoke, lambda r: dict(tiny=2 * r.graphs_per_engine()), (15, 20)),
    "ar-profile": Part(ar_profile, lambda r: dict(ar=1), (25, 10)),
    "round-profile": Part(round_profile, lambda r: dict(ar=2 * len(r.a.round_budgets), tiny=4 * len(
        r.a.round_budgets), round=len(r.a.round_budgets)), (20, 10)),
    "verify-curve": Part(verify_curve, lambda r: dict(ar=len(set(r.a.verify_budgets) - set(r.results.get(
        "verify", {})))), (10, 5)),
    "projection": Part(projection, projection_needs, (10, 5)),
    "hybrid-rule": Part(hybrid_rule, lambda r: {}, (30, 10)),
    "hybrid-slice": Part(hybrid_slice, lambda r: dict(ar=3), (30, 10)),
    "flex": Part(flex, lambda r: dict(tiny=len(SMALL_FLEX_CASES if r.a.small else FLEX_CASES)), (20, 20)),
}
ALL_PARTS = list(PARTS)
FIRST_PARTS = ["hybrid-tiny", "pair-smoke", "ar-profile", "round-profile", "verify-curve", "projection",
               "hybrid-rule", "hybrid-slice"]


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as the project's command lines do
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (cuda:N) or cpu")
    p.add_argument("--small", action="store_true", help="small shapes and every part: the script on a CPU")
    p.add_argument("--eager", action="store_true", help="compile nothing (the test suite's quick run)")
    p.add_argument("--parts", nargs="+", choices=ALL_PARTS, metavar="PART",
                   help=f"parts to run, in this order (default: {' '.join(FIRST_PARTS)}; with --small all)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds from the start: a part priced to end later is skipped (default 500; --small 1500)")
    p.add_argument("--part-seconds", type=float, default=None,
                   help="each part's alarm, seconds (default 300; --small 900)")
    p.add_argument("--round-budgets", type=int, nargs="+", default=[64])
    p.add_argument("--verify-budgets", type=int, nargs="+", default=[128, 512])
    p.add_argument("--repeats", type=int, default=None, help="per-call timings per measure (default 20; CPU 5)")
    p.add_argument("--json", default=None, help="where the JSON goes (rewritten after every part)")
    p.add_argument("--plant-failure", choices=ALL_PARTS, help=argparse.SUPPRESS)  # the report's own test
    a = p.parse_args(argv)
    a.parts = a.parts or (ALL_PARTS if a.small else FIRST_PARTS)
    a.deadline = a.deadline if a.deadline is not None else (1500.0 if a.small else 500.0)
    a.part_seconds = a.part_seconds if a.part_seconds is not None else (900.0 if a.small else 300.0)
    if len(set(a.parts)) != len(a.parts):
        p.error(f"--parts names a part twice: {' '.join(a.parts)}")
    if min(a.round_budgets + a.verify_budgets) < 1:
        p.error("budgets must be at least 1")
    if a.deadline <= 0 or a.part_seconds <= 0 or (a.repeats is not None and a.repeats < 1):
        p.error("--deadline and --part-seconds must be positive, --repeats at least 1")
    try:
        device = torch.device(a.device)
    except RuntimeError:
        p.error(f"--device {a.device!r} is not a device (cuda, cuda:N or cpu)")
    if device.type not in ("cuda", "cpu"):
        p.error(f"--device {a.device!r}: this check runs on cuda or cpu")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        p.error(f"--device {a.device!r}: no such CUDA device here (use --device cpu --small on a CPU)")
    if a.json and not os.access(os.path.dirname(os.path.abspath(a.json)) or ".", os.W_OK) and \
            os.path.exists(os.path.dirname(os.path.abspath(a.json))):
        p.error(f"--json {a.json!r}: its folder cannot be written")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    run = Run(a)
    run.say(f"versions: {run.out['versions']}; clocks: {run.out['clocks_at_start']}")
    run.save()
    with torch.inference_mode():
        for name in a.parts:
            run.run_part(name)
    run.out["clocks_at_end"] = clocks(run.device)
    run.out["not_ok"] = [k for k in a.parts if run.out["parts"][k]["status"] != "ok"]
    run.say(f"parts not ok: {run.out['not_ok'] or 'none'}")
    run.save()
    return 1 if run.out["not_ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
