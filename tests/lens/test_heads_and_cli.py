"""Head scores on patterns whose scores are known, on transformers' own attention, and heads
recorded during training; `qkv lens` from the command line, against the library's references.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch
from helpers import PNG, assert_one_line_error, call, call_json, hf_decoder_folder

import qkv
from qkv import lens
from qkv.lens.heads import duplicate_token_score, first_token_score, induction_score, previous_token_score
from qkv.lens.history import read_history

transformers = pytest.importorskip("transformers", reason="reference package transformers not "
                                   "installed: pip install 'qkv[reference]'")

TEXT = "w3 w17 w42 w5 w88 w9 w1 w60 w17 w42"


def _causal_uniform(T: int) -> torch.Tensor:
    return torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]


def test_scores_of_patterns_with_known_answers():
    T, R = 12, 6
    prev = torch.zeros(T, T)
    prev[0, 0] = 1
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1  # every row on the token before it
    assert float(previous_token_score(prev)) == 1.0
    assert float(first_token_score(prev)) == pytest.approx(1 / (T - 1))  # only row 1 looks at 0
    uni = _causal_uniform(T)
    want = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)  # row i spreads 1/(i+1) over i+1 keys
    assert float(previous_token_score(uni)) == pytest.approx(want)
    assert float(first_token_score(uni)) == pytest.approx(want)
    ind = _causal_uniform(2 * R).clone()
    for i in range(R, 2 * R):  # the second copy: on the token after the earlier occurrence
        ind[i] = 0
        ind[i, i - R + 1] = 1
    assert float(induction_score(ind, R)) == 1.0
    assert float(duplicate_token_score(ind, R)) == 0.0
    dup = ind.clone()
    for i in range(R, 2 * R):
        dup[i] = 0
        dup[i, i - R] = 1
    assert float(duplicate_token_score(dup, R)) == 1.0
    assert float(induction_score(dup, R)) == 0.0
    batch = torch.stack([prev, uni])  # (2, T, T) -> (2,): scores keep leading dimensions
    assert previous_token_score(batch).tolist() == pytest.approx([1.0, want])


def test_head_scores_equal_loops_over_transformers_attention(tmp_path):
    ref = hf_decoder_folder("llama", tmp_path / "llama")
    lm = qkv.load(str(tmp_path / "llama"))
    tokens = lens.repeated_tokens(lm.model.cfg.vocab_size, repeat=7, batch=3, seed=5)
    sc = lens.score_model(lm.model, tokens)
    ref.config._attn_implementation = "eager"  # weights as transformers computes them
    with torch.no_grad():
        att = ref(tokens, output_attentions=True).attentions  # L x (B, H, T, T)
    R, T = 7, 14
    for layer in range(2):
        a = att[layer].double().mean(0)  # (H, T, T): the batch's mean pattern
        for h in range(4):
            prev = sum(float(a[h, i, i - 1]) for i in range(1, T)) / (T - 1)
            ind = sum(float(a[h, i, i - R + 1]) for i in range(R, T)) / R
            dup = sum(float(a[h, i, i - R]) for i in range(R, T)) / R
            first = sum(float(a[h, i, 0]) for i in range(1, T)) / (T - 1)
            assert float(sc.previous[layer, h]) == pytest.approx(prev, abs=1e-5)
            assert float(sc.induction[layer, h]) == pytest.approx(ind, abs=1e-5)
            assert float(sc.duplicate[layer, h]) == pytest.approx(dup, abs=1e-5)
            assert float(sc.first[layer, h]) == pytest.approx(first, abs=1e-5)
    with torch.no_grad():
        logits = ref(tokens).logits.double()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    assert sc.loss_first == pytest.approx(float(ce[:, : R - 1].mean()), abs=1e-5)
    assert sc.loss_second == pytest.approx(float(ce[:, R:].mean()), abs=1e-5)


def test_copy_effects_equal_transformers_with_a_heads_w_o_columns_zeroed(tmp_path):
    """Each head's rise of the repeat's loss when knocked out equals transformers' model with that
    head's rows of W_O's input zeroed by hand (GPT-2's c_proj), minus the intact model's loss;
    the heads named as copiers are those whose rise reaches COPY_AT of what the repeat saves."""
    import copy

    ref = hf_decoder_folder("gpt2", tmp_path / "gpt2")
    lm = qkv.load(str(tmp_path / "gpt2"))
    tokens = lens.repeated_tokens(lm.model.cfg.vocab_size, repeat=7, batch=3, seed=5)
    rise = lens.copy_effects(lm.model, tokens)
    R, H = 7, ref.config.n_head
    Dh = ref.config.n_embd // H

    def repeat_loss(model) -> float:
        with torch.no_grad():
            logits = model(tokens).logits.double()
        ce = torch.nn.functional.cross_entropy(logits[:, R:-1].transpose(1, 2), tokens[:, R + 1:])
        return float(ce)

    base = repeat_loss(ref)
    for layer in range(2):
        for h in range(H):
            knocked = copy.deepcopy(ref)
            with torch.no_grad():  # Conv1D: weight (in, out); head h's inputs are rows h*Dh..
                knocked.transformer.h[layer].attn.c_proj.weight[h * Dh:(h + 1) * Dh] = 0
            assert float(rise[layer, h]) == pytest.approx(repeat_loss(knocked) - base, abs=1e-4)
    sc = lens.head_scores(lm, repeat=7, batch=3, seed=5, effects=True)
    assert sc.copying is not None and sc.copying.shape == (2, H)
    for layer, h, r in sc.copiers(share=0.0):
        assert r >= 0.0 and float(sc.copying[layer, h]) == r
    want = sorted(((i // H, i % H) for i, v in enumerate(sc.copying.flatten().tolist())
                   if v >= 0.25 * sc.saved), key=lambda lh: -float(sc.copying[lh]))
    assert [(lay, h) for lay, h, _ in sc.copiers()] == (want if sc.saved > 0 else [])


def test_repeated_tokens_avoid_stop_ids_and_repeat():
    t = lens.repeated_tokens(10, repeat=50, batch=4, seed=0, avoid=(0, 3))
    assert t.shape == (4, 100) and torch.equal(t[:, :50], t[:, 50:])
    assert not torch.isin(t, torch.tensor([0, 3])).any()
    assert torch.equal(t, lens.repeated_tokens(10, repeat=50, batch=4, seed=0, avoid=(0, 3)))
    # a vocabulary large enough: no token twice in a half, so each has one earlier occurrence
    u = lens.repeated_tokens(30, repeat=24, batch=16, seed=0, avoid=(0,))
    assert all(len(set(row[:24].tolist())) == 24 for row in u) and not (u == 0).any()


def test_a_gpt_run_records_its_heads_at_every_evaluation(tiny_run):
    run = tiny_run("gpt")
    hist = read_history(run / "history.jsonl")
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [m["step"] for m in metrics if "val_loss" in m]
    assert hist is not None and hist.scores["induction"].shape == (len(rows), 2, 4)
    # the last row is the final model's scores on the same probe (the best weights are the last here)
    lm = qkv.load(str(run))
    avoid = lens.probe_avoid(lm.tokenizer, tuple(lm.stop_ids))
    assert avoid == tuple(i for i in range(lm.tokenizer.vocab_size) if "\n" in lm.tokenizer.decode([i]))
    probe = lens.repeated_tokens(lm.tokenizer.vocab_size, repeat=16, batch=8, seed=1234, avoid=avoid)
    now = lens.score_model(lm.model, probe)
    assert torch.allclose(hist.scores["previous"][-1], now.previous, atol=2e-4)
    assert (run / "heads.png").read_bytes().startswith(PNG)
    assert "heads: in-context copying: loss" in tiny_run.stdout("gpt")


# ------------------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    return hf_decoder_folder("gpt2", folder), str(folder)




def test_cli_probs_equal_transformers(gpt2):
    ref, folder = gpt2
    got = call_json(["lens", folder, "--prompt", TEXT, "--temperature", "0.7", "-k", "4", "--json"])
    with torch.no_grad():
        logits = ref(torch.tensor([[int(w[1:]) for w in TEXT.split()]])).logits[0, -1].double()
    want = torch.softmax(logits / 0.7, -1).topk(4)
    assert [t["id"] for t in got["top"]] == want.indices.tolist()
    assert [t["prob"] for t in got["top"]] == pytest.approx(want.values.tolist(), abs=1e-6)


def test_cli_views_agree_with_the_library(gpt2, tmp_path):
    _, folder = gpt2
    lm = qkv.load(folder)
    got = call_json(["lens", folder, TEXT, "--effects", "--heads", "--attribute", "w7", "--wrong", "w8",
                 "--patch", "--corrupt", TEXT.replace("w60", "w61"), "--answer", "w7", "--json"])
    eff = lens.head_effects(lm, TEXT, answer="w7", wrong="w8")  # --answer and --wrong apply to --effects too
    assert got["effects"]["metric"] == "logit difference"
    assert torch.allclose(torch.tensor(got["effects"]["effect"]), eff.effect, atol=1e-6)
    att = lens.attribute(lm, TEXT, "w7", "w8")
    assert got["attribute"]["total"] == pytest.approx(att.total, abs=1e-6)
    assert sum(got["attribute"]["parts"].values()) == pytest.approx(att.total, abs=1e-4)
    p = lens.patch(lm, TEXT, TEXT.replace("w60", "w61"), answer="w7", wrong="w8")
    assert got["patch"]["wrong"] == p.wrong
    assert torch.allclose(torch.tensor(got["patch"]["values"]), p.values, atol=1e-6)
    assert torch.allclose(torch.tensor(got["heads"]["induction"]), lens.head_scores(lm).induction, atol=1e-6)


def test_cli_patch_estimate_is_the_librarys_beside_the_exact_sweep(gpt2):
    _, folder = gpt2
    lm = qkv.load(folder)
    corrupt = TEXT.replace("w60", "w61")
    pair = ["--patch", "--corrupt", corrupt, "--site", "head", "--answer", "w7", "--wrong", "w8"]
    got = call_json(["lens", folder, TEXT, *pair, "--estimate", "--compare", "-k", "5", "--json"])
    est = lens.attribution_patch(lm, TEXT, corrupt, site="head", answer="w7", wrong="w8")
    exact = lens.patch(lm, TEXT, corrupt, site="head", answer="w7", wrong="w8")
    assert got["method"] == "attribution patching"
    assert torch.allclose(torch.tensor(got["values"]), est.values, atol=1e-6)
    assert torch.allclose(torch.tensor(got["exact_values"]), exact.values, atol=1e-6)
    agree = lens.agreement(est.values, exact.values, k=5)
    assert got["spearman"] == pytest.approx(agree.spearman)
    assert got["recall"] == agree.recall and got["k"] == 5
    alone = call_json(["lens", folder, TEXT, *pair, "--estimate", "--json"])
    assert "exact_values" not in alone and alone["values"] == got["values"]


def test_cli_heads_by_effect_are_the_librarys(gpt2):
    _, folder = gpt2
    got = call_json(["lens", folder, "--heads", "--by-effect", "--json"])
    sc = lens.head_scores(qkv.load(folder), effects=True)
    assert torch.allclose(torch.tensor(got["copying"]), sc.copying, atol=1e-6)
    assert got["copiers"] == [[layer, h, pytest.approx(r)] for layer, h, r in sc.copiers()]
    rc, out, err = call(["lens", folder, "--heads", "--by-effect"])
    assert rc == 0, err
    assert "heads by what they do" in out and ("copying" in out or "does not copy" in out)


def test_cli_writes_svg_png_and_json(gpt2, tmp_path):
    _, folder = gpt2
    rc, out, err = call(["lens", folder, TEXT, "--logit-lens", "-o", str(tmp_path / "lens.svg")])
    assert rc == 0, err
    root = ET.parse(tmp_path / "lens.svg").getroot()  # a standalone, valid SVG
    assert root.tag.endswith("svg")
    refs = [v for el in root.iter() for k, v in el.attrib.items() if k.endswith("href")]
    assert refs and all(r.startswith(("#", "data:")) for r in refs)  # nothing outside the file
    assert "logit lens" in out
    rc, out, err = call(["lens", folder, TEXT, "--probs", "--ablate", "0.1,1.2", "-o",
                         str(tmp_path / "v.png")])
    assert rc == 0, err
    assert (tmp_path / "v-probs.png").read_bytes().startswith(PNG)
    assert (tmp_path / "v-ablate.png").read_bytes().startswith(PNG)
    rc, _, err = call(["lens", folder, TEXT, "--logit-lens", "-o", str(tmp_path / "lens.json")])
    assert rc == 0, err
    data = json.loads((tmp_path / "lens.json").read_text())
    ll = lens.logit_lens(qkv.load(folder), TEXT)
    assert torch.allclose(torch.tensor(data["top_prob"]), ll.top(1)[0][..., 0], atol=1e-6)
    rc, _, err = call(["attend", folder, TEXT, "-o", str(tmp_path / "att.svg")])
    assert rc == 0, err
    assert ET.parse(tmp_path / "att.svg").getroot().tag.endswith("svg")


@pytest.mark.parametrize("extra, message", [
    (["--ablate", "2.7"], "head 2.7 is not in"),
    (["--ablate", "x"], "LAYER.HEAD"),
    (["--patch", "--corrupt", "w1 w2"], "same number of tokens"),
    (["--patch"], "--patch needs --corrupt"),
    (["--estimate"], "--estimate and --compare are for --patch"),
    (["--by-effect"], "--by-effect is for --heads"),
    (["--patch", "--corrupt", TEXT, "--compare"], "add --estimate"),
    (["--attribute", "w7 w8"], "must be one token"),
    (["--temperature", "0"], "temperature must be a number > 0"),
    (["-o", "x.gif"], "must name a .png, .svg, .pdf or .json file"),
])
def test_cli_bad_input_is_one_line(gpt2, extra, message):
    _, folder = gpt2
    rc, _, err = call(["lens", folder, TEXT, *extra])
    assert message in assert_one_line_error(rc, err)


def test_cli_refuses_what_a_model_kind_cannot_do(tiny_run):
    rc, _, err = call(["lens", str(tiny_run("seq2seq")), "abc", "--ablate", "0.0"])
    assert "the lens reads text models made of attention heads" in assert_one_line_error(rc, err)


def test_encoders_get_ablation_and_head_scores_not_predictions(tmp_path):
    from helpers import hf_bert_config, save_hf_folder

    torch.manual_seed(0)
    ref = transformers.BertModel(hf_bert_config()).eval()
    save_hf_folder(ref, tmp_path / "bert")
    folder = str(tmp_path / "bert")
    rc, _, err = call(["lens", folder, "w3 w4 w5", "--probs"])
    assert "is an encoder: it predicts no next token" in assert_one_line_error(rc, err)
    enc = qkv.load(folder)
    got = lens.ablate(enc, "w3 w4 w5", heads=[(1, 2)])
    import copy
    model = copy.deepcopy(enc.model)
    with torch.no_grad():
        model.stack.blocks[1].attn.out_proj.weight[:, 32:48] = 0
        want = model(torch.tensor([enc.tokenizer.encode("w3 w4 w5")])).hidden[0]
    assert (got - want).abs().max() <= 1e-6
    data = call_json(["lens", folder, "w3 w4 w5", "--effects", "--json"])
    assert data["metric"] == "embedding change" and len(data["effect"]) == 2


def test_repeats_corpus_writes_each_line_twice():
    from qkv.data.corpora import repeats_text

    text = repeats_text(n_lines=50, seed=3)
    assert text == repeats_text(n_lines=50, seed=3)
    lines = text.splitlines()
    assert len(lines) == 50
    for line in lines:
        half = len(line) // 2
        assert line[:half] == line[half:] and 8 <= half <= 30 and line.isalpha()


@pytest.mark.slow
def test_the_induction_preset_learns_to_copy_from_context(tmp_path):
    """The preset as a user runs it (about a minute on 2 cores): the loss on the repeated half
    falls well below the first half's, and one head of the second layer becomes an induction
    head (score from ~0.03 at step 0 past 0.5), the moment printed."""
    rc, out, err = call(["train", "gpt", "--preset", "induction", "--out_dir", str(tmp_path / "run"),
                         "--no-progress"])
    assert rc == 0, err
    hist = read_history(tmp_path / "run" / "history.jsonl")
    assert hist.copying_from() is not None
    assert hist.loss_first[-1] - hist.loss_second[-1] > 0.5
    best = hist.scores["induction"].flatten(1).max(1).values
    assert best[0] < 0.1 and best[-1] > 0.5
    assert hist.loss_second[-1] < 1.0  # copying, not guessing among 26 letters (3.3 nats)
    formed = hist.formed()["induction"]
    assert formed is not None and f"induction head formed at step {formed}" in out


def test_show_renders_standalone_svg_views_for_notebooks(gpt2, tmp_path):
    _, folder = gpt2
    lm = qkv.load(folder)
    shown = qkv.show(lm, TEXT, k=5)
    page = shown._repr_html_()
    assert page.count("<svg") == 3 and "<script" not in page
    for view in ("probs", "logit_lens", "heads"):
        root = ET.fromstring(shown.svg(view))
        refs = [v for el in root.iter() for k, v in el.attrib.items() if k.endswith("href")]
        assert all(r.startswith(("#", "data:")) for r in refs)
    top = lens.next_token(lm, TEXT, k=5).top
    assert all(p.token in shown.svg("probs") for p in top)  # the bars are labelled with the tokens
    paths = shown.save(tmp_path)
    assert sorted(p.name for p in paths) == ["heads.svg", "logit_lens.svg", "probs.svg"]
    with pytest.raises(qkv.errors.InputError, match="unknown view"):
        qkv.show(lm, TEXT, views=["nope"])


def test_show_draws_the_patch_estimate_and_beside_it_the_exact_sweep(gpt2):
    """qkv.show's patch view holds attribution patching's own table (a direct call, to 1e-6);
    compare=True adds the exact sweep's and names their agreement in the title."""
    from qkv.figures import Heatmap, Heatmaps

    _, folder = gpt2
    lm = qkv.load(folder)
    corrupt = "w3 w17 w42 w5 w88 w9 w1 w61 w17 w42"
    kw = dict(answer="w7", wrong="w8")
    shown = qkv.show(lm, TEXT, views=["patch"], corrupt=corrupt, **kw)
    est = lens.attribution_patch(lm, TEXT, corrupt, site="head", **kw)
    fig = shown.figures["patch"]
    assert isinstance(fig, Heatmap) and fig.diverging and list(shown.pictures) == ["patch"]
    assert torch.allclose(fig.values, est.values, atol=1e-6, rtol=0)
    assert fig.rows == [f"layer {i}" for i in range(lm.n_layers)] and len(fig.columns) == lm.n_heads
    assert "attribution patching" in fig.title and "<svg" in shown.svg("patch")
    resid = qkv.show(lm, TEXT, views=["patch"], corrupt=corrupt, site="resid", **kw).figures["patch"]
    assert torch.allclose(resid.values, lens.attribution_patch(lm, TEXT, corrupt, site="resid", **kw).values,
                          atol=1e-6, rtol=0)
    assert list(resid.columns) == est.clean_tokens
    both = qkv.show(lm, TEXT, views=["patch"], corrupt=corrupt, compare=True, **kw).figures["patch"]
    exact = lens.patch(lm, TEXT, corrupt, site="head", **kw)
    a = lens.agreement(est.values, exact.values)
    assert isinstance(both, Heatmaps) and len(both.panels) == 2
    assert torch.allclose(both.panels[0].values, est.values, atol=1e-6, rtol=0)
    assert torch.allclose(both.panels[1].values, exact.values, atol=1e-6, rtol=0)
    assert f"Spearman {a.spearman:.3f}, top-{a.k} recall {a.recall:.2f}" in both.title
    # the default views gain the patch view when a corrupt prompt is given
    views = list(qkv.show(lm, TEXT, corrupt=corrupt, **kw).pictures)
    assert views == ["probs", "logit_lens", "heads", "patch"]
    for bad, message in ((dict(views=["patch"]), "give corrupt="),
                         (dict(views=["probs"], corrupt=corrupt), "add 'patch' to views"),
                         (dict(views=["patch"], corrupt="w3 w17"), "same number of tokens")):
        with pytest.raises(qkv.errors.InputError, match=message) as e:
            qkv.show(lm, TEXT, **bad)
        assert "\n" not in str(e.value)
    q8 = qkv.load(folder, weights="int8")
    with pytest.raises(qkv.errors.InputError, match="weights='fp32'"):
        qkv.show(q8, TEXT, views=["patch"], corrupt=corrupt, **kw)


def test_cli_qk_is_the_library_row(gpt2):
    _, folder = gpt2
    got = call_json(["lens", folder, TEXT, "--qk", "1.2", "--query", "6", "--json"])
    qk = lens.query_key(qkv.load(folder), TEXT, 1, 2, 6)
    assert got["query_token"] == "w1" and got["keys"] == TEXT.split()[:7]
    assert torch.allclose(torch.tensor(got["weights"]), qk.weights, atol=1e-6)
    assert torch.allclose(torch.tensor(got["scaled"]), torch.tensor(got["dots"]) / 16 ** 0.5, atol=1e-5)
    rc, _, err = call(["lens", folder, TEXT, "--qk", "1.2,0.1"])
    assert "--qk takes one head" in assert_one_line_error(rc, err)


def test_cli_rollout_is_the_library_rollout(gpt2, tmp_path):
    _, folder = gpt2
    got = call_json(["lens", folder, TEXT, "--rollout", "--json"])
    tokens, r = lens.text_rollout(qkv.load(folder), TEXT)
    assert got["tokens"] == tokens and torch.allclose(torch.tensor(got["rollout"]), r, atol=1e-6)
    rc, out, err = call(["lens", folder, TEXT, "--rollout", "-o", str(tmp_path / "r.png")])
    assert rc == 0, err
    assert (tmp_path / "r.png").read_bytes().startswith(PNG) and "attention rollout" in out
