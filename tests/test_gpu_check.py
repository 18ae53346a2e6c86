"""scripts/gpu_check.py's machinery, on the CPU with small shapes (eager where the point is not compiling, so that
it stays quick): the named parts run in the order given, each recorded with its measures; a part that fails is an
error, one that overruns its alarm a timeout, one priced past the deadline skipped, and any of these makes the
exit status 1; bad arguments are one error line and exit 2; the output ends with one compact summary holding the
figures; --plan prices the documented device calls within their deadlines without running anything. The full smoke
run, every part compiled, is `python scripts/gpu_check.py --device cpu --small --json PATH` (docs/benchmarks.md)."""

import json
import os
import signal
import subprocess
import sys

import torch

from conftest import REPO_ROOT, assert_one_error_line

SCRIPT = os.path.join(REPO_ROOT, "scripts", "gpu_check.py")
sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
import gpu_check as script  # noqa: E402


def gpu_check(tmp_path, *args):
    """(exit status, stdout, stderr, the JSON or None) of one call on the CPU with small shapes."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--small", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc.returncode, proc.stdout, proc.stderr, json.loads(out.read_text()) if out.exists() else None


def test_named_parts_run_in_order_and_report_their_measures(tmp_path):
    parts = ["verify-curve", "hybrid-rule", "round-profile", "ar-profile", "projection", "dflash2-profile",
             "prefill", "gemma4-31b"]
    code, stdout, stderr, result = gpu_check(tmp_path, "--eager", "--parts", *parts, "--verify-budgets", "4",
                                             "--repeats", "2")
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert list(result["parts"]) == parts
    starts = [line.split("] ")[1].split(":")[0] for line in stdout.splitlines() if ": starts (priced at" in line]
    assert starts == parts
    for name, part in result["parts"].items():
        assert part["status"] == "ok", (name, part)
        assert part["seconds"] > 0 and part["recompiles"] == 0 and part["compile_s"] == 0 and "peak_gb" in part
    assert result["not_ok"] == [] and result["versions"]["torch"] == torch.__version__
    ar = result["parts"]["ar-profile"]["result"]
    assert 0 < ar["floor_ms"] and ar["bytes_gb"]["total"] > ar["bytes_gb"]["weights"] > 0
    assert ar["profile"]["per_step"] > 0 and ar["profile"]["top"]
    stages = result["parts"]["round-profile"]["result"]["64"]["stages_ms"]
    assert list(stages) == ["draft", "tree", "verify", "accept", "commit"]
    rule = result["parts"]["hybrid-rule"]["result"]
    assert set(rule) == {f"R{r}-{s}" for r in (65, 257, 513) for s in ("triangular", "series")}
    projection = result["parts"]["projection"]["result"]
    assert ar["floor_with_table_ms"] > ar["floor_ms"]  # the untied 8B table: read whole or a row of it
    hf = projection["transformers"]  # transformers' eager generate on the same weights, timed in this call
    assert hf["step_ms"] > 0 and hf["attention"]
    assert projection["ar_over_transformers"] == hf["step_ms"] / ar["pipelined_ms"]
    for row in projection["rows"].values():  # tau x AR step / round, the middles it lacked measured by itself
        assert row["projected_speedup"] == row["tau"] * projection["ar_ms"] / row["round_ms"] > 0
        assert row["over_transformers"] == row["tau"] * hf["step_ms"] / row["round_ms"] > 0
    assert set(result["parts"]["verify-curve"]["result"]) == {"4"}
    dflash2 = result["parts"]["dflash2-profile"]["result"]  # the lattice's stages, the drafter's shape recorded
    assert list(dflash2["64"]["stages_ms"]) == list(stages) and dflash2["drafter"]["selector_top_k"] == 8
    assert dflash2["drafter"]["assumed"] and "round_over_ar" not in dflash2["64"]  # no slice AR step in this call
    for name in ("8b", "27b-slice"):
        rec = result["parts"]["prefill"]["result"][name]
        assert set(rec) == {"chunk", "bytes_per_token", "1024", "2048"} and rec["bytes_per_token"]["target_kv"] > 0
        assert all(rec[n]["tokens_per_s"] == int(n) / rec[n]["seconds"] > 0 for n in ("1024", "2048"))
    gemma = result["parts"]["gemma4-31b"]["result"]  # sliding and full layers' own K/V, a drafter of z-lab's shapes
    assert gemma["ar"]["floor_ms"] > 0 and gemma["64"]["round_over_ar"] == gemma["64"]["round_ms"] / \
        gemma["ar"]["pipelined_ms"] > 0
    assert gemma["kv_bytes_per_token"] == (5 * 2 * 64 + 1 * 1 * 128) * 2 * 4  # float32 on the CPU
    # the last line: the summary, short, the JSON's own, with every part's figures
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("summary: ") and len(last) < 4000, last[:200]
    summary = json.loads(last[len("summary: "):])
    assert summary == result["summary"] and list(summary["parts"]) == parts and summary["not_ok"] == []
    figures = {name: part["figures"] for name, part in summary["parts"].items()}
    assert figures["ar-profile"]["floor_with_table_ms"] > figures["ar-profile"]["floor_ms"] > 0
    assert figures["projection"]["transformers_ms"] > 0
    for key, row in figures["projection"]["rows"].items():
        assert row["over_our_ar"] > 0 and row["over_transformers"] > 0 and row["paper"] in (7.52, 5.56), key
    assert set(figures["round-profile"]["64"]["stages_ms"]) == set(stages)


def test_a_failing_part_and_an_overrunning_one_end_not_ok_and_the_run_goes_on(tmp_path):
    # ar-profile compiles (seconds on any machine) under a 1-second alarm; hybrid-rule fails as it starts
    code, stdout, stderr, result = gpu_check(tmp_path, "--parts", "ar-profile", "hybrid-rule", "--part-seconds", "1",
                                             "--plant-failure", "hybrid-rule")
    assert code == 1, stdout[-3000:] + stderr[-3000:]
    parts = result["parts"]
    assert parts["ar-profile"]["status"] == "timeout", parts["ar-profile"]
    assert parts["hybrid-rule"]["status"] == "error" and "planted failure" in parts["hybrid-rule"]["traceback"]
    assert result["not_ok"] == ["ar-profile", "hybrid-rule"]


def test_a_part_priced_past_the_deadline_is_skipped(tmp_path):
    code, stdout, stderr, result = gpu_check(tmp_path, "--eager", "--parts", "hybrid-rule", "--deadline", "1")
    assert code == 1, stdout[-3000:] + stderr[-3000:]
    part = result["parts"]["hybrid-rule"]
    assert part["status"] == "skipped" and "deadline" in part["why"] and "seconds" not in part


def in_process(args, capsys):
    """(exit status, stdout, stderr) of the script's main() in this process: its argument checks and --plan import
    nothing more and run nothing, so a process of their own would only add its imports."""
    try:
        code = script.main(args)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_bad_arguments_are_one_error_line(capsys):
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "tpu"], capture_output=True, text=True, timeout=120)
    assert_one_error_line(proc.returncode, proc.stderr, "tpu")  # as a command
    cases = [(["--parts", "nope"], "nope"), (["--repeats", "0"], "--repeats must be at least 1")]  # not the default
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "no such CUDA device"))
    for args, message in cases:
        code, _, err = in_process(args, capsys)
        assert_one_error_line(code, err, message)


def test_the_documented_calls_fit_their_deadlines_and_one_that_does_not_is_named(capsys):
    """--plan prices the first device call (the speed parts) and the second (the smokes) from the default seconds
    per graph, without a device; each ends before its deadline with a margin. Too short a deadline names the
    requested parts that would be skipped, exit 1."""
    for args, parts in ([], script.FIRST_PARTS), (["--second-call"], script.SECOND_PARTS):
        code, out, err = in_process(["--plan", *args], capsys)
        assert code == 0, out + err
        lines = out.splitlines()
        assert [line.split()[0] for line in lines[1:1 + len(parts)]] == parts
        assert all("ends at" in line for line in lines[1:1 + len(parts)])
        end, margin = (float(w) for w in lines[-1].split()[4:7:2])
        assert end + margin == float(lines[0].split("--deadline ")[1].split()[0]) and margin >= 0.05 * end, lines[-1]
    code, out, _ = in_process(["--plan", "--deadline", "200"], capsys)
    assert code == 1 and out.splitlines()[-1] == "requested parts past --deadline: round-profile projection", out


def test_stage_marks_leave_generation_tracking_as_it_was():
    """Run.stage marks a CUDA graph step at each call; once marked by hand, CUDA graph trees would count
    generations by hand-marked steps alone for the rest of the process: stage_generations puts it back."""
    from torch._inductor import cudagraph_trees
    before = cudagraph_trees.MarkStepBox.mark_step_counter
    with script.stage_generations():
        torch.compiler.cudagraph_mark_step_begin()
        assert cudagraph_trees.MarkStepBox.mark_step_counter != before
    assert cudagraph_trees.MarkStepBox.mark_step_counter == before


def test_the_solve_a_graph_can_take_is_named():
    captured = lambda tri, ser: {"R513-triangular": dict(captured=tri), "R513-series": dict(captured=ser)}  # noqa
    assert script.capturable_solve(captured(True, True), 513) == "triangular"
    assert script.capturable_solve(captured(False, True), 513).startswith("series (fallback")
    assert script.capturable_solve(captured(False, False), 513).startswith("none")


def test_sigterm_ends_the_running_part_and_the_summary_is_printed(tmp_path):
    """A command stopped at its time limit (SIGTERM): the part running ends as terminated, none after it starts,
    and the output still ends with the summary (the JSON too)."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.Popen([sys.executable, SCRIPT, "--device", "cpu", "--small", "--json", str(out), "--parts",
                             "hybrid-rule", "ar-profile", "prefill"], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    lines = []
    for line in proc.stdout:  # ar-profile compiles its step: seconds on any machine
        lines.append(line)
        if "ar-profile: starts" in line:
            proc.send_signal(signal.SIGTERM)
            break
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=300) == 1, "".join(lines)[-3000:]
    summary = json.loads(lines[-1][len("summary: "):])
    statuses = {name: part["status"] for name, part in summary["parts"].items()}
    assert statuses == {"hybrid-rule": "ok", "ar-profile": "terminated", "prefill": "skipped"}, statuses
    assert "SIGTERM" in summary["parts"]["ar-profile"]["why"] and summary["not_ok"] == ["ar-profile", "prefill"]
    assert json.loads(out.read_text())["summary"] == summary
