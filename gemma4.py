"""Gemma 4 text targets (transformers 5.24's gemma4 / gemma4_text: the 31B's dense layout, the 26B-A4B's MoE block)
as a family module: its own model class meeting settings.Target, built from the core's parts (model.Linear's stacked
projections, model.allocate_kv_caches, tree_attn's PrefixMask tables), and its loader.

What differs from Qwen3 (docs/checkpoints.md, "Gemma 4"): sliding-window layers beside full-attention layers, each
kind with its own head size, K/V heads and RoPE; full layers whose values are their keys (attention_k_eq_v); a value
norm; four norms per layer and a per-layer output scale; a gelu-tanh MLP; embeddings scaled by sqrt(hidden); logits
softcapped. A sliding layer's window counts positions, not cache slots: in a tree verify a node sees the committed
tokens within the window of its own depth, and its ancestors, as transformers sees the path alone.
"""

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import model
import regions
from families import text_config
from loading import (check_layer_count, eos_ids_of, load_weights, on_meta, parse_device, parse_dtype, read_json,
                     resolve_checkpoint, tie_or_keep_head)
from model import Linear, rope_cos_sin
from moe import checkpoint_places
from rope import rope_frequencies
from tree_attn import BLOCK, flex_kernel_options, prefix_block_mask

def compute_dtype(dtype) -> torch.dtype:
    """The dtype norms and logits are computed in: float32, or float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
# Tensors of the hub's multimodal checkpoints that the text model does not read.
SKIPPED_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def is_gemma4(raw: dict) -> bool:
    """Whether a config.json is a Gemma 4 checkpoint (the families seam's dispatch)."""
    archs = raw.get("architectures") or []
    return raw.get("model_type") in ("gemma4", "gemma4_text") or \
        (isinstance(archs, list) and any(a in ARCHITECTURES for a in archs))


# ----------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple  # "sliding_attention" or "full_attention" per layer
    head_dims: tuple  # per layer (full layers: global_head_dim)
    kv_heads: tuple  # per layer (full layers with attention_k_eq_v: num_global_key_value_heads)
    attention_k_eq_v: bool  # full layers have no v_proj: their values are their keys' projection, value-normed
    sliding_window: int
    rope_parameters: dict  # per layer type: rope_type ("default" or "proportional"), rope_theta, partial factor
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    final_logit_softcapping: float | None
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    # What rope.position_limit reads: Gemma 4's RoPE never stretches past max_position_embeddings.
    rope_scaling: dict = None

    def __post_init__(self):
        self.rope_scaling = {"rope_type": "default"}

    def sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"


def gemma4_config(raw: dict, where: str) -> Gemma4Config:
    """A Gemma 4 config.json (text-only gemma4_text, or the hub's gemma4 with text_config) as Gemma4Config; what
    the module would get wrong is refused with one line naming the file."""
    d, where = text_config(raw, where)
    refuse = []
    if d.get("hidden_size_per_layer_input"):
        refuse.append(f"hidden_size_per_layer_input={d['hidden_size_per_layer_input']} (per-layer input "
                      f"embeddings of the small E2B / E4B models)")
    if d.get("num_kv_shared_layers"):
        refuse.append(f"num_kv_shared_layers={d['num_kv_shared_layers']} (KV sharing of the small models)")
    if d.get("use_bidirectional_attention") == "all":
        refuse.append("use_bidirectional_attention='all' (a non-causal model)")
    if d.get("attention_bias"):
        refuse.append("attention_bias=true")
    if d.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        refuse.append(f"hidden_activation={d['hidden_activation']!r} (gelu_pytorch_tanh is read)")
    if refuse:
        raise ValueError(f"{where}: a Gemma 4 model this engine does not run: {'; '.join(refuse)}")

    def integer(key, default=None):
        v = d.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{where}: {key} must be a positive integer, got {v!r}")
        return v

    layers = integer("num_hidden_layers")
    types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                     for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{where}: layer_types must list 'sliding_attention' or 'full_attention' for each of the "
                         f"{layers} layers, got {types!r}")
    types = types[:-1] + ["full_attention"]  # transformers forces the last layer to full attention
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    heads, head_dim, kv = integer("num_attention_heads"), integer("head_dim", 256), integer("num_key_value_heads")
    head_dims, kv_heads = per_layer_shapes(d, where, types, head_dim, kv, k_eq_v)
    moe = bool(d.get("enable_moe_block"))
    softcap = d.get("final_logit_softcapping")
    return Gemma4Config(
        vocab_size=integer("vocab_size"), hidden_size=integer("hidden_size"),
        intermediate_size=integer("intermediate_size"), num_hidden_layers=layers, num_attention_heads=heads,
        layer_types=tuple(types), head_dims=head_dims, kv_heads=kv_heads, attention_k_eq_v=k_eq_v,
        sliding_window=integer("sliding_window", 512), rope_parameters=rope_parameters(d, where, types),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=integer("max_position_embeddings", 131072),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", d.get("tie_word_embeddings", True))),
        final_logit_softcapping=float(softcap) if softcap else None, enable_moe_block=moe,
        num_experts=integer("num_experts") if moe else 0, top_k_experts=integer("top_k_experts") if moe else 0,
        moe_intermediate_size=integer("moe_intermediate_size") if moe else 0)


def per_layer_shapes(d: dict, where: str, types: list, head_dim: int, kv: int, k_eq_v: bool) -> tuple:
    """(head size, K/V heads) per layer, as transformers resolves them: a saved per_layer_config ({layer: its
    overrides}) when the file has one, else full layers take global_head_dim (default 512) and, with
    attention_k_eq_v, num_global_key_value_heads."""
    overrides = d.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": d.get("global_head_dim", 512)}
        if k_eq_v and d.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = d["num_global_key_value_heads"]
        overrides = {str(i): full for i, t in enumerate(types) if t == "full_attention"}
    if not isinstance(overrides, dict):
        raise ValueError(f"{where}: per_layer_config must be a JSON object, got {overrides!r}")
    head_dims, kv_heads = [], []
    for i in range(len(types)):
        o = overrides.get(str(i)) or {}
        if set(o) - {"head_dim", "num_key_value_heads"}:
            raise ValueError(f"{where}: per_layer_config of layer {i} overrides {sorted(o)}; only head_dim and "
                             f"num_key_value_heads are read")
        for key, default, out in (("head_dim", head_dim, head_dims), ("num_key_value_heads", kv, kv_heads)):
            v = o.get(key, default)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}: layer {i}'s {key} must be a positive integer, got {v!r}")
            out.append(v)
    return tuple(head_dims), tuple(kv_heads)


def rope_parameters(d: dict, where: str, types: list) -> dict:
    """Each layer type's RoPE (transformers' defaults when the file has none): default or proportional only."""
    given = d.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    out = {}
    for kind in set(types):
        p = given.get(kind) if isinstance(given, dict) else None
        if not isinstance(p, dict) or p.get("rope_type") not in ("default", "proportional") or \
                not isinstance(p.get("rope_theta"), (int, float)):
            raise ValueError(f"{where}: rope_parameters[{kind!r}] must give rope_type 'default' or 'proportional' "
                             f"and a rope_theta, got {p!r}")
        if p["rope_type"] == "default" and p.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{where}: rope_parameters[{kind!r}]: a partial default RoPE is not supported")
        out[kind] = dict(p)
    return out


@dataclass
class RopeOf:
    """What rope.rope_frequencies reads, for one layer type."""
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rope_scaling: dict
    max_position_embeddings: int

    @property
    def rotary_dim(self) -> int:
        return self.head_dim


def inv_freqs(c: Gemma4Config, device=None) -> dict:
    """{layer type: inverse frequencies} (each type's head size and RoPE)."""
    out = {}
    for kind, p in c.rope_parameters.items():
        head_dim = c.head_dims[c.layer_types.index(kind)]
        rope = RopeOf(head_dim, p["rope_theta"], p.get("partial_rotary_factor", 1.0), p,
                      c.max_position_embeddings)
        out[kind] = rope_frequencies(rope, device)[0]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Masks


def sliding_block_mask(base: BlockMask, positions, window: int) -> BlockMask:
    """The sliding-window layers' mask from the round's PrefixMask BlockMask `base`: what base allows, where the
    key's position is within window - 1 of the query's. Positions, not slots: a committed slot's position is the
    slot itself, a new row's is positions[b, row] (a tree node's depth past the prefix), so a node's window counts
    along its own path. Every visited block goes through the mask_mod (no full blocks), from the block of the
    lowest position any row sees."""
    kv_num, kv_idx, full_num, full_idx, prefix, allow = base.prefix_tensors
    kv_len, last, n_kv = base.seq_lengths[1], allow.shape[-1] - 1, kv_idx.shape[-1]
    base_mod = base.mask_mod

    def mask_mod(b, h, q, kv):
        rel = kv - prefix[b]
        new = (rel >= 0) & (rel <= last)
        kv_pos = torch.where(new, positions[b, rel.clamp(0, last)], kv)
        return base_mod(b, h, q, kv) & (positions[b, q.clamp(0, last)] - kv_pos < window)

    low = (positions.amin(-1) - window + 1).clamp(min=0)
    first = (low // BLOCK).clamp(max=n_kv).to(torch.int32)
    end = ((prefix + last + BLOCK) // BLOCK).clamp(max=n_kv).to(torch.int32)
    num = (end - first)[:, None, None].expand_as(kv_num).contiguous()
    blocks = torch.arange(n_kv, dtype=torch.int32, device=prefix.device)
    indices = (blocks + first[:, None]).clamp(max=n_kv - 1)[:, None, None].expand_as(kv_idx).contiguous()
    return BlockMask.from_kv_blocks(num, indices, torch.zeros_like(full_num), full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(last + 1, kv_len), compute_q_blocks=False)


def dense_mask(block_mask: BlockMask) -> torch.Tensor:
    """A BlockMask's mask_mod evaluated over every (row, slot) as a bool [N, 1, Q, S] tensor (eager CPU attention
    by SDPA: eager FlexAttention on the CPU is a slow vmapped fallback)."""
    q_len, kv_len = block_mask.seq_lengths
    device = block_mask.kv_num_blocks.device
    b = torch.arange(block_mask.kv_num_blocks.shape[0], device=device)[:, None, None, None]
    return block_mask.mask_mod(b, 0, torch.arange(q_len, device=device)[:, None],
                               torch.arange(kv_len, device=device)[None, :])


# ----------------------------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: normalized and scaled in float32 (float64 for a float64 model), then cast back; without
    a scale (the value norm, the router's norm) when with_scale is false."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x):
        h = x.to(compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            h = h * self.weight.to(h.dtype)
        return h.to(x.dtype)


class Attention(nn.Module):
    """Gemma 4's attention: q/k norms, a value norm without scale, no 1/sqrt(d) (the norms set the scale), and for
    a full layer with k_eq_v no v_proj: its values are the key projection, value-normed."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, k_eq_v: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.k_eq_v = heads, kv_heads, head_dim, k_eq_v
        parts = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim}
        if not k_eq_v:
            parts["v_proj"] = kv_heads * head_dim
        self.qkv_proj = Linear(hidden, parts=parts)
        self.o_proj = Linear(heads * head_dim, hidden)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.v_norm = RMSNorm(head_dim, eps, with_scale=False)
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        self.kv_rows = None  # model.allocate_kv_caches

    def forward(self, x, cos, sin, cache_pos, mask):
        n, q_len = x.shape[:2]
        q, k, *v = self.qkv_proj.split(self.qkv_proj(x))
        v = v[0] if v else k
        q = self.q_norm(q.view(n, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = model.apply_rope(q, cos, sin)
        k = self.k_norm(k.view(n, q_len, self.kv_heads, self.head_dim)).transpose(1, 2)
        batch = torch.arange(n, device=x.device)[:, None]
        self.k_cache[batch, :, cache_pos] = model.apply_rope(k, cos, sin).transpose(1, 2)
        self.v_cache[batch, :, cache_pos] = self.v_norm(v.view(n, q_len, self.kv_heads, self.head_dim))
        return self.o_proj(self.attend(q, mask))

    def attend(self, q, mask):
        n, q_len = q.shape[0], q.shape[2]
        gqa = self.heads != self.kv_heads
        if isinstance(mask, torch.Tensor):  # a dense mask (eager on the CPU)
            out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, scale=1.0,
                                                 enable_gqa=gqa)
        else:
            out = flex_attention(q, self.k_cache, self.v_cache, block_mask=mask, scale=1.0, enable_gqa=gqa,
                                 kernel_options=flex_kernel_options(q_len, q.device.type))
        return out.transpose(1, 2).reshape(n, q_len, self.heads * self.head_dim)


class MLP(model.MLP):
    """Qwen3's gated MLP with Gemma's gate activation, GELU (tanh approximation)."""

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Router(nn.Module):
    """The 26B-A4B's router: the unscaled norm of the layer's input, scaled per channel and by hidden^-0.5, picks
    top_k experts by softmax (in float32, as transformers computes it at every dtype); their probabilities,
    renormalized, times each chosen expert's own scale are its weights."""

    def __init__(self, hidden: int, experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k = top_k
        self.norm = RMSNorm(hidden, eps, with_scale=False)
        self.proj = Linear(hidden, experts)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))

    def forward(self, x):
        """(expert ids [R, top_k], weights [R, top_k]) for rows x [R, H]."""
        scores = self.proj(self.norm(x) * self.scale * x.shape[-1] ** -0.5)
        weights, ids = scores.softmax(-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights * self.per_expert_scale[ids]


class Experts(nn.Module):
    """The 26B-A4B's gelu-tanh experts, stacked [experts, out, in] (the loader splits the file's fused gate_up_proj
    into gate_proj and up_proj). A few (row, expert) pairs gather their experts' weights; many run every expert
    over every row, weighted by the routing (zero where not chosen), reading each expert once."""

    def __init__(self, hidden: int, inter: int, experts: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.up_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))

    def forward(self, x, ids, weights):
        weights = weights.to(x.dtype)
        if ids.numel() <= self.gate_proj.shape[0]:
            flat, xr = ids.reshape(-1), x.repeat_interleave(ids.shape[1], dim=0)  # pair j: row j // k
            h = F.gelu(torch.einsum("ph,pih->pi", xr, self.gate_proj[flat]), approximate="tanh") * \
                torch.einsum("ph,pih->pi", xr, self.up_proj[flat])
            out = torch.einsum("pi,phi->ph", h, self.down_proj[flat]) * weights.reshape(-1, 1)
            return out.view(*ids.shape, -1).sum(1)
        h = F.gelu(torch.einsum("rh,eih->rei", x, self.gate_proj), approximate="tanh") * \
            torch.einsum("rh,eih->rei", x, self.up_proj)
        out = torch.einsum("rei,ehi->reh", h, self.down_proj)
        dense = torch.zeros(out.shape[:2], dtype=x.dtype, device=x.device).scatter(1, ids, weights)
        return (out * dense[..., None]).sum(1)


class Block(nn.Module):
    """One Gemma 4 decoder layer: attention and MLP each between a norm before and a norm after, the layer's
    output scaled by layer_scalar."""

    def __init__(self, c: Gemma4Config, index: int):
        super().__init__()
        h, eps = c.hidden_size, c.rms_norm_eps
        self.sliding = c.sliding(index)
        self.recurrent = False
        self.self_attn = Attention(h, c.num_attention_heads, c.kv_heads[index], c.head_dims[index], eps,
                                   c.attention_k_eq_v and not self.sliding)
        self.mlp = MLP(h, c.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.moe = c.enable_moe_block
        if self.moe:  # the 26B-A4B: experts beside the MLP, each branch normed before and after
            self.router = Router(h, c.num_experts, c.top_k_experts, eps)
            self.experts = Experts(h, c.moe_intermediate_size, c.num_experts)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps)

    def forward(self, x, cos, sin, cache_pos, mask):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, cache_pos, mask))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(self.sparse(x))
        return (x + self.post_feedforward_layernorm(h)) * self.layer_scalar

    def sparse(self, x):
        """The experts' branch: routed by the layer's input x itself, run on its pre_feedforward_layernorm_2."""
        rows = x.reshape(-1, x.shape[-1])
        ids, weights = self.router(rows)
        return self.experts(self.pre_feedforward_layernorm_2(rows), ids, weights).view(x.shape)


@torch.compiler.nested_compile_region
def _layer_once(layer, x, cos, sin, positions, cache_pos, kv_num_blocks, kv_indices, full_num, full_idx, prefix,
                allow, window):
    """A layer under torch.compile, its mask rebuilt from tensors (as regions._layer_once): one trace per kind."""
    mask = prefix_block_mask(kv_num_blocks, kv_indices, full_num, full_idx, prefix, allow,
                             layer.self_attn.k_cache.shape[2])
    if window:
        mask = sliding_block_mask(mask, positions, window)
    return layer(x, cos, sin, cache_pos, mask)


class Gemma4(nn.Module):
    recurrent_layers = ()  # no recurrent state (what memory.recurrent_bytes_per_request sums over)

    def __init__(self, config: Gemma4Config):
        super().__init__()
        self.config = c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)  # unscaled: the drafter scales its own
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = inv_freqs(c)  # {layer type: tensor}: plain attributes, not checkpoint state
        self.eos_ids: list[int] = []
        self.path: str | None = None

    # Target members that read only embed_tokens and the layers' K/V caches (full length, one pair per layer, each
    # with its own heads and head size): the dense Qwen3's own, shared rather than inherited (a Gemma is no Qwen3).
    device, dtype, setup_cache, kv_caches = model.Qwen3.device, model.Qwen3.dtype, model.Qwen3.setup_cache, \
        model.Qwen3.kv_caches

    def embed(self, tokens):
        # As transformers: sqrt(hidden) as a float32 buffer cast to the weights' dtype (73.5 for 5376 in bfloat16).
        scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32).to(self.dtype)
        return self.embed_tokens(tokens) * scale

    def run_layer(self, layer, x, rope, positions, cache_pos, masks):
        cos, sin = rope[layer.sliding]
        window = self.config.sliding_window if layer.sliding else 0
        if torch.compiler.is_compiling() and regions.COMPILE_LAYERS_ONCE:
            # (a region's inputs may not alias each other: a decode step's positions are its cache slots)
            return _layer_once(layer, x, cos, sin, positions.clone(), cache_pos, *masks[False].prefix_tensors,
                               window)
        return layer(x, cos, sin, cache_pos, masks[layer.sliding])

    def layer_masks(self, block_mask, positions) -> dict:
        """{sliding: the mask its layers attend under}; dense tensors when eager on the CPU."""
        masks = {False: block_mask}
        if any(layer.sliding for layer in self.layers):
            masks[True] = sliding_block_mask(block_mask, positions, self.config.sliding_window)
        if positions.device.type == "cpu" and not torch.compiler.is_compiling():
            masks = {k: dense_mask(m) for k, m in masks.items()}
        return masks

    def forward(self, tokens, input_pos, cache_pos, block_mask, logits_rows=None, feature_layers=(), argmax=False,
                **hooks):
        """As model.Qwen3.forward (settings.Target); a recurrent target's hooks are ignored. The logits are
        softcapped, and argmax picks from the softcapped logits, as transformers' greedy does."""
        if tokens.dim() == 1:
            rows = None if logits_rows is None else logits_rows[None]
            logits, features = self(tokens[None], input_pos[None], cache_pos[None], block_mask, rows, feature_layers,
                                    argmax)
            logits = tuple(t[0] for t in logits) if argmax else logits[0]
            return logits, (None if features is None else features[0])
        x = self.embed(tokens)
        rope = {layer.sliding: None for layer in self.layers}
        for sliding in rope:
            freqs = self.inv_freq["sliding_attention" if sliding else "full_attention"]
            rope[sliding] = tuple(t[:, None] for t in rope_cos_sin(input_pos, freqs, 1.0, x.dtype))
        masks = self.layer_masks(block_mask, input_pos)
        outputs, last = {}, len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = self.run_layer(layer, x, rope, input_pos, cache_pos, masks)
            if i in feature_layers:
                outputs[i] = self.norm(x) if i == last else x  # as model.Qwen3: the last layer's is normed
        if logits_rows is not None:
            x = x.gather(1, logits_rows[..., None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(self.norm(x)).to(compute_dtype(x.dtype))
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if argmax:
            logits = (logits.argmax(-1), torch.isfinite(logits).all(-1))
        features = torch.cat([outputs[i] for i in feature_layers], dim=-1) if feature_layers else None
        return logits, features


# ----------------------------------------------------------------------------------------------------------------
# Tensor parallel (tp.py: under torchrun only)


def shard_attention(attn: Attention, prefix: str, plan):
    """This rank's query heads and the K/V heads they read (a K/V head shared by ranks when there are fewer than
    ranks), q/k/v and o split by those heads; a full layer whose values are its keys has no v_proj: its values
    come from this rank's own key heads. The q/k norms (per head size) stay whole."""
    import tp
    heads, kv, hd = attn.heads, attn.kv_heads, attn.head_dim
    n, r = tp.world_size(), tp.rank()
    if kv < n and n % kv:
        raise ValueError(f"tensor parallel: {prefix}'s {kv} key/value heads neither split over {n} ranks nor "
                         f"divide them (ranks sharing a KV head)")
    q0, q1 = tp.split(heads, "num_attention_heads")
    k0, k1 = tp.split(kv, f"{prefix}'s key/value heads") if kv >= n else (r // (n // kv), r // (n // kv) + 1)
    plan[f"{prefix}.q_proj.weight"] = (0, heads * hd, [(q0 * hd, q1 * hd)])
    for name in ("k_proj",) if attn.k_eq_v else ("k_proj", "v_proj"):
        plan[f"{prefix}.{name}.weight"] = (0, kv * hd, [(k0 * hd, k1 * hd)])
    plan[f"{prefix}.o_proj.weight"] = (1, heads * hd, [(q0 * hd, q1 * hd)])
    attn.heads, attn.kv_heads = q1 - q0, k1 - k0
    parts = {"q_proj": attn.heads * hd, "k_proj": attn.kv_heads * hd}
    if not attn.k_eq_v:
        parts["v_proj"] = attn.kv_heads * hd
    hidden = attn.qkv_proj.in_features
    tp.resize_linear(attn.qkv_proj, sum(parts.values()), hidden, parts)
    tp.resize_linear(attn.o_proj, hidden, attn.heads * hd)


def shard(target: Gemma4):
    """tp.shard for a Gemma 4 target built on the meta device: attention by heads, the MLP and the 26B-A4B's
    experts by their intermediate size (the router whole), each sublayer's output all-reduced before its
    post-norm, the embedding and the head by vocabulary. Returns the plan of what to read (tp.take)."""
    import tp
    plan = tp.Plan()
    for i, block in enumerate(target.layers):
        prefix = f"layers.{i}"
        shard_attention(block.self_attn, f"{prefix}.self_attn", plan)
        tp.shard_mlp(block.mlp, f"{prefix}.mlp", plan)
        summed = [block.self_attn, block.mlp]
        if block.moe:
            tp.shard_moe(block, prefix, plan)
            summed.append(block.experts)
        for sublayer in summed:
            sublayer.register_forward_hook(tp.all_reduce_output)
    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    target.embed_tokens = tp.VocabParallelEmbedding(vocab, hidden)
    target.lm_head = tp.VocabParallelHead(hidden, vocab)
    plan["embed_tokens.weight"] = (0, vocab, [target.embed_tokens.vocab_rows])
    plan["lm_head.weight"] = (0, vocab, [target.lm_head.vocab_rows])
    return plan


def from_pretrained(path_or_repo: str, device=None, dtype=None) -> Gemma4:
    """A Gemma 4 checkpoint (Gemma4ForCausalLM, or the hub's multimodal Gemma4ForConditionalGeneration, whose
    vision and audio towers are not read) at a local path or Hub repo; bf16 on CUDA and fp32 elsewhere unless
    `dtype` says."""
    path = resolve_checkpoint(path_or_repo, "target")
    where = os.path.join(path, "config.json")
    raw = read_json(where)
    config = gemma4_config(raw, where)
    check_layer_count(path, config.num_hidden_layers, where, SKIPPED_PREFIXES)
    device = parse_device(device)
    tp = None
    if os.environ.get("WORLD_SIZE", "1") != "1":
        import tp  # under torchrun only
        device = tp.setup(device)
    dtype = parse_dtype(dtype, device)
    target = on_meta(lambda: Gemma4(config), where)
    if config.enable_moe_block:  # its fused experts.gate_up_proj is split as Qwen3.5-MoE's is
        target.checkpoint_places = checkpoint_places
    # launched by torchrun: this rank's shard, read as slices (tp.py)
    take = functools.partial(tp.take, shard(target)) if tp is not None and tp.enabled() else None
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    load_weights(target, path, strip_prefix=("model.language_model.", "model."), device=device, dtype=dtype,
                 optional=optional, skip_prefixes=SKIPPED_PREFIXES, take=take)
    if config.tie_word_embeddings:
        tie_or_keep_head(target, path)
    target.inv_freq = inv_freqs(config, device)
    target.eos_ids = eos_ids_of(path, text_config(raw, where)[0], config.vocab_size)
    target.path = path
    return target.eval()
