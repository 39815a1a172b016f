"""Issue 28: sections of the lectures qkv did not show (masking, Q ≠ K, head counts) and the notes'
own numbers, each against a computation written out here."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import assert_one_line_error, call

from qkv.attention import MultiHeadAttention
from qkv.explain import explain_masking, explain_qk
from qkv.explain.masking import QK_TOKENS, TOKENS


def projections(dim: int, seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The topic's layer rebuilt from its seed, and its q, k of the topic's tokens, by hand."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(dim, 1).double()
    x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    w, b = layer.qkv.weight.detach(), layer.qkv.bias.detach()
    return x @ w[:dim].T + b[:dim], x @ w[dim : 2 * dim].T + b[dim : 2 * dim]


def test_masking_by_hand() -> None:
    r = explain_masking(dim=8, seed=3)
    T = len(TOKENS)
    q, k = projections(8, 3, T)
    E = q @ k.T / math.sqrt(8)
    torch.testing.assert_close(torch.tensor(r.scores, dtype=torch.float64), E, atol=1e-12, rtol=0)
    M = torch.tensor(r.mask)
    assert (M.triu(1) == float("-inf")).sum() == T * (T - 1) // 2 and (M.tril() == 0).all()
    W = torch.tensor(r.weights, dtype=torch.float64)
    for i in range(T):  # each row: the softmax of the allowed scores alone, zeros after
        want = torch.exp(E[i, : i + 1] - E[i, : i + 1].max())
        torch.testing.assert_close(W[i, : i + 1], want / want.sum(), atol=1e-12, rtol=0)
        assert (W[i, i + 1 :] == 0).all()
    assert r.future_weight == 0 and r.row_vs_prefix < 1e-12 and r.layer_vs_manual < 1e-12
    assert r.prefix_output < 1e-12


def test_tied_queries_and_keys_give_symmetric_scores() -> None:
    r = explain_qk(dim=8, seed=5)
    q, k = projections(8, 5, len(QK_TOKENS))
    tied = torch.tensor(r.tied, dtype=torch.float64)
    torch.testing.assert_close(tied, q @ q.T / math.sqrt(8), atol=1e-12, rtol=0)  # W_K := W_Q
    torch.testing.assert_close(torch.tensor(r.separate, dtype=torch.float64), q @ k.T / math.sqrt(8),
                               atol=1e-12, rtol=0)
    assert (tied - tied.T).abs().max() < 1e-12 and r.tied_asymmetry < 1e-12
    assert r.separate_asymmetry > 0.1 and r.tied_weights_asymmetry > 0.01 and r.hand < 1e-12


def test_cli_prints_the_mask_and_refuses_a_bad_width() -> None:
    rc, out, err = call(["explain", "masking"])
    assert rc == 0 and "−∞" in out and "softmax(E + M)" in out and "1.000" in out, err
    rc, out, err = call(["explain", "qk", "--dim", "4"])
    assert rc == 0 and "W_Q = W_K" in out and "max |s_ij − s_ji|" in out
    rc, _, err = call(["explain", "qk", "--dim", "0"])
    assert "--dim must be in 1..1024" in assert_one_line_error(rc, err)


def test_head_counts_both_ways_and_gqa() -> None:
    from qkv.explain import explain_heads

    d, h, kv = 64, 4, 2
    full, split, gqa = explain_heads(d, h, kv).designs
    assert (full.qkv_params, full.out_params) == (3 * h * d * d, h * d * d)  # CS189: 3d² -> 3hd²
    assert (split.qkv_params, split.out_params) == (3 * d * d, d * d)  # CS231N: d/h per head
    assert gqa.qkv_params == d * d + 2 * kv * (d // h) * d and gqa.kv_cache_per_token == 2 * kv * (d // h)
    assert [x.module_params for x in (full, split, gqa)] == [x.total for x in (full, split, gqa)]
    theirs = torch.nn.MultiheadAttention(d, h, bias=False)  # PyTorch's own: heads of width d/h
    assert sum(p.numel() for p in theirs.parameters()) == split.total
    rc, out, err = call(["explain", "heads", "--dim", "64", "--heads", "4", "--kv-heads", "2"])
    assert rc == 0 and f"{full.total:,}" in out and f"{split.total:,}" in out, err
    rc, _, err = call(["explain", "heads", "--kv-heads", "5"])
    assert "--kv-heads must divide --heads (12)" in assert_one_line_error(rc, err)


def test_where_the_notes_differ_the_output_says_so() -> None:
    """Each in one labelled line, with the number computed (independently checked here)."""
    third = math.exp(3) / (math.exp(1) + math.exp(2) + math.exp(3))
    rc, out, _ = call(["explain", "softmax"])
    assert rc == 0 and "[0.09, 0.24, 0.66]" in out and f"{third:.4f}" in out and "truncated" in out
    soft = (math.exp(0) * 51 + math.exp(1) * 42 + math.exp(0) * 31) / (2 + math.e)
    rc, out, _ = call(["explain", "lookup"])
    assert rc == 0 and '"exactly 42"' in out and f"{soft:.4f}" in " ".join(out.split())
    rc, out, _ = call(["explain", "equivariance"])
    assert rc == 0 and "permutation-invariant in one place" in " ".join(out.split())


def test_a_post_ln_gpt_computes_the_papers_block_trains_resumes_and_is_not_exported(tmp_path) -> None:
    """--norm_placement post: x = LN(x + Attn(x)); x = LN(x + MLP(x)), no final norm (Vaswani et
    al. 2017; CS231N Lec 8), checked by hand on a 1-layer model; `qkv train gpt` trains and resumes
    it; the cached decode equals recomputing; export refuses it in one line (no reader has it)."""
    import torch.nn.functional as F
    from helpers import TINY_TEXT, flags, metrics, tiny_train

    from qkv.generation import generate
    from qkv.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=20, max_seq_len=16, dim=16, n_layers=1, n_heads=2, norm_placement="post")
    m = GPT(cfg).eval()
    assert m.stack.norm is None
    x = torch.randint(0, 20, (1, 7))
    blk = m.stack.blocks[0]
    with torch.no_grad():
        h = m.tok_emb(x) + m.pos_emb.weight[:7]
        q, k, v = blk.attn.qkv(h).view(1, 7, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, 7, 16)
        h = blk.norm1(h + blk.attn.out_proj(a))
        h = blk.norm2(h + blk.mlp(h))
        torch.testing.assert_close(m(x).logits, m.lm_head(h), atol=1e-5, rtol=0)
        cached = [int(t[0]) for t in generate(m, x[:, :3], 8, temperature=0.0, mode="eager")]
        full = [int(t[0]) for t in generate(m, x[:, :3], 8, temperature=0.0, use_cache=False)]
    assert cached == full
    (tmp_path / "text.txt").write_text(TINY_TEXT)
    run = tmp_path / "post"
    rc, out, err = call(["train", "gpt", "--preset", "tiny", "--norm_placement", "post", "--data",
                         str(tmp_path / "text.txt"), "--out_dir", str(run), "--no-progress",
                         *flags(tiny_train("gpt"))])
    assert rc == 0, out + err
    assert json.loads((run / "config.json").read_text())["model"]["norm_placement"] == "post"
    rc, out, err = call(["train", "--resume", str(run), "--max_iters", "12", "--no-progress"])
    assert rc == 0, out + err
    assert metrics(run)[-1]["step"] == 12 and math.isfinite(metrics(run)[-1]["val_loss"])
    for fmt in ("hf", "gguf"):
        rc, _, err = call(["export", str(run), "--format", fmt, "-o", str(tmp_path / f"out-{fmt}")])
        assert "--norm_placement post" in assert_one_line_error(rc, err)


def test_a_16k_context_model_on_a_million_tokens() -> None:
    """CS189 Lec 22: attention's parameters do not grow with N, its N² work and its cache do."""
    from qkv.explain import explain_cost

    a, b = explain_cost(model=None).longer
    d = 768
    assert (a.n, b.n) == (16_384, 1_000_000)
    assert a.qkv_params + a.out_params == b.qkv_params + b.out_params == 4 * d * d
    assert (a.score_flops, b.score_flops) == (4 * a.n**2 * d, 4 * b.n**2 * d)  # QKᵀ and AV, 2 FLOPs a MAC
    rc, out, _ = call(["explain", "cost", "--model", "tiny"])
    assert rc == 0 and f"{b.score_flops / a.score_flops:,.0f}x" in out and "61.0x" in out


def test_positions_against_the_formulas_by_hand() -> None:
    from qkv.explain import explain_positions

    dim, n = 16, 64
    r = explain_positions(dim=dim, positions=n, seed=1)
    omega = [10000.0 ** (-2 * i / dim) for i in range(dim // 2)]
    for k, dot in r.decay:  # PE(p)·PE(p+k) = Σ_i sin·sin + cos·cos = Σ_i cos(k·ω_i), for any p
        assert math.isclose(dot, sum(math.cos(k * w) for w in omega), abs_tol=1e-5)
    curve = [sum(math.cos(k * w) for w in omega) for k in range(len(r.curve))]
    assert r.first_rise == next(k for k in range(1, len(curve)) if curve[k] > curve[k - 1])
    assert r.decay_p_spread < 1e-5 and all(err < 1e-6 for _, err in r.rotation)
    rows = {q.encoding.split(" (")[0]: q for q in r.requirements}
    sin, learned, integer = rows["sinusoidal"], rows["learned table"], rows["integer p"]
    assert sin.unique and sin.bounded and sin.relative and sin.any_length and sin.largest <= 1
    assert not learned.relative and learned.shift_error > 0.1
    assert learned.reach == n and not learned.any_length
    assert not integer.bounded and integer.largest == 100_000 - 1 and not integer.relative
    for row in r.integer:  # ‖x‖ = 1 and r = p in one coordinate: p² / (1 + p²) of ‖x + r‖² (x ⟂ r on average)
        assert math.isclose(row.position_share, row.position**2 / (1 + row.position**2))
    assert r.concat_vs_add < 1e-12 and r.alibi_error == 0
    for d, cos, want in r.cosines:  # E|cos| of a random direction against a fixed one ≈ √(2/(πd))
        assert abs(cos - want) < 0.15 * want + 0.02, (d, cos, want)
    for _, rope, added in r.rope_spread:  # RoPE: qᵀk depends on m − n only; added PEs do not
        assert rope < 1e-5 and added > 1  # qkv keeps its angle table in float32


def test_rope_offsets_by_hand() -> None:
    """The topic's RoPE claim, independently: rotate q to m and k to n with 2x2 rotations written
    here (pairs i, i + D/2 as qkv's rotate-half layout), the score equals the one at (m − n, 0)."""
    from qkv.attention import RotaryEmbedding

    D = 8
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)

    def rot(x: torch.Tensor, p: int) -> torch.Tensor:
        out = x.clone()
        for i in range(D // 2):
            a = p * 10000.0 ** (-2 * i / D)
            out[i] = x[i] * math.cos(a) - x[i + D // 2] * math.sin(a)
            out[i + D // 2] = x[i] * math.sin(a) + x[i + D // 2] * math.cos(a)
        return out

    rope = RotaryEmbedding(D, 64).double()
    qs, ks = rope(q.expand(1, 1, 64, D).contiguous())[0, 0], rope(k.expand(1, 1, 64, D).contiguous())[0, 0]
    for m, n in ((5, 2), (40, 37), (63, 60)):
        torch.testing.assert_close(qs[m], rot(q, m), atol=1e-6, rtol=0)
        assert math.isclose(float(qs[m] @ ks[n]), float(rot(q, 3) @ k), abs_tol=1e-5)


def test_positions_cli_and_bad_input(tmp_path) -> None:
    png = tmp_path / "p.png"
    rc, out, err = call(["explain", "positions", "--dim", "8", "--positions", "32", "--plot", str(png)])
    assert rc == 0 and "sinusoidal" in out and "R_k" in out and png.stat().st_size > 1000, err
    rc, _, err = call(["explain", "positions", "--dim", "7"])
    assert "dim must be even" in assert_one_line_error(rc, err)
    rc, _, err = call(["explain", "positions", "--dim", "64", "--positions", "100"])
    assert "at least 2 x dim" in assert_one_line_error(rc, err)


def test_attention_only_blocks_by_hand_train_attend_and_are_not_exported(tmp_path) -> None:
    """--mlp none: each block is x + Attn(LN(x)) only (softmax its one non-linearity), checked by
    hand on a 1-layer model; the parameters are the full model's less each MLP and its norm; `qkv
    train gpt --mlp none` trains, `qkv lens --attribute` reads it (the MLPs write nothing) and
    export refuses in one line; --mlp_hidden beside it is refused."""
    import torch.nn.functional as F
    from helpers import TINY_TEXT, flags, tiny_train

    from qkv.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    kw = dict(vocab_size=20, max_seq_len=16, dim=16, n_layers=1, n_heads=2)
    m = GPT(GPTConfig(**kw, mlp="none")).eval()
    x = torch.randint(0, 20, (1, 7))
    blk = m.stack.blocks[0]
    with torch.no_grad():
        h = m.tok_emb(x) + m.pos_emb.weight[:7]
        q, k, v = blk.attn.qkv(blk.norm1(h)).view(1, 7, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, 7, 16)
        h = h + blk.attn.out_proj(a)  # and nothing else: no MLP, no second norm
        torch.testing.assert_close(m(x).logits, m.lm_head(m.stack.norm(h)), atol=1e-5, rtol=0)
    full = GPT(GPTConfig(**kw))
    mlp_and_norm = sum(p.numel() for n, p in full.named_parameters() if ".mlp." in n or ".norm2." in n)
    assert mlp_and_norm == 2 * 16 * 64 + 64 + 16 + 2 * 16  # fc_in, biases, fc_out's bias, LN
    assert m.num_params() == full.num_params() - mlp_and_norm
    with pytest.raises(ValueError, match="mlp_hidden"):
        GPTConfig(**kw, mlp="none", mlp_hidden=32)

    (tmp_path / "text.txt").write_text(TINY_TEXT)
    run = tmp_path / "attn-only"
    rc, out, err = call(["train", "gpt", "--preset", "tiny", "--mlp", "none", "--data",
                         str(tmp_path / "text.txt"), "--out_dir", str(run), "--no-progress",
                         *flags(tiny_train("gpt"))])
    assert rc == 0, out + err
    rc, out, err = call(["lens", str(run), "--prompt", "the king", "--attribute", "e", "--json"])
    assert rc == 0, err
    mlps = [v for v in _numbers_named(json.loads(out), "mlp")]
    assert mlps and all(abs(v) < 1e-6 for v in mlps), mlps
    for fmt in ("hf", "gguf"):
        rc, _, err = call(["export", str(run), "--format", fmt, "-o", str(tmp_path / f"out-{fmt}")])
        assert "--mlp none" in assert_one_line_error(rc, err)
    rc, _, err = call(["train", "gpt", "--preset", "tiny", "--mlp", "none", "--mlp_hidden", "64", "--data",
                       str(tmp_path / "text.txt"), "--out_dir", str(tmp_path / "bad")])
    assert "mlp_hidden" in assert_one_line_error(rc, err)


def _numbers_named(tree: object, word: str) -> list[float]:
    """Every number in a JSON tree under a key containing ``word`` (lists of them included)."""
    out: list[float] = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            named = word in str(k).lower()
            if named and isinstance(v, (int, float)):
                out.append(float(v))
            elif named and isinstance(v, list) and all(isinstance(e, (int, float)) for e in v):
                out += [float(e) for e in v]
            else:
                out += _numbers_named(v, word)
    elif isinstance(tree, list):
        for v in tree:
            out += _numbers_named(v, word)
    return out


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi"])
def test_tied_queries_and_keys_make_the_models_scores_symmetric(positions: str) -> None:
    """--tie_qk: the keys are the queries, W x (RoPE rotates both by their own positions, and
    (R_m q)·(R_n k) = qᵀR_{n−m}k is still symmetric for k = q; ALiBi's −m|i − j| is symmetric);
    the model's causal weights are softmax(S + M) of a symmetric S computed here from W_Q alone."""
    from qkv.models.gpt import GPT, GPTConfig

    torch.manual_seed(1)
    m = GPT(GPTConfig(vocab_size=20, max_seq_len=16, dim=16, n_layers=1, n_heads=2, tie_qk=True,
                      positions=positions)).eval()
    blk = m.stack.blocks[0]
    assert blk.attn.qkv.weight.shape == (2 * 16, 16)  # [W_Q | W_V]: no W_K
    x = torch.randint(0, 20, (1, 6))
    with torch.no_grad():
        h = m.tok_emb(x) + (m.pos_emb.weight[:6] if positions == "learned" else 0)
        wq, bq = blk.attn.qkv.weight[:16], blk.attn.qkv.bias[:16]
        q = (blk.norm1(h) @ wq.T + bq).view(1, 6, 2, 8).transpose(1, 2)  # (1, H, T, Dh)
        if positions == "rope":
            q = m.rope(q)
        S = q @ q.transpose(-1, -2) / math.sqrt(8)
        if positions == "alibi":
            S = S + m.alibi(6)
        assert (S - S.transpose(-1, -2)).abs().max() < 1e-5  # s_ij = s_ji before the mask
        want = torch.softmax(S.masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf")), -1)
        got = m(x, backend="reference", return_weights=True).weights[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_tie_qk_refuses_grouped_heads_and_export(tmp_path) -> None:
    from helpers import TINY_TEXT, flags, tiny_train

    (tmp_path / "text.txt").write_text(TINY_TEXT)
    base = ["train", "gpt", "--preset", "tiny", "--data", str(tmp_path / "text.txt"), "--no-progress"]
    rc, _, err = call([*base, "--tie_qk", "true", "--n_kv_heads", "1", "--out_dir", str(tmp_path / "bad")])
    assert "tie_qk" in assert_one_line_error(rc, err)
    run = tmp_path / "tied"
    rc, out, err = call([*base, "--tie_qk", "true", "--out_dir", str(run), *flags(tiny_train("gpt"))])
    assert rc == 0, out + err
    assert json.loads((run / "config.json").read_text())["model"]["tie_qk"] is True
    png = tmp_path / "tied.png"
    rc, _, err = call(["attend", str(run), "the king", "--layer", "0", "-o", str(png)])
    assert rc == 0 and png.stat().st_size > 1000, err
    rc, _, err = call(["export", str(run), "--format", "hf", "-o", str(tmp_path / "hf")])
    assert "--tie_qk" in assert_one_line_error(rc, err)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rope", "alibi", "none"])
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_seq2seq_transformer_positions_and_norm_placement(positions: str, placement: str) -> None:
    """The copy experiment's encoder-decoder: token-by-token decoding with its KV cache equals the
    teacher-forced pass for every position kind and norm placement; without positions the encoder
    is permutation-equivariant (attention alone), with any of them it is not."""
    from qkv.models.transformer import TransformerSeq2Seq, TransformerSeq2SeqConfig

    torch.manual_seed(0)
    m = TransformerSeq2Seq(TransformerSeq2SeqConfig(
        dim=32, n_heads=4, enc_layers=1, dec_layers=2, max_src_len=12, max_tgt_len=12, src_vocab=10,
        tgt_vocab=10, positions=positions, norm_placement=placement)).eval()
    assert (m.decoder.norm is None) == (placement == "post")
    src = torch.randint(3, 10, (2, 9))
    src[1, 7:] = 0  # padding
    tgt = torch.randint(3, 10, (2, 8))
    tgt[:, 0] = 1
    with torch.no_grad():
        full = m(src, tgt).logits
        state = m.start(src)
        for t in range(7):
            logits, _ = m.step(state, tgt[:, t])
            torch.testing.assert_close(logits, full[:, t], atol=1e-5, rtol=0)
        perm = torch.tensor([3, 0, 8, 1, 5, 2, 7, 4, 6])
        memory, _, _ = m.encode(src[:1])
        shuffled, _, _ = m.encode(src[:1, perm])
    moved = float((shuffled - memory[:, perm]).abs().max())
    assert (moved < 1e-5) == (positions == "none"), moved


def test_copy_task_brings_its_own_preset(tmp_path) -> None:
    base = ["train", "seq2seq", "--arch", "transformer", "--max_iters", "2", "--eval_interval", "2",
            "--eval_iters", "1", "--n_train", "100", "--n_val", "5", "--n_test", "5", "--n_heldout", "5",
            "--no-progress", "--compile", "false", "--dtype", "fp32"]
    rc, out, err = call([*base, "--task", "copy", "--positions", "alibi", "--out_dir", str(tmp_path / "c")])
    assert rc == 0 and "preset copy-cpu" in out and "lengths 5-60" in out, out + err
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["model"]["positions"] == "alibi" and cfg["train"]["batch_size"] == 64  # copy-cpu's batch
    rc, out, err = call([*base, "--out_dir", str(tmp_path / "d")])
    assert rc == 0 and "preset dates-cpu" in out, out + err
