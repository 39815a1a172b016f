"""Pretrained models ready to use: text in, embeddings or text out.

    enc = qkv.load("minilm");  enc.embed(["a sentence", ...])  -> (N, 384), unit length
                               enc.rank("query", documents)     -> [(index, cosine), ...]
    lm = qkv.load("smollm2");  lm.generate("Once upon a time", max_new_tokens=64)
                               lm.generate("What is the capital of France?", chat=True)

Each object holds a qkv model (built from ``qkv.layers``), its tokenizer and the settings
read from the checkpoint; nothing here knows a foreign file format.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from qkv.generation import generate as generate_tokens
from qkv.generation.decode import text_pieces
from qkv.generation.sampling import make_generator
from qkv.models.encoder import Encoder
from qkv.models.gpt import GPT
from qkv.tokenizers.hf import HFTokenizer

DTypeName = Literal["float32", "bfloat16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WeightsName = Literal["auto", "fp32", "bf16", "int8", "q4"]
WEIGHTS = ("auto", "fp32", "bf16", "int8", "q4")
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


@dataclass
class SentenceEncoder:
    """A sentence-embedding model: mean-pooled, L2-normalised encoder states (Sentence-BERT)."""

    name: str
    model: Encoder
    tokenizer: HFTokenizer
    max_tokens: int  # longer sentences are truncated (sentence-transformers does the same)

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
        dim = self.model.cfg.dim
        out = torch.empty(len(texts), dim)
        all_ids = self.tokenizer.encode_many(texts, self.max_tokens)
        order = sorted(range(len(texts)), key=lambda i: len(all_ids[i]))
        for start in range(0, len(texts), batch_size):
            idx = order[start : start + batch_size]
            lengths = [len(all_ids[i]) for i in idx]
            width = max(lengths)
            x = torch.tensor([all_ids[i] + [0] * (width - len(all_ids[i])) for i in idx],
                             device=device)
            mask = torch.arange(x.shape[1], device=device) < torch.tensor(lengths, device=device)[:, None]
            hidden = self.model(x, mask).hidden
            pooled = self.model.pool(hidden, mask).float()
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
class CausalLM:
    """A pretrained decoder (qkv's GPT) with its tokenizer, chat template and stop tokens."""

    name: str
    model: GPT
    tokenizer: HFTokenizer
    chat_template: str | None = None
    stop_ids: tuple[int, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)
    last_stats: dict[str, float] = field(default_factory=dict)  # of the last stream()

    def to(self, dtype: str | torch.dtype) -> CausalLM:
        """Cast the weights to float32 (exact to the reference) or bfloat16 (half the memory
        traffic per token)."""
        self._check_not_quantized(f"cast to {dtype}")
        self.model.to(weights_dtype(dtype))
        return self

    def _check_not_quantized(self, what: str) -> None:
        if self.info.get("weights") in ("int8", "q4"):
            raise ValueError(f"{self.name} is stored as {self.info['weights']}, which cannot be {what}; "
                             f"load it again: qkv.load({self.name!r}, weights=...)")

    def quantize(self, weights: WeightsName) -> CausalLM:
        """Store the weights as ``weights``, in place, for faster decoding:

        - "fp32": as converted (exact to the reference implementation); "bf16": cast.
        - "int8": every projection as int8 rows (PyTorch's int8 kernel).
        - "q4": the decoder blocks' projections in 4-bit groups of 32 (PyTorch's int4 kernel,
          bf16 activations; each SwiGLU's gate and up matrices as one, its hidden in bf16).
          Only for files stored in 4 bits (Q4_0/Q4_1), whose own codes it keeps.
        - "auto": q4 where the file is stored in 4 bits and PyTorch has the kernels, else fp32.

        int8 and q4 give the output head int8 rows whose 64 largest logits are recomputed in
        fp32 (:class:`~qkv.layers.quant.TopKRefinedLinear`). The embedding table, norms and the
        attention arithmetic stay float32.
        """
        from qkv.layers.quant import TopKRefinedLinear, int4_kernels_available, quantize_linears

        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
        self._check_not_quantized(f"re-stored as {weights}")
        types = self.info.get("weight_types") or []
        in_4_bits = len(types) == 1 and types[0] in Q4_SOURCES  # one 4-bit grid: its codes kept
        if weights == "auto":
            weights = "q4" if in_4_bits and int4_kernels_available() else "fp32"
        if weights == "q4" and not in_4_bits:
            raise ValueError(
                f"weights='q4' decodes from a file's own 4-bit groups (all {' or all '.join(Q4_SOURCES)}); "
                f"{self.name}'s blocks are stored as {', '.join(types) or 'floats (not a GGUF)'}: use "
                "weights='int8', 'bf16' or 'fp32'")
        if weights == "q4" and not int4_kernels_available():
            raise ValueError(f"weights='q4' needs PyTorch's CPU int4 kernels (torch >= 2.5; this is "
                             f"{torch.__version__}); use weights='int8'")
        self.info["weights"] = weights
        if weights in ("fp32", "bf16"):
            return self.to("float32" if weights == "fp32" else "bfloat16")
        self.model.to(torch.float32)
        if weights == "q4":
            quantize_linears(self.model, "q4", skip=("lm_head",), symmetric=types == ["Q4_0"])
        head = self.model.lm_head.weight.detach()  # (V, dim) float32, the tied embedding
        quantize_linears(self.model, "int8")
        # bf16 logits from the int8 kernel would round near-ties: recompute the top 64 in fp32.
        self.model.lm_head = TopKRefinedLinear(self.model.lm_head, head)
        return self

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
        compile: bool = False,
    ) -> Iterator[str]:
        """Yield the continuation of ``prompt`` piece by piece (whole characters only).

        ``chat=True`` wraps the prompt in the chat template. ``max_new_tokens`` is bounded by
        the context: at most ``max_seq_len - len(prompt)`` tokens are generated.
        ``compile=True`` decodes through the model's compiled step
        (:mod:`qkv.generation.compiled`): compiled on the first call of the process (tens of
        seconds), faster per token on every later one.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        text = self.format_chat(prompt, system) if chat else prompt
        ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError("the prompt is empty; give some text to continue")
        W = self.model.cfg.max_seq_len
        if len(ids) >= W:
            raise ValueError(f"the prompt has {len(ids)} tokens; {self.name} reads at most "
                             f"{W - 1} plus one new token: shorten it")
        x = torch.tensor([ids], device=self.model.tok_emb.weight.device)
        max_new_tokens = min(max_new_tokens, W - len(ids))
        gen = make_generator(x.device, seed)
        stats = self.last_stats = {"prompt_tokens": len(ids), "new_tokens": 0, "seconds": 0.0}

        def new_ids() -> Iterator[int]:
            t0 = time.perf_counter()
            for t in generate_tokens(self.model, x, max_new_tokens, temperature=temperature,
                                     top_k=top_k, top_p=top_p, use_cache=use_cache, generator=gen,
                                     stop_ids=self.stop_ids if stop_at_eos else (), compile=compile):
                tid = int(t[0])
                stats.update(new_tokens=stats["new_tokens"] + 1, seconds=time.perf_counter() - t0)
                yield tid

        yield from text_pieces(self.tokenizer.decode, new_ids(), context=ids)

    def generate(self, prompt: str, max_new_tokens: int = 128, **kwargs: Any) -> str:
        """The continuation of ``prompt`` as one string (greedy by default); see :meth:`stream`."""
        return "".join(self.stream(prompt, max_new_tokens, **kwargs))
