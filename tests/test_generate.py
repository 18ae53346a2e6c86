"""generate(method="ar") against transformers, reproducibility, compiled == eager without recompiles, and the
CLI's handling of bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch

import cli as command_line
import compiling
from conftest import compiled_equals_eager
from ddtree import generate
from text import Text
from model import Qwen3
from cli import grouped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random transformers Qwen3 (the reference) and the same weights loaded by us."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=None)
    hf = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # HF inits norms to 1 and projections small: perturb so mistakes show
            p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp("ar") / "target"
    hf.save_pretrained(path)
    return hf, Qwen3.from_pretrained(str(path), device="cpu")


def prompts(n, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_greedy_equals_transformers_generate(pair):
    hf, ours = pair
    for prompt in prompts(4) + [list(range(1, 128)) + list(range(100))]:  # the last one spans 2 prefill chunks
        ids = torch.tensor([prompt])  # explicit attention mask: else HF masks prompt tokens equal to pad_token_id
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        res = generate(ours, None, prompt, method="ar", max_new_tokens=24, stop_ids=[])
        assert res.tokens == ref
        assert res.stats["new_tokens"] == 24 and res.stats["rounds"] == 23 and res.stats["tau"] == 1.0


def test_stop_ids_end_generation(pair):
    _, ours = pair
    full = generate(ours, None, [5, 6, 7], method="ar", max_new_tokens=20, stop_ids=[])
    stop = full.tokens[7]
    res = generate(ours, None, [5, 6, 7], method="ar", max_new_tokens=20, stop_ids=[stop])
    assert res.tokens == full.tokens[:full.tokens.index(stop) + 1]


def test_sampling_is_reproducible_by_seed(pair):
    _, ours = pair
    kw = dict(method="ar", max_new_tokens=20, temperature=1.3, top_k=50, top_p=0.95, stop_ids=[])
    a = generate(ours, None, [1, 2, 3], seed=7, **grouped(kw)).tokens
    b = generate(ours, None, [1, 2, 3], seed=7, **grouped(kw)).tokens
    c = generate(ours, None, [1, 2, 3], seed=8, **grouped(kw)).tokens
    greedy = generate(ours, None, [1, 2, 3], method="ar", max_new_tokens=20, stop_ids=[]).tokens
    assert a == b
    assert a != c and a != greedy  # 20 tokens at T=1.3 over 128 tokens: a collision is ~impossible


def test_compiled_equals_eager_without_recompiles(pair):
    _, ours = pair
    ps = prompts(3, seed=1)
    assert len(ps[1]) != len(ps[2]) != len(ps[0])
    cases = list(zip(ps, (12, 60, 60)))  # a short warm-up run, then 100+ steps
    runs = compiled_equals_eager(lambda c, compile: generate(ours, None, c[0], method="ar", max_new_tokens=c[1],
                                                             stop_ids=[], compile=compile), cases)
    assert sum(r.stats["rounds"] for r in runs) >= 100


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_ids=[]), "prompt is empty"),
    (dict(prompt_ids=[1], max_new_tokens=5000), "max_position_embeddings"),
    (dict(prompt_ids=[1], temperature=-0.5), "temperature"),
    (dict(prompt_ids=[1], temperature=float("nan")), "temperature"),
    (dict(prompt_ids=[1], top_p=0.0), "top_p"),
    (dict(prompt_ids=[1], top_p=1.5), "top_p"),
    (dict(prompt_ids=[1], min_p=2.0), "min_p"),
    (dict(prompt_ids=[1], top_k=-1), "top_k"),
    (dict(prompt_ids=[1], budget=2.5), "budget must be an integer"),
    (dict(prompt_ids=[1], budget=0), "budget"),
    (dict(prompt_ids=[1], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_ids=[1000]), "prompt ids"),
    (dict(prompt_ids=[1], method="beam"), "unknown method"),
])
def test_bad_api_input_is_a_clear_value_error(pair, kwargs, message):
    _, ours = pair
    kwargs.setdefault("method", "ar")
    with pytest.raises((ValueError, TypeError), match=message):
        generate(ours, None, **grouped(kwargs))


# ---- CLI -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random target with a tokenizer and chat template, written by the project's own script."""
    out = tmp_path_factory.mktemp("cli")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "checkpoints.py"), "random-pair", "--out",
                    str(out), "--vocab", "512"], check=True, capture_output=True)
    return str(out / "target")


def cli(capsys, *args):
    code = command_line.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_runs_and_prints_json(checkpoint, capsys):
    code, out, err = cli(capsys, "--target", checkpoint, "--method", "ar", "--prompt", "def f(x):",
                         "--max-new-tokens", "8", "--json", "--no-chat")
    assert code == 0, err
    result = json.loads(out)
    assert len(result["tokens"]) == 8 and result["stats"]["method"] == "ar"


def test_cli_streams_text_and_summary(checkpoint, capsys):
    code, out, err = cli(capsys, "--target", checkpoint, "--method", "ar", "--prompt", "hello", "--max-new-tokens",
                         "8", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3")
    assert code == 0, err
    assert "tau" in err and "tokens/s" in err
    assert "the prompt went through the chat template" in err  # the checkpoint has one: say that it was applied
    code, out, err = cli(capsys, "--target", checkpoint, "--method", "ar", "--prompt", "hello", "--max-new-tokens",
                         "8", "--no-chat")
    assert code == 0 and "chat template" not in err, err


def test_chat_template_renders_like_transformers(checkpoint):
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    ours = Text(checkpoint)
    messages = [{"role": "user", "content": "def f(x):"}]
    assert ours.render_chat("def f(x):") == hf.apply_chat_template(messages, tokenize=False,
                                                                     add_generation_prompt=True)
    conversation = messages + [{"role": "assistant", "content": "    return x"}, {"role": "user", "content": "Why?"}]
    assert ours.render_chat(conversation) == hf.apply_chat_template(conversation, tokenize=False,
                                                                    add_generation_prompt=True)
    assert ours.encode("x = [1, 2]  # ok") == hf.encode("x = [1, 2]  # ok", add_special_tokens=False)


def test_cli_non_qwen3_checkpoint(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    code, _, err = cli(capsys, "--target", str(tmp_path), "--method", "ar", "--prompt", "hi")
    assert code == 2 and "not a Qwen3" in err and "llama" in err


def test_cli_process_exits_nonzero_without_traceback(checkpoint):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "ddtree.py"), "--target", checkpoint, "--prompt", "hi",
                        "--method", "ar", "--top-p", "7"], capture_output=True, text=True)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and p.stderr.startswith("error: --top-p must be")  # the CLI speaks in flags


def test_ctrl_c_while_torch_imports_exits_130_quietly():
    # The first seconds of `python ddtree.py` are spent importing torch: Ctrl-C there ends the run as Ctrl-C
    # anywhere else does, exit status 130 and no traceback.
    import signal
    import time
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "ddtree.py"), "--prompt", "hi"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)  # past the interpreter's start, inside `import torch` (about a second here)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err and not out, (p.returncode, err[-2000:])


@pytest.mark.parametrize("kind", ["a file", "read-only"])
def test_an_unwritable_inductor_cache_falls_back_to_a_private_one_with_a_warning(tmp_path, monkeypatch, kind):
    # A compile would die in inductor's worker threads (thousands of lines); the engine checks the directory first.
    bad = tmp_path / "inductor"
    if kind == "a file":
        bad.write_text("not a directory")
    else:
        bad.mkdir()
        bad.chmod(0o500)
        if os.access(bad, os.W_OK):
            pytest.skip("this user can write to a read-only directory")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(bad))
    with pytest.warns(UserWarning, match="cannot be written") as caught:
        compiling.writable_inductor_cache.__wrapped__()
    fallback = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert str(bad) in str(caught[0].message) and fallback != str(bad) and os.access(fallback, os.W_OK)


def test_a_writable_inductor_cache_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "fine"))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiling.writable_inductor_cache.__wrapped__()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "fine")
