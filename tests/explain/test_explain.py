"""`qkv explain TOPIC`: every topic's numbers against values computed here independently (hand
computation, float64 math, plain torch ops), one CLI run per topic, and one-line errors.

Topics that need MiniLM (retrieval's embedding column, context) or SmolLM2 (cost --model smollm2)
skip those checks when the asset is absent, with the reason every asset skip gives ("asset
missing: NAME (qkv assets install NAME)", tests/pretrained/asset_skip.py); CI installs both.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from helpers import PNG, assert_one_line_error, call, softmax64
from pretrained.asset_skip import require_asset

from qkv.explain import TOPICS
from qkv.explain.context import explain_context
from qkv.explain.cost import kv_cache_rows, layer_flops, lecture_cost, model_config, model_cost
from qkv.explain.equivariance import explain_equivariance
from qkv.explain.lookup import explain_lookup
from qkv.explain.retrieval import DOCUMENTS, explain_retrieval, tfidf_example
from qkv.explain.scaling import expected_score_moments, explain_scaling
from qkv.explain.softmax import explain_softmax
from qkv.explain.worked_example import explain_worked_example

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def table_rows(out: str, title: str) -> dict[str, list[str]]:
    """The rows of the rich table printed under the line that starts with ``title``: first
    cell -> the other cells, stripped (a first cell cut to fit ends in "…")."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1:]:
        if line.startswith("└"):
            break
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            rows[cells[0]] = cells[1:]
    return rows


@pytest.fixture
def no_assets(monkeypatch):
    """Every asset looks absent, exactly as on a bare machine."""
    import qkv.assets

    monkeypatch.setattr(qkv.assets, "_files", lambda asset: None)


# --------------------------------------------------------------------------- softmax


def test_softmax_numbers() -> None:
    r = explain_softmax([1, 2, 3], [0.5, 2])
    assert r.hardmax == [0, 0, 1]
    assert r.softmax == pytest.approx(softmax64([1, 2, 3]), abs=1e-15)
    assert [round(p, 2) for p in r.softmax] == [0.09, 0.24, 0.67]  # the notes write 0.66: truncated
    assert r.tempered[0] == pytest.approx(softmax64([2, 4, 6]), abs=1e-15)  # T = 0.5
    assert r.tempered[1] == pytest.approx(softmax64([0.5, 1, 1.5]), abs=1e-15)  # T = 2
    # Row by row: [3, 2, 1] reverses the weights; [1001, 1002, 1003] is shift invariant.
    assert r.matrix_softmax[1] == pytest.approx(softmax64([3, 2, 1]), abs=1e-15)
    assert r.matrix_softmax[2] == pytest.approx(r.matrix_softmax[0], abs=1e-15)
    assert r.naive_finite == [True, True, False]  # e^1003 overflows float64


def test_softmax_cli_prints_the_lectures_numbers_and_a_plot(tmp_path: Path) -> None:
    out_png = tmp_path / "softmax.png"
    rc, out, err = call(["explain", "softmax", "--temperature", "0.5", "--plot", str(out_png)])
    assert rc == 0, err
    expected = [f"{p:.4f}" for p in softmax64([1, 2, 3])]  # the lecture's 0.09, 0.24, 0.67
    expected.append(f"{softmax64([2, 4, 6])[2]:.4f}")  # T = 0.5 sharpens the top weight
    for text in [*expected, "NaN"]:  # NaN: the naive e^x / Σe^x of [1001, 1002, 1003]
        assert text in out
    assert out_png.read_bytes().startswith(PNG)


# --------------------------------------------------------------------------- lookup


def test_lookup_numbers() -> None:
    r = explain_lookup(queries=[[0, 1, 0], [1, 1, 0]], sharpness=[1, 10])
    assert r.names == ["A", "B", "C"] and r.values == [51, 42, 31]
    # Hardmax: the exact dictionary, and the even mix for the ambiguous query.
    assert r.hard[0].value == 42 and r.hard[0].weights == [0, 1, 0]
    assert r.hard[1].value == pytest.approx((51 + 42) / 2, abs=1e-12)
    for i, q in enumerate([[0, 1, 0], [1, 1, 0]]):
        for j, s in enumerate([1, 10]):
            p = softmax64([s * x for x in q])  # one-hot keys: qᵀk_i = q_i
            assert r.soft[i][j].weights == pytest.approx(p, abs=1e-14)
            assert r.soft[i][j].value == pytest.approx(51 * p[0] + 42 * p[1] + 31 * p[2], abs=1e-12)
    assert r.soft[0][0].value == pytest.approx(41.5761, abs=1e-4)  # s = 1: not quite 42


def test_lookup_cli() -> None:
    rc, out, err = call(["explain", "lookup", "--query", "1", "1", "0", "--sharpness", "1"])
    assert rc == 0, err
    p = softmax64([1, 1, 0])  # one-hot keys, query [1, 1, 0], sharpness 1
    hard, soft = (51 + 42) / 2, 51 * p[0] + 42 * p[1] + 31 * p[2]  # hardmax splits the tie
    assert f"{hard:.4f}" in out and f"{soft:.4f}" in out and "51" in out


# --------------------------------------------------------------------------- retrieval


def _words(text: str) -> list[str]:
    return "".join(c if c.isalnum() or c == "'" else " " for c in text.lower()).split()


def test_tfidf_example_by_hand() -> None:
    ex = tfidf_example()
    assert ex.tf == 0.02
    assert ex.idf == pytest.approx(math.log(10 / 3), abs=1e-15)
    assert ex.tfidf == pytest.approx(0.02 * 1.2039728043259361, abs=1e-15)
    assert ex.tfidf_log10 == pytest.approx(0.02 * math.log10(10 / 3), abs=1e-15)


def test_retrieval_bag_of_words_and_tfidf() -> None:
    query = "a puppy playing in the park"
    r = explain_retrieval(query, encoder=None)
    docs = [_words(d) for d in DOCUMENTS]
    vocab = sorted({w for d in docs for w in d})
    q = _words(query)
    assert r.bow == [sum(d.count(w) for w in q) for d in docs]  # counts·counts
    df = {w: sum(w in d for d in docs) for w in vocab}
    idf = {w: math.log(len(docs) / df[w]) for w in vocab}
    known = [w for w in q if w in idf]

    def vec(words: list[str]) -> list[float]:
        return [words.count(w) / len(words) * idf[w] for w in vocab]

    qv = vec(known)
    for got, d in zip(r.tfidf, docs, strict=True):
        dv = vec(d)
        dot = sum(a * b for a, b in zip(qv, dv, strict=True))
        assert got == pytest.approx(dot / math.hypot(*qv) / math.hypot(*dv), abs=1e-12)
    assert r.unknown_words == ["puppy", "playing"]
    assert max(range(8), key=lambda i: r.tfidf[i]) == 1  # the word "park" wins under TF-IDF
    # Without MiniLM, attention runs over the TF-IDF vectors: softmax(10 · cosine).
    assert r.minilm is None and r.attention_over == "TF-IDF"
    assert r.attention == pytest.approx(softmax64([10 * c for c in r.tfidf]), abs=1e-12)
    assert r.attention_nearest == 1


def test_retrieval_with_minilm(minilm) -> None:
    query = "a puppy playing in the park"
    r = explain_retrieval(query, encoder=minilm, sharpness=10)
    e = minilm.embed([query, *DOCUMENTS]).double()
    cos = [float(torch.dot(e[0], d) / (e[0].norm() * d.norm())) for d in e[1:]]
    assert r.minilm == pytest.approx(cos, abs=1e-5)
    assert max(range(8), key=lambda i: cos[i]) == 0  # "puppy" finds the dog without a shared word
    assert r.attention == pytest.approx(softmax64([10 * c for c in cos]), abs=1e-4)
    assert r.attention_nearest == 0


def test_retrieval_cli_without_minilm_says_how_to_install(no_assets) -> None:
    rc, out, err = call(["explain", "retrieval", "--doc", "the cat sat", "--doc", "a dog ran",
                         "--query", "cat"])
    assert rc == 0, err
    idf = math.log(1000 / 300)  # the hand example: 2 times in 100 words, in 300 of 1,000 documents
    assert f"idf = ln(1000/300) = {idf:.5f}" in out and f"tf-idf = {0.02 * idf:.5f}" in out
    assert "qkv assets install minilm" in out


def test_retrieval_cli_with_minilm(minilm_cli) -> None:
    rc, out, err = call(["explain", "retrieval"])
    assert rc == 0, err
    rows = table_rows(out, "query: ")
    assert len(rows) == len(DOCUMENTS)
    # The reference: cosines of the query's and documents' embeddings in float64, ranked by
    # hand, and attention = softmax(10 · cosine) in float64.
    e = minilm_cli.embed(["a puppy playing in the park", *DOCUMENTS]).double()
    cos = [float(torch.dot(e[0], d) / (e[0].norm() * d.norm())) for d in e[1:]]
    rank = {i: r + 1 for r, i in enumerate(sorted(range(len(cos)), key=lambda i: -cos[i]))}
    attention = softmax64([10 * c for c in cos])
    for i, (first, cells) in enumerate(rows.items()):
        assert first.startswith(f"{i + 1}. {DOCUMENTS[i][:10]}")
        printed, printed_rank = re.fullmatch(r"(-?[0-9.]+) \((\d+)\)", cells[2]).groups()
        assert float(printed) == pytest.approx(cos[i], abs=5e-4 + 1e-6)  # printed to 3 decimals
        assert int(printed_rank) == rank[i]
        assert float(cells[3]) == pytest.approx(attention[i], abs=5e-4 + 1e-6)
    assert rank[0] == 1  # "puppy" finds the dog document without a shared word


# --------------------------------------------------------------------------- scaling


def test_scaling_variance_grows_like_d_and_scaling_fixes_it() -> None:
    r = explain_scaling(dims=[4, 64, 1024], samples=1000, keys=16, seed=1)
    for row in r.rows:
        assert row.expected_var == row.d and row.expected_mean == 0
        # 16,000 scores per width: the sample variance is within a few percent of d.
        assert row.var == pytest.approx(row.d, rel=0.1)
        assert row.var_scaled == pytest.approx(1.0, rel=0.1)
        assert 0 < row.entropy < math.log(16) and 0 < row.entropy_scaled < math.log(16)
    top = [row.max_weight for row in r.rows]
    assert top == sorted(top) and top[-1] > 0.9  # unscaled: ever more peaked
    assert all(abs(row.max_weight_scaled - r.rows[0].max_weight_scaled) < 0.05 for row in r.rows)
    assert r.rows[-1].saturated > 0.5 and r.rows[-1].saturated_scaled == 0


def test_scaling_moments_for_any_mean_and_variance() -> None:
    # q·k = Σ q_i k_i; E[q_i k_i] = μ², Var(q_i k_i) = E[q²]E[k²] − μ⁴ = (σ²+μ²)² − μ⁴.
    mu, sigma, d = 0.5, 2.0, 10
    var = d * ((sigma**2 + mu**2) ** 2 - mu**4)
    assert expected_score_moments(d, mu, sigma) == pytest.approx((d * mu**2, var))
    r = explain_scaling(dims=[10], samples=2000, keys=8, mu=mu, sigma=sigma)
    assert r.rows[0].mean == pytest.approx(d * mu**2, abs=0.3)
    assert r.rows[0].var == pytest.approx(var, rel=0.1)


def test_scaling_cli(tmp_path: Path) -> None:
    rc, out, err = call(["explain", "scaling", "--dims", "4", "256", "--samples", "200",
                         "--plot", str(tmp_path / "s.png")])
    assert rc == 0, err
    assert re.search(r"│ 256 +│ +0 │", out) and "256" in out
    assert (tmp_path / "s.png").read_bytes().startswith(PNG)


# --------------------------------------------------------------------------- worked example


def test_worked_example_by_hand() -> None:
    r = explain_worked_example()
    # Discussion 10: q_i = W_Qᵀx_i etc., worked out by hand.
    assert r.q == [[2, 3, -5], [-1, 0, -2], [1, -2, 8]]
    assert r.k == [[-6, 0, 1], [0, 0, 1], [4, 0, -3]]
    assert r.v == [[16, 27], [-8, 0], [8, -18]]
    assert r.scores == [[-17, -5, 23], [4, -2, 2], [2, 8, -20]]
    for i in range(3):
        p = softmax64([s / math.sqrt(3) for s in r.scores[i]])
        assert r.weights[i] == pytest.approx(p, abs=1e-15)
        z = [sum(p[j] * r.v[j][c] for j in range(3)) for c in range(2)]
        assert r.out[i] == pytest.approx(z, abs=1e-12)
    # The Discussion's unscaled softmax: 0.9975 on x2.
    assert r.unscaled_weights[2][1] == pytest.approx(1 / (1 + math.exp(-6) + math.exp(-28)), abs=1e-15)
    assert round(r.unscaled_weights[2][1], 4) == 0.9975
    for i in range(3):  # the Discussion's outputs, unscaled
        p = softmax64(r.scores[i])
        assert r.unscaled_out[i] == pytest.approx([sum(p[j] * r.v[j][c] for j in range(3)) for c in range(2)],
                                                  abs=1e-12)
    # The matrix form, with torch's own softmax.
    X = torch.tensor(r.x, dtype=torch.float64)
    Q, K, V = (X @ torch.tensor(w, dtype=torch.float64) for w in (r.w_q, r.w_k, r.w_v))
    Z = torch.softmax(Q @ K.T / math.sqrt(3), dim=-1) @ V
    assert torch.allclose(Z, torch.tensor(r.matrix_out, dtype=torch.float64), atol=1e-12)
    assert r.max_abs_diff < 1e-12


def test_worked_example_unscaled_and_cli(tmp_path: Path) -> None:
    r = explain_worked_example(scaled=False)
    assert r.scale == 1 and r.weights == r.unscaled_weights
    rc, out, err = call(["explain", "worked-example", "--plot", str(tmp_path / "w.png")])
    assert rc == 0, err
    for text in ("[2, 8, -20]", "0.9975", "[1, -2, 8]", "equal in float64"):
        assert text in out
    # the notes' numbers come first, labelled; qkv's scaled convention after them
    first, answer = out.index("as Discussion 10 computes it"), out.index("0.9975")
    assert first < answer < out.index("Transformer's scaling")
    assert (tmp_path / "w.png").read_bytes().startswith(PNG)


# --------------------------------------------------------------------------- equivariance


def test_equivariance() -> None:
    r = explain_equivariance(tokens=5, dim=8, heads=2, seed=3)
    assert sorted(r.permutation) == list(range(5)) and r.permutation != list(range(5))
    plain, positions, causal = r.cases
    assert plain.equivariant and plain.max_abs_diff < 1e-12
    assert not positions.equivariant and positions.max_abs_diff > 1e-3
    assert not causal.equivariant and causal.max_abs_diff > 1e-3
    assert r.pooled_diff["no positions"] < 1e-12  # same words, another order: same mean
    assert r.pooled_diff["+ sinusoidal positions"] > 1e-3


def test_equivariance_cli() -> None:
    rc, out, err = call(["explain", "equivariance", "--tokens", "4"])
    assert rc == 0, err
    assert "yes: equivariant" in out and out.count(" no ") >= 2


# --------------------------------------------------------------------------- cost


def test_cost_lecture_table() -> None:
    n, d = 196, 768
    c = lecture_cost(n, d)
    assert c.qkv_params == 3 * d * d and c.out_params == d * d
    assert c.fc_params == (n * d) ** 2 == 22_658_678_784
    assert c.proj_flops == 2 * 4 * n * d * d  # Q, K, V, O: a multiply-add is 2 FLOPs
    assert c.score_flops == 2 * 2 * n * n * d  # QKᵀ and AV
    assert c.fc_flops == 2 * (n * d) ** 2


def test_cost_of_a_preset() -> None:
    cfg = model_config("tiny")  # 2 layers, width 32, 4 heads of 8, GELU MLP 4x
    L, dim, H, Dh, T = 2, 32, 4, 8, 32
    rows = kv_cache_rows(cfg, T, "bfloat16")
    assert [(r.kind, r.kv_heads) for r in rows] == [("MHA", 4), ("GQA", 2), ("MQA", 1)]
    assert [r.bytes for r in rows] == [2 * L * k * T * Dh * 2 for k in (4, 2, 1)]
    assert [r.actual for r in rows] == [True, False, False]
    lf = layer_flops(cfg, 100)
    assert lf.proj == 2 * 100 * dim * 3 * H * Dh + 2 * 100 * H * Dh * dim
    assert lf.scores == 2 * 2 * 100 * 100 * H * Dh
    assert lf.mlp == 2 * 100 * dim * 4 * dim * 2
    m = model_cost("tiny", dtype="float32")
    mlp_per_token, proj_per_token = 2 * dim * 4 * dim * 2, 2 * dim * 4 * dim
    assert m.crossover_scores == pytest.approx(mlp_per_token / (4 * H * Dh))
    assert m.crossover_attn == pytest.approx((mlp_per_token - proj_per_token) / (4 * H * Dh))
    assert m.kv[0].bytes == 2 * L * H * cfg.max_seq_len * Dh * 4


def test_cost_of_smollm2() -> None:
    require_asset("smollm2")
    pytest.importorskip("gguf", reason="gguf not installed: pip install 'qkv[pretrained]'")
    m = model_cost("smollm2", context=8192)
    cfg = m.config
    sizes = (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim)
    assert sizes == (30, 576, 9, 3, 64)
    by_k = {r.kv_heads: r for r in m.kv}
    assert by_k[3].actual and by_k[3].bytes == 2 * 30 * 3 * 64 * 8192 * 2 == 188_743_680
    assert by_k[9].bytes == 3 * by_k[3].bytes and by_k[1].bytes == by_k[3].bytes // 3
    mlp = 2 * 576 * 1536 * 3  # SwiGLU: three matrices
    assert m.crossover_scores == pytest.approx(mlp / (4 * 9 * 64))  # 2304 tokens


def test_cost_cli(tmp_path: Path) -> None:
    rc, out, err = call(["explain", "cost", "--n", "196", "--d", "768", "--model", "tiny",
                         "--plot", str(tmp_path / "c.png")])
    assert rc == 0, err
    n, d = 196, 768
    kv_per_token = 2 * 2 * 4 * 8 * 2  # tiny preset: K and V, 2 layers, 4 heads of 8, bf16 (the default)
    kv_bytes = kv_per_token * model_config("tiny").max_seq_len
    for text in (f"{3 * d * d:,} (3D²)", f"{(n * d) ** 2:,} (N²D²)", f"{2 * (n * d) ** 2 / 1e9:.2f}G (2N²D²)",
                 "(this model)", f"{kv_bytes:,} ({kv_bytes / 1024:.1f} KiB)", f"{kv_per_token} B"):
        assert text in out
    assert (tmp_path / "c.png").read_bytes().startswith(PNG)


def test_cost_cli_without_smollm2(no_assets) -> None:
    rc, out, err = call(["explain", "cost"])  # falls back to a preset, and says so
    assert rc == 0, err
    assert "qkv assets install smollm2" in out and "shakespeare-char" in out
    line = assert_one_line_error(*call(["explain", "cost", "--model", "smollm2"])[::2])
    assert "qkv assets install smollm2" in line


# --------------------------------------------------------------------------- context


def test_context_numbers(minilm) -> None:
    r = explain_context(minilm)
    model, tok = minilm.model, minilm.tokenizer.tokenizer
    # The last layer's "bank" vectors, straight from the encoder's output.
    vecs = []
    for text in r.bank.sentences:
        enc = tok.encode(text)
        with torch.no_grad():
            h = model(torch.tensor([enc.ids])).hidden[0].double()
        vecs.append(h[enc.tokens.index("bank")])
    for i in range(4):
        for j in range(4):
            c = float(torch.dot(vecs[i], vecs[j]) / (vecs[i].norm() * vecs[j].norm()))
            assert r.bank.cosine[-1][i][j] == pytest.approx(c, abs=1e-5)
    assert r.bank.within is not None and r.bank.across is not None
    assert r.bank.within[-1] > r.bank.across[-1]  # context separates the two senses
    # "about 0.9 river + 0.1 money" (the notes): sentence 1's last vector projected on the line
    # between the other river sentence and the mean of the two money sentences, by hand
    a, b = vecs[1], (vecs[2] + vecs[3]) / 2
    w = float(torch.dot(vecs[0] - b, a - b) / torch.dot(a - b, a - b))
    assert r.bank.share[-1][0] == pytest.approx(min(max(w, 0.0), 1.0), abs=1e-5)
    assert r.bank.sense_names == ("river", "money")
    assert abs(r.bank.within[0] - r.bank.across[0]) < 0.01  # the embeddings barely do
    # Layer 1's attention of "it", by hand from the embeddings and the first block's weights.
    it = r.it[0]
    ids = torch.tensor([tok.encode(it.sentence).ids])
    with torch.no_grad():
        x = model.emb_norm(model.tok_emb(ids) + model.pos_emb.weight[: ids.shape[1]]
                           + model.type_emb(torch.zeros_like(ids)))[0].double()
        w = model.stack.blocks[0].attn.qkv
        qkv = x @ w.weight.double().T + w.bias.double()
    q, k = qkv[:, :384].view(-1, 12, 32), qkv[:, 384:768].view(-1, 12, 32)
    scores = torch.einsum("hd,shd->hs", q[it.it], k) / math.sqrt(32)
    assert torch.allclose(torch.tensor(it.weights[0], dtype=torch.float64), torch.softmax(scores, dim=-1),
                          atol=1e-5)
    for layer in it.weights:
        sums = torch.tensor(layer, dtype=torch.float64).sum(-1)
        assert torch.allclose(sums, torch.ones(12, dtype=torch.float64), atol=1e-5)


def _it_weights_by_hand(encoder, sentence: str) -> tuple[list[str], torch.Tensor]:
    """(tokens, (layers, heads, T) float64): every head's softmax(q·k/√32) row of "it", from
    each block's own input and its Q/K weights (hooks only read the inputs)."""
    model, tok = encoder.model, encoder.tokenizer.tokenizer
    enc = tok.encode(sentence)
    inputs: list[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda m, args: inputs.append(args[0][0].detach().double()))
             for b in model.stack.blocks]
    try:
        with torch.no_grad():
            model(torch.tensor([enc.ids]))
    finally:
        for h in hooks:
            h.remove()
    j, rows = enc.tokens.index("it"), []
    for x, block in zip(inputs, model.stack.blocks, strict=True):
        w = block.attn.qkv
        qkv = x @ w.weight.detach().double().T + w.bias.detach().double()  # (T, 3 · 384)
        q, k = qkv[j, :384].view(12, 32), qkv[:, 384:768].view(-1, 12, 32)  # (H, D), (T, H, D)
        rows.append(torch.softmax(torch.einsum("hd,thd->ht", q, k) / math.sqrt(32), dim=-1))
    return list(enc.tokens), torch.stack(rows)


def test_context_cli(minilm_cli, tmp_path: Path) -> None:
    from qkv.explain.context import IT_SENTENCES

    rc, out, err = call(["explain", "context", "--plot", str(tmp_path / "ctx.png")])
    assert rc == 0, err
    assert (tmp_path / "ctx.png").read_bytes().startswith(PNG)
    by_hand = [_it_weights_by_hand(minilm_cli, s) for s in IT_SENTENCES]  # "...tired", "...wide"
    # The per-layer tables: the mean over the 12 heads of the weight on each candidate.
    for sentence, (tokens, w) in zip(IT_SENTENCES, by_hand, strict=True):
        rows = table_rows(out, repr(sentence))
        assert list(rows) == [str(layer + 1) for layer in range(w.shape[0])]
        for layer, cells in enumerate(rows.values()):
            mean = w[layer].mean(0)
            assert float(cells[0]) == pytest.approx(float(mean[tokens.index("animal")]), abs=5e-4 + 1e-6)
            assert float(cells[1]) == pytest.approx(float(mean[tokens.index("street")]), abs=5e-4 + 1e-6)
    # The single-head table: the head that puts the most weight on "animal" in "...tired" and
    # the one on "street" in "...wide", found here by argmax over every (layer, head).
    heads = table_rows(out, "single heads:")
    expected = {}
    for (tokens, w), target in zip(by_hand, ("animal", "street"), strict=True):
        weight = w[:, :, tokens.index(target)]  # (layers, heads)
        layer, head = divmod(int(weight.argmax()), weight.shape[1])
        expected[f"layer {layer + 1} head {head + 1}"] = [
            float(ww[layer, head, tt.index(n)]) for tt, ww in by_hand for n in ("animal", "street")]
    assert list(heads) == list(expected)
    for name, want in expected.items():
        assert [float(c) for c in heads[name]] == pytest.approx(want, abs=5e-4 + 1e-6)
    # The "bank" table: cosines of the word's vector after each layer, averaged by hand over
    # the 6 pairs, the 2 same-sense pairs (river 1-2, money 3-4) and the 4 others.
    model, tok = minilm_cli.model, minilm_cli.tokenizer.tokenizer
    vecs = []  # per sentence: (layers + 1, dim), layer 0 = the embeddings
    for text in ("I swam across the river to get to the other bank.",
                 "We sat on the bank of the river and watched the water.",
                 "I deposited my paycheck at the bank.", "The bank approved my loan application."):
        enc, states = tok.encode(text), []

        def keep(module, args, output, states=states) -> None:
            states.append(output[0] if isinstance(output, tuple) else output)

        hooks = [m.register_forward_hook(keep) for m in (model.emb_norm, *model.stack.blocks)]
        try:
            with torch.no_grad():
                model(torch.tensor([enc.ids]))
        finally:
            for h in hooks:
                h.remove()
        vecs.append(torch.stack([st[0, enc.tokens.index("bank")].double() for st in states]))
    rows = table_rows(out, "cosine between the 'bank' vectors")
    assert list(rows) == ["0 (embeddings)", "1", "2", "3", "4", "5", "6"]
    for layer, cells in enumerate(rows.values()):
        def cos(i: int, j: int, layer: int = layer) -> float:
            a, b = vecs[i][layer], vecs[j][layer]
            return float(torch.dot(a, b) / (a.norm() * b.norm()))

        pairs = [cos(i, j) for i in range(4) for j in range(i + 1, 4)]
        same, other = (cos(0, 1) + cos(2, 3)) / 2, (cos(0, 2) + cos(0, 3) + cos(1, 2) + cos(1, 3)) / 4
        want = [sum(pairs) / 6, same, other, same - other]
        assert [float(c) for c in cells] == pytest.approx(want, abs=5e-4 + 1e-6)


def test_context_rejects_sentences_without_the_word(minilm_cli) -> None:
    line = assert_one_line_error(*call(["explain", "context", "--sentence", "a river bank",
                                        "--sentence", "no such word here"])[::2])
    assert "does not contain 'bank'" in line


def test_context_without_minilm_names_the_install_command(no_assets) -> None:
    line = assert_one_line_error(*call(["explain", "context"])[::2])
    assert "qkv assets install minilm" in line


# --------------------------------------------------------------------------- the command


def test_no_topic_lists_the_topics() -> None:
    rc, out, _ = call(["explain"])
    assert rc == 0
    for name, topic in TOPICS.items():
        assert name in out and topic.help in out


@pytest.mark.parametrize("topic", sorted(TOPICS))
def test_topic_help(topic: str) -> None:
    rc, out, _ = call(["explain", topic, "--help"])
    assert rc == 0 and f"qkv explain {topic}" in out and "options:" in out


@pytest.mark.parametrize("argv, message", [
    (["nope"], "choose from: softmax, lookup, retrieval"),
    (["softmax", "--temperature", "0"], "--temperature values must be > 0"),
    (["softmax", "--values", "1"], "--values needs two or more"),
    (["softmax", "--values", "x"], "invalid float value: 'x'"),
    (["softmax", "--bogus"], "unrecognized arguments: --bogus"),
    (["softmax", "--plot", "out.jpg"], "--plot must name a .png, .svg or .pdf file"),
    (["softmax", "--plot", "no/such/folder/out.png"], "does not exist"),
    (["lookup", "--query", "1", "0"], "give 3 numbers"),
    (["lookup", "--entries", "A51"], "NAME=VALUE"),
    (["scaling", "--samples", "1"], "--samples must be >= 2"),
    (["scaling", "--dims", "0"], "--dims must be >= 1"),
    (["equivariance", "--dim", "6", "--heads", "4"], "--heads must divide --dim"),
    (["cost", "--model", "gpt5"], "invalid choice: 'gpt5'"),
    (["cost", "--n", "0"], "--n must be >= 1"),
    (["retrieval", "--doc", "only one"], "--doc at least twice"),
    (["worked-example", "--plot", "x.gif"], "--plot must name a .png, .svg or .pdf file"),
])
def test_bad_input_is_one_line(argv: list[str], message: str) -> None:
    line = assert_one_line_error(*call(["explain", *argv])[::2])
    assert message in line
