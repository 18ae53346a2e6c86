"""How an engine's steps are compiled and called: torch.compile with CUDA graphs on a GPU (the CPU's compile behind
cpu.compile_round), the guards a compiled step checks per call, and an inductor cache that can be written.

The engine's round and prefill chunk are fullgraph functions of fixed shapes: one graph each per engine shape,
replayed every round. docs/compile.md explains each choice made here.
"""

import contextlib
import functools
import os
import tempfile
import warnings

import torch


def compile_steps(round_fn, prefill_step, target, drafter, compile: bool | str):
    """The engine's (round, prefill step) as this device runs them, the inductor options its compiling calls set
    (guards), and the seconds spent preparing them (on the CPU, building its attention kernel; 0 on a GPU). With
    compile False they stay eager. On the CPU the models take cpu/'s layer classes here, eager or compiled
    (cpu.compile_round). The prefill step is compiled where prefill_compiled says.

    One graph per fixed shape (prefill chunk, round). dynamic=False: a graph that went dynamic on the query length
    fails to build on the CPU (docs/compile.md). Engines compile the same methods, so they share one cache per
    method: an engine whose tensors and settings match an earlier one's reuses its graphs (which read the models
    and masks through the engine at each call); frozen graphs are per engine."""
    if compile:
        # Room for a few engines (settings, budgets) before dynamo falls back to eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        writable_inductor_cache()
    mode = "reduce-overhead" if compile is True else compile  # on a GPU: CUDA graphs ("max-autotune" includes them)
    if target.device.type == "cpu":
        import cpu  # the CPU seam: imported only for an engine on a CPU
        round_fn, options, prepare_seconds = cpu.compile_round(round_fn, target, drafter, compile)
    else:
        options, prepare_seconds = {}, 0.0
        if compile:
            round_fn = torch.compile(round_fn, dynamic=False, fullgraph=True, mode=mode)
    if prefill_compiled(compile, target.device.type):
        prefill_step = torch.compile(prefill_step, dynamic=False, fullgraph=True, mode=mode)
    return round_fn, prefill_step, options, prepare_seconds


def prefill_compiled(compile: bool | str, device_type: str) -> bool:
    """Whether compile_steps compiles an engine's prefill step: when it compiles, except on the CPU, where the
    prefill stays eager (docs/compile.md, "Eager prefill on CPU")."""
    return bool(compile) and device_type != "cpu"


def graph_warmup_calls(compile, device_type: str) -> int:
    """Calls of each compiled step before its graph runs as it will: CUDA graph trees run a function's first call
    as a warm-up and record its graph on the second (torch/_inductor/cudagraph_trees.py); plain graphs are built
    by the first call."""
    return 2 if compile and device_type == "cuda" else 1


def guards(options: dict, check: bool):
    """The context of a compiled step's call (a plain call for an eager one). With `check`, every guard is
    evaluated and `options` (inductor's, for a compile) are set: only such a call can compile. Without, only the
    guards that tell the step's graphs apart are (every tensor that is not a parameter, and whatever once made a
    graph recompile), and a call that would recompile is an error instead, so it needs no options and does not pay
    for setting them: a step sees the same objects and shapes at every round of a run (docs/compile.md, "Guards
    checked once per run")."""
    if not check:
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    return torch._inductor.config.patch(options) if options else contextlib.nullcontext()


@functools.cache
def writable_inductor_cache():
    """Inductor writes every compiled kernel under TORCHINDUCTOR_CACHE_DIR (default: the temporary directory's
    torchinductor_<user>); where that cannot be written, a compile dies deep inside a worker thread. Checked once
    per process: an unwritable one is replaced by a private temporary directory for this process, with one warning."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    try:
        path = cache_dir()  # makes it if need be
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        fallback = tempfile.mkdtemp(prefix="ddtree-inductor-")
        warnings.warn(f"the inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR')} cannot be written ({e}); "
                      f"compiling into {fallback} for this run (set TORCHINDUCTOR_CACHE_DIR to a writable directory "
                      f"to keep compiled kernels between runs)")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = fallback
