"""scripts/gpu_check.py, run as on the GPU but on the CPU, eagerly and on small models: every section of every
part must come back ok, so that the script itself is not what fails on the day a GPU is lent."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    args = ["--device", "cpu", "--small", "--eager", "--json", str(out), "--budgets", "16", "4", "--e2e-budget", "4",
            "--pair-budgets", "4", "16", "--pair-modes", "eager", "--sampled-batches", "1", "2", "--prefill-lengths",
            "300", "--batch-budgets", "4", "--batches", "2", "--moe-budgets", "4", "--hybrid-budgets", "4", "16",
            "--hybrid-series-budgets", "16", "--repeats", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DDTREE_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), *args], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    sections = result["sections"]
    assert not result["sections_not_ok"], {k: sections[k] for k in result["sections_not_ok"]}
    for name in ("flex vs sdpa", "bundled pair", "AR step eager", "round B=16", "end to end", "sampled B=512",
                 "long prefill", "batched B=4 batch 2", "budget auto", "layers compiled once A/B", "MoE expert paths",
                 "MoE AR step", "MoE verify B=4", "hybrid target", "hybrid AR step eager", "hybrid verify B=4",
                 "hybrid verify B=16", "hybrid verify B=16 series"):
        assert sections[name]["status"] == "ok", name
    assert all(case["status"] == "ok" for case in result["flex_vs_sdpa"].values())
    pair = result["bundled_pair"]
    assert set(pair) == {"eager/dflash", "eager/ddtree-B4", "eager/ddtree-B16", "eager/auto-forced",
                         "eager/batch-shrinking"}
    assert all(case["status"] == "ok" and case["equal_to_eager_ar"] for case in pair.values()), pair
    hybrid = result["hybrid"]  # a Gated DeltaNet target: the tree verify ran through its recurrent layers
    assert set(hybrid["verify_ms"]) == {"4", "16"} and hybrid["state_gb_per_request"] > 0, hybrid
    assert set(hybrid["verify_series_ms"]) == {"16"}, hybrid
    assert result["versions"]["torch"] == __import__("torch").__version__
