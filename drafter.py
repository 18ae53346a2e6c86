"""DFlash block-diffusion drafters (z-lab checkpoint formats, DFlash 1 and 2) in our own modules.

A round drafts one block `[bonus, MASK x (block_size - 1)]` per request at absolute positions start .. start +
block_size - 1. Every layer is a Qwen3 layer whose keys/values are those of the context (the target's chosen-layer
outputs of the committed tokens, fused by `fc` + `hidden_norm`) followed by those of the block; the block attends
to all of the context and bidirectionally to itself. Output k >= 1 is the distribution of the token at start + k,
so one forward gives block_size - 1 per-position distributions. The embedding and lm_head are the target's.

Only the context's K/V persist between rounds (one cache buffer per layer, like the target's); the block's K/V
are written into the slots just after the context and overwritten by the next round. Context features are
appended with a fixed width so every round has the same shapes and compiles once.

DFlash 2 (`DFlash2DraftModel`) adds two things (docs/checkpoints.md, "DFlash 2"): in every layer a grouped dynamic
causal convolution over the block's rows around the attention and around the MLP, and a candidate selector: the
drafter's top-K tokens per position, scored with a low-rank term of the token before them, so that a position's
law depends on its predecessor (draft_tree.Lattice).
"""

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loading import (check_layer_count, check_pair, dflash_config_fields, load_weights, on_meta, parse_device,
                     parse_dtype, read_json, resolve_checkpoint)
from draft_tree import Lattice
from gated_delta import compute_dtype
from model import Block, Linear, Qwen3Config, RMSNorm, allocate_kv_caches, rope_cos_sin, run_layer
from rope import rope_frequencies
import tp


@dataclass
class DFlashConfig:
    model: Qwen3Config  # the drafter's own layers (hidden size equal to the target's)
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    # per layer (sliding window or None, causal): how its block rows attend (loading.attention_kinds); () = every
    # layer (None, False), the whole context and block
    attention: tuple = ()
    output_multiplier: float = 1.0  # logits = lm_head(h) * output_multiplier, then the softcap
    logit_softcap: float | None = None  # final_logit_softcapping: logits = c * tanh(logits / c)
    input_embedding_scale: float = 1.0  # the block's embeddings are scaled by it
    # DFlash 2 (0 = DFlash 1): the convolutions' kernel and group sizes, the selector's rank and candidates
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "DFlashConfig":
        """The drafter's config.json, checked (loading.dflash_config_fields)."""
        fields = dflash_config_fields(d, where)
        return cls(model=Qwen3Config(**fields.pop("model")), **fields)

    def attention_of(self, layer: int) -> tuple:
        return self.attention[layer] if self.attention else (None, False)

    @property
    def mask_kinds(self) -> list:
        """The distinct (window, causal) of the layers: one block mask each (ddtree.Engine)."""
        return sorted({self.attention_of(i) for i in range(self.model.num_hidden_layers)}, key=str)

    @property
    def selector(self) -> bool:
        """Whether this is a DFlash 2 drafter (a candidate selector; drafts are a Lattice)."""
        return self.selector_top_k > 0


def grouped_dynamic_conv(x, dynamic, base, group: int):
    """out[t] = sum_{o < K} (base[o] + dynamic[t, o, g]) * x[t - o] over the rows t of each request's block
    (x[t - o] = 0 before the block's first row: the context is never convolved). x [N, T, C]; dynamic
    [N, T, K, C / group] (one correction per group g of `group` channels, from the row's own input); base [K, C]."""
    N, T, C = x.shape
    K, groups = base.shape[0], C // group
    blocks = x.view(N, T, groups, group)
    out = torch.zeros_like(blocks)
    for o in range(K):
        shifted = blocks if o == 0 else F.pad(blocks[:, :T - o], (0, 0, 0, 0, o, 0))
        out = out + (base[o].view(groups, group) + dynamic[:, :, o, :, None]) * shifted
    return out.view(N, T, C)


class GroupedDynamicConv(nn.Module):
    """DFlash 2's convolution around a sublayer: the sublayer's normed input h gives, through one projection, the
    per-group corrections of two kernels (`prepare`: the first convolves h before the sublayer; `finish`: the
    second convolves the sublayer's output with the corrections computed from h)."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.empty(2, kernel, hidden))
        self.kernel_projection = Linear(hidden, 2 * kernel * (hidden // group))

    def prepare(self, h):
        dynamic = self.kernel_projection(h).view(*h.shape[:-1], 2, self.kernel, h.shape[-1] // self.group)
        return grouped_dynamic_conv(h, dynamic[:, :, 0], self.base_kernel[0], self.group), dynamic[:, :, 1]

    def finish(self, out, dynamic):
        return grouped_dynamic_conv(out, dynamic, self.base_kernel[1], self.group)


class DFlash2Block(Block):
    """A DFlash 2 drafter layer: a Qwen3 layer whose attention and MLP each sit between the two kernels of a
    GroupedDynamicConv."""

    def __init__(self, c: Qwen3Config, kernel: int, group: int):
        super().__init__(c)
        self.attention_conv = GroupedDynamicConv(c.hidden_size, kernel, group)
        self.mlp_conv = GroupedDynamicConv(c.hidden_size, kernel, group)

    def forward(self, x, cos, sin, cache_pos, mask, recurrent=None):
        h, dynamic = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, cache_pos, mask), dynamic)
        h, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), dynamic)


class CandidateSelector(nn.Module):
    """DFlash 2's selector: the drafter's top-K tokens at each draft position, each scored by its logit plus a
    low-rank term coupling it to the token before it, (P[prev] * W h) . S[token], with P, S the predecessor and
    successor codebooks (published without `.weight`: CODEBOOK_ALIASES) and h the drafter's output at the
    position."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = Linear(hidden, rank)

    def lattice(self, hidden, logits, anchor) -> Lattice:
        """hidden [N, L, H], logits [N, L, V] (float32, or float64) of the L draft positions, anchor [N] (the
        bonus, the token before position 0) -> the Lattice of candidates [N, L, K] (logit order) and scores
        [N, L, K, K]: row p of position d scores the candidates after candidate p of position d - 1 (after the
        anchor for d = 0, whose K rows are equal)."""
        K = min(self.top_k, logits.shape[-1])
        unary, tokens = logits.topk(K, dim=-1)
        before = torch.cat([anchor[:, None, None].expand(-1, 1, K), tokens[:, :-1]], dim=1)  # [N, L, K]
        return Lattice(tokens, self.scores(hidden, before, tokens, unary))

    def scores(self, hidden, before, tokens, unary):
        """The selector's scores [..., P, K] of candidates tokens [..., K] (logits `unary` [..., K]) after each
        of the tokens before [..., P], at positions of drafter outputs hidden [..., H], in the logits' dtype."""
        f = unary.dtype
        h = self.hidden_projection(hidden).to(f)[..., None, :]  # [..., 1, r]
        pred = self.predecessor_codebook[before].to(f) * h  # [..., P, r]
        succ = self.successor_codebook[tokens].to(f)  # [..., K, r]
        return unary[..., None, :] + pred @ succ.transpose(-1, -2)


# z-lab publishes the codebooks without `.weight`, and its package's save_pretrained writes them with it (its
# modules are nn.Embeddings); the package reads both, and so do we.
CODEBOOK_ALIASES = {f"candidate_selector.{name}.weight": f"candidate_selector.{name}"
                    for name in ("predecessor_codebook", "successor_codebook")}


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config, self.block_size = config, config.block_size
        c = config.model
        if config.selector:
            self.layers = nn.ModuleList(DFlash2Block(c, config.conv_kernel_size, config.conv_group_size)
                                        for _ in range(c.num_hidden_layers))
            self.candidate_selector = CandidateSelector(c.vocab_size, c.hidden_size, config.selector_rank,
                                                        config.selector_top_k)
        else:
            self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        for i, layer in enumerate(self.layers):  # which of draft()'s masks each layer takes
            layer.mask_kind = config.attention_of(i)
        self.fc = Linear(len(config.target_layer_ids) * c.hidden_size, c.hidden_size)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        inv_freq, self.rope_attention_factor = rope_frequencies(c)  # a Qwen3 config's RoPE, scaling included
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.target_parts = None  # (embed_tokens, lm_head) of the bound target: used, not owned (no state_dict)
        self.path: str | None = None

    @property
    def device(self):
        return self.fc.weight.device

    @property
    def dtype(self):
        return self.fc.weight.dtype

    def bind(self, target) -> "DFlashDrafter":
        """Check that this drafter fits `target` and use the target's embedding and lm_head."""
        check_pair(target, self)
        self.target_parts = (target.embed_tokens, target.lm_head)
        return self

    def setup_cache(self, length: int, batch: int = 1):
        allocate_kv_caches(self.layers, length, self.dtype, self.device, batch)

    def kv_caches(self):
        return [c for layer in self.layers for c in (layer.self_attn.k_cache, layer.self_attn.v_cache)]

    def append_context(self, features, positions, cache_pos):
        """Write the context K/V of committed tokens: features [N, W, len(ids) * hidden] (the target's chosen-layer
        outputs), at RoPE positions and cache slots [N, W] (request n in cache row n). No attention: context rows
        are keys, never queries."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = (t[:, None] for t in rope_cos_sin(positions, self.inv_freq, self.rope_attention_factor, ctx.dtype))
        for layer in self.layers:
            layer.self_attn.store_kv(*layer.self_attn.kv_proj(ctx), cos, sin, cache_pos)

    def forward(self, block_tokens, positions, cache_pos, masks: dict, rows: slice = slice(None)):
        """One denoising pass over blocks [N, block_size] -> the final normed hidden states [N, block_size, H] of
        the block's `rows` (row k predicts the token at position start + k; row 0 is the bonus's own row and is
        not a prediction). Each layer attends under masks[its (window, causal)] (config.mask_kinds)."""
        embed = self.target_parts[0]
        x = embed(block_tokens)
        if self.config.input_embedding_scale != 1:
            x = x * self.config.input_embedding_scale
        cos, sin = (t[:, None] for t in rope_cos_sin(positions, self.inv_freq, self.rope_attention_factor, x.dtype))
        for layer in self.layers:
            x = run_layer(layer, x, cos, sin, cache_pos, masks[layer.mask_kind])
        return self.norm(x[:, rows])

    def logits(self, hidden, lm_head=None):
        """Logits of hidden states in float32 (float64 for a float64 model): the target's lm_head (or `lm_head`),
        times output_multiplier, softcapped."""
        logits = (lm_head or self.target_parts[1])(hidden).to(compute_dtype(hidden.dtype))
        c = self.config
        if c.output_multiplier != 1:
            logits = logits * c.output_multiplier
        if c.logit_softcap:
            logits = torch.tanh(logits / c.logit_softcap) * c.logit_softcap
        return logits

    def draft(self, bonus, start, masks: dict, denoise_steps: int = 1, length: int | None = None):
        """Per-position draft logits [N, length, vocab] (a DFlash 2 drafter: the draft_tree.Lattice of its
        selector) for the first `length` (default and at most block_size - 1) positions after each request's bonus
        [N] at start [N]. A shorter length changes no logit:
        every row of the block still runs through every layer (the rows see each other), and only the unused
        rows' final norm and lm_head are skipped; a tree of B nodes is at most B deep, so ddtree needs only
        min(B, block_size - 1) of them.

        `masks`, one per config.mask_kinds (tree_attn.PrefixMask.set), must let request n's block see slots
        [0, start[n] + block_size) as its layers attend. With denoise_steps T > 1, each pass unmasks the most
        confident still-masked positions (their argmax) and the next pass conditions on them; each position keeps
        the logits of the pass that decided it (the last pass for those still masked), so the draft is the same
        per-position form as with T = 1.
        """
        bs, n = self.block_size, bonus.shape[0]
        length = length or bs - 1
        pos = start[:, None] + torch.arange(bs, device=bonus.device)
        mask_tokens = torch.full((n, bs - 1), self.config.mask_token_id, dtype=torch.long, device=bonus.device)
        tokens = torch.cat([bonus[:, None], mask_tokens], dim=1)
        if denoise_steps == 1:
            hidden = self(tokens, pos, pos, masks, rows=slice(1, 1 + length))
            logits = self.logits(hidden)
            if self.config.selector:
                return self.candidate_selector.lattice(hidden, logits, bonus)
            return logits
        if self.config.selector:
            raise ValueError("denoise_steps > 1 is not supported for DFlash 2 drafters")
        logits = self.logits(self(tokens, pos, pos, masks))[:, 1:]
        masked = torch.ones(n, bs - 1, dtype=torch.bool, device=bonus.device)

        def decided_after(passes):  # an equal share of the block is decided by each pass
            return -(-(bs - 1) * passes // denoise_steps)

        for step in range(1, denoise_steps):
            count = decided_after(step) - decided_after(step - 1)
            confidence = logits.log_softmax(-1).amax(-1).masked_fill(~masked, -float("inf"))
            chosen = torch.zeros_like(masked).scatter(1, confidence.topk(count, dim=-1).indices, True) & masked
            tokens = torch.cat([tokens[:, :1], torch.where(chosen, logits.argmax(-1), tokens[:, 1:])], dim=1)
            masked = masked & ~chosen
            new = self.logits(self(tokens, pos, pos, masks))[:, 1:]
            logits = torch.where(masked[..., None], new, logits)
        return logits[:, :length]

    @classmethod
    def from_pretrained(cls, path_or_repo: str, device=None, dtype=None) -> "DFlashDrafter":
        path = resolve_checkpoint(path_or_repo, "drafter")
        where = os.path.join(path, "config.json")
        config = DFlashConfig.from_dict(read_json(where), where)
        check_layer_count(path, config.model.num_hidden_layers, where)
        device = tp.setup(parse_device(device))  # under torchrun: this rank's GPU (the drafter is replicated)
        dtype = parse_dtype(dtype, device)
        drafter = on_meta(lambda: cls(config), where)
        load_weights(drafter, path, strip_prefix="", device=device, dtype=dtype, aliases=CODEBOOK_ALIASES)
        drafter.inv_freq = rope_frequencies(config.model, device)[0]
        drafter.path = path
        return drafter.eval()
