"""A student's function inside qkv's own models (``qkv learn run``; issue 40, item 4).

Three rooms, each compared with the same model running qkv's built-in code, same seed:

- **the GPT on Shakespeare** (the ``cpu`` preset's architecture: 2 blocks, width 192, 4 heads,
  context 64, characters): softmax, scaled dot-product attention, the causal mask, multi-head
  attention, sinusoidal positions, LayerNorm (and the other exercises that have a place in a
  block). Two models start from the same weights and see the same batches; the student's trains
  with their function in every block, the other with qkv's. The verdict: the outputs before training
  equal to 1e-4 of their largest (the forward pass is the same function) and the last evaluation within
  :data:`LOSS_TOLERANCE` nats (float rounding differs between a hand-written softmax and a fused
  kernel, and training amplifies it a little; a wrong function is off by far more).
- **SmolLM2-135M** (a real pretrained Llama-style model): ``rope`` rotates every query and key of
  its 30 layers; the greedy continuation must be the same text as qkv's own. ``kv_cache_step``
  keeps every layer's keys and values and attends one new token at a time; the greedy tokens
  must be those of decoding without any cache (every step recomputes the whole sequence).
- **the dates RNN** (GRU encoder-decoder, CS231N Lec 8): ``additive_attention`` scores the
  encoder states at every decoding step; trained beside qkv's ``AdditiveAttention`` on batches of
  equal source length (the exercise's function takes no padding mask).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention.functional import AttentionOutput, repeat_kv
from qkv.errors import InputError

if TYPE_CHECKING:
    from qkv.models.gpt import GPTConfig

LOSS_TOLERANCE = 0.02  # nats: the last evaluation's |student − built-in|
OUTPUT_TOLERANCE = 1e-4  # max |Δ logits| / max |logits| before any training step

GPT_EXERCISES = ("softmax", "scaled_dot_product_attention", "causal_mask", "multi_head_attention",
                 "sinusoidal_positions", "layer_norm", "feed_forward", "cross_entropy")
SMOLLM2_EXERCISES = ("rope", "kv_cache_step")
RNN_EXERCISES = ("additive_attention",)
RUNNABLE = GPT_EXERCISES + SMOLLM2_EXERCISES + RNN_EXERCISES


@dataclass
class RunResult:
    """What one run measured. ``curves``: model ("yours", "qkv's") -> split ("train",
    "validation") -> [(step, loss)] (training runs); ``texts``:
    label -> the greedy text (SmolLM2 runs); ``passed``: the verdict against ``tolerance``."""

    exercise: str
    model: str
    passed: bool
    verdict: str
    tolerance: str
    seconds: float
    curves: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    numbers: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class StudentError(Exception):
    """The student's function raised inside the model (the message says where)."""


def _call(fn: Callable[..., Any], name: str, *args: Any, **kw: Any) -> Any:
    try:
        return fn(*args, **kw)
    except (NotImplementedError, StudentError):
        raise
    except Exception as e:
        raise StudentError(f"your {name} raised {type(e).__name__} inside the model: "
                           f"{' '.join(str(e).split())[:200]}") from None


def _tensor(got: Any, name: str, shape: tuple[int, ...]) -> Tensor:
    if isinstance(got, tuple | list):
        got = got[0]
    if not isinstance(got, Tensor) or tuple(got.shape) != shape:
        what = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
        raise StudentError(f"your {name} returned {what} inside the model, expected shape {shape}; "
                           f"`qkv learn check {name}` says more")
    return got


# --------------------------------------------------------------------------- the GPT room


class StudentAttention(nn.Module):
    """Replaces one block's :class:`~qkv.attention.multihead.MultiHeadAttention` (its weights
    kept in ``inner``): the projections are qkv's, the attention in between is the student's."""

    def __init__(self, inner: nn.Module, name: str, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.inner, self.name, self.fn = inner, name, fn

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
                is_causal: bool = False, bias: Tensor | None = None, rope: nn.Module | None = None,
                cache: Any = None, backend: Any = None, return_weights: bool = False) -> AttentionOutput:
        inner, fn, name = self.inner, self.fn, self.name
        B, T, D = x.shape
        H, Dh = inner.n_heads, inner.head_dim
        if name == "multi_head_attention":
            W = inner.qkv.weight  # (3D, D): rows [q | k | v], applied as x @ W.T
            w_q, w_k, w_v = W[:D].T, W[D:2 * D].T, W[2 * D:].T
            out = _call(fn, name, x, w_q, w_k, w_v, inner.out_proj.weight.T, H, causal=True)
            return AttentionOutput(_tensor(out, name, (B, T, D)), None)
        q, k, v = inner._project(x, None, rope, 0)
        k, v = repeat_kv(k, H), repeat_kv(v, H)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if name == "softmax":
            s = (q @ k.transpose(-1, -2)) / math.sqrt(Dh)
            w = _tensor(_call(fn, name, s.masked_fill(~causal, float("-inf")), dim=-1), name, tuple(s.shape))
            out = w @ v
        elif name == "scaled_dot_product_attention":
            out = _tensor(_call(fn, name, q, k, v, mask=causal), name, (B, H, T, Dh))
        elif name == "causal_mask":
            m = _call(fn, name, T)
            if not isinstance(m, Tensor) or tuple(m.shape) != (T, T):
                raise StudentError(f"your causal_mask({T}) is not a ({T}, {T}) tensor")
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=m.to(torch.bool, copy=False))
        else:  # pragma: no cover - the table below routes only the names above here
            raise AssertionError(name)
        out = out.transpose(1, 2).reshape(B, T, H * Dh)
        return AttentionOutput(inner.out_proj(out), None)


class StudentNorm(nn.Module):
    """Replaces a LayerNorm: the student's ``layer_norm(x, weight, bias, eps)`` on its weights."""

    def __init__(self, inner: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.inner, self.fn = inner, fn

    def forward(self, x: Tensor) -> Tensor:
        w = self.inner.weight
        b = self.inner.bias if self.inner.bias is not None else torch.zeros_like(w)
        out = _call(self.fn, "layer_norm", x, w, b, eps=self.inner.eps)
        return _tensor(out, "layer_norm", tuple(x.shape))


class StudentPositions(nn.Module):
    """Replaces the sinusoidal table: rows ``offset .. offset + T`` of ``fn(max_len, dim)``."""

    def __init__(self, fn: Callable[..., Any], max_len: int, dim: int) -> None:
        super().__init__()
        table = _call(fn, "sinusoidal_positions", max_len, dim)
        self.register_buffer("table", _tensor(table, "sinusoidal_positions", (max_len, dim)).float())

    def forward(self, T: int, offset: int | Tensor = 0) -> Tensor:
        return self.table[int(offset): int(offset) + T]


class StudentMLP(nn.Module):
    """Replaces a GELU MLP: the student's ``feed_forward(x, w1, b1, w2, b2)`` on its weights."""

    def __init__(self, inner: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.inner, self.fn = inner, fn
        self.up, self.down = _linears(inner)

    def forward(self, x: Tensor) -> Tensor:
        up, down = self.up, self.down
        b1 = up.bias if up.bias is not None else torch.zeros(up.weight.shape[0])
        b2 = down.bias if down.bias is not None else torch.zeros(down.weight.shape[0])
        out = _call(self.fn, "feed_forward", x, up.weight.T, b1, down.weight.T, b2)
        return _tensor(out, "feed_forward", tuple(x.shape))


def _linears(mlp: nn.Module) -> tuple[nn.Module, nn.Module]:
    lins = [m for m in mlp.modules() if isinstance(m, nn.Linear)]
    if len(lins) != 2:
        raise InputError("feed_forward runs inside a GELU MLP of two linear layers; this model's MLP has "
                         f"{len(lins)}")
    return lins[0], lins[1]


def gpt_config(name: str, vocab: int) -> GPTConfig:
    """The ``cpu`` preset's GPT (fp32, no dropout); sinusoidal positions for that exercise."""
    from qkv.models.gpt import GPTConfig
    from qkv.presets import GPT_PRESETS

    model = dict(GPT_PRESETS["cpu"]["model"])
    if name == "sinusoidal_positions":
        model["positions"] = "sinusoidal"
    return GPTConfig(vocab_size=vocab, **model)


def with_student(model: nn.Module, name: str, fn: Callable[..., Any]) -> nn.Module:
    """``model`` (a qkv GPT) with the student's ``fn`` in the place of exercise ``name``."""
    from qkv.layers.norm import LayerNorm

    for block in model.stack.blocks:
        if name in ("softmax", "scaled_dot_product_attention", "causal_mask", "multi_head_attention"):
            block.attn = StudentAttention(block.attn, name, fn)
        elif name == "layer_norm":
            for attr in ("norm1", "norm2"):
                if isinstance(getattr(block, attr), LayerNorm):
                    setattr(block, attr, StudentNorm(getattr(block, attr), fn))
        elif name == "feed_forward":
            block.mlp = StudentMLP(block.mlp, fn)
    if name == "layer_norm":
        for attr, mod in list(model.stack.named_children()):
            if isinstance(mod, LayerNorm):
                setattr(model.stack, attr, StudentNorm(mod, fn))
    if name == "sinusoidal_positions":
        model.pos_emb = StudentPositions(fn, model.cfg.max_seq_len, model.cfg.dim)
    return model


def shakespeare() -> tuple[Any, Tensor, Tensor]:
    """(character tokenizer, train ids, val ids) of the Shakespeare asset."""
    from qkv.data.corpora import load_text
    from qkv.tokenizers.char import CharTokenizer

    text = load_text().text
    tok = CharTokenizer(sorted(set(text)))
    ids = torch.tensor(tok.encode(text), dtype=torch.long)
    n = int(len(ids) * 0.9)
    return tok, ids[:n], ids[n:]


def _windows(data: Tensor, starts: Tensor, T: int) -> tuple[Tensor, Tensor]:
    idx = starts[:, None] + torch.arange(T + 1)
    w = data[idx]
    return w[:, :-1], w[:, 1:]


@dataclass
class Side:
    """One of the two models a training run compares: how to build it, its loss on a batch and
    its outputs (logits) on a batch."""

    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Any], Tensor]
    outputs: Callable[[nn.Module, Any], Tensor]


def _block_outputs(model: nn.Module, run: Callable[[], Any]) -> list[Tensor]:
    """The output of every block of ``model`` (its first ``blocks`` or ``layers`` list, at any
    depth: GPT's is ``stack.blocks``) while ``run()`` runs it, in order (none for a model without
    such a list)."""
    blocks = next((m for name, m in model.named_modules()
                   if name.rsplit(".", 1)[-1] in ("blocks", "layers") and isinstance(m, nn.ModuleList)), None)
    seen: list[Tensor] = []
    if not isinstance(blocks, nn.ModuleList):
        run()
        return seen
    hooks = [b.register_forward_hook(lambda _m, _i, out: seen.append(
        (out[0] if isinstance(out, tuple) else out).detach().double())) for b in blocks]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def first_difference(yours: list[Tensor], ours: list[Tensor], logits: tuple[Tensor, Tensor]) -> str:
    """Where two forward passes first part: the first block whose output differs by more than
    :data:`OUTPUT_TOLERANCE` of its largest, and there the first position (dim 1) that does."""
    stages = [(f"block {i}'s output", a, b) for i, (a, b) in enumerate(zip(yours, ours, strict=False))]
    stages.append(("the logits", *logits))
    for what, a, b in stages:
        if a.shape != b.shape:
            return f"{what} has shape {tuple(a.shape)}, qkv's {tuple(b.shape)}"
        scale = b.abs().max().clamp_min(1e-12)
        bad = ~torch.isfinite(a) & torch.isfinite(b)
        err = (a - b).abs().nan_to_num(0.0, 0.0, 0.0)
        off = bad | (err / scale > OUTPUT_TOLERANCE)
        if off.any():
            per_pos = off.any(dim=tuple(d for d in range(off.ndim) if d != 1)) if off.ndim > 1 else off
            pos = int(per_pos.nonzero()[0])
            if bad.any():
                return f"{what} has NaN or inf first at position {pos} (qkv's is finite there)"
            rel = err.max().item() / scale.item()
            return f"{what} differ{'' if what == 'the logits' else 's'} first, at position {pos} " \
                   f"(max error {rel:.1e} of its largest)"
    return "the outputs differ"


def side_by_side(name: str, model_text: str, yours: Side, ours: Side, batches: list[Any], evals: list[Any],
                 make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer], seed: int,
                 progress: Callable[[str, int, int], None] | None) -> RunResult:
    """Train the student's model and qkv's from the same seed on the same ``batches``, evaluating
    on ``evals`` ten times; the verdict compares the outputs before any step (the same function?
    max |Δ| relative to the largest, :data:`OUTPUT_TOLERANCE`) and the last evaluation's loss
    (:data:`LOSS_TOLERANCE`). When the outputs (or the loss) already differ before training, it
    stops there and says where: the first block and position that differ."""
    start = time.perf_counter()
    steps = len(batches)
    every = max(1, steps // 10)
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    models: dict[str, nn.Module] = {}
    before: dict[str, Tensor] = {}
    inside: dict[str, list[Tensor]] = {}
    first: dict[str, float] = {}
    for label, side in (("yours", yours), ("qkv's", ours)):
        torch.manual_seed(seed)
        model = models[label] = side.build()
        with torch.no_grad():
            def forward(model: nn.Module = model, side: Side = side, label: str = label) -> None:
                before[label] = side.outputs(model, evals[0]).detach().double()
            inside[label] = _block_outputs(model, forward)
            model.eval()
            first[label] = sum(side.loss(model, b).item() for b in evals) / len(evals)
            model.train()
    a, b = before["yours"], before["qkv's"]
    d_first = (a - b).abs().max().item() / b.abs().max().item() if a.shape == b.shape else math.inf
    d_loss = abs(first["yours"] - first["qkv's"])
    if not d_first <= OUTPUT_TOLERANCE or not d_loss <= LOSS_TOLERANCE / 10:
        mine, theirs = first["yours"], first["qkv's"]
        if not d_first <= OUTPUT_TOLERANCE:
            where = first_difference(inside["yours"], inside["qkv's"], (a, b))
        else:
            where = f"the loss is {mine:.4f} with yours, {theirs:.4f} with qkv's"
        return RunResult(name, model_text, False,
                         f"before training, {where}: not the same function, so it stopped there "
                         "(no training)",
                         f"outputs before training within {OUTPUT_TOLERANCE:g} of their largest",
                         time.perf_counter() - start,
                         numbers={"first_yours": first["yours"], "first_qkv": first["qkv's"],
                                  "output_difference": d_first})
    for label, side in (("yours", yours), ("qkv's", ours)):
        model = models[label]
        opt = make_opt([p for p in model.parameters() if p.requires_grad])

        def evaluate(model: nn.Module = model, side: Side = side) -> float:
            model.eval()
            with torch.no_grad():
                vals = [side.loss(model, b).item() for b in evals]
            model.train()
            return sum(vals) / len(vals)

        train, val = [], []
        for step, batch in enumerate(batches):
            if step % every == 0:
                val.append((step, evaluate()))
            loss = side.loss(model, batch)
            if not torch.isfinite(loss):
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            train.append((step, loss.item()))
            if progress is not None:
                progress(label, step + 1, steps)
        val.append((steps, evaluate()))
        curves[label] = {"train": train, "validation": val}
        if label == "yours" and len(train) < steps:
            break  # NaN or inf: no need to train qkv's
    yours_v = curves["yours"]["validation"]
    if "qkv's" not in curves:
        return RunResult(name, model_text, False,
                         f"your model's loss became NaN or infinite at step {len(curves['yours']['train'])}",
                         "a finite loss at every step", time.perf_counter() - start, curves=curves)
    ours_v = curves["qkv's"]["validation"]
    first_y, first_o, last_y, last_o = yours_v[0][1], ours_v[0][1], yours_v[-1][1], ours_v[-1][1]
    d_last = abs(last_y - last_o)
    verdict = (f"after {steps} steps the validation loss is {last_y:.4f} with yours, {last_o:.4f} with "
               f"qkv's (|difference| {d_last:.4f})")
    passed = d_last <= LOSS_TOLERANCE
    return RunResult(name, model_text, passed, verdict,
                     f"outputs before training within {OUTPUT_TOLERANCE:g} of their largest, the last "
                     f"validation loss within {LOSS_TOLERANCE:g} nats",
                     time.perf_counter() - start, curves=curves,
                     numbers={"first_yours": first_y, "first_qkv": first_o, "val_yours": last_y,
                              "val_qkv": last_o, "output_difference": d_first})


def run_gpt(name: str, fn: Callable[..., Any], steps: int = 200, seed: int = 0, batch: int = 16,
            progress: Callable[[str, int, int], None] | None = None) -> RunResult:
    """Train two copies of the ``cpu`` GPT on Shakespeare, ``steps`` AdamW steps on the same
    batches from the same weights: one with the student's ``fn``, one with qkv's own."""
    from qkv.models.gpt import GPT

    _, train, val = shakespeare()
    cfg = gpt_config(name, int(max(train.max(), val.max())) + 1)
    T = cfg.max_seq_len
    g = torch.Generator().manual_seed(seed)

    def draw(data: Tensor) -> tuple[Tensor, Tensor]:
        return _windows(data, torch.randint(len(data) - T - 1, (batch,), generator=g), T)

    batches = [draw(train) for _ in range(steps)]
    evals = [draw(val) for _ in range(4)]

    def logits(model: nn.Module, xy: tuple[Tensor, Tensor]) -> Tensor:
        return model(xy[0]).logits

    def ours(model: nn.Module, xy: tuple[Tensor, Tensor]) -> Tensor:
        logits = model(xy[0]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), xy[1].reshape(-1))

    def yours(model: nn.Module, xy: tuple[Tensor, Tensor]) -> Tensor:
        if name != "cross_entropy":
            return ours(model, xy)
        got = _call(fn, name, model(xy[0]).logits, xy[1])
        if not isinstance(got, Tensor) or got.numel() != 1:
            raise StudentError("your cross_entropy did not return one number (the mean loss)")
        return got.reshape(())

    return side_by_side(
        name, "the cpu GPT on Shakespeare (2 blocks, width 192, 4 heads, context 64; AdamW 3e-3, "
        f"batch {batch}, seed {seed})", Side(lambda: with_student(GPT(cfg), name, fn), yours, logits),
        Side(lambda: GPT(cfg), ours, logits), batches, evals,
        lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.0), seed, progress)


# --------------------------------------------------------------------------- the SmolLM2 room

PROMPT = "The capital of France is Paris. The capital of Germany is"


class StudentRope(nn.Module):
    """Replaces a model's RotaryEmbedding: ``rope(x, positions, theta)`` at the cache's offset."""

    def __init__(self, inner: nn.Module, fn: Callable[..., Any], theta: float) -> None:
        super().__init__()
        self.inner, self.fn, self.theta = inner, fn, theta

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        if isinstance(offset, Tensor) and offset.numel() != 1:
            raise InputError("qkv learn run rope decodes one row at a time")
        T = x.shape[-2]
        pos = torch.arange(int(offset), int(offset) + T)
        return _tensor(_call(self.fn, "rope", x, pos, theta=self.theta), "rope", tuple(x.shape))


class StudentCache(nn.Module):
    """Replaces one layer's attention: keys and values kept by the student's ``kv_cache_step``,
    one new token at a time (the model runs with no cache of its own)."""

    def __init__(self, inner: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.inner, self.fn = inner, fn
        self.pos = 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def forward(self, x: Tensor, context: Tensor | None = None, *, rope: nn.Module | None = None,
                **_: Any) -> AttentionOutput:
        inner = self.inner
        B, T, _ = x.shape
        H, Dh = inner.n_heads, inner.head_dim
        q, k, v = inner._project(x, None, rope, self.pos)
        k, v = repeat_kv(k, H), repeat_kv(v, H)
        if self.k is None:
            self.k = self.v = k[:, :, :0]
        outs = []
        for t in range(T):
            got = _call(self.fn, "kv_cache_step", q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                        self.k, self.v)
            if not (isinstance(got, tuple | list) and len(got) == 3):
                raise StudentError("your kv_cache_step must return (out, k_cache, v_cache)")
            out, self.k, self.v = got
            outs.append(_tensor(out, "kv_cache_step", (B, H, 1, Dh)))
            if self.k.shape[2] != self.pos + t + 1:
                raise StudentError(f"after {self.pos + t + 1} tokens your k_cache holds {self.k.shape[2]} "
                                   "positions along dim 2")
        self.pos += T
        out = torch.cat(outs, dim=2).transpose(1, 2).reshape(B, T, H * Dh)
        return AttentionOutput(inner.out_proj(out), None)


def _greedy_full(lm: Any, ids: list[int], n: int) -> list[int]:
    """Greedy decoding with no cache at all (every step runs the whole sequence), by qkv's one
    decoding loop (:meth:`CausalLM.steps`), eagerly."""
    from qkv.generation.decoders import DecodeMode

    return [t for t, _ in lm.steps(ids, n, use_cache=False, stop_at_eos=False, mode=DecodeMode.EAGER)]


def _greedy_student(model: nn.Module, ids: list[int], n: int) -> list[int]:
    """Greedy decoding feeding only the new token each step (the student's cache holds the rest)."""
    out = list(ids)
    logits = model(torch.tensor([ids])).logits[0, -1]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([out[-1:]])).logits[0, -1]
    return out[len(ids):]


def run_smollm2(name: str, fn: Callable[..., Any], new_tokens: int = 24,
                progress: Callable[[str, int, int], None] | None = None) -> RunResult:
    """``rope`` or ``kv_cache_step`` inside SmolLM2-135M: the greedy tokens against qkv's own."""
    from qkv.inference.loading import open_model

    start = time.perf_counter()
    lm = open_model("smollm2", weights="fp32")
    model = lm.model.eval()
    ids = list(lm.tokenizer.encode(PROMPT))
    with torch.inference_mode():
        if progress:
            progress("qkv's", 0, 1)
        ours = _greedy_full(lm, ids, new_tokens)
        if progress:
            progress("qkv's", 1, 1)
        if name == "rope":
            theta = float(model.cfg.rope_theta)
            saved = model.rope
            model.rope = StudentRope(saved, fn, theta)
            try:
                yours = _greedy_full(lm, ids, new_tokens)
            finally:
                model.rope = saved
            where = "rotating every query and key of the 30 layers"
        else:
            blocks = list(model.stack.blocks)
            saved = [b.attn for b in blocks]
            for b in blocks:
                b.attn = StudentCache(b.attn, fn)
            try:
                yours = _greedy_student(model, ids, new_tokens)
            finally:
                for b, a in zip(blocks, saved, strict=True):
                    b.attn = a
            where = "keeping every layer's keys and values, one token per step"
        if progress:
            progress("yours", 1, 1)
    same = sum(a == b for a, b in zip(yours, ours, strict=True))
    first_diff = next((i for i, (a, b) in enumerate(zip(yours, ours, strict=True)) if a != b), None)
    passed = first_diff is None
    text_y, text_o = lm.tokenizer.decode(yours), lm.tokenizer.decode(ours)
    if passed:
        verdict = f"the same {new_tokens} greedy tokens as qkv's own ({where})"
    else:
        verdict = (f"the greedy tokens part at token {first_diff} ({same}/{new_tokens} equal): yours "
                   f"{text_y!r} vs qkv's {text_o!r}")
    reference = "qkv's RoPE" if name == "rope" else "decoding without a cache (the whole sequence each step)"
    return RunResult(name, f"SmolLM2-135M (fp32), prompt {PROMPT!r}, greedy", passed, verdict,
                     f"every greedy token equal to {reference}", time.perf_counter() - start,
                     texts={"yours": text_y, "qkv's": text_o}, tokens={"yours": yours, "qkv's": ours},
                     numbers={"equal_tokens": float(same), "tokens": float(new_tokens)})


# --------------------------------------------------------------------------- the dates RNN room


class StudentAdditive(nn.Module):
    """Replaces the dates RNN's AdditiveAttention: ``additive_attention(query, keys, w_q, w_k, v)``
    on its weights (the key projection's bias added to the keys' projection is qkv's; the student's
    function has none, so both models are built without it)."""

    def __init__(self, inner: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.inner, self.fn = inner, fn

    def project_keys(self, keys: Tensor) -> Tensor:
        return keys  # the student's function projects the keys itself

    def forward(self, query: Tensor, keys: Tensor, values: Tensor | None = None, mask: Tensor | None = None,
                projected_keys: Tensor | None = None) -> AttentionOutput:
        inner = self.inner
        got = _call(self.fn, "additive_attention", query, keys, inner.w_q.weight.T, inner.w_k.weight.T,
                    inner.w_v.weight[0])
        if not (isinstance(got, tuple | list) and len(got) == 2):
            raise StudentError("your additive_attention must return (context, weights)")
        B, S, Dk = keys.shape
        return AttentionOutput(_tensor(got[0], "additive_attention", (B, Dk)),
                               _tensor(got[1], "additive_attention", (B, S)))


def run_dates(name: str, fn: Callable[..., Any], steps: int = 100, seed: int = 0, batch: int = 32,
              progress: Callable[[str, int, int], None] | None = None) -> RunResult:
    """Train two GRU encoder-decoders with Bahdanau attention on dates: the student's additive
    attention against qkv's, same weights, same batches (each of one source length)."""
    from qkv.data.dates import make_date_pairs
    from qkv.models.rnn_seq2seq import RNNSeq2Seq, RNNSeq2SeqConfig
    from qkv.tokenizers.vocab import BOS, EOS, PAD, CharVocab

    pairs = make_date_pairs(n_train=6000, n_val=400, n_test=10, n_heldout=10, seed=seed)
    src_vocab = CharVocab.build([s for s, _ in pairs.train])
    tgt_vocab = CharVocab.build([t for _, t in pairs.train])

    def by_length(rows: list[tuple[str, str]]) -> dict[int, list[tuple[str, str]]]:
        out: dict[int, list[tuple[str, str]]] = {}
        for s, t in rows:
            out.setdefault(len(src_vocab.encode(s)), []).append((s, t))
        return {n: r for n, r in out.items() if len(r) >= 8}

    def tensors(rows: list[tuple[str, str]]) -> tuple[Tensor, Tensor]:
        src = torch.tensor([src_vocab.encode(s) for s, _ in rows])
        tl = max(len(tgt_vocab.encode(t)) for _, t in rows) + 2
        tgt = torch.full((len(rows), tl), PAD)
        for i, (_, t) in enumerate(rows):
            ids = [BOS, *tgt_vocab.encode(t), EOS]
            tgt[i, : len(ids)] = torch.tensor(ids)
        return src, tgt

    train, val = by_length(pairs.train), by_length(pairs.val)
    g = torch.Generator().manual_seed(seed)
    lengths = sorted(train)
    weights = torch.tensor([len(train[n]) for n in lengths], dtype=torch.float)
    batches = []
    for _ in range(steps):
        n = lengths[int(torch.multinomial(weights, 1, generator=g))]
        rows = train[n]
        pick = torch.randint(len(rows), (min(batch, len(rows)),), generator=g).tolist()
        batches.append(tensors([rows[i] for i in pick]))
    evals = [tensors(rows[:batch]) for rows in list(val.values())[:6]]
    cfg = RNNSeq2SeqConfig(src_vocab=len(src_vocab), tgt_vocab=len(tgt_vocab), emb_dim=32, hidden=64,
                           dec_hidden=128, attn_dim=64, max_src_len=max(lengths), max_tgt_len=16)

    def build(student: bool) -> nn.Module:
        model = RNNSeq2Seq(cfg)
        model.attn.w_k.bias.data.zero_()
        model.attn.w_k.bias.requires_grad_(False)  # the exercise's additive attention has no bias
        if student:
            model.attn = StudentAdditive(model.attn, fn)
        return model

    def loss(model: nn.Module, st: tuple[Tensor, Tensor]) -> Tensor:
        return model(*st).loss

    def logits(model: nn.Module, st: tuple[Tensor, Tensor]) -> Tensor:
        return model(*st).logits

    return side_by_side(
        name, "the dates RNN (GRU encoder-decoder, Bahdanau attention; Adam 2e-3, "
        f"batch {batch}, seed {seed})",
        Side(lambda: build(True), loss, logits), Side(lambda: build(False), loss, logits), batches, evals,
        lambda ps: torch.optim.Adam(ps, lr=2e-3), seed, progress)


def run(name: str, fn: Callable[..., Any], steps: int | None = None, seed: int = 0,
        progress: Callable[[str, int, int], None] | None = None) -> RunResult:
    """Exercise ``name``'s function ``fn`` inside the model it belongs to (see the module doc)."""
    if name in GPT_EXERCISES:
        return run_gpt(name, fn, steps or 200, seed, progress=progress)
    if name in SMOLLM2_EXERCISES:
        return run_smollm2(name, fn, progress=progress)
    if name in RNN_EXERCISES:
        return run_dates(name, fn, steps or 100, seed, progress=progress)
    raise InputError(f"{name} has no model to run in; `qkv learn run` takes {', '.join(RUNNABLE)}")
