"""Encoder-decoders: padding gets exactly zero attention, the Transformer decoder is causal
and its cached steps equal the full forward pass, beam width 1 is greedy, beam search beats
greedy where it should (hand-built distribution), and teacher-forced training learns."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.attention import KVCache
from qkv.generation.decode import beam_search, greedy_decode
from qkv.models.rnn_seq2seq import RNNSeq2Seq, RNNSeq2SeqConfig
from qkv.models.transformer import TransformerSeq2Seq, TransformerSeq2SeqConfig
from qkv.tokenizers.vocab import BOS, EOS, PAD

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = {
    "rnn": lambda: RNNSeq2Seq(RNNSeq2SeqConfig(src_vocab=20, tgt_vocab=12, emb_dim=16, hidden=16,
                                               dec_hidden=24, attn_dim=16)),
    "rnn-lstm": lambda: RNNSeq2Seq(RNNSeq2SeqConfig(src_vocab=20, tgt_vocab=12, emb_dim=16, hidden=16,
                                                    dec_hidden=24, attn_dim=16, cell="lstm")),
    "rnn-noattn": lambda: RNNSeq2Seq(RNNSeq2SeqConfig(arch="rnn-noattn", src_vocab=20, tgt_vocab=12,
                                                      emb_dim=16, hidden=16, dec_hidden=24)),
    "transformer": lambda: TransformerSeq2Seq(TransformerSeq2SeqConfig(
        src_vocab=20, tgt_vocab=12, dim=32, n_heads=4, enc_layers=2, dec_layers=2, max_tgt_len=32)),
}


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 20, (3, 7), generator=g)
    src[0, 5:] = PAD
    src[2, 3:] = PAD
    tgt = torch.randint(4, 12, (3, 6), generator=g)
    tgt[:, 0], tgt[:, -1] = BOS, EOS
    return src, tgt


def _seq2seq(name: str):
    torch.manual_seed(0)
    return MODELS[name]().eval()


def _cross(out):
    return out.weights[-1] if isinstance(out.weights, list) else out.weights  # (B, [H,] T, S)


@pytest.mark.parametrize("name", ["rnn", "rnn-lstm", "transformer"])
def test_padding_gets_exactly_zero_attention(name: str) -> None:
    src, tgt = _batch()
    w = _cross(_seq2seq(name)(src, tgt, return_weights=True))
    assert torch.all(w[0, ..., 5:] == 0) and torch.all(w[2, ..., 3:] == 0)
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))


@pytest.mark.parametrize("name", list(MODELS))
def test_extra_padding_changes_nothing(name: str) -> None:
    """The encoder's padding mask is used: more PAD columns give the same outputs."""
    src, tgt = _batch()
    m = _seq2seq(name)
    a = m(src, tgt).logits
    b = m(torch.cat([src, torch.zeros(3, 4, dtype=torch.long)], 1), tgt).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_transformer_decoder_is_causal() -> None:
    src, tgt = _batch()
    m = _seq2seq("transformer")
    a = m(src, tgt).logits
    tgt2 = tgt.clone()
    tgt2[:, 3] = 5  # change input position 3: outputs 0..2 must not move
    b = m(src, tgt2).logits
    torch.testing.assert_close(a[:, :3], b[:, :3])
    assert not torch.allclose(a[:, 3:], b[:, 3:])


def test_transformer_cached_steps_equal_the_full_forward() -> None:
    src, tgt = _batch()
    m = _seq2seq("transformer")
    full = m(src, tgt).logits
    state = m.start(src)
    steps = [m.step(state, tgt[:, t])[0] for t in range(tgt.shape[1] - 1)]
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_beam_width_one_is_greedy(name: str) -> None:
    src, _ = _batch(1)
    m = _seq2seq(name)
    g, b = greedy_decode(m, src, 8), beam_search(m, src, 8, beam=1)
    assert g.tokens == b.tokens
    assert g.scores == pytest.approx(b.scores, abs=1e-5)


def test_kv_cache_reorder() -> None:
    c = KVCache(2, 3, 1, 4, 2)
    c.k[:, :, 0, 0, 0] = torch.tensor([10.0, 11.0, 12.0])
    layer0 = c.layer(0)
    c.reorder(torch.tensor([2, 2, 0]))
    assert c.k[1, :, 0, 0, 0].tolist() == [12.0, 12.0, 10.0]
    assert layer0.k[:, 0, 0, 0].tolist() == [12.0, 12.0, 10.0]  # views see the new order
    with pytest.raises(ValueError, match="index must have shape"):
        c.reorder(torch.tensor([0, 1]))


class _ToyModel:
    """A 'model' with a hand-written next-token distribution over {EOS=2, A=4, B=5}:
    first step A 0.6 / B 0.4; after A: A 0.5 / B 0.5 (then EOS); after B: EOS 0.9 ... so the
    greedy path A, A, EOS has p = 0.6·0.5·1 = 0.30 but B, EOS has p = 0.4·0.9 = 0.36."""

    class State:
        def __init__(self, n: int) -> None:
            self.hist = [[] for _ in range(n)]

        def reorder(self, index: torch.Tensor) -> None:
            self.hist = [list(self.hist[i]) for i in index.tolist()]

    def start(self, src: torch.Tensor):
        return self.State(len(src))

    def step(self, state, prev: torch.Tensor):
        rows = []
        for h, p in zip(state.hist, prev.tolist(), strict=True):
            if p != BOS:
                h.append(p)
            probs = torch.full((6,), 1e-9)
            for tok, pr in self.next_probs(h).items():
                probs[tok] = pr
            rows.append(probs.log())
        return torch.stack(rows), None

    @staticmethod
    def next_probs(h: list[int]) -> dict[int, float]:
        if not h:
            return {4: 0.6, 5: 0.4}
        if h == [4]:
            return {4: 0.5, 5: 0.5}
        if h == [5]:
            return {EOS: 0.9, 4: 0.1}
        return {EOS: 1.0}


def test_beam_search_finds_the_more_likely_sequence() -> None:
    src = torch.ones(1, 3, dtype=torch.long)
    toy = _ToyModel()
    g = greedy_decode(toy, src, 5)
    assert g.tokens == [[4, 4]] and g.scores[0] == pytest.approx(math.log(0.30), abs=1e-6)
    b = beam_search(toy, src, 5, beam=2, length_penalty=0.0)
    assert b.tokens == [[5]] and b.scores[0] == pytest.approx(math.log(0.36), abs=1e-6)


@pytest.mark.parametrize("name", ["rnn", "transformer"])
def test_teacher_forced_loss_decreases(name: str) -> None:
    """Learn to copy 8 short sequences: the loss falls by well over half in 60 steps."""
    torch.manual_seed(0)
    m = MODELS[name]().train()
    g = torch.Generator().manual_seed(3)
    body = torch.randint(4, 12, (8, 5), generator=g)
    src = body.clone()
    tgt = torch.cat([torch.full((8, 1), BOS), body, torch.full((8, 1), EOS)], 1)
    opt = torch.optim.Adam(m.parameters(), 3e-3)
    first = None
    for _ in range(60):
        loss = m(src, tgt).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.4 * first


class _EvictionToy(_ToyModel):
    """First step EOS 0.3 / A 0.7; after A, A and B 0.5 each, and from there on tokens keep
    coming at 0.5 each (EOS 1e-9): the empty output (p 0.3) is the best, but two longer live
    candidates outscore it by raw score at step 2. It must not be forgotten."""

    @staticmethod
    def next_probs(h: list[int]) -> dict[int, float]:
        return {EOS: 0.3, 4: 0.7} if not h else {4: 0.5, 5: 0.5}


def test_beam_search_keeps_finished_hypotheses() -> None:
    b = beam_search(_EvictionToy(), torch.ones(1, 2, dtype=torch.long), 6, beam=2, length_penalty=0.0)
    assert b.tokens == [[]] and b.scores[0] == pytest.approx(math.log(0.3), abs=1e-6)


@pytest.mark.parametrize("name", ["rnn", "transformer"])
def test_batched_beam_search_equals_one_source_at_a_time(name: str) -> None:
    src, _ = _batch(2)
    m = _seq2seq(name)
    together = beam_search(m, src, 8, beam=3)
    for i in range(len(src)):
        alone = beam_search(m, src[i : i + 1, : int((src[i] != PAD).sum())], 8, beam=3)
        assert alone.tokens[0] == together.tokens[i]
        assert alone.scores[0] == pytest.approx(together.scores[i], abs=1e-4)
        if alone.weights[0] is not None:
            S = alone.weights[0].shape[-1]
            torch.testing.assert_close(alone.weights[0], together.weights[i][:, :S], atol=1e-5, rtol=1e-4)


def test_outputs_never_contain_padding_bos_or_unknown() -> None:
    src, _ = _batch(3)
    m = _seq2seq("rnn")
    with torch.no_grad():  # make the untrained model prefer the forbidden tokens
        m.out.bias[[PAD, BOS, 3]] += 100.0
    for res in (greedy_decode(m, src, 6), beam_search(m, src, 6, beam=2)):
        assert all(not {PAD, BOS, 3} & set(t) for t in res.tokens)


class _LateBestToy(_ToyModel):
    """First step A 0.6 / EOS 0.2 / B 0.2; after A: A 0.9 / EOS 0.1; after A, A: EOS 0.99; after
    B: EOS 0.9. With two beams, the empty output (0.2) and B, EOS (0.18) finish first, but
    A, A, EOS (p 0.535) is far more likely: a full list of finished outputs must not end the
    search while a live output can still beat them."""

    @staticmethod
    def next_probs(h: list[int]) -> dict[int, float]:
        if not h:
            return {4: 0.6, EOS: 0.2, 5: 0.2}
        if h == [4]:
            return {4: 0.9, EOS: 0.1}
        if h == [5]:
            return {EOS: 0.9, 4: 0.1}
        return {EOS: 0.99, 4: 0.01}


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beam_search_waits_for_a_better_late_output(length_penalty: float) -> None:
    b = beam_search(_LateBestToy(), torch.ones(1, 2, dtype=torch.long), 6, beam=2,
                    length_penalty=length_penalty)
    assert b.tokens == [[4, 4]] and b.scores[0] == pytest.approx(math.log(0.6 * 0.9 * 0.99), abs=1e-6)
