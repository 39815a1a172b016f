"""The lectures' worked examples, computed live by qkv's own code (``qkv explain TOPIC``).

Each topic is a function that returns a plain result object (dataclasses of floats and
lists, so tests check the numbers, not printed text), a renderer that prints it as rich
tables, and, where a picture helps, a plot function (``--plot out.png``):

    softmax         hardmax vs softmax of [1, 2, 3], temperature, row-wise on a matrix
    lookup          the soft dictionary {A: 51, B: 42, C: 31} with one-hot keys
    retrieval       bag of words, TF-IDF and MiniLM retrieval; then attention over the documents
    scaling         Var(qᵀk) grows like d; dividing by √d keeps the softmax soft (Discussion 10)
    worked-example  Discussion 10's three tokens, step by step and as softmax(QKᵀ/√d)V
    derivation      attention built up in the notes' order: average, raw vectors, W_Q/W_K, W_V and √d
    equivariance    permuting tokens permutes outputs; positions break it
    positions       the notes' four requirements on every encoding; integers; add vs concat; R_k; RoPE
    masking         the causal mask: E + M with 0 / −∞, rows renormalised over what they may see
    qk              why W_Q ≠ W_K: one matrix makes the scores symmetric
    heads           multi-head parameters both ways: h full-width heads (3hd²) vs width d/h (3d²), GQA
    cost            parameters, FLOPs and KV-cache bytes of attention
    cnn             an MLP on P pixels needs P² weights; a CNN sees locally (receptive fields measured)
    architectures   RNN vs CNN vs self-attention: FLOPs, sequential steps, path length, timed here
    context         MiniLM: "bank" by a river and at a bank; where "it" looks
    bottleneck      copying strings with one fixed context vector vs with attention
    addressing      location-based vs content-based addressing (Lecture 21's last slide)
    hard-attention  REINFORCE for one sampled location: unbiased, and what a baseline buys

Lectures: Berkeley CS189 Lec 21-22 and Discussion 10; Stanford CS231N Lec 8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from qkv.explain import plots
from qkv.explain.architectures import explain_architectures, explain_cnn, render_architectures, render_cnn
from qkv.explain.attention_claims import (
    explain_addressing,
    explain_bottleneck,
    explain_hard_attention,
    render_addressing,
    render_bottleneck,
    render_hard_attention,
)
from qkv.explain.context import explain_context, render_context
from qkv.explain.cost import explain_cost, render_cost
from qkv.explain.derivation import explain_derivation, render_derivation
from qkv.explain.equivariance import explain_equivariance, render_equivariance
from qkv.explain.heads import explain_heads, render_heads
from qkv.explain.lookup import explain_lookup, render_lookup
from qkv.explain.masking import explain_masking, explain_qk, render_masking, render_qk
from qkv.explain.positions import explain_positions, render_positions
from qkv.explain.retrieval import explain_retrieval, render_retrieval
from qkv.explain.scaling import explain_scaling, render_scaling
from qkv.explain.softmax import explain_softmax, render_softmax
from qkv.explain.worked_example import explain_worked_example, render_worked_example


class Topic(NamedTuple):
    """One topic: its one-line help, the function computing its result, the renderer
    (result, rich Console) and the plot writer (result, path) or None."""

    help: str
    compute: Callable[..., Any]
    render: Callable[[Any, Any], None]
    plot: Callable[[Any, Any], Any] | None = None
    needs_minilm: bool = False


TOPICS: dict[str, Topic] = {
    "softmax": Topic("hardmax vs softmax of [1, 2, 3] (≈ 0.09, 0.24, 0.67), temperature, row by row",
                     explain_softmax, render_softmax, plots.plot_softmax),
    "lookup": Topic("the soft dictionary {A: 51, B: 42, C: 31}: queries [0,1,0] and [1,1,0]",
                    explain_lookup, render_lookup, plots.plot_lookup),
    "retrieval": Topic("inner-product retrieval: bag of words, TF-IDF, MiniLM; then soft attention",
                       explain_retrieval, render_retrieval, plots.plot_retrieval),
    "scaling": Topic("why divide by √d: Var(qᵀk) = d and a saturating softmax (Discussion 10)",
                     explain_scaling, render_scaling, plots.plot_scaling),
    "worked-example": Topic("Discussion 10's three tokens by hand, checked against softmax(QKᵀ/√d)V",
                            explain_worked_example, render_worked_example, plots.plot_worked_example),
    "derivation": Topic("attention in the notes' order: average all values, raw vectors, W_Q/W_K, W_V, √d",
                        explain_derivation, render_derivation),
    "equivariance": Topic("permuting tokens permutes the outputs; adding positions breaks it",
                          explain_equivariance, render_equivariance),
    "positions": Topic("4 requirements on each encoding; integer positions; add vs concat; R_k; RoPE",
                       explain_positions, render_positions, plots.plot_positions),
    "masking": Topic("the causal mask: E + M (0 / −∞), softmax renormalises each row over what it may see",
                     explain_masking, render_masking),
    "qk": Topic("why queries and keys differ: with W_Q = W_K the scores are symmetric (s_ij = s_ji)",
                explain_qk, render_qk),
    "heads": Topic("multi-head parameters both ways: h full-width heads (3hd², CS189) vs d/h wide (3d²), GQA",
                   explain_heads, render_heads),
    "cost": Topic("parameters and FLOPs vs a dense layer (3D² vs N²D²); KV cache of MHA/GQA/MQA",
                  explain_cost, render_cost, plots.plot_cost),
    "cnn": Topic("Lecture 21's motivation: P² weights of an MLP on pixels; a CNN's receptive field, measured",
                 explain_cnn, render_cnn),
    "architectures": Topic("RNN vs CNN vs self-attention: FLOPs, sequential steps, path length, ms here",
                           explain_architectures, render_architectures),
    "context": Topic('MiniLM: "bank" by the river vs at the bank; which tokens "it" attends to',
                     explain_context, render_context, plots.plot_context, needs_minilm=True),
    "bottleneck": Topic("copy random strings: one fixed context vector vs attention, exact by length",
                        explain_bottleneck, render_bottleneck),
    "addressing": Topic("location-based (softmax(W h)) vs content-based (softmax(qᵀa_i)) addressing",
                        explain_addressing, render_addressing),
    "hard-attention": Topic("REINFORCE for one sampled location: exact gradient vs estimates, baselines",
                            explain_hard_attention, render_hard_attention),
}

__all__ = [
    "TOPICS",
    "Topic",
    "explain_addressing",
    "explain_architectures",
    "explain_bottleneck",
    "explain_cnn",
    "explain_context",
    "explain_cost",
    "explain_derivation",
    "explain_equivariance",
    "explain_hard_attention",
    "explain_heads",
    "explain_lookup",
    "explain_masking",
    "explain_positions",
    "explain_qk",
    "explain_retrieval",
    "explain_scaling",
    "explain_softmax",
    "explain_worked_example",
]
