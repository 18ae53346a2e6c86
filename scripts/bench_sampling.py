"""What a sampled round's per-row work costs at a real vocabulary: warping (temperature, top-k, top-p), drawing the
uniforms and the inversion draw, for verify-sized blocks of rows, eager, as a table.

    python scripts/bench_sampling.py [--vocab 151936] [--rows 17 65] [--threads 2] [--repeats 3]

Rows of 17 and 65 are the verify rows of B = 16 and 64 trees; 151936 is Qwen3's vocabulary.
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
from benchlib import best_of  # noqa: E402
from sampler import Sampling, draw_noise, sample, warp_probs  # noqa: E402

SETTINGS = (("T 0.6, top-k 20, top-p 0.95", Sampling(0.6, 20, 0.95)),  # Qwen3's recommended thinking-mode values
            ("T 0.6, top-p 0.95", Sampling(0.6, top_p=0.95)),
            ("T 1", Sampling(1.0)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", type=int, nargs="+", default=[17, 65])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(f"vocab {a.vocab}, {a.threads} threads, eager, best of {a.repeats} (ms)")
    print(f"{'rows':>5s}  {'setting':30s} {'warp':>8s} {'draw':>8s} {'sample':>8s} {'total':>8s}")
    for rows in a.rows:
        logits = 3 * torch.randn(rows, a.vocab, generator=g)
        for name, s in SETTINGS:
            warp, probs = best_of(lambda: warp_probs(logits, s), a.repeats)
            draw, u = best_of(lambda: draw_noise((rows,), g, "cpu"), a.repeats)
            pick, _ = best_of(lambda: sample(probs, u), a.repeats)
            total, _ = best_of(lambda: sample(warp_probs(logits, s), draw_noise((rows,), g, "cpu")), a.repeats)
            print(f"{rows:5d}  {name:30s} {warp * 1e3:8.2f} {draw * 1e3:8.3f} {pick * 1e3:8.2f} {total * 1e3:8.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
