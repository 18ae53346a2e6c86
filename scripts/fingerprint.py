"""The engine's behaviour as one sha256 per case: greedy and sampled tokens, per-round acceptance and path lengths of
every family (the bundled pair, DFlash 2, a Qwen3-MoE, a Qwen3.5 hybrid and its MoE twin written by transformers,
YaRN RoPE scaling), eager and compiled. A refactor that changes no behaviour prints the same table before and
after; docs/benchmarks.md ("Fingerprints") holds the record.

    python scripts/fingerprint.py --json runs/fingerprint.json            # every case (compiled ones take minutes)
    python scripts/fingerprint.py --eager-only                           # seconds
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402

from checkpoints import (dflash_config, hybrid_text_config, moe_config, qwen3_config,  # noqa: E402
                         random_dflash_weights, random_hybrid_model, random_qwen3_weights, save_checkpoint)
from ddtree import generate_batch  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from model import Qwen3  # noqa: E402

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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write every case's sha256 (and the runs themselves) to this file")
    p.add_argument("--eager-only", action="store_true", help="skip the compiled cases")
    a = p.parse_args()
    torch.manual_seed(0)
    out = {}
    with tempfile.TemporaryDirectory() as root:
        pairs = write_pairs(root)
        loaded = {}
        for pair, method, settings, compile in cases(a.eager_only):
            if pair not in loaded:
                t, d, vocab = pairs[pair]
                loaded = {pair: (Qwen3.from_pretrained(t, device="cpu"), DFlashDrafter.from_pretrained(d, device="cpu"),
                                 vocab)}
            target, drafter, vocab = loaded[pair]
            name = f"{pair}/{method}/" + ",".join(f"{k}={v}" for k, v in settings.items()) + ("/compiled" if compile
                                                                                              else "")
            runs = run_case(target, drafter, vocab, method, settings, compile)
            digest = hashlib.sha256(json.dumps(runs, sort_keys=True).encode()).hexdigest()[:16]
            out[name] = dict(sha256=digest, runs=runs)
            print(f"{digest}  {name}  ({sum(len(r['tokens']) for r in runs)} tokens, "
                  f"{sum(len(r['accepted'] or []) for r in runs)} rounds)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
