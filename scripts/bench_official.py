"""Our DDTree beside the official DDTree loop (github.com/liranringel/ddtree) on the same weights and prompts, on
the CPU: greedy tokens compared, tokens/s side by side per budget.

    git clone https://github.com/liranringel/ddtree /path/to/official   # not a dependency of this project
    pip install loguru                                                   # the official code logs with it
    python scripts/bench_official.py --official /path/to/official [--budgets 4 16 64] [--prompts 4]

The official code targets CUDA and transformers 4; it runs here, in a child process of its own (its `ddtree.py`
and `model` package would shadow ours), with four in-process patches, none of which touches its algorithm:
its CUDA-synchronizing timer becomes time.perf_counter; `datasets` (imported only to load benchmark data) is
stubbed; DynamicCache.crop(length) is translated to transformers 5's crop(-tokens_to_remove); and the models load
in float32 on the CPU. Both sides run the bundled pair by default (our checkpoints are in the formats the official
code reads: a Hugging Face Qwen3 and a z-lab DFlash drafter), greedy, prefill included in the time, after one
warm-up call per budget, the fastest of --passes passes; ours in each of --modes (eager, compiled as the CLI's
`--compile`, and max-autotune as its `--max-autotune`).
Note: the official loop drops every generated token equal to the drafter's mask token id from its output
(`output_ids[0] != mask_token_id`), so its token list can be shorter where that id is generated.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from settings import grouped  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def official_child(path: str, request: dict) -> dict:
    """Runs in the child process: the official ddtree_generate over the prompts, per budget."""
    import types
    sys.modules["datasets"] = types.SimpleNamespace(load_dataset=None, Features=None, Sequence=None, Value=None)
    sys.path.insert(0, path)
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    torch.set_num_threads(request["threads"])
    import dflash as off_dflash  # noqa: the official modules
    import ddtree as off_ddtree
    from model import DFlashDraftModel
    off_dflash.cuda_time = off_ddtree.cuda_time = time.perf_counter
    crop = DynamicCache.crop

    def crop_to_length(self, max_length):
        if max_length < 0:
            return crop(self, max_length)
        extra = self.get_seq_length() - max_length
        if extra > 0:
            crop(self, -extra)
    DynamicCache.crop = crop_to_length
    target = AutoModelForCausalLM.from_pretrained(request["target"], dtype=torch.float32).eval()
    drafter = DFlashDraftModel.from_pretrained(request["draft"], dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for budget in request["budgets"]:
            def run(ids):
                return off_ddtree.ddtree_generate(drafter, target, torch.tensor([ids]), drafter.mask_token_id,
                                                  request["new_tokens"], drafter.block_size, [], 0.0,
                                                  tree_budget=budget)
            run(request["prompts"][0])  # warm-up
            best = None
            for _ in range(request["passes"]):
                tokens, seconds = [], 0.0
                for ids in request["prompts"]:
                    t0 = time.perf_counter()
                    res = run(ids)
                    seconds += time.perf_counter() - t0
                    tokens.append(res.output_ids[0, res.num_input_tokens:].tolist())
                if best is None or seconds < best["seconds"]:
                    best = dict(tokens=tokens, seconds=seconds)
            out[str(budget)] = best
    return out


def ours(target_path, draft_path, prompts, budgets, new_tokens, compile, passes) -> dict:
    from ddtree import generate
    from drafter import DFlashDrafter
    from model import Qwen3
    target = Qwen3.from_pretrained(target_path, device="cpu")
    drafter = DFlashDrafter.from_pretrained(draft_path, device="cpu")
    out = {}
    for budget in budgets:
        kw = dict(method="ddtree", budget=budget, max_new_tokens=new_tokens, stop_ids=[], compile=compile)
        generate(target, drafter, prompts[0], **grouped(kw))  # warm-up (compile)
        best = None
        for _ in range(passes):
            runs = [generate(target, drafter, p, **grouped(kw)) for p in prompts]
            seconds = sum(r.stats["seconds"] for r in runs)
            if best is None or seconds < best["seconds"]:
                best = dict(tokens=[r.tokens for r in runs], seconds=seconds)
        out[str(budget)] = best
    return out


MODES = {"eager": False, "compiled": True, "max-autotune": "max-autotune"}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--official", required=True, help="a checkout of github.com/liranringel/ddtree")
    p.add_argument("--target", default=os.path.join(ROOT, "assets", "tiny-target"))
    p.add_argument("--draft", default=os.path.join(ROOT, "assets", "tiny-draft"))
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=3, help="passes over the prompts per side; the fastest counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["eager", "compiled"],
                   help="how ours runs: eager, compiled (--compile, as the CLI), max-autotune (--max-autotune)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(official_child(a.official, json.load(sys.stdin))))
        return
    sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
    import torch
    from benchlib import held_out_code
    from text import Text
    torch.set_num_threads(a.threads)
    prompts = held_out_code(Text(a.target), a.prompts, 64, 160, a.seed)
    request = dict(target=a.target, draft=a.draft, budgets=a.budgets, prompts=prompts, new_tokens=a.new_tokens,
                   threads=a.threads, passes=a.passes)
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--official", a.official, "--child"],
                           input=json.dumps(request), capture_output=True, text=True, cwd=a.official)
    if child.returncode:
        raise SystemExit(f"the official loop failed:\n{child.stderr[-3000:]}")
    official = json.loads(child.stdout.strip().splitlines()[-1])
    runs = {"official": official}
    for mode in a.modes:
        runs[f"ours {mode}"] = ours(a.target, a.draft, prompts, a.budgets, a.new_tokens, MODES[mode], a.passes)
    print(f"greedy DDTree, {a.prompts} held-out prompts x {a.new_tokens} new tokens, {a.threads} threads, CPU; "
          f"tokens/s (prefill included, the fastest of {a.passes} passes), speedup over the official loop, "
          f"tokens equal to the official loop's")
    print(f"{'B':>5s} " + " ".join(f"{name:>22s}" for name in runs))
    for budget in map(str, a.budgets):
        cells = []
        base = official[budget]
        for name, r in runs.items():
            tps = sum(map(len, r[budget]["tokens"])) / r[budget]["seconds"]
            same = sum(x == y for x, y in zip(r[budget]["tokens"], base["tokens"]))
            speed = tps / (sum(map(len, base["tokens"])) / base["seconds"])
            cells.append(f"{tps:8.1f} {speed:5.2f}x {same}/{len(prompts)} eq")
        print(f"{budget:>5s} " + " ".join(f"{c:>22s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
