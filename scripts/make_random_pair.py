"""Write a small random Qwen3 target and a DFlash drafter for it in the real file formats,
with a BPE tokenizer trained on a slice of the standard library. Random weights accept nothing; this pair is for
exercising the code paths offline, e.g.

    python scripts/make_random_pair.py --out runs/random-pair
    python ddtree.py --target runs/random-pair/target --draft runs/random-pair/draft --prompt "def f(x):"
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoints import (dflash_config, qwen3_config, random_dflash_weights, random_qwen3_weights,  # noqa: E402
                         save_checkpoint, stdlib_files, train_tokenizer)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/random-pair")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    target_dir = os.path.join(a.out, "target")
    files, _ = stdlib_files()
    tok = train_tokenizer(files[:200], a.vocab, target_dir)
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    config = qwen3_config(tok.get_vocab_size(), hidden=128, inter=256, layers=4, heads=4, kv_heads=2, head_dim=32,
                          eos=eos)
    save_checkpoint(target_dir, config, random_qwen3_weights(config, seed=a.seed), eos_ids=eos)
    draft_dir = os.path.join(a.out, "draft")
    draft = dflash_config(config, layers=1, block_size=8, mask_token_id=tok.token_to_id("<|mask|>"),
                          target_layer_ids=[1, 2])
    save_checkpoint(draft_dir, draft, random_dflash_weights(draft, seed=a.seed + 1))
    print(f"wrote {target_dir} and {draft_dir} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main()
