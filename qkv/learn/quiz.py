"""`qkv learn quiz [MODEL]`: predict, then reveal. Questions computed live from a model, the
answer taken, then the truth shown with the lens's own numbers (:mod:`qkv.lens`).

Four kinds of question, each computed from the model in front of you (nothing is hard-coded):

    next       the likeliest next token after a prompt (the top candidates shuffled with a
               distractor; reveal: the next-token probabilities, softmax of the logits, CS189
               Lec 22)
    induction  which head is the induction head (Olsson et al. 2022): the highest induction score
               of :func:`qkv.lens.head_scores` (reveal: every head's score)
    knockout   does knocking head L.H out raise the loss on a text (reveal: the mean next-token
               cross-entropy with and without it, by :func:`qkv.lens.ablate`)
    lens       at which layer does the logit lens (nostalgebraist 2020) first rank the model's
               final answer top (reveal: the answer's rank and probability after each block)

Answers come from a terminal (rich prompts), from ``--answers 2,1,3``, or line by line from a
stdin that is not a terminal (scripts, tests). The score goes to your progress
(:func:`qkv.learn.progress.record_quiz`). The page of ``qkv serve`` asks the same questions
(:mod:`qkv.serve.quiz_api`). This module's top level stays light: torch and the model load when
a quiz runs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from qkv.errors import InputError

if TYPE_CHECKING:
    from qkv.lens import HeadScores
    from qkv.pipelines import CausalLM

KINDS: tuple[str, ...] = ("next", "induction", "knockout", "lens")
KIND_TITLES = {"next": "the next token", "induction": "the induction head", "knockout": "knock a head out",
               "lens": "the logit lens"}
DEFAULT_MODEL = "smollm2"

# Prompts and passages for models that read English; a model whose tokenizer cannot read them
# (a character-level run of another alphabet, the induction run's letters) gets a random
# sequence of its own tokens written twice, which every decoder can be asked about.
PROMPTS = ("The capital of France is", "Once upon a time, there was a little", "One, two, three, four,",
           "ROMEO: But soft, what light through yonder", "The cat sat on the",
           "Monday, Tuesday, Wednesday,", "To be, or not to be, that is the")
PASSAGES = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is "
            "the sun.",
            "The cat sat on the mat. The dog sat on the rug. The cat sat on the mat again.",
            "Once upon a time, there was a little girl who lived in a village near the forest.")


@dataclass
class Question:
    """One question: ``question`` in words about ``text`` (the tokens it reads, decoded),
    ``choices`` to pick from, ``truth`` the index of the right one, ``reveal`` the lens's numbers
    behind it (JSON-friendly), ``explain`` the truth in one sentence with those numbers."""

    kind: str
    model: str
    question: str
    text: str | None
    choices: list[str]
    truth: int
    reveal: dict[str, Any] = field(default_factory=dict)
    explain: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------ texts


def _tokens_ok(lm: CausalLM, text: str) -> list[int] | None:
    try:
        ids = lm.tokenizer.encode(text)
    except (ValueError, KeyError):
        return None
    return ids if ids and len(ids) <= lm.model.cfg.max_seq_len and lm.tokenizer.decode(ids) == text else None


def is_induction_run(lm: CausalLM) -> bool:
    """A run of the ``induction`` preset (trained on the builtin ``repeats`` corpus: random
    letters, each line written twice)."""
    run = getattr(lm, "run_dir", None)
    if run is None:
        return False
    try:
        data = json.loads((run / "config.json").read_text()).get("data") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return "repeats" in (data.get("corpus"), data.get("builtin"))


def repeated_text(lm: CausalLM, rng: random.Random, half: int, cut: int) -> list[int]:
    """``half`` distinct random tokens of the model's vocabulary written once, then their first
    ``cut`` again (no line breaks or end-of-text: :func:`qkv.lens.probe_avoid`)."""
    from qkv.lens import probe_avoid

    avoid = set(probe_avoid(lm.tokenizer, tuple(getattr(lm, "stop_ids", ()) or ())))
    vocab = min(lm.model.cfg.vocab_size, lm.tokenizer.vocab_size)
    pool = [i for i in range(vocab) if i not in avoid]
    half = max(2, min(half, len(pool), lm.model.cfg.max_seq_len // 2))
    first = rng.sample(pool, half)
    return first + first[:max(1, min(cut, half - 1))]


def pick_text(lm: CausalLM, rng: random.Random, long: bool) -> list[int]:
    """The token ids a question reads: one of the English prompts (or passages, ``long``) the
    model's tokenizer reads exactly, else a repeated random sequence of its tokens."""
    if not is_induction_run(lm):
        texts = [ids for t in (PASSAGES if long else PROMPTS) if (ids := _tokens_ok(lm, t)) is not None]
        if texts:
            return rng.choice(texts)
    return repeated_text(lm, rng, 12 if long else 10, 10 if long else rng.randint(3, 7))


def _show(token: str) -> str:
    """A token as a choice: quoted, so that a leading space or a line break is seen."""
    return json.dumps(token, ensure_ascii=False)


# ------------------------------------------------------------------ the four kinds


def next_question(lm: CausalLM, rng: random.Random) -> Question:
    """(a) The likeliest next token after a prompt, among the top candidates and a distractor."""
    from qkv import lens

    ids = pick_text(lm, rng, long=False)
    nt = lens.next_token(lm, ids, k=10)
    dec = lm.tokenizer.decode
    picked: list[tuple[int, str]] = []
    for c in nt.top:  # the top three with distinct spellings
        if len(picked) < 3 and all(s != c.token for _, s in picked):
            picked.append((c.id, c.token))
    top_ids = {c.id for c in nt.top}
    vocab = min(lm.model.cfg.vocab_size, lm.tokenizer.vocab_size)
    for _ in range(200):  # a distractor: a random token the model does not put in its top 10
        i = rng.randrange(vocab)
        s = dec([i])
        if i not in top_ids and s.strip() and s.isprintable() and all(s != t for _, t in picked):
            picked.append((i, s))
            break
    truth_id = nt.top[0].id
    rng.shuffle(picked)
    probs = nt.probs()
    text = dec(ids)
    best = nt.top[0]
    return Question(
        "next", lm.name, f"After {_show(text)}, which token does {lm.name} find likeliest next?", text,
        [_show(s) for _, s in picked], [i for i, _ in picked].index(truth_id),
        reveal={"bars": [{"id": c.id, "token": c.token, "prob": c.prob} for c in nt.top],
                "choices": [{"id": i, "token": s, "prob": float(probs[i])} for i, s in picked]},
        explain=f"{lm.name} gives {_show(best.token)} {best.prob:.1%} (softmax of its logits); "
                + ", ".join(f"{_show(c.token)} {c.prob:.1%}" for c in nt.top[1:4]) + " come next.")


def induction_question(lm: CausalLM, rng: random.Random, scores: HeadScores | None = None) -> Question:
    """(b) Which head is the induction head: the highest induction score of every head."""
    from qkv import lens

    sc = scores if scores is not None else lens.head_scores(lm)
    ind = sc.induction
    L, H = ind.shape
    best = divmod(int(ind.argmax()), H)
    others = [(layer, h) for layer in range(L) for h in range(H) if (layer, h) != best]
    picked = [best, *rng.sample(others, min(3, len(others)))]
    rng.shuffle(picked)
    which = "the induction head" if is_induction_run(lm) else "the strongest induction head"
    second = float(ind.flatten().topk(min(2, ind.numel())).values[-1])
    return Question(
        "induction", lm.name,
        f"Which head is {which} of {lm.name}: on a random sequence written twice, the head that looks "
        "from each token of the second copy to the token that followed it the first time? (LAYER.HEAD)",
        None, [f"{layer}.{h}" for layer, h in picked], picked.index(best),
        reveal={"scores": [[round(float(v), 5) for v in row] for row in ind], "best": list(best),
                "loss_first": sc.loss_first, "loss_second": sc.loss_second},
        explain=f"head {best[0]}.{best[1]} puts {float(ind[best]):.2f} of its attention on the induction "
                f"target (the next best: {second:.2f}); the loss on the repeat is {sc.loss_second:.2f} nats "
                f"against {sc.loss_first:.2f} on the first copy.")


def text_loss(logits: Any, ids: Sequence[int]) -> float:
    """Mean next-token cross-entropy (nats) of logits (T, V) on the text ``ids``."""
    import torch
    import torch.nn.functional as F

    return float(F.cross_entropy(logits[:-1].double(), torch.tensor(list(ids[1:]))))


def knockout_question(lm: CausalLM, rng: random.Random) -> Question:
    """(c) Does knocking head L.H out (its output zeroed) raise the loss on a text?"""
    from qkv import lens
    from qkv.lens.hooks import shape

    ids = pick_text(lm, rng, long=True)
    L, H, _ = shape(lm.model)
    head = (rng.randrange(L), rng.randrange(H))
    base = text_loss(lens.ablate(lm, ids, []), ids)
    without = text_loss(lens.ablate(lm, ids, [head]), ids)
    text = lm.tokenizer.decode(ids)
    rises = without > base
    return Question(
        "knockout", lm.name,
        f"Knock head {head[0]}.{head[1]} (layer {head[0]}, head {head[1]}, both counted from 0) of "
        f"{lm.name} out (its output zeroed). Does the loss on "
        f"{_show(text)} rise?",
        text, ["yes, the loss rises", "no, it stays or falls"], 0 if rises else 1,
        reveal={"head": list(head), "loss": base, "loss_without": without},
        explain=f"the mean next-token loss is {base:.4f} nats with every head and {without:.4f} without "
                f"{head[0]}.{head[1]} ({without - base:+.4f}).")


def row_name(row: int) -> str:
    return "the embeddings (before block 0)" if row == 0 else f"after block {row - 1}"


def lens_question(lm: CausalLM, rng: random.Random) -> Question:
    """(d) At which layer does the logit lens first rank the model's final answer top?"""
    import torch

    from qkv import lens

    ids = pick_text(lm, rng, long=False)
    ll = lens.logit_lens(lm, ids)
    with torch.inference_mode():
        lp = torch.log_softmax(ll.head(ll.normed[:, -1]).float(), dim=-1).cpu()  # (L + 1, V), last position
    answer = int(lp[-1].argmax())
    ranks = [int((row > row[answer]).sum()) + 1 for row in lp]
    first = next(r for r, k in enumerate(ranks) if k == 1)
    R = lp.shape[0]
    rows = sorted([first, *rng.sample([r for r in range(R) if r != first], min(3, R - 1))])
    text, tok = lm.tokenizer.decode(ids), lm.tokenizer.decode([answer])
    top = [lm.tokenizer.decode([int(i)]) for i in lp.argmax(-1)]
    return Question(
        "lens", lm.name,
        f"After {_show(text)}, {lm.name} predicts {_show(tok)}. Reading the residual stream after each "
        f"block through the final norm and the output head (the logit lens), where is {_show(tok)} "
        "first ranked top?", text, [row_name(r) for r in rows], rows.index(first),
        reveal={"rows": [row_name(r) for r in range(R)], "answer": tok, "rank": ranks,
                "prob": [float(v) for v in lp[:, answer].exp()], "top": top, "first": first},
        explain=f"{_show(tok)} is ranked {ranks[0]} by the embeddings and first top {row_name(first)} "
                f"(probability {float(lp[first, answer].exp()):.3f} there, {float(lp[-1, answer].exp()):.3f} "
                "at the end).")


MAKERS: dict[str, Callable[..., Question]] = {"next": next_question, "induction": induction_question,
                                              "knockout": knockout_question, "lens": lens_question}


def check_quiz_model(lm: Any, name: str) -> CausalLM:
    """``lm`` if it is a decoder the quiz can ask about, else InputError naming what to give."""
    from qkv.pipelines import CausalLM

    if not isinstance(lm, CausalLM):
        raise InputError(f"{name} is not a decoder but a {getattr(lm, 'kind', type(lm).__name__)} model: the "
                         "quiz asks about next tokens and heads of a decoder; give smollm2 or a GPT run")
    return lm


def make_question(lm: CausalLM, kind: str, rng: random.Random, scores: HeadScores | None = None) -> Question:
    """One question of ``kind`` (see :data:`KINDS`), drawn with ``rng``."""
    if kind not in MAKERS:
        raise InputError(f"no question kind {kind!r}; the kinds are {', '.join(KINDS)}")
    if kind == "induction":
        return induction_question(lm, rng, scores)
    return MAKERS[kind](lm, rng)


def questions(lm: CausalLM, n: int, seed: int) -> Iterator[Question]:
    """``n`` questions, the kinds in turn from a seeded start, each computed when asked for."""
    rng = random.Random(seed)
    start = rng.randrange(len(KINDS))
    scores = None
    for i in range(n):
        kind = KINDS[(start + i) % len(KINDS)]
        if kind == "induction" and scores is None:
            from qkv import lens

            scores = lens.head_scores(lm)
        yield make_question(lm, kind, rng, scores)


# ------------------------------------------------------------------ answers


def parse_answer(raw: str, q: Question, number: int) -> int:
    """A 1-based choice number typed or given -> the 0-based index; InputError otherwise."""
    raw = raw.strip()
    if not raw.isdigit() or not 1 <= int(raw) <= len(q.choices):
        raise InputError(f"answer {number} must be a choice number from 1 to {len(q.choices)}, got {raw!r}")
    return int(raw) - 1


class Answers:
    """Where the answers come from: ``--answers`` (all given up front), a terminal (rich
    prompts), or the lines of a stdin that is not a terminal."""

    def __init__(self, given: str | None, stdin: Any, tty: bool) -> None:
        self.given = None if given is None else [a for a in given.split(",")]
        self.stdin, self.tty = stdin, tty and given is None

    def check_count(self, n: int) -> None:
        if self.given is not None and len(self.given) != n:
            raise InputError(f"--answers has {len(self.given)} answers for {n} questions; give {n} "
                             "numbers, comma-separated (or --n to match)")

    def get(self, q: Question, number: int) -> int:
        if self.given is not None:
            return parse_answer(self.given[number - 1], q, number)
        if self.tty:
            from rich.prompt import IntPrompt

            choice = IntPrompt.ask("your answer", choices=[str(i) for i in range(1, len(q.choices) + 1)])
            return int(choice) - 1
        line = self.stdin.readline()
        if not line:
            raise InputError(f"stdin ended before answer {number}: give one choice number per line, "
                             "or --answers 2,1,...")
        return parse_answer(line, q, number)


# ------------------------------------------------------------------ the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"a decoder: a bundled model or a GPT run directory (default {DEFAULT_MODEL})")
    p.add_argument("--n", type=int, default=4, help="how many questions (the four kinds in turn; default 4)")
    p.add_argument("--seed", type=int, default=None,
                   help="the same seed asks the same questions (default: random)")
    p.add_argument("--answers", default=None, metavar="2,1,3",
                   help="the choice numbers, comma-separated, instead of asking (scripts and tests)")
    p.add_argument("--json", action="store_true",
                   help="print {model, seed, questions: [..., answer, truth, correct], score, total} as JSON")


def _say(out: Any, text: str = "") -> None:
    print(text, file=out)


def _reveal_lines(q: Question) -> list[str]:
    """The lens's numbers behind the truth, as text."""
    r = q.reveal
    if q.kind == "next":
        return [f"  {_show(b['token']):>16} {'█' * round(40 * b['prob']):40s} {b['prob']:7.2%}"
                for b in r["bars"]]
    if q.kind == "induction":
        H = len(r["scores"][0])
        head = " " * 10 + "".join(f"  head {h:<2}" for h in range(H))
        return [head] + [f"  layer {i:<2}" + "".join(f"  {v:7.3f}" for v in row)
                         for i, row in enumerate(r["scores"])]
    if q.kind == "knockout":
        return [f"  loss with every head   {r['loss']:.4f} nats",
                f"  without {r['head'][0]}.{r['head'][1]:<14} {r['loss_without']:.4f} nats"]
    return [f"  {name:34s} rank {k:>6}  p = {p:.3f}  top {_show(t)}"
            for name, k, p, t in zip(r["rows"], r["rank"], r["prob"], r["top"], strict=True)]


def run_quiz(lm: CausalLM, n: int, seed: int, answers: Answers, out: Any, quiet: bool) -> dict[str, Any]:
    """Ask ``n`` questions, take the answers, reveal each; returns the JSON record."""
    answers.check_count(n)
    asked = []
    score = 0
    for i, q in enumerate(questions(lm, n, seed), 1):
        if not quiet:
            _say(out, f"\nQuestion {i}/{n} ({KIND_TITLES[q.kind]})")
            _say(out, q.question)
            for j, c in enumerate(q.choices, 1):
                _say(out, f"  {j}) {c}")
            out.flush()
        given = answers.get(q, i)
        right = given == q.truth
        score += right
        if not quiet:
            verdict = "right" if right else "not quite"
            _say(out, f"{verdict}: the answer is {q.truth + 1}) {q.choices[q.truth]}"
                 + ("" if right else f" (you said {given + 1}) {q.choices[given]})"))
            _say(out, "  " + q.explain)
            for line in _reveal_lines(q):
                _say(out, line)
        asked.append({**q.as_dict(), "answer": given + 1, "truth": q.truth + 1, "correct": right})
    return {"model": lm.name, "seed": seed, "questions": asked, "score": score, "total": n}


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def main(args: argparse.Namespace) -> int:
    from qkv.inference import open_model, resolve
    from qkv.learn import progress

    if not 1 <= args.n <= 100:
        raise InputError(f"--n must be from 1 to 100 questions, got {args.n}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    ref = resolve(args.model)
    if ref.kind != "decoder":
        article = "an" if ref.kind[:1] in "aeiou" else "a"
        raise InputError(f"{args.model} is not a decoder but {article} {ref.kind} model: the quiz asks about "
                         "next tokens and heads of a decoder; give smollm2 or a GPT run")
    answers = Answers(args.answers, sys.stdin, _is_tty(sys.stdin))
    answers.check_count(args.n)
    lm = check_quiz_model(open_model(ref), args.model)
    out = sys.stderr if args.json else sys.stdout
    record = run_quiz(lm, args.n, seed, answers, out, quiet=args.json and not answers.tty)
    progress.record_quiz(lm.name, record["score"], record["total"])
    if args.json:
        print(json.dumps(record, ensure_ascii=False))
    else:
        print(f"\nscore: {record['score']}/{record['total']} (seed {seed}: `--seed {seed}` asks these again)")
    return 0
