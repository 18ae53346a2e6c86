"""RoPE's frequencies for every rope type a Qwen3 config may name (plain, linear, YaRN, Llama 3, proportional),
computed once at load as transformers 5.24 computes them, and the longest context the scaling allows. Load-time
arithmetic: the round only reads the frequencies (model.rope_cos_sin)."""

import math

import torch


def rope_inv_freq(dim: int, theta: float, device) -> torch.Tensor:
    """Plain RoPE's inverse frequencies (float32) for `dim` rotated dimensions."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def rope_frequencies(config, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotated dims / 2] in float32, attention factor) for a model.Qwen3Config's RoPE, as transformers
    5.24 computes them once at load (modeling_rope_utils.ROPE_INIT_FUNCTIONS: the same float32 operations in the
    same order, so the same bits); the attention factor scales cos and sin (model.rope_cos_sin). The rotated dims
    are the first config.rotary_dim, or every dim for proportional (a zero frequency leaves its pair as it is)."""
    r, theta, dim = config.rope_scaling, config.rope_theta, config.rotary_dim
    kind = r["rope_type"]
    if kind == "proportional":
        return proportional_inv_freq(config.head_dim, theta, config.partial_rotary_factor, r.get("factor", 1.0),
                                     device), 1.0
    if kind == "yarn":
        factor = yarn_factor(r, config.max_position_embeddings)
        return yarn_inv_freq(dim, theta, factor, r, device), yarn_attention_factor(factor, r)
    inv_freq = rope_inv_freq(dim, theta, device)
    if kind == "linear":  # positions / factor, folded into the frequencies
        return inv_freq / r["factor"], 1.0
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, r), 1.0
    return inv_freq, 1.0


def position_limit(config) -> tuple[int, str]:
    """The most positions (prompt + new tokens) a request may reach, and where that number comes from.
    transformers never changes max_position_embeddings for RoPE scaling, and Qwen's long-context instructions add
    a yarn block (factor 4, original 32768) beside max_position_embeddings 40960 without raising it; the scaled
    window is what the scaling is for, so the limit is the larger of max_position_embeddings and factor times the
    length the scaling stretches (as vLLM derives it): original_max_position_embeddings for yarn and llama3,
    max_position_embeddings for linear (which divides every position by factor). proportional and plain RoPE
    keep max_position_embeddings."""
    r, stated = config.rope_scaling, config.max_position_embeddings
    kind = r["rope_type"]
    if kind in ("yarn", "llama3"):
        factor = yarn_factor(r, stated) if kind == "yarn" else r["factor"]
        scaled = int(factor * r["original_max_position_embeddings"])
        where = f"{kind} factor {factor:g} x original_max_position_embeddings {r['original_max_position_embeddings']}"
    elif kind == "linear":
        scaled, where = int(r["factor"] * stated), f"linear factor {r['factor']:g} x max_position_embeddings {stated}"
    else:
        scaled = 0
    if scaled > stated:
        return scaled, f"the target's RoPE scaling: {where}"
    return stated, "the target's max_position_embeddings"


def yarn_factor(r: dict, max_positions: int) -> float:
    """YaRN's factor; a null one is the ratio of max_position_embeddings to the original length (DeepSeek-V3's)."""
    return r["factor"] if r["factor"] is not None else max_positions / r["original_max_position_embeddings"]


def yarn_inv_freq(dim: int, theta: float, factor: float, r: dict, device) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as transformers' _compute_yarn_parameters: frequencies that turn fewer than
    beta_slow times over the original length are divided by factor (interpolated), those turning more than
    beta_fast times are kept (extrapolated), with a linear ramp over the dimensions between."""
    beta_fast, beta_slow = r.get("beta_fast") or 32, r.get("beta_slow") or 1
    original = r["original_max_position_embeddings"]
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low, high = yarn_correction_range(beta_fast, beta_slow, dim, theta, original, r.get("truncate", True))
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp.to(device=device, dtype=torch.float)
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_correction_range(beta_fast, beta_slow, dim: int, theta: float, original: int, truncate) -> tuple:
    """The dimensions (as pair indices, clamped to [0, dim - 1]) where a frequency turns beta_fast and beta_slow
    times over the original length; floored and ceiled unless truncate is false (a null reads as false, as in
    transformers)."""
    def dim_of(turns):
        return (dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_attention_factor(factor: float, r: dict) -> float:
    """YaRN's scale of cos and sin: attention_factor when given, else 0.1 ln(factor) + 1 (with mscale and
    mscale_all_dim both set, the ratio of the two such terms, DeepSeek's)."""
    if r.get("attention_factor") is not None:
        return r["attention_factor"]

    def mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if r.get("mscale") and r.get("mscale_all_dim"):
        return float(mscale(factor, r["mscale"]) / mscale(factor, r["mscale_all_dim"]))
    return mscale(factor)


def llama3_inv_freq(inv_freq: torch.Tensor, r: dict) -> torch.Tensor:
    """Llama 3.1's scaling, as transformers' _compute_llama3_parameters: wavelengths shorter than original /
    high_freq_factor kept, longer than original / low_freq_factor divided by factor, smoothed between."""
    factor, low, high = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
    original = r["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def proportional_inv_freq(head_dim: int, theta: float, partial: float, factor: float, device) -> torch.Tensor:
    """Proportional RoPE (transformers' _compute_proportional_rope_parameters): head_dim / 2 pairs, the first
    int(partial * head_dim // 2) turning at exponents over the whole head_dim, the rest at frequency 0; all divided
    by factor."""
    angles = int(partial * head_dim // 2)
    turning = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(device=device,
                                                                                      dtype=torch.float) / head_dim))
    still = torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device=device)
    return torch.cat((turning, still)) / factor
