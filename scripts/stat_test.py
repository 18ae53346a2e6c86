"""Statistical correctness run (docs/stat_test.md, the correctness pyramid's level 3): sampled output follows the
target's law.

The exact joint law of the first n new tokens under the warped target (the autoregressive law: the product of
warped next-token distributions, in float64) is enumerated over its support: depth by depth, each prefix with mass
is extended by the tokens its warped law keeps, one batched target forward per depth. On a tiny vocabulary that is
all V^n sequences; on a real one, top-k / top-p / min-p keep it small (top-k 4, n = 3: at most 64 sequences,
whatever the vocabulary). N independent samples are the requests of generate_batch with seeds seed0 + i (each the
same sample as generate(seed=seed0 + i) alone); a chi-square test (cells with an expected count below 5 pooled;
any sample outside the support fails) and the total-variation distance compare them with the exact law. A
planted-bug control (a subtly wrong verifier or warping, monkeypatched into the engine) is run on the same seeds
and must be rejected, which shows the run has the power to see a real bug.

    python scripts/stat_test.py --method ddtree --budget 5 --temperature 0.9 --top-k 3 --top-p 0.95 --samples 4000
    python scripts/stat_test.py --method dflash --draft-sampling --temperature 0.8 --top-p 0.9 --samples 4000
    python scripts/stat_test.py --bundled --text "def f(x):" --method ddtree --top-k 4 --top-p 0.9 --samples 4000
    python scripts/stat_test.py --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --device cuda ...

Exit status 1 if the real run's p-value is below --alpha (1e-6) or the control's is not. With --temperature 0 the
check is instead that every sample equals the AR greedy sequence (no control). Options are checked before anything
runs, as the command line checks its own: one `error:` line and exit status 2.

Speed. Eager FlexAttention on a CPU costs a fixed price per call whatever the size (docs/stat_test.md), so the
layers of the engine's eager CPU runs attend with SDPA over the same mask_mod materialized instead
(cpu.EAGER_CPU_ATTENTION): that is `--attention dense`, the default, the engine as is. `--attention flex` makes
them run eager FlexAttention, the real kernel, and `--attention kernel` our CPU attention kernel (the one compiled
CPU engines run) on the same mask. tests/test_stat.py checks that all three give the engine the same tokens for
the same seeds.

Controls (`--control`; `auto` picks by method):
  residual_p    draft sampling: on rejection resample from p instead of the residual max(p - q, 0)
  own_row       tree walk: accept a node when the target's token at the node's own row (instead of its
                parent's row) equals the node's token
  unwarped      tree walk: the target's tokens in a speculative round are sampled from softmax(logits / T),
                without top-k / top-p / min-p (the prefill's first token stays right)
  shared_noise  every draw of a round uses the same uniform (correlated draws across rows)
  stale_commit  a hybrid target's recurrent layers commit the state after the round's root only, dropping the
                accepted drafts (attention layers keep them): speculation with --hybrid
  window_slots  a Gemma 4 target's sliding layers count their window in cache slots instead of positions along
                a node's path (a tree node past its depth sees too little): speculation with --gemma4
  none          no control
"""

import argparse
import contextlib
import itertools
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "scripts")):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ddtree  # noqa: E402
import cpu  # noqa: E402
import gemma4  # noqa: E402
from checkpoints import (dflash_config, hybrid_text_config, moe_config, qwen3_config,  # noqa: E402
                         random_dflash_weights, random_hybrid_model, random_qwen3_weights, save_checkpoint,
                         save_hybrid)
from ddtree import finite_rows, generate, generate_batch  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from hybrid import Qwen3_5  # noqa: E402
from model import Qwen3  # noqa: E402
from sampler import Sampling, sample, warp_probs  # noqa: E402
from tree_attn import PrefixMask  # noqa: E402
from cli import in_flags, one_line_errors  # noqa: E402
from loading import read_json  # noqa: E402
from cli import grouped  # noqa: E402
from settings import Speculation, check_int, check_settings, recurrent_target  # noqa: E402

ALPHA = 1e-6
DEFAULT_BUDGET = 5  # ddtree's tree nodes
CONTROLS = ("auto", "none", "residual_p", "own_row", "unwarped", "shared_noise", "stale_commit", "window_slots")
MAX_CELLS = 200_000


# ----------------------------------------------------------------------------------------------------------------
# A random pair in the real formats


def write_random_pair(out_dir: str, vocab: int, seed: int = 2, target_std: float = 0.4, draft_std: float = 0.4,
                      block_size: int = 3, hidden: int = 32, target_layers: int = 2, draft_layers: int = 1,
                      moe: bool = False, hybrid: bool = False, dflash2: bool = False, gemma: bool = False):
    """A tiny Qwen3 target and DFlash drafter. Weights of std 0.3-0.5 give a non-degenerate target (several tokens
    with real mass after warping; how peaked it is varies with the seed, and run_check warns when the law is
    nearly degenerate). The drafter shares the target's embedding and lm_head, so its drafts correlate with the
    target's choices: with seed 2 (vocab 4, block 3) 0.7-1.0 drafts are accepted per round. moe: a Qwen3-MoE
    target (4 experts, top 2, every layer sparse). hybrid: a Qwen3.5 target instead (write_random_hybrid_target),
    the drafter reading all of its layers, Gated DeltaNet and gated attention alike. dflash2: a DFlash 2 drafter
    (RANDOM_DFLASH2: its selector keeps vocab - 1 candidates, so its laws are zero off them). gemma: a Gemma 4
    target instead (write_random_gemma4_target), the drafter Gemma-style (the target's embeddings scaled by
    sqrt(hidden), its logits softcapped as the target's)."""
    two = dict(RANDOM_DFLASH2, selector_top_k=max(1, vocab - 1)) if dflash2 else None
    if gemma:
        if moe or hybrid or dflash2:
            raise ValueError("--gemma4 cannot be combined with --moe, --hybrid or --dflash2")
        tc = write_random_gemma4_target(os.path.join(out_dir, "target"), vocab, seed, target_std, hidden)
        dc = dflash_config({**tc, "rope_theta": 10_000.0}, layers=draft_layers, block_size=block_size,
                           target_layer_ids=list(range(tc["num_hidden_layers"])))
        dc["dflash_config"].update(input_embedding_scale=hidden ** 0.5,
                                   final_logit_softcapping=tc["final_logit_softcapping"])
        save_checkpoint(os.path.join(out_dir, "draft"), dc, random_dflash_weights(dc, seed=seed + 1, std=draft_std))
        return os.path.join(out_dir, "target"), os.path.join(out_dir, "draft")
    if hybrid:
        if moe:
            raise ValueError("--hybrid and --moe cannot be combined (the random hybrid target is dense)")
        tc = write_random_hybrid_target(os.path.join(out_dir, "target"), vocab, seed, target_std, hidden)
        dc = dflash_config({**tc, "rope_theta": tc["rope_parameters"]["rope_theta"]}, layers=draft_layers,
                           block_size=block_size, target_layer_ids=list(range(tc["num_hidden_layers"])), dflash2=two)
        save_checkpoint(os.path.join(out_dir, "draft"), dc, random_dflash_weights(dc, seed=seed + 1, std=draft_std))
        return os.path.join(out_dir, "target"), os.path.join(out_dir, "draft")
    tc = qwen3_config(vocab, hidden=hidden, inter=2 * hidden, layers=target_layers, heads=2, kv_heads=1,
                      head_dim=16, eos=(vocab - 1, 0))
    if moe:
        tc = moe_config(tc, experts=4, top_k=2, inter=hidden)
    save_checkpoint(os.path.join(out_dir, "target"), tc, random_qwen3_weights(tc, seed=seed, std=target_std))
    dc = dflash_config(tc, layers=draft_layers, block_size=block_size, target_layer_ids=list(range(target_layers)),
                       dflash2=two)
    save_checkpoint(os.path.join(out_dir, "draft"), dc, random_dflash_weights(dc, seed=seed + 1, std=draft_std))
    return os.path.join(out_dir, "target"), os.path.join(out_dir, "draft")


RANDOM_DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8)  # the random pair's (hidden 32)


def write_random_hybrid_target(out_dir: str, vocab: int, seed: int = 2, std: float = 0.4, hidden: int = 32,
                               layers: int = 4, interval: int = 2) -> dict:
    """A tiny Qwen3.5 hybrid target written by transformers (checkpoints.random_hybrid_model / save_hybrid):
    `layers` layers, every `interval`-th gated attention and the others Gated DeltaNet (4 and 2: linear, full,
    linear, full), widths as the dense random pair's (hidden 32, 2 heads of 16, 1 KV head; linear heads 2 key / 4
    value of 8 dims, kernel 4). Every parameter is its initial value plus N(0, std) noise, which for the matrices
    and embeddings (initialized at std 0.02) is --target-std's meaning in the dense pair, and moves the norms (1 +
    w), A_log and dt_bias off their init values. Returns the text config as a dict."""
    text = hybrid_text_config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=layers, full_attention_interval=interval, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=8, linear_value_head_dim=8, eos_token_id=vocab - 1,
                              bos_token_id=0)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # save_pretrained's shard bar
    hf = random_hybrid_model(text, seed=seed, std=std)
    kinds = hf.config.layer_types
    assert "linear_attention" in kinds and "full_attention" in kinds, kinds
    save_hybrid(hf, out_dir)
    return hf.config.to_dict()


GEMMA4_WINDOW = 2  # the random Gemma 4 target's sliding window: the default prompt and 3 new tokens cross it


def write_random_gemma4_target(out_dir: str, vocab: int, seed: int = 2, std: float = 0.4, hidden: int = 32,
                               window: int = GEMMA4_WINDOW) -> dict:
    """A tiny Gemma 4 target written by transformers (Gemma4ForCausalLM's save_pretrained): a sliding layer (window
    `window`, 2 heads of 16, 1 K/V head, default RoPE) and a full one (a head of 32 whose values are its keys,
    proportional RoPE), softcap 4 (it bounds the logits of a vocabulary of 4 to +-4, so the law stays spread).
    Every parameter is N(0, std) noise, around 1 for the norms; the layer scalars are 0.8. Returns its config as a
    dict."""
    import transformers
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    text = transformers.Gemma4TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=window, final_logit_softcapping=4.0, hidden_size_per_layer_input=0,
        max_position_embeddings=4096, layer_types=["sliding_attention", "full_attention"], eos_token_id=vocab - 1,
        bos_token_id=0)
    torch.manual_seed(seed)
    hf = transformers.Gemma4ForCausalLM(text)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * std + (1.0 if "norm" in name else 0.0))
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.8)
    hf.save_pretrained(out_dir)
    return hf.config.to_dict()


def load_pair(target_path: str, draft_path: str | None, device: str = "cpu"):
    if gemma4.is_gemma4(read_json(os.path.join(target_path, "config.json"))):
        target = gemma4.from_pretrained(target_path, device=device, dtype="float32")
    else:
        target = Qwen3.from_pretrained(target_path, device=device, dtype="float32")
    drafter = DFlashDrafter.from_pretrained(draft_path, device=device, dtype="float32") if draft_path else None
    return target, drafter


# ----------------------------------------------------------------------------------------------------------------
# Attention: the engine's eager CPU path (dense SDPA) or the real FlexAttention kernel


@contextlib.contextmanager
def attention(kind: str):
    """How eager CPU layers attend under the engine's BlockMasks (cpu.EAGER_CPU_ATTENTION): kind 'dense' as the
    engine does by default (SDPA over the mask materialized); 'flex': eager FlexAttention; 'kernel': the CPU
    attention kernel that compiled CPU engines run (cpu.load_cpu_kernel)."""
    saved = cpu.EAGER_CPU_ATTENTION, cpu.USE_CPU_KERNEL
    cpu.EAGER_CPU_ATTENTION = {"dense": "sdpa"}.get(kind, kind)
    cpu.USE_CPU_KERNEL = kind == "kernel"
    if kind == "kernel" and not cpu.load_cpu_kernel():
        raise SystemExit("error: --attention kernel: the CPU attention kernel could not be built (see the warning)")
    ddtree._ENGINES.clear()  # engines fix their attention when they are made
    try:
        yield
    finally:
        cpu.EAGER_CPU_ATTENTION, cpu.USE_CPU_KERNEL = saved
        ddtree._ENGINES.clear()


# ----------------------------------------------------------------------------------------------------------------
# The exact law


def last_logits(target: Qwen3, contexts: list[list[int]], batch: int = 64) -> torch.Tensor:
    """float32 logits [C, V] of the token after each context (all of one length), through the same forward the
    engine uses, `batch` contexts per forward (each in its own cache row)."""
    n = len(contexts[0])
    length = max(1024, -(-n // 128) * 128)
    out = []
    for first in range(0, len(contexts), batch):
        part = torch.tensor(contexts[first:first + batch], device=target.device)
        target.setup_cache(length, part.shape[0])
        if recurrent_target(target):
            target.reset_recurrent()  # a hybrid target's recurrent states start empty
        if target.device.type == "cpu":
            cpu.use_cpu_classes(target)  # its layers attend as an engine's on the CPU
        mask = PrefixMask(n, length, target.device, batch=part.shape[0], causal=True)
        pos = torch.arange(n, device=target.device).expand_as(part)
        last = torch.full((part.shape[0], 1), n - 1, device=target.device)
        with torch.inference_mode():
            logits, _ = target(part, pos, pos, mask.set(0), logits_rows=last)
        out.append(logits[:, 0])
    return torch.cat(out)


def warp_margin(logits: torch.Tensor, s: Sampling) -> float:
    """How far a row's warped support is from flipping (a token crossing a top-k / top-p / min-p threshold):
    the engine's logits for the same context come from other forward shapes and may differ in the last bits.
    inf when no filter is on."""
    if s.greedy:
        top2 = logits.double().topk(min(2, logits.shape[-1])).values
        return float(top2[0] - top2[-1]) if top2.numel() > 1 else math.inf
    x = logits.double() / s.temperature
    m = math.inf
    V = x.shape[-1]
    if 0 < s.top_k < V:
        v = x.sort(descending=True).values
        if v[s.top_k - 1] != v[s.top_k]:  # exact ties at the threshold are kept together by both: no flip
            m = min(m, float(v[s.top_k - 1] - v[s.top_k]))
        x = x.masked_fill(x < v[s.top_k - 1], -math.inf)
    if s.top_p < 1:
        p = x.softmax(-1)
        above = torch.stack([p[p > pi].sum() for pi in p])
        m = min(m, float((above - s.top_p).abs().min()))
        x = x.masked_fill(above >= s.top_p, -math.inf)
    if s.min_p > 0:
        p = x.softmax(-1)
        live = p > 0
        m = min(m, float((p[live] - s.min_p * p.max()).abs().min()))
    return m


@dataclass
class Law:
    """The exact joint law of the first n new tokens, over its support: the sequences with positive probability
    and their probabilities (float64), then one more cell, of probability 0, that collects every sample outside
    the support. margin: the smallest warping margin over the contexts used (see warp_margin)."""
    sequences: list
    probs: np.ndarray
    margin: float

    def counts(self, samples) -> np.ndarray:
        """How many of `samples` (token sequences) fall in each cell."""
        index = {seq: i for i, seq in enumerate(self.sequences)}
        counts = np.zeros(len(self.probs), dtype=np.int64)
        for seq in samples:
            counts[index.get(tuple(seq), len(self.sequences))] += 1
        return counts


def exact_law(target: Qwen3, prompt: list[int], n: int, s: Sampling, batch: int = 64) -> Law:
    """The autoregressive law of the warped target (the product of warped next-token distributions), enumerated
    over its support only: depth by depth, every prefix with positive probability is extended by the tokens its
    warped next-token law keeps, whose logits come from one batched forward per depth. With top-k 4 and n = 3
    that is 1 + 4 + 16 forwards and at most 64 sequences, whatever the vocabulary."""
    law, margin = {(): 1.0}, math.inf
    for _ in range(n):
        prefixes = list(law)
        logits = last_logits(target, [prompt + list(p) for p in prefixes], batch)
        warped = warp_probs(logits, s).double()
        warped = warped / warped.sum(-1, keepdim=True)
        margin = min([margin] + [warp_margin(row, s) for row in logits])
        grown = {}
        for prefix, row in zip(prefixes, warped):
            for token in row.nonzero().flatten().tolist():
                grown[prefix + (token,)] = law[prefix] * float(row[token])
        if len(grown) > MAX_CELLS:
            raise ValueError(f"the warped law has over {MAX_CELLS} sequences of {n} tokens: too many to enumerate "
                             f"(use top-k / top-p / min-p, or fewer tokens)")
        law = grown
    sequences = sorted(law)
    probs = np.array([law[seq] for seq in sequences] + [0.0])
    return Law(sequences, probs / probs.sum(), margin)


# ----------------------------------------------------------------------------------------------------------------
# The comparison


def chi_square(counts: np.ndarray, probs: np.ndarray):
    """(p-value, cells used, samples outside the law's support, TV distance). Cells with expected < 5 are pooled
    into one (if that pool is still < 5 the smallest remaining cell joins it). A sample on a zero-probability
    sequence is an immediate failure (p = 0)."""
    from scipy.stats import chisquare
    N = counts.sum()
    tv = 0.5 * np.abs(counts / N - probs).sum()
    outside = int(counts[probs == 0].sum())
    if outside:
        return 0.0, 0, outside, tv
    live = probs > 0
    obs, exp = counts[live].astype(float), probs[live] * N
    order = np.argsort(exp)
    obs, exp = obs[order], exp[order]
    small = exp < 5
    k = int(small.sum())
    if 0 < k < len(exp) and exp[:k].sum() < 5:
        k += 1
    if k:
        obs = np.concatenate([[obs[:k].sum()], obs[k:]])
        exp = np.concatenate([[exp[:k].sum()], exp[k:]])
    if len(exp) < 2:
        return 1.0, len(exp), 0, tv
    exp = exp * (obs.sum() / exp.sum())  # scipy wants equal totals (they are, up to rounding)
    return float(chisquare(obs, exp).pvalue), len(exp), 0, tv


def draw_samples(target, drafter, prompt, n: int, samples: int, seed0: int = 0, batch: int = 64, **kw):
    """The first n tokens of `samples` runs of generate(seed=seed0 + i), drawn as requests of generate_batch, `batch`
    at a time (each the same sample as its lone run); with acceptance statistics and samples/s."""
    t0 = time.perf_counter()
    results = generate_batch(target, drafter, [prompt] * samples, max_new_tokens=n, stop_ids=[],
                             seeds=[seed0 + i for i in range(samples)], max_batch=batch, **grouped(kw))
    seconds = time.perf_counter() - t0
    assert all(len(r.tokens) == n for r in results)
    rounds = drafts = 0
    if kw.get("method") != "ar":
        rounds = sum(r.stats["rounds"] for r in results)
        drafts = sum(sum(r.stats["path_lengths"]) - r.stats["rounds"] for r in results)  # each round commits a bonus
    return [tuple(r.tokens) for r in results], dict(rounds=rounds, drafts_per_round=drafts / rounds if rounds else 0.0,
                                                    samples_per_s=samples / seconds, seconds=seconds)


# ----------------------------------------------------------------------------------------------------------------
# Planted bugs


def _verify_chain_residual_p(p, q, drafts, accept_u, noise, room=None):
    """sampler.verify_chain_sampled with the bug: on rejection resample from p, not max(p - q, 0). Batched as the
    engine calls it: p [N, L + 1, V], q [N, L, V], drafts and accept_u [N, L], noise [N, L + 1, V], room [N] (the
    drafts before the position limit count, as in the real rule)."""
    d = drafts.unsqueeze(-1)
    L = drafts.shape[-1]
    drafted = torch.arange(L, device=drafts.device) < (L if room is None else room.unsqueeze(-1))
    px = p[:, :L].gather(-1, d).squeeze(-1).double()
    qx = q.gather(-1, d).squeeze(-1).double()
    n = ((accept_u.double() * qx < px) & drafted).long().cumprod(-1).sum(-1)
    cand = sample(p, noise)  # BUG: p[:, :L] where the residual belongs
    return n, cand.gather(1, n[:, None]).squeeze(1)


def _walk_tree_own_row(parents, tokens, target, max_depth):
    """sampler.walk_tree with the bug: a node matches when the target's token at its own row (the token after
    it), not at its parent's row, equals its token. Walked on the host per request (parents, tokens [N, B],
    target [N, B + 1]), first matching child first, so each result is still a path."""
    paths, lengths, nexts = [], [], []
    for par, tok, tgt in zip(parents.tolist(), tokens.tolist(), target.tolist()):
        path, row = [0], 0
        while len(path) <= max_depth:
            kids = [i + 1 for i in range(len(par)) if par[i] == row and tok[i] == tgt[i + 1]]  # BUG: tgt[row]
            if not kids:
                break
            row = kids[0]
            path.append(row)
        paths.append(path + [0] * (max_depth + 1 - len(path)))
        lengths.append(len(path))
        nexts.append(tgt[row])
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=parents.device)
    return as_tensor(paths), as_tensor(lengths), as_tensor(nexts)


_ENGINE_PICK = ddtree.Engine.pick


def _pick_unwarped(self, logits, noise):
    """Engine.pick with the bug: a round's rows (more than one per request) are sampled without top-k / top-p /
    min-p."""
    if self.sampling.greedy or logits.shape[1] == 1:
        return _ENGINE_PICK(self, logits, noise)
    unwarped = (logits.float() / self.sampling.temperature).softmax(-1)  # BUG: not warped
    return sample(unwarped, noise), finite_rows(logits)


def _draw_noise_shared(shape, generator, device):
    """sampler.draw_noise with the bug: one uniform for every draw of the call."""
    u = torch.rand(1, dtype=torch.float64, generator=generator, device=device)
    return u.expand(shape).contiguous()


_commit_recurrent = Qwen3_5.commit_recurrent


def _commit_recurrent_root_only(self, recurrent, path, length):
    """hybrid.Qwen3_5.commit_recurrent with the bug: the recurrent (and conv) states advance over the path's root only,
    as if no draft had been accepted; the attention layers' K/V still hold the whole path."""
    return _commit_recurrent(self, recurrent, path, length.clamp(max=1))  # BUG: length


_SLIDING_BLOCK_MASK = gemma4.sliding_block_mask


def _sliding_mask_in_slots(base, positions, window: int):
    """gemma4.sliding_block_mask with the bug: the window counts cache slots (a new row's slot is the prefix plus
    its row), not positions along the node's path, so a tree node past its depth sees too few committed tokens."""
    prefix = base.prefix_tensors[4]
    rows = torch.arange(positions.shape[-1], device=positions.device)
    return _SLIDING_BLOCK_MASK(base, (prefix[:, None] + rows).expand_as(positions), window)  # BUG: slots


def auto_control(method: str, draft_sampling: bool) -> str:
    if method == "ar":
        return "none"
    if method == "dflash" and draft_sampling:
        return "residual_p"
    return "own_row"


# --budget auto in a statistical run: the candidates take the rounds in this fixed cycle (trees of AUTO_CYCLE_BUDGETS
# nodes), 7 rounds long so that each batch of samples starts elsewhere in it.
AUTO_CYCLE_BUDGETS = (2, 5)
AUTO_CYCLE = (5, "chain", 2, "ar", 5, 2, "chain")


@contextlib.contextmanager
def switching_auto():
    """Budget auto with its choice made by a fixed cycle over its candidates (plain decoding, the chain, trees of 2
    and 5 nodes) instead of by measured speed, so that samples see every kind of switch mid-request. A cycle, like
    the measured choice, depends on the past only (docs/budget.md); by measurement, a small random pair on a CPU
    runs plain decoding alone, and its samples would test no speculative round at all."""
    import budget
    from budget import AutoBudget
    cycle = itertools.cycle(AUTO_CYCLE)
    saved = budget.AUTO_BUDGETS, AutoBudget.choose
    budget.AUTO_BUDGETS, AutoBudget.choose = AUTO_CYCLE_BUDGETS, lambda self: (next(cycle), False)
    try:
        yield
    finally:
        budget.AUTO_BUDGETS, AutoBudget.choose = saved


@contextlib.contextmanager
def planted(control: str, method: str, draft_sampling: bool):
    """Monkeypatch the engine with a planted bug (restored on exit). Engines are cached per settings and look
    these names up at call time (eager mode), so a cached engine picks up the patch."""
    walk = method == "ddtree" or (method == "dflash" and not draft_sampling)
    if control in ("residual_p",) and not (method == "dflash" and draft_sampling):
        raise ValueError("control residual_p needs --method dflash --draft-sampling")
    if control in ("own_row", "unwarped") and not walk:
        raise ValueError(f"control {control} needs the tree walk (ddtree, or dflash without --draft-sampling)")
    if control in ("stale_commit", "window_slots") and method == "ar":
        raise ValueError(f"control {control} needs a speculative method (dflash or ddtree)")
    patches = {"none": [], "residual_p": [(ddtree, "verify_chain_sampled", _verify_chain_residual_p)],
               "own_row": [(ddtree, "walk_tree", _walk_tree_own_row)],
               "unwarped": [(ddtree.Engine, "pick", _pick_unwarped)],
               "shared_noise": [(ddtree, "draw_noise", _draw_noise_shared)],
               "stale_commit": [(Qwen3_5, "commit_recurrent", _commit_recurrent_root_only)],
               "window_slots": [(gemma4, "sliding_block_mask", _sliding_mask_in_slots)]}[control]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


# ----------------------------------------------------------------------------------------------------------------
# One full check


def run_check(target, drafter, prompt, n, samples, sampling_kw: dict, method: str, budget: int | str = 4,
              draft_sampling: bool = False, draft_temperature: float = 1.0, control: str = "auto", seed: int = 0,
              attention_kind: str = "dense", control_samples: int | None = None, denoise_steps: int = 1,
              alpha: float = ALPHA, batch: int = 64, log=print):
    """Runs the real check and the control; returns a dict of results (p-values, TV, speeds, acceptance)."""
    s = Sampling(**sampling_kw)
    if control == "auto":  # greedy: the check is that every sample is the AR greedy sequence (main)
        control = "none" if s.greedy else auto_control(method, draft_sampling)
    kw = dict(method=method, budget=budget if method == "ddtree" else None, draft_sampling=draft_sampling,
              draft_temperature=draft_temperature, denoise_steps=denoise_steps, **sampling_kw)
    if control == "stale_commit" and not recurrent_target(target):
        raise ValueError("control stale_commit needs a target with recurrent layers (--hybrid)")
    if control == "window_slots" and not isinstance(target, gemma4.Gemma4):
        raise ValueError("control window_slots needs a Gemma 4 target (--gemma4)")
    out = {"control_name": control}
    with attention(attention_kind):
        law = exact_law(target, prompt, n, s, batch)
        probs, margin = law.probs, law.margin
        out["margin"], out["law"] = margin, law
        support = len(law.sequences)
        log(f"exact law: {support} sequences with mass, max prob {probs.max():.4f}, "
            f"perplexity {math.exp(-(probs[probs > 0] * np.log(probs[probs > 0])).sum()):.2f}, "
            f"warp margin {margin:.2e}")
        if not s.greedy and (support < 3 or probs.max() > 0.9):
            log("WARNING: the target law is nearly degenerate: a wrong verifier can hardly shift it. Pick another "
                "--pair-seed / --target-std, or a higher --temperature.")
        if margin < 1e-5:
            log("WARNING: a warping threshold is within 1e-5 of flipping for some context; last-bit differences "
                "between forward shapes could change the support. Pick another --pair-seed or settings.")
        runs = [("real", "none", samples)]
        if control != "none":
            runs.append(("control", control, control_samples or samples))
        auto = method == "ddtree" and budget == "auto"
        for name, ctl, N in runs:
            with planted(ctl, method, draft_sampling), switching_auto() if auto else contextlib.nullcontext():
                samples_drawn, st = draw_samples(target, drafter, prompt, n, N, seed0=seed * 1_000_003, batch=batch,
                                                 **kw)
            counts = law.counts(samples_drawn)
            pvalue, cells, outside, tv = chi_square(counts, probs)
            out[name] = dict(p=pvalue, tv=tv, cells=cells, outside=outside, counts=counts, **st)
            ok = pvalue >= alpha if name == "real" else pvalue < alpha
            out[name]["ok"] = ok
            if name == "real" and method != "ar" and st["drafts_per_round"] < 0.2:
                log(f"WARNING: {st['drafts_per_round']:.2f} drafts accepted per round: the verification rule is "
                    "barely exercised. Pick another --pair-seed / --draft-std.")
            acc = f", {st['drafts_per_round']:.2f} drafts accepted per round" if method != "ar" else ""
            log(f"{name:8s} [{ctl}] N={N}: chi-square p = {pvalue:.3e} ({cells} cells"
                f"{f', {outside} samples outside the support' if outside else ''}), TV = {tv:.4f}, "
                f"{st['samples_per_s']:.1f} samples/s{acc} -> {'PASS' if ok else 'FAIL'}"
                f"{'' if name == 'real' else ' (the control must be rejected)'}")
    return out


def parse_args(argv):
    p = one_line_errors(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--method", choices=("ar", "dflash", "ddtree"), default="ddtree")
    p.add_argument("--budget", type=budget_value, default=None,
                   help=f"ddtree: tree nodes (default {DEFAULT_BUDGET}), or auto (budget auto, its candidates taking "
                        "the rounds in a fixed cycle: switching_auto)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--draft-sampling", action="store_true")
    p.add_argument("--draft-temperature", type=float, default=1.0)
    p.add_argument("--denoise-steps", type=int, default=1)
    p.add_argument("--n-tokens", type=int, default=3, help="length of the joint law")
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--control-samples", type=int, default=None, help="default: --samples")
    p.add_argument("--control", choices=CONTROLS, default="auto")
    p.add_argument("--vocab", type=int, default=4, help="for the random pair")
    p.add_argument("--batch", type=int, default=64, help="samples drawn together (generate_batch's max_batch); 1 "
                                                         "draws them one generate() call at a time")
    p.add_argument("--text", default=None, help="the prompt as text, encoded with the checkpoint's tokenizer "
                                                 "(a real checkpoint: --target, --draft, or --bundled)")
    p.add_argument("--bundled", action="store_true", help="the bundled tiny pair (vocab 4096)")
    p.add_argument("--block-size", type=int, default=3, help="for the random pair's drafter")
    p.add_argument("--target-std", type=float, default=0.4, help="random target weights' std")
    p.add_argument("--draft-std", type=float, default=0.4, help="random drafter weights' std")
    p.add_argument("--pair-seed", type=int, default=2, help="random pair weights (2: a target law with ~17 live "
                                                                "sequences of 64 at T=1, top-k 3, top-p 0.95)")
    p.add_argument("--seed", type=int, default=0, help="samples use generate(seed=seed * 1000003 + i)")
    p.add_argument("--prompt", default=None, help="comma-separated token ids (default: 1,2,3 mod vocab)")
    p.add_argument("--target", default=None, help="Qwen3 checkpoint dir (default: write a random pair)")
    p.add_argument("--moe", action="store_true", help="the random pair's target is a Qwen3-MoE")
    p.add_argument("--dflash2", action="store_true", help="the random pair's drafter is a DFlash 2 (a selector "
                   "over vocab - 1 candidates)")
    p.add_argument("--hybrid", action="store_true", help="the random pair's target is a Qwen3.5 hybrid (Gated "
                                                          "DeltaNet + gated attention layers)")
    p.add_argument("--gemma4", action="store_true", help="the random pair's target is a Gemma 4 (a sliding layer "
                   f"of window {GEMMA4_WINDOW} and a full one), its drafter Gemma-style")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the settings and results to FILE")
    p.add_argument("--draft", default=None, help="DFlash checkpoint dir (default: write a random pair)")
    p.add_argument("--attention", choices=("dense", "flex", "kernel"), default="dense")
    p.add_argument("--alpha", type=float, default=ALPHA, help="the real run fails below, the control must be below")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def budget_value(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of nodes or 'auto': {text!r}") from None


def check_args(a):
    """The options checked before anything runs, as the command line checks its own: a setting that does not apply
    to the method is refused (settings.check_settings), and a --json file that could not be written is an error
    now rather than after the run."""
    check_settings(a.method, Sampling(a.temperature, a.top_k, a.top_p, a.min_p), a.budget,
                   Speculation(draft_temperature=a.draft_temperature, draft_sampling=a.draft_sampling,
                               denoise_steps=a.denoise_steps))
    if not 0 < a.alpha < 1:
        raise ValueError(f"--alpha must be in (0, 1), got {a.alpha}")
    for flag, value, low in (("--samples", a.samples, 1), ("--control-samples", a.control_samples, 1),
                             ("--n-tokens", a.n_tokens, 1), ("--batch", a.batch, 1), ("--threads", a.threads, 1),
                             ("--block-size", a.block_size, 2), ("--vocab", a.vocab, 2)):
        if value is not None:
            check_int(flag, value, low)
    if a.bundled:
        a.target, a.draft = ddtree.DEFAULT_TARGET, ddtree.DEFAULT_DRAFT
    if (a.target is None) != (a.draft is None) and a.method != "ar":
        raise ValueError("give both --target and --draft, or neither (a random pair)")
    if a.hybrid and (a.target is not None or a.moe):
        raise ValueError("--hybrid is for the random pair, without --target / --draft / --bundled / --moe")
    if a.gemma4 and (a.target is not None or a.moe or a.hybrid or a.dflash2):
        raise ValueError("--gemma4 is for the random pair, without --target / --draft / --bundled / --moe / "
                         "--hybrid / --dflash2")
    if a.dflash2 and (a.target is not None or a.method == "ar"):
        raise ValueError("--dflash2 is for the random pair's drafter, without --target / --draft / --bundled, "
                         "and with a drafting method")
    if a.prompt is not None and a.text is not None:
        raise ValueError("give --prompt (token ids) or --text, not both")
    if a.json is not None:
        folder = os.path.dirname(os.path.abspath(a.json))
        if not os.path.isdir(folder):
            raise ValueError(f"--json {a.json}: no directory {folder}")
        if os.path.isdir(a.json) or not os.access(folder, os.W_OK):
            raise ValueError(f"--json {a.json}: cannot be written")


def token_ids(text: str, vocab: int) -> list[int]:
    """--prompt: comma-separated token ids in [0, vocab)."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--prompt must be token ids separated by commas, got {text!r}") from None
    if not all(0 <= t < vocab for t in ids):
        raise ValueError(f"--prompt: token ids must lie in [0, {vocab}) for this target, got {text}")
    return ids


def write_json(path: str, a, out: dict, good: bool, seconds: float, vocab: int, prompt: list[int]):
    """The run's settings (the command-line options), the exact law's summary and each run's numbers (without the
    per-cell counts), as one JSON object."""
    import json
    law = out["law"]
    live = law.probs[law.probs > 0]
    runs = {name: {k: (v.item() if hasattr(v, "item") else v) for k, v in out[name].items() if k != "counts"}
            for name in ("real", "control") if name in out}
    margin = float(law.margin) if math.isfinite(law.margin) else None  # inf (no filter on): null
    obj = dict(settings=vars(a), vocab=vocab, prompt=prompt, control_name=out["control_name"],
               law=dict(sequences=len(law.sequences), max_prob=float(law.probs.max()),
                        perplexity=float(math.exp(-(live * np.log(live)).sum())), warp_margin=margin),
               **runs, result="PASS" if good else "FAIL", seconds=seconds)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=float)
        f.write("\n")


def main(argv=None) -> int:
    """Bad options are one `error:` line and exit status 2, as on the command line; then 0 (PASS) or 1 (FAIL)."""
    try:
        a = parse_args(argv)
        check_args(a)
        return run(a)
    except (ValueError, TypeError) as e:
        print(f"error: {in_flags(str(e))}", file=sys.stderr)
        return 2


def run(a) -> int:
    torch.set_num_threads(a.threads)
    budget = (a.budget if a.budget is not None else DEFAULT_BUDGET) if a.method == "ddtree" else None
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        target_path, draft_path = a.target, a.draft
        if target_path is None:
            t, d = write_random_pair(tmp, a.vocab, a.pair_seed, a.target_std, a.draft_std, a.block_size,
                                     moe=a.moe, hybrid=a.hybrid, dflash2=a.dflash2, gemma=a.gemma4)
            target_path, draft_path = target_path or t, draft_path or d
        target, drafter = load_pair(target_path, draft_path if a.method != "ar" else None, a.device)
        V = target.config.vocab_size
        if a.text is not None:
            from text import Text
            prompt = Text(target.path).encode(a.text)
        else:
            prompt = token_ids(a.prompt, V) if a.prompt else [(1 + i) % V for i in range(3)]
        sampling_kw = dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p)
        shown = prompt if len(prompt) <= 12 else f"{prompt[:12]}..({len(prompt)} tokens)"
        print(f"method={a.method} budget={budget} draft_sampling={a.draft_sampling} "
              f"draft_temperature={a.draft_temperature} denoise_steps={a.denoise_steps} {sampling_kw} "
              f"n_tokens={a.n_tokens} vocab={V} prompt={shown} attention={a.attention} batch={a.batch}"
              + (f" block_size={drafter.block_size}" if drafter is not None else ""))
        if Sampling(**sampling_kw).greedy:
            ar = generate(target, None, prompt, method="ar", max_new_tokens=a.n_tokens, stop_ids=[]).tokens
        out = run_check(target, drafter, prompt, a.n_tokens, a.samples, sampling_kw, a.method, budget,
                        a.draft_sampling, a.draft_temperature, a.control, a.seed, a.attention, a.control_samples,
                        a.denoise_steps, a.alpha, a.batch)
        if Sampling(**sampling_kw).greedy:
            law = out["law"]
            ok = out["real"]["counts"][law.sequences.index(tuple(ar))] == a.samples
            print(f"greedy: every sample equals the AR greedy sequence {ar}: {'PASS' if ok else 'FAIL'}")
            out["real"]["ok"] &= bool(ok)
    good = out["real"]["ok"] and out.get("control", {"ok": True})["ok"]
    print("RESULT:", "PASS" if good else "FAIL")
    if a.json:
        write_json(a.json, a, out, good, time.perf_counter() - started, V, prompt)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
