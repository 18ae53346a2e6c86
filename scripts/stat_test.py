"""Statistical correctness run (docs/stat_test.md, the correctness pyramid's level 3): sampled output follows the
target's law.

On a tiny vocabulary the exact joint law of the first n new tokens under the warped target is enumerated (the
autoregressive law: the product of warped next-token distributions, over all V^n sequences, in float64). N
independent samples come from `generate(..., seed=i)` with the chosen method; a chi-square test (cells with an
expected count below 5 pooled) and the total-variation distance compare them with the exact law. A planted-bug
control (a subtly wrong verifier or warping, monkeypatched into the engine) is run on the same seeds and must be
rejected, which shows the run has the power to see a real bug.

    python scripts/stat_test.py --method ddtree --budget 5 --temperature 0.9 --top-k 3 --top-p 0.95 --samples 4000
    python scripts/stat_test.py --method dflash --draft-sampling --temperature 0.8 --top-p 0.9 --samples 4000

Exit status 1 if the real run's p-value is below --alpha (1e-6) or the control's is not. With --temperature 0 the
check is instead that every sample equals the AR greedy sequence (no control).

Speed. Eager FlexAttention on a CPU costs ~9 ms per call whatever the size (its math path vmaps the mask_mod over
[queries, all cache slots] through Python), so the engine's eager CPU runs hand their layers the same mask_mod
materialized for SDPA instead (ddtree.EAGER_CPU_ATTENTION): that is `--attention dense`, the default, the engine as
is. `--attention flex` makes them run eager FlexAttention, the real kernel. tests/test_stat.py checks that both
give the engine the same tokens for the same seeds.

Controls (`--control`; `auto` picks by method):
  residual_p    draft sampling: on rejection resample from p instead of the residual max(p - q, 0)
  own_row       tree walk: accept a node when the target's token at the node's own row (instead of its
                parent's row) equals the node's token
  unwarped      tree walk: the target's tokens in a speculative round are sampled from softmax(logits / T),
                without top-k / top-p / min-p (the prefill's first token stays right)
  shared_noise  every row of a round uses the same Exponential noise row (correlated draws across rows)
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "scripts")):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ddtree  # noqa: E402
from checkpoints import (dflash_config, moe_config, qwen3_config, random_dflash_weights, random_qwen3_weights,  # noqa: E402
                         save_checkpoint)
from ddtree import generate  # noqa: E402
from drafter import DFlashDrafter  # noqa: E402
from model import Qwen3  # noqa: E402
from sampler import Sampling, sample, warp_probs  # noqa: E402
from tree_attn import PrefixMask, causal  # noqa: E402

ALPHA = 1e-6
CONTROLS = ("auto", "none", "residual_p", "own_row", "unwarped", "shared_noise")
MAX_CELLS = 200_000


# ----------------------------------------------------------------------------------------------------------------
# A random pair in the real formats


def write_random_pair(out_dir: str, vocab: int, seed: int = 2, target_std: float = 0.4, draft_std: float = 0.4,
                      block_size: int = 3, hidden: int = 32, target_layers: int = 2, draft_layers: int = 1,
                      moe: bool = False):
    """A tiny Qwen3 target and DFlash drafter. Weights of std 0.3-0.5 give a non-degenerate target (several tokens
    with real mass after warping; how peaked it is varies with the seed, and run_check warns when the law is
    nearly degenerate). The drafter shares the target's embedding and lm_head, so its drafts correlate with the
    target's choices: with seed 2 (vocab 4, block 3) 0.7-1.0 drafts are accepted per round. moe: a Qwen3-MoE
    target (4 experts, top 2, every layer sparse)."""
    tc = qwen3_config(vocab, hidden=hidden, inter=2 * hidden, layers=target_layers, heads=2, kv_heads=1,
                      head_dim=16, eos=(vocab - 1, 0))
    if moe:
        tc = moe_config(tc, experts=4, top_k=2, inter=hidden)
    save_checkpoint(os.path.join(out_dir, "target"), tc, random_qwen3_weights(tc, seed=seed, std=target_std))
    dc = dflash_config(tc, layers=draft_layers, block_size=block_size, target_layer_ids=list(range(target_layers)))
    save_checkpoint(os.path.join(out_dir, "draft"), dc, random_dflash_weights(dc, seed=seed + 1, std=draft_std))
    return os.path.join(out_dir, "target"), os.path.join(out_dir, "draft")


def load_pair(target_path: str, draft_path: str | None):
    target = Qwen3.from_pretrained(target_path, device="cpu", dtype="float32")
    drafter = DFlashDrafter.from_pretrained(draft_path, device="cpu", dtype="float32") if draft_path else None
    return target, drafter


# ----------------------------------------------------------------------------------------------------------------
# Attention: the engine's eager CPU path (dense SDPA) or the real FlexAttention kernel


@contextlib.contextmanager
def attention(kind: str):
    """kind 'dense': the engine as is (eager CPU engines materialize the mask for SDPA); 'flex': eager engines
    hand their layers the BlockMask, so eager FlexAttention runs (ddtree.EAGER_CPU_ATTENTION)."""
    saved = ddtree.EAGER_CPU_ATTENTION
    ddtree.EAGER_CPU_ATTENTION = "sdpa" if kind == "dense" else "flex"
    ddtree._ENGINES.clear()  # engines fix their attention when they are made
    try:
        yield
    finally:
        ddtree.EAGER_CPU_ATTENTION = saved
        ddtree._ENGINES.clear()


# ----------------------------------------------------------------------------------------------------------------
# The exact law


def next_token_logits(target: Qwen3, tokens: list[int]) -> torch.Tensor:
    """float32 logits [len(tokens), V] of the target run causally on `tokens` (row i: the next token after
    tokens[:i + 1]), through the same forward the engine uses."""
    n = len(tokens)
    cache = target.layers[0].self_attn.k_cache
    if cache is None or cache.shape[2] < n:
        target.setup_cache(max(1024, -(-n // 128) * 128))
    mask = PrefixMask(n, target.layers[0].self_attn.k_cache.shape[2], target.device, dense=ddtree.EAGER_CPU_ATTENTION == "sdpa")
    mask.allow.copy_(causal(n))
    pos = torch.arange(n, device=target.device)
    with torch.inference_mode():
        logits, _ = target(torch.tensor(tokens, device=target.device), pos, pos, mask.set(0))
    return logits


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


def exact_law(target: Qwen3, prompt: list[int], n: int, s: Sampling):
    """(probs [V^n] float64 in itertools.product order, the smallest warping margin over the contexts used).
    Sequence index = sum(tok_k * V^(n-1-k))."""
    V = target.config.vocab_size
    if V ** n > MAX_CELLS:
        raise ValueError(f"vocab {V} ^ n_tokens {n} = {V ** n} cells: too many to enumerate (max {MAX_CELLS})")
    P = len(prompt)
    cond = {}  # prefix tuple -> warped next-token probs [V] float64
    margin = math.inf
    for head in itertools.product(range(V), repeat=n - 1):
        logits = next_token_logits(target, prompt + list(head))[P - 1:]
        for k in range(n):
            prefix = head[:k]
            if prefix not in cond:
                w = warp_probs(logits[k: k + 1], s)[0].double()
                cond[prefix] = w / w.sum()
                margin = min(margin, warp_margin(logits[k], s))
    probs = np.zeros(V ** n)
    for i, seq in enumerate(itertools.product(range(V), repeat=n)):
        pr = 1.0
        for k in range(n):
            pr *= float(cond[seq[:k]][seq[k]])
            if pr == 0.0:
                break
        probs[i] = pr
    return probs / probs.sum(), margin


def seq_index(tokens, V: int) -> int:
    i = 0
    for t in tokens:
        i = i * V + t
    return i


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


def draw_samples(target, drafter, prompt, n: int, samples: int, seed0: int = 0, **kw):
    """counts [V^n], acceptance statistics and samples/s for `samples` runs of generate(seed=seed0 + i)."""
    V = target.config.vocab_size
    counts = np.zeros(V ** n, dtype=np.int64)
    rounds = drafts = 0
    t0 = time.perf_counter()
    for i in range(samples):
        res = generate(target, drafter, prompt, max_new_tokens=n, seed=seed0 + i, stop_ids=[], **kw)
        assert len(res.tokens) == n, res.tokens
        counts[seq_index(res.tokens, V)] += 1
        if kw.get("method") != "ar":
            rounds += res.stats["rounds"]
            drafts += sum(res.stats["verified"]) - res.stats["rounds"]  # each round also commits its bonus
    seconds = time.perf_counter() - t0
    return counts, dict(rounds=rounds, drafts_per_round=drafts / rounds if rounds else 0.0,
                        samples_per_s=samples / seconds, seconds=seconds)


# ----------------------------------------------------------------------------------------------------------------
# Planted bugs


def _verify_chain_residual_p(p, q, drafts, accept_u, noise):
    """sampler.verify_chain_sampled with the bug: on rejection resample from p, not max(p - q, 0)."""
    L = drafts.shape[0]
    d = drafts.unsqueeze(-1)
    px = p[:L].gather(-1, d).squeeze(-1).double()
    qx = q.gather(-1, d).squeeze(-1).double()
    n = (accept_u.double() * qx < px).long().cumprod(0).sum()
    cand = sample(p, noise)  # BUG: p[:L] where the residual belongs
    return n, cand.gather(0, n.view(1)).squeeze(0)


def _walk_tree_own_row(parents, tokens, target, max_depth):
    """sampler.walk_tree with the bug: a node matches when the target's token at its own row (the token after
    it), not at its parent's row, equals its token. Walked on the host, first matching child first, so the
    result is still a path."""
    B = parents.shape[0]
    par, tok, tgt = parents.tolist(), tokens.tolist(), target.tolist()
    path, row = [0], 0
    while len(path) <= max_depth:
        kids = [i + 1 for i in range(B) if par[i] == row and tok[i] == tgt[i + 1]]  # BUG: tgt[row]
        if not kids:
            break
        row = kids[0]
        path.append(row)
    length = len(path)
    padded = torch.tensor(path + [0] * (max_depth + 1 - length), dtype=torch.long, device=parents.device)
    return padded, torch.tensor(length, device=parents.device), target[row]


def _pick_unwarped(self, logits, noise):
    """Engine.pick with the bug: a round's rows (more than one) are sampled without top-k / top-p / min-p."""
    ok = torch.isfinite(logits).all()
    if self.sampling.greedy:
        return logits.argmax(-1), ok
    if logits.shape[0] > 1:
        return sample((logits.float() / self.sampling.temperature).softmax(-1), noise), ok  # BUG: not warped
    return sample(warp_probs(logits, self.sampling), noise), ok


def _draw_noise_shared(shape, generator, device):
    """sampler.draw_noise with the bug: one Exponential row broadcast to every row."""
    row = torch.empty(shape[-1], dtype=torch.float32, device=device).exponential_(generator=generator)
    return row.expand(shape).contiguous()


def auto_control(method: str, draft_sampling: bool) -> str:
    if method == "ar":
        return "none"
    if method == "dflash" and draft_sampling:
        return "residual_p"
    return "own_row"


@contextlib.contextmanager
def planted(control: str, method: str, draft_sampling: bool):
    """Monkeypatch the engine with a planted bug (restored on exit). Engines are cached per settings and look
    these names up at call time (eager mode), so a cached engine picks up the patch."""
    walk = method == "ddtree" or (method == "dflash" and not draft_sampling)
    if control in ("residual_p",) and not (method == "dflash" and draft_sampling):
        raise ValueError("control residual_p needs --method dflash --draft-sampling")
    if control in ("own_row", "unwarped") and not walk:
        raise ValueError(f"control {control} needs the tree walk (ddtree, or dflash without --draft-sampling)")
    patches = {"none": [], "residual_p": [(ddtree, "verify_chain_sampled", _verify_chain_residual_p)],
               "own_row": [(ddtree, "walk_tree", _walk_tree_own_row)],
               "unwarped": [(ddtree.Engine, "pick", _pick_unwarped)],
               "shared_noise": [(ddtree, "draw_noise", _draw_noise_shared)]}[control]
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


def run_check(target, drafter, prompt, n, samples, sampling_kw: dict, method: str, budget: int = 4,
              draft_sampling: bool = False, draft_temperature: float = 1.0, control: str = "auto", seed: int = 0,
              attention_kind: str = "dense", control_samples: int | None = None, denoise_steps: int = 1,
              alpha: float = ALPHA, log=print):
    """Runs the real check and the control; returns a dict of results (p-values, TV, speeds, acceptance)."""
    s = Sampling(**sampling_kw)
    if control == "auto":  # greedy: the check is that every sample is the AR greedy sequence (main)
        control = "none" if s.greedy else auto_control(method, draft_sampling)
    kw = dict(method=method, budget=budget if method == "ddtree" else None, draft_sampling=draft_sampling,
              draft_temperature=draft_temperature, denoise_steps=denoise_steps, **sampling_kw)
    out = {"control_name": control}
    with attention(attention_kind):
        probs, margin = exact_law(target, prompt, n, s)
        out["margin"] = margin
        support = int((probs > 0).sum())
        log(f"exact law: {len(probs)} sequences, {support} with mass, max prob {probs.max():.4f}, "
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
        for name, ctl, N in runs:
            with planted(ctl, method, draft_sampling):
                counts, st = draw_samples(target, drafter, prompt, n, N, seed0=seed * 1_000_003, **kw)
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=("ar", "dflash", "ddtree"), default="ddtree")
    p.add_argument("--budget", type=int, default=5)
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
    p.add_argument("--vocab", type=int, default=4, help="for the random pair (<= 8)")
    p.add_argument("--block-size", type=int, default=3, help="for the random pair's drafter")
    p.add_argument("--target-std", type=float, default=0.4, help="random target weights' std")
    p.add_argument("--draft-std", type=float, default=0.4, help="random drafter weights' std")
    p.add_argument("--pair-seed", type=int, default=2, help="random pair weights (2: a target law with ~17 live "
                                                                "sequences of 64 at T=1, top-k 3, top-p 0.95)")
    p.add_argument("--seed", type=int, default=0, help="samples use generate(seed=seed * 1000003 + i)")
    p.add_argument("--prompt", default=None, help="comma-separated token ids (default: 1,2,3 mod vocab)")
    p.add_argument("--target", default=None, help="Qwen3 checkpoint dir (default: write a random pair)")
    p.add_argument("--moe", action="store_true", help="the random pair's target is a Qwen3-MoE")
    p.add_argument("--draft", default=None, help="DFlash checkpoint dir (default: write a random pair)")
    p.add_argument("--attention", choices=("dense", "flex"), default="dense")
    p.add_argument("--alpha", type=float, default=ALPHA, help="the real run fails below, the control must be below")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.method == "ar" and a.draft_sampling:
        raise SystemExit("--draft-sampling needs --method dflash")
    if (a.target is None) != (a.draft is None) and a.method != "ar":
        raise SystemExit("give both --target and --draft, or neither (a random pair)")
    with tempfile.TemporaryDirectory() as tmp:
        target_path, draft_path = a.target, a.draft
        if target_path is None:
            if not 2 <= a.vocab <= 8:
                raise SystemExit("--vocab must be in [2, 8]")
            t, d = write_random_pair(tmp, a.vocab, a.pair_seed, a.target_std, a.draft_std, a.block_size,
                                     moe=a.moe)
            target_path, draft_path = target_path or t, draft_path or d
        target, drafter = load_pair(target_path, draft_path if a.method != "ar" else None)
        V = target.config.vocab_size
        prompt = ([int(x) for x in a.prompt.split(",")] if a.prompt else [(1 + i) % V for i in range(3)])
        sampling_kw = dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p)
        shown = prompt if len(prompt) <= 12 else f"{prompt[:12]}..({len(prompt)} tokens)"
        print(f"method={a.method} budget={a.budget} draft_sampling={a.draft_sampling} "
              f"draft_temperature={a.draft_temperature} denoise_steps={a.denoise_steps} {sampling_kw} "
              f"n_tokens={a.n_tokens} vocab={V} prompt={shown} "
              f"attention={a.attention}"
              + (f" block_size={drafter.block_size}" if drafter is not None else ""))
        if Sampling(**sampling_kw).greedy:
            ar = generate(target, None, prompt, method="ar", max_new_tokens=a.n_tokens, stop_ids=[]).tokens
        if V ** a.n_tokens > MAX_CELLS:
            raise SystemExit(f"vocab {V} ^ n_tokens {a.n_tokens} sequences: too many to enumerate (max {MAX_CELLS})")
        out = run_check(target, drafter, prompt, a.n_tokens, a.samples, sampling_kw, a.method, a.budget,
                        a.draft_sampling, a.draft_temperature, a.control, a.seed, a.attention, a.control_samples,
                        a.denoise_steps, a.alpha)
        if Sampling(**sampling_kw).greedy:
            V = target.config.vocab_size
            ok = out["real"]["counts"][seq_index(ar, V)] == a.samples
            print(f"greedy: every sample equals the AR greedy sequence {ar}: {'PASS' if ok else 'FAIL'}")
            out["real"]["ok"] &= bool(ok)
    good = out["real"]["ok"] and out.get("control", {"ok": True})["ok"]
    print("RESULT:", "PASS" if good else "FAIL")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
