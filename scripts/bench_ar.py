"""Autoregressive decoding speed: our eager and compiled AR beside transformers' generate, on the same random
Qwen3 weights, in one run (ratios are what to read: machines here are noisy).

    python scripts/bench_ar.py [--layers 4 --hidden 256 --vocab 8192 --new 128 --repeats 3]
"""

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from benchlib import compare, print_rows, save_random_target  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for every contender")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    path = tempfile.mkdtemp()
    save_random_target(path, a.vocab, a.hidden, a.layers)
    prompt = torch.randint(0, a.vocab, (a.prompt_len,)).tolist()
    rows = compare(path, prompt, a.new, a.repeats)
    print(f"random Qwen3: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, fp32, CPU "
          f"({torch.get_num_threads()} threads), prompt {a.prompt_len}, {a.new} new tokens, best of {a.repeats}")
    print_rows(rows, a.new)


if __name__ == "__main__":
    main()
