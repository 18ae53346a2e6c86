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
from checkpoints import qwen3_config, random_qwen3_weights, save_checkpoint  # noqa: E402
from ddtree import generate  # noqa: E402
from model import Qwen3  # noqa: E402


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


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
    config = qwen3_config(a.vocab, hidden=a.hidden, inter=3 * a.hidden, layers=a.layers, heads=a.hidden // 64,
                          kv_heads=max(1, a.hidden // 128), head_dim=64)
    save_checkpoint(path, config, random_qwen3_weights(config))
    ours = Qwen3.from_pretrained(path, device="cpu")
    prompt = torch.randint(0, a.vocab, (a.prompt_len,)).tolist()

    from transformers import Qwen3ForCausalLM
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def run_hf():
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new, min_new_tokens=a.new,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, a.prompt_len:].tolist()

    def run_ours(compile):
        return lambda: generate(ours, None, prompt, method="ar", max_new_tokens=a.new, stop_ids=[],
                                compile=compile).tokens

    rows = []
    t_hf, ref = best_of(run_hf, a.repeats)
    rows.append(("transformers generate", t_hf, ref))
    rows.append(("ours eager",) + best_of(run_ours(False), a.repeats))
    t = time.perf_counter()
    run_ours(True)()  # compile (not timed below)
    print(f"compile + first run: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    rows.append(("ours compiled",) + best_of(run_ours(True), a.repeats))

    print(f"random Qwen3: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, fp32, CPU "
          f"({torch.get_num_threads()} threads), prompt {a.prompt_len}, {a.new} new tokens, best of {a.repeats}")
    print(f"{'':24s} {'tokens/s':>9s} {'vs transformers':>16s} {'same tokens':>12s}")
    for name, seconds, tokens in rows:
        print(f"{name:24s} {a.new / seconds:9.1f} {t_hf / seconds:15.2f}x {str(tokens == ref):>12s}")


if __name__ == "__main__":
    main()
