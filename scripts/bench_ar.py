"""Autoregressive decoding speed: our eager and compiled AR beside transformers' generate, on the same random
Qwen3 weights, in one run (ratios are what to read: machines here are noisy).

    python scripts/bench_ar.py [--layers 4 --hidden 256 --vocab 8192 --new 128 --repeats 3]
"""

import argparse
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench import save_random_target  # noqa: E402
from ddtree import generate  # noqa: E402
from model import Qwen3  # noqa: E402


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


def print_rows(rows, new):
    t_hf, ref = rows[0][1], rows[0][2]
    print(f"{'':24s} {'tokens/s':>9s} {'vs transformers':>16s} {'same tokens':>12s}")
    for name, seconds, tokens in rows:
        print(f"{name:24s} {new / seconds:9.1f} {t_hf / seconds:15.2f}x {str(tokens == ref):>12s}")


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
