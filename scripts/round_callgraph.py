"""What one DDTree round crosses: the repository's own functions that one round runs, per file, and the deepest
chain of calls from generate() to the attention. A reader's measure of how far one round spreads.

    python scripts/round_callgraph.py [--budget 16] [--eager-tree] [--list]

The round runs eagerly on the bundled pair (CPU), with the tree builder a compiled engine uses (draft_tree.build_tree;
--eager-tree: the heap an eager engine uses), so the functions are those a compiled round traces. Counted are named
functions and methods defined in the repository's .py files (comprehensions and lambdas apart), each once.
"""

import argparse
import collections
import inspect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import ddtree  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from model import Qwen3  # noqa: E402


def profile_round(target, drafter, budget: int):
    """(functions: {(file, qualified name): source lines}, the deepest stack into Attention.attend)."""
    seen, stack, deepest, inside = {}, [], [], [False]

    def hook(frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(ROOT) or os.sep + "tests" + os.sep in code.co_filename or \
                os.sep + ".venv" + os.sep in code.co_filename:
            return
        if event == "call":
            stack.append(code.co_name)
            inside[0] = inside[0] or code.co_name == "_round"
            if inside[0]:
                try:
                    lines = len(inspect.getsourcelines(code)[0])
                except OSError:
                    lines = 0
                seen[(os.path.relpath(code.co_filename, ROOT), code.co_qualname)] = lines
            if code.co_qualname == "Attention.attend" and len(stack) > len(deepest):
                deepest[:] = stack
        elif event == "return":
            if stack:
                stack.pop()
            if code.co_name == "_round":
                inside[0] = False

    prompt = list(range(5, 40))
    ddtree.generate(target, drafter, prompt, budget=budget, max_new_tokens=3)  # imports, caches
    sys.setprofile(hook)
    try:
        ddtree.generate(target, drafter, prompt, budget=budget, max_new_tokens=2)  # the prefill, then one round
    finally:
        sys.setprofile(None)
    return seen, deepest


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--eager-tree", action="store_true", help="the heap builder (an eager engine's) instead")
    p.add_argument("--list", action="store_true", help="print every function")
    a = p.parse_args()
    if not a.eager_tree:
        ddtree.build_tree_heap = ddtree.build_tree  # what the engine picks when eager: the compiled round's builder
    target = Qwen3.from_pretrained(ddtree.DEFAULT_TARGET, device="cpu")
    drafter = DFlashDrafter.from_pretrained(ddtree.DEFAULT_DRAFT, device="cpu")
    with torch.inference_mode():
        seen, deepest = profile_round(target, drafter, a.budget)
    named = {k: v for k, v in seen.items() if "<" not in k[1]}
    files = collections.Counter(f for f, _ in named)
    print(f"one round (B = {a.budget}): {len(named)} named functions ({sum(named.values())} lines) in {len(files)} "
          f"files: {', '.join(f'{f} {n}' for f, n in files.most_common())}")
    start = deepest.index("generate") if "generate" in deepest else 0
    print(f"generate -> attention: {len(deepest) - start} frames: {' > '.join(deepest[start:])}")
    if a.list:
        for (f, name), lines in sorted(named.items()):
            print(f"  {f:16s} {name:40s} {lines:4d} lines")


if __name__ == "__main__":
    main()
