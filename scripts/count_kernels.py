"""What a compiled AR decode step launches: inductor's fused kernels, GEMMs and other calls, per layer.

    python scripts/count_kernels.py [--layers 4] [--json out.json]

The step is compiled as a GPU engine compiles it (plain modules, every layer inlined, fullgraph) but on the CPU,
with the mask materialized for SDPA (compiled CPU FlexAttention is the CPU seam's business). Inductor's CPU and
GPU backends fuse the same pointwise graph, so the counts stand for a GPU step's launches: GEMMs exactly, fused
kernels closely. Two targets of a few small layers: a dense Qwen3 and a Qwen3.5 hybrid (three Gated DeltaNet
layers, then gated attention). Each compile takes seconds.
"""

import argparse
import collections
import os
import re
import sys

import torch
from torch._inductor.utils import run_and_get_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import model  # noqa: E402
from gated_delta import Recurrent  # noqa: E402
from model import Qwen3, Qwen3Config  # noqa: E402
from tree_attn import PrefixMask  # noqa: E402

DENSE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=False)
HYBRID = dict(DENSE, partial_rotary_factor=0.25, zero_centered_norm=True, attn_output_gate=True,
              linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
              linear_num_value_heads=6)
CALL = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+)(?:\.default)?\(", re.M)


def kind(call: str) -> str:
    if call.startswith(("cpp_fused", "triton_")):
        return "fused"
    if call.startswith("extern_kernels.") and call.split(".")[1] in ("mm", "addmm", "bmm", "baddbmm"):
        return "gemm"
    return call


def decode_step_calls(config: Qwen3Config) -> collections.Counter:
    """The kernel calls of one compiled decode step (one row, context 100) of a random model of this config."""
    model.COMPILE_LAYERS_ONCE = False  # every layer's calls in the one graph
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Qwen3(config).eval()
    m.setup_cache(1024)
    mask = PrefixMask(1, 1024, "cpu", dense=True).set(torch.tensor([100]))
    token, pos = torch.zeros(1, 1, dtype=torch.long), torch.tensor([[100]])

    def step(token, pos):
        return m(token, pos, pos, mask, recurrent=Recurrent.chain(torch.ones(1, dtype=torch.long)))[0]

    with torch.inference_mode():
        _, code = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False), token, pos)
    return collections.Counter(kind(c) for c in CALL.findall("\n".join(code)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.layers < 4:
        print("error: --layers must be at least 4 (the hybrid's layout: three Gated DeltaNet layers, then "
              "attention)", file=sys.stderr)
        return 2
    hybrid_types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(a.layers))
    configs = {"dense": Qwen3Config(**DENSE, num_hidden_layers=a.layers),
               "hybrid": Qwen3Config(**HYBRID, num_hidden_layers=a.layers, layer_types=hybrid_types)}
    out = {}
    print(f"{'target':8s} {'layers':>6s} {'gemm':>6s} {'fused':>6s} {'other':>6s} {'total':>6s} {'per layer':>10s}")
    for name, config in configs.items():
        calls = decode_step_calls(config)
        other = sum(v for k, v in calls.items() if k not in ("gemm", "fused"))
        total = sum(calls.values())
        out[name] = dict(layers=a.layers, calls=dict(calls), total=total)
        print(f"{name:8s} {a.layers:6d} {calls['gemm']:6d} {calls['fused']:6d} {other:6d} {total:6d} "
              f"{(total - 1) / a.layers:10.2f}")  # the lm_head's GEMM is the step's own
    if a.json:
        from benchlib import write_json
        write_json(a.json, dict(torch=torch.__version__, steps=out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
