"""Writing checkpoints in the real formats: a byte-level BPE tokenizer, Qwen3 (Hugging Face layout) and DFlash
(z-lab layout) files. Used by the training script, the benchmarks and the tests' fixtures; its command line writes
a small random pair with a tokenizer, to exercise the code paths offline (random weights accept nothing):

    python scripts/checkpoints.py random-pair --out runs/random-pair [--vocab 1024] [--seed 0]
    python ddtree.py --target runs/random-pair/target --draft runs/random-pair/draft --prompt "def f(x):"
"""

import argparse
import glob
import json
import os
import sys
import sysconfig

import torch
from safetensors.torch import save_file

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

# A Qwen3-style template: user/assistant turns, generation prompt; thinking is off (no <think> tokens here).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def stdlib_files(held_out_every: int = 0):
    """The Python standard library's own .py sources: a corpus every machine with Python has."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in f and "/test" not in f and "idlelib" not in f)
    if not held_out_every:
        return files, []
    return ([f for i, f in enumerate(files) if i % held_out_every],
            [f for i, f in enumerate(files) if i % held_out_every == 0])


def train_tokenizer(files, vocab_size: int, out_dir: str, chat_template: str = CHAT_TEMPLATE):
    """Byte-level BPE with the chat and mask tokens; writes tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "model_max_length": 4096}
    if chat_template:
        config["chat_template"] = chat_template
    write_json_file(os.path.join(out_dir, "tokenizer_config.json"), config)
    return tok


def qwen3_config(vocab_size, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=32, max_pos=4096,
                 tie=False, eos=(2, 0), v5=False) -> dict:
    c = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size,
         "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
         "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
         "rms_norm_eps": 1e-6, "max_position_embeddings": max_pos, "tie_word_embeddings": tie,
         "attention_bias": False, "use_sliding_window": False, "hidden_act": "silu",
         "bos_token_id": eos[1], "eos_token_id": list(eos)}
    if v5:
        c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, dtype="float32")
    else:
        c.update(rope_theta=1e6, rope_scaling=None, torch_dtype="float32")
    return c


def random_qwen3_weights(c: dict, seed: int = 0, std: float = 0.05) -> dict:
    """Random weights with Hugging Face's tensor names for a Qwen3 config dict."""
    g = torch.Generator().manual_seed(seed)
    H, I, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rand(c["vocab_size"], H), "model.norm.weight": 1 + rand(H)}
    for i in range(c["num_hidden_layers"]):
        w.update(layer_weights(f"model.layers.{i}.", H, I, nh, nkv, hd, rand))
        if is_sparse(c, i):  # the dense MLP gives way to a router and per-expert SwiGLUs (Hugging Face's names)
            for n in ("gate_proj", "up_proj", "down_proj"):
                del w[f"model.layers.{i}.mlp.{n}.weight"]
            E, J = c["num_experts"], c["moe_intermediate_size"]
            w[f"model.layers.{i}.mlp.gate.weight"] = rand(E, H)
            for e in range(E):
                for n, shape in (("gate_proj", (J, H)), ("up_proj", (J, H)), ("down_proj", (H, J))):
                    w[f"model.layers.{i}.mlp.experts.{e}.{n}.weight"] = rand(*shape)
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(c["vocab_size"], H)
    return w


def moe_config(c: dict, experts: int, top_k: int, inter: int, sparse_step: int = 1, mlp_only=(),
               norm_topk_prob: bool = True) -> dict:
    """A Qwen3-MoE config dict from a Qwen3 one (transformers 4.x layout: num_experts), as Qwen3-30B-A3B's."""
    return dict(c, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=experts,
                num_experts_per_tok=top_k, moe_intermediate_size=inter, decoder_sparse_step=sparse_step,
                mlp_only_layers=list(mlp_only), norm_topk_prob=norm_topk_prob)


def is_sparse(c: dict, layer: int) -> bool:
    return (c.get("num_experts", 0) > 0 and layer not in c.get("mlp_only_layers", [])
            and (layer + 1) % c.get("decoder_sparse_step", 1) == 0)


def layer_weights(prefix, H, I, nh, nkv, hd, rand) -> dict:
    names = {"self_attn.q_proj.weight": (nh * hd, H), "self_attn.k_proj.weight": (nkv * hd, H),
             "self_attn.v_proj.weight": (nkv * hd, H), "self_attn.o_proj.weight": (H, nh * hd),
             "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    w = {prefix + n: rand(*s) for n, s in names.items()}
    for n, d in (("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.q_norm", hd),
                 ("self_attn.k_norm", hd)):
        w[prefix + n + ".weight"] = 1 + rand(d)
    return w


def atomic_write(path: str, write):
    """write(temporary_path), then the temporary file renamed over `path`: a reader, or a run cut short, never meets
    half a file, and what was at `path` stays until the new file is whole."""
    atomic_write_all({path: write})


def atomic_write_all(writes: dict):
    """{path: write(temporary_path)}: every file written to its temporary first, and only when all are whole are
    they renamed into place, so a save that fails midway changes none of them."""
    temporaries = {path: f"{path}.tmp.{os.getpid()}" for path in writes}
    try:
        for path, write in writes.items():
            write(temporaries[path])
        for path, temporary in temporaries.items():
            os.replace(temporary, path)
    finally:
        for temporary in temporaries.values():
            if os.path.exists(temporary):
                os.remove(temporary)


def json_writer(obj, indent=2):
    def write(path):
        with open(path, "w") as f:
            json.dump(obj, f, indent=indent)
    return write


def write_json_file(path: str, obj, indent=2):
    atomic_write(path, json_writer(obj, indent))


def save_checkpoint(out_dir: str, config: dict, weights: dict, eos_ids=None):
    """config.json + model.safetensors (+ generation_config.json with the stop ids), all replaced together."""
    os.makedirs(out_dir, exist_ok=True)
    writes = {os.path.join(out_dir, "config.json"): json_writer(config),
              os.path.join(out_dir, "model.safetensors"):
                  lambda p: save_file({k: v.contiguous() for k, v in weights.items()}, p, metadata={"format": "pt"})}
    if eos_ids is not None:
        writes[os.path.join(out_dir, "generation_config.json")] = json_writer(
            {"eos_token_id": list(eos_ids), "do_sample": False})
    atomic_write_all(writes)


DFLASH2 = dict(conv_kernel_size=4, conv_group_size=16, selector_rank=16, selector_top_k=8)  # a tiny DFlash 2


def dflash_config(target: dict, layers=1, block_size=8, mask_token_id=None, target_layer_ids=None, inter=None,
                  dflash2: dict | None = None) -> dict:
    """A DFlash drafter config for `target` (a Qwen3 config dict) in z-lab's layout; with `dflash2` (its
    dflash_config fields, e.g. DFLASH2), a DFlash 2 drafter's."""
    c = {k: target[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta")
         if k in target}
    c.update(architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=layers,
             intermediate_size=inter or target["intermediate_size"], tie_word_embeddings=False,
             block_size=block_size, num_target_layers=target["num_hidden_layers"],
             dflash_config={"mask_token_id": target["vocab_size"] - 1 if mask_token_id is None else mask_token_id})
    if "rope_theta" not in c:
        c["rope_theta"] = (target.get("rope_parameters") or {}).get("rope_theta", 1e6)
    if target_layer_ids is not None:
        c["dflash_config"]["target_layer_ids"] = list(target_layer_ids)
    return as_dflash2(c, dflash2) if dflash2 else c


def as_dflash2(config: dict, fields: dict) -> dict:
    """A DFlash 1 drafter config made DFlash 2's: its architecture, and `fields` (conv_kernel_size,
    conv_group_size, selector_rank, selector_top_k) in its dflash_config."""
    return dict(config, architectures=["DFlash2DraftModel"], dflash_config={**config["dflash_config"], **fields})


def random_dflash_weights(c: dict, seed: int = 1, std: float = 0.05) -> dict:
    """Random weights with z-lab's tensor names: layers.{i}.*, fc.weight, hidden_norm.weight, norm.weight."""
    g = torch.Generator().manual_seed(seed)
    H = c["hidden_size"]
    n_ids = len(c["dflash_config"].get("target_layer_ids") or []) or c["num_hidden_layers"]

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    w = {"fc.weight": rand(H, n_ids * H), "hidden_norm.weight": 1 + rand(H), "norm.weight": 1 + rand(H)}
    for i in range(c["num_hidden_layers"]):
        w.update(layer_weights(f"layers.{i}.", H, c["intermediate_size"], c["num_attention_heads"],
                               c["num_key_value_heads"], c["head_dim"], rand))
    two = c["dflash_config"]
    if "selector_top_k" in two:  # DFlash 2: two convolutions per layer, the selector (codebooks without .weight)
        K, groups, r = two["conv_kernel_size"], H // two["conv_group_size"], two["selector_rank"]
        for i in range(c["num_hidden_layers"]):
            for conv in ("attention_conv", "mlp_conv"):
                w[f"layers.{i}.{conv}.base_kernel"] = rand(2, K, H) * 4  # about a trained drafter's scale
                w[f"layers.{i}.{conv}.kernel_projection.weight"] = rand(2 * K * groups, H)
        V = c["vocab_size"]
        w.update({"candidate_selector.predecessor_codebook": rand(V, r) * 10,
                  "candidate_selector.successor_codebook": rand(V, r) * 10,
                  "candidate_selector.hidden_projection.weight": rand(r, H)})
    return w


def zlab_config(target_config: dict, layers: int, block_size: int, mask_token_id: int, target_layer_ids,
                intermediate_size: int | None = None) -> dict:
    """config.json of a drafter for a Qwen3 target (its config.json as a dict), in z-lab's layout."""
    c = {k: target_config[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                       "head_dim", "rms_norm_eps", "max_position_embeddings") if k in target_config}
    theta = target_config.get("rope_theta", (target_config.get("rope_parameters") or {}).get("rope_theta", 1e6))
    c.update(architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=layers,
             intermediate_size=intermediate_size or target_config["intermediate_size"], rope_theta=theta,
             tie_word_embeddings=False, attention_bias=False, block_size=block_size,
             num_target_layers=target_config["num_hidden_layers"],
             dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)})
    return c


def checkpoint_tensors(model: torch.nn.Module) -> dict:
    """The module's state under the checkpoint's names, each stacked weight cut back into its projections."""
    from loading import stacked_parts
    parts = stacked_parts(model)
    state = dict(model.state_dict())
    out = {name: state.pop(name) for name in list(state) if name not in {p for p, _, _ in parts.values()}}
    for part, (name, start, stop) in parts.items():
        out[part] = state[name][start:stop]
    return out


def zlab_weights(drafter: torch.nn.Module, dtype=torch.float32) -> dict:
    """A drafter.DFlashDrafter's tensors under z-lab's names (layers.{i}.*, fc.weight, hidden_norm.weight,
    norm.weight)."""
    return {k: v.detach().to(dtype).contiguous().clone() for k, v in checkpoint_tensors(drafter).items()}


# ----------------------------------------------------------------------------------------------------------------
# Resumable training state: the trainable module's parameters and the optimizer's moments in one safetensors file,
# and the step, log and arguments in a small json (no pickle anywhere).


def add_training_options(p, lr: float, weight_decay: float, bf16_help: str | None = None):
    """The optimizer, precision, bookkeeping and machine options both training commands take (scripts/train.py)."""
    import argparse
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=weight_decay)
    # bf16 autocast pays only where oneDNN has bf16 kernels (AVX-512 and newer); on an AVX2-only CPU the same
    # drafter step took 26 s in bf16 against 1.2-1.4 s in fp32 (torch 2.13, 2 threads), so the default follows the CPU
    fast_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=fast_bf16,
                   help=f"{bf16_help or 'bf16 autocast'} (default: {'on' if fast_bf16 else 'off'} on this CPU: on "
                        f"where oneDNN has bf16 kernels)")
    p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--files", type=int, default=0, help="use only the first N training files (tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)


def save_train_state(run_dir: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer, info: dict):
    """Write state.safetensors + state.json atomically (a crash mid-write leaves the previous state)."""
    os.makedirs(run_dir, exist_ok=True)
    tensors = {}
    for name, p in module.named_parameters():
        tensors["param." + name] = p.detach().contiguous().clone()
        for key, value in optimizer.state.get(p, {}).items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"opt.{name}.{key}"] = value.detach().contiguous().clone()
    tmp = os.path.join(run_dir, "state.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(run_dir, "state.safetensors"))
    tmp = os.path.join(run_dir, "state.json.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, os.path.join(run_dir, "state.json"))


def load_train_state(run_dir: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """Restore what save_train_state wrote into `module` and `optimizer`; returns the json info, or None when the
    directory holds no state yet."""
    from safetensors.torch import load_file
    json_file, tensor_file = os.path.join(run_dir, "state.json"), os.path.join(run_dir, "state.safetensors")
    if not (os.path.isfile(json_file) and os.path.isfile(tensor_file)):
        return None
    tensors = load_file(tensor_file)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(tensors["param." + name])
            moments = {k[len(f"opt.{name}."):]: v for k, v in tensors.items() if k.startswith(f"opt.{name}.")}
            if moments:
                optimizer.state[p] = {k: (v.to(p.device) if k != "step" else v) for k, v in moments.items()}
    with open(json_file) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------------------------
# Qwen3.5 / Qwen3.6 hybrid targets (transformers' qwen3_5 and qwen3_5_moe), written by transformers itself


def hybrid_text_config(moe: bool = False, **overrides) -> dict:
    """A tiny Qwen3.5 text config (kwargs of transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig): 4 layers
    (3 Gated DeltaNet, 1 gated attention with the default full_attention_interval 4), hidden 64, head_dim 32,
    linear heads Hk = 2, Hv = 4 of 16 dims, kernel 4, a non-default rope_theta; MoE: 6 experts of 24, top 2, a
    shared expert of 40."""
    c = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
             tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.25})
    if moe:
        c.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
    else:
        c.update(intermediate_size=96)
    c.update(overrides)
    return c


def random_hybrid_model(text: dict, moe: bool = False, seed: int = 0, std: float = 0.1):
    """transformers' Qwen3_5ForCausalLM (or Qwen3_5MoeForCausalLM) for `text`, every parameter moved off its
    initial value by N(0, std) noise (norm weights, A_log, dt_bias included: nothing sits at a convenient
    default), in eval mode, float32, SDPA attention, the eager expert loop."""
    import transformers
    torch.manual_seed(seed)
    if moe:
        hf = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    else:
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    with torch.no_grad():
        for p in hf.parameters():  # tied embeddings are one parameter: perturbed once
            p.add_(torch.randn_like(p) * std)
    hf.config._attn_implementation = "sdpa"
    hf.config._experts_implementation = "eager"  # the per-expert loop: exact in any dtype (grouped_mm has no float64)
    return hf.eval()


def tiny_vision_config(out_hidden: int) -> dict:
    return dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=out_hidden, patch_size=4,
                spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


def save_hybrid(hf, out_dir: str, layout: str = "causal_lm", max_shard_size: str = "5GB", mtp: bool = False):
    """Write a hybrid model as a Hub checkpoint, with transformers' save_pretrained:
    - layout "causal_lm": Qwen3_5ForCausalLM's own (text config at the top level, weights under model.*);
    - layout "conditional_generation": the Hub's Qwen3_5ForConditionalGeneration (Qwen3_5MoeFor... for MoE) with a
      tiny random vision tower (model.visual.*), the text config nested in text_config, the text weights under
      model.language_model.*, lm_head.weight top level (absent when tied).
    mtp=True adds multi-token-prediction tensors (mtp.*) as the released checkpoints carry (random; rewritten into
    the last shard)."""
    import transformers
    from safetensors.torch import load_file
    moe = type(hf).__name__.startswith("Qwen3_5Moe")
    if layout == "causal_lm":
        hf.save_pretrained(out_dir, max_shard_size=max_shard_size)
    elif layout == "conditional_generation":
        text = hf.config.to_dict()
        tie = text["tie_word_embeddings"]
        classes = (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration) if moe else \
            (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration)
        config = classes[0](text_config=text, vision_config=tiny_vision_config(text["hidden_size"]),
                            tie_word_embeddings=tie)
        full = classes[1](config).eval()
        missing, unexpected = full.model.language_model.load_state_dict(hf.model.state_dict(), strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        if not tie:
            full.lm_head.weight.data.copy_(hf.lm_head.weight.data)
        full.save_pretrained(out_dir, max_shard_size=max_shard_size)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    if mtp:
        files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
        file = os.path.join(out_dir, files[-1])
        w = dict(load_file(file))
        H = hf.config.hidden_size
        g = torch.Generator().manual_seed(7)
        w.update({"mtp.fc.weight": torch.randn(H, 2 * H, generator=g), "mtp.norm.weight": torch.randn(H, generator=g),
                  "mtp.layers.0.input_layernorm.weight": torch.randn(H, generator=g)})
        save_file(w, file, metadata={"format": "pt"})
        index = os.path.join(out_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                idx = json.load(f)
            idx["weight_map"].update({k: files[-1] for k in w if k.startswith("mtp.")})
            write_json_file(index, idx)


# ----------------------------------------------------------------------------------------------------------------
# The command line: a random pair with a tokenizer


def write_random_pair(out: str, vocab: int = 1024, seed: int = 0) -> tuple[str, str]:
    """A random Qwen3 target (hidden 128, 4 layers, tokenizer trained on the standard library's first 200 files)
    under out/target and a one-layer DFlash drafter for it (block 8, reading target layers 1 and 2) under
    out/draft; returns the two paths."""
    target_dir, draft_dir = os.path.join(out, "target"), os.path.join(out, "draft")
    files, _ = stdlib_files()
    tok = train_tokenizer(files[:200], vocab, target_dir)
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    config = qwen3_config(tok.get_vocab_size(), hidden=128, inter=256, layers=4, heads=4, kv_heads=2, head_dim=32,
                          eos=eos)
    save_checkpoint(target_dir, config, random_qwen3_weights(config, seed=seed), eos_ids=eos)
    draft = dflash_config(config, layers=1, block_size=8, mask_token_id=tok.token_to_id("<|mask|>"),
                          target_layer_ids=[1, 2])
    save_checkpoint(draft_dir, draft, random_dflash_weights(draft, seed=seed + 1))
    return target_dir, draft_dir


def at_least_one(text: str) -> int:
    """argparse's type for --vocab: a whole number of at least 1 (the tokenizer adds its byte alphabet anyway)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    from cli import one_line_errors
    raw = argparse.RawDescriptionHelpFormatter
    p = one_line_errors(argparse.ArgumentParser(description=__doc__, formatter_class=raw))
    commands = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    pair = one_line_errors(commands.add_parser("random-pair", help="a random target and drafter, with a tokenizer",
                                               description=write_random_pair.__doc__))
    pair.add_argument("--out", default="runs/random-pair")
    pair.add_argument("--vocab", type=at_least_one, default=1024)
    pair.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    """Runs the command; 2 with one `error:` line for bad options."""
    try:
        a = parser().parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target_dir, draft_dir = write_random_pair(a.out, a.vocab, a.seed)
    with open(os.path.join(target_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    print(f"wrote {target_dir} and {draft_dir} (vocab {vocab})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # cli.py, beside ddtree.py
    sys.exit(main())
