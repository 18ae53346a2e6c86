"""Attention masks as FlexAttention BlockMasks, and KV compaction.

Every attention call (prefill, decode, tree verify, the drafter's block) has `q_len` new rows written at cache
slots [prefix, prefix + q_len); row i sees every slot below `prefix` and the new slots prefix + j that allow[i, j]
marks (causal, ancestor-or-self, or all ones: docs/round.md, "One mask for every attention"). So one mask_mod serves
all, reading `prefix`, `allow` and block tables that are rewritten in place, so that new trees and prefixes never
recompile (docs/compile.md, "Masks updated in place"). The tables are built by hand (`from_kv_blocks`):
`create_block_mask` fails to compile on CPU for this mask_mod (docs/compile.md, "create_block_mask on CPU").
"""

import torch
from torch.nn.attention.flex_attention import BlockMask, FlexKernelOptions

BLOCK = 128  # FlexAttention's tile; cache lengths are rounded up to a multiple of it


def round_up(n: int, multiple: int = BLOCK) -> int:
    return (n + multiple - 1) // multiple * multiple


def flex_kernel_options(q_len: int, device_type: str) -> dict | None:
    """FlexAttention's kernel options for a call of q_len query rows, or None for its defaults: on CUDA, every call
    of 2 to BLOCK - 1 rows takes the main Triton kernel, as the decoding kernel inductor would pick is right under
    our masks for one row only (docs/compile.md, "FlexAttention's kernel per query length")."""
    if device_type != "cuda" or q_len == 1 or q_len >= BLOCK:
        return None
    return {"BACKEND": "TRITON"} if "BACKEND" in FlexKernelOptions.__annotations__ else {
        "FORCE_USE_FLEX_ATTENTION": True}


def prefix_block_mask(kv_num_blocks, kv_indices, full_num, full_idx, prefix, allow, kv_len: int,
                      window: int | None = None, context: int | None = None) -> BlockMask:
    """PrefixMask's BlockMask from its tensors: row q of request b sees the slots before prefix[b] and, among the
    rows written from prefix[b] on, those that allow[b, q] marks; with a `window`, only the slots within
    window - 1 of its own slot prefix[b] + q (a sliding-window layer); with a `context`, of the slots before
    prefix[b] only the last `context` (the drafter's context window; every row alike). Also what a compiled layer
    rebuilds its mask with (regions.run_layer), so that the mask reaches it as tensors."""
    q_len = allow.shape[-1]
    last = q_len - 1

    def mask_mod(b, h, q, kv):
        rel = kv - prefix[b]
        new = (rel >= 0) & (rel <= last)
        seen = (kv < prefix[b]) | (new & (allow[b, q.clamp(0, last), rel.clamp(0, last)] != 0))
        if context is not None:
            seen = seen & (rel >= -context)
        if window is None:
            return seen
        return seen & (rel - q > -window) & (rel - q < window)

    block_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                          mask_mod=mask_mod, seq_lengths=(q_len, kv_len), compute_q_blocks=False)
    block_mask.prefix_tensors = (kv_num_blocks, kv_indices, full_num, full_idx, prefix, allow)
    block_mask.window, block_mask.context = window, context
    return block_mask


class PrefixMask:
    """The mask for `q_len` rows written at slots [prefix, prefix + q_len) of a `kv_len`-slot cache, for `batch`
    requests at once: request n has its own prefix[n] and allow[n] (one cache row each). `set` returns the
    BlockMask the attention layers take. The rows see each other all (a decode step, the drafter's block, a tree
    until `set` gives its allow) or, `causal`, each only the rows up to itself (a prefill chunk, a causal drafter
    layer). With a `window` (a sliding-window layer), a row sees only the slots within window - 1 of its own; with a
    `context`, only the last `context` slots before the prefix (and its own rows)."""

    def __init__(self, q_len: int, kv_len: int, device, batch: int = 1, window: int | None = None,
                 causal: bool = False, context: int | None = None):
        assert kv_len % BLOCK == 0, "cache length must be a multiple of the FlexAttention block"
        self.q_len, self.kv_len, self.window, self.context = q_len, kv_len, window, context
        n_q, n_kv = -(-q_len // BLOCK), kv_len // BLOCK
        self.n_kv = n_kv
        self.prefix = torch.zeros(batch, dtype=torch.int64, device=device)
        # Bytes, not bool, nonzero = allowed, written with pointwise ops only (docs/compile.md, "Allow matrix as
        # bytes", "Writing the allow matrix").
        self.allow = torch.ones(batch, q_len, q_len, dtype=torch.uint8, device=device)
        if causal:
            self.allow.tril_()
        # The blocks wholly below the prefix are "full" (full_idx from block 0, full_num of them): the kernel skips
        # the mask_mod there. kv_indices lists the masked blocks from prefix // BLOCK on, kv_num_blocks of them.
        # The two index tensors must be distinct (docs/compile.md, "Full-block tensors").
        self.kv_num_blocks = torch.zeros(batch, 1, n_q, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(batch, 1, n_q, n_kv, dtype=torch.int32, device=device)
        self.full_num = torch.zeros(batch, 1, n_q, dtype=torch.int32, device=device)
        full_idx = torch.arange(n_kv, dtype=torch.int32, device=device).expand(batch, 1, n_q, n_kv).contiguous()
        self.blocks = torch.arange(n_kv, dtype=torch.int32, device=device)
        # Written in place by compiled steps: CUDA graphs capture those only for inputs known to stay put
        # (docs/compile.md, "mark_static_address for CUDA graphs").
        for t in (self.prefix, self.allow, self.kv_num_blocks, self.kv_indices, self.full_num):
            torch._dynamo.mark_static_address(t)
        self.block_mask = prefix_block_mask(self.kv_num_blocks, self.kv_indices, self.full_num, full_idx,
                                            self.prefix, self.allow, kv_len, window, context)
        self.mask_mod = self.block_mask.mask_mod

    def set(self, prefix, allow: torch.Tensor | None = None):
        """Point the mask at new prefix lengths (one per request [N], or an int for all) and, optionally, new allow
        matrices ([q_len, q_len] for every request, or [N, q_len, q_len]). Compiled code passes both per request
        ([N] and [N, q_len, q_len]): compiled CPU FlexAttention cannot lower a mask whose tensors the graph
        broadcasts (docs/compile.md, "The mask's prefix as a per-request tensor")."""
        self.prefix.copy_(torch.as_tensor(prefix, dtype=torch.int64))
        if allow is not None:
            # Inside a compiled graph the mask_mod reads `allow` itself, not the buffer: as_strided makes inductor
            # store it first (docs/compile.md, "as_strided before the mask reads it").
            self.allow.copy_(allow.as_strided(allow.shape, allow.stride()))
        # Visit only the KV blocks that can hold a visible slot: [0, prefix + q_len), per request; those below
        # the prefix as full blocks. With a window or a context, every block from the one of the lowest slot any
        # row sees (the first row's) goes through the mask_mod.
        end = ((self.prefix + self.q_len + BLOCK - 1) // BLOCK).clamp(max=self.n_kv).to(torch.int32)
        if self.window is None and self.context is None:
            full = first = (self.prefix // BLOCK).clamp(max=self.n_kv).to(torch.int32)
        else:
            low = torch.zeros_like(self.prefix)
            if self.window is not None:
                low = torch.maximum(low, self.prefix - self.window + 1)
            if self.context is not None:
                low = torch.maximum(low, self.prefix - self.context)
            first = (low // BLOCK).clamp(max=self.n_kv).to(torch.int32)
            full = first * 0
        self.full_num.copy_(full[:, None, None].expand_as(self.full_num))
        self.kv_num_blocks.copy_((end - first)[:, None, None].expand_as(self.kv_num_blocks))
        masked = (self.blocks + first[:, None]).clamp(max=self.n_kv - 1)
        self.kv_indices.copy_(masked[:, None, None].expand_as(self.kv_indices))
        return self.block_mask


def compact_kv(caches, prefix, rows: torch.Tensor):
    """Move the K/V of each request's accepted rows (slots prefix[n] + rows[n]) to contiguous slots prefix[n] + 0,
    1, ... of its cache row. prefix [N], rows [N, R] (or 0-d and [R] for one request); the padding of `rows` may
    be anything: it lands past the new prefix, where nothing reads before it is overwritten."""
    prefix = torch.as_tensor(prefix, device=rows.device).view(-1, 1)
    rows = rows.view(prefix.shape[0], -1)
    src = prefix + rows
    dst = prefix + torch.arange(rows.shape[1], device=rows.device)
    batch = torch.arange(rows.shape[0], device=rows.device)[:, None]
    for cache in caches:
        cache[batch, :, dst] = cache[batch, :, src]
