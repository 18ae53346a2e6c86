"""Bad input and hostile conditions: every mistake is one clear error (a ValueError / TypeError from the API, one
`error:` line and exit 2 from the CLI), never a traceback or a silently wrong answer; statistics count what was
emitted; Ctrl-C, closed pipes and a closed stdout end cleanly. The property tests drive generate() and the CLI
with generated argument values and corrupt checkpoint files at generated offsets."""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ddtree import DEFAULT_DRAFT, generate, generate_batch
from drafter import DFlashDrafter
from model import Qwen3
from cli import grouped
from settings import Speculation, Target, check_applies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from conftest import PAIR_VOCAB, assert_one_error_line, cli, load_pair  # noqa: E402
from checkpoints import dflash_config, random_dflash_weights, save_checkpoint  # noqa

VOCAB = PAIR_VOCAB
BUNDLED_TARGET = os.path.join(ROOT, "assets", "tiny-target")


@pytest.fixture(scope="module")
def files(random_pair_files):
    return random_pair_files


@pytest.fixture(scope="module")
def pair(files):
    return load_pair(files)


def greedy_ar(target, prompt, n):
    return generate(target, None, prompt, method="ar", max_new_tokens=n, stop_ids=[]).tokens


# ---- the four bugs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-40, 1e-46, 5e-324])
def test_vanishing_temperature_samples_the_argmax(pair, temperature):
    """logits / 1e-40 overflows float32: the law is the argmax's, never NaN and token 0."""
    target, drafter = pair
    prompt = [3, 4, 5]
    ar = greedy_ar(target, prompt, 12)
    for method in ("ar", "ddtree", "dflash"):
        res = generate(target, None if method == "ar" else drafter, prompt, method=method, max_new_tokens=12,
                       temperature=temperature, seed=1, stop_ids=[])
        assert res.tokens == ar, method


def test_vanishing_draft_temperature_keeps_drafting(pair):
    """A draft temperature of 1e-40 concentrates the tree on the drafter's argmax path: it still accepts drafts."""
    target, drafter = pair
    prompt = [3, 4, 5]
    base = generate(target, drafter, prompt, method="ddtree", budget=4, max_new_tokens=30, stop_ids=[])
    sharp = generate(target, drafter, prompt, method="ddtree", budget=4, max_new_tokens=30, stop_ids=[],
                     speculation=Speculation(draft_temperature=1e-40))
    assert sharp.tokens == base.tokens == greedy_ar(target, prompt, 30)
    assert sharp.stats["tau"] > 1.0, sharp.stats


def test_non_finite_probabilities_are_an_error(pair, monkeypatch):
    """Warped probabilities that are NaN (here planted) stop generation with an error instead of a token 0."""
    target, drafter = pair
    import ddtree as engine_module
    import sampler
    nan = lambda logits, s: torch.full_like(logits, float("nan"))
    monkeypatch.setattr(engine_module, "warp_probs", nan)
    monkeypatch.setattr(sampler, "warp_probs", nan)  # the target's draws (sampler.sample_rows)
    for method in ("ar", "ddtree"):
        with pytest.raises(ValueError, match="non-finite"):
            generate(target, None if method == "ar" else drafter, [3, 4], method=method, max_new_tokens=6,
                     temperature=0.8, seed=0, stop_ids=[])


def with_layer_ids(src, dst, ids, swap_fc_blocks):
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        c = json.load(f)
    c["dflash_config"]["target_layer_ids"] = ids
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(c, f)
    if swap_fc_blocks:
        w = load_file(os.path.join(dst, "model.safetensors"))
        fc = w["fc.weight"]
        H = fc.shape[0]
        w["fc.weight"] = torch.cat([fc[:, H:], fc[:, :H]], dim=1).contiguous()
        save_file(w, os.path.join(dst, "model.safetensors"))
    return DFlashDrafter.from_pretrained(dst, device="cpu")


def test_target_layer_ids_are_read_in_their_listed_order(pair, files, tmp_path):
    """ids [2, 0] with fc's column blocks swapped is the same drafter as ids [0, 2]: same tokens, same acceptance;
    [2, 0] without the swap is a different drafter."""
    target, drafter = pair
    swapped = with_layer_ids(files["draft"], str(tmp_path / "swapped"), [2, 0], swap_fc_blocks=True)
    reordered = with_layer_ids(files["draft"], str(tmp_path / "reordered"), [2, 0], swap_fc_blocks=False)
    same, different = 0, 0
    for prompt in ([3, 4, 5], [7, 2, 9, 9, 1], [11] * 6):
        for method, budget in (("ddtree", 6), ("dflash", None)):
            a, b, c = (generate(target, d, prompt, method=method, budget=budget, max_new_tokens=30, stop_ids=[])
                       for d in (drafter, swapped, reordered))
            assert a.tokens == b.tokens == c.tokens  # lossless whatever the drafter
            assert a.stats["path_lengths"] == b.stats["path_lengths"]
            same += 1
            different += a.stats["path_lengths"] != c.stats["path_lengths"]
    assert different > 0  # the order is not ignored


def test_repeated_target_layer_ids_are_supported(pair, files, tmp_path):
    target, _ = pair
    src = str(tmp_path / "src")
    _, tc = None, json.load(open(os.path.join(files["target"], "config.json")))
    dc = dflash_config(tc, layers=1, block_size=4, target_layer_ids=[1, 1])
    save_checkpoint(src, dc, random_dflash_weights(dc, seed=2, std=0.35))
    drafter = DFlashDrafter.from_pretrained(src, device="cpu")
    assert drafter.fc.weight.shape[1] == 2 * tc["hidden_size"]
    res = generate(target, drafter, [3, 4, 5], method="ddtree", budget=5, max_new_tokens=20, stop_ids=[])
    assert res.tokens == greedy_ar(target, [3, 4, 5], 20)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_stats_count_only_emitted_tokens(pair, method):
    target, drafter = pair
    d = None if method == "ar" else drafter
    for n in (1, 2, 3, 17):
        res = generate(target, d, [3, 4, 5], method=method, max_new_tokens=n, stop_ids=[])
        s = res.stats
        assert len(res.tokens) == s["new_tokens"] == n
        assert sum(s["accepted"]) == n - 1 and len(s["accepted"]) == len(s["path_lengths"]) == s["rounds"]
        assert all(1 <= a <= v for a, v in zip(s["accepted"], s["path_lengths"]))
        assert s["tau"] == (sum(s["accepted"]) / s["rounds"] if s["rounds"] else 0.0)
    full = generate(target, d, [3, 4, 5], method=method, max_new_tokens=40, stop_ids=[]).tokens
    stop = full[9]
    res = generate(target, d, [3, 4, 5], method=method, max_new_tokens=40, stop_ids=[stop])
    assert res.tokens[-1] == stop and sum(res.stats["accepted"]) == len(res.tokens) - 1


def test_fresh_seed_leaves_torch_global_rng_alone(pair):
    target, drafter = pair
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = generate(target, drafter, [3, 4], method="ddtree", budget=4, max_new_tokens=8,
                 temperature=1.0)
    assert torch.equal(torch.rand(3), expected)
    b = generate(target, drafter, [3, 4], method="ddtree", budget=4, max_new_tokens=8,
                 temperature=1.0,
                 seed=a.stats["seed"])
    assert b.tokens == a.tokens  # the drawn seed is reported and reproduces the run


# ---- the Python API's argument checks --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prompt_ids=[1.0, 2.0]), TypeError, "list of int token ids"),
    (dict(prompt_ids=[[1, 2], [3]]), TypeError, "list of int token ids"),
    (dict(prompt_ids="hello"), TypeError, "not text"),
    (dict(prompt_ids=torch.tensor([1.0, 2.0])), TypeError, "1-D integer tensor"),
    (dict(prompt_ids=torch.tensor([[1, 2]])), TypeError, "1-D integer tensor"),
    (dict(prompt_ids=[True, 2]), TypeError, "list of int token ids"),
    (dict(prompt_ids=[2**70]), ValueError, "prompt ids must lie in"),
    (dict(stop_ids=5), TypeError, "stop_ids must be a list"),
    (dict(stop_ids=[1.5]), TypeError, "stop_ids must be a list"),
    (dict(stop_ids=[-5, 10**12]), ValueError, r"stop ids must lie in \[0, 16\).* got \[-5, 1000000000000\]"),
    (dict(prompt_ids=torch.tensor([1, 2], device="meta")), ValueError, "meta tensor"),
    (dict(seed=10**5000), ValueError, "seed must be in .* got an integer of 5001 digits"),
    (dict(method="ar"), ValueError, "drafter does not apply to method 'ar'"),
    (dict(seed=2**63), ValueError, "seed must be in"),
    (dict(seed=-1), ValueError, "seed must be in"),
    (dict(compile="yes"), TypeError, "compile must be True, False or 'max-autotune'"),
    (dict(on_tokens=5), TypeError, "on_tokens"),
    (dict(max_new_tokens=10**30), ValueError, "max_new_tokens must be in"),
    (dict(temperature="1"), ValueError, "temperature must be a real number"),
    (dict(method="ar", budget=8), ValueError, "budget does not apply to method 'ar'"),
    (dict(method="dflash", budget=8), ValueError, "budget does not apply to method 'dflash'"),
    (dict(method="ddtree", draft_sampling=True, temperature=1.0), ValueError, "draft_sampling does not apply"),
    (dict(method="dflash", draft_sampling=True), ValueError, "draft_sampling does not apply"),
    (dict(method="ar", show_tree=True), ValueError, "show_tree does not apply"),
    (dict(method="ar", denoise_steps=2), ValueError, "denoise_steps does not apply"),
    (dict(method="ddtree", denoise_steps=10**9), ValueError, "exceeds the drafter's 4 draft positions"),
    (dict(method="dflash", draft_temperature=0.5), ValueError, "draft_temperature does not apply"),
    (dict(top_k=5), ValueError, "top_k does not apply .* greedy"),
    (dict(top_p=0.5, min_p=0.1), ValueError, "top_p, min_p does not apply"),
    (dict(budget=8, speculation=Speculation(budget=4)), ValueError, "budget is given twice"),
    (dict(speculation=dict(budget=4)), TypeError, "speculation must be a settings.Speculation"),
    (dict(speculation=Speculation(show_tree=1)), TypeError, "show_tree must be True or False"),
])
def test_bad_api_arguments_say_what_is_expected(pair, kwargs, error, message):
    target, drafter = pair
    kwargs = dict(dict(prompt_ids=[1, 2], method="ddtree", max_new_tokens=4), **kwargs)
    with pytest.raises(error, match=message):
        generate(target, drafter, **grouped(kwargs))


def test_grouped_settings_are_the_api_arguments_and_a_setting_given_twice_is_refused():
    assert grouped(dict(temperature=0.5, top_p=0.9, show_tree=True, denoise_steps=2, budget=4, seed=1)) == dict(
        temperature=0.5, top_p=0.9, budget=4, seed=1, speculation=Speculation(denoise_steps=2, show_tree=True))
    assert grouped(dict(budget=4)) == dict(budget=4)
    with pytest.raises(ValueError, match="denoise_steps and speculation are both given"):
        grouped(dict(denoise_steps=2, speculation=Speculation()))


class OnlyTheProtocol:
    """A target that has the Target protocol's members and nothing else: what generate() may ask of any family's
    model (settings.Target), here forwarded to a Qwen3."""

    def __init__(self, model):
        self._model = model
        for name in Target.__annotations__:
            setattr(self, name, getattr(model, name))

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def setup_cache(self, length, batch):
        return self._model.setup_cache(length, batch)

    def kv_caches(self):
        return self._model.kv_caches()


def test_any_object_meeting_the_target_protocol_is_a_target(pair):
    target, drafter = pair
    kw = dict(budget=8, max_new_tokens=12, stop_ids=[])
    for method, sampled in (("ddtree", dict(temperature=0.7, seed=2)), ("dflash", {}), ("ar", {})):
        d = None if method == "ar" else drafter
        kw_m = {k: v for k, v in kw.items() if method == "ddtree" or k != "budget"}
        assert generate(OnlyTheProtocol(target), d, [3, 4], method=method, **kw_m, **sampled).tokens == \
            generate(target, d, [3, 4], method=method, **kw_m, **sampled).tokens


def test_models_of_the_wrong_kind_say_which_argument(pair):
    target, drafter = pair
    with pytest.raises(TypeError, match=r"target must meet the Target protocol .*: None has no config, eos_ids, "):
        generate(None, drafter, [1, 2], max_new_tokens=4)
    missing_head = OnlyTheProtocol(target)
    del missing_head.lm_head
    with pytest.raises(TypeError, match=r"Target protocol .*: a OnlyTheProtocol has no lm_head$"):
        generate(missing_head, drafter, [1, 2], max_new_tokens=4)
    with pytest.raises(TypeError, match="drafter must be a drafter.DFlashDrafter .*, got a Qwen3"):
        generate(target, target, [1, 2], max_new_tokens=4)


def test_weights_of_a_type_the_engine_cannot_compute_in_are_refused(files):
    target = Qwen3.from_pretrained(files["target"], device="cpu").to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="the target's weights are torch.float8_e4m3fn"):
        generate(target, None, [1, 2], method="ar", max_new_tokens=4)


def test_numpy_numbers_are_numbers(pair):
    target, drafter = pair
    kw = dict(method="ddtree", budget=4, max_new_tokens=8, stop_ids=[])
    plain = generate(target, drafter, [3, 4], temperature=0.5, top_k=3, top_p=0.75, seed=1, **kw)
    numpy = generate(target, drafter, [3, 4], temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.75),
                     seed=np.int64(1), **kw)
    assert numpy.tokens == plain.tokens


def test_integer_tensors_and_tuples_are_prompts(pair):
    target, _ = pair
    ref = greedy_ar(target, [3, 4, 5], 5)
    for prompt in (torch.tensor([3, 4, 5]), torch.tensor([3, 4, 5], dtype=torch.int32), (3, 4, 5)):
        assert generate(target, None, prompt, method="ar", max_new_tokens=5, stop_ids=[]).tokens == ref


# ---- concurrent callers ----------------------------------------------------------------------------------------


def test_a_call_from_a_callback_on_the_same_models_is_refused(pair):
    """The models' caches hold the running requests: generate() from on_tokens or on_result on the same models is
    one clear RuntimeError, and the models serve the next call as before."""
    target, drafter = pair
    again = lambda *_: generate(target, None, [5], method="ar", max_new_tokens=2)
    with pytest.raises(RuntimeError, match="already running on these models in this thread"):
        generate(target, drafter, [3, 4], budget=4, max_new_tokens=6, on_tokens=again)
    with pytest.raises(RuntimeError, match="already running on these models in this thread"):
        generate_batch(target, drafter, [[3, 4], [5, 6, 7]], budget=4, max_new_tokens=6, stop_ids=[],
                       on_result=again)
    assert generate(target, None, [3, 4], method="ar", max_new_tokens=6, stop_ids=[]).tokens == \
        greedy_ar(target, [3, 4], 6)


def test_two_threads_on_the_same_models_take_turns(pair):
    """A second thread's run on the models waits until the first returns: both get their lone runs' tokens."""
    target, drafter = pair
    kw = dict(method="ddtree", budget=4, max_new_tokens=20, stop_ids=[])
    alone = {p: generate(target, drafter, list(p), **kw).tokens for p in ((3, 4), (9, 8, 7))}
    results, errors = {}, []

    def run(prompt, on_tokens=None):
        try:
            results[prompt] = generate(target, drafter, list(prompt), on_tokens=on_tokens, **kw).tokens
        except Exception as e:  # noqa: BLE001 (the test reports it)
            errors.append(e)

    other = threading.Thread(target=run, args=((9, 8, 7),))

    def start_the_other_mid_run(new):  # the first run's first tokens: the other thread starts, and waits
        if not other.is_alive() and not other.ident:
            other.start()
            time.sleep(0.3)

    first = threading.Thread(target=run, args=((3, 4), start_the_other_mid_run))
    first.start()
    first.join(60)
    other.join(60)
    assert not errors and results == alone


# ---- property test: generate() with generated arguments --------------------------------------------------------


def applies(setting: str, method: str, greedy: bool) -> bool:
    """Whether settings.check_applies lets `setting` through for this method and sampling."""
    try:
        check_applies(method, greedy, [setting])
    except ValueError:
        return False
    return True


def junk():
    return st.sampled_from([None, "3", 2.5, float("nan"), float("inf"), -float("inf"), -1, 0, 2**64, True, [], {},
                            10**400])


VALID = dict(
    method=st.sampled_from(["ar", "dflash", "ddtree"]),
    budget=st.one_of(st.none(), st.integers(1, 40)),
    max_new_tokens=st.integers(1, 12),
    temperature=st.one_of(st.just(0.0), st.floats(1e-45, 5.0), st.integers(1, 3)),
    top_k=st.integers(0, 20),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    stop_ids=st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=3)),
    draft_temperature=st.one_of(st.just(1.0), st.floats(1e-40, 10.0)),
    draft_sampling=st.booleans(),
    denoise_steps=st.integers(1, 3),
    show_tree=st.booleans(),
)
BAD = dict(method=st.sampled_from(["beam", "", None, 3, "AR"]), max_new_tokens=st.just(10**6),
           prompt_ids=st.one_of(st.lists(st.integers(-3, 2**64), max_size=4), st.text(max_size=5),
                                st.lists(st.floats(), min_size=1, max_size=3), st.just([[1, 2]])))


@st.composite
def generate_arguments(draw):
    """(prompt, kwargs): valid values, settings that do not apply dropped 3 times in 4, and in about half of the
    examples one argument replaced by a wrong type, a wrong value or a huge number."""
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
    kwargs = draw(st.fixed_dictionaries({"method": VALID["method"]},
                                        optional={k: v for k, v in VALID.items() if k != "method"}))
    if draw(st.integers(0, 3)):
        greedy = kwargs.get("temperature", 0) == 0
        kwargs = {k: v for k, v in kwargs.items() if applies(k, kwargs.get("method", "ddtree"), greedy)}
    bad = draw(st.sampled_from([None] * 12 + sorted(VALID) + sorted(BAD)))
    if bad is not None:
        value = draw(st.one_of(junk(), BAD[bad]) if bad in BAD else junk())
        if bad == "prompt_ids":
            prompt = value
        else:
            kwargs[bad] = value
    return prompt, kwargs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=generate_arguments())
def test_generate_with_generated_arguments(pair, arguments):
    """Either a result that keeps every invariant, or a ValueError / TypeError with a message: nothing else."""
    target, drafter = pair
    prompt, kwargs = arguments
    try:
        res = generate(target, None if kwargs["method"] == "ar" else drafter, prompt, **grouped(kwargs))
    except (ValueError, TypeError) as e:
        assert str(e)
        event(type(e).__name__)
        return
    s = res.stats
    event(f"generated ({s['method']})")
    assert 1 <= len(res.tokens) == s["new_tokens"] <= kwargs.get("max_new_tokens", 256)
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in res.tokens)
    assert sum(s["accepted"]) == s["new_tokens"] - 1 and s["rounds"] == len(s["accepted"])
    stop = set(target.eos_ids if kwargs.get("stop_ids") is None else kwargs["stop_ids"])
    assert not stop & set(res.tokens[:-1])
    if (kwargs.get("temperature") or 0) == 0 and s["method"] != "ar":
        assert res.tokens == generate(target, None, prompt, method="ar", max_new_tokens=s["new_tokens"],
                                      stop_ids=sorted(stop)).tokens


# ---- checkpoint files ------------------------------------------------------------------------------------------


def copy_target(files, tmp_path, name="t"):
    dst = tmp_path / name
    shutil.copytree(files["target"], dst)
    return dst


def sharded_target(files, tmp_path):
    """The same target in two shards with an index."""
    dst = copy_target(files, tmp_path, "sharded")
    w = load_file(str(dst / "model.safetensors"))
    os.remove(dst / "model.safetensors")
    names = sorted(w)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: w[k] for k in keys}, str(dst / shard))
    index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def edit_config(path, edit):
    c = json.loads((path / "config.json").read_text())
    edit(c)
    (path / "config.json").write_text(json.dumps(c))


def edit_tensors(path, edit):
    w = load_file(str(path / "model.safetensors"))
    edit(w)
    save_file(w, str(path / "model.safetensors"))


CORRUPTIONS = {
    "config not JSON": (lambda p: (p / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    "config an array": (lambda p: (p / "config.json").write_text("[1, 2]"), "expected a JSON object"),
    "config not UTF-8": (lambda p: (p / "config.json").write_bytes(b"\xff\xfe{}"), "not valid JSON"),
    "hidden_size a string": (lambda p: edit_config(p, lambda c: c.update(hidden_size="64")),
                             "hidden_size must be a positive integer"),
    "negative layers": (lambda p: edit_config(p, lambda c: c.update(num_hidden_layers=-1)), "num_hidden_layers"),
    "rope_theta a string": (lambda p: edit_config(p, lambda c: c.update(rope_theta="1e6")), "rope_theta"),
    "rms_norm_eps zero": (lambda p: edit_config(p, lambda c: c.update(rms_norm_eps=0)), "rms_norm_eps"),
    "tie a string": (lambda p: edit_config(p, lambda c: c.update(tie_word_embeddings="no")), "tie_word_embeddings"),
    "rope_parameters a list": (lambda p: edit_config(p, lambda c: c.update(rope_parameters=[1])), "rope_parameters"),
    "eos a string": (lambda p: (p / "generation_config.json").write_text('{"eos_token_id": "x"}'), "eos_token_id"),
    "empty safetensors": (lambda p: (p / "model.safetensors").write_bytes(b""), "not a readable safetensors file"),
    "garbage safetensors": (lambda p: (p / "model.safetensors").write_bytes(os.urandom(1000)),
                            "not a readable safetensors file"),
    "huge header length": (lambda p: flip(p / "model.safetensors", 7, 0x7F), "not a readable safetensors file"),
    "int32 weights": (lambda p: edit_tensors(p, lambda w: w.update({k: v.to(torch.int32) for k, v in w.items()})),
                      "not floating-point"),
    "wrong shape": (lambda p: edit_tensors(p, lambda w: w.update({"model.norm.weight": torch.ones(3)})), "shape"),
    "missing tensor": (lambda p: edit_tensors(p, lambda w: w.pop("model.norm.weight")), "lacks"),
    "no weights": (lambda p: os.remove(p / "model.safetensors"), "no model.safetensors"),
    # hostile files: refused from what the files hold before anything is allocated or built
    "config nested 100000 deep": (lambda p: (p / "config.json").write_text('{"x": ' + "[" * 100000 + "]" * 100000 +
                                                                          "}"), "config.json: not valid JSON"),
    "config a 5000-digit integer": (lambda p: (p / "config.json").write_text('{"hidden_size": ' + "9" * 5000 + "}"),
                                    "config.json: not valid JSON"),
    "generation_config nested": (lambda p: (p / "generation_config.json").write_text("[" * 100000 + "]" * 100000),
                                 "generation_config.json: not valid JSON"),
    "layers past the weights": (lambda p: edit_config(p, lambda c: c.update(num_hidden_layers=1000000)),
                                r"config.json: num_hidden_layers=1000000, but model.safetensors holds 3 layers"),
    "heads past the weights": (lambda p: edit_config(p, lambda c: c.update(num_attention_heads=2**30)),
                               "self_attn.o_proj.weight' has shape"),
    "heads past any model": (lambda p: edit_config(p, lambda c: c.update(num_attention_heads=2**40)),
                             "config.json: num_attention_heads=1099511627776 is past"),
    "sizes past int64": (lambda p: edit_config(p, lambda c: c.update(num_attention_heads=2**30, head_dim=2**30)),
                         "config.json: its sizes make tensors too large"),
}


def flip(file, offset, value):
    data = bytearray(file.read_bytes())
    data[offset] = value
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupt_checkpoints_are_one_clear_error(files, tmp_path, name):
    corrupt, message = CORRUPTIONS[name]
    path = copy_target(files, tmp_path)
    corrupt(path)
    with pytest.raises(ValueError, match=message):
        Qwen3.from_pretrained(str(path), device="cpu")


def stored_twice(path):
    """The second shard also holds a tensor of the first (zeroed): which one counts would be the reading order's."""
    first, second = (str(path / f"model-0000{i}-of-00002.safetensors") for i in (1, 2))
    name, tensor = next(iter(load_file(first).items()))
    save_file({**load_file(second), name: torch.zeros_like(tensor)}, second)


@pytest.mark.parametrize("edit, message", [
    (dict(num_hidden_layers=1000000), "config.json: num_hidden_layers=1000000, but model.safetensors holds 2 layers"),
    (dict(block_size=10**9), "config.json: block_size=1000000000 is past max_position_embeddings=4096"),
])
def test_drafter_sizes_past_its_files_or_positions_are_refused(files, tmp_path, edit, message):
    path = tmp_path / "d"
    shutil.copytree(files["draft"], path)
    edit_config(path, lambda c: c.update(edit))
    with pytest.raises(ValueError, match=message):
        DFlashDrafter.from_pretrained(str(path), device="cpu")


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: os.remove(p / "model-00002-of-00002.safetensors"), "which is missing"),
    (lambda p: (p / "model.safetensors.index.json").write_text('{"metadata": {}}'), "no weight_map"),
    (lambda p: (p / "model.safetensors.index.json").write_text("{"), "not valid JSON"),
    (lambda p: (p / "model-00001-of-00002.safetensors").write_bytes(b"\x00" * 8), "not a readable"),
    (lambda p: stored_twice(p), "is also stored in"),
])
def test_corrupt_shards_are_one_clear_error(files, tmp_path, corrupt, message):
    path = sharded_target(files, tmp_path)
    Qwen3.from_pretrained(str(path), device="cpu")  # intact, it loads
    corrupt(path)
    with pytest.raises(ValueError, match=message):
        Qwen3.from_pretrained(str(path), device="cpu")


def index_pointing(path, shard: str, to: str):
    """The index of a sharded target with `shard`'s entries naming `to` instead."""
    file = path / "model.safetensors.index.json"
    index = json.loads(file.read_text())
    index["weight_map"] = {k: to if v == shard else v for k, v in index["weight_map"].items()}
    file.write_text(json.dumps(index))


@pytest.mark.parametrize("outside", ["absolute", "parent", "parent inside", "backslashes"])
def test_an_index_naming_files_outside_its_directory_is_refused(files, tmp_path, outside):
    """A weight_map entry that leaves the checkpoint's directory is refused, even where the file it names is a
    valid shard."""
    path = sharded_target(files, tmp_path)
    shard = "model-00002-of-00002.safetensors"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(path / shard, elsewhere / shard)
    to = {"absolute": str(elsewhere / shard), "parent": f"../elsewhere/{shard}",
          "parent inside": f"sub/../../elsewhere/{shard}", "backslashes": f"..\\elsewhere\\{shard}"}[outside]
    index_pointing(path, shard, to)
    with pytest.raises(ValueError, match="model.safetensors.index.json: weight_map names .*, which is not a file "
                                         "inside the checkpoint's directory"):
        Qwen3.from_pretrained(str(path), device="cpu")


def test_shards_linked_from_elsewhere_and_in_subdirectories_load(files, tmp_path):
    """The Hub's cache links each file of a snapshot to a blob outside it: the index's names are judged, not where
    they resolve to; a name below the directory is inside it."""
    path = sharded_target(files, tmp_path)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for i, shard in enumerate(("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")):
        shutil.move(path / shard, blobs / f"blob{i}")
        os.symlink(blobs / f"blob{i}", path / shard)
    (path / "sub").mkdir()
    os.rename(path / "model-00002-of-00002.safetensors", path / "sub" / "model-00002-of-00002.safetensors")
    index_pointing(path, "model-00002-of-00002.safetensors", "sub/model-00002-of-00002.safetensors")
    target = Qwen3.from_pretrained(str(path), device="cpu")
    whole = Qwen3.from_pretrained(files["target"], device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), whole.state_dict().values()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_truncated_or_flipped_weights_never_escape_as_another_error(files, tmp_path_factory, data):
    """Truncation anywhere is an error; a flipped byte is an error or (data bytes, an unused metadata byte) a
    model that loads: never another exception type."""
    path = copy_target(files, tmp_path_factory.mktemp("cut"))
    file = path / "model.safetensors"
    size = file.stat().st_size
    header = 8 + int.from_bytes(file.read_bytes()[:8], "little")
    if data.draw(st.booleans(), label="truncate"):
        file.write_bytes(file.read_bytes()[:data.draw(st.integers(0, size - 1), label="keep")])
        with pytest.raises(ValueError, match="not a readable safetensors file|lacks|shape"):
            Qwen3.from_pretrained(str(path), device="cpu")
    else:
        flip(file, data.draw(st.integers(0, header - 1), label="offset"), data.draw(st.integers(0, 255), label="byte"))
        try:
            Qwen3.from_pretrained(str(path), device="cpu")
        except ValueError as e:
            assert str(e)


@pytest.mark.parametrize("file, eos", [("generation_config.json", 10**30), ("generation_config.json", [1, VOCAB]),
                                       ("config.json", VOCAB + 7)])
def test_stop_ids_the_target_cannot_produce_are_left_out_with_a_warning(files, tmp_path, file, eos):
    path = copy_target(files, tmp_path)
    edit = json.loads((path / file).read_text())
    edit["eos_token_id"] = eos
    (path / file).write_text(json.dumps(edit))
    with pytest.warns(UserWarning, match=f"{file}: eos_token_id .* not below vocab_size {VOCAB} .*left out"):
        target = Qwen3.from_pretrained(str(path), device="cpu")
    assert target.eos_ids and all(i < VOCAB for i in target.eos_ids)
    assert len(generate(target, None, [2, 3], method="ar", max_new_tokens=3).tokens) <= 3


def test_cli_warns_of_a_stop_id_the_target_cannot_produce(text_copy):
    (text_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**30}))
    code, out, err = cli("--target", str(text_copy), "--method", "ar", "--prompt", "hi", "--max-new-tokens", "3")
    assert code == 0 and err.startswith("warning: ") and "generation_config.json: eos_token_id" in err, err


def test_meta_and_unknown_devices_are_refused(files):
    for device in ("meta", "nonsense", "cuda:99" if not torch.cuda.is_available() else "meta"):
        with pytest.raises(ValueError, match="is not usable here"):
            Qwen3.from_pretrained(files["target"], device=device)
    for dtype in (torch.int32, torch.float8_e4m3fn):  # float8 is floating point, but nothing computes in it here
        with pytest.raises(ValueError, match="not one the engine computes in"):
            Qwen3.from_pretrained(files["target"], device="cpu", dtype=dtype)


# ---- the command line ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--method", "ar", "--target", "/no/such/dir"], "no such directory"),
    (["--method", "ar", "--prompt", ""], "prompt is empty"),
    (["--method", "ar", "--temperature", "-1"], "temperature"),
    (["--method", "ar", "--top-p", "0"], "--top-p must be in (0, 1]"),  # the CLI speaks in flags
    (["--method", "ar", "--top-p", "1.01"], "--top-p must be in (0, 1]"),
    (["--budget", "1.5"], "--budget must be an integer"),
    (["--budget", "0"], "budget"),
    (["--max-autotune", "--no-compile"], "--max-autotune compiles"),
    (["--budget", "-3"], "budget"),
    (["--method", "ar", "--max-new-tokens", "100000"], "max_position_embeddings"),
    (["--method", "ar", "--top-k", "x"], "--top-k must be an integer"),
    (["--method", "ar", "--dtype", "int8"], "unknown dtype"),
    (["--method", "dflash", "--budget", "4"], "--budget does not apply to method 'dflash'"),
    (["--method", "ar", "--budget", "4"], "--budget does not apply to method 'ar'"),
    (["--method", "ar", "--show-tree"], "--show-tree does not apply"),
    (["--method", "ar", "--draft", "x"], "--draft does not apply"),
    (["--method", "ar", "--denoise-steps", "2"], "--denoise-steps does not apply"),
    (["--draft-sampling", "--temperature", "1"], "--draft-sampling does not apply to method 'ddtree'"),
    (["--method", "dflash", "--draft-sampling"], "--draft-sampling does not apply to method 'dflash' with greedy"),
    (["--method", "dflash", "--draft-temperature", "2"], "--draft-temperature does not apply"),
    (["--top-k", "4"], "--top-k does not apply"),
    (["--top-p", "0.5"], "--top-p does not apply"),
    (["--min-p", "0.5"], "--min-p does not apply"),
    (["--seed", str(2**64)], "--seed must be in"),
    (["--seed", "x"], "--seed must be an integer"),
    (["--temperature", "warm"], "--temperature must be a number"),
    (["--temperature", "nan"], "--temperature must be"),
    (["--temperature", "inf"], "--temperature must be"),
    (["--device", "meta"], "is not usable here"),
    (["--prompt", "\udcff\udcfe"], "not valid UTF-8"),
])
def test_cli_refuses_what_does_not_apply_and_bad_values(args, message):
    base = ["--prompt", "def f(x):", "--max-new-tokens", "4", "--no-chat"]
    assert_one_error_line(*cli(*base, *args)[::2], message)


def test_cli_a_tree_too_large_for_memory_is_one_line():
    # A DFlash 2 drafter's few candidates per depth let the tree builders order millions of nodes; the verify's
    # mask alone would then hold (budget + 1)^2 bytes, a terabyte here: the allocation fails, and that is bad input.
    draft2 = os.path.join(os.path.dirname(DEFAULT_DRAFT), "tiny-draft2")
    code, _, err = cli("--prompt", "def f(x):", "--max-new-tokens", "4", "--no-chat", "--draft", draft2,
                       "--budget", "1000000")
    assert_one_error_line(code, err, "out of memory")
    assert "--budget" in err


def test_cli_tiny_temperature_is_not_token_zero():
    code, out, err = cli("--prompt", "def f(x):", "--max-new-tokens", "6", "--no-chat", "--json", "--method", "ar",
                         "--temperature", "1e-40")
    greedy = cli("--prompt", "def f(x):", "--max-new-tokens", "6", "--no-chat", "--json", "--method", "ar")[1]
    assert code == 0, err
    assert json.loads(out)["tokens"] == json.loads(greedy)["tokens"]


@pytest.fixture
def text_copy(tmp_path):
    dst = tmp_path / "target"
    shutil.copytree(BUNDLED_TARGET, dst)
    return dst


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: (p / "tokenizer.json").write_text("{garbage"), "not a readable tokenizer"),
    (lambda p: (p / "tokenizer_config.json").write_text('{"chat_template": "{% if %}"}'),
     "the chat template failed to render"),
    (lambda p: (p / "tokenizer_config.json").write_text('{"chat_template": "{{ messages[3].content.x.y }}"}'),
     "the chat template failed to render"),
    (lambda p: (p / "tokenizer_config.json").write_text('{"chat_template": 7}'), "chat_template must be a string"),
    (lambda p: (p / "tokenizer_config.json").write_text("[]"), "expected a JSON object"),
])
def test_cli_broken_tokenizer_or_template_is_one_line(text_copy, corrupt, message):
    corrupt(text_copy)
    args = ["--target", str(text_copy), "--method", "ar", "--prompt", "hi", "--max-new-tokens", "4"]
    assert_one_error_line(*cli(*args)[::2], message)


# Chat templates are the checkpoint's code: each of these ends, in bounded time and memory, as one error naming the
# template's file (render_chats' child process: a wall clock, an address-space limit, a bound on what is rendered).
HOSTILE_TEMPLATES = {  # (template, what the error says: a regex)
    "loops under the range limit": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                    "{% endfor %}", "did not finish rendering in 2.02 s"),
    "a long repetition": ("{{ 'x' * 100000000 }}", "repeats a sequence of 1 100000000 times"),
    "a long rendering": ("{{ '{:>100000000}'.format('x') }}", "it rendered 100000000 characters"),
    # (past the memory limit within a second or two: under load, the clock may stop it first)
    "doubling a string": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s|length }}", "it took more than 1024 MiB|did not finish rendering"),
    "a range past the sandbox's": ("{% for i in range(10**9) %}{% endfor %}", r"OverflowError: Range too big"),
    "a recursive macro": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    "its own exception": ("{{ raise_exception('only user turns') }}", r"\(it raised: only user turns\)"),
}


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_hostile_chat_templates_end_as_one_error_naming_the_file(text_copy, monkeypatch, name):
    import text
    monkeypatch.setattr(text, "RENDER_SECONDS", 2.0)
    template, message = HOSTILE_TEMPLATES[name]
    (text_copy / "chat_template.jinja").write_text(template)
    with pytest.raises(ValueError, match=f"chat_template.jinja: the chat template .*({message})"):
        text.Text(str(text_copy)).render_chats(["hi", "there"])


def test_cli_hostile_chat_template_is_one_line(text_copy):
    (text_copy / "tokenizer_config.json").write_text(json.dumps({"chat_template": HOSTILE_TEMPLATES[
        "a long repetition"][0]}))
    args = ["--target", str(text_copy), "--method", "ar", "--prompt", "hi", "--max-new-tokens", "4"]
    assert_one_error_line(*cli(*args)[::2], "tokenizer_config.json: the chat template failed to render")


@pytest.mark.parametrize("name", ["config not JSON", "hidden_size a string", "garbage safetensors", "int32 weights",
                                  "config nested 100000 deep", "config a 5000-digit integer",
                                  "layers past the weights", "heads past the weights"])
def test_cli_corrupt_checkpoint_is_one_line(files, tmp_path, name):
    corrupt, message = CORRUPTIONS[name]
    path = copy_target(files, tmp_path)
    corrupt(path)
    assert_one_error_line(*cli("--target", str(path), "--method", "ar", "--prompt", "hi")[::2], message)


def test_cli_reports_compile_time_apart():
    code, out, err = cli("--prompt", "def f(x):", "--method", "ar", "--max-new-tokens", "40", "--no-chat", "--json",
                         "--compile")
    assert code == 0, err
    s = json.loads(out)["stats"]
    assert s["compile_seconds"] > 0 and s["seconds"] > 0
    assert s["tokens_per_s"] == pytest.approx(s["new_tokens"] / s["seconds"])


CLI_VALID = {
    "--method": st.sampled_from(["ar", "dflash", "ddtree"]),
    "--budget": st.sampled_from(["1", "7", "30"]),
    "--max-new-tokens": st.sampled_from(["1", "5"]),
    "--temperature": st.sampled_from(["0", "0.7", "1e-40", "2"]),
    "--top-k": st.sampled_from(["0", "3"]),
    "--top-p": st.sampled_from(["1", "0.5"]),
    "--min-p": st.sampled_from(["0", "0.2"]),
    "--seed": st.sampled_from(["0", "7", str(2**63 - 1)]),
    "--draft-temperature": st.sampled_from(["1", "0.5"]),
    "--denoise-steps": st.sampled_from(["1", "2"]),
    "--dtype": st.sampled_from(["float32", "bf16"]),
}
CLI_BAD = ["beam", "0", "-2", "1.5", "x", "", "99999999999999999999", "3000", "-1", "nan", "inf", str(2**63), "int8",
           "-:"]
CLI_FLAGS = ["--draft-sampling", "--show-tree", "--json", "--no-chat", "--chat"]


@st.composite
def cli_arguments(draw):
    options = draw(st.fixed_dictionaries({}, optional=CLI_VALID))
    flags = draw(st.lists(st.sampled_from(CLI_FLAGS), unique=True))
    if draw(st.integers(0, 3)):
        method, greedy = options.get("--method", "ddtree"), options.get("--temperature", "0") == "0"
        options = {k: v for k, v in options.items() if applies(k[2:].replace("-", "_"), method, greedy)}
        flags = [f for f in flags if applies(f[2:].replace("-", "_"), method, greedy)]
    bad = draw(st.sampled_from([None] * 6 + sorted(CLI_VALID)))
    if bad is not None:
        options[bad] = draw(st.sampled_from(CLI_BAD))
    prompt = draw(st.one_of(st.sampled_from(["def f(x):", "x = 1"]), st.text(max_size=12),
                            st.sampled_from([" ", "\x00", "\udcff", ""])))
    return ["--prompt", prompt] + [x for k, v in options.items() for x in (k, v)] + flags


@settings(max_examples=60, deadline=None)
@given(args=cli_arguments())
def test_cli_with_generated_arguments(args):
    """Exit 0 with output, or exit 2 with exactly one `error:` line: never a traceback."""
    if "--max-new-tokens" not in args:
        args = args + ["--max-new-tokens", "4"]
    code, out, err = cli(*args)
    event(f"exit {code}")
    if code == 2:
        assert err.startswith("error: ") and err.count("\n") == 1, (args, err)
    else:
        assert code == 0, (args, err)
        if "--json" in args:
            assert json.loads(out)["stats"]["new_tokens"] >= 1


# ---- signals and pipes -----------------------------------------------------------------------------------------

LONG_RUN = [sys.executable, os.path.join(ROOT, "ddtree.py"), "--prompt", "def f(x):", "--method", "ar", "--no-chat",
            "--max-new-tokens", "1900"]


def test_ctrl_c_keeps_the_text_and_exits_130():
    # As in a terminal: SIGINT handled by Python (a shell without job control starts background commands with
    # SIGINT ignored, and a child keeps that). Pressed twice, 10 ms apart: the second press finds the run ending
    # (its atexit handlers) and changes nothing.
    p = subprocess.Popen(LONG_RUN, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ,
                         OMP_NUM_THREADS="1"), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = p.stdout.read(1)  # generation has started
    p.send_signal(signal.SIGINT)
    time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted after" in err
    printed = int(err.split("interrupted after ")[1].split()[0])
    assert first and 0 < printed < 1900 and len(first + out) > 0


def test_ctrl_c_in_process_prints_what_was_committed(monkeypatch, capsys):
    calls = []

    from text import Streamer
    import cli as command_line

    def interrupt_on_third_call(self, ids, original=Streamer.__call__):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        original(self, ids)

    monkeypatch.setattr(Streamer, "__call__", interrupt_on_third_call)
    code = command_line.main(["--prompt", "def f(x):", "--method", "ar", "--no-chat", "--max-new-tokens", "50"])
    out, err = capsys.readouterr()
    assert code == 130 and "[ar] interrupted after 2 tokens" in err and "Traceback" not in err
    assert len(out) > 1  # the two tokens (here whitespace) and the closing newline


def test_sigterm_is_ctrl_c_and_json_keeps_what_was_committed(monkeypatch, capsys):
    from text import Streamer
    import cli as command_line
    calls, handlers = [], {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def terminate_on_third_call(self, ids, original=Streamer.__call__):
        calls.append(1)
        original(self, ids)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Streamer, "__call__", terminate_on_third_call)
    try:
        code = command_line.main(["--prompt", "def f(x):", "--method", "ar", "--no-chat", "--max-new-tokens", "50",
                                  "--json"])
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert code == 143 and printed["interrupted"] and len(printed["tokens"]) == 3, (code, out, err)
    assert "[ar] terminated after 3 tokens" in err and "Traceback" not in err


def run_with_closed(stream: str, *args):
    """cli.main with stderr or stdout closed (None, as Python has it when the descriptor was closed at start):
    (exit status, what the other stream got)."""
    import cli as command_line
    other = io.StringIO()
    closed = contextlib.redirect_stderr(None) if stream == "stderr" else contextlib.redirect_stdout(None)
    kept = contextlib.redirect_stdout(other) if stream == "stderr" else contextlib.redirect_stderr(other)
    with closed, kept:
        code = command_line.main(list(args))
    return code, other.getvalue()


def test_closed_stderr_keeps_stdout_for_the_text():
    code, out = run_with_closed("stderr", "--prompt", "def f(x):", "--method", "ar", "--budget", "4")
    assert code == 2 and out == ""
    code, out = run_with_closed("stderr", "--prompt", "def f(x):", "--method", "ar", "--no-chat",
                                "--max-new-tokens", "4")
    assert code == 0 and out and "[ar]" not in out and "tokens" not in out, out


def test_closed_stdout_is_an_error_before_anything_runs():
    code, err = run_with_closed("stdout", "--prompt", "def f(x):", "--method", "ar", "--no-chat")
    assert_one_error_line(code, err, "stdout is closed")


def test_closed_pipe_exits_quietly():
    p = subprocess.Popen(LONG_RUN, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ,
                         OMP_NUM_THREADS="1"))
    assert len(p.stdout.read(10)) == 10
    p.stdout.close()  # as `| head -c 10` does
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert p.returncode == 141 and err == "", err
