"""The command line of `python ddtree.py`: flags to generate()'s settings, text in and out, one `error:` line for
bad input, Ctrl-C / SIGTERM and closed pipes or streams handled. The engine never imports this file."""

import argparse
import codecs
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import warnings
from typing import NamedTuple

import torch

from batch import RequestsFailed
from ddtree import DEFAULT_DRAFT, DEFAULT_TARGET, generate, generate_batch
from drafter import DFlashDrafter
from memory import memory_line, memory_per_token
from model import Qwen3
from sampler import Sampling
from settings import (AUTO_BUDGETS, DEFAULT_BUDGET, METHODS, Speculation, check_applies, check_int,
                      check_recalibrate, check_sampling)
from text import Streamer, Text
import tp


SPECULATION_FIELDS = ("draft_temperature", "draft_sampling", "denoise_steps", "show_tree", "draft_window")


def grouped(settings: dict) -> dict:
    """generate()'s keyword arguments from flat ones (the command line's): SPECULATION_FIELDS make `speculation`."""
    out = {k: v for k, v in settings.items() if k not in SPECULATION_FIELDS}
    given = {k: settings[k] for k in SPECULATION_FIELDS if k in settings}
    if given and "speculation" in out:
        raise ValueError(f"{', '.join(given)} and speculation are both given: give them as speculation")
    if given:
        out["speculation"] = Speculation(**given)
    return out


def parse_args(argv):
    p = one_line_errors(argparse.ArgumentParser(
        description="DDTree speculative decoding with a Qwen3 target and a DFlash drafter.",
        epilog="An option that does not apply to the chosen method (e.g. --budget with --method dflash, --top-k "
               "with greedy decoding) is an error, not ignored; --seed is accepted everywhere."))
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt")
    source.add_argument("--prompts-file", help="many requests, run as batches: one JSON string or object "
                                               "({\"prompt\": ..., \"seed\": ...}) per line; one JSON line out per "
                                               "request")
    p.add_argument("--batch-size", default=None, help="with --prompts-file: requests run together (default 16)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="Qwen3 checkpoint: local directory or hub repo id")
    p.add_argument("--draft", default=None, help="DFlash drafter: local directory or hub repo id (dflash, ddtree; "
                                                 "default: the bundled tiny drafter)")
    p.add_argument("--method", default="ddtree", choices=METHODS)
    p.add_argument("--budget", default=None, help=f"tree nodes per round (ddtree; default {DEFAULT_BUDGET}), or "
                                                  "'auto': the fastest of plain decoding, the chain and trees of "
                                                  f"{', '.join(map(str, AUTO_BUDGETS))} nodes, measured on this "
                                                  "device")
    p.add_argument("--recalibrate", action="store_true", default=None,
                   help="with --budget auto: measure the candidates' round times again (on a quiet machine) and "
                        "store them, instead of reading the stored calibration")
    p.add_argument("--max-new-tokens", default="256")
    p.add_argument("--temperature", default="0", help="0 (default) = greedy")
    p.add_argument("--top-k", default=None, help="sampling: keep the k most probable tokens")
    p.add_argument("--top-p", default=None, help="sampling: keep the smallest set of mass >= p")
    p.add_argument("--min-p", default=None, help="sampling: drop tokens below p x the top probability")
    p.add_argument("--seed", default=None)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the checkpoint's chat template (default: on when it has one)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--max-autotune", action="store_true",
                   help="compile with autotuned matmuls (CPU: frozen weights, C++ GEMM templates; longer compile)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--draft-temperature", default=None,
                   help="ddtree: temperature of the drafter's distributions when building trees (default 1, as in "
                        "the paper)")
    p.add_argument("--draft-sampling", action="store_true", default=None,
                   help="dflash with sampling: sample the chain from the draft law and verify with min(1, p/q)")
    p.add_argument("--denoise-steps", default=None, help="dflash, ddtree: drafter passes per round (default 1)")
    p.add_argument("--show-tree", action="store_true", default=None,
                   help="dflash, ddtree: print the first round's tree with accepted marks")
    p.add_argument("--draft-window", default=None,
                   help="dflash, ddtree: the drafter sees only the last W committed tokens (default: all)")
    p.add_argument("--memory", action="store_true",
                   help="print on stderr, before generating, the caches' bytes per token of context (target K/V, "
                        "drafter K/V), the recurrent states' bytes per request, and the longest request's total")
    return p.parse_args(argv)


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse's own errors end as ours do (the scripts' too): a ValueError, which main() makes one `error:` line,
    exit 2 (not usage + message)."""
    def error(message):
        raise ValueError(f"{message} (see --help)")

    parser.error = error
    return parser


def as_int(name: str, text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def as_float(name: str, text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None


def settings_from_args(args) -> dict:
    """generate()'s keyword arguments from the command line: the options given, as numbers, checked to apply."""
    budget = args.budget if args.budget == "auto" else as_int("--budget", args.budget)
    values = dict(budget=budget, max_new_tokens=as_int("--max-new-tokens", args.max_new_tokens),
                  temperature=as_float("--temperature", args.temperature),
                  top_k=as_int("--top-k", args.top_k), top_p=as_float("--top-p", args.top_p),
                  min_p=as_float("--min-p", args.min_p), seed=as_int("--seed", args.seed),
                  draft_temperature=as_float("--draft-temperature", args.draft_temperature),
                  denoise_steps=as_int("--denoise-steps", args.denoise_steps),
                  draft_sampling=args.draft_sampling, show_tree=args.show_tree,
                  draft_window=as_int("--draft-window", args.draft_window), recalibrate=args.recalibrate)
    given = {k: v for k, v in values.items() if v is not None}
    flags = set(given) | ({"draft"} if args.draft is not None else set())
    check_sampling(Sampling(given["temperature"], given.get("top_k", 0), given.get("top_p", 1.0),
                            given.get("min_p", 0.0)))
    check_applies(args.method, given["temperature"] == 0, sorted(flags), spell=lambda n: "--" + n.replace("_", "-"))
    check_recalibrate(given.get("recalibrate", False), given.get("budget"))
    return given


def compile_mode(args) -> bool | str:
    if args.max_autotune and args.compile is False:
        raise ValueError("--max-autotune compiles: it cannot go with --no-compile")
    return "max-autotune" if args.max_autotune else bool(args.compile)


def check_source(args):
    """What goes with --prompt and what with --prompts-file (whose output is one JSON line per request)."""
    if args.prompts_file:
        for flag, given in (("--json", args.json), ("--show-tree", args.show_tree)):
            if given:
                raise ValueError(f"{flag} goes with --prompt (--prompts-file prints one JSON line per request)")
    elif args.batch_size is not None:
        raise ValueError("--batch-size goes with --prompts-file")


def run_cli(args) -> int:
    if sys.stdout is None:  # closed when the run started: the text would be lost
        raise ValueError("stdout is closed: the generated text would go nowhere")
    check_source(args)
    settings = settings_from_args(args)  # before loading anything
    compile_mode(args)
    requests = read_prompts_file(args.prompts_file) if args.prompts_file else \
        [Request(None, check_text(args.prompt), None)]
    target = Qwen3.from_pretrained(args.target, device=args.device, dtype=args.dtype)
    text = Text(target.path)
    chat = args.chat if args.chat is not None else bool(text.chat_template)
    if chat and not text.chat_template:
        raise ValueError(f"{args.target}: --chat asked for, but the checkpoint has no chat template")
    given = [r.prompt for r in requests]
    prompts = [text.encode(p) for p in (text.render_chats(given) if chat else given)]
    for request, prompt in zip(requests, prompts):
        if not prompt:
            raise ValueError(f"{located(args, request)}the prompt is empty")
    drafter = None
    if args.method != "ar":
        drafter = DFlashDrafter.from_pretrained(args.draft or DEFAULT_DRAFT, device=target.device,
                                                dtype=target.dtype)
    if args.memory:  # before generating: what a long prompt will cost is the question it answers
        say(memory_line(memory_per_token(target, drafter), max(map(len, prompts)) + settings["max_new_tokens"]))
    if args.prompts_file:
        return run_batch(args, target, drafter, text, prompts, requests, settings)
    streamer = Streamer(text, None if args.json else sys.stdout)
    try:
        res = generate(target, drafter, prompts[0], method=args.method, compile=compile_mode(args),
                       on_tokens=streamer, **grouped(settings))
    except KeyboardInterrupt as e:
        # What was committed stays printed; the summary says where it stopped.
        if args.json:
            print(json.dumps(dict(text=text.decode(streamer.ids), tokens=streamer.ids, interrupted=True)))
        else:
            print()
        say(f"[{args.method}] {stopped(e)} after {len(streamer.ids)} tokens")
        return stop_status(e)
    if args.show_tree and res.trees:
        tokens, parents, depths, path, length = res.trees[0]
        say(f"\nround 1 tree ({args.method}, {int((parents >= 0).sum())} nodes; ✓ accepted):")
        say(format_tree(tokens, parents, accepted_rows=path[:length], decode=lambda t: repr(text.decode([t])),
                        root=repr(text.decode(res.tokens[:1]))))
    s = res.stats
    if args.json:
        print(json.dumps(dict(text=text.decode(res.tokens), tokens=res.tokens, stats=s)))
    else:
        print()
        compiled = f" (+{s['compile_seconds']:.1f} s {warm_up_label(args)})" if s["compile_seconds"] else ""
        templated = "; the prompt went through the chat template (--no-chat: as written)" if chat else ""
        say(f"[{s['method']}] {s['new_tokens']} tokens in {s['rounds']} rounds, tau {s['tau']:.2f}, "
            f"{s['tokens_per_s']:.1f} tokens/s{compiled}{templated}")
        if "auto" in s:
            say(auto_summary(s["auto"]))
    return 0


def auto_summary(a: dict) -> str:
    """Budget auto's line under the CLI summary: what ran, the estimates and the round times they come from
    (estimated now / calibrated), probing, and the calibration: when it was taken, why it was taken again, and
    whether this run found it wrong (then the next run calibrates again)."""
    ran = ", ".join(f"{c} x{n}" for c, n in a["rounds_per_candidate"].items())
    rates = ", ".join(f"{c} {v['tokens_per_s']:.0f} ({v['round_ms']:.1f}/{v['calibrated_ms']:.1f} ms)"
                      for c, v in a["candidates"].items() if v["tokens_per_s"] is not None)
    how = a["calibration"]
    if a["calibrated_now"]:
        calibration = f"calibrated in {a['calibrate_seconds']:.1f} s ({how['renewed_because']})"
    else:
        calibration = f"calibration of {how['taken'] or 'unknown date'}"
    if how["quiet"] is False:
        calibration += ", taken while the machine was busy"
    renew = f"; this run measured {how['renew']}: the next run calibrates again" if how["renew"] else ""
    return (f"auto: best {a['choice']}; rounds run: {ran}; estimated tokens/s per request (ms a round now/"
            f"calibrated): {rates}; {a['probe_rounds']} probe rounds ({a['probe_overhead_seconds'] * 1e3:+.0f} ms "
            f"against the best); {calibration} in {a['cost_file']} (--recalibrate: take it again){renew}")


def format_tree(tokens, parents, accepted_rows=None, decode=lambda t: str(t), probs=None, root="<bonus>"):
    """A `tree`-style text picture of one round's tree (the CLI's --show-tree).

    One line per node: decoded token, then its probability if `probs` ([B], e.g. q of the token at its depth) is
    given, then "✓" if its row is in `accepted_rows` (rows of the accepted path; the root is row 0) and "·" if
    not (marks only when accepted_rows is given). Children appear in rank order (= row order). Padding is skipped.
    """
    tokens, parents = (torch.as_tensor(t).tolist() for t in (tokens, parents))
    probs = None if probs is None else torch.as_tensor(probs).tolist()
    accepted = None if accepted_rows is None else set(torch.as_tensor(accepted_rows).reshape(-1).tolist())
    children = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(i + 1)

    def label(row):
        text = root if row == 0 else decode(tokens[row - 1])
        text = text.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
        if row > 0 and probs is not None:
            text += f"  {probs[row - 1]:.3f}"
        if accepted is not None:
            text += "  ✓" if row in accepted else "  ·"
        return text

    lines = [label(0)]

    def walk(row, indent):
        kids = children.get(row, [])
        for n, kid in enumerate(kids):
            last = n == len(kids) - 1
            lines.append(indent + ("└── " if last else "├── ") + label(kid))
            walk(kid, indent + ("    " if last else "│   "))

    walk(0, "")
    return "\n".join(lines)


def run_batch(args, target, drafter, text, prompts, requests, settings) -> int:
    """--prompts-file: every request through generate_batch; one JSON line per request (with its index) as soon as
    it ends, or for a request that failed alone an `error:` line naming its line of the file (the others go on,
    and the exit status is 2); a summary line on stderr. --seed S gives request i the seed S + i unless its line has
    its own."""
    base = settings.pop("seed", None)
    seeds = [r.seed if r.seed is not None else (None if base is None else base + i) for i, r in enumerate(requests)]
    batch = as_int("--batch-size", args.batch_size) if args.batch_size is not None else 16
    check_int("--batch-size", batch, 1)
    t0 = time.perf_counter()
    done = []

    def print_line(i, res):  # as each request ends: Ctrl-C later keeps every line printed so far
        if res.error is not None:
            say(f"error: {located(args, requests[i])}{res.error}")
        else:
            print(json.dumps(dict(index=i, text=text.decode(res.tokens), tokens=res.tokens, stats=res.stats)),
                  flush=True)
        done.append(i)

    try:
        results = generate_batch(target, drafter, prompts, method=args.method, compile=compile_mode(args),
                                 seeds=seeds, max_batch=batch, on_result=print_line, **grouped(settings))
    except RequestsFailed as e:  # each failed request has had its error line
        results = e.results
    except (ValueError, TypeError) as e:  # an error about "prompt i" is one about its line of the file
        raise type(e)(re.sub(r"^prompt (\d+): ", lambda m: located(args, requests[int(m[1])]), str(e))) from None
    except KeyboardInterrupt as e:
        say(f"[{args.method}] {stopped(e)} after {len(done)} of {len(prompts)} requests")
        return stop_status(e)
    seconds = time.perf_counter() - t0
    ok = [r for r in results if r.error is None]
    total = sum(len(r.tokens) for r in ok)
    # compile_seconds grows as a batch runs (a smaller engine's first warm-up): its last request's is the batch's
    compiling = sum(max(r.stats["compile_seconds"] for r in results[i:i + batch])
                    for i in range(0, len(results), batch))
    count = f"{len(ok)} of {len(results)}" if len(ok) < len(results) else f"{len(results)}"
    say(f"[{args.method}] {count} requests in batches of up to {batch}: {total} tokens, "
        f"{total / max(seconds - compiling, 1e-9):.1f} tokens/s" +
        (f" (+{compiling:.1f} s {warm_up_label(args)})" if compiling else ""))
    if settings.get("budget") == "auto":  # one line per batch: each batch chooses on its own
        for i in range(0, len(results), batch):
            last = max(results[i:i + batch], key=lambda r: len(r.stats["auto"]["schedule"]))  # the final report
            say(auto_summary(last.stats["auto"]))
    return 0 if len(ok) == len(results) else 2


def warm_up_label(args) -> str:
    """What a run's time before its first round went to: compiling its engines, and for budget auto, timing
    its candidates."""
    compiling = compile_mode(args) is not False
    if args.budget == "auto":
        return "compiling and calibrating" if compiling else "calibrating"
    return "compiling"


def check_text(prompt: str) -> str:
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the prompt is not valid UTF-8 text") from None
    if not prompt:
        raise ValueError("the prompt is empty")
    return prompt


class Request(NamedTuple):
    line: int | None  # its line in --prompts-file (None: --prompt)
    prompt: str
    seed: int | None


def located(args, request: Request) -> str:
    """Where a request came from, as an error message starts: "FILE line N: " (nothing for --prompt)."""
    return "" if request.line is None else f"{args.prompts_file} line {request.line}: "


def read_prompts_file(path: str) -> list[Request]:
    """A Request per non-blank line of a --prompts-file: a JSON string, or an object with "prompt" and optionally
    "seed". Lines end at a newline only (str.splitlines() would also cut a JSON string at an unescaped U+2028,
    U+2029 or U+0085); each is decoded on its own, so that a byte that is not UTF-8 names its line."""
    with open(path, "rb") as f:
        data = f.read().removeprefix(codecs.BOM_UTF8)  # a byte-order mark, as some editors write, is not text
    requests = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        where = f"{path} line {number}"
        try:
            line = raw.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
        if line.strip():
            requests.append(parse_request(line, number, where))
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests


def parse_request(line: str, number: int, where: str) -> Request:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: not JSON (nested too deeply)") from None
    except ValueError as e:  # valid JSON Python will not read, such as an integer of over 4,300 digits
        raise ValueError(f"{where}: {str(e).split(';')[0]}") from None
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or set(item) - {"prompt", "seed"}:
        raise ValueError(f'{where}: expected a JSON string or an object {{"prompt": str, "seed": int}}')
    seed = item.get("seed")
    if seed is not None:
        check_int(f"{where}: seed", seed, 0)
    try:
        return Request(number, check_text(item["prompt"]), seed)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def main(argv=None) -> int:
    tp.quiet_other_ranks()  # under torchrun, rank 0 alone prints
    handlers = catch_stop_signals()
    try:
        with warnings.catch_warnings():
            warnings.showwarning = print_warning
            args = parse_args(argv)
            return run_cli(args)
    except (ValueError, TypeError, OSError) as e:
        if isinstance(e, BrokenPipeError):
            return closed_pipe()
        say(f"error: {in_flags(str(e))}")
        return 2
    except KeyboardInterrupt as e:  # while loading
        say(stopped(e))
        return stop_status(e)
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        say(f"error: out of memory: {str(e).splitlines()[0][:300]} (a smaller --budget, --max-new-tokens or prompt "
            "needs less; --memory prints what a token costs)")
        return 2
    finally:
        release_stop_signals(handlers)


def out_of_memory(e: BaseException) -> bool:
    """Whether an allocation failed: a request too large for the device (a huge tree's mask and scratch rows, a long
    prompt) is bad input like any other, not a crash."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


class Terminated(KeyboardInterrupt):
    """SIGTERM, which ends a run as Ctrl-C does."""


STOP_SIGNALS = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Terminated}


def on_stop_signal(number, frame):
    """Ctrl-C or SIGTERM: the run stops where it is and keeps what it printed. Later ones are ignored: the exit is
    under way, and a second press would only interrupt its cleanup (an atexit traceback)."""
    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    raise STOP_SIGNALS[number]()


def catch_stop_signals() -> dict:
    """on_stop_signal for Ctrl-C and SIGTERM (where signals can be caught: the main thread); the handlers before."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {number: signal.signal(number, on_stop_signal) for number in STOP_SIGNALS}


def release_stop_signals(handlers: dict):
    """The handlers before main(), unless a stop signal came (then they stay ignored until the process ends)."""
    for number, handler in handlers.items():
        if signal.getsignal(number) is on_stop_signal:
            signal.signal(number, handler)


def stopped(e: KeyboardInterrupt) -> str:
    return "terminated" if isinstance(e, Terminated) else "interrupted"


def stop_status(e: KeyboardInterrupt) -> int:
    """128 + the signal's number, as shells report it: 143 for SIGTERM, 130 for Ctrl-C."""
    return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)


def say(line: str):
    """A line on stderr, or nowhere when stderr is closed (print(file=None) would write it to stdout, the text's)."""
    if sys.stderr is not None:
        with contextlib.suppress(OSError):
            print(line, file=sys.stderr, flush=True)


# The API's parameter names that are CLI flags of another spelling: the command line speaks in flags.
FLAGS = {name: "--" + name.replace("_", "-") for name in (
    "max_new_tokens", "top_k", "top_p", "min_p", "temperature", "budget", "draft_temperature", "draft_sampling",
    "denoise_steps", "show_tree", "draft_window", "seed", "recalibrate")} | {"max_batch": "--batch-size"}


def in_flags(message: str) -> str:
    """An error from the Python API as the command line says it: its parameter names as flags."""
    return re.sub(r"(?<![\w-])(" + "|".join(FLAGS) + r")\b", lambda m: FLAGS[m[1]], message)


def print_warning(message, category, filename, lineno, file=None, line=None):
    """The command line's warnings: one `warning:` line each, as its errors are one `error:` line."""
    say(f"warning: {message}")


def closed_pipe() -> int:
    """The reader of stdout went away (`| head`): stop quietly. Output still buffered would fail again when
    Python flushes at exit, so stdout now points at /dev/null. 141 = 128 + SIGPIPE, as a shell reports it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141
