"""Calls on a lent GPU: how fast is today's engine against its floor, and is it right there?

The device tool brings back only the files a command writes under $OUT and the tail of its output; pipefail keeps
gpu_check's exit status through tee (docs/benchmarks.md, "gpu_check"):

    set -o pipefail; PYTHONUNBUFFERED=1 python scripts/gpu_check.py --json $OUT/gpu_check.json 2>&1 |
        tee $OUT/gpu_check.log                                                  # the first call, timeout_s 510
    set -o pipefail; PYTHONUNBUFFERED=1 python scripts/gpu_check.py --second-call --json $OUT/gpu_check-2.json 2>&1 |
        tee $OUT/gpu_check-2.log                                                # the second call, timeout_s 280
    python scripts/gpu_check.py --plan [--second-call]                   # the call's parts priced; runs nothing
    python scripts/gpu_check.py --parts flex hybrid-slice --json out.json    # the named parts, in the order given
    python scripts/gpu_check.py --device cpu --small --json /tmp/x.json      # every part, small shapes: a smoke run

Parts (docs/benchmarks.md, "gpu_check", says what each measures):
  ar-profile     the Qwen3-8B-shaped AR step: pipelined and per call, its floor (with and without the embedding
                 table), the profiler's kernel table
  round-profile  a B = 64 round on 8B shapes, random drafter: each stage compiled alone, the round, the host read
  projection     the paper's acceptance (Qwen3-8B, MATH-500, T = 0) x AR step / round, over our AR and over
                 transformers' eager generate on the same weights: speedup, tokens/s
  pair-smoke     the bundled pair, compiled: ddtree B 16 and a batch that shrinks, token-equal to eager ar
  hybrid-tiny    a tiny float32 hybrid and drafter, compiled: ar, dflash, ddtree B 16 / 64 and B 64 with the
                 'series' tree solve, each token-equal to eager ar, over a prompt of two prefill chunks
  hybrid-rule    the 27B-shaped tree rule alone, R = 65 / 257 / 513, both solves, eager and in a CUDA graph
  verify-curve   the 8B target's verify forward at --verify-budgets
  hybrid-slice   4 layers of Qwen3.5-27B: AR step against its floor, verify at B 64 / 512, extra peak memory
  dflash2-profile  a DDTree round over a DFlash 2 drafter of Qwen3.8-27B-DFlash2's shapes on the 27B slice: stages
  prefill        prompts of 8K and 32K tokens through the compiled prefill on the 8B target and the 27B slice
  flex           compiled FlexAttention under the engine's masks against SDPA at G = 4, 6 (head 256) and 8
  gemma4-31b     12 layers of gemma-4-31B (10 sliding, 2 full of heads 512 whose values are their keys), random
                 bf16, with a drafter of z-lab's gemma-4-31B-it-DFlash shapes: AR step against its floor, a B = 64
                 round over it

Without --parts a device call answers the speed question: ar-profile, round-profile, projection (the first call);
then, only if they fit before the deadline, gemma4-31b, verify-curve, hybrid-slice, dflash2-profile, prefill and flex (not
requested, so their being skipped is no failure). --second-call runs the correctness smokes (pair-smoke,
hybrid-tiny: whether the engine is right on the device) and hybrid-rule (no compile: how the recurrent layers can
be captured). With --small every part runs and is requested.

Before a part starts it is priced from the seconds per compiled graph measured so far in this call, per kind of
graph: a model forward ("ar": an AR step, a verify, a draft), a whole round ("round"), a graph of the tiny models
or of a round's small stages ("tiny"); until a kind is measured a default from the lent GPUs' runs of record
stands in. A part priced to end past --deadline is skipped. Each part runs under its own alarm (--part-seconds,
never past the deadline). Each part records status (ok, error + traceback, timeout, skipped + why), seconds, peak
device memory, recompiles, graphs CUDA graphs refused and compile seconds; the JSON (versions, device, driver,
clocks) is rewritten after every part, so a run cut short keeps what it measured. The output ends with one line,
`summary: {...}`: every part's status and the figures that matter, rounded (a few thousand characters); on SIGTERM
(a time limit's) the running part ends as terminated, no other starts, and the summary is printed all the same. Exit
status: 0 when every requested part is ok (--plan: when every requested part fits), 1 when one errs, times out or
is skipped, 2 for bad arguments.
"""

import time

T0 = time.time()  # the deadline counts from the call's start, imports included

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
from benchlib import (build_drafter, build_target, copy_bandwidth, cpu_name, fill_random, keep,  # noqa: E402
                      kernel_table, materialize, per_call_ms, pipelined_ms, random_tokens, stepped_round, sync,
                      transformers_step_ms, transformers_twin, tree_verify, write_json)
import compiling  # noqa: E402
import ddtree  # noqa: E402
import gated_delta  # noqa: E402
import gemma4  # noqa: E402
from ddtree import Engine, Speculation, cache_length, generate, generate_batch, prefill_chunk  # noqa: E402
from dflash2 import DFlash2Drafter, Lattice  # noqa: E402
from draft_tree import ancestor_matrix  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from memory import memory_per_token  # noqa: E402
from model import Qwen3  # noqa: E402
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
# Qwen3.5-27B's text config as public material agrees on it: 64 layers, every 4th gated full attention (24 heads
# of 256, 4 KV heads, a quarter of each head roped), the others Gated DeltaNet (16 key and 48 value heads of 128).
QWEN3_5_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                   num_attention_heads=24, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7,
                   max_position_embeddings=262144, tie_word_embeddings=False, layer_types=hybrid_layer_types(64),
                   partial_rotary_factor=0.25, zero_centered_norm=True, attn_output_gate=True,
                   linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_num_key_heads=16, linear_num_value_heads=48)
HYBRID_SLICE = dict(QWEN3_5_27B, num_hidden_layers=4, layer_types=hybrid_layer_types(4))
SMALL_HYBRID = dict(HYBRID_SLICE, vocab_size=4096, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=4)
# A vocabulary of 8: a random drafter's trees (its laws nearly flat) then hold the target's choices a few levels
# deep, so commits of accepted paths through the recurrent layers are exercised.
TINY_HYBRID = dict(SMALL_HYBRID, vocab_size=8, hidden_size=128, intermediate_size=256, head_dim=32,
                   linear_key_head_dim=32, linear_value_head_dim=32)
# z-lab/Qwen3.8-27B-DFlash2's drafter as public material describes it: hidden 5120 (its target's), 32 query and 8 KV
# heads of 128, a block of 8, convolutions of 2 taps with a correction per 16 channels, a selector of rank 256 over
# 16 candidates, sliding layers of window 2048 that see the block both ways. Its layer count and MLP width are not
# in that material: 5 layers (z-lab's DFlash drafters of 8B targets) and the target's 17408 stand in, and the JSON
# names them as assumed. It reads four target layers, all a 4-layer slice has.
DFLASH2_27B = dict(block=8, layers=5, ids=[0, 1, 2, 3], conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                   selector_top_k=16, attention=((2048, False),) * 5,
                   model=dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=17408))
SMALL_DFLASH2 = dict(DFLASH2_27B, layers=2, attention=((64, False),) * 2, selector_rank=32, selector_top_k=8,
                     model=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768))
DFLASH2_ASSUMED = ["num_hidden_layers", "intermediate_size"]
# google/gemma-4-31B-it's text config (docs/checkpoints.md, "Gemma 4"): 60 layers, 5 sliding (window 1024, 16 K/V
# heads of 256) to 1 full (4 K/V heads of 512 whose values are its keys), tied embeddings of 262,144. A slice of 12
# layers keeps the pattern (10 sliding, 2 full) and fits any lent GPU beside the 8B pair.
GEMMA4_31B = dict(model_type="gemma4_text", vocab_size=262144, hidden_size=5376, intermediate_size=21504,
                  num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16, head_dim=256,
                  global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024,
                  final_logit_softcapping=30.0, max_position_embeddings=262144, tie_word_embeddings=True)
GEMMA4_SLICE = dict(GEMMA4_31B, num_hidden_layers=12)
SMALL_GEMMA4 = dict(GEMMA4_SLICE, vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                    num_global_key_value_heads=1, sliding_window=256)
# z-lab/gemma-4-31B-it-DFlash's config as public material quotes it: 5 Qwen3-style layers of 64 / 8 heads of 128, an
# MLP of 10752, RoPE theta 1e6, block 16, four causal sliding layers (window 2048) and a full one, softcap 30; it
# reads six target layers (1, 12, 23, 35, 46, 57 of 60; of the slice, six spread alike).
GEMMA4_DRAFTER = dict(block=16, layers=5, attention=((2048, True),) * 4 + ((None, False),), logit_softcap=30.0,
                      model=dict(num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=10752,
                                 rope_theta=1e6))
SMALL_GEMMA4_DRAFTER = dict(GEMMA4_DRAFTER, layers=2, attention=((64, True), (None, False)),
                            model=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768,
                                       rope_theta=1e6))
PREFILL_LENGTHS = (8192, 32768)  # --small: (1024, 2048)
CONTEXT = 512  # committed tokens before every timed step, round and verify

# DDTree paper (Ringel & Romano), Table 1: Qwen3-8B on MATH-500 at temperature 0, mean acceptance length tau (the
# bonus token included) and speedup over autoregressive decoding, for DDTree at its best budget (B = 512, Fig. 4)
# and for DFlash's chain (block 16). Fig. 3 plots the other budgets without printing their values.
PAPER = dict(budgets={512: dict(tau=10.73, speedup=7.52)}, chain=dict(tau=7.79, speedup=5.56))

# --------------------------------------------------------------------------------------------------- the run


class PartTimeout(BaseException):
    """A part's alarm: a BaseException, so that code catching Exception lets it through."""


# Seconds per compiled graph until a kind is measured in this call. On a GPU, from the H200 runs of record (torch
# 2.11, cold inductor cache, 16 cores as on the H100): an 8B-shaped forward ("ar": the AR step's first compiled
# calls took 28.6, 30.1, 30.3 and 35.3 s), a whole 8B round ("round": generate() at B = 64 took 132 s for its round,
# its prefill chunk and the run), a tiny model's or a round stage's graph ("tiny": the bundled pair's engines, two
# graphs each and an eager reference run, took 18-27 s). On a CPU, --small's shapes.
DEFAULT_PER_GRAPH = {"cuda": dict(ar=35.0, round=110.0, tiny=12.0), "cpu": dict(ar=15.0, round=40.0, tiny=20.0)}
STARTUP_S = {"cuda": 20.0, "cpu": 15.0}  # imports, versions and clocks before the first part: --plan's start


class Prices:
    """What a part costs before it runs: the graphs it compiles (fewer when the parts before it handed on what it
    needs) at the seconds per graph of their kind (measured in this call, or the defaults), and its other work."""

    def __init__(self, a, cuda: bool):
        self.a, self.cuda, self.compile = a, cuda, not a.eager
        self.per_graph = dict(DEFAULT_PER_GRAPH["cuda" if cuda else "cpu"])
        self.measured = {kind: [] for kind in self.per_graph}
        self.provided = dict(ar=False, rounds=set(), verify=set())  # what later parts can take from earlier ones

    def graphs_per_engine(self) -> int:
        """A new compiled engine's graphs: its round, and on a GPU its prefill chunk (eager on a CPU)."""
        return 2 if self.cuda else 1

    def graphs(self, name: str) -> dict:
        return PARTS[name][1](self) if self.compile else {}

    def price(self, name: str) -> float:
        work = PARTS[name][2][self.a.small or not self.cuda]
        return sum(n * self.per_graph[kind] for kind, n in self.graphs(name).items()) + work

    def compiled(self, kind: str, seconds: float, graphs: int = 1):
        """A compile measured in this call: the running seconds per graph of its kind."""
        self.measured[kind] += [seconds / graphs] * graphs
        self.per_graph[kind] = statistics.mean(self.measured[kind])


def parts_in_order(a) -> tuple:
    """(the requested parts, the parts run after them only if they fit before the deadline)."""
    requested = a.parts or (list(PARTS) if a.small else FIRST_PARTS)
    return requested, [p for p in IF_TIME_REMAINS if p not in requested and not a.parts and not a.small]


def plan(a) -> int:
    """--plan: the call's parts priced in order at the default seconds per graph, each assumed to hand on what it
    measures, against --deadline; nothing is built or run. Exit status 0 when every requested part fits."""
    prices = Prices(a, torch.device(a.device).type == "cuda")
    requested, optional = parts_in_order(a)
    end, late = STARTUP_S["cuda" if prices.cuda else "cpu"], []
    print(f"plan on {'a GPU' if prices.cuda else 'the CPU'} at {prices.per_graph} s per graph, --deadline "
          f"{a.deadline:.0f} s; start {end:.0f} s")
    for name in requested + optional:
        price, graphs = prices.price(name), prices.graphs(name)
        fits = end + price <= a.deadline
        if fits:
            end += price
            for key, value in PARTS[name][3](a).items():
                prices.provided[key] = value if key == "ar" else prices.provided[key] | set(value)
        elif name in requested:
            late.append(name)
        print(f"  {name:16s} {'' if name in requested else '(if time remains) '}{graphs} priced {price:4.0f} s: "
              + (f"ends at {end:4.0f} s" if fits else "past the deadline: skipped"))
    print(f"requested parts end at {end:.0f} s, {a.deadline - end:.0f} s before --deadline"
          if not late else f"requested parts past --deadline: {' '.join(late)}")
    return 1 if late else 0


class Run:
    """The call's settings, clock, JSON and prices, and what parts hand each other (models, bandwidth, the AR step,
    rounds, verifies)."""

    def __init__(self, a):
        self.a, self.device = a, torch.device(a.device)
        self.cuda, self.compile = self.device.type == "cuda", not a.eager
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.prices = Prices(a, self.cuda)
        self.models, self.results, self.part, self.terminated, self.in_part = {}, {}, None, None, False
        self.repeats = a.repeats or (20 if self.cuda else 5)
        self.back_to_back = 100 if self.cuda else 10
        self.out = dict(command="python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
                        started=time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(T0)),
                        settings={k: v for k, v in vars(a).items() if k != "plant_failure"},
                        versions=versions(self.device), clocks_at_start=clocks(self.device), parts={})

    def elapsed(self) -> float:
        return time.time() - T0

    def say(self, text: str):
        print(f"[{self.elapsed():5.0f} s] {text}", flush=True)

    def save(self):
        self.out.update(seconds=self.elapsed(), per_graph_s=self.prices.per_graph,
                        graphs_measured={k: len(v) for k, v in self.prices.measured.items()})
        if self.a.json:
            write_json(self.a.json, self.out)

    def graphs_per_engine(self) -> int:
        return self.prices.graphs_per_engine()

    def compiled(self, kind: str, seconds: float, graphs: int = 1):
        """A compile measured in this call: its kind's running seconds per graph, the part's compile seconds."""
        self.prices.compiled(kind, seconds, graphs)
        self.part["compile_s"] += seconds

    def run_part(self, name: str, requested: bool = True):
        fn = PARTS[name][0]
        self.prices.provided = dict(ar="ar" in self.results, rounds=set(self.results.get("rounds", {})),
                                    verify=set(self.results.get("verify", {})))
        graphs, price = self.prices.graphs(name), self.prices.price(name)
        left = self.a.deadline - self.elapsed()
        rec = self.out["parts"][name] = dict(requested=requested, price_s=round(price, 1), graphs=graphs)
        if price > left:
            rec.update(status="skipped", why=f"priced at {price:.0f} s ({graphs} at {self.prices.per_graph} s per "
                                             f"graph, and the rest), {left:.0f} s left before --deadline")
            self.say(f"{name}: skipped ({rec['why']})")
            return self.save()
        self.say(f"{name}: starts (priced at {price:.0f} s, {left:.0f} s left)")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        t, recompiles, skips = time.time(), sum(counters["recompiles"].values()), counters["inductor"][
            "cudagraph_skips"]
        rec.update(compile_s=0.0, result={})
        self.part, rang = rec, []

        def alarm(signum, frame):
            rang.append(time.time())
            raise PartTimeout("the part's alarm rang (--part-seconds or --deadline)")

        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, max(0.01, min(self.a.part_seconds, left)))
        try:
            try:
                self.in_part = True
                if self.terminated is not None:  # SIGTERM came as the part was starting
                    raise PartTimeout("terminated (SIGTERM)")
                if name == self.a.plant_failure:
                    raise RuntimeError(f"planted failure in {name} (--plant-failure)")
                fn(self, rec["result"])
            finally:
                self.in_part = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            rec["status"] = "ok"
        except (PartTimeout, Exception):  # noqa: BLE001 (a part's failure is a finding; the next part runs)
            # dynamo and inductor may wrap the alarm's exception in their own: the alarm's record decides
            status = "timeout" if rang else "terminated" if self.terminated is not None else "error"
            rec.update(status=status, traceback=traceback.format_exc()[-6000:])
            if status != "error":
                rec["why"] = f"stopped after {(rang[0] if rang else self.terminated) - t:.0f} s" + (
                    " by SIGTERM" if status == "terminated" else "")
        # cudagraph_skips: graphs that CUDA graph trees refused and ran uncaptured (the log says why)
        rec.update(seconds=time.time() - t, recompiles=sum(counters["recompiles"].values()) - recompiles,
                   cudagraph_skips=counters["inductor"]["cudagraph_skips"] - skips,
                   peak_gb=torch.cuda.max_memory_allocated(self.device) / 1e9 if self.cuda else None)
        self.say(f"{name}: {rec['status']} in {rec['seconds']:.0f} s (compiling {rec['compile_s']:.0f} s)"
                 + (f"\n{rec['traceback']}" if "traceback" in rec else ""))
        self.forget()
        self.save()

    def terminate(self, signum, frame):
        """SIGTERM (a command's time limit, say): the part running ends as `terminated`, no other part starts, and
        the call ends with its summary, so that the output's tail still holds what was measured."""
        self.terminated = time.time()
        if self.in_part:
            raise PartTimeout("terminated (SIGTERM)")

    def forget(self):
        """Engines and compiled graphs go after every part (one cut short leaves them half made; CUDA graph pools
        hold device memory); built models stay for the parts after."""
        ddtree._ENGINES.clear()
        torch._dynamo.reset()
        gated_delta.TREE_SOLVE = "triangular"
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def pair8b(self):
        """The Qwen3-8B-shaped target and a 5-layer block-16 drafter (--small: small shapes), built once."""
        if "8b" not in self.models:
            target = build_target(SMALL if self.a.small else QWEN3_8B, self.device, self.dtype)
            self.models["8b"] = (target, build_drafter(target, block=16, layers=2 if self.a.small else 5))
        return self.models["8b"]

    def slice27b(self):
        """Four layers of Qwen3.5-27B (--small: of the small hybrid) in the run's dtype, built once."""
        if "27b-slice" not in self.models:
            self.models["27b-slice"] = build_target(SMALL_HYBRID if self.a.small else HYBRID_SLICE, self.device,
                                                    self.dtype)
        return self.models["27b-slice"]

    def bandwidth(self) -> float:
        if "bandwidth" not in self.results:
            self.results["bandwidth"] = copy_bandwidth(self.device, 0.25 if self.a.small else 2.0)
        return self.results["bandwidth"]

    def first_calls(self, kind: str, fn):
        """fn()'s first calls, which compile it (and under CUDA graphs record it): a measured compile of `kind`.
        Returns the last call's output, cloned."""
        t = time.perf_counter()
        for _ in range(compiling.graph_warmup_calls(self.compile, self.device.type)):
            out = keep(fn())
        sync(self.device)
        if self.compile:
            self.compiled(kind, time.perf_counter() - t)
        return out

    def stage(self, fn):
        """fn compiled as the engine compiles its steps (fullgraph, fixed shapes, CUDA graphs on a GPU), each call a
        new CUDA graph step, so that stages replay independently of each other."""
        if not self.compile:
            return fn
        compiled = torch.compile(fn, dynamic=False, fullgraph=True, mode="reduce-overhead" if self.cuda else None)
        if not self.cuda:
            return compiled
        return lambda *args: (torch.compiler.cudagraph_mark_step_begin(), compiled(*args))[1]


@contextlib.contextmanager
def stage_generations():
    """Where Run.stage's calls mark their CUDA graph steps: on leaving, CUDA graph trees tell generations apart as
    before. Once a step is marked by hand, the trees count generations by hand-marked steps alone for every later
    compiled call of the process (an engine's round then runs as it never does for a user)."""
    from torch._inductor import cudagraph_trees
    before = cudagraph_trees.MarkStepBox.mark_step_counter
    try:
        yield
    finally:
        cudagraph_trees.MarkStepBox.mark_step_counter = before


def nvidia_smi(fields: str):
    """The first GPU's answer to nvidia-smi --query-gpu=fields, or None where nvidia-smi cannot answer."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip().splitlines()[0]
    return None


def versions(device) -> dict:
    v = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda, triton=None,
             device_name=cpu_name(), capability=None, driver=None)
    with contextlib.suppress(ImportError):
        import triton
        v["triton"] = triton.__version__
    if device.type == "cuda":
        v.update(device_name=torch.cuda.get_device_name(device), driver=nvidia_smi("driver_version"),
                 capability=list(torch.cuda.get_device_capability(device)))
    return v


CLOCKS = "clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu"


def clocks(device):
    """The GPU's clocks, power and temperature now (a throttled device explains a slow figure), or None."""
    line = nvidia_smi(CLOCKS) if device.type == "cuda" else None
    return None if line is None else dict(zip(CLOCKS.split(","), (x.strip() for x in line.split(","))))


# ------------------------------------------------------------------------------------------- correctness parts


def token_case(run, name: str, result, ref: list, out: dict):
    """A compiled run against eager AR's tokens, recorded under out[name]; its warm-up is a measured compile."""
    diff = next((i for i, (x, y) in enumerate(zip(result.tokens, ref)) if x != y), None)
    out[name] = dict(equal_to_eager_ar=result.tokens == ref, first_diff=diff, tau=result.stats["tau"],
                     compile_s=result.stats["compile_seconds"])
    if run.compile:
        run.compiled("tiny", result.stats["compile_seconds"], run.graphs_per_engine())
    run.say(f"  {name}: equal to eager ar {result.tokens == ref} (first difference {diff}), tau "
            f"{result.stats['tau']:.2f}, compiling {result.stats['compile_seconds']:.1f} s")


def require_equal(out: dict):
    wrong = [k for k, v in out.items() if isinstance(v, dict) and v.get("equal_to_eager_ar") is False]
    if wrong:
        raise AssertionError(f"unequal to eager ar: {wrong}")


def hybrid_tiny(run, out):
    target = build_target(TINY_HYBRID, run.device, torch.float32, std=0.2)  # peaked laws: no near ties
    drafter = build_drafter(target, block=8, layers=2)
    prompt = random_tokens(prefill_chunk(run.device.type) + 37, TINY_HYBRID["vocab_size"])  # two prefill chunks
    ref = generate(target, None, prompt, method="ar", max_new_tokens=48, stop_ids=[]).tokens
    for method, budget, solve in [("ar", None, "triangular"), ("dflash", None, "triangular"),
                                  ("ddtree", 16, "triangular"), ("ddtree", 64, "triangular"),
                                  ("ddtree", 64, "series")]:
        # gated_delta.TREE_SOLVE is read while tracing: the 'series' case compiles afresh (and forget() resets it)
        if solve != gated_delta.TREE_SOLVE:
            run.forget()
            gated_delta.TREE_SOLVE = solve
        res = generate(target, drafter if method != "ar" else None, prompt, method=method, budget=budget,
                       max_new_tokens=48, compile=run.compile, stop_ids=[])
        token_case(run, "-".join([method] + [f"B{budget}"] * bool(budget) + [solve] * (solve != "triangular")),
                   res, ref, out)
    out["prompt_tokens"] = len(prompt)
    require_equal(out)


def pair_smoke(run, out):
    target = Qwen3.from_pretrained(ddtree.DEFAULT_TARGET, device=run.device, dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(ddtree.DEFAULT_DRAFT, device=run.device, dtype=torch.float32)
    drafter.bind(target)
    prompt = list(range(5, 45))
    ref = generate(target, None, prompt, method="ar", max_new_tokens=96, stop_ids=[]).tokens
    res = generate(target, drafter, prompt, budget=16, max_new_tokens=96, compile=run.compile, stop_ids=[])
    token_case(run, "ddtree-B16", res, ref, out)
    if run.cuda and run.compile:  # that every round replays a graph: the profiler counts the launches
        table = kernel_table(lambda: generate(target, drafter, prompt, budget=16, max_new_tokens=32,
                                              compile=True, stop_ids=[]), run.device, 1)
        out["ddtree-B16"]["graph_launches_in_32_tokens"] = table["graph_launches_per_step"]
    # Two requests in one batch under a stop token that ends them at different rounds, so that the batch moves
    # to a smaller engine: each request's tokens against its own eager AR run.
    prompts = [prompt, list(range(12, 48))]
    stop = [ref[12]]  # a token request 0 emits: it stops early, the other later or never
    refs = [generate(target, None, p, method="ar", max_new_tokens=48, stop_ids=stop).tokens for p in prompts]
    t = time.perf_counter()
    batch = generate_batch(target, drafter, prompts, budget=16, max_new_tokens=48, stop_ids=stop,
                           compile=run.compile, max_batch=2)
    if run.compile:
        run.compiled("tiny", time.perf_counter() - t, run.graphs_per_engine())
    out["batch-shrinking"] = dict(equal_to_eager_ar=[r.tokens for r in batch] == refs, lengths=list(map(len, refs)))
    run.say(f"  batch-shrinking: {out['batch-shrinking']}")
    if len(set(map(len, refs))) < 2:
        raise AssertionError(f"the requests end together ({refs}): the batch never shrinks")
    require_equal(out)


# ------------------------------------------------------------------------------------------------- speed parts


def step_bytes(target: Qwen3, context: int) -> dict:
    """The bytes a decode step reads: every weight but the embedding table, of which it reads a row (a tied table
    is read whole as the lm_head); the K/V of `context` slots; recurrent states, read and written back. Also the
    total with the whole table counted (`total_with_table`), as the H200 runs of record counted it."""
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    table = target.embed_tokens.weight
    table_bytes = 0 if target.config.tie_word_embeddings else table.numel() * table.element_size()
    weights += table.shape[1] * table.element_size() - table_bytes
    kv = sum(c.shape[1] * context * c.shape[3] * c.element_size() for c in target.kv_caches())
    states = 2 * sum(s[:1].numel() * s.element_size()
                     for s in (target.state_tensors() if getattr(target, "recurrent", False) else ()))
    total = weights + kv + states
    return dict(weights=weights, kv=kv, states=states, total=total,
                total_with_table=total + table_bytes - table.shape[1] * table.element_size() * bool(table_bytes))


def ar_step(run, target: Qwen3, profile: bool) -> dict:
    """The AR step after CONTEXT tokens as the engine runs it (Engine.round of a compiled ar engine: CUDA graphs
    on a GPU), pipelined and per call, against the floor of the bytes it reads; with `profile` the kernel table."""
    spec = Speculation()
    engine = Engine(target, None, "ar", Sampling(), spec, cache_length(CONTEXT, 64, "ar", spec, None),
                    compile=run.compile)
    engine.prefill_step = Engine.prefill_step.__get__(engine)  # the prefill only fills the cache: eager, no graph
    engine.start([random_tokens(CONTEXT, target.config.vocab_size)], [0])
    step = stepped_round(engine, engine.requests.token, engine.requests.position, None)
    run.first_calls("ar", step)
    read = step_bytes(target, CONTEXT)
    floor, with_table = (read[k] / run.bandwidth() * 1e3 for k in ("total", "total_with_table"))
    rec = dict(pipelined_ms=pipelined_ms(step, run.device, run.back_to_back), floor_ms=floor,
               floor_with_table_ms=with_table, per_call_ms=per_call_ms(step, run.device, run.repeats),
               copy_bandwidth_gbs=run.bandwidth() / 1e9, bytes_gb={k: v / 1e9 for k, v in read.items()})
    rec["pipelined_over_floor"] = rec["pipelined_ms"] / floor
    rec["pipelined_over_floor_with_table"] = rec["pipelined_ms"] / with_table
    run.say(f"  AR step: pipelined {rec['pipelined_ms']:.3f} ms, per call {rec['per_call_ms']:.3f} ms; floor "
            f"{floor:.3f} ms ({read['total'] / 1e9:.2f} GB at {run.bandwidth() / 1e9:.0f} GB/s): "
            f"{rec['pipelined_over_floor']:.2f}x; with the whole embedding table {with_table:.3f} ms: "
            f"{rec['pipelined_over_floor_with_table']:.2f}x")
    if profile:
        rec["profile"] = table = kernel_table(step, run.device, 20)
        run.say(f"  {table['of']} per step {table['per_step']:.0f}, summed {table['us_per_step']:.0f} us against "
                f"{rec['pipelined_ms'] * 1e3:.0f} us of wall time; top: "
                + "; ".join(f"{t['name'][:60]} {t['us_per_step']:.0f} us" for t in table["top"][:5]))
    return rec


def ar_profile(run, out):
    out.update(ar_step(run, run.pair8b()[0], profile=True))
    run.results["ar"] = out


def stage_split(engine, drafter, bonus, start, measure):
    """The round's five stages, each through measure(name, kind of graph, fn, *args) in the round's order, each
    taking the outputs of the stages before it."""
    if isinstance(drafter, DFlash2Drafter):  # a Lattice crosses the stages' edges as its two tensors
        def draft(b, s):
            lattice = engine.draft(b, s)
            return lattice.tokens, lattice.scores

        lattice = measure("draft", "ar", draft, bonus, start)
        tokens, parents, depths = measure("tree", "tiny", lambda t, s: engine.propose(Lattice(t, s), None)[:3],
                                          *lattice)
    else:
        logits_q = measure("draft", "ar", engine.draft, bonus, start)
        tokens, parents, depths = measure("tree", "tiny", lambda lq: engine.propose(lq, None)[:3], logits_q)
    rows, positions, logits, features, recurrent = measure("verify", "ar", engine.verify, bonus, tokens, parents,
                                                           depths, start)
    path, length, _, _ = measure("accept", "tiny", lambda lg, t, p: engine.accept(lg, t, p, None, None, None),
                                 logits, tokens, parents)
    measure("commit", "tiny", lambda s, p, ln, pos, f: (engine.commit(s, p, ln, pos, f, recurrent), ln)[1],
            start, path, length, positions, features)


def round_stages(run, target, drafter, budget: int, ar: dict | None = None) -> dict:
    """A DDTree round at `budget` after CONTEXT tokens: each stage compiled alone as the engine compiles its round
    and timed pipelined; the whole round (Engine.round) pipelined and per call; Engine.step, whose excess over
    the round is its one host read and bookkeeping; the round over `ar` (that target's AR step) when given. A DFlash
    2 drafter's draft stage is its block and selector, its tree stage the lattice's best tree."""
    spec = Speculation(budget=budget)
    engine = Engine(target, drafter, "ddtree", Sampling(), spec,
                    cache_length(CONTEXT, 16 * (run.repeats + 8), "ddtree", spec, drafter), compile=run.compile)
    engine.prefill_step = Engine.prefill_step.__get__(engine)
    engine.start([random_tokens(CONTEXT, target.config.vocab_size)], [0])
    bonus, start, ms = engine.requests.token, engine.requests.position, {}

    def measure(name, kind, fn, *args):
        f = run.stage(fn)
        out = run.first_calls(kind, lambda: f(*args))
        ms[name] = pipelined_ms(lambda: f(*args), run.device, run.back_to_back)
        return out

    with stage_generations():
        stage_split(engine, drafter, bonus, start, measure)
    whole = stepped_round(engine, bonus, start, None, None, None)
    run.first_calls("round", whole)
    rec = dict(stages_ms=ms, stages_sum_ms=sum(ms.values()), round_ms=pipelined_ms(whole, run.device,
                                                                                  run.back_to_back),
               round_per_call_ms=per_call_ms(whole, run.device, run.repeats),
               step_ms=per_call_ms(engine.step, run.device, run.repeats))
    rec["host_ms"] = rec["step_ms"] - rec["round_per_call_ms"]
    if ar is not None:
        rec["round_over_ar"] = rec["round_ms"] / ar["pipelined_ms"]
    run.say(f"  B={budget}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items())
            + f" ms (sum {rec['stages_sum_ms']:.3f}); whole round {rec['round_ms']:.3f} ms pipelined, "
            f"{rec['round_per_call_ms']:.3f} per call; step {rec['step_ms']:.3f} (host {rec['host_ms']:.3f})"
            + (f"; {rec['round_over_ar']:.2f}x the AR step" if "round_over_ar" in rec else ""))
    return rec


def round_profile(run, out):
    for budget in run.a.round_budgets:
        out[budget] = run.results.setdefault("rounds", {})[budget] = round_stages(run, *run.pair8b(), budget,
                                                                                  run.results.get("ar"))


def verify_time(run, target, budget: int, feature_layers=()) -> dict:
    """The target's verify forward of budget + 1 rows (a random tree after CONTEXT slots, compiled as the engine
    compiles it: benchlib.tree_verify; greedy: the argmax pair, not float32 logits), pipelined and per call."""
    fn = tree_verify(target, budget, run.compile, prompt_len=CONTEXT, feature_layers=feature_layers, argmax=True)
    run.first_calls("ar", fn)
    return dict(ms=pipelined_ms(fn, run.device, run.back_to_back),
                per_call_ms=per_call_ms(fn, run.device, run.repeats))


def verify_8b(run, budget: int) -> float:
    """Verify milliseconds at `budget` on the 8B pair (the drafter's features included, as in the round), measured
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


def projection_graphs(p: Prices) -> dict:
    """What projection compiles: what the parts before it in this call left unmeasured, and per paper row not run
    whole its budget's middle stages (middle_ms)."""
    rounds = p.provided["rounds"]
    graphs = dict(ar=0 if p.provided["ar"] else 1, tiny=0 if rounds else 3, round=0 if rounds else 1)
    graphs["ar"] += (0 if rounds else 2) + 1 + len(set(PAPER["budgets"]) - (rounds or {64}))
    return graphs


def middle_ms(run, target, drafter, method: str, budget: int | None) -> float:
    """Milliseconds of a greedy round's stages that depend on its budget (the tree, the verify, the accept) at
    `budget` (method dflash: the drafter's argmax chain and its verify of a block's rows), compiled together as one
    stage graph after one drafter pass and timed pipelined: what the round at that budget spends beyond the draft
    and the commit, which every budget shares."""
    spec = Speculation(budget=budget) if method == "ddtree" else Speculation()
    engine = Engine(target, drafter, method, Sampling(), spec, cache_length(CONTEXT, 64, method, spec, drafter),
                    compile=run.compile)
    engine.prefill_step = Engine.prefill_step.__get__(engine)
    engine.start([random_tokens(CONTEXT, target.config.vocab_size)], [0])
    bonus, start = engine.requests.token, engine.requests.position
    draft = keep(engine.draft(bonus, start))

    def middle(draft_logits):
        tokens, parents, depths, q = engine.propose(draft_logits, None)
        rows, positions, logits, features, recurrent = engine.verify(bonus, tokens, parents, depths, start)
        path, length, next_token, ok = engine.accept(logits, tokens, parents, q, None, None)
        return path, length, next_token, features  # what the commit reads: nothing of the forward is left out

    with stage_generations():
        f = run.stage(middle)
        run.first_calls("ar", lambda: f(draft))
        return pipelined_ms(lambda: f(draft), run.device, run.back_to_back)


def transformers_ar(run, target) -> dict:
    """transformers' eager greedy `generate` on the target's own weights after CONTEXT tokens: its milliseconds per
    decoded token (benchlib.transformers_step_ms), the baseline the paper's speedups are over; or why not."""
    try:
        import transformers
    except ImportError as e:
        return dict(error=f"transformers is not installed here ({e}): no projection over its AR")
    hf = transformers_twin(target)
    rec = transformers_step_ms(hf, random_tokens(CONTEXT, target.config.vocab_size), 32 if run.cuda else 8,
                               2 if run.cuda else 1)
    rec["transformers"] = transformers.__version__
    run.say(f"  transformers {rec['transformers']} eager generate ({rec['attention']}): {rec['step_ms']:.3f} ms per "
            f"token after {CONTEXT} tokens")
    return rec


def projection(run, out):
    """tau x (AR step / round) per budget: the speedup over our own AR were our drafter to accept as the paper's,
    and tau x (transformers' eager AR step / round), the paper's own baseline, on the same weights. A round not run
    whole at a budget is the measured B = 64 round (round-profile's) with its budget's stages swapped: less its
    tree, verify and accept stages, plus those of the row's budget compiled together (middle_ms; the chain: the
    drafter's argmax chain, the verify of a block's rows, its accept)."""
    target, drafter = run.pair8b()
    if "ar" not in run.results:
        run.results["ar"] = ar_step(run, target, profile=False)
    if not run.results.get("rounds"):
        run.results["rounds"] = {64: round_stages(run, target, drafter, 64, run.results["ar"])}
    ar, base = run.results["ar"]["pipelined_ms"], min(run.results["rounds"])
    r0 = run.results["rounds"][base]
    stages = r0["stages_ms"]
    rest = r0["round_ms"] - stages["tree"] - stages["verify"] - stages["accept"]
    if rest <= 0:  # a noisy machine measured the whole round under its middle stages: the others' sum instead
        rest = stages["draft"] + stages["commit"]
    rows = {}
    for b, paper in PAPER["budgets"].items():
        if b in run.results["rounds"]:
            rows[f"ddtree-B{b}"] = dict(paper, round_ms=run.results["rounds"][b]["round_ms"], source="measured whole")
        else:
            rows[f"ddtree-B{b}"] = dict(paper, round_ms=rest + middle_ms(run, target, drafter, "ddtree", b),
                                        source=f"round at B={base}, its tree, verify and accept at B={b}")
    rows["dflash-chain"] = dict(PAPER["chain"], round_ms=rest + middle_ms(run, target, drafter, "dflash", None),
                                source=f"round at B={base}, the chain's drafts, verify and accept in place of its "
                                       f"tree, verify and accept")
    out["transformers"] = hf = transformers_ar(run, target)
    for key, r in rows.items():
        r.update(projected_speedup=r["tau"] * ar / r["round_ms"], tokens_per_s=r["tau"] * 1e3 / r["round_ms"])
        if "step_ms" in hf:
            r["over_transformers"] = r["tau"] * hf["step_ms"] / r["round_ms"]
        run.say(f"  {key}: tau {r['tau']} x AR {ar:.3f} ms / round {r['round_ms']:.3f} ms = "
                f"{r['projected_speedup']:.2f}x over our AR"
                + (f", {r['over_transformers']:.2f}x over transformers' AR" if "over_transformers" in r else "")
                + f" ({r['tokens_per_s']:.0f} tokens/s); the paper's {r['speedup']}x over its AR [{r['source']}]")
    out.update(ar_ms=ar, ar_tokens_per_s=1e3 / ar, rest_ms=rest, rows=rows,
               paper="DDTree paper (Ringel & Romano), Table 1 and Fig. 4: Qwen3-8B, MATH-500, T = 0")
    if "step_ms" in hf:
        out["ar_over_transformers"] = hf["step_ms"] / ar


# ------------------------------------------------------------------------------------------------ hybrid parts


def bounded_tree(budget: int, max_depth: int, seed: int = 0) -> torch.Tensor:
    """parents [B]: node i hangs under a random earlier row less than max_depth deep, so that the tree is at most
    max_depth deep, as a round's tree is at most L deep."""
    g = torch.Generator().manual_seed(seed)
    depths, parents = [0], []
    for _ in range(budget):
        allowed = [r for r, d in enumerate(depths) if d < max_depth]
        parents.append(allowed[int(torch.randint(0, len(allowed), (1,), generator=g))])
        depths.append(depths[parents[-1]] + 1)
    return torch.tensor(parents)


def captured(fn, device):
    """(fn's CUDA graph's replay, None) after warm-up calls on a side stream, or (None, the capture's error)."""
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
    """gated_delta.tree_gated_delta at Qwen3.5-27B's recurrent shapes (q and k of 16 key heads, v of 48 value heads,
    all of 128, as the layer hands them over; float32), trees of R rows at most 15 deep (the drafter's positions),
    per layer and for the 48 layers."""
    hk, hv, dim, layers = (2, 4, 32, 48) if run.a.small else (16, 48, 128, 48)
    gen = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen).to(run.device)  # noqa: E731
    for rows in (65, 257, 513):
        anc = ancestor_matrix(bounded_tree(rows - 1, 15)[None], 15, dtype=torch.uint8).to(run.device)
        q, k = (gated_delta.l2norm(rand(1, rows, hk, dim)) for _ in range(2))
        v, g, beta = rand(1, rows, hv, dim), -rand(1, rows, hv).abs(), rand(1, rows, hv).sigmoid()
        state = 0.1 * rand(1, hv, dim, dim)
        for solve in ("triangular", "series"):
            gated_delta.TREE_SOLVE = solve  # read at each eager call
            try:
                rule = lambda: gated_delta.tree_gated_delta(q, k, v, g, beta, state, anc, 15)  # noqa: E731
                for _ in range(2):  # warm-up: the first calls load kernels and grow the allocator's pool
                    rule()
                rec = dict(eager_ms=pipelined_ms(rule, run.device, run.repeats))
                if run.cuda:
                    replay, error = captured(rule, run.device)
                    rec.update(captured=error is None, capture_error=error)
                    if replay is not None:
                        rec["graph_ms"] = pipelined_ms(replay, run.device, run.back_to_back)
            finally:
                gated_delta.TREE_SOLVE = "triangular"
            rec[f"{layers}_layers_ms"] = rec.get("graph_ms", rec["eager_ms"]) * layers
            out[f"R{rows}-{solve}"] = rec
            run.say(f"  R={rows} {solve}: {rec}")
        if run.cuda:
            out.setdefault("solve_in_a_graph", {})[f"R{rows}"] = capturable_solve(out, rows)


def capturable_solve(out: dict, rows: int) -> str:
    """The solve a round of R rows can take inside a CUDA graph: triangular (gated_delta's default) when it was
    captured, else the series solve when that was (the fallback: gated_delta.TREE_SOLVE = "series"), else none
    (the recurrent layers' tree rule would leave the graph)."""
    for solve in ("triangular", "series"):
        if out[f"R{rows}-{solve}"]["captured"]:
            return solve if solve == "triangular" else "series (fallback: the triangular solve is not capturable)"
    return "none: neither solve is capturable"


def hybrid_slice(run, out):
    """Four layers of Qwen3.5-27B (--small: of the small hybrid) in bf16, the 8B pair freed first."""
    run.models.clear()
    run.forget()
    target = run.slice27b()
    out["weights_gb"] = sum(p.numel() * p.element_size() for p in target.parameters()) / 1e9
    out["ar"] = run.results["ar-27b-slice"] = ar_step(run, target, profile=False)
    for budget in (64, 512):
        base = torch.cuda.memory_allocated(run.device) if run.cuda else 0
        if run.cuda:
            torch.cuda.reset_peak_memory_stats(run.device)
        out[f"verify_B{budget}"] = rec = verify_time(run, target, budget)
        rec["extra_peak_gb"] = (torch.cuda.max_memory_allocated(run.device) - base) / 1e9 if run.cuda else None
        run.say(f"  verify B={budget}: {rec['ms']:.3f} ms ({rec['ms'] / out['ar']['pipelined_ms']:.1f}x the AR "
                f"step), extra peak {rec['extra_peak_gb']} GB")


def build_gemma4(shape: dict, device, dtype, seed: int = 0, std: float = 0.02) -> gemma4.Gemma4:
    """A random Gemma 4 target of the config.json fields `shape` in `dtype` on the device (norms 1, layer scalars
    1, the head tied to the embeddings as the 31B's)."""
    config = gemma4.gemma4_config(shape, "gpu_check")
    target = materialize(lambda: gemma4.Gemma4(config), device, dtype)
    if config.tie_word_embeddings:  # to_empty gives each module a tensor of its own
        target.lm_head.weight = target.embed_tokens.weight
    fill_random(target, seed, std, False)
    with torch.no_grad():
        for layer in target.layers:
            layer.layer_scalar.fill_(1.0)
    target.inv_freq = gemma4.inv_freqs(config, device)
    return target.eval()


def gemma4_round(run, target, drafter, budget: int, ar: dict) -> dict:
    """A DDTree round at `budget` after CONTEXT tokens, compiled whole as the engine compiles it (Engine.round):
    pipelined and per call, over the target's AR step `ar`."""
    spec = Speculation(budget=budget)
    engine = Engine(target, drafter, "ddtree", Sampling(), spec, cache_length(CONTEXT, 64, "ddtree", spec, drafter),
                    compile=run.compile)
    engine.prefill_step = Engine.prefill_step.__get__(engine)  # the prefill only fills the caches: eager
    engine.start([random_tokens(CONTEXT, target.config.vocab_size)], [0])
    whole = stepped_round(engine, engine.requests.token, engine.requests.position, None, None, None)
    run.first_calls("round", whole)
    rec = dict(round_ms=pipelined_ms(whole, run.device, run.back_to_back),
               round_per_call_ms=per_call_ms(whole, run.device, run.repeats))
    rec["round_over_ar"] = rec["round_ms"] / ar["pipelined_ms"]
    run.say(f"  B={budget}: round {rec['round_ms']:.3f} ms pipelined, {rec['round_per_call_ms']:.3f} per call; "
            f"{rec['round_over_ar']:.2f}x the AR step")
    return rec


def gemma4_31b(run, out):
    """12 layers of gemma-4-31B (--small: small Gemma 4 shapes) in the run's dtype, the models of earlier parts
    freed first: the AR step against its floor, and a B = 64 round (--round-budgets) with a random drafter of
    z-lab's gemma-4-31B-it-DFlash shapes (nothing is accepted: cost, not tau)."""
    run.models.clear()
    run.forget()
    shape, d = (SMALL_GEMMA4, SMALL_GEMMA4_DRAFTER) if run.a.small else (GEMMA4_SLICE, GEMMA4_DRAFTER)
    target = build_gemma4(shape, run.device, run.dtype)
    layers = shape["num_hidden_layers"]
    ids = [round(i * (layers - 1) / 5) for i in range(6)]  # six taps spread over the layers, as the drafter's
    drafter = build_drafter(target, block=d["block"], layers=d["layers"], ids=ids, model=d["model"],
                            attention=d["attention"], logit_softcap=d["logit_softcap"])
    out["layers"], out["drafter_target_layer_ids"] = layers, ids
    out["weights_gb"] = sum(p.numel() * p.element_size() for p in target.parameters()) / 1e9
    out["kv_bytes_per_token"] = memory_per_token(target)["target_kv"]
    out["ar"] = ar = ar_step(run, target, profile=False)
    for budget in run.a.round_budgets:
        out[budget] = gemma4_round(run, target, drafter, budget, ar)


def dflash2_profile(run, out):
    """A DDTree round (round_stages, at --round-budgets) over a random DFlash 2 drafter of Qwen3.8-27B-DFlash2's
    shapes (--small: small ones) on the 27B slice: the draft (block, convolutions, selector) and tree (the lattice's
    best tree) stages at the drafter's full size, the verify of four target layers of 64; the round over the
    slice's AR step when hybrid-slice measured it in this call."""
    shape = SMALL_DFLASH2 if run.a.small else DFLASH2_27B
    target = run.slice27b()
    drafter = build_drafter(target, **shape)
    c = drafter.config  # what was built, as built
    out["drafter"] = dict(layers=c.model.num_hidden_layers, heads=[c.model.num_attention_heads,
                                                                   c.model.num_key_value_heads, c.model.head_dim],
                          intermediate_size=c.model.intermediate_size, block=c.block_size,
                          conv=[c.conv_kernel_size, c.conv_group_size], selector_rank=c.selector_rank,
                          selector_top_k=c.selector_top_k, attention=list(map(list, c.attention)),
                          assumed=DFLASH2_ASSUMED,
                          weights_gb=sum(p.numel() * p.element_size() for p in drafter.parameters()) / 1e9)
    for budget in run.a.round_budgets:
        out[budget] = round_stages(run, target, drafter, budget, run.results.get("ar-27b-slice"))


def prefill(run, out):
    """Prompts of 8K and 32K tokens (--small: 1K and 2K) prefilled by an ar engine as a request's start does (in
    fixed chunks through the one compiled chunk graph on a GPU; eager on a CPU), on the 8B target and on the 27B
    slice: seconds, tokens/s, the caches' bytes per token and what the longest prompt holds."""
    lengths = (1024, 2048) if run.a.small else PREFILL_LENGTHS
    for name, target in (("8b", run.pair8b()[0]), ("27b-slice", run.slice27b())):
        run.forget()  # the 27B slice compiles afresh, its own compile measured, not the 8B's graphs reused or held
        spec = Speculation()
        engine = Engine(target, None, "ar", Sampling(), spec, cache_length(max(lengths), 8, "ar", spec, None),
                        compile=run.compile)
        chunk = prefill_chunk(run.device.type)
        run.first_calls("ar", lambda: engine.start([random_tokens(chunk, target.config.vocab_size)], [0]))
        per_token = memory_per_token(target)
        rec = out[name] = dict(chunk=chunk, bytes_per_token=per_token)
        for n in lengths:
            prompt = random_tokens(n, target.config.vocab_size, seed=n)
            sync(run.device)
            t = time.perf_counter()
            engine.start([prompt], [0])
            sync(run.device)
            seconds = time.perf_counter() - t
            rec[n] = dict(seconds=seconds, tokens_per_s=n / seconds,
                          cache_gb=(per_token["target_kv"] * n + per_token["recurrent"]) / 1e9)
            run.say(f"  {name} prefill of {n} tokens: {seconds:.3f} s, {n / seconds:,.0f} tokens/s, caches "
                    f"{rec[n]['cache_gb']:.2f} GB")
        del engine


# -------------------------------------------------------------------------------------------------------- flex


# (heads, kv heads, head size, query rows, K/V written in the graph in float32 as the engine's layers do):
# Qwen3-8B's G = 4 at the engine's lengths (decode, verify rows, a block, a prefill chunk), the drafter's block at
# G = 2, Qwen3.5-27B's G = 6 with heads of 256, Qwen3-30B-A3B's G = 8 at one row. --small: a case per shape.
FLEX_CASES = [(16, 4, 128, q, False) for q in (1, 17, 65, 128, 513)] + [(8, 4, 128, 8, True)] + \
             [(24, 4, 256, q, False) for q in (1, 17, 65, 513)] + [(32, 4, 128, 1, False)]
SMALL_FLEX_CASES = [(16, 4, 128, 17, False), (8, 4, 128, 8, True), (24, 4, 256, 65, False), (32, 4, 128, 1, False)]


def flex(run, out):
    """Each case's largest |difference| from SDPA over three prefixes of random trees; the part fails on an error
    or a difference beyond the dtype's rounding."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # a graph per case
    for heads, kv_heads, dim, rows, write in SMALL_FLEX_CASES if run.a.small else FLEX_CASES:
        key = f"G{heads // kv_heads}-d{dim}-q{rows}" + ("-write-f32" if write else "")
        dtype, t = torch.float32 if write else run.dtype, time.perf_counter()
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
    device, mask = run.device, PrefixMask(q_len, kv_len, run.device)
    options = flex_kernel_options(q_len, device.type)

    def attend(q, k, v, k_new, v_new, slots):
        if write:
            k.index_copy_(2, slots, k_new)
            v.index_copy_(2, slots, v_new)
        return torch.nn.attention.flex_attention.flex_attention(q, k, v, block_mask=mask.block_mask, enable_gqa=True,
                                                                kernel_options=options)

    if run.compile:
        attend = torch.compile(attend, dynamic=False, fullgraph=True)
    worst = 0.0
    for prefix in (0, 130, kv_len - q_len - 1):
        gen = torch.Generator().manual_seed(q_len + prefix)
        parents = (torch.rand(q_len - 1, generator=gen) * torch.arange(1, q_len)).long()  # row i under a row before
        anc = ancestor_matrix(parents).to(device)
        mask.set(prefix, anc)
        q = torch.randn(1, heads, q_len, dim, generator=gen).to(device, dtype)
        k, v, k_new, v_new = (torch.randn(1, kv_heads, n, dim, generator=gen).to(device, dtype)
                              for n in (kv_len, kv_len, q_len, q_len))
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


# name: (fn(run, out) filling the part's results and raising on a failure; fn(prices) -> {kind: graphs it
# compiles}, for its price; its seconds besides compiling (on a GPU at full shapes, on a CPU or with --small);
# fn(args) -> what it hands on to the parts after it (Prices.provided), for --plan)
NOTHING = lambda a: {}  # noqa: E731
PARTS = {  # in the order --small runs them: the device calls' order
    "ar-profile": (ar_profile, lambda p: dict(ar=1), (25, 10), lambda a: dict(ar=True)),
    "round-profile": (round_profile, lambda p: {k: n * len(p.a.round_budgets) for k, n in
                                                dict(ar=2, tiny=3, round=1).items()}, (20, 10),
                      lambda a: dict(rounds=a.round_budgets)),
    # projection: besides its graphs, transformers' eager generate on the same weights
    "projection": (projection, projection_graphs, (25, 10), lambda a: dict(ar=True, rounds=[64])),
    "pair-smoke": (pair_smoke, lambda p: dict(tiny=2 * p.graphs_per_engine()), (15, 20), NOTHING),
    # hybrid-tiny: five engines' rounds; on a GPU also prefills: ar's, the drafter engines' and the series one's
    "hybrid-tiny": (hybrid_tiny, lambda p: dict(tiny=8 if p.cuda else 5), (20, 30), NOTHING),
    "hybrid-rule": (hybrid_rule, lambda p: {}, (30, 10), NOTHING),
    "verify-curve": (verify_curve, lambda p: dict(ar=len(set(p.a.verify_budgets) - p.provided["verify"])), (10, 5),
                     lambda a: dict(verify=a.verify_budgets)),
    "hybrid-slice": (hybrid_slice, lambda p: dict(ar=3), (30, 10), NOTHING),
    "dflash2-profile": (dflash2_profile, lambda p: {k: n * len(p.a.round_budgets) for k, n in
                                                    dict(ar=2, tiny=3, round=1).items()}, (30, 10), NOTHING),
    "prefill": (prefill, lambda p: dict(ar=2 if p.cuda else 0), (40, 20), NOTHING),
    "flex": (flex, lambda p: dict(tiny=len(SMALL_FLEX_CASES if p.a.small else FLEX_CASES)), (20, 20), NOTHING),
    # gemma4-31b: the AR step's graph and a whole round per budget; besides, building 15 GB of random weights
    "gemma4-31b": (gemma4_31b, lambda p: dict(ar=1, round=len(p.a.round_budgets)), (30, 10), NOTHING),
}
# The first call answers the speed question; the second checks the engine's tokens on the device and how the
# recurrent layers' tree rule can be captured (docs/benchmarks.md, "gpu_check").
FIRST_PARTS = ["ar-profile", "round-profile", "projection"]
SECOND_PARTS = ["pair-smoke", "hybrid-tiny", "hybrid-rule"]
SECOND_DEADLINE = 250.0
IF_TIME_REMAINS = ["gemma4-31b", "verify-curve", "hybrid-slice", "dflash2-profile", "prefill", "flex"]
DEADLINE = 450.0  # the first call's: its command runs under timeout_s 510, the second's under 280


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, as the project's command lines do
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (cuda:N) or cpu")
    p.add_argument("--small", action="store_true", help="small shapes and every part: the script on a CPU")
    p.add_argument("--eager", action="store_true", help="compile nothing (the test suite's quick runs)")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), metavar="PART",
                   help=f"parts to run, in this order (default: {' '.join(FIRST_PARTS)}, then if time remains "
                        f"{' '.join(IF_TIME_REMAINS)}; with --small all)")
    p.add_argument("--deadline", type=float, help="seconds from the start: a part priced to end later is skipped "
                                                  f"(default {DEADLINE:.0f}; --small 1500)")
    p.add_argument("--part-seconds", type=float, help="each part's alarm (default 400; --small 900)")
    p.add_argument("--round-budgets", type=int, nargs="+", default=[64])
    p.add_argument("--verify-budgets", type=int, nargs="+", default=[128, 512])
    p.add_argument("--repeats", type=int, help="synchronized calls per timing (default 20; CPU 5)")
    p.add_argument("--json", help="where the JSON goes (rewritten after every part)")
    p.add_argument("--second-call", action="store_true",
                   help=f"the second call's parts ({' '.join(SECOND_PARTS)}) and deadline ({SECOND_DEADLINE:.0f} s)")
    p.add_argument("--plan", action="store_true", help="print the call's parts priced against --deadline and exit "
                                                      "(runs nothing: no device needed)")
    p.add_argument("--plant-failure", choices=list(PARTS), help=argparse.SUPPRESS)  # the report's own test
    a = p.parse_args(argv)
    if a.second_call:
        if a.parts:
            p.error("--second-call names its own parts: give --parts or --second-call")
        a.parts = list(SECOND_PARTS)
        a.deadline = SECOND_DEADLINE if a.deadline is None else a.deadline
    a.deadline = (1500.0 if a.small else DEADLINE) if a.deadline is None else a.deadline
    a.part_seconds = (900.0 if a.small else 400.0) if a.part_seconds is None else a.part_seconds
    if a.parts and len(set(a.parts)) != len(a.parts):
        p.error(f"--parts names a part twice: {' '.join(a.parts)}")
    if min(a.round_budgets + a.verify_budgets) < 1 or a.deadline <= 0 or a.part_seconds <= 0 or \
            (a.repeats is not None and a.repeats < 1):  # --repeats 0 is no default: refused, not replaced
        p.error("budgets and --repeats must be at least 1, --deadline and --part-seconds positive")
    try:
        device = torch.device(a.device)
    except RuntimeError:
        p.error(f"--device {a.device!r} is not a device (cuda, cuda:N or cpu)")
    if device.type not in ("cuda", "cpu"):
        p.error(f"--device {a.device!r}: this check runs on cuda or cpu")
    if device.type == "cuda" and not a.plan and (not torch.cuda.is_available()
                                                 or (device.index or 0) >= torch.cuda.device_count()):
        p.error(f"--device {a.device!r}: no such CUDA device here (use --device cpu --small on a CPU)")
    return a


def rounded(x):
    """Numbers to 4 significant digits, through dicts and lists: the summary's figures."""
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v) for v in x]
    return x


def round_figures(rounds: dict) -> dict:
    return {b: dict(stages_ms=r["stages_ms"], round_ms=r["round_ms"], per_call_ms=r["round_per_call_ms"],
                    host_ms=r["host_ms"], over_ar=r.get("round_over_ar")) for b, r in rounds.items()
            if isinstance(r, dict) and "round_ms" in r}


# Each part's figures that matter, picked from its result for the summary.
FIGURES = {
    "ar-profile": lambda r: dict(ms=r["pipelined_ms"], per_call_ms=r["per_call_ms"], floor_ms=r["floor_ms"],
                                 over_floor=r["pipelined_over_floor"], floor_with_table_ms=r["floor_with_table_ms"],
                                 over_floor_with_table=r["pipelined_over_floor_with_table"],
                                 copy_gbs=r["copy_bandwidth_gbs"], kernels_per_step=r.get("profile", {}).get(
                                     "per_step")),
    "round-profile": round_figures,
    "projection": lambda r: dict(ar_ms=r["ar_ms"], rest_ms=r["rest_ms"],
                                 transformers_ms=r["transformers"].get("step_ms", r["transformers"].get("error")),
                                 rows={k: dict(round_ms=v["round_ms"], tau=v["tau"], over_our_ar=v["projected_speedup"],
                                               over_transformers=v.get("over_transformers"), paper=v["speedup"])
                                       for k, v in r["rows"].items()}),
    "verify-curve": lambda r: {b: v["ms"] for b, v in r.items()},
    "pair-smoke": lambda r: {k: v["equal_to_eager_ar"] for k, v in r.items()},
    "hybrid-tiny": lambda r: {k: v["equal_to_eager_ar"] for k, v in r.items() if isinstance(v, dict)},
    "hybrid-rule": lambda r: {k: [v.get("eager_ms"), v.get("graph_ms"), v.get("captured")] if k.startswith("R")
                              else v for k, v in r.items()},
    "hybrid-slice": lambda r: dict(ar_ms=r["ar"]["pipelined_ms"], over_floor=r["ar"]["pipelined_over_floor"],
                                   verify_ms={k: v["ms"] for k, v in r.items() if k.startswith("verify")}),
    "dflash2-profile": round_figures,
    "gemma4-31b": lambda r: dict(ar_ms=r["ar"]["pipelined_ms"], floor_ms=r["ar"]["floor_ms"],
                                 over_floor=r["ar"]["pipelined_over_floor"],
                                 rounds={b: dict(round_ms=v["round_ms"], over_ar=v["round_over_ar"])
                                         for b, v in r.items() if isinstance(v, dict) and "round_ms" in v}),
    "prefill": lambda r: {m: {n: v["tokens_per_s"] for n, v in rec.items() if isinstance(v, dict) and
                              "tokens_per_s" in v} for m, rec in r.items()},
    "flex": lambda r: dict(worst=max((v.get("max_diff") or 0.0) for v in r.values()),
                           not_ok=[k for k, v in r.items() if not v["ok"]]),
}


def summary(out: dict) -> dict:
    """One compact record of the call: versions, each part's status, seconds and compile seconds, its figures that
    matter (or why it has none), the requested parts not ok; printed last, so that the tail of the output holds
    every figure even when the files are lost."""
    parts = {}
    for name, rec in out["parts"].items():
        entry = dict(status=rec["status"], s=rec.get("seconds"), compile_s=rec.get("compile_s"))
        if rec["status"] in ("skipped", "timeout", "terminated"):
            entry["why"] = rec.get("why")
        if "traceback" in rec:
            entry["error"] = rec["traceback"].strip().splitlines()[-1][:300]
        try:
            figures = FIGURES[name](rec.get("result") or {})
            if any(v is not None for v in (figures.values() if isinstance(figures, dict) else [figures])):
                entry["figures"] = figures
        except (KeyError, TypeError, AttributeError, ValueError):  # a part cut short has some of its figures
            entry["figures"] = "incomplete (the JSON holds what it measured)"
        parts[name] = entry
    v = out["versions"]
    return rounded(dict(torch=v["torch"], triton=v["triton"], device=v["device_name"], seconds=out.get("seconds"),
                        per_graph_s=out.get("per_graph_s"), parts=parts, not_ok=out.get("not_ok")))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.plan:
        return plan(a)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    requested, optional = parts_in_order(a)
    run = Run(a)
    run.out["requested"] = requested
    run.say(f"versions: {run.out['versions']}; clocks: {run.out['clocks_at_start']}")
    run.save()
    signal.signal(signal.SIGTERM, run.terminate)
    with torch.inference_mode():
        for name in requested + optional:
            if run.terminated is None:
                run.run_part(name, requested=name in requested)
            else:
                run.out["parts"][name] = dict(requested=name in requested, status="skipped", why="SIGTERM came first")
    run.out["clocks_at_end"] = clocks(run.device)
    run.out["not_ok"] = [k for k in requested if run.out["parts"][k]["status"] != "ok"]
    run.save()
    run.out["summary"] = summary(run.out)
    run.save()
    run.say(f"requested parts not ok: {run.out['not_ok'] or 'none'}")
    print("summary: " + json.dumps(run.out["summary"], separators=(",", ":")), flush=True)
    return 1 if run.out["not_ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
