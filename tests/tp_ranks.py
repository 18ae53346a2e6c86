"""One rank of tests/test_tp.py, launched by torchrun: runs the cases of a JSON file through the public API (the
models sharded by the environment torchrun sets, as any script's would be) and writes what it saw to
OUT.rank{RANK}.json: each case's tokens and the collectives it ran, the target's parameter shapes and bytes (and
any parameter whose storage is larger than itself), a run of budget auto (its tokens, and the choices made from
the ranks' timings), how far `scripts/bench.py moe-parallel`'s two ways of splitting an MoE layer are from the
whole layer, and the command line's output and exit status (rank 0 alone prints).

    torchrun --standalone --nproc-per-node 2 tests/tp_ranks.py CASES.json OUT
"""

import contextlib
import io
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import cli  # noqa: E402
import bench  # noqa: E402
import bench_models  # noqa: E402
import tp  # noqa: E402
from ddtree import generate  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from model import Qwen3  # noqa: E402
import gemma4  # noqa: E402
from loading import read_json  # noqa: E402


def load_target(path: str, **kw):
    """The target at `path` through its family's loader (a Gemma 4 through gemma4.from_pretrained)."""
    if gemma4.is_gemma4(read_json(os.path.join(path, "config.json"))):
        return gemma4.from_pretrained(path, **kw)
    return Qwen3.from_pretrained(path, **kw)


class Collectives(TorchDispatchMode):
    """Counts the functional collectives (torch.ops._c10d_functional) that run while active, by name, and the
    all-gathers by the leading size of what each rank gives (a share of the vocabulary's logits, or 3: the greedy
    pick's value, index and finiteness)."""

    def __init__(self):
        super().__init__()
        self.counts, self.gathered = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            name = func.overloadpacket.__name__
            self.counts[name] = self.counts.get(name, 0) + 1
            if name == "all_gather_into_tensor":
                rows = str(args[0].shape[0])
                self.gathered[rows] = self.gathered.get(rows, 0) + 1
        return func(*args, **(kwargs or {}))


def parameter_bytes(model) -> int:
    """Bytes of the model's distinct parameter storages (a tied lm_head, the embedding's own parameter, counts once)."""
    seen = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def oversized(model) -> list[str]:
    """The parameters whose storage holds more than their own elements: a shard that kept the whole tensor it was
    cut from alive."""
    return [n for n, p in model.named_parameters() if p.untyped_storage().nbytes() > p.numel() * p.element_size()]


def greedy_pick(rows: list) -> dict:
    """tp.VocabParallelHead.argmax of logits `rows` [R, V]: the head is the identity of the vocabulary (this rank's
    rows of it), so that its logits are the rows themselves, ties as planted."""
    rows = torch.tensor(rows, dtype=torch.float64)
    vocab = rows.shape[-1]
    head = tp.VocabParallelHead(vocab, vocab)
    start, stop = head.vocab_rows
    head.weight = torch.nn.Parameter(torch.eye(vocab, dtype=torch.float64)[start:stop])
    tokens, finite = head.argmax(rows, torch.float64)
    return dict(tokens=tokens.tolist(), finite=finite.tolist())


def main(cases_file: str, out: str):
    cases = json.load(open(cases_file))
    loaded, record = {}, {"cases": [], "shapes": {}, "bytes": {}}
    for case in cases["runs"] + cases.get("gemma", []):
        if case["target"] not in loaded:
            target = load_target(case["target"], device="cpu", dtype=torch.float64)
            drafter = DFlashDrafter.from_pretrained(case["draft"], device="cpu", dtype=torch.float64)
            loaded[case["target"]] = target, drafter
            record["shapes"][case["target"]] = {n: list(p.shape) for n, p in
                                               target.named_parameters(remove_duplicate=False)}
            record["bytes"][case["target"]] = parameter_bytes(target)
            record.setdefault("tied", {})[case["target"]] = target.lm_head.weight is target.embed_tokens.weight
            # in the file's dtype (float32), where the loader's cast copies nothing
            record.setdefault("oversized", {})[case["target"]] = oversized(load_target(case["target"]))
        target, drafter = loaded[case["target"]]
        with Collectives() as seen:
            res = generate(target, drafter, case["prompt"], method=case["method"], budget=case.get("budget"),
                           max_new_tokens=case["max_new_tokens"], temperature=case.get("temperature", 0.0),
                           seed=case.get("seed"), stop_ids=[])
        record["cases"].append(dict(tokens=res.tokens, rounds=res.stats["rounds"], collectives=seen.counts,
                                    gathered=seen.gathered, share=target.lm_head.share))
    record["greedy_pick"] = greedy_pick(cases["ties"])
    auto = cases["auto"]
    target, drafter = loaded[auto["target"]]
    res = generate(target, drafter, auto["prompt"], budget="auto", max_new_tokens=auto["max_new_tokens"], stop_ids=[])
    record["auto"] = dict(tokens=res.tokens, **{k: res.stats["auto"][k] for k in ("schedule", "candidates",
                                                                            "calibrated_now", "cost_file")})
    record["moe_parallel"] = bench_models.moe_parallel_check(bench.parser().parse_args(["moe-parallel", "--check"]))
    for argv in cases["cli"]:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = cli.main(argv)
        record.setdefault("cli", []).append(dict(code=code, stdout=stdout.getvalue(), stderr=stderr.getvalue()))
    with open(f"{out}.rank{tp.rank()}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
