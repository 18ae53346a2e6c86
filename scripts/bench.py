"""Every measurement of the engine, one command each:

    python scripts/bench.py COMMAND [options]       (python scripts/bench.py COMMAND --help: what it measures, how)

The cost of one round and of its parts (their code: scripts/bench_round.py)
  round       where a DDTree round's time goes, stage by stage, per budget, on a random pair; tree building alone;
              --scorecard: the compiled fast path's CPU goals
  roofline    each stage of a compiled round beside its floor on this machine (bytes / bandwidth, FLOPs / peak)
  crossover   plain decoding's step beside a DDTree round per budget: the tau a pair must reach to break even
  sampling    a sampled round's per-row work at a real vocabulary: warping, drawing, sampling
  kernels     what a compiled decode step launches (fused kernels, GEMMs), per layer
  callgraph   the functions one round runs, the deepest chain from generate() to the attention, a whole generate()
  ar          our eager and compiled AR beside transformers' generate on the same random weights

Models side by side (scripts/bench_models.py)
  pair        AR, the DFlash chain and DDTree on a trained pair: tau, tokens/s, the round split; --only-batches:
              generate_batch at growing batch sizes; --only-auto: budget auto beside every fixed choice
  context     DDTree's tau against prompt length (0.5K-8K), with and without the drafter's window; prefill tokens/s
  official    our DDTree beside the official DDTree loop on the same weights and prompts
  moe         a Qwen3-MoE target beside the dense one of the same active size
  hybrid      the verify forward through a hybrid target beside the dense one: time, peak memory, recurrent share
  memory      one request's peak memory at B = 512 over Qwen3's vocabulary, greedy beside sampled
  calibrate   budget auto's calibration for a pair on this device, stored in the cost cache, and its curve
  moe-parallel  one MoE layer over torchrun's ranks, every expert split beside expert parallel, per verify rows

The paper's benchmark (scripts/bench_datasets.py)
  datasets    Table 1 on the paper's datasets (MATH-500, GSM8K, AIME, HumanEval, MBPP, LiveCodeBench, SWE-bench,
              MT-Bench, Alpaca): tau and speedup over AR per method and budget, every greedy output checked equal
              to AR's, HumanEval's pass@1 (--score), a JSON of every response, plots; data parallel under torchrun

The library they share is scripts/benchlib.py; docs/benchmarks.md holds what each measured, when and on which
machine. Bad options are one `error:` line and exit status 2, as on ddtree.py's command line; counts must be at
least 1, and --json / --out must be writable: both are checked before anything is measured.
"""

import argparse
import inspect
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]
import bench_datasets  # noqa: E402
import bench_models  # noqa: E402
import bench_round  # noqa: E402
from benchlib import check_writable  # noqa: E402
from cli import in_flags, one_line_errors  # noqa: E402

COMMANDS = {**bench_round.COMMANDS, **bench_models.COMMANDS, **bench_datasets.COMMANDS}  # name -> (its options, its run)


def parser() -> argparse.ArgumentParser:
    """One subcommand per measurement; a command's --help is its run's docstring."""
    raw = argparse.RawDescriptionHelpFormatter
    p = one_line_errors(argparse.ArgumentParser(description=__doc__, formatter_class=raw))
    commands = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (options, run) in COMMANDS.items():
        options(one_line_errors(commands.add_parser(name, description=inspect.getdoc(run), formatter_class=raw)))
    return p


def main(argv=None) -> int:
    """Runs one command; its exit status (0 unless it says otherwise), or 2 with one `error:` line for bad options
    (argparse's own errors too: cli.one_line_errors)."""
    try:
        a = parser().parse_args(argv)
        for flag, folder in (("json", False), ("out", True)):  # the results' place, before anything is measured
            if getattr(a, flag, None):
                check_writable(f"--{flag}", getattr(a, flag), folder)
        return COMMANDS[a.command][1](a) or 0
    except (ValueError, TypeError) as e:
        print(f"error: {in_flags(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
