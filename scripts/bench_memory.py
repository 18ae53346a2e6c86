"""Peak memory of one request at the paper's budget over Qwen3's vocabulary, greedy beside sampled: a random
2-layer target of vocabulary 151,936 (hidden 64, benchlib.save_random_pair) and a block-16 drafter, eager on the CPU, B = 512, 4 new tokens,
sampled with temperature 1 and top-p 0.95. Each case runs in a fresh process; its cost is the growth of the
process's peak resident set (ru_maxrss) over what loading the pair took. --all-rows warps and samples every
verified row at once (sampler.ROW_CHUNK_ELEMENTS unbounded), as the engine did before sampling went by chunks.

    python scripts/bench_memory.py [--json out/memory.json]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from settings import grouped  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

VOCAB = 151936


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one_case(root, sampled, all_rows):
    """In this process: load, then one generate; prints the peak's growth in MB."""
    import torch
    import sampler
    from ddtree import generate
    from drafter import DFlashDrafter
    from model import Qwen3
    if all_rows:
        sampler.ROW_CHUNK_ELEMENTS = 2**62
    torch.set_num_threads(1)
    target = Qwen3.from_pretrained(os.path.join(root, "target"), device="cpu")
    drafter = DFlashDrafter.from_pretrained(os.path.join(root, "draft"), device="cpu")
    kw = dict(temperature=1.0, top_p=0.95, seed=0) if sampled else {}
    # imports, caches
    generate(target, drafter, list(range(5, 25)), budget=16, max_new_tokens=2, stop_ids=[], **grouped(kw))
    before = peak_mb()
    res = generate(target, drafter, list(range(5, 25)), budget=512, max_new_tokens=4, stop_ids=[], **grouped(kw))
    print(json.dumps(dict(growth_mb=peak_mb() - before, tokens=res.tokens)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--case", nargs=3, help=argparse.SUPPRESS)  # root sampled all_rows: run one case here
    a = p.parse_args()
    if a.case:
        return one_case(a.case[0], a.case[1] == "1", a.case[2] == "1")
    out = {}
    with tempfile.TemporaryDirectory() as root:
        from benchlib import save_random_pair
        save_random_pair(root, hidden=64, layers=2, vocab=VOCAB, block_size=16)
        for name, sampled, all_rows in (("greedy", 0, 0), ("sampled", 1, 0), ("sampled, all rows at once", 1, 1)):
            line = subprocess.run([sys.executable, __file__, "--case", root, str(sampled), str(all_rows)],
                                  capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            out[name] = json.loads(line)
            print(f"{name:28s} peak growth {out[name]['growth_mb']:8.0f} MB  tokens {out[name]['tokens']}",
                  flush=True)
    g = out["greedy"]["growth_mb"]
    print(f"sampled / greedy: {out['sampled']['growth_mb'] / g:.2f}x (all rows at once: "
          f"{out['sampled, all rows at once']['growth_mb'] / g:.2f}x); the sampled draws are "
          f"{'identical' if out['sampled']['tokens'] == out['sampled, all rows at once']['tokens'] else 'DIFFERENT'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
