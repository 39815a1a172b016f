"""What attention does, not only where it looks: read and change what a Transformer computes.

    import qkv, qkv.lens as lens
    lm = qkv.load("smollm2")
    lens.next_token(lm, "The capital of France is")        # top-k next tokens, any temperature
    lens.logit_lens(lm, "The capital of France is")        # (L + 1, T, V) each layer's prediction
    lens.run_with_cache(lm, text)["blocks.3.attn.hook_z"]  # every activation, TransformerLens names
    lens.ablate(lm, text, heads=[(3, 1)])                  # logits with a head knocked out
    lens.head_effects(lm, text)                            # every head's effect on the loss
    lens.patch(lm, clean, corrupt, site="head")            # activation patching
    lens.attribution_patch(lm, clean, corrupt)             # its estimate from 2 forward + 1 backward
    lens.edge_attribution(lm, clean, corrupt).top(10)      # the paths between heads that carry it
    lens.faithfulness(lm, clean, corrupt, scores)          # keep a method's top-k heads: MIB's CPR, CMD
    lens.attribute(lm, text, " Paris", " London")          # direct logit attribution
    lens.head_scores(lm)                                   # previous-token, induction, ... heads
    lens.head_scores(lm, effects=True).copiers()           # ... and the heads whose knock-out undoes copying
    lens.query_key(lm, text, layer=3, head=1)              # one attention row, q·k term by term

Every function takes any text model ``qkv.load`` opens (GPT runs, Hugging Face folders and GGUF
files of llama / mistral / qwen2 / gemma / gpt2; encoders for what applies to them) and works
with plain torch hooks on qkv's own blocks (:mod:`qkv.lens.hooks`); nothing is copied or traced.
"""

from qkv.lens.atp import Agreement, PatchEstimate, agreement, attribution_patch
from qkv.lens.attribution import Attribution, attribute
from qkv.lens.cache import ActivationCache, run_with_cache
from qkv.lens.causal import HeadEffects, Patching, ablate, head_effects, parse_heads, patch
from qkv.lens.edges import Edge, Edges, edge_attribution
from qkv.lens.faithful import Faithfulness, circuit_faithfulness, faithfulness
from qkv.lens.heads import (
    COPY_AT,
    HEAD_TYPES,
    NAMED_AT,
    HeadScores,
    QueryKey,
    copy_effects,
    head_scores,
    probe_avoid,
    query_key,
    repeated_tokens,
    score_model,
    text_rollout,
)
from qkv.lens.predict import LogitLens, NextToken, TokenProb, logit_lens, next_token

__all__ = ["COPY_AT", "HEAD_TYPES", "NAMED_AT", "ActivationCache", "Agreement", "Attribution", "Edge",
           "Edges", "Faithfulness", "HeadEffects", "HeadScores", "LogitLens", "NextToken", "PatchEstimate",
           "Patching", "QueryKey", "TokenProb", "ablate", "agreement", "attribute", "attribution_patch",
           "circuit_faithfulness", "copy_effects", "edge_attribution", "faithfulness", "head_effects",
           "head_scores", "logit_lens", "next_token", "parse_heads", "patch", "probe_avoid", "query_key",
           "repeated_tokens", "run_with_cache", "score_model", "text_rollout"]
