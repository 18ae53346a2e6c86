"""Build budget auto's calibration for a pair on this device, store it in the cost cache, and print the curve.

    python scripts/calibrate.py [--target PATH] [--draft PATH] [--compile] [--batch N] [--temperature T ...]

`generate(budget="auto")` calibrates by itself the first time a (device, pair, settings) key is seen; this runs
that calibration explicitly (again, replacing a stored one) and prints, per candidate, the seconds of a round and
the rate it would reach accepting every draft (what decides whether it is viable). docs/budget.md.
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import budget  # noqa: E402
import ddtree  # noqa: E402
from cli import in_flags, one_line_errors  # noqa: E402
from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET, Sampling, Speculation  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from model import Qwen3  # noqa: E402
from settings import check_int, check_models, check_request, check_settings  # noqa: E402


def parse_args(argv):
    p = one_line_errors(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--batch", type=int, default=1, help="requests per batch (a power of two, as generate_batch runs)")
    p.add_argument("--prompt-len", type=int, default=128, help="sizes the cache as a run of this prompt would")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--denoise-steps", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Bad settings are one `error:` line and exit status 2, as on the command line, before anything is stored."""
    try:
        return calibrate(parse_args(argv))
    except (ValueError, TypeError) as e:
        print(f"error: {in_flags(str(e))}", file=sys.stderr)
        return 2


def calibrate(a) -> int:
    """The settings checked as generate(budget="auto") checks a run of them; then the calibration, stored."""
    check_int("--batch", a.batch, 1)
    check_int("--prompt-len", a.prompt_len, 1)
    if a.threads is not None:
        check_int("--threads", a.threads, 1)
    sampling, spec = check_settings("ddtree", Sampling(a.temperature, a.top_k, a.top_p, a.min_p), None,
                                    Speculation(budget="auto", denoise_steps=a.denoise_steps))
    if a.threads:
        torch.set_num_threads(a.threads)
    target = Qwen3.from_pretrained(a.target, device=a.device, dtype=a.dtype)
    drafter = DFlashDrafter.from_pretrained(a.draft, device=target.device, dtype=target.dtype)
    check_models(target, drafter, "ddtree")
    # A run of these settings: the cache this calibration is for must be one that a run can have.
    check_request(target, drafter, [[0] * a.prompt_len], [0], [], "ddtree", a.max_new_tokens, spec, a.compile,
                  None, a.batch)
    budgets = budget.auto_budgets(a.prompt_len, a.max_new_tokens, target)
    length = ddtree.cache_length(a.prompt_len, a.max_new_tokens, "ddtree", spec, drafter, budgets)
    with torch.inference_mode():
        engine = ddtree.get_engine(target, drafter, "ddtree", sampling, spec, length, a.compile, a.batch,
                                   auto=budgets)
        seconds = engine.warm_up(recalibrate=True)
    print(f"{budget.device_name(target.device)}; torch {torch.__version__}, {target.dtype}, "
          f"{'compiled' if a.compile else 'eager'}, batch {a.batch}, {length} cache slots; calibrated in "
          f"{engine.calibrate_seconds:.1f} s ({seconds:.1f} s with compiling the viable candidates)")
    print(engine.curve_table())
    print(f"stored in {budget.cache_file()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
