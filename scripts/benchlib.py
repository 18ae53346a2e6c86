"""The library every measurement shares (scripts/bench.py's commands and scripts/gpu_check.py): timing (sync,
timed, interleaved; on a device per call or pipelined, and the profiler's kernel table), JSON output, a command
run in a fresh process (its peak memory its own), the random target (written as a checkpoint, or built in its
dtype on a device: build_target, build_drafter), the per-stage round split and its table rows, a verify forward
alone (verify_ms, tree_verify), tree construction alone, AR beside transformers' generate (compare, print_rows),
and held-out prompts and greedy runs on a trained pair, side by side (held_out_code, interleaved_runs).
"""

import argparse
import itertools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (os.path.join(ROOT, "scripts"), ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)
from checkpoints import (dflash_config, qwen3_config, random_dflash_weights, random_qwen3_weights,  # noqa: E402
                         save_checkpoint, stdlib_files, write_json_file)
from draft_tree import ancestor_matrix, build_tree, build_tree_heap  # noqa: E402
from cpu import AUTOTUNE_OPTIONS, compile_frozen, use_cpu_classes  # noqa: E402
from compiling import guards  # noqa: E402
import batch as batching  # noqa: E402
from ddtree import Engine, Speculation, cache_length, generate, generate_batch  # noqa: E402
from dflash2 import DFlash2Config, DFlash2Drafter  # noqa: E402
from drafter import DFlashConfig, DFlashDrafter  # noqa: E402
import families  # noqa: E402
from model import Qwen3, Qwen3Config, rope_frequencies  # noqa: E402
from sampler import Sampling  # noqa: E402
from text import Text  # noqa: E402
from train import HELD_OUT_EVERY, read  # noqa: E402
from tree_attn import PrefixMask, compact_kv  # noqa: E402
from cli import grouped  # noqa: E402


def positive_int(text: str) -> int:
    """argparse's type for a count (prompts, passes, repeats, threads, sizes, budgets): an integer of at least 1,
    refused while the options are parsed, before anything is built or measured."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1, got {value}")
    return value


def check_writable(flag: str, path: str, folder: bool = False):
    """Refuse, before anything is measured, an output that could not be written at the end (a run's results would
    be lost): `path` (a file; a folder with `folder`) exists and is writable, or the nearest folder above it that
    exists is writable (write_json makes the folders below it)."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if os.path.isdir(path) != folder:
            raise ValueError(f"{flag} {path} is {'a file, not a folder' if folder else 'a folder, not a file'}")
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path} is not writable")
        return
    above = os.path.dirname(path)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ValueError(f"{flag} {path} cannot be written: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} cannot be written: {above} is not writable")


def write_json(path: str, obj):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_json_file(path, obj, indent=1)  # whole or not at all: gpu_check rewrites it after every section


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats):
    """Median milliseconds of fn() over `repeats` calls (after one warm-up), and its output."""
    return interleaved([fn], device, repeats)[0], fn()


def interleaved(fns, device, repeats):
    """Median milliseconds of each of fns, called in turn `repeats` times (after one warm-up call each)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            ts.append((time.perf_counter() - t) * 1e3)
    return [statistics.median(ts) for ts in times]


def save_random_target(path, vocab, hidden, layers) -> dict:
    """The benchmarks' random Qwen3 (head_dim 64, GQA 2, MLP 3x hidden) written to `path`; returns its config."""
    tc = qwen3_config(vocab, hidden=hidden, inter=3 * hidden, layers=layers, heads=max(1, hidden // 64),
                      kv_heads=max(1, hidden // 128), head_dim=64)
    save_checkpoint(path, tc, random_qwen3_weights(tc))
    return tc


def save_random_pair(out_dir: str, hidden: int, layers: int, vocab: int = 4096, block_size: int = 8) -> tuple:
    """A random target of `hidden` x `layers` (save_random_target) and a random one-layer DFlash drafter for it
    (block 8 by default, reading target layers 1 and layers - 2), written under out_dir; returns their two paths."""
    target, draft = os.path.join(out_dir, "target"), os.path.join(out_dir, "draft")
    tc = save_random_target(target, vocab, hidden, layers)
    dc = dflash_config(tc, layers=1, block_size=block_size, target_layer_ids=[1, max(1, layers - 2)])
    save_checkpoint(draft, dc, random_dflash_weights(dc))
    return target, draft


def stepped_round(engine, *args):
    """A zero-argument call of engine.round(*args) as Engine.step calls it: every guard at the first call, then
    only those that tell the compiled graphs apart (compiling.guards)."""
    calls = itertools.count()

    def call():
        with guards(engine.compile_options, check=next(calls) == 0):
            return engine.round(*args)
    return call


def frozen_stage(f):
    """f compiled as a frozen engine compiles its round, and called as Engine.step calls it: the first call
    (the compile) with every guard and AUTOTUNE_OPTIONS, the later ones skipping the guards."""
    compiled, calls = compile_frozen(f), itertools.count()

    def call(*args):
        with guards(AUTOTUNE_OPTIONS, check=next(calls) == 0):
            return compiled(*args)
    return call


@torch.inference_mode()
def round_split(target, drafter, budget, compile, repeats, prompt_len=200):
    """Per-stage milliseconds of one round after a real prefill, for one budget.

    With `compile` (True or "max-autotune"), the forwards (draft, verify, context) and the whole round run
    compiled as the engine runs them (CUDA graphs on the GPU, frozen graphs under max-autotune on the CPU), so
    round - forwards is the rest of the round in the same mode; and the tree work alone (propose + the verify
    mask + accept, given the forwards' logits) is also timed compiled, with and (on the GPU) without CUDA graphs:
    `tree_work` and `tree_work_nograph`.
    """
    dev = target.device
    spec = Speculation(budget=budget)
    engine = Engine(target, drafter, "ddtree", Sampling(), spec, cache_length(prompt_len, 64, "ddtree", spec, drafter),
                    compile=compile)  # its masks and tree builder are those of an engine run this way
    engine.prefill_step = Engine.prefill_step.__get__(engine)  # the prefill only sets up the caches here: eager
    draft, context, verify = split_forwards(engine, compile)
    prompt = torch.randint(0, target.config.vocab_size, (prompt_len,)).tolist()
    bonus, _ = engine.prefill([prompt])  # a batch of one request: every tensor below has a leading 1
    start = torch.tensor([prompt_len], device=dev)
    ms = {}
    ms["draft"], logits_q = timed(lambda: draft(bonus, start), dev, repeats)
    logits_q = logits_q.clone()  # a CUDA graph's next replay overwrites its outputs: what is used later is cloned
    ms["tree"], (tokens, parents, depths, q) = timed(lambda: engine.propose(logits_q, None), dev, repeats)
    ms["verify"], out = timed(lambda: verify(bonus, tokens, parents, depths, start), dev, repeats)
    rows, pos, logits, features, _ = keep(out)
    ms["walk"], (path, length, nxt, _) = timed(lambda: engine.accept(logits, tokens, parents, q, None, None), dev,
                                            repeats)
    feats = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
    positions = pos.gather(1, path)
    ms["compact"], _ = timed(lambda: compact_kv(target.kv_caches(), start, path), dev, repeats)
    ms["context"], _ = timed(lambda: context(start, feats, positions), dev, repeats)
    ms["sum"] = sum(ms.values())
    ms["overhead_pct"] = 100 * (ms["tree"] + ms["walk"] + ms["compact"]) / ms["sum"]
    if compile:
        forwards = [lambda: draft(bonus, start), lambda: context(start, feats, positions),
                    lambda: verify(bonus, tokens, parents, depths, start)]
        ms.update(compiled_round_ms(engine, bonus, start, forwards, repeats))
        ms.update(tree_work_ms(engine, start, logits_q, logits, repeats))
    return ms


def split_forwards(engine, compile):
    """(draft, context, verify) as round_split times them: compiled as the engine compiles them when `compile` is
    set (CUDA graphs on a GPU, frozen graphs under max-autotune on the CPU)."""
    dev = engine.device
    # The drafter's forward comes in two parts in our round: the block pass (draft) and, at commit, the context
    # K/V of the committed tokens (Engine.commit's append_context). Both count as the drafter's forward, not as
    # tree overhead.
    context = lambda start, feats, positions: engine.drafter.append_context(  # noqa: E731
        feats, positions, start[:, None] + torch.arange(positions.shape[1], device=positions.device))
    mode = "reduce-overhead" if dev.type == "cuda" else None  # CUDA graphs, as the engine compiles them
    frozen = compile == "max-autotune" and dev.type == "cpu"
    draft = engine.draft
    if compile:  # engine.round is compiled already, as the engine runs it; the stages are compiled the same way
        stage = frozen_stage if frozen else lambda f: torch.compile(f, dynamic=False, fullgraph=True, mode=mode)
        draft, context = stage(engine.draft), stage(context)
    # The verify builds its mask from the parents inside, as the round does, so its time includes the mask's.
    verify = engine.verify
    if compile:
        verify = frozen_stage(verify) if frozen else torch.compile(verify, dynamic=False, fullgraph=True, mode=mode)
    return draft, context, verify


def compiled_round_ms(engine, bonus, start, forwards, repeats) -> dict:
    """The whole compiled round beside its forwards (draft, context, verify): what it costs beyond them is the
    real tree overhead (the verify's mask, built inside the verify as the round builds it, counts as
    the verify's). They are timed interleaved (round, draft, context, verify, round, ...) so that a noisy
    machine shifts all of them alike; the round runs as Engine.step runs it (every guard at its first call, then
    only those that tell graphs apart)."""
    whole, *fwd = interleaved([stepped_round(engine, bonus, start, None, None, None)] + forwards, engine.device,
                              3 * repeats)
    return {"round": whole, "round_overhead_pct": 100 * (whole - sum(fwd)) / whole}


def tree_work_ms(engine, start, logits_q, logits, repeats) -> dict:
    """The tree work alone (propose, the verify's mask and accept, given the forwards' logits), compiled:
    `tree_work`, and on a GPU also without CUDA graphs, `tree_work_nograph`."""
    def tree_work(logits_q, logits):
        tokens, parents, depths, q = engine.propose(logits_q, None)
        anc = ancestor_matrix(parents, engine.max_depth, dtype=torch.uint8)
        engine.verify_mask.set(start, anc)
        return engine.accept(logits, tokens, parents, q, None, None)

    mode = "reduce-overhead" if engine.device.type == "cuda" else None
    out = {}
    for name, m in ({"tree_work": mode} | ({"tree_work_nograph": None} if mode else {})).items():
        fn = torch.compile(tree_work, dynamic=False, fullgraph=True, mode=m)
        out[name], _ = timed(lambda: fn(logits_q, logits), engine.device, repeats)
    return out


def verify_ms(target, budget: int, compile: bool, repeats: int, prompt_len: int = 256, seed: int = 0) -> float:
    """Milliseconds of one verify forward of budget + 1 rows (a random tree: random_tree) after a prompt_len
    prefix, compiled as the engine compiles it (CUDA graphs on the GPU). Budget 0 is a decode step. On a MoE
    target the rows route to their own experts, so the cost follows how many are touched."""
    dev, n = target.device, budget + 1
    g = torch.Generator().manual_seed(seed)
    kv = -(-(prompt_len + n) // 1024) * 1024
    target.setup_cache(kv)
    parents, depths = random_tree(budget, g)
    if dev.type == "cpu":  # the layers as every CPU engine runs them, eager (SDPA) or compiled, whatever ran before
        use_cpu_classes(target)
    mask = PrefixMask(n, kv, dev)
    block_mask = mask.set(prompt_len, ancestor_matrix(parents.to(dev), int(depths.max()), dtype=torch.uint8))
    tokens = torch.randint(0, target.config.vocab_size, (n,), generator=g).to(dev)  # g goes on from the tree's draws
    positions, slots = prompt_len + depths.to(dev), prompt_len + torch.arange(n, device=dev)
    forward = target
    if compile:
        forward = torch.compile(target, dynamic=False, fullgraph=True,
                                mode="reduce-overhead" if dev.type == "cuda" else None)
    ms, _ = timed(lambda: forward(tokens, positions, slots, block_mask)[0], dev, repeats)
    return ms


def random_tree(budget: int, g: torch.Generator):
    """(parents [B], depths [B + 1]) on the CPU, drawn from g: node i hangs under a random earlier row."""
    parents = torch.tensor([int(torch.randint(0, i + 1, (1,), generator=g)) for i in range(budget)],
                           dtype=torch.long)
    depths = torch.zeros(budget + 1, dtype=torch.long)
    for i in range(budget):
        depths[i + 1] = depths[int(parents[i])] + 1
    return parents, depths


def tree_verify(target, budget: int, compile: bool = False, prompt_len: int = 256, seed: int = 0,
                feature_layers=(), argmax: bool = False):
    """A zero-argument callable running one verify of budget + 1 rows (a batch of one request) as Engine.verify
    runs it: a random tree after `prompt_len` committed slots, its ancestor mask built and written into the verify
    mask, RoPE positions prompt_len + depth, cache slots prompt_len + row, the outputs of `feature_layers` (a
    drafter's context features, as the round asks for them), and the recurrent layers in tree mode (their pending
    k, u and G, which the commit reads, are returned with the logits, so nothing is left out).
    The caches hold zeros (the values do not change the work). compile: torch.compile fullgraph (CUDA graphs on a
    GPU, as the engine compiles its round). argmax: the target's argmax pair in place of float32 logits, the form a
    greedy round's verify hands its accept."""
    dev, n = target.device, budget + 1
    kv = -(-(prompt_len + n) // 1024) * 1024
    target.setup_cache(kv)
    parents, depths = random_tree(budget, torch.Generator().manual_seed(seed))
    if dev.type == "cpu":  # the layers as every CPU engine runs them, eager (SDPA) or compiled, whatever ran before
        use_cpu_classes(target)
    mask = PrefixMask(n, kv, dev)
    start = torch.tensor([prompt_len], device=dev)
    tokens = torch.randint(0, target.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed)).to(dev)
    positions = (prompt_len + depths)[None].to(dev)
    slots = (prompt_len + torch.arange(n))[None].to(dev)
    parents = parents[None].to(dev)
    depth = int(depths.max())  # the bound the engine would pass (its draft positions), here the tree's own

    def forward(tokens, positions, slots, start, parents):
        anc = ancestor_matrix(parents, depth, dtype=torch.uint8)
        tree = target.tree_state(parents, anc, depth) if target.recurrent else None
        logits, features = target(tokens, positions, slots, mask.set(start, anc), feature_layers=feature_layers,
                                  recurrent=tree, argmax=argmax)
        pending = tree.pending if tree is not None else {}
        return (logits, features, *(t for i in sorted(pending) for t in pending[i][1:]))

    if compile:
        forward = torch.compile(forward, dynamic=False, fullgraph=True,
                                mode="reduce-overhead" if dev.type == "cuda" else None)
    return lambda: forward(tokens, positions, slots, start, parents)


def round_header(cols, compiled: bool, width: int = 8) -> str:
    return (f"{'B':>5s} " + " ".join(f"{c[:width]:>{width}s}" for c in cols) + f" {'overhead':>9s}"
            + (f" {'compiled':>9s}" if compiled else ""))


def round_row(budget, ms, cols, width: int = 8) -> str:
    """One line of a round_split table: the stages' milliseconds, the eager overhead share and, when the whole
    round was compiled, its overhead share."""
    return (f"{budget:5d} " + " ".join(f"{ms[c]:{width}.2f}" for c in cols) + f" {ms['overhead_pct']:8.1f}%"
            + (f" {ms['round_overhead_pct']:8.1f}%" if "round_overhead_pct" in ms else ""))


def tree_alone(vocab, depth, budget, device, repeats):
    """Tree construction by itself at the paper's size: the heap (reference) and the tensor version."""
    logq = torch.log_softmax(torch.randn(depth, vocab, device=device) * 3, -1)
    out = {}
    out["heap_ms"], heap = timed(lambda: build_tree_heap(logq, budget), device, repeats)
    out["tensor_eager_ms"], fast = timed(lambda: build_tree(logq, budget), device, repeats)
    compiled = torch.compile(build_tree, dynamic=False, fullgraph=True)
    out["tensor_compiled_ms"], fast_c = timed(lambda: compiled(logq, budget), device, repeats)
    out["equal"] = all(torch.equal(a, b) for a, b in zip(heap, fast)) and all(
        torch.equal(a, b) for a, b in zip(heap, fast_c))
    return out


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def compare(path: str, prompt: list, new: int, repeats: int):
    """(name, seconds, tokens) for transformers' generate, our eager AR and our compiled AR on the checkpoint at
    `path`, greedy, `new` tokens, best of `repeats` (compilation not timed)."""
    from transformers import Qwen3ForCausalLM
    ours = Qwen3.from_pretrained(path, device="cpu")
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def run_hf():
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def run_ours(compile):
        return lambda: generate(ours, None, prompt, method="ar", max_new_tokens=new, stop_ids=[],
                                compile=compile).tokens

    rows = [("transformers generate",) + best_of(run_hf, repeats)]
    rows.append(("ours eager",) + best_of(run_ours(False), repeats))
    t = time.perf_counter()
    run_ours(True)()  # compile (not timed below)
    print(f"compile + first run: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    rows.append(("ours compiled",) + best_of(run_ours(True), repeats))
    return rows


def transformers_twin(target: Qwen3):
    """transformers' Qwen3ForCausalLM on `target`'s own weights (a plain Qwen3: no hybrid, no MoE), sharing their
    memory: built on the meta device, then given views of the target's tensors under the checkpoint's names
    (checkpoints.checkpoint_tensors: a stacked projection's rows are the projection), so an 8B pair needs no second
    copy. Its rotary table is made on the target's device, as from_pretrained makes it."""
    import transformers
    from checkpoints import checkpoint_tensors
    c, device = target.config, target.embed_tokens.weight.device
    config = transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}, attention_bias=False,
        use_sliding_window=False, dtype=target.embed_tokens.weight.dtype)
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(config)
    state = {(name if name == "lm_head.weight" else "model." + name): t
             for name, t in checkpoint_tensors(target).items()}
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True, assign=True)
    with torch.device(device):  # its constructor makes the table (its signature differs between releases)
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config).to(device)
    return hf.eval()


def transformers_step_ms(hf, prompt: list, new: int, repeats: int) -> dict:
    """transformers' greedy `generate` (eager, its default attention) after `prompt`: the milliseconds per decoded
    token, read off the clock at each token it hands its streamer (the device synced there, as generate's own
    stopping check does each step): the median gap between successive tokens after the first, the best of `repeats`
    runs. The prefill and the first token are left out, as they are for our AR step; a gap is one step, so a slow
    spell on a busy machine cannot make the figure negative, as a difference of two whole runs can."""
    device = hf.lm_head.weight.device
    ids = torch.tensor([prompt], device=device)

    class Clock:  # generate's streamer interface: put(token ids) per step (the prompt first), end()
        def __init__(self):
            self.times = []

        def put(self, value):
            sync(device)
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def step_s() -> float:
        clock = Clock()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1 + new, min_new_tokens=1 + new,
                    do_sample=False, eos_token_id=None, pad_token_id=0, streamer=clock)
        after_first = clock.times[2:]  # times[0]: the prompt handed over; times[1]: the first token, after the prefill
        assert len(after_first) == new, len(clock.times)
        return statistics.median(b - a for a, b in zip(clock.times[1:], after_first))

    step_s()  # warm-up: the first call sets up kernels and the generation config
    return dict(step_ms=min(step_s() for _ in range(max(repeats, 1))) * 1e3, new_tokens=new,
                prompt_tokens=len(prompt), attention=hf.config._attn_implementation)


def print_rows(rows, new):
    t_hf, ref = rows[0][1], rows[0][2]
    print(f"{'':24s} {'tokens/s':>9s} {'vs transformers':>16s} {'same tokens':>12s}")
    for name, seconds, tokens in rows:
        print(f"{name:24s} {new / seconds:9.1f} {t_hf / seconds:15.2f}x {str(tokens == ref):>12s}")


def held_out_code(text: Text, n: int, lo: int, hi: int, seed: int):
    """n token windows of length lo..hi from the held-out standard-library files."""
    rng = random.Random(seed)
    _, held = stdlib_files(HELD_OUT_EVERY)
    docs = [ids for ids in (text.encode(read(f)) for f in held) if len(ids) > hi + 1]
    out = []
    for _ in range(n):
        ids = rng.choice(docs)
        length = rng.randint(lo, hi)
        start = rng.randint(0, len(ids) - length - 1)
        out.append(ids[start:start + length])
    return out


def long_windows(text: Text, n: int, length: int, seed: int):
    """n token windows of exactly `length` from the held-out standard-library files read as one stream (a window
    may run across files, as a long context of several files does)."""
    rng = random.Random(seed)
    _, held = stdlib_files(HELD_OUT_EVERY)
    stream = [t for f in held for t in text.encode(read(f))]
    if len(stream) <= length:
        raise ValueError(f"the held-out files hold {len(stream)} tokens: no window of {length}")
    starts = [rng.randint(0, len(stream) - length) for _ in range(n)]
    return [stream[s:s + length] for s in starts]


def interleaved_runs(configs: dict, prompts, new_tokens, compile, passes=3) -> dict:
    """Greedy generations of every config side by side: one engine per config, all alive at once and warmed up
    first, then `passes` over the prompts with each prompt run by every config in turn, so that a slow spell of
    the machine lands on all of them alike. configs: {key: (target, drafter, method, budget, denoise[, drafter
    window])}; the first is the reference the others' tokens are compared with (plain decoding, normally).

    Per key: tau and tokens_per_s over every pass, accepted (the first pass's rounds), same_tokens (prompts whose
    tokens equal the reference's), common_prefix (mean tokens before the first difference from the reference:
    new_tokens where all agree; below it in bf16, where the top two logits can tie exactly and the verify breaks
    the tie otherwise than a decode step: docs/lossless.md) and compile_seconds (the warm-up)."""
    length = max(len(p) for p in prompts)
    engines, out = {}, {}
    with torch.inference_mode():
        for key, (target, drafter, method, budget, denoise, *window) in configs.items():
            spec = Speculation(budget=budget if method == "ddtree" else None, denoise_steps=denoise,
                               draft_window=(window or [None])[0])
            engine = Engine(target, drafter if method != "ar" else None, method, Sampling(), spec,
                            cache_length(length, new_tokens, method, spec, drafter), compile)
            engines[key] = engine
            out[key] = dict(compile_seconds=engine.warm_up(), accepted=[], tokens=[], seconds=0.0, new=0, rounds=0)
        for n in range(passes):
            for prompt in prompts:
                for key, engine in engines.items():
                    res = batching.run(lambda longest, size: engine, [prompt], [0], set(), new_tokens)[0]
                    r = out[key]
                    r["seconds"] += res.stats["seconds"]
                    r["new"] += res.stats["new_tokens"]
                    r["rounds"] += res.stats["rounds"]
                    if n == 0:
                        r["accepted"] += res.stats["accepted"]
                        r["tokens"].append(res.tokens)
    reference = out[next(iter(configs))]["tokens"]
    for r in out.values():
        prefixes = [common_prefix(a, b) for a, b in zip(r["tokens"], reference)]
        r.update(tau=sum(r["accepted"]) / len(r["accepted"]), tokens_per_s=r.pop("new") / r.pop("seconds"),
                 same_tokens=sum(a == b for a, b in zip(r["tokens"], reference)),
                 common_prefix=sum(prefixes) / len(prefixes))
    return out


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def batched_run(target, drafter, prompts, method, budget, new_tokens, compile, batch, passes=2):
    """Greedy generate_batch over all prompts, `batch` requests at a time (1: one request after another):
    tokens/s of the whole set over wall time, the best of `passes` after a warm-up pass (compile, caches)."""
    kw = dict(method=method, budget=budget if method == "ddtree" else None, max_new_tokens=new_tokens, stop_ids=[],
              compile=compile, max_batch=batch)
    generate_batch(target, drafter, prompts[:batch], **grouped(kw))
    best = 0.0
    for _ in range(passes):
        t0 = time.perf_counter()
        results = generate_batch(target, drafter, prompts, **grouped(kw))
        seconds = time.perf_counter() - t0 - sum(r.stats["compile_seconds"] for r in results[::batch])
        best = max(best, sum(r.stats["new_tokens"] for r in results) / seconds)
    return best


# ---------------------------------------------------------------------------------- random models in their dtype


def materialize(make, device, dtype):
    """make() built on the meta device and converted to dtype there (no memory yet), then given uninitialized memory
    on the device: no float32 copy of the weights ever exists, so 27B shapes fit an 80 GB device in bf16."""
    with torch.device("meta"):
        module = make()
    return module.to(dtype).to_empty(device=device)


def fill_random(module, seed: int, std: float, zero_centred: bool):
    """Every parameter filled in place from a seeded generator (runs repeat): normal(0, std), except the norms (the
    identity: 1 for x * w, 0 for a hybrid's zero-centred x * (1 + w), which Gated DeltaNet's own norm is not) and
    Gated DeltaNet's decay (A in [1, 16] as transformers draws it; softplus(dt_bias) log-uniform in [1e-3, 1e-1]
    as Mamba's), which normal noise would make decay too fast or not at all."""
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    uniform = lambda p, lo, hi: torch.empty(p.shape, device=device).uniform_(lo, hi, generator=gen)  # noqa: E731
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if zero_centred and "linear_attn." not in name else 1.0)
            elif name.endswith("A_log"):
                p.copy_(uniform(p, 1.0, 16.0).log())
            elif name.endswith("dt_bias"):
                p.copy_(uniform(p, math.log(1e-3), math.log(1e-1)).exp().expm1().log())  # softplus's inverse
            else:
                p.normal_(0.0, std, generator=gen)


HYBRID_FIELDS = ("layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers", "shared_expert_intermediate_size")


def target_config(**fields) -> Qwen3Config:
    """A Qwen3Config from flat fields, as the scripts write shapes: a hybrid's own (HYBRID_FIELDS) gathered into a
    hybrid.HybridConfig, a MoE's (MOE_FIELDS) into a moe.MoEConfig; zero_centered_norm and attn_output_gate (on in
    every hybrid) dropped."""
    for key in ("zero_centered_norm", "attn_output_gate"):
        fields.pop(key, None)
    own = {k: fields.pop(k) for k in HYBRID_FIELDS if k in fields}
    if own:
        from hybrid import HybridConfig
        fields["hybrid"] = HybridConfig(**own)
    own = {k: fields.pop(k) for k in MOE_FIELDS if k in fields}
    if own.get("num_experts"):
        from moe import MoEConfig
        fields["moe"] = MoEConfig(**own)
    return Qwen3Config(**fields)


def build_target(shape: dict, device, dtype, seed: int = 0, std: float = 0.02) -> Qwen3:
    """A random target of the (flat) Qwen3Config fields `shape`, built in `dtype` on the device."""
    c = target_config(**shape)
    target = materialize(lambda: families.build(Qwen3, c), device, dtype)
    if c.tie_word_embeddings:  # to_empty gives each module a tensor of its own
        target.lm_head.weight = target.embed_tokens.weight
    fill_random(target, seed, std, c.hybrid is not None)
    target.inv_freq = rope_frequencies(c, device)[0]  # float32, as loading makes it
    return target.eval()


def build_drafter(target: Qwen3, block: int, layers: int, seed: int = 1, std: float = 0.02, ids=None,
                  model: dict | None = None, **dflash) -> DFlashDrafter:
    """A random DFlash drafter (plain Qwen3 layers whatever the target's) reading z-lab's Qwen3-8B layers on a
    36-layer target, else the first three (or `ids`). `model` overrides the layers' shapes (heads, MLP width), taken
    from the target by default; `dflash` sets DFlashConfig's other fields (per-layer attention; DFlash 2's
    convolutions and selector: a dflash2.DFlash2Drafter)."""
    t = target.config
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings")
    model = model or {}
    shape = {k: getattr(t, k) for k in keys if k not in model} | model  # a family's config may lack some
    config = Qwen3Config(**shape, num_hidden_layers=layers, tie_word_embeddings=False)
    if ids is None:
        ids = [1, 9, 17, 25, 33] if t.num_hidden_layers == 36 else list(range(min(3, t.num_hidden_layers)))
    two = "selector_top_k" in dflash
    cls, config_type = (DFlash2Drafter, DFlash2Config) if two else (DFlashDrafter, DFlashConfig)
    dc = config_type(model=config, block_size=block, num_target_layers=t.num_hidden_layers, target_layer_ids=ids,
                     mask_token_id=t.vocab_size - 1, **dflash)
    drafter = materialize(lambda: cls(dc), target.device, target.dtype)
    fill_random(drafter, seed, std, False)
    drafter.inv_freq = rope_frequencies(config, target.device)[0]
    return drafter.eval().bind(target)


def random_tokens(n: int, vocab: int, seed: int = 0) -> list:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------------------ device timing, the kernel table


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
    """Milliseconds per fn() over n calls issued back to back with one synchronization (CUDA events on a GPU): the
    cost when the host runs ahead of the device, as in a decoding loop."""
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
    """Clones of a compiled call's tensors (and of what has a clone, as a Lattice or a Recurrent): a CUDA graph's
    next replay overwrites its outputs."""
    if isinstance(out, tuple):
        return tuple(keep(t) for t in out)
    return out.clone() if hasattr(out, "clone") else out


def copy_bandwidth(device, gib: float) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    a = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() * a.element_size() / (per_call_ms(lambda: b.copy_(a), device, 5) / 1e3)


def kernel_table(fn, device, steps: int, top: int = 12) -> dict:
    """The profiler's view of `steps` calls of fn: on a GPU its kernels (in CUDA graph replays too), on a CPU its
    operators (nested ones counted too): per step their count and summed time, and the top ones by time."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    events = prof.key_averages()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    rows = sorted(((e.key, e.count, e.self_device_time_total if cuda else e.self_cpu_time_total) for e in events
                   if e.device_type == kind), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    return dict(of="kernels" if cuda else "cpu operators", per_step=sum(r[1] for r in rows) / steps,
                us_per_step=total / steps,
                graph_launches_per_step=sum(e.count for e in events if e.key == "cudaGraphLaunch") / steps,
                top=[dict(name=k[:120], per_step=c / steps, us_per_step=us / steps, share=us / max(total, 1e-9))
                     for k, c, us in rows[:top]])


# ---------------------------------------------------------------------- a command in a fresh process, the machine


def in_fresh_process(*args, env=None, input=None, cwd=None) -> dict:
    """`python scripts/bench.py ARGS` in a process of its own (so that its peak memory, or the modules it imports,
    are its own), `input` on its stdin; returns the JSON object its last line prints."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench.py"), *args], capture_output=True,
                          text=True, env=env, input=input, cwd=cwd)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def status_mb(key: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM) in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def reset_peak() -> float:
    """Freed heap pages back to the system (malloc_trim), then the process's peak resident set (VmHWM) reset to
    what it holds now (Linux: /proc/self/clear_refs, 5); returns the resident set it starts from, in MB."""
    import ctypes
    import gc
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mb("VmRSS")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"
