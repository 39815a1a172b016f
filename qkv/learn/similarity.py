"""How alike two solutions are, for a person to review (never to deduct): MOSS's winnowing
(Schleimer, Wilkerson and Aiken 2003) over normalised syntax trees.

A solution's function is read with ``ast`` (nothing runs), walked in order and written as tokens:
the kind of each node, the names of attributes and called functions (``torch.exp`` stays
``exp``: what it computes), constants by type, and every local name replaced by the order in
which it first appeared, so renaming variables, reformatting, comments and docstrings change
nothing. Hashes of every ``K`` consecutive tokens are winnowed (the smallest of each window of
``W``) into a fingerprint; the similarity of two solutions is the share of the smaller
fingerprint found in the other.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

K = 6  # tokens per gram
W = 4  # grams per winnowing window
REVIEW_AT = 0.9  # similarities from here up are listed for review in grades.csv


def tokens(source: str, name: str) -> list[str]:
    """The normalised tokens of function ``name`` in ``source`` (and of the module's other
    functions it may call), or [] if it does not parse or is not there."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    fns = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    if name not in fns:
        return []
    order = [fns[name]] + [f for n, f in fns.items() if n != name]
    names: dict[str, int] = {}
    out: list[str] = []

    def in_order(node: ast.AST) -> Iterable[ast.AST]:  # depth first: the order the code reads
        yield node
        for child in ast.iter_child_nodes(node):
            yield from in_order(child)

    for fn in order:
        for node in in_order(fn):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str):
                continue  # a docstring
            if isinstance(node, ast.Constant):
                out.append(f"C:{type(node.value).__name__}")
            elif isinstance(node, ast.Name):
                out.append(f"v{names.setdefault(node.id, len(names))}")
            elif isinstance(node, ast.arg):
                out.append(f"a{names.setdefault(node.arg, len(names))}")
            elif isinstance(node, ast.Attribute):
                out.append(f".{node.attr}")
            elif isinstance(node, ast.FunctionDef):
                out.append("def")
            elif not isinstance(node, ast.Load | ast.Store | ast.Del | ast.expr_context):
                out.append(type(node).__name__)
    return out


def fingerprint(toks: Sequence[str]) -> set[int]:
    """The winnowed hashes of ``toks``' K-grams (all of them when there are fewer than W)."""
    grams = [int.from_bytes(hashlib.blake2b(" ".join(toks[i:i + K]).encode(), digest_size=8).digest(), "big")
             for i in range(max(0, len(toks) - K + 1))]
    if len(grams) <= W:
        return set(grams)
    return {min(grams[i:i + W]) for i in range(len(grams) - W + 1)}


def similarity(a: set[int], b: set[int]) -> float:
    """The share of the smaller fingerprint found in the other (0 when either is empty)."""
    if not a or not b:
        return 0.0
    return len(a & b) / min(len(a), len(b))


@dataclass(frozen=True)
class Match:
    """The most similar other solution to one student's function: whose (a student, or
    "qkv's solution") and how similar (0 to 1)."""

    exercise: str
    other: str
    score: float


def closest(exercise: str, students: dict[str, str], reference: str) -> dict[str, Match]:
    """For each student (name -> the source holding their ``exercise`` function), the most
    similar of qkv's reference solution and every other student's."""
    prints = {s: fingerprint(tokens(src, exercise)) for s, src in students.items()}
    prints_ref = fingerprint(tokens(reference, exercise))
    out = {}
    for s, fp in prints.items():
        if not fp:
            continue
        best = Match(exercise, "qkv's solution", similarity(fp, prints_ref))
        for other, fo in prints.items():
            if other != s:
                score = similarity(fp, fo)
                if score > best.score:
                    best = Match(exercise, other, score)
        out[s] = best
    return out


def summary(matches: Iterable[Match]) -> str:
    """One cell of grades.csv: the matches at or above :data:`REVIEW_AT`, highest first
    ("softmax 0.97 qkv's solution; rope 0.92 bob"), or ""."""
    high = sorted((m for m in matches if m.score >= REVIEW_AT), key=lambda m: -m.score)
    return "; ".join(f"{m.exercise} {m.score:.2f} {m.other}" for m in high)
