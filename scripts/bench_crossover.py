"""Where speculation pays on this machine: plain decoding's step beside a DDTree round per budget, compiled, on the
bundled pair and on random pairs of growing size; a round's cost in plain steps is the tau a pair must reach at
that budget just to match plain decoding (its break-even tau).

    python scripts/bench_crossover.py [--sizes bundled 1024x8] [--budgets 4 16 64]
                                      [--mode max-autotune|compile] [--dtype float32|bfloat16]

A size HxL is a random Qwen3 target of hidden size H and L layers (MLP 3H, head_dim 64, vocab 4096) with a
random one-layer DFlash drafter (block 8, reading target layers 1 and L - 2), written in the real checkpoint
formats; `bundled` is the bundled trained pair (256x4 with a two-layer drafter). The engine runs them as
`generate` does. A round costs the same whatever it accepts, up to the few KV rows a commit moves, so random
drafts time it as well as trained ones. The bundled pair (17 MB in fp32) sits in the L3 cache, where a forward
is compute-bound from a few rows on; 1024x8 (109M parameters, 436 MB in fp32) does not, so its plain step
streams the weights from DRAM and a few-row forward can cost little more than one row. DDTree at budget B beats
plain decoding by tau(B) / break-even(B), with tau(B) the pair's measured tokens per round (the bundled pair's:
`scripts/bench_pair.py`, docs/benchmarks.md).

Each engine is compiled first (its compile time is printed apart); then the methods take turns, `--passes`
times, each turn the median of `--steps` steps after a prefill of `--prompt-len` random tokens; the table keeps
each method's fastest turn.
"""

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
from benchlib import save_random_pair, timed, write_json  # noqa: E402
from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET, Engine, Speculation, cache_length  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from model import Qwen3  # noqa: E402
from sampler import Sampling  # noqa: E402

CPU = torch.device("cpu")


def random_pair(out_dir: str, hidden: int, layers: int, dtype):
    """The benchmarks' random pair of `hidden` x `layers` (benchlib.save_random_pair), loaded as the engine loads
    them."""
    return load_pair(*save_random_pair(out_dir, hidden, layers), dtype)


def load_pair(target_path: str, draft_path: str, dtype):
    target = Qwen3.from_pretrained(target_path, device="cpu", dtype=dtype)
    drafter = DFlashDrafter.from_pretrained(draft_path, device="cpu", dtype=dtype).bind(target)
    return target, drafter


def step_ms(engine: Engine, prompt: list, steps: int) -> float:
    """Median milliseconds of `steps` engine steps (rounds, or plain decoding steps) after a prefill of `prompt`
    and one untimed step (benchlib.timed); a step includes its host read, as in `generate`."""
    engine.start([prompt], seeds=[0])
    return timed(engine.step, CPU, steps)[0]


def measure(target, drafter, budgets, mode, prompt_len: int, steps: int, passes: int) -> dict:
    compile = True if mode == "compile" else mode
    prompt = torch.randint(0, target.config.vocab_size - 1, (prompt_len,)).tolist()
    spec = {None: Speculation()} | {b: Speculation(budget=b) for b in budgets}
    # Room for one turn (each starts from the prefill): steps + 2 rounds (timed's warm-up and its last call), each
    # committing at most block_size tokens.
    max_len = cache_length(prompt_len, (steps + 2) * drafter.block_size, "ddtree", spec[max(budgets)], drafter)
    engines, compile_s = {}, {}
    for b in spec:  # compile each engine first, so that the turns below time generation alone
        engines[b] = Engine(target, None if b is None else drafter, "ar" if b is None else "ddtree", Sampling(),
                            spec[b], max_len, compile)
        compile_s[b] = engines[b].warm_up()
    ms = {b: float("inf") for b in spec}
    for _ in range(passes):
        for b in spec:
            ms[b] = min(ms[b], step_ms(engines[b], prompt, steps))
    return {"ar_ms": ms[None], "round_ms": {b: ms[b] for b in budgets},
            "break_even_tau": {b: ms[b] / ms[None] for b in budgets},
            "compile_s": {"ar" if b is None else b: s for b, s in compile_s.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["bundled", "1024x8"],
                   help="HIDDENxLAYERS per random pair, or bundled")
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--mode", choices=["max-autotune", "compile"], default="max-autotune",
                   help="compile as --max-autotune or as --compile does")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    out = {"args": vars(a), "threads": torch.get_num_threads(), "torch": torch.__version__, "sizes": {}}
    dtype = getattr(torch, a.dtype)
    print(f"{out['threads']} threads, {a.dtype}, compiled as --{a.mode}; break-even tau = round ms / plain step ms")
    print(f"{'pair':>8s} {'params':>8s} {'MB':>6s} {'AR ms':>7s} " +
          " ".join(f"{'B=' + str(b) + ' ms':>9s} {'tau*':>5s}" for b in a.budgets))
    for size in a.sizes:
        with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
            if size == "bundled":
                target, drafter = load_pair(DEFAULT_TARGET, DEFAULT_DRAFT, dtype)
            else:
                hidden, layers = (int(x) for x in size.split("x"))
                target, drafter = random_pair(tmp, hidden, layers, dtype)
            params = sum(t.numel() for t in target.parameters())
            r = measure(target, drafter, a.budgets, a.mode, a.prompt_len, a.steps, a.passes)
        megabytes = params * dtype.itemsize / 1e6
        r.update(params=params, megabytes=megabytes)
        out["sizes"][size] = r
        print(f"{size:>8s} {params / 1e6:7.1f}M {megabytes:6.0f} {r['ar_ms']:7.2f} " +
              " ".join(f"{r['round_ms'][b]:9.2f} {r['break_even_tau'][b]:5.2f}" for b in a.budgets), flush=True)
        print(f"{'':>8s} compile s: " + ", ".join(f"{k}: {v:.0f}" for k, v in r["compile_s"].items()), flush=True)
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
