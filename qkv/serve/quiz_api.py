"""The page's quiz mode, "predict, then reveal" (`qkv learn quiz`'s questions, :mod:`qkv.learn.quiz`):

    POST /api/quiz/question   {model, kind?, seed?}        -> the question: its text and choices, its seed
    POST /api/quiz/answer     {model, kind, seed, choice}  -> right or not, the truth, the lens's numbers

A question is a function of (model, kind, seed): the answer computes it again, so the server
keeps no state between the two requests (a restart or another worker changes nothing) and the
question response carries no truth. Both run in the server's compute loop, like every lens
request (:mod:`qkv.serve.loop`): their forward passes, hooks and knock-outs see no other
request's. The induction question reads the head scores the lens endpoint caches. The score is
the page's to count.
"""

from __future__ import annotations

import random
import secrets
import time
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field

from qkv.errors import InputError

if TYPE_CHECKING:
    from qkv.learn.quiz import Question
    from qkv.serve.api import Explorer
    from qkv.serve.registry import Lease

Kind = Literal["next", "induction", "knockout", "lens"]
SEED_MAX = 2**31 - 1


class QuizQuestionRequest(BaseModel):
    model: str = Field(min_length=1, max_length=256, examples=["smollm2"])
    kind: Kind | None = Field(
        None, description="next: the likeliest next token; induction: which head is the induction head; "
        "knockout: does knocking a head out raise the loss; lens: where the logit lens first ranks the "
        "answer top. Default: one chosen by the seed")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="the same seed asks the same question "
                             "(default: a random one)")


class QuizQuestion(BaseModel):
    model: str
    kind: Kind
    seed: int = Field(description="send model, kind and seed back with the answer")
    title: str = Field(description="the kind in words")
    question: str
    text: str | None = Field(description="the text the question reads (null: random tokens, head scores)")
    choices: list[str]
    seconds: float = Field(description="server time for this request")


class QuizAnswerRequest(BaseModel):
    model: str = Field(min_length=1, max_length=256, examples=["smollm2"])
    kind: Kind
    seed: int = Field(ge=0, le=SEED_MAX)
    choice: int = Field(ge=0, le=63, description="the chosen choice's index, from 0")


class QuizReveal(BaseModel):
    model: str
    kind: Kind
    seed: int
    choice: int
    truth: int = Field(description="the right choice's index, from 0")
    correct: bool
    explain: str = Field(description="the truth in one sentence, with the lens's numbers")
    reveal: dict[str, Any] = Field(description="next: bars [{id, token, prob}] (top 10); induction: "
                                   "scores (L x H), best [layer, head]; knockout: head, loss, loss_without; "
                                   "lens: rows, rank, prob, top per row, first")


class QuizEndpoints:
    """The quiz's two handlers on an :class:`~qkv.serve.api.Explorer` (its compute loop, its
    registry, its cache of head scores)."""

    def __init__(self, explorer: Explorer) -> None:
        self.explorer = explorer

    def _ask(self, model: str, kind: str, seed: int) -> Question:
        """The question (model, kind, seed) names, computed in the compute loop."""
        from qkv.learn import quiz
        from qkv.serve.lens_api import _scores

        ex = self.explorer

        def ask(lease: Lease) -> Question:
            lm = quiz.check_quiz_model(lease.src, model)
            scores = _scores(lm, ex.head_scores, lease.ref.key) if kind == "induction" else None
            return quiz.make_question(lm, kind, random.Random(seed), scores)

        return ex._compute(model, ask, "quiz")

    def question(self, req: QuizQuestionRequest) -> QuizQuestion:
        """A question computed from ``model`` (decoders: smollm2, GPT runs), without its truth."""
        from qkv.learn.quiz import KIND_TITLES, KINDS

        t0 = time.perf_counter()
        seed = req.seed if req.seed is not None else secrets.randbelow(SEED_MAX + 1)
        kind = req.kind or KINDS[seed % len(KINDS)]
        q = self._ask(req.model, kind, seed)
        return QuizQuestion(model=req.model, kind=kind, seed=seed, title=KIND_TITLES[kind],  # type: ignore[arg-type]
                            question=q.question, text=q.text, choices=q.choices,
                            seconds=time.perf_counter() - t0)

    def answer(self, req: QuizAnswerRequest) -> QuizReveal:
        """Whether ``choice`` is right for the question (model, kind, seed), and the lens's numbers
        behind the truth."""
        q = self._ask(req.model, req.kind, req.seed)
        if req.choice >= len(q.choices):
            with self.explorer._errors():
                raise InputError(f"choice must be from 0 to {len(q.choices) - 1} (this question has "
                                 f"{len(q.choices)} choices), got {req.choice}")
        return QuizReveal(model=req.model, kind=req.kind, seed=req.seed, choice=req.choice, truth=q.truth,
                          correct=req.choice == q.truth, explain=q.explain, reveal=q.reveal)


def mount_quiz(app: FastAPI, explorer: Explorer, responses: dict[int | str, dict[str, Any]]) -> QuizEndpoints:
    """Route ``/api/quiz/question`` and ``/api/quiz/answer`` of ``app`` to a :class:`QuizEndpoints`."""
    quiz = QuizEndpoints(explorer)
    app.add_api_route("/api/quiz/question", quiz.question, methods=["POST"], response_model=QuizQuestion,
                      responses=responses)
    app.add_api_route("/api/quiz/answer", quiz.answer, methods=["POST"], response_model=QuizReveal,
                      responses=responses)
    return quiz
