"""The Qwen3.5 / Qwen3.6 hybrid family (transformers' qwen3_5, qwen3_5_moe; docs/checkpoints.md): its config fields,
its target class and the hooks the engine calls on a recurrent target (docs/recurrent_tree.md, "Hooks").

Qwen3_5 is the dense Qwen3 with its layers converted after the dense skeleton is built: a linear_attention layer
mixes with a Gated DeltaNet (gated_delta.py) in place of attention and keeps a recurrent state per request, which
each forward advances along a chain (prefill, decode) or evaluates over a tree (verify) as a gated_delta.Recurrent
says; attention ropes the first partial_rotary_factor * head_dim dimensions and gates its output with sigmoid of a
second half of q_proj; every RMSNorm but the Gated DeltaNet's own is zero-centred (x * (1 + w)). Qwen3.5-MoE's MLP
is moe.py's, with a shared expert.
"""

from dataclasses import dataclass

import torch

import regions
from gated_delta import GatedDeltaNet, Recurrent, ZeroCenteredRMSNorm, commit_tree
from loading import dense_fields, positive
from model import Attention, Block, Qwen3, RMSNorm, apply_rope


# ----------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class HybridConfig:
    """layer_types: "full_attention" or "linear_attention" (Gated DeltaNet) per layer, and the Gated DeltaNet's
    sizes."""
    layer_types: tuple
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int


# What transformers 5.24 takes when config.json has no head_dim / num_key_value_heads.
DEFAULTS = {"qwen3_5": dict(head_dim=256, num_key_value_heads=4),
            "qwen3_5_moe": dict(head_dim=256, num_key_value_heads=2)}
LAYER_TYPES = ("full_attention", "linear_attention")
# Stripped from tensor names: the text model lies under model.language_model. (ForConditionalGeneration) or model.
# (ForCausalLM); skipped: a vision tower (model.visual.*) and multi-token-prediction weights (mtp.*), unused here.
CHECKPOINT_PREFIXES = ("model.language_model.", "model."), ("model.visual.", "mtp.", "model.mtp.")


def config_fields(d: dict, where: str, kind: str, rope_reader=None) -> dict:
    """Qwen3Config's fields from the text part of a Qwen3.5 config.json (text_config) of `kind` ("dense" or "moe",
    families.hybrid_kind): the dense ones (without a dense MLP for Qwen3.5-MoE), partial RoPE of 0.25 of head_dim
    when the file gives none (its RoPE read by rope_reader, families.rope_reader), then hybrid_fields and, for
    Qwen3.5-MoE, moe.qwen3_5_moe_fields."""
    family = "qwen3_5_moe" if kind == "moe" else "qwen3_5"
    fields = dense_fields(d, where, family, DEFAULTS[family], mlp=kind != "moe", partial_default=0.25,
                          rope_reader=rope_reader)
    fields.update(hybrid_fields(d, where, fields["partial_rotary_factor"], fields["head_dim"]))
    if kind == "moe":
        import moe
        fields["moe"] = moe.MoEConfig(**moe.qwen3_5_moe_fields(d, where))
    return fields


def hybrid_fields(d: dict, where: str, partial, head_dim: int) -> dict:
    """The Qwen3.5 fields (a HybridConfig, and Qwen3Config's partial_rotary_factor checked): which layers are Gated
    DeltaNet (layer_types, or every full_attention_interval-th layer full attention, default 4), their sizes, the
    partial RoPE (default 0.25 of head_dim, as transformers); the attention output gate is always on in Qwen3.5."""
    layers = d["num_hidden_layers"]
    kinds = d.get("layer_types")
    if kinds is None:
        interval = positive(where, d, "full_attention_interval", default=4)
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise ValueError(f"{where}: layer_types must list one type per layer ({layers}), got {kinds!r}")
    unknown = sorted(set(map(str, kinds)) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"{where}: unknown layer type(s) {unknown} in layer_types (supported: "
                         f"{', '.join(LAYER_TYPES)})")
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
        raise ValueError(f"{where}: partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    rotary = int(head_dim * partial)
    if rotary < 2 or rotary % 2:
        raise ValueError(f"{where}: partial_rotary_factor={partial} of head_dim={head_dim} ropes {rotary} "
                         f"dimensions; an even number >= 2 is needed")
    if d.get("attn_output_gate", True) is not True:
        raise ValueError(f"{where}: attn_output_gate={d['attn_output_gate']!r} is not supported (Qwen3.5's "
                         f"attention is always gated)")
    linear = {k: positive(where, d, k, default=default) for k, default in (
        ("linear_conv_kernel_dim", 4), ("linear_key_head_dim", 128), ("linear_value_head_dim", 128),
        ("linear_num_key_heads", 16), ("linear_num_value_heads", 32))}
    if linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
        raise ValueError(f"{where}: linear_num_value_heads={linear['linear_num_value_heads']} is not a multiple of "
                         f"linear_num_key_heads={linear['linear_num_key_heads']}")
    return dict(partial_rotary_factor=float(partial), hybrid=HybridConfig(layer_types=tuple(kinds), **linear))


# ----------------------------------------------------------------------------------------------------------------
# Modules


class GatedAttention(Attention):
    """Qwen3.5's attention: q_proj also gives a per-head output gate (each head's query then its gate), the output
    is o_proj(attention * sigmoid(gate)), and the q / k norms are zero-centred."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__(hidden, heads, kv_heads, head_dim, eps, q_rows=2 * heads * head_dim)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps)

    def forward(self, x, cos, sin, cache_pos, mask):
        n, q_len = x.shape[:2]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, gate = q.view(n, q_len, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.reshape(n, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        self.store_kv(k, v, cos, sin, cache_pos)
        out = self.attend(q, mask, self.head_dim ** -0.5)
        out = out * torch.sigmoid(gate.reshape(n, q_len, self.heads * self.head_dim))
        return self.o_proj(out)


class DeltaNetBlock(Block):
    """A linear_attention layer: the Gated DeltaNet (`linear_attn`, taking the forward's Recurrent) in place of
    self_attn."""

    def __init__(self, c, index: int):
        super().__init__(c, index)
        del self.self_attn
        h = c.hybrid
        self.linear_attn = GatedDeltaNet(c.hidden_size, h.linear_num_key_heads, h.linear_num_value_heads,
                                         h.linear_key_head_dim, h.linear_value_head_dim, h.linear_conv_kernel_dim,
                                         c.rms_norm_eps, index)

    def forward(self, x, recurrent=None):
        x = x + self.linear_attn(self.input_layernorm(x), recurrent)
        return x + self.mlp(self.post_attention_layernorm(x))


def zero_centre_norms(module):
    """Every RMSNorm below `module` becomes a zero-centred one (the Gated DeltaNet's own norm is another class)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is RMSNorm:
                setattr(parent, name, ZeroCenteredRMSNorm(child.weight.shape[0], child.eps))


@torch.compiler.nested_compile_region
def _recurrent_chain_once(layer, x, valid):
    return layer(x, Recurrent.chain(valid))


@torch.compiler.nested_compile_region
def _recurrent_tree_once(layer, x, parents, anc, depth):
    recurrent = Recurrent.tree(parents, anc, depth)
    x = layer(x, recurrent)
    return (x, *next(iter(recurrent.pending.values())))


def run_recurrent_layer(layer, x, recurrent):
    """A recurrent layer through its one compiled region (regions.COMPILE_LAYERS_ONCE): the region takes the
    Recurrent's tensors and hands back what a tree verify leaves for the commit (recurrent.pending)."""
    if not regions.COMPILE_LAYERS_ONCE:
        return layer(x, recurrent)
    if recurrent is not None and recurrent.is_tree:
        x, *pending = _recurrent_tree_once(layer, x, recurrent.parents, recurrent.anc, recurrent.depth)
        recurrent.pending[layer.linear_attn.index] = tuple(pending)
        return x
    return _recurrent_chain_once(layer, x, None if recurrent is None else recurrent.valid)


class Qwen3_5(Qwen3):
    """A Qwen3.5 / Qwen3.6 hybrid target: the dense Qwen3 with its layers converted (module docstring), and the
    recurrent target's hooks (settings.RECURRENT_HOOKS)."""
    recurrent = True

    def __init__(self, config):
        super().__init__(config)
        c = config
        for i, kind in enumerate(c.hybrid.layer_types):
            if kind == "linear_attention":
                self.layers[i] = DeltaNetBlock(c, i)
            else:
                self.layers[i].self_attn = GatedAttention(c.hidden_size, c.num_attention_heads,
                                                          c.num_key_value_heads, c.head_dim, c.rms_norm_eps)
        zero_centre_norms(self)
        self.recurrent_layers = [layer.linear_attn for layer in self.layers if hasattr(layer, "linear_attn")]

    def run_layer(self, layer, x, cos, sin, cache_pos, mask, recurrent):
        if hasattr(layer, "linear_attn"):
            return run_recurrent_layer(layer, x, recurrent)
        return regions.run_layer(layer, x, cos, sin, cache_pos, mask)

    def setup_cache(self, length: int, batch: int = 1):
        """The K/V caches (Qwen3.setup_cache), and per recurrent layer its conv state [batch, C, K - 1] (model
        dtype) and state [batch, Hv, Dk, Dv] (float32; float64 for a float64 model), reused the same way."""
        super().setup_cache(length, batch)
        for m in self.recurrent_layers:
            m.allocate(batch, self.dtype, self.device)

    # -- the recurrent target's hooks (settings.RECURRENT_HOOKS; docs/recurrent_tree.md, "Hooks") ---------------------

    def reset_recurrent(self):
        """Zero every recurrent and conv state (before a new prompt's prefill)."""
        for t in self.state_tensors():
            t.zero_()

    def state_tensors(self):
        """Every per-request recurrent tensor (request row = dim 0): each recurrent layer's conv state, then its
        state (after setup_cache)."""
        for m in self.recurrent_layers:
            yield m.conv_state
            yield m.state

    def chain_state(self, valid) -> Recurrent:
        """The forward's `recurrent` for a prefill chunk or decode step: the states advance in place over the first
        valid [N] rows of each request."""
        return Recurrent.chain(valid)

    def tree_state(self, parents, anc, depth: int) -> Recurrent:
        """The forward's `recurrent` for a tree verify: states untouched, recurrent.pending filled for
        commit_recurrent. parents [N, B], anc [N, B + 1, B + 1] (draft_tree.ancestor_matrix), depth its bound."""
        return Recurrent.tree(parents, anc, depth)

    def commit_recurrent(self, recurrent, path, length):
        """After a tree verify: each recurrent layer's state := its state after the accepted path, and its conv
        state := the last K - 1 inputs along it. path [N, D + 1]: accepted rows from the root (entries past length
        ignored); length [N] >= 1 (counts the root). In place, static shapes, no host read."""
        commit_tree(self.recurrent_layers, recurrent, path, length)
