"""Every measurement of the engine, one command each:

    python scripts/bench.py COMMAND [options]       (python scripts/bench.py COMMAND --help: what it measures, how)

The cost of one round and of its parts (their code: scripts/bench_round.py)
  round       where a DDTree round's time goes, stage by stage, per budget, on a random pair; tree building alone;
              --scorecard: the compiled fast path's CPU goals
  roofline    each stage of a compiled round beside its floor on this machine (bytes / bandwidth, FLOPs / peak)
  crossover   plain decoding's step beside a DDTree round per budget: the tau a pair must reach to break even
  sampling    a sampled round's per-row work at a real vocabulary: warping, drawing, sampling
  kernels     what a compiled decode step launches (fused kernels, GEMMs), per layer
  callgraph   the functions one round runs, the deepest chain from generate() to the attention, a whole generate()
  ar          our eager and compiled AR beside transformers' generate on the same random weights

Models side by side (scripts/bench_models.py)
  pair        AR, the DFlash chain and DDTree on a trained pair: tau, tokens/s, the round split; --only-batches:
              generate_batch at growing batch sizes; --only-auto: budget auto beside every fixed choice
  context     DDTree's tau against prompt length (0.5K-8K), with and without the drafter's window; prefill tokens/s
  official    our DDTree beside the official DDTree loop on the same weights and prompts
  moe         a Qwen3-MoE target beside the dense one of the same active size
  hybrid      the verify forward through a hybrid target beside the dense one: time, peak memory, recurrent share
  memory      one request's peak memory at B = 512 over Qwen3's vocabulary, greedy beside sampled
  calibrate   budget auto's calibration for a pair on this device, stored in the cost cache, and its curve
  moe-parallel  one MoE layer over torchrun's ranks, every expert split beside expert parallel, per verify rows

The engine's size and behaviour, for a refactor to keep or shrink (their code: here)
  size        the lines a dense greedy + sampled run imports, the import cycles among engine modules, the core six
              files' lines (the dense core's size, measured from outside)
  fingerprint one sha256 per case of every family's greedy and sampled tokens, per-round acceptance and path
              lengths, eager and compiled: the same table before and after a refactor that changes no behaviour

The paper's benchmark (scripts/bench_datasets.py)
  datasets    Table 1 on the paper's datasets (MATH-500, GSM8K, AIME, HumanEval, MBPP, LiveCodeBench, SWE-bench,
              MT-Bench, Alpaca): tau and speedup over AR per method and budget, every greedy output checked equal
              to AR's, HumanEval's pass@1 (--score), a JSON of every response, plots; data parallel under torchrun

The library they share is scripts/benchlib.py; docs/benchmarks.md holds what each measured, when and on which
machine. Bad options are one `error:` line and exit status 2, as on ddtree.py's command line; counts must be at
least 1, and --json / --out must be writable: both are checked before anything is measured.
"""

import argparse
import ast
import hashlib
import inspect
import json
import os
import subprocess
import sys
import tempfile

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]
import bench_datasets  # noqa: E402
import bench_models  # noqa: E402
import bench_round  # noqa: E402
import torch  # noqa: E402

from benchlib import ROOT, check_writable, write_json  # noqa: E402
from checkpoints import (dflash_config, hybrid_text_config, moe_config, qwen3_config,  # noqa: E402
                         random_dflash_weights, random_hybrid_model, random_qwen3_weights, save_checkpoint)
from cli import in_flags, one_line_errors  # noqa: E402
from ddtree import generate_batch  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from model import Qwen3  # noqa: E402

# ------------------------------------------------------------------------------------------ size: the dense core


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


def hand_overs(root: str = ROOT) -> dict[str, list[str]]:
    """{module imported by name: the engine modules that name it}: every families.family("name") call (family("name")
    inside families.py), the core's one way to a family or an optional module, which no import statement shows."""
    found = {}
    for module, files in engine_modules(root).items():
        for file in files:
            tree = ast.parse(open(file, encoding="utf-8").read())
            for node in ast.walk(tree):
                func = node.func if isinstance(node, ast.Call) else None
                by_name = getattr(func, "id", None) == "family" or (
                    getattr(func, "attr", None) == "family" and getattr(func.value, "id", None) == "families")
                if by_name and node.args and isinstance(node.args[0], ast.Constant):
                    found.setdefault(node.args[0].value, set()).add(module)
    return {name: sorted(modules) for name, modules in sorted(found.items())}


def all_lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def measure(root: str = ROOT) -> dict:
    """Every number of the size command's report, as its --json writes them."""
    imported = {f: non_blank_lines(os.path.join(root, f)) for f in imported_modules(root)}
    core = {f: non_blank_lines(os.path.join(root, f)) for f in CORE}
    engine = {f: n for f, n in imported.items() if f.split(os.sep)[0] != SEAM}
    seam = {f: n for f, n in imported.items() if f.split(os.sep)[0] == SEAM}
    return {"imported": engine, "imported_lines": sum(engine.values()), "seam": seam,
            "seam_lines": sum(seam.values()), "cycles": import_cycles(root),
            "cycles_deferred": import_cycles(root, deferred=True), "core": core,
            "core_lines": sum(core.values()),
            "core_all_lines": sum(all_lines(os.path.join(root, f)) for f in CORE), "hand_overs": hand_overs(root)}


def print_size(r: dict):
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
    print("   imported by name (families.family; no edge above): " +
          ", ".join(f"{name} (from {', '.join(by)})" for name, by in r["hand_overs"].items()))
    print(f"3. the core six files: {r['core_lines']} non-blank lines, {r['core_all_lines']} with blank lines")
    for f, n in r["core"].items():
        print(f"   {f:<24} {n:>6}")


def size_options(p):
    p.add_argument("--json", metavar="FILE", help="write the measurements to FILE as JSON")


def size(a):
    """The size of the dense core, measured from outside (issue 61, the dense core alone; docs/benchmarks.md,
    "Core size"):

        python scripts/bench.py size [--json FILE]

    1. imported: a dense greedy + sampled generation on the bundled pair (eager, a few tokens, in a child process
       that imports only what such a run needs), and the repository modules it imported (tests/ and scripts/
       aside), each with its non-blank lines; the CPU seam (cpu/) is counted apart.
    2. cycles: the import cycles among the engine modules (the repository's top-level modules and packages), from
       the imports each makes at its top level (inside if / try / with blocks too), and again with the imports
       deferred into functions and classes counted (a deferred import only hides a cycle); an
       `if __name__ == "__main__":` block (an entry stub) is never counted. The family modules families.py imports
       by name are listed apart: the core's hand-over to a family, by design (docs/families.md, "The hand-over").
    3. core: the non-blank lines of the core six files.

    Exit status 1 with one `error:` line when the dense run fails.
    """
    try:
        report = measure()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_size(report)
    if a.json:
        write_json(a.json, report)


# ------------------------------------------------------------------------------------------ fingerprint


ASSETS = os.path.join(ROOT, "assets")
PROMPT_SEED = 7


def write_pairs(root: str) -> dict:
    """Random target/drafter checkpoints of every family under root: name -> (target dir, drafter dir, vocab)."""
    pairs = {"bundled": (os.path.join(ASSETS, "tiny-target"), os.path.join(ASSETS, "tiny-draft"), None),
             "dflash2": (os.path.join(ASSETS, "tiny-target"), os.path.join(ASSETS, "tiny-draft2"), None)}
    vocab = 16
    dense = qwen3_config(vocab, hidden=64, inter=96, layers=3, heads=4, kv_heads=2, head_dim=16, eos=(1, 0))
    families = {"moe": moe_config(dense, experts=4, top_k=2, inter=32, sparse_step=1, mlp_only=[0]),
                "yarn": dict(dense, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 1024})}
    for name, tc in families.items():
        t, d = os.path.join(root, name, "target"), os.path.join(root, name, "draft")
        save_checkpoint(t, tc, random_qwen3_weights(tc, seed=0, std=0.35), eos_ids=[1])
        dc = dflash_config(dict(tc, rope_scaling=None), layers=2, block_size=5, target_layer_ids=[0, 2])
        save_checkpoint(d, dc, random_dflash_weights(dc, seed=5, std=0.35))
        pairs[name] = (t, d, vocab)
    for name, moe in (("hybrid", False), ("hybrid_moe", True)):
        text = hybrid_text_config(moe, vocab_size=vocab, full_attention_interval=2)
        hf = random_hybrid_model(text, moe, seed=0, std=0.3)
        t, d = os.path.join(root, name, "target"), os.path.join(root, name, "draft")
        hf.save_pretrained(t)
        tc = hf.config.to_dict()
        dc = dflash_config({**tc, "rope_theta": 10000.0}, layers=2, block_size=5, target_layer_ids=[0, 1, 2], inter=96)
        save_checkpoint(d, dc, random_dflash_weights(dc, seed=3, std=0.2))
        pairs[name] = (t, d, vocab)
    return pairs


def prompts(vocab: int | None, n: int) -> list:
    """n prompts of 3 to 11 ids below the vocabulary (1000 for a tokenizer's checkpoint), the same every run."""
    g = torch.Generator().manual_seed(PROMPT_SEED)
    high = vocab or 1000
    return [torch.randint(2, high, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def cases(eager_only: bool):
    """(pair, method, settings, compile) of every case: each family greedy and sampled through ddtree, dflash and
    ar eagerly, a batch, and the compiled round where it is cheap enough to compile once per family."""
    for pair in ("bundled", "dflash2", "moe", "yarn", "hybrid", "hybrid_moe"):
        yield pair, "ar", {}, False
        yield pair, "dflash", {}, False
        yield pair, "ddtree", dict(budget=16), False
        yield pair, "ddtree", dict(budget=16, temperature=0.8, seed=3), False
        yield pair, "ddtree", dict(budget=16, batch=3, temperature=0.8, seed=5), False
    if not eager_only:
        for pair in ("bundled", "dflash2", "moe", "hybrid"):
            yield pair, "ddtree", dict(budget=16), True
        yield "bundled", "ddtree", dict(budget=16, temperature=0.8, seed=3), True


def run_case(target, drafter, vocab, method, settings, compile) -> dict:
    settings = dict(settings)
    n = settings.pop("batch", 1)
    kw = dict(method=method, max_new_tokens=40, stop_ids=[], compile=compile, **settings)
    if method == "ar":
        kw.pop("budget", None)
        drafter = None
    if method == "dflash":
        kw.pop("budget", None)
    seed = kw.pop("seed", None)
    ps = prompts(vocab, n)
    results = generate_batch(target, drafter, ps, seeds=[seed] * n if seed is not None else None, **kw)
    return [dict(tokens=r.tokens, accepted=r.stats.get("accepted"), path_lengths=r.stats.get("path_lengths"))
            for r in results]


def fingerprint_options(p):
    p.add_argument("--json", help="write every case's sha256 (and the runs themselves) to this file")
    p.add_argument("--eager-only", action="store_true", help="skip the compiled cases")


def fingerprint(a):
    """The engine's behaviour as one sha256 per case: greedy and sampled tokens, per-round acceptance and path
    lengths of every family (the bundled pair, DFlash 2, a Qwen3-MoE, a Qwen3.5 hybrid and its MoE twin written by
    transformers, YaRN RoPE scaling), eager and compiled. A refactor that changes no behaviour prints the same
    table before and after; docs/benchmarks.md ("Core size after the families refactor") holds the record.

        python scripts/bench.py fingerprint --json runs/fingerprint.json     # every case (compiled ones take minutes)
        python scripts/bench.py fingerprint --eager-only                     # seconds
    """
    torch.manual_seed(0)
    out = {}
    with tempfile.TemporaryDirectory() as root:
        pairs = write_pairs(root)
        loaded = {}
        for pair, method, settings, compile in cases(a.eager_only):
            if pair not in loaded:
                t, d, vocab = pairs[pair]
                loaded = {pair: (Qwen3.from_pretrained(t, device="cpu"),
                                 DFlashDrafter.from_pretrained(d, device="cpu"), vocab)}
            target, drafter, vocab = loaded[pair]
            name = f"{pair}/{method}/" + ",".join(f"{k}={v}" for k, v in settings.items()) + ("/compiled" if compile
                                                                                              else "")
            runs = run_case(target, drafter, vocab, method, settings, compile)
            digest = hashlib.sha256(json.dumps(runs, sort_keys=True).encode()).hexdigest()[:16]
            out[name] = dict(sha256=digest, runs=runs)
            print(f"{digest}  {name}  ({sum(len(r['tokens']) for r in runs)} tokens, "
                  f"{sum(len(r['accepted'] or []) for r in runs)} rounds)", flush=True)
    if a.json:
        write_json(a.json, out)


# ------------------------------------------------------------------------------------------ the command line


COMMANDS = {**bench_round.COMMANDS, **bench_models.COMMANDS, **bench_datasets.COMMANDS,  # name -> (its options,
            "size": (size_options, size), "fingerprint": (fingerprint_options, fingerprint)}  # its run)


def parser() -> argparse.ArgumentParser:
    """One subcommand per measurement; a command's --help is its run's docstring."""
    raw = argparse.RawDescriptionHelpFormatter
    p = one_line_errors(argparse.ArgumentParser(description=__doc__, formatter_class=raw))
    commands = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (options, run) in COMMANDS.items():
        options(one_line_errors(commands.add_parser(name, description=inspect.getdoc(run), formatter_class=raw)))
    return p


def main(argv=None) -> int:
    """Runs one command; its exit status (0 unless it says otherwise), or 2 with one `error:` line for bad options
    (argparse's own errors too: cli.one_line_errors)."""
    try:
        a = parser().parse_args(argv)
        for flag, folder in (("json", False), ("out", True)):  # the results' place, before anything is measured
            if getattr(a, flag, None):
                check_writable(f"--{flag}", getattr(a, flag), folder)
        return COMMANDS[a.command][1](a) or 0
    except (ValueError, TypeError) as e:
        print(f"error: {in_flags(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
