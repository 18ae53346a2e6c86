"""The dense Qwen3 target: a Hugging Face checkpoint loaded through safetensors into our own modules. The forward
takes token ids, their RoPE positions and cache slots (a tree node at depth d: position start + d, slot start + row)
and returns logits plus, on request, chosen layers' outputs (the drafter's context features). Other families are
modules that families.py applies to this skeleton after it is built (docs/families.md); nothing here imports one."""

import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import families
from loading import (check_layer_count, defaulted_note, eos_ids_of, load_weights, on_meta, parse_device, parse_dtype,
                     read_json, resolve_checkpoint, tie_or_keep_head)
from regions import run_layer
from tree_attn import flex_kernel_options


# ----------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # RoPE scaling as rope.py reads it ("default": plain RoPE); partial_rotary_factor: the share of each head rotated.
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "default"})
    partial_rotary_factor: float = 1.0
    defaulted: tuple = ()  # "field=value" of head_dim / num_key_value_heads when config.json has none (loading.py)
    # A family's own fields (moe.MoEConfig, hybrid.HybridConfig); None for dense.
    moe: object = None
    hybrid: object = None

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head that RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json", moe: bool | None = None) -> "Qwen3Config":
        """Every value from config.json, checked (families.config_fields; moe: read the MoE fields, None: if qwen3_moe)."""
        return cls(**families.config_fields(d, where, moe))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the reference upcasts: float32 for bf16 / fp16 / fp32 models, float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def rope_frequencies(config, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotated dims / 2] in float32, attention factor) of a config's RoPE (a scaled one: rope.py)."""
    if config.rope_scaling["rope_type"] != "default":
        return families.family("rope").rope_frequencies(config, device)
    dim = config.rotary_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)), 1.0


# ----------------------------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # As Qwen3: normalize upcast, cast back, then scale (the order matters in bf16).
        h = x.to(compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype):
    """cos, sin [..., rotary dims / 2] for positions [...], one per rotated pair, computed upcast and scaled by the
    RoPE's attention factor before the cast, as transformers does."""
    f = compute_dtype(dtype)
    freqs = positions.to(f)[..., None] * inv_freq.to(f)
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE (Hugging Face's products and sums, without the rotated copy). x: [N, heads, Q, head_dim];
    cos/sin: [N, 1, Q, rotary dims / 2]. Dimensions past the rotary ones pass through."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class Linear(nn.Linear):
    """nn.Linear without bias (on the CPU, cpu.CpuLinear takes its place). `parts` ({checkpoint name: rows}, in
    order) stacks projections of one input into one weight, read in one GEMM (the loader fills and writes back each
    part's rows); `split` cuts an output into the parts."""

    def __init__(self, in_features: int, out_features: int | None = None, parts: dict | None = None):
        super().__init__(in_features, out_features or sum(parts.values()), bias=False)
        self.parts = dict(parts) if parts else None

    def split(self, y):
        return y.split(list(self.parts.values()), dim=-1)

    def argmax(self, x, dtype: torch.dtype) -> tuple:
        """(each row's argmax token, whether all its logits are finite) of self(x) in `dtype`: what a greedy pick
        reads (tp.VocabParallelHead finds both without gathering the vocabulary)."""
        logits = self(x).to(dtype)
        return logits.argmax(-1), torch.isfinite(logits).all(-1)


class Attention(nn.Module):
    """Qwen3's attention. `q_rows`: q_proj's rows (more than the queries' in some families)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, q_rows: int | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_rows = q_rows or heads * head_dim
        kv_rows = kv_heads * head_dim
        self.qkv_proj = Linear(hidden, parts={"q_proj": self.q_rows, "k_proj": kv_rows, "v_proj": kv_rows})
        self.o_proj = Linear(heads * head_dim, hidden)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        # Static K/V caches, registered as (non-persistent) buffers so CUDA graphs see fixed addresses.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        self.kv_rows = None  # the (K, V) buffers the caches are the first rows of (allocate_kv_caches)

    def store_kv(self, k, v, cos, sin, cache_pos):
        """Projected k, v [N, Q, kv_heads * head_dim] into the caches (k normed and roped) at slots cache_pos."""
        n, q_len = k.shape[:2]
        k = self.k_norm(k.view(n, q_len, self.kv_heads, self.head_dim))
        batch = torch.arange(n, device=k.device)[:, None]
        self.k_cache[batch, :, cache_pos] = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)
        self.v_cache[batch, :, cache_pos] = v.view(n, q_len, self.kv_heads, self.head_dim)

    def kv_proj(self, x):
        """(k, v) projections of rows x alone, for rows that are never queries (a drafter's context)."""
        return F.linear(x, self.qkv_proj.weight[self.q_rows:]).chunk(2, dim=-1)

    def forward(self, x, cos, sin, cache_pos, mask):
        n, q_len = x.shape[:2]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = self.q_norm(q.reshape(n, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        self.store_kv(k, v, cos, sin, cache_pos)
        return self.o_proj(self.attend(q, mask, self.head_dim ** -0.5))

    def attend(self, q, mask, scale):
        """q [N, H, Q, D] over this layer's caches under `mask`, as [N, Q, H * D] (on the CPU: cpu.CpuAttention)."""
        n, q_len = q.shape[0], q.shape[2]
        out = flex_attention(q, self.k_cache, self.v_cache, block_mask=mask, scale=scale,
                             enable_gqa=self.heads != self.kv_heads,
                             kernel_options=flex_kernel_options(q_len, q.device.type))
        return out.transpose(1, 2).reshape(n, q_len, self.heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, parts={"gate_proj": inter, "up_proj": inter})
        self.down_proj = Linear(inter, hidden)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """One pre-norm Qwen3 decoder layer (also the DFlash drafter's layer, whose attention differs only in K/V)."""

    def __init__(self, c: Qwen3Config, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                   c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def forward(self, x, cos, sin, cache_pos, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def allocate_kv_caches(layers, length: int, dtype, device, batch: int = 1):
    """One K and one V buffer per layer [batch, kv_heads, length, head_dim], never views of one stacked buffer
    (compiled FlexAttention misreads them, docs/compile.md). Buffers with at least `batch` rows are kept (graphs
    hold on to them) and a smaller batch gets their first rows."""
    with torch.inference_mode(False):  # normal tensors: usable inside and outside inference mode
        for layer in layers:
            if not hasattr(layer, "self_attn"):  # a layer of another kind (a recurrent one): no K/V
                continue
            attn = layer.self_attn
            shape = (batch, attn.kv_heads, length, attn.head_dim)
            full = attn.kv_rows
            if full is None or full[0].shape[0] < batch or full[0].shape[1:] != shape[1:] or \
                    full[0].dtype != dtype or full[0].device != torch.device(device):
                full = attn.kv_rows = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
            if attn.k_cache is None or attn.k_cache.shape != shape or attn.k_cache.data_ptr() != full[0].data_ptr():
                attn.k_cache, attn.v_cache = (t if t.shape[0] == batch else t[:batch] for t in full)


class Qwen3(nn.Module):
    recurrent = False  # no recurrent state: the engine builds and commits none (a recurrent family's class says True)

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq, self.rope_attention_factor = rope_frequencies(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.eos_ids: list[int] = []
        self.path: str | None = None

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def setup_cache(self, length: int, batch: int = 1):
        """Allocate (or reuse) the K/V caches for `batch` requests of `length` slots."""
        allocate_kv_caches(self.layers, length, self.dtype, self.device, batch)

    def kv_caches(self):
        """Each attention layer's K and V cache, in order."""
        for layer in self.layers:
            if hasattr(layer, "self_attn"):
                yield from (layer.self_attn.k_cache, layer.self_attn.v_cache)

    def run_layer(self, layer, x, cos, sin, cache_pos, mask, recurrent):
        """One layer of the forward (a recurrent family routes its recurrent layers, which take `recurrent`)."""
        return run_layer(layer, x, cos, sin, cache_pos, mask)

    def forward(self, tokens, input_pos, cache_pos, block_mask, logits_rows=None, feature_layers=(), recurrent=None,
                argmax=False):
        """tokens, input_pos, cache_pos: [N, Q] int64 (rows, RoPE positions, cache slots), or [Q] for one request.
        Returns (float32 logits [N, len(logits_rows) or Q, V], features [N, Q, len(feature_layers) * hidden] or
        None), without N for 1-D input. logits_rows: [N, k] rows to take logits of. recurrent: a recurrent target's
        state (settings.RECURRENT_HOOKS). argmax: the pair Linear.argmax gives in place of the logits."""
        if tokens.dim() == 1:
            rows = None if logits_rows is None else logits_rows[None]
            logits, features = self(tokens[None], input_pos[None], cache_pos[None], block_mask, rows, feature_layers,
                                    recurrent, argmax)
            logits = tuple(t[0] for t in logits) if argmax else logits[0]
            return logits, (None if features is None else features[0])
        x = self.embed_tokens(tokens)
        cos, sin = (t[:, None] for t in rope_cos_sin(input_pos, self.inv_freq, self.rope_attention_factor, x.dtype))
        outputs, last = {}, len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = self.run_layer(layer, x, cos, sin, cache_pos, block_mask, recurrent)
            if i in feature_layers:
                # Hugging Face's last hidden state is after the final norm: drafters train on it (docs/checkpoints.md).
                outputs[i] = self.norm(x) if i == last else x
        if logits_rows is not None:
            x = x.gather(1, logits_rows[..., None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head.argmax(self.norm(x), compute_dtype(x.dtype)) if argmax else \
            self.lm_head(self.norm(x)).to(compute_dtype(x.dtype))
        # In the listed order, repeats included: the drafter's fc columns follow its target_layer_ids list.
        features = torch.cat([outputs[i] for i in feature_layers], dim=-1) if feature_layers else None
        return logits, features

    @classmethod
    def from_pretrained(cls, path_or_repo: str, device=None, dtype=None) -> "Qwen3":
        """The checkpoint at a local path or Hub repo, read as transformers reads it (docs/checkpoints.md); bf16 on
        CUDA, fp32 elsewhere unless `dtype` says. Its families are applied to the skeleton (families.py)."""
        path = resolve_checkpoint(path_or_repo, "target")
        where = os.path.join(path, "config.json")
        raw = read_json(where)
        other = families.other_loader(raw, where)
        if other is not None:  # another family's own target class
            return other(path, device, dtype)
        config = Qwen3Config.from_dict(raw, where)
        strip, skip_prefixes = families.checkpoint_prefixes(raw)
        check_layer_count(path, config.num_hidden_layers, where, skip_prefixes)
        device, take = families.parallel_device(parse_device(device))
        dtype = parse_dtype(dtype, device)
        model = on_meta(lambda: families.build(cls, config), where)
        optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
        try:
            load_weights(model, path, strip_prefix=strip, device=device, dtype=dtype, optional=optional,
                         skip_prefixes=skip_prefixes, take=take and take(model))
        except ValueError as e:
            if config.defaulted and "has shape" in str(e):
                raise ValueError(f"{e} ({defaulted_note(config.defaulted)})") from None
            raise
        if config.tie_word_embeddings:
            tie_or_keep_head(model, path)
        model.inv_freq = rope_frequencies(config, device)[0]
        model.eos_ids = eos_ids_of(path, families.text_config(raw, where)[0], config.vocab_size)
        model.path = path
        return model.eval()
