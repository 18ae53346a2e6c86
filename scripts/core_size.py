"""The size of the dense core, measured from outside (issue: the dense core alone; docs/benchmarks.md, "Core size"):

    python scripts/core_size.py [--json FILE]

1. imported: a dense greedy + sampled generation on the bundled pair (eager, a few tokens, in a child process that
   imports only what such a run needs), and the repository modules it imported (tests/ and scripts/ aside), each
   with its non-blank lines; the CPU seam (cpu/) is counted apart.
2. cycles: the import cycles among the engine modules (the repository's top-level modules and packages), from the
   imports each makes at its top level (inside if / try / with blocks too), and again with the imports deferred
   into functions and classes counted (a deferred import only hides a cycle); an `if __name__ == "__main__":`
   block (an entry stub) is never counted. The family modules families.py imports by name are listed apart: the
   core's hand-over to a family, by design (docs/families.md, "The hand-over").
3. core: the non-blank lines of the core six files.

Standard library only: the child process is the only one that imports torch.
"""

import argparse
import ast
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("ddtree.py", "model.py", "drafter.py", "draft_tree.py", "tree_attn.py", "sampler.py")
SEAM = "cpu"  # the CPU-only seam, counted apart
NOT_ENGINE = {"tests", "scripts"}

# The child: a dense target and a DFlash 1 drafter, greedy then sampled, eager; prints the files of every module
# it imported. Prompt ids are given directly: the tokenizer is the caller's, not the engine's.
CHILD = """
import json, sys
sys.path.insert(0, ROOT)
from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET, generate
from drafter import DFlashDrafter
from model import Qwen3
target = Qwen3.from_pretrained(DEFAULT_TARGET)
drafter = DFlashDrafter.from_pretrained(DEFAULT_DRAFT)
prompt = list(range(10, 42))
greedy = generate(target, drafter, prompt, budget=16, max_new_tokens=8)
sampled = generate(target, drafter, prompt, budget=16, max_new_tokens=8, temperature=0.8, seed=0)
assert len(greedy.tokens) == len(sampled.tokens) == 8, (greedy.tokens, sampled.tokens)
print(json.dumps([getattr(m, "__file__", None) for m in list(sys.modules.values())]))
"""


def non_blank_lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def repo_module(path: str | None, root: str) -> str | None:
    """The path of a module's file relative to the repository, or None when it lies outside it (or in a hidden
    folder, such as a virtual environment kept inside the repository)."""
    if not path or not os.path.isabs(path) or not os.path.isfile(path):  # torch.classes' is "_classes.py"
        return None
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    parts = rel.split(os.sep)
    if parts[0] == os.pardir or any(p.startswith(".") or p == "site-packages" for p in parts):
        return None
    return rel


def imported_modules(root: str = ROOT) -> list[str]:
    """The repository files (relative paths) of the modules a dense greedy + sampled run imports, tests/ and scripts/
    aside."""
    env = dict(os.environ, PYTHONPATH=root)
    child = subprocess.run([sys.executable, "-c", f"ROOT = {root!r}\n" + CHILD], cwd=root, env=env,
                           capture_output=True, text=True)
    if child.returncode != 0:
        raise RuntimeError(f"the dense run failed (exit {child.returncode}): {child.stderr.strip()[-2000:]}")
    files = json.loads(child.stdout.strip().splitlines()[-1])
    found = {repo_module(f, root) for f in files} - {None}
    return sorted(f for f in found if f.split(os.sep)[0] not in NOT_ENGINE)


def engine_modules(root: str = ROOT) -> dict[str, list[str]]:
    """Module name -> its files: the repository's top-level .py files and packages (a folder with __init__.py: all
    its .py files), tests/, scripts/ and hidden folders aside."""
    modules = {}
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if entry.endswith(".py") and os.path.isfile(path):
            modules[entry[:-3]] = [path]
        elif (os.path.isdir(path) and not entry.startswith(".") and entry not in NOT_ENGINE
              and os.path.isfile(os.path.join(path, "__init__.py"))):
            modules[entry] = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".py"))
    return modules


def is_main_block(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":`, the entry stub a module may import its command line from."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def imported_names(tree: ast.Module, package: str | None, deferred: bool) -> set[str]:
    """The first component of every module imported (a relative import: `package`): at the top level (inside if /
    try / with blocks too), and with `deferred` also inside functions and classes; never in an
    `if __name__ == "__main__":` block."""
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(package if node.level else node.module.split(".")[0])
        elif is_main_block(node):
            continue
        elif deferred:
            todo.extend(n for n in ast.iter_child_nodes(node) if not isinstance(n, ast.expr))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ExceptHandler)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []))
    return names - {None}


def import_graph(root: str = ROOT, deferred: bool = False) -> dict[str, set[str]]:
    """Engine module -> the engine modules it imports (imported_names)."""
    modules = engine_modules(root)
    graph = {}
    for name, files in modules.items():
        package = name if files[0].endswith("__init__.py") or len(files) > 1 else None
        imports = set()
        for path in files:
            with open(path, encoding="utf-8") as f:
                imports |= imported_names(ast.parse(f.read(), path), package, deferred)
        graph[name] = {m for m in imports if m in modules and m != name}
    return graph


def import_cycles(root: str = ROOT, deferred: bool = False, limit: int = 100) -> list[list[str]]:
    """The elementary cycles of the import graph (at most `limit`), each as its modules from the smallest name,
    in import order: ["a", "b"] is a -> b -> a."""
    graph = import_graph(root, deferred)
    cycles = []

    def walk(start, node, path):
        for nxt in sorted(graph[node]):
            if nxt == start:
                cycles.append(list(path))
            elif nxt > start and nxt not in path and len(cycles) < limit:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return cycles[:limit]


def hand_overs(root: str = ROOT) -> list[str]:
    """The family modules families.py imports by name (families.family("name")): the core's one way to a family,
    which no import statement shows."""
    tree = ast.parse(open(os.path.join(root, "families.py"), encoding="utf-8").read())
    return sorted({node.args[0].value for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "family"
                   and node.args and isinstance(node.args[0], ast.Constant)})


def measure(root: str = ROOT) -> dict:
    imported = {f: non_blank_lines(os.path.join(root, f)) for f in imported_modules(root)}
    core = {f: non_blank_lines(os.path.join(root, f)) for f in CORE}
    engine = {f: n for f, n in imported.items() if f.split(os.sep)[0] != SEAM}
    seam = {f: n for f, n in imported.items() if f.split(os.sep)[0] == SEAM}
    return {"imported": engine, "imported_lines": sum(engine.values()), "seam": seam,
            "seam_lines": sum(seam.values()), "cycles": import_cycles(root),
            "cycles_deferred": import_cycles(root, deferred=True), "core": core,
            "core_lines": sum(core.values()), "hand_overs": hand_overs(root)}


def print_report(r: dict):
    print(f"1. a dense greedy + sampled run imports {len(r['imported'])} repository modules, "
          f"{r['imported_lines']} non-blank lines (the CPU seam apart: {len(r['seam'])} module(s), "
          f"{r['seam_lines']} lines)")
    for f, n in sorted(r["imported"].items(), key=lambda kv: -kv[1]):
        print(f"   {f:<24} {n:>6}")
    for f, n in r["seam"].items():
        print(f"   ({f}){'':<{max(0, 22 - len(f))}} {n:>6}")
    print(f"2. import cycles among engine modules: {len(r['cycles'])} through top-level imports, "
          f"{len(r['cycles_deferred'])} with the imports deferred into functions")
    for cycle in r["cycles_deferred"]:
        print("   " + " -> ".join(cycle + cycle[:1]) + ("" if cycle in r["cycles"] else "   (deferred)"))
    print(f"   families.py hands over by name to: {', '.join(r['hand_overs'])}")
    print(f"3. the core six files: {r['core_lines']} non-blank lines")
    for f, n in r["core"].items():
        print(f"   {f:<24} {n:>6}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", metavar="FILE", help="write the measurements to FILE as JSON")
    args = p.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        print(f"error: --json {args.json}: its folder does not exist", file=sys.stderr)
        return 2
    try:
        report = measure()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_report(report)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        except OSError as e:
            print(f"error: --json {args.json}: {e.strerror}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
