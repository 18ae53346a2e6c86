"""How an engine's round and prefill step are compiled (fullgraph, fixed shapes) and called, and an inductor cache
that can be written (docs/compile.md)."""

import contextlib
import functools
import os
import tempfile
import warnings

import torch


def compile_steps(round_fn, prefill_step, target, drafter, compile: bool | str):
    """(round, prefill step) as this device runs them, the inductor options for guards(), and the seconds spent
    preparing them (the CPU's attention kernel; 0 on a GPU); eager with compile False. dynamic=False: a graph
    dynamic on the query length fails to build on the CPU (docs/compile.md)."""
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
    """Whether compile_steps compiles the prefill step: not on the CPU (docs/compile.md, "Eager prefill on CPU")."""
    return bool(compile) and device_type != "cpu"


def graph_warmup_calls(compile, device_type: str) -> int:
    """Calls of a compiled step before its graph runs as it will (CUDA graph trees record on the second)."""
    return 2 if compile and device_type == "cuda" else 1


def guards(options: dict, check: bool):
    """The context of a compiled step's call: with `check`, every guard evaluated and inductor's `options` set (only
    such a call can compile); without, guard evaluation skipped, as a step sees the same objects and shapes every
    round (docs/compile.md, "Guards checked once per run")."""
    if not check:
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    return torch._inductor.config.patch(options) if options else contextlib.nullcontext()


@functools.cache
def writable_inductor_cache():
    """An unwritable inductor cache (a compile would die deep in a worker thread) replaced by a private temporary
    directory for this process, with one warning; checked once per process."""
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
