"""Every layer call of a compiled step as one nested compiled region, traced once per distinct layer and reused by
every layer like it, so that a deep model compiles in the time of one layer (docs/compile.md)."""

import torch

from tree_attn import prefix_block_mask

# Read while tracing; False inlines every layer, as a frozen graph needs (its weights become graph constants).
COMPILE_LAYERS_ONCE = True


@torch.compiler.nested_compile_region
def _layer_once(layer, x, cos, sin, cache_pos, kv_num_blocks, kv_indices, full_num, full_idx, prefix, allow, window,
                context):
    mask = prefix_block_mask(kv_num_blocks, kv_indices, full_num, full_idx, prefix, allow,
                             layer.self_attn.k_cache.shape[2], window or None, context or None)
    return layer(x, cos, sin, cache_pos, mask)


def run_layer(layer, x, cos, sin, cache_pos, mask):
    """layer(x, ...) through the layers' one compiled region; a BlockMask not from a PrefixMask (a test's) has no
    tensors to rebuild it from, so its layer is called directly."""
    if not COMPILE_LAYERS_ONCE or not hasattr(mask, "prefix_tensors"):
        return layer(x, cos, sin, cache_pos, mask)
    # Dynamo reuses a region only for tensor, number and module arguments: the BlockMask goes in as its tensors.
    return _layer_once(layer, x, cos, sin, cache_pos, *mask.prefix_tensors, mask.window or 0, mask.context or 0)
