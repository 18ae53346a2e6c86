"""Tensor parallel (tp.py) on the CPU: two gloo ranks launched by torchrun (tests/tp_ranks.py, one launch for the
module) against one rank in this process, float64, tiny random checkpoints of the three target kinds: dense Qwen3
(one KV head for two ranks: replicated; a vocabulary of 17: an uneven split; tied embeddings), Qwen3-MoE (per-expert
tensors) and a Qwen3.5-MoE hybrid in the hub's layout (Gated DeltaNet, gated attention, a shared expert).

- greedy ddtree gives one rank's tokens on every target, and both ranks agree;
- a sampled run gives the same samples for the same seed;
- each rank holds its shard only: the sharded tensors (the embedding too) at half their rows or columns, the rest
  whole, a tied lm_head the embedding's own parameter;
- one all-reduce per sublayer (2 per layer per target forward) and per embedding lookup, and one all-gather per
  forward: of the logits, or in a greedy pick of each rank's best (value, index, finite), whose planted ties across
  the vocabulary's shards go as torch.argmax's;
- the command line under torchrun (the bundled pair) prints on rank 0 alone, and sizes that do not split are one
  `error:` line, as is a tensor whose shape config.json contradicts;
- budget auto makes the same choices on every rank, and gives greedy's tokens;
- `scripts/bench.py moe-parallel`'s split experts and expert parallel layers both give the whole MoE layer.
"""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, assert_one_error_line, write_drafter
from ddtree import generate
from drafter import DFlashDrafter

sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
from checkpoints import (dflash_config, hybrid_text_config, moe_config, qwen3_config,  # noqa: E402
                         random_dflash_weights, random_hybrid_model, random_qwen3_weights, save_checkpoint,
                         save_hybrid)

RANKS = 2
RANKS_TIMEOUT = 120  # seconds; the launch takes about 20
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


# Logits rows over a vocabulary of 17 (rank 0 holds ids 0-8, rank 1 ids 9-16) with their ties planted: torch.argmax
# of the whole row takes the lowest index among equal maxima, and an all-NaN row's index 0.
TIES = [[0.0] * 8 + [2.0, 2.0] + [0.0] * 7,  # across the shards' boundary: 8
        [0.0] * 3 + [5.0] + [0.0] * 8 + [5.0] + [0.0] * 4,  # one in each shard: 3
        [1.0] * 10 + [4.0] + [1.0] * 4 + [4.0, 1.0],  # both in rank 1's shard, over rank 0's best: 10
        [-3.0] * 17,  # every logit: 0
        [float("nan")] * 17]  # not finite: 0


def write_dense(path, heads=4):
    tc = qwen3_config(17, hidden=64, inter=96, layers=2, heads=heads, kv_heads=1, head_dim=16, tie=True,
                      eos=(1, 0))
    save_checkpoint(os.path.join(path, "target"), tc, random_qwen3_weights(tc, seed=1, std=0.35), eos_ids=[1])
    write_drafter(os.path.join(path, "draft"), tc, layers=1, block_size=5)


def write_moe(path):
    tc = moe_config(qwen3_config(16, hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16, eos=(1, 0)),
                    experts=4, top_k=2, inter=32)
    save_checkpoint(os.path.join(path, "target"), tc, random_qwen3_weights(tc, seed=2, std=0.35), eos_ids=[1])
    write_drafter(os.path.join(path, "draft"), tc, layers=1, block_size=5)


def write_hybrid(path):
    hf = random_hybrid_model(hybrid_text_config(moe=True, vocab_size=16, full_attention_interval=2), moe=True,
                             seed=2, std=0.35)
    save_hybrid(hf, os.path.join(path, "target"), layout="conditional_generation")
    tc = json.load(open(os.path.join(path, "target", "config.json")))["text_config"]
    dc = dflash_config({**tc, "rope_theta": 10000.0, "intermediate_size": 48}, layers=1, block_size=5,
                       target_layer_ids=[0, 1, 3])
    save_checkpoint(os.path.join(path, "draft"), dc, random_dflash_weights(dc, seed=3, std=0.05))


def write_misshapen(path):
    """The dense pair with one more head's rows in layer 0's q_proj than config.json says."""
    from safetensors.torch import load_file, save_file
    write_dense(path)
    file = os.path.join(path, "target", "model.safetensors")
    w = load_file(file)
    q = w["model.layers.0.self_attn.q_proj.weight"]
    w["model.layers.0.self_attn.q_proj.weight"] = torch.cat([q, q[:16]])
    save_file(w, file, metadata={"format": "pt"})


def write_gemma4(path):
    """A Gemma 4 target written by transformers (test_gemma4's: sliding layers of 2 K/V heads, full layers of one
    K/V head whose values are its keys, the 26B-A4B's experts beside the MLP, tied embeddings), float64, with a
    Gemma-style drafter reading two of its layers."""
    from test_gemma4 import write_target
    hf = write_target(os.path.join(path, "target"), "moe")
    tc = hf.config.to_dict()
    dc = dflash_config({**tc, "rope_theta": 10000.0}, layers=1, block_size=5, target_layer_ids=[1, 4])
    dc["dflash_config"].update(input_embedding_scale=tc["hidden_size"] ** 0.5,
                               final_logit_softcapping=tc["final_logit_softcapping"])
    save_checkpoint(os.path.join(path, "draft"), dc, random_dflash_weights(dc, seed=3, std=0.3))


def cases(paths: dict) -> dict:
    runs = [dict(kind=kind, method="ddtree", budget=8) for kind in ("dense", "moe", "hybrid")]
    runs += [dict(kind=kind, method="ddtree", budget=8, temperature=1.0, seed=11) for kind in ("dense", "hybrid")]
    for run in runs:
        run.update(target=paths[run["kind"]] + "/target", draft=paths[run["kind"]] + "/draft", prompt=PROMPT,
                   max_new_tokens=16)
    bad = paths["bad"] + "/target"
    auto = dict(runs[0], budget="auto", max_new_tokens=24)
    gemma = [dict(kind="gemma4", method="ddtree", budget=8), dict(kind="gemma4", method="ddtree", budget=8,
                                                                   temperature=1.0, seed=11)]
    for run in gemma:
        run.update(target=paths["gemma4"] + "/target", draft=paths["gemma4"] + "/draft", prompt=PROMPT * 3,
                   max_new_tokens=16)
    return dict(runs=runs, gemma=gemma, ties=TIES, auto=auto,
                cli=[["--prompt", "hello", "--no-chat", "--json", "--budget", "4", "--max-new-tokens", "6"],
                     ["--prompt", "hello", "--target", bad, "--method", "ar", "--no-chat"],
                     ["--prompt", "hello", "--target", paths["misshapen"] + "/target", "--method", "ar", "--no-chat"]])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the cases, what rank 0 and rank 1 saw)."""
    root = tmp_path_factory.mktemp("tp")
    paths = {kind: str(root / kind) for kind in ("dense", "moe", "hybrid", "bad", "misshapen", "gemma4")}
    write_dense(paths["dense"])
    write_moe(paths["moe"])
    write_hybrid(paths["hybrid"])
    write_dense(paths["bad"], heads=3)
    write_misshapen(paths["misshapen"])
    write_gemma4(paths["gemma4"])
    spec = cases(paths)
    json.dump(spec, open(root / "cases.json", "w"))
    # budget auto calibrates afresh: the ranks' timings of the calibration make the same choices too
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DDTREE_CACHE_DIR=str(root / "costs"))
    ranks = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={RANKS}", os.path.join(REPO_ROOT, "tests", "tp_ranks.py"),
                              str(root / "cases.json"), str(root / "out")], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _, err = ranks.communicate(timeout=RANKS_TIMEOUT)
    except subprocess.TimeoutExpired:
        # Ranks that disagree wait on each other's collectives. torchrun stops its ranks (which run in sessions of
        # their own) when it is terminated, not when it is killed.
        ranks.terminate()
        ranks.communicate(timeout=60)
        pytest.fail(f"the ranks did not finish in {RANKS_TIMEOUT} s (waiting on each other's collectives?)")
    assert ranks.returncode == 0, err[-4000:]
    seen = [json.load(open(root / f"out.rank{r}.json")) for r in range(RANKS)]
    return spec, seen


@functools.cache
def one_rank_models(target: str, draft: str):
    from tp_ranks import load_target
    return (load_target(target, device="cpu", dtype=torch.float64),
            DFlashDrafter.from_pretrained(draft, device="cpu", dtype=torch.float64))


def one_rank(run) -> list[int]:
    target, drafter = one_rank_models(run["target"], run["draft"])
    return generate(target, drafter, run["prompt"], method=run["method"], budget=run["budget"],
                    max_new_tokens=run["max_new_tokens"], temperature=run.get("temperature", 0.0),
                    seed=run.get("seed"), stop_ids=[]).tokens


def test_two_ranks_give_one_ranks_tokens_greedy_and_sampled(runs):
    spec, seen = runs
    for i, run in enumerate(spec["runs"]):
        tokens = [rank["cases"][i]["tokens"] for rank in seen]
        assert tokens[0] == tokens[1], (run["kind"], tokens)
        assert tokens[0] == one_rank(run), run
        assert len(tokens[0]) == run["max_new_tokens"]


def test_a_gemma4_target_on_two_ranks_gives_one_ranks_tokens_from_its_shards(runs):
    """Gemma 4 (sliding window 8 crossed by a prompt of 24, full layers whose values are their keys, experts beside
    the MLP): greedy and sampled ddtree on two ranks give one rank's tokens, and each rank holds half of every
    split tensor, the full layers' single K/V head whole on both (their keys, no v_proj), the rest whole."""
    spec, seen = runs
    first = len(spec["runs"])
    for i, run in enumerate(spec["gemma"]):
        tokens = [rank["cases"][first + i]["tokens"] for rank in seen]
        assert tokens[0] == tokens[1] == one_rank(run), (run, tokens)
    target = spec["gemma"][0]["target"]
    whole = {n: list(p.shape) for n, p in one_rank_models(target, spec["gemma"][0]["draft"])[0]
             .named_parameters(remove_duplicate=False)}
    for rank in seen:
        shapes = rank["shapes"][target]
        assert rank["tied"][target] and rank["oversized"][target] == []
        for n, full in whole.items():
            part = shapes[n]
            if n.endswith("qkv_proj.weight"):  # 2 of 4 query heads; sliding: 1 of 2 K/V heads, full: its 1 (k only)
                full_layer = int(n.split(".")[1]) in (2, 5)
                assert part == [2 * 16 + 16 if full_layer else 2 * 8 + 8 + 8, full[1]], (n, part, full)
            elif n.endswith(SPLIT):
                dims = [d for d, (a, b) in enumerate(zip(part, full)) if a != b]
                assert len(dims) == 1 and part[dims[0]] * RANKS == full[dims[0]], (n, part, full)
            else:
                assert part == full, (n, part, full)


# The parameters that tp.py splits across the ranks (by name ending).
SPLIT = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "experts.gate_proj",
         "experts.up_proj", "experts.down_proj", "in_proj.weight", "conv1d.weight", "dt_bias", "A_log",
         "out_proj.weight", "lm_head.weight", "embed_tokens.weight")


def test_each_rank_holds_only_its_shard(runs):
    """Every parameter of a rank is either the whole tensor (norms, routers) or its rank's part along the
    one dimension tp.py splits, the ranks' parts adding up to the whole (the dense target's stacked q/k/v: half the
    query heads and its one KV head whole); on each target the parts are most of the bytes."""
    spec, seen = runs
    for run in spec["runs"][:3]:
        whole = {n: list(p.shape) for n, p in one_rank_models(run["target"], run["draft"])[0]
                 .named_parameters(remove_duplicate=False)}
        shapes = [rank["shapes"][run["target"]] for rank in seen]
        for n, full in whole.items():
            parts = [s[n] for s in shapes]
            if not n.endswith(SPLIT):
                assert all(p == full for p in parts), (n, parts, full)
                continue
            dims = {d for p in parts for d, (a, b) in enumerate(zip(p, full)) if a != b}
            assert len(dims) == 1, (n, parts, full)
            d = dims.pop()
            if run["kind"] == "dense" and n.endswith("qkv_proj.weight"):  # 4 heads of 16 over 2 ranks, 1 KV head
                assert all(p[d] == 4 * 16 // RANKS + 2 * 16 for p in parts), (n, parts)
            else:
                assert sum(p[d] for p in parts) == full[d], (n, parts, full)
        full_bytes = sum(torch.Size(s).numel() for n, s in whole.items() if n != "lm_head.weight" or
                         run["kind"] != "dense") * 8  # (the dense target's lm_head is its embedding)
        for rank in seen:
            assert rank["tied"][run["target"]] == (run["kind"] == "dense"), run["kind"]  # the rows both take
            assert rank["bytes"][run["target"]] < 0.55 * full_bytes, (run["kind"], rank["bytes"], full_bytes)
            assert rank["oversized"][run["target"]] == [], (run["kind"], rank["oversized"][run["target"]])


def test_one_all_reduce_per_sublayer_and_embedding_one_gather_per_forward(runs):
    """A ddtree run is one prefill forward (the prompt fits one chunk) and per round a drafter forward (its
    embedding is the target's: one all-reduce; its logits through the target's lm_head: one all-gather of the
    logits) and a verify forward (2 all-reduces per layer, one for the embedding, one all-gather). A target's
    forward in a greedy run gathers each rank's best logit, index and finiteness per row, not the logits."""
    spec, seen = runs
    for i, run in enumerate(spec["runs"]):
        config = json.load(open(run["target"] + "/config.json"))
        layers = config.get("text_config", config)["num_hidden_layers"]
        for rank in seen:
            case = rank["cases"][i]
            forwards = 1 + case["rounds"]
            assert case["collectives"]["all_reduce"] == (2 * layers + 1) * forwards + case["rounds"], (run["kind"],
                                                                                                       case)
            assert case["collectives"]["all_gather_into_tensor"] == forwards + case["rounds"], (run["kind"], case)
            greedy = run.get("temperature", 0.0) == 0
            logits = {str(case["share"]): case["rounds"] + (0 if greedy else forwards)}
            assert case["gathered"] == ({**logits, "3": forwards} if greedy else logits), (run["kind"], case)


def test_greedy_pick_without_the_logits_breaks_ties_as_argmax_of_the_whole_row(runs):
    """Each rank's best (value, index), gathered, give torch.argmax's token of the whole row on every rank."""
    whole = torch.tensor(TIES, dtype=torch.float64)
    assert whole.argmax(-1).tolist() == [8, 3, 10, 0, 0]
    for rank in runs[1]:
        assert rank["greedy_pick"] == dict(tokens=whole.argmax(-1).tolist(),
                                           finite=torch.isfinite(whole).all(-1).tolist())


def test_split_experts_and_expert_parallel_both_give_the_whole_moe_layer(runs):
    """`scripts/bench.py moe-parallel`'s two schemes (which docs/tp.md's measurement compares), in float64 on two ranks,
    through a few pairs and through many."""
    for rank in runs[1]:
        assert rank["moe_parallel"] < 1e-12, rank["moe_parallel"]


def test_command_line_under_torchrun(runs):
    spec, seen = runs
    good, bad, misshapen = seen[0]["cli"]
    assert good["code"] == 0, good["stderr"]
    assert len(json.loads(good["stdout"])["tokens"]) == 6
    assert_one_error_line(bad["code"], bad["stderr"], "num_attention_heads (3) does not split over 2 ranks")
    # a rank reads a slice: the whole tensor's shape is still checked against config.json
    assert_one_error_line(misshapen["code"], misshapen["stderr"],
                          "misshapen/target/model.safetensors: tensor 'layers.0.self_attn.q_proj.weight' has shape "
                          "(80, 64), config.json implies 64")
    # rank 1 prints no output; its stderr is its own: the same error line where it fails as rank 0 does
    assert [(other["stdout"], other["code"]) for other in seen[1]["cli"]] == [("", 0), ("", 2), ("", 2)]
    assert seen[1]["cli"][0]["stderr"] == ""
    assert [other["stderr"] for other in seen[1]["cli"][1:]] == [bad["stderr"], misshapen["stderr"]]


def test_budget_auto_makes_the_same_choices_on_every_rank(runs):
    """Each rank times its own rounds; the ranks' longest time is every rank's, so the calibration, the candidate
    of every round and the estimates agree, and the tokens are greedy's (budget auto is lossless). The calibration
    is kept under a key of its own (a round over two ranks does not cost what one device's does)."""
    spec, seen = runs
    auto = [rank["auto"] for rank in seen]
    assert auto[0]["calibrated_now"]
    assert [json.loads(key)["ranks"] for key in json.load(open(auto[0]["cost_file"]))] == [RANKS]
    assert auto[0] == auto[1]
    assert auto[0]["tokens"] == one_rank(dict(spec["auto"], budget=8))  # one rank's plain greedy ddtree


NEVER_JOINS = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
import tp
tp.setup(torch.device("cpu"))
if tp.rank() == 1:
    time.sleep(float(sys.argv[3]))  # a rank that hangs: it never joins the collective
    sys.exit(0)
t = time.time()
try:
    dist.all_reduce(torch.ones(1))
    outcome = "returned"
except Exception as e:
    outcome = type(e).__name__
json.dump(dict(outcome=outcome, waited=time.time() - t), open(sys.argv[2], "w"))
sys.exit(1)  # torchrun then stops the other rank
"""


def test_a_rank_that_never_joins_ends_the_others_wait_after_the_timeout(tmp_path):
    """tp.setup's process group waits DDTREE_TP_TIMEOUT_S for a collective (here 3 s), not the backend's default,
    however long the other rank hangs (here 12 s)."""
    script = tmp_path / "never_joins.py"
    script.write_text(NEVER_JOINS)
    env = dict(os.environ, OMP_NUM_THREADS="1", DDTREE_TP_TIMEOUT_S="3")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
                    str(script), REPO_ROOT, str(tmp_path / "out.json"), "12"], env=env, capture_output=True,
                   timeout=RANKS_TIMEOUT)
    seen = json.load(open(tmp_path / "out.json"))
    assert seen["outcome"] == "RuntimeError" and 2.5 < seen["waited"] < 8, seen


def test_ctrl_c_under_the_launcher_exits_130_with_the_streamed_text_kept(tmp_path):
    """`python tp.py` is torchrun with its flags: on Ctrl-C torchrun hands SIGINT to the ranks, rank 0 keeps what it
    streamed and says where it stopped, and the launch exits 130 as one process does (torchrun itself: its own
    SignalException traceback, exit 1)."""
    import signal
    import time
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")
    launch = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "tp.py"), "--standalone",
                               f"--nproc-per-node={RANKS}", os.path.join(REPO_ROOT, "ddtree.py"), "--prompt", "def",
                               "--no-chat", "--method", "ar", "--temperature", "3", "--seed", "1",
                               "--max-new-tokens", "2000"], env=env, stdout=out, stderr=err, text=True)
    deadline = time.monotonic() + RANKS_TIMEOUT
    while not os.path.getsize(tmp_path / "out") and launch.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)  # until the text streams
    launch.send_signal(signal.SIGINT)
    code = launch.wait(timeout=60)
    text, said = open(tmp_path / "out").read(), open(tmp_path / "err").read()
    assert code == 130 and text, (code, said[-3000:])
    # every rank keeps its stderr: each says where it stopped (a collective cut short may add the backend's warning)
    assert "Traceback" not in said and "[ar] interrupted after " in said, said[-3000:]


def test_an_error_under_the_launcher_is_its_one_line_and_exit_status():
    """Bad input under `python tp.py`: the ranks' `error:` line (the same from each) and its exit status 2, without
    torchrun's failure report (torchrun itself: a ChildFailedError traceback, exit 1)."""
    launch = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tp.py"), "--standalone",
                             f"--nproc-per-node={RANKS}", os.path.join(REPO_ROOT, "ddtree.py"), "--prompt", "x",
                             "--top-k", "3"], env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                            capture_output=True, text=True, timeout=RANKS_TIMEOUT)
    lines = set(launch.stderr.splitlines())
    assert launch.returncode == 2 and len(lines) == 1, (launch.returncode, launch.stderr[-3000:])
    assert_one_error_line(launch.returncode, lines.pop() + "\n", "--top-k does not apply to method 'ddtree'")
