"""RoPE scaling beyond plain RoPE (linear, YaRN, Llama 3, proportional), applied through families.py when config.json
names one: its parameters read and checked as transformers 5.24 settles them, its frequencies and attention factor
computed once at load as transformers computes them, and the longest context the scaling allows. Load-time
arithmetic: the round only reads the frequencies (model.rope_cos_sin). Plain RoPE is the core's (model.py,
loading.plain_rope).
"""

import math

import torch

from loading import DEFAULT_ROPE_THETA, positive


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


# What transformers 5.24 does with each RoPE type (modeling_rope_utils.ROPE_INIT_FUNCTIONS): the keys its function
# reads besides rope_theta and partial_rotary_factor, those it cannot do without, or why the type is refused here.
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "proportional": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
}
ROPE_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                 "yarn": ("factor",)}
ROPE_REFUSED = {
    "dynamic": "transformers recomputes its frequencies from the longest position a forward has seen so far (and "
               "keeps them), so a key's rotation depends on how the calls were chunked: no fixed-shape engine "
               "gives its logits past max_position_embeddings (below it, it is plain RoPE: drop the block)",
    "longrope": "transformers switches all positions of a forward between short_factor and long_factor by that "
                "forward's longest position, so a key's rotation depends on how the calls were chunked",
}
# The rope types whose pretraining length transformers settles into the parameters (standardize_rope_params).
ROPE_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")
# Keys of a rope_parameters block that text positions never read (Qwen3.5's multimodal sections).
ROPE_TEXT_IRRELEVANT = ("mrope_section", "mrope_interleaved")


def rope_parameters(d: dict, where: str, partial_default: float | None, max_positions: int) -> tuple[dict, str]:
    """The RoPE parameters as transformers 5.24 settles them (PreTrainedConfig.convert_rope_params_to_dict, then
    standardize_rope_params): a non-empty rope_scaling (v4) replaces rope_parameters (v5) whole; the top-level
    rope_theta (else transformers' default, 10000) and partial_rotary_factor (else the family's default,
    `partial_default`) fill what the block lacks; rope_type wins over its old name, type; llama3 and yarn take a
    top-level original_max_position_embeddings over the block's, else max_position_embeddings. Where the
    replacement would drop a value rope_parameters states (its rope_theta, say), the file is refused rather than
    run with transformers' silent substitute. Returns the parameters and the name of the block they came from."""
    given, scaling = d.get("rope_parameters"), d.get("rope_scaling")
    for name, block in (("rope_parameters", given), ("rope_scaling", scaling)):
        if block is not None and not isinstance(block, dict):
            raise ValueError(f"{where}: {name} must be a JSON object or null, got {block!r}")
    source = "rope_scaling" if scaling else "rope_parameters"
    params = dict(scaling or given or {})
    params.setdefault("rope_theta", d.get("rope_theta", DEFAULT_ROPE_THETA))
    partial = d.get("partial_rotary_factor", partial_default)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    params.setdefault("rope_type", params.get("type", "default"))
    if scaling and given:
        check_nothing_dropped(given, params, where)
    kind = params["rope_type"]
    if not isinstance(kind, str):
        raise ValueError(f"{where}: {source}.rope_type must be a string, got {kind!r}")
    if kind in ROPE_REFUSED:
        raise ValueError(f"{where}: rope scaling type {kind!r} (in {source}) is not supported: {ROPE_REFUSED[kind]}")
    if kind not in ROPE_KEYS:
        raise ValueError(f"{where}: rope scaling type {kind!r} (in {source}) is not one transformers 5.24 knows "
                         f"(implemented here: {', '.join(ROPE_KEYS)})")
    if kind in ROPE_WITH_ORIGINAL_LENGTH:
        original = "original_max_position_embeddings"
        params[original] = d[original] if original in d else params.get(original, max_positions)
    return params, source


def check_nothing_dropped(given: dict, params: dict, where: str):
    """rope_scaling replaces rope_parameters in transformers: refuse a file whose rope_parameters says something
    (other than plain RoPE, which the scaling block is there to change) that the settled parameters do not."""
    given_type = given.get("rope_type", given.get("type", "default"))
    lost = [k for k, v in given.items() if k not in ("rope_type", "type") + ROPE_TEXT_IRRELEVANT
            and params.get(k) != v]
    if given_type not in ("default", params["rope_type"]):
        lost.insert(0, "rope_type")
    if lost:
        raise ValueError(f"{where}: rope_scaling replaces rope_parameters (as transformers 5.24 reads the file), "
                         f"so rope_parameters' {', '.join(f'{k}={given.get(k, given_type)!r}' for k in lost)} would "
                         f"be ignored; give {'it' if len(lost) == 1 else 'them'} in rope_scaling (or drop one block)")


def rope_fields(d: dict, where: str, partial_default: float | None, max_positions: int) -> dict:
    """What loading.dense_fields reads of a config's RoPE when it names a scaling (its rope_reader): the settled
    parameters (rope_parameters) with "scaling", Qwen3Config.rope_scaling (rope_scaling_fields)."""
    params, source = rope_parameters(d, where, partial_default, max_positions)
    return dict(params, scaling=rope_scaling_fields(params, source, where))


def rope_scaling_fields(params: dict, source: str, where: str) -> dict:
    """Qwen3Config.rope_scaling: the rope type and the keys its transformers function reads, each checked (a
    missing required key is transformers' KeyError; absent optional keys take its defaults in model.py)."""
    kind, where = params["rope_type"], f"{where} ({source})"
    missing = [k for k in ROPE_REQUIRED.get(kind, ()) if k not in params]
    if missing:
        raise ValueError(f"{where}: rope scaling type {kind!r} needs {', '.join(missing)}")
    fields = {"rope_type": kind}
    for key in (k for k in ROPE_KEYS[kind] if k in params):
        value = fields[key] = params[key]
        if value is None and kind == "yarn" and key != "original_max_position_embeddings":
            continue  # yarn reads a null as absent (a null factor: max_position_embeddings / the original)
        if key == "truncate":
            if not isinstance(value, bool):
                raise ValueError(f"{where}: truncate must be true or false, got {value!r}")
        elif key == "original_max_position_embeddings":
            positive(where, params, key)
        elif key in ("beta_fast", "beta_slow"):  # turns over the original length, whose log yarn takes
            if finite(where, params, key) < 0:
                raise ValueError(f"{where}: {key} must be a positive number (0 or null: the default), got {value!r}")
        elif key in ("mscale", "mscale_all_dim"):
            finite(where, params, key)
        else:  # factor, attention_factor, low_freq_factor, high_freq_factor
            positive(where, params, key, float)
    return fields


def finite(where: str, d: dict, key: str) -> float:
    """d[key] checked to be a finite number."""
    value = d[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be a finite number, got {value!r}")
    return value


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
