"""Text models ready to use: text in, embeddings or text out.

    enc = qkv.load("minilm");  enc.embed(["a sentence", ...])  -> (N, 384), unit length
                               enc.rank("query", documents)     -> [(index, cosine), ...]
    lm = qkv.load("smollm2");  lm.generate("Once upon a time", max_new_tokens=64)
                               lm.generate("What is the capital of France?", chat=True)
    lm = qkv.load("runs/gpt-cpu-...");  lm.generate("\\n", 300, temperature=0.8)

Each object holds a qkv model (built from ``qkv.layers``), its tokenizer and the settings read
from where it came from (a GGUF file, a Hugging Face folder, a run directory of ``qkv train``);
nothing here reads a file. :class:`CausalLM` is the one decoding path: ``qkv generate``, the
server and Python all stream through :meth:`CausalLM.stream`, and :meth:`CausalLM.set_weights`
is the one place that decides how the weights are held (fp32, bf16, int8, q4).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, overload

import torch
from torch import Tensor

from qkv.generation import generate as generate_tokens
from qkv.generation.builds import Decision, StepStatus, ensure, saved_steps_wanted, warn_once
from qkv.generation.decode import crop_prompt, text_pieces
from qkv.generation.decoders import DecodeMode
from qkv.generation.sampling import make_generator
from qkv.models.encoder import Encoder
from qkv.models.gpt import GPT
from qkv.pipelines.kinds import Kind, LayersAndHeads
from qkv.tokenizers.base import Tokenizer

DTypeName = Literal["float32", "bfloat16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Weights = Literal["auto", "fp32", "bf16", "int8", "q4"]
WEIGHTS: tuple[Weights, ...] = ("auto", "fp32", "bf16", "int8", "q4")
# GGUF block formats whose groups of 32 are exactly torch's 4-bit groups: Q4_1 (w = d·q + m)
# and Q4_0 (w = d·(q − 8)). Re-grouping their dequantised weights gives back the file's own
# codes and scales, so weights="q4" decodes from the file's 4 bits, not from a second rounding:
# for Q4_1 by each group's min and max (llama.cpp sets d and m from them), for Q4_0 by the
# symmetric scale that puts every weight of a group on a whole code (llama.cpp's reference
# quantiser puts the largest |w| at code 0, its importance-matrix one may not; a Q4_0 file
# regrouped by min and max, as before, moved its logits by 0.5 in 2.3). A file mixing the two
# is not decoded in 4 bits.
Q4_SOURCES = ("Q4_0", "Q4_1")


def weights_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A weights' precision by name ("float32", "bfloat16", ...) or as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def sample_prompt(tok: Tokenizer) -> str:
    """What a trained run continues when no prompt is given: a newline if its tokenizer knows one
    (a new speech, in Shakespeare), else its first token."""
    try:
        return "\n" if tok.encode("\n") else tok.decode([0])
    except ValueError:  # a character tokenizer of a text without newlines
        return tok.decode([0])


@dataclass
class SentenceEncoder(LayersAndHeads):
    """A sentence-embedding model: mean-pooled, L2-normalised encoder states (Sentence-BERT).

    ``architecture``: what it was built from ("bert"). ``max_tokens``: longer sentences are
    truncated (sentence-transformers does the same).
    """

    name: str
    model: Encoder
    tokenizer: Tokenizer
    max_tokens: int
    architecture: str = "bert"
    kind: ClassVar[Kind] = "encoder"

    @property
    def context(self) -> int:
        """The most tokens read at once."""
        return self.model.cfg.max_seq_len

    @torch.inference_mode()
    def embed(
        self,
        texts: str | Sequence[str],
        batch_size: int = 32,
        normalize: bool = True,
        on_batch: Callable[[int], None] | None = None,
    ) -> Tensor:
        """(N, dim) float32 embeddings of ``texts`` (one text -> (1, dim)).

        All texts are tokenized first (in parallel), then sorted by their number of tokens
        and batched, so a batch holds little padding (sorting by characters, as
        sentence-transformers does, pads ~1.5x more on mixed prose and code). The result is in
        the input order. ``on_batch(n)`` is called after each batch of n texts.
        """
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("embed() takes a string or a sequence of strings")
        device = self.model.tok_emb.weight.device
        out = torch.empty(len(texts), self.model.cfg.dim)
        all_ids = self.tokenizer.encode_many(texts, self.max_tokens)  # type: ignore[attr-defined]
        order = sorted(range(len(texts)), key=lambda i: len(all_ids[i]))
        for start in range(0, len(texts), batch_size):
            idx = order[start : start + batch_size]
            lengths = [len(all_ids[i]) for i in idx]
            width = max(lengths)
            x = torch.tensor([all_ids[i] + [0] * (width - len(all_ids[i])) for i in idx], device=device)
            mask = torch.arange(x.shape[1], device=device) < torch.tensor(lengths, device=device)[:, None]
            pooled = self.model.pool(self.model(x, mask).hidden, mask).float()
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            out[idx] = pooled.cpu()
            if on_batch is not None:
                on_batch(len(idx))
        return out

    def rank(self, query: str, documents: Sequence[str], batch_size: int = 32) -> list[tuple[int, float]]:
        """Documents ranked by cosine similarity to ``query``: [(index, score)], best first.

        Retrieval as an inner product of unit vectors (CS189 Lec 21, "inner-product retrieval").
        """
        if not documents:
            raise ValueError("rank() needs at least one document")
        e = self.embed([query, *documents], batch_size)
        scores = e[1:] @ e[0]  # (N,) cosines, since rows have unit length
        order = torch.argsort(scores, descending=True)
        return [(int(i), float(scores[i])) for i in order]


@dataclass
class StreamStats:
    """What the last :meth:`CausalLM.stream` did: tokens read and written, and how long the
    new ones took (prompt included)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    first_token_s: float = 0.0  # the prompt's prefill and the first new token
    notes: list[str] = field(default_factory=list)  # what was changed about the request
    decision: Decision | None = None  # which decoder ran the steps, and why not the saved step

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the whole time, the prompt's prefill included."""
        return self.new_tokens / max(self.seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        """The tokens after the first over the time after it: the decoding rate alone (what
        llama.cpp's ``llama-bench`` reports as tg)."""
        if self.new_tokens < 2:
            return 0.0
        return (self.new_tokens - 1) / max(self.seconds - self.first_token_s, 1e-9)


@dataclass
class CausalLM(LayersAndHeads):
    """A decoder (qkv's GPT) with its tokenizer, chat template and stop tokens.

    name: how it is called in messages. architecture: "llama", "qwen2", "gpt2", "gemma", or
    "gpt" for a qkv run. stored_as: how the file stores its block matrices (a GGUF's
    ``("Q4_1",)``; empty for floats): whether ``weights="q4"`` can keep the file's own 4 bits.
    weights: how the weights are held now (see :meth:`set_weights`). run_dir: the run directory
    of a model trained by qkv (None otherwise). default_prompt: what to continue when none is
    given (a run's newline; None: a prompt is needed).
    """

    name: str
    model: GPT
    tokenizer: Tokenizer
    chat_template: str | None = None
    stop_ids: tuple[int, ...] = ()
    architecture: str = "gpt"
    stored_as: tuple[str, ...] = ()
    weights: Weights = "fp32"
    run_dir: Path | None = None
    default_prompt: str | None = None
    last_stats: StreamStats = field(default_factory=StreamStats)  # of the last stream()
    kind: ClassVar[Kind] = "decoder"

    @property
    def context(self) -> int:
        """The most tokens read at once (the model's ``max_seq_len``)."""
        return self.model.cfg.max_seq_len

    def prepare(self, batch_rows: int = 0, batch_tokens: int = 256,
                on_stage: Callable[[str], object] | None = None) -> list[StepStatus]:
        """Build this model's saved decoding steps on this machine if it has none (what ``qkv
        prepare`` does; tens of seconds, once per model, weight format, thread count and
        machine), so that every later process decodes through them from its first token: ~3x the
        eager speed (BENCHMARKS.md). Nothing is built where the native step
        (:mod:`qkv.generation.native_step`: no set-up, faster still) runs the model: it decodes
        one request and a running batch's rows alike. Else the step of one request, and with
        ``batch_rows`` >= 2 the step of a running batch of that many rows over ``batch_tokens``
        positions (what ``qkv serve`` decodes with: 8 x 256 by default).
        Returns each built step's status, one request's first (a failure is a status, never an
        exception); ``on_stage`` is told each stage as it begins."""
        if not saved_steps_wanted(self.model):
            return []
        out = [ensure(self.model, on_stage=on_stage)]
        if batch_rows >= 2:
            out.append(ensure(self.model, rows=batch_rows, cache_len=min(batch_tokens, self.context),
                              on_stage=on_stage))
        return out

    # ------------------------------------------------------------------ how the weights are held

    def to(self, dtype: str | torch.dtype) -> CausalLM:
        """Cast the weights to float32 (exact to the reference) or bfloat16 (half the memory
        traffic per token)."""
        self._check_not_quantized(f"cast to {dtype}")
        dt = weights_dtype(dtype)
        self.model.to(dt)
        self.weights = "bf16" if dt == torch.bfloat16 else "fp32"
        return self

    def _check_not_quantized(self, what: str) -> None:
        if self.weights in ("int8", "q4"):
            raise ValueError(f"{self.name} is stored as {self.weights}, which cannot be {what}; "
                             f"load it again: qkv.load({self.name!r}, weights=...)")

    def set_weights(self, weights: Weights | None = None, dtype: str | torch.dtype | None = None) -> CausalLM:
        """The one rule for how a loaded decoder holds its weights: ``weights`` when given (see
        :meth:`quantize`), else ``dtype`` when given (a cast), else ``"auto"``."""
        if weights is not None:
            return self.quantize(weights)
        if dtype is not None:
            return self.to(dtype)
        return self.quantize("auto")

    def quantize(self, weights: Weights) -> CausalLM:
        """Store the weights as ``weights``, in place, for faster decoding:

        - "fp32": as converted (exact to the reference implementation); "bf16": cast.
        - "int8": every projection in 8-bit groups of 32 (GGUF's Q8_0 grid) on qkv's kernel
          (:mod:`qkv.kernels`), or as int8 rows on PyTorch's where that is not available.
        - "q4": the decoder blocks' projections in 4-bit groups of 32, the file's own codes and
          float16 scales (each SwiGLU's gate and up matrices as one), on qkv's kernel (int8
          activations with their residual), or PyTorch's int4 kernel (bf16 activations) where
          that is not available. Only for files stored in 4 bits (Q4_0/Q4_1).
        - "auto": q4 where the file is stored in 4 bits and PyTorch has the kernels, else fp32.

        int8 and q4 give the output head 8-bit groups (Q8_0's, on qkv's kernel where it builds,
        else int8 rows on PyTorch's) whose 64 largest logits are recomputed in fp32
        (:class:`~qkv.layers.quant.TopKRefinedLinear`). The embedding table, norms and the
        attention arithmetic stay float32.
        """
        from qkv.kernels import q8_op
        from qkv.layers.quant import (
            Int8Linear,
            Q8Linear,
            TopKRefinedLinear,
            int4_kernels_available,
            quantize_linears,
        )

        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
        self._check_not_quantized(f"re-stored as {weights}")
        types = list(self.stored_as)
        in_4_bits = len(types) == 1 and types[0] in Q4_SOURCES  # one 4-bit grid: its codes kept
        if weights == "auto":
            weights = "q4" if in_4_bits and int4_kernels_available() else "fp32"
        if weights == "q4" and not in_4_bits:
            stored = ", ".join(types) or ("floats (a qkv run)" if self.run_dir else "floats (not a GGUF)")
            raise ValueError(
                f"weights q4 decodes from a file's own 4-bit groups (all {' or all '.join(Q4_SOURCES)}); "
                f"{self.name}'s blocks are stored as {stored}: use --weights int8 (weights='int8'), "
                "bf16 or fp32")
        if weights == "q4" and not int4_kernels_available():
            raise ValueError(f"weights q4 needs PyTorch's CPU int4 kernels (torch >= 2.5; this is "
                             f"{torch.__version__}); use --weights int8 (weights='int8')")
        if weights in ("fp32", "bf16"):
            return self.to("float32" if weights == "fp32" else "bfloat16")
        self.model.to(torch.float32)
        if weights == "q4":
            quantize_linears(self.model, "q4", skip=("lm_head",), symmetric=types == ["Q4_0"])
        lin = self.model.lm_head
        head = lin.weight.detach()  # (V, dim) float32, the tied embedding
        quantize_linears(self.model, "int8", skip=("lm_head",))
        V, D = head.shape
        if q8_op() is not None and V % 16 == 0 and D % 32 == 0 and Q8Linear.fits(head):
            # 8-bit groups of 32 on qkv's kernel: the file's own Q8_0 blocks where it stores the
            # head so (SmolLM2), else the head re-quantised to them
            approx: torch.nn.Module = Q8Linear.from_float(head, bias=lin.bias)
        else:
            approx = Int8Linear.from_float(head, bias=lin.bias)
        # Near-ties in the approximate logits (bf16 ones from PyTorch's int8 kernel round to
        # 0.125 steps) could swap: recompute the top 64 in fp32.
        tied = head.data_ptr() == self.model.tok_emb.weight.data_ptr()
        self.model.lm_head = TopKRefinedLinear(approx, head, owned=not tied)
        self.weights = weights
        return self

    # ------------------------------------------------------------------ text in, text out

    def format_chat(self, messages: str | Sequence[dict[str, str]], system: str | None = None) -> str:
        """Render the checkpoint's chat template (ChatML for SmolLM2) with the assistant turn
        opened, ready for generation. A string is one user message."""
        if self.chat_template is None:
            raise ValueError(f"{self.name} has no chat template; generate without --chat")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        messages = list(messages)
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # The template comes from a file: render it sandboxed, as transformers does.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True,
                bos_token="", eos_token=self.tokenizer.decode(self.stop_ids[:1]),
            )
        except TemplateError as e:
            raise ValueError(f"the chat template of {self.name} failed to render: {e}") from None

    def prompt_ids(self, prompt: str, *, chat: bool = False, system: str | None = None,
                   slide: bool = False) -> tuple[list[int], list[str]]:
        """The ids generation starts from, and notes on what was changed about them.

        A prompt that fills the context: refused (``slide`` False: the caller asked for the
        whole prompt to be read), or cropped to its last ``context - 1`` tokens with a note.
        """
        if system is not None and not chat:
            raise ValueError("a system message is part of a chat: add --chat (chat=True)")
        text = self.format_chat(prompt, system) if chat else prompt
        if not text:
            raise ValueError("the prompt is empty; give some text to continue")
        try:
            ids = self.tokenizer.encode(text)
        except ValueError as e:  # a character the vocabulary does not hold
            raise ValueError(f"the prompt cannot be read by {self.name}: {e}") from None
        if not ids:
            raise ValueError("the prompt encodes to no tokens; give some text to continue")
        W = self.context
        if len(ids) < W:
            return ids, []
        if not slide:
            raise ValueError(f"the prompt has {len(ids)} tokens; {self.name} reads at most "
                             f"{W - 1} plus one new token: shorten it")
        kept = crop_prompt(torch.tensor([ids]), W)[0][0].tolist()
        return kept, [f"prompt has {len(ids)} tokens, more than the context; keeping the last {len(kept)}"]

    def stream(
        self,
        prompt: str,
        max_new_tokens: int = 128,
        *,
        chat: bool = False,
        system: str | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        use_cache: bool = True,
        stop_at_eos: bool = True,
        mode: DecodeMode | str = DecodeMode.AUTO,
        slide: bool = False,
    ) -> Iterator[str]:
        """Yield the continuation of ``prompt`` piece by piece (whole characters only).

        ``chat=True`` wraps the prompt in the chat template. Without ``slide``, at most
        ``context - len(prompt)`` tokens are generated and a prompt that fills the context is
        refused; with ``slide`` (what ``qkv generate`` asks for a continuation) a long prompt
        keeps its last tokens and generation goes on past the context, which keeps its newest
        half (:func:`qkv.generation.generate`). Notes on either are in ``last_stats.notes``.
        ``mode`` (:class:`~qkv.generation.decoders.DecodeMode`): ``"auto"`` decodes through the
        model's saved step when one was built on this machine (:meth:`prepare`, ``qkv prepare``;
        loaded in milliseconds), else eagerly, with an
        :class:`~qkv.generation.builds.EagerDecodingWarning` once per process saying how to
        build one; ``"build"`` builds it first if there is none (once per model and machine);
        ``"jit"`` compiles in this process (:mod:`qkv.generation.compiled`); ``"eager"``. Which
        decoder ran, and why, is in ``last_stats.decision``.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        ids, notes = self.prompt_ids(prompt, chat=chat, system=system, slide=slide)
        if not slide and max_new_tokens > self.context - len(ids):
            notes.append(f"max_new_tokens {max_new_tokens} bounded to {self.context - len(ids)} "
                         f"by the {self.context}-token context")
            max_new_tokens = self.context - len(ids)
        stats = self.last_stats = StreamStats(prompt_tokens=len(ids), notes=notes)

        def new_ids() -> Iterator[int]:
            t0 = time.perf_counter()
            for tid, _ in self.steps(ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                     seed=seed, use_cache=use_cache, stop_at_eos=stop_at_eos, mode=mode):
                stats.new_tokens += 1
                stats.seconds = time.perf_counter() - t0
                if stats.new_tokens == 1:
                    stats.first_token_s = stats.seconds
                yield tid

        yield from text_pieces(self.tokenizer.decode, new_ids(), context=ids)

    def steps(self, ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
              top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
              use_cache: bool = True, stop_at_eos: bool = True, mode: DecodeMode | str = DecodeMode.AUTO,
              return_weights: bool = False) -> Iterator[tuple[int, list[Tensor] | None]]:
        """The decoding loop under :meth:`stream` and the server's token-by-token attention:
        each new id after ``ids`` and, with ``return_weights``, the attention row of the position
        that chose it, one (1, H, S) tensor per layer. Stops at the model's stop ids
        (``stop_at_eos``); goes past the context by keeping its newest half
        (:func:`qkv.generation.generate`). Which decoder runs is ``last_stats.decision``."""
        x = torch.tensor([list(ids)], device=self.model.tok_emb.weight.device)

        def decided(d: Decision) -> None:
            self.last_stats.decision = d
            warn_once(str(self.run_dir) if self.run_dir is not None else self.name, self.model, d)

        for out in generate_tokens(self.model, x, max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, use_cache=use_cache, generator=make_generator(x.device, seed),
                                   stop_ids=self.stop_ids if stop_at_eos else (), mode=mode,
                                   return_weights=return_weights, on_decision=decided):
            nxt, weights = out if return_weights else (out, None)
            yield int(nxt[0]), weights

    @overload
    def generate(self, prompt: str, max_new_tokens: int = 128, **kwargs: object) -> str: ...

    @overload
    def generate(self, prompt: Sequence[str], max_new_tokens: int = 128, **kwargs: object) -> list[str]: ...

    def generate(self, prompt: str | Sequence[str], max_new_tokens: int = 128,
                 **kwargs: object) -> str | list[str]:
        """The continuation of ``prompt`` as one string (greedy by default); see :meth:`stream`.
        A list of prompts decodes as one running batch (:meth:`generate_many`)."""
        if not isinstance(prompt, str):
            return self.generate_many(prompt, max_new_tokens, **kwargs)  # type: ignore[arg-type]
        return "".join(self.stream(prompt, max_new_tokens, **kwargs))  # type: ignore[arg-type]

    def generate_many(self, prompts: Sequence[str], max_new_tokens: int = 128, *, chat: bool = False,
                      system: str | None = None, temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None, seed: int | Sequence[int | None] | None = None,
                      stop_at_eos: bool = True, rows: int = 8,
                      mode: DecodeMode | str = DecodeMode.AUTO) -> list[str]:
        """Continue every prompt, decoded together: up to ``rows`` at once in one running batch,
        the next prompt joining as soon as one ends (:mod:`qkv.generation.batch`). Each
        continuation is the one :meth:`generate` gives for that prompt alone (the same greedy
        tokens, to float rounding; sampled, the same tokens for the same seed). ``seed``: one for
        every prompt, or one per prompt. Each is bounded by the context as in :meth:`stream`
        (without ``slide``). ``mode``: ``"auto"`` steps through the model's saved steps where
        they were built (a lone row, and the running batch's own step), ``"build"`` builds them
        first (~40 s each on 2 cores, once per model, ``rows`` and machine), ``"eager"``."""
        from qkv.generation.batch import Request, generate_batch

        if isinstance(prompts, str):
            raise ValueError("generate_many takes a list of prompts; use generate for one")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        seeds = list(seed) if isinstance(seed, Sequence) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts; give one seed or one per "
                             "prompt")
        ids = [self.prompt_ids(p, chat=chat, system=system)[0] for p in prompts]
        stops = self.stop_ids if stop_at_eos else ()
        reqs = [Request(i, min(max_new_tokens, self.context - len(i)), temperature, top_k, top_p, s, stops)
                for i, s in zip(ids, seeds, strict=True)]
        new: list[list[int]] = [[] for _ in prompts]
        for i, tok in generate_batch(self.model, reqs, rows, mode=mode):
            new[i].append(tok.id)
        return ["".join(text_pieces(self.tokenizer.decode, n, context=i))
                for n, i in zip(new, ids, strict=True)]
