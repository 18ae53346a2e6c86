"""A drafter's options beyond plain layers (drafter_options.py): read only for a config that sets them, each hostile
value refused with one line naming the field, and a plain config (the bundled drafter's, a Qwen3 drafter's
full-attention layer_types) read to DFlashConfig's defaults without importing the module."""

import json
import os

import pytest

import families
from drafter import DFlashConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "assets", "tiny-draft", "config.json")) as f:
    BUNDLED = json.load(f)  # two layers
LAYERS = BUNDLED["num_hidden_layers"]


@pytest.fixture
def asked(monkeypatch):
    """The family modules families.py hands over to while the test runs."""
    names, family = [], families.family
    monkeypatch.setattr(families, "family", lambda name: names.append(name) or family(name))
    return names


PLAIN = {
    "bundled": {},
    "Qwen3Config's own fields": dict(layer_types=["full_attention"] * LAYERS, use_sliding_window=False,
                                     sliding_window=None, max_window_layers=LAYERS),
    "is_causal null or false": dict(is_causal=False),
}


@pytest.mark.parametrize("extra", PLAIN.values(), ids=PLAIN.keys())
def test_a_plain_drafter_config_reads_without_the_options_module(asked, extra):
    c = DFlashConfig.from_dict(dict(BUNDLED, **extra))
    assert "drafter_options" not in asked
    assert (c.attention, c.output_multiplier, c.input_embedding_scale, c.logit_softcap) == ((), 1.0, 1.0, None)
    assert c.mask_kinds == [(None, False)]


SET = {
    "causal rows": (dict(is_causal=True), dict(attention=((None, True),) * LAYERS)),
    "a sliding layer": (dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True,
                             sliding_window=6), dict(attention=((6, True), (None, False)))),
    "a sliding layer, no window": (dict(layer_types=["full_attention", "sliding_attention"]),
                                   dict(attention=((None, False), (None, True)))),
    "softcap and scales": (dict(final_logit_softcapping=30, dflash_config=dict(BUNDLED["dflash_config"],
                                                                               output_multiplier=0.5,
                                                                               input_embedding_scale=16)),
                           dict(logit_softcap=30.0, output_multiplier=0.5, input_embedding_scale=16.0)),
    "multiplier 1 given": (dict(output_multiplier=1), dict(output_multiplier=1.0)),
}


@pytest.mark.parametrize("extra, expected", SET.values(), ids=SET.keys())
def test_options_a_config_sets_are_read_by_the_module(asked, extra, expected):
    c = DFlashConfig.from_dict(dict(BUNDLED, **extra))
    assert "drafter_options" in asked
    assert {k: getattr(c, k) for k in expected} == expected


HOSTILE = {
    "is_causal 0": (dict(is_causal=0), "is_causal must be true, false or null"),
    "is_causal a string": (dict(is_causal="yes"), "is_causal must be true, false or null"),
    "layer_types one short": (dict(layer_types=["full_attention"] * (LAYERS - 1)), "layer_types must list"),
    "layer_types a string": (dict(layer_types="full_attention"), "layer_types must list"),
    "an unknown layer type": (dict(layer_types=["full_attention", "chunked_attention"]), "layer_types must list"),
    "sliding without layer_types": (dict(use_sliding_window=True, sliding_window=4),
                                    "use_sliding_window=true without layer_types"),
    "window 0": (dict(layer_types=["sliding_attention"] * LAYERS, use_sliding_window=True, sliding_window=0),
                 "sliding_window must be a positive integer"),
    "multiplier null": (dict(output_multiplier=None), "output_multiplier must be a finite nonzero number"),
    "multiplier 0": (dict(output_multiplier=0), "output_multiplier must be a finite nonzero number"),
    "embedding scale true": (dict(input_embedding_scale=True), "input_embedding_scale must be a finite nonzero"),
    "softcap negative": (dict(final_logit_softcapping=-1), "final_logit_softcapping must be a non-negative"),
    "softcap a string": (dict(final_logit_softcapping="30"), "final_logit_softcapping must be a non-negative"),
}


@pytest.mark.parametrize("extra, message", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_option_is_one_error_naming_the_field(extra, message):
    with pytest.raises(ValueError, match=message) as e:
        DFlashConfig.from_dict(dict(BUNDLED, **extra), "draft/config.json")
    assert str(e.value).startswith("draft/config.json: ") and "\n" not in str(e.value)
