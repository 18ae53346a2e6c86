"""DFlash block-diffusion drafter (z-lab checkpoint format) in our own modules.

A round drafts one block `[bonus, MASK x (block_size - 1)]` per request at absolute positions start .. start +
block_size - 1. Every layer is a Qwen3 layer whose keys/values are those of the context (the target's chosen-layer
outputs of the committed tokens, fused by `fc` + `hidden_norm`) followed by those of the block; the block attends
to all of the context and bidirectionally to itself. Output k >= 1 is the distribution of the token at start + k,
so one forward gives block_size - 1 per-position distributions. The embedding and lm_head are the target's.

Only the context's K/V persist between rounds (one cache buffer per layer, like the target's); the block's K/V
are written into the slots just after the context and overwritten by the next round. Context features are
appended with a fixed width so every round has the same shapes and compiles once.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from loading import (check_pair, dflash_config_fields, load_weights, parse_device, parse_dtype, read_json,
                     resolve_checkpoint)
from model import (Block, Linear, Qwen3Config, RMSNorm, allocate_kv_caches, layer_kv_caches, rope_cos_sin,
                   rope_inv_freq, run_layer)


@dataclass
class DFlashConfig:
    model: Qwen3Config  # the drafter's own layers (hidden size equal to the target's)
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    windows: tuple = ()  # per layer: its sliding window (slots) or None (full attention); () = all full

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "DFlashConfig":
        """The drafter's config.json, checked (loading.dflash_config_fields)."""
        fields = dflash_config_fields(d, where)
        return cls(model=Qwen3Config(**fields.pop("model")), **fields)

    @property
    def sliding_window(self) -> int | None:
        return next((w for w in self.windows if w is not None), None)


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        c = config.model
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        for i, layer in enumerate(self.layers):  # which of draft()'s masks each layer takes
            layer.window = config.windows[i] if config.windows else None
        self.fc = Linear(len(config.target_layer_ids) * c.hidden_size, c.hidden_size)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(c.head_dim, c.rope_theta, None), persistent=False)
        self.target_parts = None  # (embed_tokens, lm_head) of the bound target: used, not owned (no state_dict)
        self.path: str | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

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
        return layer_kv_caches(self.layers)

    def append_context(self, features, positions, cache_pos):
        """Write the context K/V of committed tokens: features [N, W, len(ids) * hidden] (the target's chosen-layer
        outputs), at RoPE positions and cache slots [N, W] (request n in cache row n). No attention: context rows
        are keys, never queries."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = (t[:, None] for t in rope_cos_sin(positions, self.inv_freq, ctx.dtype))
        for layer in self.layers:
            layer.self_attn.write_kv(ctx, cos, sin, cache_pos)

    def forward(self, block_tokens, positions, cache_pos, block_mask, rows: slice = slice(None), window_mask=None):
        """One denoising pass over blocks [N, block_size] -> float32 logits [N, block_size, vocab] of the block's
        `rows` (row k predicts the token at position start + k; row 0 is the bonus's own row and is not a
        prediction). Sliding-window layers attend under `window_mask`, the rest under `block_mask`."""
        embed, lm_head = self.target_parts
        x = embed(block_tokens)
        cos, sin = (t[:, None] for t in rope_cos_sin(positions, self.inv_freq, x.dtype))
        for layer in self.layers:
            x = run_layer(layer, x, cos, sin, cache_pos, window_mask if layer.window else block_mask)
        return lm_head(self.norm(x[:, rows])).float()

    def draft(self, bonus, start, block_mask, denoise_steps: int = 1, length: int | None = None, window_mask=None):
        """Per-position draft logits [N, length, vocab] for the first `length` (default and at most
        block_size - 1) positions after each request's bonus [N] at start [N]. A shorter length changes no logit:
        every row of the block still runs through every layer (the rows see each other), and only the unused
        rows' final norm and lm_head are skipped; a tree of B nodes is at most B deep, so ddtree needs only
        min(B, block_size - 1) of them.

        `block_mask` must let request n's block see slots [0, start[n] + block_size) (tree_attn.PrefixMask with
        all-ones allow); `window_mask`, for a drafter with sliding-window layers, the same with the drafter's
        window (PrefixMask(window=config.sliding_window)). With denoise_steps T > 1, each pass unmasks the most confident still-masked positions
        (their argmax) and the next pass conditions on them; each position keeps the logits of the pass that
        decided it (the last pass for those still masked), so the draft is the same per-position form as with
        T = 1.
        """
        bs, n = self.block_size, bonus.shape[0]
        length = length or bs - 1
        pos = start[:, None] + torch.arange(bs, device=bonus.device)
        masks = torch.full((n, bs - 1), self.config.mask_token_id, dtype=torch.long, device=bonus.device)
        tokens = torch.cat([bonus[:, None], masks], dim=1)
        if denoise_steps == 1:
            return self(tokens, pos, pos, block_mask, rows=slice(1, 1 + length), window_mask=window_mask)
        logits = self(tokens, pos, pos, block_mask, window_mask=window_mask)[:, 1:]
        masked = torch.ones(n, bs - 1, dtype=torch.bool, device=bonus.device)

        def decided_after(passes):  # an equal share of the block is decided by each pass
            return -(-(bs - 1) * passes // denoise_steps)

        for step in range(1, denoise_steps):
            count = decided_after(step) - decided_after(step - 1)
            confidence = logits.log_softmax(-1).amax(-1).masked_fill(~masked, -float("inf"))
            chosen = torch.zeros_like(masked).scatter(1, confidence.topk(count, dim=-1).indices, True) & masked
            tokens = torch.cat([tokens[:, :1], torch.where(chosen, logits.argmax(-1), tokens[:, 1:])], dim=1)
            masked = masked & ~chosen
            new = self(tokens, pos, pos, block_mask, window_mask=window_mask)[:, 1:]
            logits = torch.where(masked[..., None], new, logits)
        return logits[:, :length]

    @classmethod
    def from_pretrained(cls, path_or_repo: str, device=None, dtype=None) -> "DFlashDrafter":
        path = resolve_checkpoint(path_or_repo, "drafter")
        where = os.path.join(path, "config.json")
        config = DFlashConfig.from_dict(read_json(where), where)
        device = parse_device(device)
        dtype = parse_dtype(dtype, device)
        with torch.device("meta"):
            drafter = cls(config)
        load_weights(drafter, path, strip_prefix="", device=device, dtype=dtype)
        drafter.inv_freq = rope_inv_freq(config.model.head_dim, config.model.rope_theta, device)
        drafter.path = path
        return drafter.eval()
