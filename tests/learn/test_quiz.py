"""`qkv learn quiz`: every question's truth equals one computed here independently of qkv.lens
(the model's forward and argmax; induction scores read off the attention weights with loops; a
head knocked out by a hook written here; the logit lens with the final norm and the unembedding
applied by hand), the score counts the right answers, answers come from --answers or from stdin,
bad input is one line with exit code 2, and the score is kept in the progress file."""

from __future__ import annotations

import io
import json
import random

import pytest
import torch
from helpers import assert_one_line_error, call, call_one_thread, flags, tiny_train

import qkv
from qkv import lens
from qkv.learn import progress, quiz

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def induction_run(tmp_path_factory):
    """A few steps of the ``induction`` preset (random letters written twice), ~5 s."""
    run = tmp_path_factory.mktemp("quiz") / "induction"
    settings = {**tiny_train("gpt"), "max_iters": 30, "eval_interval": 15}
    rc, out, err = call_one_thread(["train", "gpt", "--preset", "induction", "--out_dir", str(run),
                                    "--no-progress", *flags(settings)])
    assert rc == 0, out + err
    return run


@pytest.fixture(scope="module")
def models(tiny_run, induction_run):
    """The tiny Shakespeare GPT (English prompts) and the induction run (repeated letters)."""
    return {"gpt": qkv.load(tiny_run("gpt")), "induction": qkv.load(induction_run)}


def ids_of(lm, text: str) -> list[int]:
    ids = lm.tokenizer.encode(text)
    assert lm.tokenizer.decode(ids) == text
    return ids


def logits_of(lm, ids: list[int]) -> torch.Tensor:
    """(T, V) float64 by the model's own forward pass."""
    with torch.no_grad():
        return lm.model(torch.tensor([ids])).logits[0].double()


def loss64(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean next-token cross-entropy by hand: -log softmax at the next token, float64."""
    z = logits[:-1].double()
    logp = z - z.logsumexp(-1, keepdim=True)
    return float(-sum(logp[i, ids[i + 1]] for i in range(len(ids) - 1)) / (len(ids) - 1))


@pytest.mark.parametrize("which", ["gpt", "induction"])
def test_next_token_truth_is_the_forward_pass_argmax(models, which) -> None:
    lm = models[which]
    for seed in range(4):
        q = quiz.next_question(lm, random.Random(seed))
        z = logits_of(lm, ids_of(lm, q.text))[-1]
        best = int(z.argmax())
        assert q.choices[q.truth] == json.dumps(lm.tokenizer.decode([best]), ensure_ascii=False)
        assert len(set(q.choices)) == len(q.choices) >= 3
        p = torch.softmax(z, -1)
        for bar in q.reveal["bars"]:
            assert bar["prob"] == pytest.approx(float(p[bar["id"]]), abs=1e-6)
        assert q.reveal["bars"][0]["id"] == best


def test_the_induction_head_is_the_highest_induction_score_read_off_the_weights(models) -> None:
    lm = models["induction"]
    q = quiz.induction_question(lm, random.Random(0))
    assert quiz.is_induction_run(lm) and not quiz.is_induction_run(models["gpt"])
    assert "the induction head" in q.question
    # the probe head_scores documents: 8 random sequences of 24 tokens, each written twice
    R = 24
    tokens = lens.repeated_tokens(lm.tokenizer.vocab_size, R, 8, 0,
                                  lens.probe_avoid(lm.tokenizer, tuple(lm.stop_ids)))
    with torch.no_grad():
        weights = lm.model(tokens, return_weights=True, backend="reference").weights  # L x (B, H, T, T)
    L, H = len(weights), weights[0].shape[1]
    score = torch.zeros(L, H, dtype=torch.float64)
    for layer in range(L):
        w = weights[layer].double().mean(0)
        for h in range(H):
            # query i of the second copy looks at the token after its earlier occurrence, i - R + 1
            score[layer, h] = sum(w[h, i, i - R + 1] for i in range(R, 2 * R)) / R
    best = divmod(int(score.argmax()), H)
    assert q.choices[q.truth] == f"{best[0]}.{best[1]}"
    assert torch.allclose(torch.tensor(q.reveal["scores"], dtype=torch.float64), score, atol=1e-4)
    assert len(set(q.choices)) == len(q.choices) == 4


@pytest.mark.parametrize("which", ["gpt", "induction"])
def test_knockout_truth_by_a_hook_that_zeroes_the_head(models, which) -> None:
    lm = models[which]
    for seed in range(3):
        q = quiz.knockout_question(lm, random.Random(seed))
        ids = ids_of(lm, q.text)
        layer, head = q.reveal["head"]
        attn = lm.model.stack.blocks[layer].attn
        Dh = attn.head_dim

        def zero_head(module, args, head=head, Dh=Dh):
            x = args[0].clone()  # (B, T, H·Dh): the heads side by side, before W_O mixes them
            x[..., head * Dh:(head + 1) * Dh] = 0
            return (x,)

        base = loss64(logits_of(lm, ids), ids)
        handle = attn.out_proj.register_forward_pre_hook(zero_head)
        try:
            without = loss64(logits_of(lm, ids), ids)
        finally:
            handle.remove()
        assert q.reveal["loss"] == pytest.approx(base, abs=1e-5)
        assert q.reveal["loss_without"] == pytest.approx(without, abs=1e-5)
        assert without != base
        assert q.choices[q.truth].startswith("yes" if without > base else "no")


@pytest.mark.parametrize("which", ["gpt", "induction"])
def test_logit_lens_truth_by_the_final_norm_and_unembedding_by_hand(models, which) -> None:
    lm = models[which]
    model = lm.model
    for seed in range(3):
        q = quiz.lens_question(lm, random.Random(seed))
        ids = ids_of(lm, q.text)
        streams: list[torch.Tensor] = []
        first_block = model.stack.blocks[0]
        hooks = [first_block.register_forward_pre_hook(lambda m, a, s=streams: s.append(a[0][0, -1]))]
        hooks += [b.register_forward_hook(lambda m, a, out, s=streams: s.append(out.x[0, -1]))
                  for b in model.stack.blocks]
        try:
            final = logits_of(lm, ids)[-1]
        finally:
            for h in hooks:
                h.remove()
        norm = model.stack.norm
        rows = []
        for x in (s.detach() for s in streams):  # LayerNorm on each row's own stream, then x W_Uᵀ
            x = x.double()
            h = (x - x.mean()) / torch.sqrt(((x - x.mean()) ** 2).mean() + norm.eps) * norm.weight.double()
            if norm.bias is not None:
                h = h + norm.bias.double()
            rows.append((h @ model.lm_head.weight.double().T).detach())
        answer = int(final.argmax())
        assert int(rows[-1].argmax()) == answer
        ranks = [int((r > r[answer]).sum()) + 1 for r in rows]
        first = ranks.index(1)
        assert q.reveal["rank"] == ranks
        assert q.reveal["first"] == first and q.choices[q.truth] == quiz.row_name(first)
        probs = [float(torch.softmax(r, -1)[answer]) for r in rows]
        assert q.reveal["prob"] == pytest.approx(probs, abs=1e-5)


def quiz_json(run, *extra: str, stdin: str | None = None, monkeypatch=None) -> tuple[int, dict | None, str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc, out, err = call(["learn", "quiz", str(run), "--json", *extra])
    return rc, (json.loads(out) if rc == 0 else None), err


def test_the_score_counts_the_right_answers_and_is_kept(induction_run, private_cache) -> None:
    rc, first, err = quiz_json(induction_run, "--seed", "7", "--n", "5", "--answers", "1,1,1,1,1")
    assert rc == 0, err
    truths = [q["truth"] for q in first["questions"]]
    assert len({q["kind"] for q in first["questions"]}) == 4
    assert first["score"] == sum(t == 1 for t in truths) and first["total"] == 5
    rc, right, err = quiz_json(induction_run, "--seed", "7", "--n", "5", "--answers",
                               ",".join(map(str, truths)))
    assert rc == 0, err
    assert [q["question"] for q in right["questions"]] == [q["question"] for q in first["questions"]]
    assert right["score"] == 5 and all(q["correct"] for q in right["questions"])
    wrong = [t % len(q["choices"]) + 1 for t, q in zip(truths, first["questions"], strict=True)]
    mixed = [*truths[:2], *wrong[2:]]
    rc, got, err = quiz_json(induction_run, "--seed", "7", "--n", "5", "--answers", ",".join(map(str, mixed)))
    assert rc == 0 and got["score"] == 2
    assert [q["answer"] for q in got["questions"]] == mixed
    kept = progress.quizzes()
    assert [(k.score, k.total) for k in kept] == [(first["score"], 5), (5, 5), (2, 5)]
    assert all(k.model == first["model"] for k in kept)
    summary = progress.quiz_summary()
    assert summary is not None and "3 quizzes played" in summary and f"{first['score'] + 7}/15" in summary


def test_answers_from_stdin_line_by_line(induction_run, private_cache, monkeypatch) -> None:
    rc, first, err = quiz_json(induction_run, "--seed", "3", "--n", "3", "--answers", "1,1,1")
    truths = [q["truth"] for q in first["questions"]]
    rc, got, err = quiz_json(induction_run, "--seed", "3", "--n", "3",
                             stdin="".join(f" {t}\n" for t in truths), monkeypatch=monkeypatch)
    assert rc == 0, err
    assert got["score"] == 3 and [q["answer"] for q in got["questions"]] == truths
    # without --json: each question, its numbered choices, then the reveal
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{t}\n" for t in truths)))
    rc, out, err = call(["learn", "quiz", str(induction_run), "--seed", "3", "--n", "3"])
    assert rc == 0, err
    assert "Question 1/3" in out and "  1) " in out and "score: 3/3" in out
    assert out.count("right: the answer is") == 3


def error_of(*argv: str) -> str:
    rc, _, err = call(["learn", "quiz", *argv])
    return assert_one_line_error(rc, err)


def test_bad_input_is_one_line_with_exit_code_2(induction_run, private_cache, monkeypatch) -> None:
    assert "no-such-model-xyz" in error_of("no-such-model-xyz", "--n", "1", "--answers", "1")
    run = str(induction_run)
    assert "--answers has 1 answers for 2 questions" in error_of(run, "--n", "2", "--answers", "1")
    assert "from 1 to" in error_of(run, "--n", "1", "--answers", "9")
    assert "got 'x'" in error_of(run, "--n", "1", "--answers", "x")
    monkeypatch.setattr("sys.stdin", io.StringIO("1\n"))
    assert "stdin ended before answer 2" in error_of(run, "--n", "2", "--json")
    from qkv.assets import AssetMissingError, asset_path

    try:  # an encoder is named as such from its name alone (resolved, never loaded)
        asset_path("minilm")
        assert "minilm is not a decoder but an encoder" in error_of("minilm", "--n", "1", "--answers", "1")
    except AssetMissingError:
        pass
    assert "--n must be" in error_of(run, "--n", "0")
    assert progress.quizzes() == []  # nothing recorded for a quiz that did not finish


def test_progress_keeps_quizzes_beside_the_exercises(private_cache) -> None:
    from qkv.learn.exercise import CheckResult, Report

    assert progress.quiz_summary() is None
    progress.record_quiz("smollm2", 3, 4)
    report = Report("softmax", (CheckResult("a", True, ""), CheckResult("b", False, "no")))
    progress.record(report)  # an exercise's attempt keeps the quizzes
    progress.record_quiz("runs/x", 1, 2)
    assert progress.load()["softmax"].ok == 1 and set(progress.load()) == {"softmax"}
    assert [(q.model, q.score, q.total) for q in progress.quizzes()] == [("smollm2", 3, 4), ("runs/x", 1, 2)]
    summary = progress.quiz_summary()
    assert summary.startswith("2 quizzes played, 4/6 answers right; last: 1/2 on runs/x")
    raw = json.loads((private_cache / "learn" / "progress.json").read_text())
    assert raw[progress.QUIZ_KEY][0]["model"] == "smollm2" and "when" in raw[progress.QUIZ_KEY][0]
    (private_cache / "learn" / "progress.json").write_text("{not json")
    assert progress.quizzes() == [] and progress.load() == {}


def test_every_kind_cycles_and_a_seed_repeats_the_questions(models) -> None:
    lm = models["gpt"]
    a = [q.as_dict() for q in quiz.questions(lm, 4, seed=11)]
    b = [q.as_dict() for q in quiz.questions(lm, 4, seed=11)]
    assert a == b and sorted(q["kind"] for q in a) == sorted(quiz.KINDS)
    for q in a:
        assert 0 <= q["truth"] < len(q["choices"]) and "NaN" not in json.dumps(q)
