"""scripts/bench.py, the one entry point of the measurements: every command parses its --help (so a command whose
code no longer imports, or whose options clash, fails here, not on the machine it was meant for), and bad options
are one `error:` line, exit status 2, as on the command line."""

import os
import sys

import pytest

from conftest import assert_one_error_line

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench  # noqa: E402


@pytest.mark.parametrize("command", list(bench.COMMANDS))
def test_every_command_parses_its_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: ") and f" {command} " in out.splitlines()[0]
    assert f"scripts/bench.py {command}" in out  # its docstring, with how to run it (python or torchrun)


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: COMMAND"),
    (["bench_pair"], "invalid choice: 'bench_pair'"),
    (["round", "--budgets", "x"], "argument --budgets: must be an integer of at least 1, got 'x'"),
    (["pair", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["roofline", "--size", "1024"], "--size takes HxL, such as 1024x8, not '1024'"),
    (["crossover", "--sizes", "bundled", "big"], "--sizes takes HxL, such as 1024x8, not 'big'"),
    (["kernels", "--layers", "3"], "--layers must be at least 4"),
    (["context", "--windows", "-1"], "--windows at least 0"),
    (["official"], "the following arguments are required: --official"),
    (["official", "--official", "/nonexistent"], "--official /nonexistent is not a checkout"),
    (["moe-parallel", "--check"], "run it under torchrun with 2 ranks or more"),
    (["datasets", "--methods", "dflash", "ddtree"], "--methods must include ar"),
    (["datasets", "--budgets", "16", "0"], "--budgets takes positive integers or auto, not '0'"),
    (["datasets", "--datasets", "mt-bench", "--score"], "--score runs HumanEval's tests: add humaneval to --datasets"),
    (["datasets", "--rows", "gsm8k=rows.jsonl"], "--rows takes NAME=FILE with NAME one of --datasets"),
    (["datasets", "--rows", "humaneval=/nonexistent.jsonl"], "--rows humaneval=/nonexistent.jsonl: no such file"),
    (["datasets", "--datasets", "gsm9k"], "argument --datasets: invalid choice: 'gsm9k'"),
    (["datasets", "--threads", "0"], "--threads must be at least 1"),
    # counts are refused as they are parsed, before a pair is built or anything runs
    (["pair", "--prompts", "0"], "argument --prompts: must be an integer of at least 1, got 0"),
    (["round", "--threads", "0"], "argument --threads: must be an integer of at least 1, got 0"),
    (["sampling", "--repeats", "-2"], "argument --repeats: must be an integer of at least 1, got -2"),
    (["moe-parallel", "--rows", "65", "0"], "argument --rows: must be an integer of at least 1, got 0"),
    (["round", "--layers", "1"], "--layers must be at least 2 (the drafter reads a target layer below the last)"),
    (["crossover", "--sizes", "256x1"], "--sizes 256x1: the hidden size must be at least 1 and the layers at least 2"),
    (["pair", "--denoise", "99"], "--denoise 99 exceeds the drafter's 7 draft positions"),  # the bundled pair's
])
def test_bad_options_are_one_error_line(args, message, capsys):
    assert_one_error_line(bench.main(args), capsys.readouterr().err, message)


def test_an_output_that_cannot_be_written_is_refused_before_anything_is_measured(tmp_path, capsys):
    """--json and --out are checked first: a run's results are never measured only to be lost at its end."""
    (tmp_path / "file").write_text("")
    for args, message in [(["pair", "--out", str(tmp_path / "file")], "file is a file, not a folder"),
                          (["memory", "--json", str(tmp_path / "file" / "m.json")],
                           f"m.json cannot be written: {tmp_path / 'file'} is a file, not a folder"),
                          (["round", "--json", str(tmp_path)], f"--json {tmp_path} is a folder, not a file")]:
        assert_one_error_line(bench.main(args), capsys.readouterr().err, message)


def test_context_runs_past_the_checkpoints_window_only_scaled_and_every_run_equals_plain_decoding(tmp_path):
    """bench.py context at a toy size: a length within the bundled pair's 2048 positions runs on the pair as it is
    and on its YaRN copy, one whose request (prompt + new tokens) passes them on the copy alone; every drafter window
    gives plain decoding's tokens."""
    import json
    assert bench.main(["context", "--lengths", "64", "2045", "--windows", "0", "16", "--prompts", "1",
                       "--new-tokens", "6", "--budget", "4", "--threads", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_context.json").read_text())["rows"]
    assert [(r["version"], r["length"]) for r in rows] == [("as is", 64), ("yarn x4", 64), ("yarn x4", 2045)]
    for r in rows:
        assert set(r["windows"]) == {"0", "16"} and r["prefill_tokens_per_s"] > 0
        assert all(w["same_tokens"] == 1 and w["tau"] >= 1 for w in r["windows"].values())
    assert (tmp_path / "tau_vs_length.png").exists()


def test_callgraph_follows_one_round_to_the_attention(capsys, monkeypatch):
    """bench.py callgraph on the bundled pair: the round's functions, the chain from generate() down to
    Attention.attend (eager FlexAttention, which compiles itself while the profile hook runs), a whole generate()."""
    import cpu
    import ddtree
    monkeypatch.setattr(cpu, "EAGER_CPU_ATTENTION", cpu.EAGER_CPU_ATTENTION)  # callgraph sets "flex"
    monkeypatch.setattr(ddtree, "build_tree_heap", ddtree.build_tree_heap)  # and the compiled round's builder
    # With the virtual environment inside the repository (as the README installs it), the profile hook also sees
    # its frames, some of which dynamo evaluates: a hook that dynamo cannot trace fails here.
    assert bench.main(["callgraph", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("one round (B = 16): ") and "ddtree.py" in out[0] and "model.py" in out[0]
    # The deepest chain: through the round's drafter or the target's prefill (its Qwen3.run_layer, the hook a
    # recurrent family overrides), then the layers' one compile region down to the attention seam.
    assert out[1].startswith("generate -> attention: ") and out[1].endswith(
        " > run_layer > _layer_once > forward > forward > attend")
    assert out[2].startswith("a whole greedy generate()")
