"""Compiled engines draft what eager engines draft: on the bundled pair (assets/, a trained drafter, so drafts are
accepted), every engine compiled with compile=True accepts the eager engine's tokens round for round
(stats["accepted"] equal), at budgets 4 and 64 and on the chain (the whole matrix: below). The target's verify keeps the tokens right
whatever a drafter or tree builder proposes, so a compiled path that drafts differently from eager only costs
speed, and comparing tokens alone does not see it (docs/compile.md, "Compiled engines accept what eager accepts").
Each compiled engine is built once (generate() keeps engines per models and settings) on the module's models."""

import os

import pytest

from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET, generate
from drafter import DFlashDrafter
from model import Qwen3
from text import Text

# Held-out code prompts (HumanEval-like docstrings, not in the pair's training text).
PROMPTS = (
    'from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n'
    '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
    '    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n'
    '    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n    """\n',
    'def count_vowels(word: str) -> int:\n    """Return how many vowels word holds.\n'
    '    >>> count_vowels("banana")\n    3\n    """\n',
)
SETTINGS = (("ddtree", 4), ("ddtree", 16), ("ddtree", 64), ("dflash", None), ("ar", None))
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def bundled(one_thread):
    target = Qwen3.from_pretrained(DEFAULT_TARGET, device="cpu")
    drafter = DFlashDrafter.from_pretrained(DEFAULT_DRAFT, device="cpu")
    text = Text(target.path)
    return target, drafter, [text.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def eager_runs(bundled):
    """{setting: [the eager run of each prompt]}, filled as the tests ask."""
    return {}


def run(bundled, method, budget, compile):
    target, drafter, prompts = bundled
    return [generate(target, None if method == "ar" else drafter, p, method=method, budget=budget,
                     max_new_tokens=NEW_TOKENS, stop_ids=[], compile=compile) for p in prompts]


# The suite compiles the extremes of the tree's size and the chain (compile=True). The whole matrix, budget 16 and
# ar added, each setting compiled with compile=True and with "max-autotune" (frozen, autotuned graphs: one to three
# minutes of compiling each here), is a separate run: DDTREE_ACCEPTANCE_MATRIX=full python -m pytest -n 0
# tests/test_compiled_acceptance.py (docs/compile.md). In the suite, max-autotune is checked the same way, round for
# round, by test_speculative's max-autotune test at B = 3 (conftest's compiled_equals_eager compares
# stats["accepted"]): a few-row context append, where inductor's own GEMM template wins on the CPU (docs/compile.md,
# "Weight views in frozen graphs"); ar's compiled tokens by test_generate's compiled test.
SUITE_SETTINGS = (("ddtree", 4), ("ddtree", 64), ("dflash", None))
FULL = os.environ.get("DDTREE_ACCEPTANCE_MATRIX") == "full"
CASES = ([(method, budget, mode) for mode in (True, "max-autotune") for method, budget in SETTINGS] if FULL
         else [(method, budget, True) for method, budget in SUITE_SETTINGS])


@pytest.mark.parametrize("method,budget,compile", CASES)
def test_compiled_engines_accept_what_eager_accepts(bundled, eager_runs, method, budget, compile):
    if (method, budget) not in eager_runs:
        eager_runs[method, budget] = run(bundled, method, budget, False)
    eager = eager_runs[method, budget]
    if method != "ar":  # drafts are accepted: a drafter or tree that goes wrong would show
        assert sum(sum(r.stats["accepted"]) for r in eager) > 1.5 * sum(r.stats["rounds"] for r in eager)
    for e, c in zip(eager, run(bundled, method, budget, compile)):
        assert c.tokens == e.tokens
        assert c.stats["accepted"] == e.stats["accepted"]
