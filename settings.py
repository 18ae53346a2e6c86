"""A run's settings (sampler.Sampling, Speculation) and their checks at the API's boundary: input is checked once,
where it enters, and everything past it assumes it valid (docs/round.md)."""

import math
import numbers
import reprlib
import secrets
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from drafter import DFlashDrafter
import families
from families import position_limit
from sampler import Sampling

METHODS = ("ddtree", "dflash", "ar")
DEFAULT_BUDGET = 512  # the paper's tree size
AUTO_BUDGETS = (4, 16, 64, 256, 512)  # the tree sizes auto chooses among, with "ar" and "chain"
INT64_MAX = 2**63 - 1
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # the weights' types a run takes


@dataclass(frozen=True)
class Speculation:
    """How a speculative round drafts (dflash, ddtree); hashable, so it keys the engine cache with Sampling."""
    budget: int | str | None = None  # ddtree: tree nodes per round, or "auto" (None for the chain: block_size - 1)
    draft_temperature: float = 1.0  # ddtree: the drafter's temperature when building trees (1, as in the paper)
    draft_sampling: bool = False  # dflash with sampling: sample the chain, verify with min(1, p/q)
    denoise_steps: int = 1  # drafter passes per round
    show_tree: bool = False  # keep each round's tree in Result.trees
    draft_window: int | None = None  # dflash, ddtree: the drafter sees only the last W committed tokens (None: all)


def verify_rows(method: str, spec: Speculation, drafter, auto=()) -> int:
    """Rows of a verify: the bonus and the tree's nodes (ddtree; budget auto: its largest tree among `auto`) or the
    chain's block_size - 1 drafts."""
    if method != "ddtree":
        return drafter.block_size
    return 1 + max(max(auto, default=0), drafter.block_size - 1) if spec.budget == "auto" else 1 + spec.budget


def check_settings(method, sampling, budget, speculation) -> tuple:
    """(Sampling, Speculation) checked against the method and each other, numbers as floats and the budget
    resolved (the default for ddtree, None otherwise). budget: the tree size, or None for speculation.budget's."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    sampling = check_sampling(sampling)
    spec = Speculation() if speculation is None else speculation
    if not isinstance(spec, Speculation):
        raise TypeError(f"speculation must be a settings.Speculation, got {reprlib.repr(spec)}")
    if budget is not None and spec.budget is not None:
        raise ValueError("budget is given twice: as budget and as speculation.budget")
    budget = spec.budget if budget is None else budget
    for name in ("draft_sampling", "show_tree"):
        if not isinstance(getattr(spec, name), bool):
            raise TypeError(f"{name} must be True or False, got {getattr(spec, name)!r}")
    if budget is not None and not (isinstance(budget, str) and budget == "auto"):
        if isinstance(budget, str):
            raise ValueError(f"budget must be a positive integer or 'auto', got {budget!r}")
        check_int("budget", budget, 1)
    check_int("denoise_steps", spec.denoise_steps, 1)
    if spec.draft_window is not None:
        check_int("draft_window", spec.draft_window, 1)
    draft_temperature = real("draft_temperature", spec.draft_temperature, TypeError)
    if not 0 < draft_temperature < float("inf") or draft_temperature > 1e300:
        raise ValueError(f"draft_temperature must be a positive finite number, got {draft_temperature!r}")
    given = dict(budget=budget is not None, draft_temperature=draft_temperature != 1,
                 draft_sampling=spec.draft_sampling, denoise_steps=spec.denoise_steps != 1, show_tree=spec.show_tree,
                 draft_window=spec.draft_window is not None,
                 top_k=sampling.top_k != 0, top_p=sampling.top_p != 1, min_p=sampling.min_p != 0)
    check_applies(method, sampling.greedy, [name for name, g in given.items() if g])
    budget = (DEFAULT_BUDGET if budget is None else budget) if method == "ddtree" else None
    return sampling, replace(spec, budget=budget, draft_temperature=draft_temperature)


def check_recalibrate(recalibrate, budget):
    """recalibrate is True or False, and True only with budget "auto", the one setting that reads a calibration."""
    if not isinstance(recalibrate, bool):
        raise TypeError(f"recalibrate must be True or False, got {shown(recalibrate)}")
    if recalibrate and budget != "auto":
        raise ValueError("recalibrate goes with budget 'auto': it measures the round times auto chooses by again")


def real(name: str, value, error=ValueError) -> float:
    """A real number as a float (an int as large as 2**64 would overflow in the kernels)."""
    # bool is an int subclass, but `temperature=True` is certainly a mistake; numbers.Real takes numpy's scalars
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be a real number, got {shown(value)}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got {shown(value)}") from None
    if math.isnan(value):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    return value


def check_sampling(s: Sampling) -> Sampling:
    """The sampling settings checked, their numbers as floats."""
    temperature, top_p, min_p = (real(name, getattr(s, name)) for name in ("temperature", "top_p", "min_p"))
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {s.temperature!r}")
    if not is_int(s.top_k) or s.top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {shown(s.top_k)}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {s.top_p!r}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {s.min_p!r}")
    return Sampling(temperature, int(s.top_k), top_p, min_p)


def check_request(target, drafter, prompts, seeds, stop_ids, method, max_new_tokens, spec, compile, on_tokens,
                  max_batch, on_result=None):
    """(prompts as lists, one seed per prompt, stop ids as a set) checked against the models; a None seed is drawn
    from the OS, leaving torch's global generator to the caller. Errors about one of several prompts name it."""
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts (each a list of token ids or a 1-D integer tensor), got "
                        f"{reprlib.repr(prompts)}")
    if not prompts:
        raise ValueError("no prompts given")
    single = len(prompts) == 1
    seeds = [None] * len(prompts) if seeds is None else seeds
    if not isinstance(seeds, (list, tuple)) or len(seeds) != len(prompts):
        raise TypeError(f"seeds must be a list of one int (or None) per prompt, got {reprlib.repr(seeds)}")
    checked, fresh = [], []
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        name = "" if single else f"prompt {i}: "
        try:
            checked.append(check_prompt(prompt, target))
            fresh.append(secrets.randbits(63) if seed is None else check_int("seed", seed, 0))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}{e}") from None
    if families.parallel():  # under torchrun: every rank draws the same randomness
        fresh = families.family("tp").same_on_every_rank(fresh)
    stop = set(target.eos_ids) if stop_ids is None else check_stop_ids(stop_ids, target.config.vocab_size)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("max_batch", max_batch, 1)
    if not isinstance(compile, bool) and compile != "max-autotune":
        raise TypeError(f"compile must be True, False or 'max-autotune', got {compile!r}")
    if on_tokens is not None and not callable(on_tokens):
        raise TypeError(f"on_tokens must be a function of (request index, list of token ids), got {on_tokens!r}")
    if on_result is not None and not callable(on_result):
        raise TypeError(f"on_result must be a function of (request index, Result), got {on_result!r}")
    index = max(range(len(checked)), key=lambda i: len(checked[i]))
    longest, name = len(checked[index]), "" if single else f"prompt {index}: "  # the errors below name it
    limit, source = position_limit(target.config)
    if longest + max_new_tokens > limit:
        raise ValueError(f"{name}prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"{limit} positions the target reaches ({source})")
    if method != "ar":
        drafter.bind(target)
        if spec.denoise_steps > drafter.block_size - 1:
            raise ValueError(f"denoise_steps {spec.denoise_steps} exceeds the drafter's {drafter.block_size - 1} "
                             f"draft positions (each pass decides at least one)")
        check_orderable(spec.budget, drafter, target.config.vocab_size)
    return checked, fresh, stop


def check_orderable(budget, drafter, vocab: int):
    """A tree of `budget` nodes is one the builders can order: draft_tree.order_key's tie-break index over budget x
    (tokens per depth) candidates stays below 2**31."""
    if not is_int(budget):  # None (the chain) or "auto" (trees of AUTO_BUDGETS)
        return
    width = drafter.candidates_per_depth or min(budget, vocab)
    if budget * width >= 2**31:
        raise ValueError(f"budget {budget} is more than the tree builder can order over {width} tokens per depth "
                         f"(at most {(2**31 - 1) // width})")


class Target(Protocol):
    """What the engine asks of a target model (model.Qwen3 is one; docs/families.md), every tensor batch first. A
    recurrent target adds RECURRENT_HOOKS and `recurrent = True`."""
    config: Any  # a dataclass: vocab_size, and what families.position_limit reads (max_position_embeddings, ...)
    eos_ids: list[int]  # the default stop tokens
    embed_tokens: torch.nn.Module  # the drafter embeds and reads out through the target's own embedding and head
    lm_head: torch.nn.Module
    device: torch.device
    dtype: torch.dtype

    def __call__(self, tokens, input_pos, cache_pos, block_mask, logits_rows=None, feature_layers=(),
                 argmax=False, **hooks) -> tuple:
        """Tokens [N, Q] at RoPE positions input_pos into cache slots cache_pos, under a PrefixMask's BlockMask ->
        (float logits of logits_rows [N, k] (None: every row), feature_layers' outputs [N, Q, F] or None). argmax:
        (argmax [N, k], all-finite [N, k]) in place of the logits. hooks: a recurrent target's state."""

    def setup_cache(self, length: int, batch: int): ...  # caches for `batch` requests of `length` slots
    def kv_caches(self): ...  # every K and V cache [N, heads, slots, dim], which compact_kv and batch.take move


TARGET_MEMBERS = (*Target.__annotations__, "__call__", "setup_cache", "kv_caches")


# A recurrent target's members beside Target's (docs/recurrent_tree.md, "Hooks").
RECURRENT_HOOKS = ("reset_recurrent", "state_tensors", "chain_state", "tree_state", "commit_recurrent")


def recurrent_target(target) -> bool:
    """Whether a target keeps recurrent state (its `recurrent` member; absent: no), and so has the recurrent hooks."""
    return getattr(target, "recurrent", False)


def check_models(target, drafter, method: str):
    """A target with every member of Target; a DFlashDrafter for dflash and ddtree, none for ar."""
    missing = [name for name in TARGET_MEMBERS if not hasattr(target, name)]
    if missing:
        raise TypeError(f"target must meet the Target protocol (settings.Target; model.Qwen3.from_pretrained gives "
                        f"one): {kind_of(target)} has no {', '.join(missing)}")
    if drafter is not None and not isinstance(drafter, DFlashDrafter):
        raise TypeError(f"drafter must be a drafter.DFlashDrafter (DFlashDrafter.from_pretrained) or None, got "
                        f"{kind_of(drafter)}")
    for name, model in (("target", target), ("drafter", drafter)):
        if model is not None and model.dtype not in COMPUTE_DTYPES:
            raise TypeError(f"the {name}'s weights are {model.dtype}: the engine computes in "
                            f"{', '.join(str(d).removeprefix('torch.') for d in COMPUTE_DTYPES)}")
    if method == "ar" and drafter is not None:
        raise ValueError("drafter does not apply to method 'ar': pass drafter=None")
    if method != "ar" and drafter is None:
        raise ValueError(f"method {method!r} needs a drafter")


def kind_of(value) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def check_applies(method: str, greedy: bool, given, spell=lambda name: name):
    """Settings given that would change nothing are refused: a silently ignored setting reads as a wrong one."""
    # Whether each setting can change a run of `method`: the one table of which settings apply (any other does).
    applies = {"budget": method == "ddtree", "draft_temperature": method == "ddtree",
               "draft_sampling": method == "dflash" and not greedy, "draft": method != "ar",
               "denoise_steps": method != "ar", "show_tree": method != "ar", "draft_window": method != "ar",
               "top_k": not greedy, "top_p": not greedy, "min_p": not greedy}
    unused = [spell(name) for name in given if not applies.get(name, True)]
    if unused:
        mode = "greedy decoding (temperature 0)" if greedy else "sampling"
        raise ValueError(f"{', '.join(unused)} does not apply to method {method!r} with {mode}")


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, low: int, high: int = INT64_MAX) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be an integer, got {shown(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {shown(value)}")
    return int(value)


def shown(value) -> str:
    """A value as an error message quotes it: shortened, a huge integer by its digit count."""
    if is_int(value) and abs(int(value)).bit_length() > 1000:
        return f"an integer of {int(math.log10(abs(int(value)))) + 1} digits"
    return reprlib.repr(value)


def check_prompt(prompt_ids, target) -> list[int]:
    """The prompt as a list of token ids in [0, vocab): a list or tuple of ints, or a 1-D integer tensor."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.is_meta:
            raise ValueError("prompt_ids is a meta tensor: it holds no token ids")
        if prompt_ids.dim() != 1 or prompt_ids.is_floating_point() or prompt_ids.is_complex() or \
                prompt_ids.dtype == torch.bool:
            raise TypeError(f"prompt_ids must be a 1-D integer tensor, got {prompt_ids.dim()}-D {prompt_ids.dtype}")
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError("prompt_ids must be token ids, not text: encode the text with the checkpoint's tokenizer")
    if not isinstance(prompt_ids, (list, tuple)) or not all(is_int(t) for t in prompt_ids):
        raise TypeError(f"prompt_ids must be a list of int token ids, got {reprlib.repr(prompt_ids)}")
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    vocab = target.config.vocab_size
    if not all(0 <= t < vocab for t in prompt_ids):
        raise ValueError(f"prompt ids must lie in [0, {vocab}) for this target")
    return [int(t) for t in prompt_ids]


def check_stop_ids(stop_ids, vocab: int) -> set[int]:
    if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, (list, tuple, set, frozenset)) or \
            not all(is_int(t) for t in stop_ids):
        raise TypeError(f"stop_ids must be a list of int token ids, got {reprlib.repr(stop_ids)}")
    outside = sorted(t for t in stop_ids if not 0 <= t < vocab)
    if outside:  # a stop id the target cannot produce would never stop anything
        raise ValueError(f"stop ids must lie in [0, {vocab}) for this target, got {reprlib.repr(outside)}")
    return {int(t) for t in stop_ids}
