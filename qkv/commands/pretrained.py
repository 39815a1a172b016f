"""`qkv embed` and `qkv similarity`: the pretrained encoders from the shell (`qkv generate
smollm2` is in :mod:`qkv.commands.generate`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from qkv.pretrained import PRETRAINED

ENCODERS = ("minilm",)


def read_text_file(path: Path) -> str:
    """A UTF-8 text file's contents; ValueError naming the fix when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}); convert it first, e.g. "
                         f"`iconv -f latin1 -t utf-8 {path} > fixed.txt`") from None


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in read_text_file(path).splitlines() if line.strip()]


def _texts(items: list[str], files: bool) -> list[str]:
    """Arguments as texts; with ``files``, an argument naming an existing file adds its lines."""
    out: list[str] = []
    for item in items:
        p = Path(item)
        if item == "-":
            out += [line.strip() for line in sys.stdin.read().splitlines() if line.strip()]
        elif files and p.is_file():
            out += _lines(p)
        elif files and p.is_dir():
            raise ValueError(f"{item} is a directory; give a UTF-8 file with one document per line")
        elif files and item.endswith(("/", ".txt", ".tsv", ".csv", ".md", ".jsonl")):
            raise ValueError(f"file not found: {item} (a sentence would not end like a path)")
        else:
            out.append(item)
    return out


def _encoder(name: str):
    """minilm, a Hugging Face BERT checkpoint folder or a bert-architecture .gguf file, opened
    by the one resolver (qkv.load's rule) as a SentenceEncoder."""
    from qkv.inference import open_model
    from qkv.inference.loading import resolve_model

    ref = resolve_model(name)
    if ref.note:
        print(f"qkv: note: {ref.note}", file=sys.stderr)
    if ref.source != "gguf" and ref.kind == "decoder":  # (a GGUF's reader names its architecture)
        raise ValueError(f"{name} is a decoder (a language model), not a sentence encoder: give "
                         f"{', '.join(ENCODERS)}, a BERT folder or a bert .gguf file")
    return open_model(ref, kinds=("encoder",))


def add_embed_parser(sub) -> None:
    p = sub.add_parser(
        "embed",
        help="sentence embeddings from the pretrained MiniLM encoder",
        description="Embed sentences with all-MiniLM-L6-v2 loaded into qkv's own Encoder: "
        "mean-pooled last hidden states, L2-normalised (what sentence-transformers computes). "
        "Prints the cosine similarity of every pair, or the vectors with --json. "
        "Needs `qkv assets install minilm`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL",
                   help=f"pretrained encoder ({', '.join(ENCODERS)}; a folder of that name: ./NAME), a "
                   "Hugging Face BERT folder or a bert .gguf file (llama.cpp's, e.g. all-MiniLM-L6-v2)")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="sentences to embed ('-' reads stdin)")
    p.add_argument("--file", type=Path, help="also embed every non-empty line of this UTF-8 file")
    p.add_argument("--json", action="store_true", help="print JSON: [{text, embedding}, ...]")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per forward pass")
    p.set_defaults(func=cmd_embed, extra_texts=True)


def cmd_embed(args: argparse.Namespace) -> int:
    texts = _texts(args.texts, files=False) + (_lines(args.file) if args.file else [])
    if not texts:
        raise ValueError("give at least one sentence to embed (arguments, --file, or '-' for stdin)")
    if any(not t.strip() for t in texts):
        raise ValueError("empty sentences cannot be embedded; remove them")
    enc = _encoder(args.model)
    emb = enc.embed(texts, batch_size=args.batch_size)
    if args.json:
        json.dump([{"text": t, "embedding": [round(float(x), 7) for x in e]}
                   for t, e in zip(texts, emb, strict=True)], sys.stdout)
        sys.stdout.write("\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"{len(texts)} sentence(s) -> {emb.shape[1]}-d unit vectors ({args.model}); "
              "first values:")
    for t, e in zip(texts, emb, strict=True):
        con.print(f"  [{', '.join(f'{x:+.3f}' for x in e[:6])}, ...]  {t[:70]}", highlight=False)
    if len(texts) > 1:
        table = Table(title="cosine similarity (inner product of unit vectors)")
        table.add_column("")
        for j in range(len(texts)):
            table.add_column(str(j + 1), justify="right")
        sims = emb @ emb.T
        for i, t in enumerate(texts):
            table.add_row(f"{i + 1}. {t[:40]}", *(f"{float(s):.3f}" for s in sims[i]))
        con.print(table)
    return 0


def add_similarity_parser(sub) -> None:
    p = sub.add_parser(
        "similarity",
        help="rank sentences by cosine similarity to a query (MiniLM)",
        description="Rank documents by the cosine similarity of their MiniLM embeddings to the "
        "query: inner-product retrieval, as in the lectures. Each DOC is a sentence, or a UTF-8 "
        "file whose non-empty lines are the documents.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL",
                   help=f"pretrained encoder ({', '.join(ENCODERS)}; a folder of that name: ./NAME), a "
                   "Hugging Face BERT folder or a bert .gguf file (llama.cpp's, e.g. all-MiniLM-L6-v2)")
    p.add_argument("query", help="the query sentence")
    p.add_argument("docs", nargs="+", metavar="FILE_OR_SENTENCE", help="documents ('-' reads stdin)")
    p.add_argument("--top", type=int, default=10, help="show the best N (0 = all)")
    p.add_argument("--json", action="store_true", help="print JSON: [{rank, score, index, text}, ...]")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per forward pass")
    p.set_defaults(func=cmd_similarity)


def cmd_similarity(args: argparse.Namespace) -> int:
    if not args.query.strip():
        raise ValueError("the query is empty; give a sentence to search for")
    docs = _texts(args.docs, files=True)
    if not docs:
        raise ValueError("no documents to rank (the files given are empty)")
    if args.top < 0:
        raise ValueError(f"--top must be >= 0, got {args.top}")
    enc = _encoder(args.model)
    t0 = time.perf_counter()
    ranked = enc.rank(args.query, docs, batch_size=args.batch_size)
    dt = time.perf_counter() - t0
    shown = ranked[: args.top] if args.top else ranked
    if args.json:
        json.dump([{"rank": r + 1, "score": round(s, 6), "index": i, "text": docs[i]}
                   for r, (i, s) in enumerate(shown)], sys.stdout)
        sys.stdout.write("\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(docs)} documents ranked by cosine similarity to: {args.query!r}")
    table.add_column("rank", justify="right")
    table.add_column("cosine", justify="right")
    table.add_column("document")
    for r, (i, s) in enumerate(shown):
        table.add_row(str(r + 1), f"{s:.4f}", docs[i])
    con = Console()
    con.print(table)
    con.print(f"[dim]{len(docs) + 1} embeddings in {dt:.2f} s[/dim]")
    return 0


__all__ = ["ENCODERS", "PRETRAINED", "add_embed_parser", "add_similarity_parser"]
