"""``qkv explain cost``: what attention costs, in parameters, FLOPs and KV-cache bytes.

CS189 Lec 22's table, for N tokens of width D:

                      self-attention              a fully connected layer over the N·D inputs
    parameters        3D² (W_Q, W_K, W_V)         (ND)² = N²D²
    compute           O(N²D) (QKᵀ and AV)         O(N²D²)

Attention's parameters do not depend on N, its compute grows like N². For a decoder that
generates, the KV cache stores every past token's keys and values: 2 · layers · K heads · head
dim · T tokens · bytes, which is why GQA (several query heads share one key/value head;
Ainslie et al. 2023) and MQA (one shared head; Shazeer 2019) exist (CS189 Lec 22, "multi-head
alternatives"). And per layer, the N² part of attention overtakes the MLP once the context T is
long enough.

Everything is counted live: parameters of qkv modules built on PyTorch's "meta" device (shapes
without memory), FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` over their forward
passes (one multiply-add = 2 FLOPs), cache bytes from a :class:`qkv.attention.KVCache`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from qkv.attention import KVCache, MultiHeadAttention
from qkv.layers.block import TransformerBlock
from qkv.models.gpt import GPTConfig
from qkv.presets import GPT_PRESETS

if TYPE_CHECKING:
    from rich.console import Console

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Published shapes for the notes' "from a dozen blocks to GPT-3's 96" (CS231N Lec 8): GPT-2 small
# (Radford et al. 2019) and GPT-3 175B (Brown et al. 2020, Table 2.1), as qkv's GPT (learned
# positions, pre-LN, GELU MLP of 4·d, tied embeddings, biases). GPT-3's alternating sparse
# attention is not modelled: its parameters and dense FLOPs are the same.
PUBLISHED = {
    "gpt2": dict(vocab_size=50257, max_seq_len=1024, dim=768, n_layers=12, n_heads=12),
    "gpt3-175b": dict(vocab_size=50257, max_seq_len=2048, dim=12288, n_layers=96, n_heads=96),
}
MODELS = ("smollm2", *PUBLISHED, *GPT_PRESETS)


def _flops(fn, *args) -> int:
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return int(counter.get_total_flops())


def param_count(module: nn.Module) -> int:
    """Parameters of ``module`` (built on the meta device: counted, never allocated)."""
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------- the lecture's table


@dataclass
class LectureCost:
    """Self-attention vs a fully connected layer over N flattened tokens of width D."""

    n: int
    d: int
    qkv_params: int  # W_Q, W_K, W_V: the lecture's 3D²
    out_params: int  # W_O, which multi-head attention adds: D²
    fc_params: int  # (ND)²
    proj_flops: int  # the four projections: 2·4·N·D²
    score_flops: int  # QKᵀ and AV: 2·2·N²·D
    fc_flops: int  # 2·(ND)²

    @property
    def attn_flops(self) -> int:
        return self.proj_flops + self.score_flops


def lecture_cost(n: int, d: int) -> LectureCost:
    """Count one single-head attention layer (qkv's MultiHeadAttention, no biases) and
    ``nn.Linear(N·D, N·D)`` on the meta device."""
    if n < 1 or d < 1:
        raise ValueError(f"N and D must be >= 1, got N={n}, D={d}")
    with torch.device("meta"):
        attn = MultiHeadAttention(d, 1, bias=False, backend="reference")
        fc = nn.Linear(n * d, n * d, bias=False)
        x = torch.empty(1, n, d)
        flat = torch.empty(1, n * d)
    total = _flops(attn, x)
    proj = _flops(attn.qkv, x) + _flops(attn.out_proj, x)
    return LectureCost(n, d, param_count(attn.qkv), param_count(attn.out_proj), param_count(fc), proj,
                       total - proj, _flops(fc, flat))


# --------------------------------------------------------------------------- models


def _smollm2_config() -> GPTConfig:
    from qkv.assets import asset_path

    return _gguf_config(asset_path("smollm2"))  # AssetMissingError names the install command


@functools.lru_cache(maxsize=2)
def _gguf_config(path: Path) -> GPTConfig:
    """The GPTConfig of a GGUF file, from qkv's conversion cache when it holds the file."""
    from qkv.pretrained.cache import entry_dir

    entry = entry_dir(path)
    if entry is not None and (entry / "config.json").is_file():  # converted before: ~1 ms
        try:
            return GPTConfig(**json.loads((entry / "config.json").read_text(encoding="utf-8"))["model"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    from qkv.pretrained.gguf_file import read_gguf
    from qkv.pretrained.gguf_models import INSTALL_HINT, gpt_config_from_gguf

    return gpt_config_from_gguf(read_gguf(path, fix=INSTALL_HINT))  # ~8 s: parses the metadata


def model_config(name: str) -> GPTConfig:
    """The GPTConfig of SmolLM2-135M (read from its installed GGUF) or of a GPT preset."""
    if name == "smollm2":
        return _smollm2_config()
    if name in PUBLISHED:
        return GPTConfig(**PUBLISHED[name])
    if name in GPT_PRESETS:
        return GPTConfig(**GPT_PRESETS[name]["model"])
    raise ValueError(f"unknown model {name!r}; choose from: {', '.join(MODELS)}")


@dataclass
class KVRow:
    """The KV cache with ``kv_heads`` key/value heads: MHA, GQA or MQA."""

    kind: str
    kv_heads: int
    group: int  # query heads per key/value head
    bytes: int
    actual: bool  # the model's own layout


@dataclass
class LayerFlops:
    """FLOPs of one Transformer layer over T tokens (the full T x T score matrix is counted;
    a causal kernel can skip about half of it)."""

    t: int
    proj: int  # Q, K, V and output projections
    scores: int  # QKᵀ and AV
    mlp: int

    @property
    def attn(self) -> int:
        return self.proj + self.scores


@dataclass
class CacheSaving:
    """One layer generating ``t`` tokens one at a time (Discussion 11's question, the KV cache's
    saving): rows pushed through the projections and MLP, (query, key) pairs scored, and FLOPs,
    with a KV cache (each step: the new token only) and without (each step: the whole prefix again,
    causal scores)."""

    t: int
    rows_cached: int  # T
    rows_recomputed: int  # Σ_t t = T(T+1)/2
    pairs_cached: int  # Σ_t t: the new query against every key so far
    pairs_recomputed: int  # Σ_t t(t+1)/2 = T(T+1)(T+2)/6
    flops_cached: int
    flops_recomputed: int


def cache_savings(cfg: GPTConfig, ts: list[int]) -> list[CacheSaving]:
    """:class:`CacheSaving` of one of ``cfg``'s layers for each T in ``ts``: per-row FLOPs (the four
    projections and the MLP) counted on one token, per-pair FLOPs 4·H·head_dim (q·k and the weighted
    value sum)."""
    one = layer_flops(cfg, 1)
    row, pair = one.proj + one.mlp, 4 * cfg.n_heads * cfg.resolved_head_dim
    out = []
    for t in ts:
        rows_full, pairs_full = t * (t + 1) // 2, t * (t + 1) * (t + 2) // 6
        out.append(CacheSaving(t, t, rows_full, t * (t + 1) // 2, pairs_full,
                               t * row + (t * (t + 1) // 2) * pair, rows_full * row + pairs_full * pair))
    return out


@dataclass
class ModelCost:
    name: str
    config: GPTConfig
    context: int
    dtype: str
    batch: int
    kv: list[KVRow]
    layers: list[LayerFlops]
    crossover_scores: float  # T above which QKᵀ + AV cost more than the MLP
    crossover_attn: float  # T above which the whole attention sublayer costs more (0: always)
    saved: list[CacheSaving] | None = None  # what the KV cache saves (Discussion 11)
    params: int = 0  # every parameter of the model (counted on a meta-device copy; tied counted once)


def kv_cache_rows(cfg: GPTConfig, context: int, dtype: str = "bfloat16", batch: int = 1) -> list[KVRow]:
    """Bytes of a KV cache for every valid number of key/value heads (each divides n_heads)."""
    H, L, Dh = cfg.n_heads, cfg.n_layers, cfg.resolved_head_dim
    rows = []
    for k in sorted((k for k in range(1, H + 1) if H % k == 0), reverse=True):
        cache = KVCache(L, batch, k, context, Dh, dtype=DTYPES[dtype], device="meta")
        kind = "MHA" if k == H else "MQA" if k == 1 else "GQA"
        rows.append(KVRow(kind, k, H // k, cache.k.nbytes + cache.v.nbytes, k == cfg.resolved_kv_heads))
    return rows


def layer_flops(cfg: GPTConfig, t: int) -> LayerFlops:
    """Count one of the model's layers over ``t`` tokens (meta device, reference attention)."""
    bc = dataclasses.replace(cfg.block_config(), backend="reference", dropout=0.0, attn_dropout=0.0)
    with torch.device("meta"):
        block = TransformerBlock(bc)
        x = torch.empty(1, t, cfg.dim)
        heads_out = torch.empty(1, t, cfg.n_heads * cfg.resolved_head_dim)
    attn = _flops(lambda h: block.attn(h, is_causal=False), x)
    proj = _flops(block.attn.qkv, x) + _flops(block.attn.out_proj, heads_out)
    return LayerFlops(t, proj, attn - proj, _flops(block.mlp, x))


def model_cost(name: str, context: int | None = None, dtype: str = "bfloat16", batch: int = 1) -> ModelCost:
    """KV-cache bytes (MHA/GQA/MQA variants) and per-layer FLOPs of model ``name`` at ``context``
    tokens (default: its max_seq_len)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    cfg = model_config(name)
    context = cfg.max_seq_len if context is None else context
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    # FLOPs are linear (projections, MLP) or quadratic (scores) in T: read the coefficients off
    # one measurement, solve for the crossovers, then measure the table's rows.
    probe = layer_flops(cfg, 64)
    a, c, b = probe.scores / 64**2, probe.proj / 64, probe.mlp / 64  # a·T², c·T, b·T
    cross_scores = b / a
    cross_attn = max(0.0, (b - c) / a)
    ts = sorted({context // 16, context // 4, context, math.ceil(cross_scores)} - {0})
    saved = cache_savings(cfg, sorted({16, 256, context} & set(range(1, context + 1))))
    from qkv.models.gpt import GPT

    with torch.device("meta"):
        params = param_count(GPT(cfg))
    return ModelCost(name, cfg, context, dtype, batch, kv_cache_rows(cfg, context, dtype, batch),
                     [layer_flops(cfg, t) for t in ts], cross_scores, cross_attn, saved, params)


@dataclass
class CostResult:
    lecture: LectureCost
    model: ModelCost | None
    note: str | None = None  # why the model part is missing
    # the notes' "a 16K-context model extrapolated to 1M tokens" (CS189 Lec 22), at width D
    longer: tuple[LectureCost, LectureCost] | None = None


SHORT_CONTEXT, LONG_CONTEXT = 16_384, 1_000_000


def explain_cost(n: int = 196, d: int = 768, model: str | None = "smollm2", context: int | None = None,
                 dtype: str = "bfloat16", batch: int = 1) -> CostResult:
    """The lecture's table for (N, D) and, unless ``model`` is None, the model's KV cache and
    per-layer FLOPs. Defaults: N = 196 patches of width D = 768 (ViT-B/16 on a 224x224 image)."""
    return CostResult(lecture_cost(n, d),
                      None if model is None else model_cost(model, context, dtype, batch),
                      longer=(lecture_cost(SHORT_CONTEXT, d), lecture_cost(LONG_CONTEXT, d)))


# --------------------------------------------------------------------------- rendering


def render_cost(r: CostResult, console: Console) -> None:
    """Print the tables of ``qkv explain cost``."""
    from qkv.explain._render import add_row, human_bytes, human_count, say, table

    lc = r.lecture
    t = table(f"N = {lc.n} tokens of width D = {lc.d}: self-attention vs one fully connected layer over "
              "all N·D inputs  (CS189 Lec 22)", ["", "self-attention", "fully connected", "ratio"])
    add_row(t, "parameters", f"{lc.qkv_params:,} (3D²)\n+ {lc.out_params:,} for W_O",
              f"{lc.fc_params:,} (N²D²)", f"{lc.fc_params / lc.qkv_params:,.3g}x")
    add_row(t, "FLOPs (forward)", f"{human_count(lc.attn_flops)}: projections "
              f"{human_count(lc.proj_flops)}\n+ QKᵀ, AV {human_count(lc.score_flops)} (4N²D)",
              f"{human_count(lc.fc_flops)} (2N²D²)", f"{lc.fc_flops / lc.attn_flops:,.3g}x")
    console.print(t)
    say(console, f"The N² part (QKᵀ, AV) passes the projections (8ND²) once N > 2D = {2 * lc.d}.", "dim")
    if r.longer is not None:
        a, b = r.longer
        t = table(f"the notes: attention's parameters do not depend on N, so a {a.n // 1024}K-context model "
                  f"can run on {b.n:,} tokens, at a price (CS189 Lec 22; width D = {a.d}, one layer)",
                  ["", f"N = {a.n:,}", f"N = {b.n:,}", "ratio"])
        add_row(t, "parameters W_Q, W_K, W_V, W_O", f"{a.qkv_params + a.out_params:,}",
                f"{b.qkv_params + b.out_params:,}", "1x")
        add_row(t, "FLOPs of QKᵀ and AV (4N²D)", human_count(a.score_flops), human_count(b.score_flops),
                f"{b.score_flops / a.score_flops:,.0f}x")
        add_row(t, "keys and values kept (2ND numbers)", human_count(2 * a.n * a.d),
                human_count(2 * b.n * b.d), f"{b.n / a.n:,.1f}x")
        console.print(t)
    if r.note:
        say(console, r.note, "yellow")
    if r.model is None:
        return
    m, cfg = r.model, r.model.config
    say(console, f"\n{m.name}: {human_count(m.params)} parameters, {cfg.n_layers} layers, width {cfg.dim}, "
        f"{cfg.n_heads} query heads of {cfg.resolved_head_dim}, {cfg.resolved_kv_heads} key/value heads, "
        f"{cfg.mlp} MLP of {cfg.mlp_hidden or 4 * cfg.dim}", "bold")
    kv = table(f"KV cache for {m.context:,} tokens, batch {m.batch}, {m.dtype}: 2 · layers · K · head dim · "
               "T · bytes", ["layout", "K heads", "queries per K", "bytes", "per token"])
    for row in m.kv:
        add_row(kv, row.kind + (" (this model)" if row.actual else ""), str(row.kv_heads), str(row.group),
                f"{row.bytes:,} ({human_bytes(row.bytes)})", human_bytes(row.bytes / (m.context * m.batch)),
                style="bold" if row.actual else None)
    console.print(kv)
    fl = table("FLOPs of one layer over T tokens (full T x T scores)",
               ["T", "attn projections", "QKᵀ + AV", "MLP", "attention / MLP"])
    for lf in m.layers:
        add_row(fl, f"{lf.t:,}", human_count(lf.proj), human_count(lf.scores), human_count(lf.mlp),
                   f"{lf.attn / lf.mlp:.2f}")
    console.print(fl)
    whole = ("from the first token" if m.crossover_attn < 1
             else f"from T ≈ {m.crossover_attn:,.0f}")
    say(console, f"QKᵀ + AV overtake the MLP at T ≈ {m.crossover_scores:,.0f} tokens; the whole attention "
        f"sublayer (with its projections) overtakes it {whole}.")
    if m.saved:
        sv = table("what the KV cache saves: one layer generating T tokens one at a time (Discussion 11)",
                   ["T", "rows through W_Q..W_O + MLP", "(query, key) pairs", "FLOPs", "saved"])
        for s in m.saved:
            add_row(sv, f"{s.t:,}", f"{s.rows_cached:,} vs {s.rows_recomputed:,}",
                    f"{s.pairs_cached:,} vs {s.pairs_recomputed:,}",
                    f"{human_count(s.flops_cached)} vs {human_count(s.flops_recomputed)}",
                    f"{s.flops_recomputed / s.flops_cached:,.1f}x")
        console.print(sv)
        say(console, "With the cache each step projects only the new token and scores it against the keys "
            "kept (T rows, T(T+1)/2 pairs); without it every step runs the whole prefix again (T(T+1)/2 "
            "rows, T(T+1)(T+2)/6 causal pairs). Old tokens' keys and values never change, so both give "
            "the same tokens (tested: cached decoding = recomputing).", "dim")
