"""Weight-only quantised linear layers for decoding: 4-bit groups, 8-bit groups and 8-bit rows.

Decoding one token multiplies one activation row by every weight matrix, so its time is the
time to read the weights. Storing them in fewer bits reads fewer bytes; the kernels multiply
straight from the packed form, without widening the matrix first:

- :class:`Int4Linear`: groups of ``group_size`` weights along the input share a scale and a
  zero point, ``w = (q − 8)·scale + zero`` with q ∈ {0..15} (asymmetric, as llama.cpp's Q4_1:
  ``w = d·q + m`` is scale d, zero m + 8d). Two kernels compute ``x Wᵀ`` from the packed
  nibbles. qkv's own (:mod:`qkv.kernels`, built for the CPU on first use; the default where it
  builds): d and m in float16 as a Q4_0/Q4_1 file stores them, each group of 32 activations
  rounded to int8 twice (a code and its residual: to 1/256 of an int8 step, finer than bf16) and
  multiplied by integer dot products, 1.56x PyTorch's kernel on a token's products
  (``benchmarks/int4_kernel.py``). PyTorch's ``torch.ops.aten._weight_int4pack_mm_for_cpu``:
  fast with bf16 activations (scales and zeros then round to bf16: ~3e-3 relative), slow with
  fp32 ones, so activations are cast to bf16 for the product and back.
- :class:`Q8Linear`: groups of 32 with one float16 scale, ``w = d·q`` (GGUF's Q8_0, whose blocks
  it recovers exactly), on qkv's kernel with the same activations.
- :class:`Int8Linear`: symmetric per-output-row int8, ``w = q·scale``,
  ``torch.ops.aten._weight_int8pack_mm`` (where qkv's kernel is not available). It too takes
  bf16 activations: with fp32 ones the kernel is ~17× slower (281 µs vs 16 µs for a 1536×576
  row product, 2 cores).

All keep ``in_features``/``out_features`` like ``nn.Linear`` and have ``dequantize()`` (the
float matrix they stand for), which the tests use as the reference. :class:`Int4SwiGLU` fuses
a SwiGLU's gate and up matrices into one 4-bit product (a decode step is bound by the number
of calls, not by bytes), and :class:`TopKRefinedLinear` keeps a quantised output head's top
logits exact.

Shapes: x (..., K) -> (..., N); W (N, K); G = K / group_size groups per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.kernels import int4_op as _qkv_int4_op
from qkv.kernels import int4_status, pack_int4, pack_q8
from qkv.kernels import q8_op as _qkv_q8_op
from qkv.layers.mlp import SwiGLU
from qkv.nn.top import top_indices

INT4_INNER_K_TILES = 2  # the packing PyTorch's CPU kernel reads fastest for K a multiple of 64


def int4_kernels_available() -> bool:
    """PyTorch has the CPU int4 weight-only kernels (2.5+)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def _float_bias(bias: Tensor | None, n: int) -> Tensor | None:
    """A linear layer's bias as a float32 buffer (None stays None); ValueError unless (n,)."""
    if bias is None:
        return None
    if bias.shape != (n,):
        raise ValueError(f"bias of shape {tuple(bias.shape)} for {n} outputs")
    return bias.detach().float().clone()


# Where a Q4_0 group's largest |w| may sit, as q − 8: llama.cpp's reference quantiser puts it at
# code 0 (−8); with an importance matrix its scale search may leave it at code 15 (+7), 1 (−7), ...
_Q4_0_STEPS = (-8, 7, -7, 6, -6, 5, -5, 4, -4, 3, -3, 2, -2, 1, -1)


def _q4_0_scales(w: Tensor) -> Tensor:
    """The scale d of each Q4_0 group of dequantised weights ``w`` (..., group): the d, among
    those that put the group's largest |w| on a code, that puts every weight on a whole code in
    0..15 (w = d·(q − 8) exactly); a group no d fits keeps the reference quantiser's."""
    extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))[..., 0]  # signed
    nonzero = extreme != 0
    scale = torch.where(nonzero, extreme / -8, torch.full_like(extreme, 1e-10))
    todo = nonzero.clone()
    for step in _Q4_0_STEPS:
        if not bool(todo.any()):
            break
        d = extreme[todo] / step
        codes = w[todo] / d[:, None] + 8
        fits = ((codes - codes.round()).abs() <= 1e-3).all(-1) & (codes.round() >= 0).all(-1) \
            & (codes.round() <= 15).all(-1)
        index = todo.nonzero(as_tuple=True)
        scale[tuple(i[fits] for i in index)] = d[fits]
        todo[tuple(i[fits] for i in index)] = False
    return scale


def _fits_float16(t: Tensor) -> bool:
    """Every value of ``t`` kept in float16 to 1e-3 relative, or within float16's smallest step
    (2^-24) of it (no overflow; only values too small to matter flush to zero): what qkv's kernels
    store scales in (a GGUF's are float16 already)."""
    h = t.half().float()
    return bool(torch.isfinite(h).all() and ((h - t).abs() <= 1e-3 * t.abs() + 2.0**-24).all())


def _plus_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    return y if bias is None else y + bias.to(y.dtype)


class Int4Linear(nn.Module):
    """``x Wᵀ`` with W in 4-bit groups: ``w = (q − 8)·scale + zero`` per group (see module doc)."""

    def __init__(self, q: Tensor, scale: Tensor, zero: Tensor, group_size: int,
                 act_dtype: torch.dtype = torch.bfloat16, bias: Tensor | None = None,
                 kernel: str | None = None) -> None:
        """q (N, K) integers in 0..15; scale, zero (N, G) floats; K divisible by group_size;
        ``bias`` (N,), kept in float32 and added after the product (Qwen2's q/k/v).
        ``kernel``: "qkv" (qkv's, int8 activations; where it builds, groups of 32), "aten"
        (PyTorch's, bf16 activations) or None, qkv's where it can be used."""
        super().__init__()
        N, K = q.shape
        if K % 2 or K % group_size or scale.shape != (N, K // group_size) or zero.shape != scale.shape:
            raise ValueError(f"4-bit weight of shape {tuple(q.shape)} needs scale/zero of shape "
                             f"({N}, {K // group_size}) and K divisible by {group_size}")
        if N % 16:
            raise ValueError(f"PyTorch's 4-bit kernel needs an output width divisible by 16, got {N}")
        if int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError("4-bit codes must lie in 0..15")
        self.in_features, self.out_features, self.group_size = K, N, group_size
        self.act_dtype = act_dtype
        d, m = scale.float(), (zero - 8 * scale).float()  # w = d·q + m, GGUF's Q4_1 form
        if kernel not in (None, "qkv", "aten"):
            raise ValueError(f"kernel must be 'qkv', 'aten' or None, got {kernel!r}")
        op = _qkv_int4_op() if group_size == 32 and kernel != "aten" else None
        if kernel == "qkv" and op is None:
            raise ValueError(f"qkv's 4-bit kernel is not available here: {int4_status()}")
        if op is not None and _fits_float16(d) and _fits_float16(m):
            # qkv's kernel (qkv/kernels/qmatmul.cpp): int8 activations, integer dot products;
            # d and m in float16, as a Q4_0/Q4_1 file stores them.
            self.kernel = "qkv"
            w4, dm = pack_int4(q, d, m)
            self.register_buffer("w4", w4)
            self.register_buffer("dm", dm)
        else:
            self.kernel = "aten"
            inner = INT4_INNER_K_TILES if K % (16 * INT4_INNER_K_TILES) == 0 else 1
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), inner)
            self.register_buffer("packed", packed)
            # The kernel's layout: (G, N, 2) holding [scale, zero], in the activation dtype.
            sz = torch.stack([scale.t(), zero.t()], dim=-1).to(act_dtype).contiguous()
            self.register_buffer("scales_zeros", sz)
        # Our own copy of the codes, two per byte, for dequantize() (the packed layouts above
        # are the kernels' own business).
        q8 = q.to(torch.uint8)
        self.register_buffer("codes", q8[:, 0::2] | (q8[:, 1::2] << 4), persistent=False)
        self.register_buffer("bias", _float_bias(bias, N))

    @classmethod
    def from_float(cls, weight: Tensor, group_size: int = 32, act_dtype: torch.dtype = torch.bfloat16,
                   bias: Tensor | None = None, symmetric: bool = False,
                   kernel: str | None = None) -> Int4Linear:
        """Quantise a float (N, K) matrix: each group's [min, max] spread over 16 levels (the
        grid of GGUF's Q4_1, whose codes this recovers from its dequantised weights); with
        ``symmetric``, llama.cpp's Q4_0 grid instead: w = d·(q − 8), no offset, d the scale
        that puts every weight of the group on a whole code (:func:`_q4_0_scales`), so a Q4_0
        file's codes are recovered too."""
        N, K = weight.shape
        w = weight.detach().float().view(N, K // group_size, group_size)
        if symmetric:
            scale = _q4_0_scales(w)
            q = (w / scale[..., None] + 8).round().clamp(0, 15).view(N, K)
            return cls(q, scale, torch.zeros_like(scale), group_size, act_dtype, bias, kernel)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp(min=1e-10)
        q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).view(N, K)
        return cls(q, scale, lo + 8 * scale, group_size, act_dtype, bias, kernel)

    def dequantize(self) -> Tensor:
        """The (N, K) float32 matrix this layer multiplies by, with the scales and zeros as
        the kernel reads them (qkv's: d and m in float16; PyTorch's: rounded to the activation
        dtype)."""
        N, K, g = self.out_features, self.in_features, self.group_size
        q = torch.stack([self.codes & 0xF, self.codes >> 4], dim=-1).view(N, K).float().view(N, K // g, g)
        if self.kernel == "qkv":
            dm = self.dm.float()  # (N/16, G, 2, 16)
            d, m = (dm[:, :, i].permute(0, 2, 1).reshape(N, K // g) for i in (0, 1))
            return (q * d[..., None] + m[..., None]).view(N, K)
        sz = self.scales_zeros.float()  # (G, N, 2)
        scale, zero = sz[..., 0].t(), sz[..., 1].t()  # (N, G)
        return ((q - 8) * scale[..., None] + zero[..., None]).view(N, K)

    def matmul(self, x2: Tensor) -> Tensor:
        """x2 (M, K) -> (M, N): the kernel alone. qkv's takes float32 or bf16 and returns
        float32; PyTorch's takes and returns the activation dtype."""
        if self.kernel == "qkv":
            return torch.ops.qkv.int4_mm(x2.contiguous(), self.w4, self.dm)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_zeros)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        x2 = x2.to(torch.float32 if x.dtype not in (torch.float32, torch.bfloat16) else x.dtype) \
            if self.kernel == "qkv" else x2.to(self.act_dtype)
        y = self.matmul(x2)  # (M, N)
        return _plus_bias(y.view(*shape[:-1], self.out_features).to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, kernel={self.kernel}, act_dtype={self.act_dtype}")


class Int8Linear(nn.Module):
    """``x Wᵀ`` with W as int8 rows: ``w = q·scale``, one scale per output row."""

    def __init__(self, q: Tensor, scale: Tensor, act_dtype: torch.dtype = torch.bfloat16,
                 bias: Tensor | None = None) -> None:
        """q (N, K) int8; scale (N,) float; ``bias`` (N,), kept in float32."""
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError("Int8Linear takes int8 codes (N, K) and one scale per row (N,)")
        self.act_dtype = act_dtype
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_int8", q.contiguous())
        self.register_buffer("scale", scale.to(act_dtype).contiguous())  # as the kernel reads it
        self.register_buffer("bias", _float_bias(bias, q.shape[0]))

    @classmethod
    def from_float(cls, weight: Tensor, act_dtype: torch.dtype = torch.bfloat16,
                   bias: Tensor | None = None) -> Int8Linear:
        """Symmetric per-row quantisation: scale = max|w| / 127."""
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-10).to(act_dtype).float()
        return cls((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale, act_dtype, bias)

    def dequantize(self) -> Tensor:
        """The (N, K) float32 matrix this layer multiplies by (scales as the kernel reads them)."""
        return self.weight_int8.float() * self.scale.float()[:, None]

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.act_dtype)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scale)
        return _plus_bias(y.view(*shape[:-1], self.out_features).to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, act_dtype={self.act_dtype}"


class Q8Linear(nn.Module):
    """``x Wᵀ`` with W in 8-bit groups of 32 inputs, ``w = d·q`` (GGUF's Q8_0: q in -127..127,
    d in float16), on qkv's kernel (:mod:`qkv.kernels`: activations rounded to int8 twice per
    group, integer dot products). A Q8_0 file's codes and scales are recovered exactly from its
    dequantised weights (:meth:`from_float`), so the product is the file's matrix."""

    def __init__(self, q: Tensor, d: Tensor, bias: Tensor | None = None) -> None:
        """q (N, K) integers in -127..127; d (N, K/32) floats; ``bias`` (N,), kept in float32.
        ValueError where qkv's kernel is not available (:func:`qkv.kernels.int4_status`)."""
        super().__init__()
        N, K = q.shape
        if _qkv_q8_op() is None:
            raise ValueError(f"qkv's 8-bit kernel is not available here: {int4_status()}")
        if int(q.min()) < -127 or int(q.max()) > 127:
            raise ValueError("8-bit codes must lie in -127..127")
        self.in_features, self.out_features = K, N
        w8, ds = pack_q8(q, d)
        self.register_buffer("w8", w8)
        self.register_buffer("ds", ds)
        self.register_buffer("bias", _float_bias(bias, N))

    @staticmethod
    def fits(weight: Tensor) -> bool:
        """Whether every group's scale max|w| / 127 keeps in float16 (a Q8_0 file's do; a matrix
        of tiny or huge weights, e.g. a qkv run's, may not: then int8 rows instead)."""
        N, K = weight.shape
        return _fits_float16(weight.detach().float().view(N, K // 32, 32).abs().amax(-1) / 127)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None) -> Q8Linear:
        """llama.cpp's Q8_0 quantiser: per group of 32, d = max|w| / 127 (rounded to float16),
        q = round(w / d)."""
        N, K = weight.shape
        w = weight.detach().float().view(N, K // 32, 32)
        d = (w.abs().amax(-1) / 127).half().float()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (w * inv[..., None]).round().clamp(-127, 127).view(N, K)
        return cls(q, d, bias)

    def dequantize(self) -> Tensor:
        """The (N, K) float32 matrix this layer multiplies by."""
        N, K = self.out_features, self.in_features
        q = (self.w8.to(torch.int16) - 128).view(N // 16, K // 32, 8, 16, 4).permute(0, 3, 1, 2, 4)
        d = self.ds.float().permute(0, 2, 1)  # (N/16, 16, G)
        return (q.reshape(N // 16, 16, K // 32, 32).float() * d[..., None]).reshape(N, K)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        x2 = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()
        y = torch.ops.qkv.q8_mm(x2.contiguous(), self.w8, self.ds)  # (M, N) float32
        return _plus_bias(y.view(*shape[:-1], self.out_features).to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4SwiGLU(nn.Module):
    """SwiGLU (``w_down(silu(w_gate x) ⊙ w_up x)``, Shazeer 2020) with 4-bit weights, fused
    for decoding: the gate and up matrices are one 4-bit matrix (one kernel call), and the
    hidden activation stays in bf16 between the products (the down product reads bf16 input
    anyway), so a layer's MLP costs 2 kernel calls and 2 casts instead of 3 and 6."""

    def __init__(self, gate_up: Int4Linear, down: Int4Linear) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.hidden = gate_up.out_features // 2

    @classmethod
    def from_swiglu(cls, mlp: SwiGLU, group_size: int = 32, symmetric: bool = False,
                    kernel: str | None = None) -> Int4SwiGLU:
        """From a float :class:`~qkv.layers.mlp.SwiGLU` without biases (``symmetric``,
        ``kernel``: see :class:`Int4Linear`)."""
        w = torch.cat([mlp.w_gate.weight, mlp.w_up.weight], dim=0)  # (2F, dim): [gate | up]
        return cls(Int4Linear.from_float(w, group_size, symmetric=symmetric, kernel=kernel),
                   Int4Linear.from_float(mlp.w_down.weight, group_size, symmetric=symmetric, kernel=kernel))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.gate_up.kernel == "aten":
            x2 = x2.to(self.gate_up.act_dtype)
        elif x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        gu = self.gate_up.matmul(x2)  # (M, 2F): float32 from qkv's kernel, bf16 from PyTorch's
        g, u = gu.split(self.hidden, dim=-1)
        h = F.silu(g) * u  # (M, F)
        y = self.down.matmul(h if self.down.kernel == "qkv" else h.to(self.down.act_dtype))
        return y.view(*shape[:-1], -1).to(x.dtype)


class TopKRefinedLinear(nn.Module):
    """An output head that reads few bytes and still ranks the likely tokens exactly.

    The int8 kernel returns bf16 outputs: logits of size ~25 come back rounded to steps of
    0.125, coarser than the gap between the two best tokens at a few per cent of positions, so
    the greedy token changes there. This head takes the fast approximate logits for every
    token, then recomputes the ``k`` largest in fp32 from the float matrix (``k`` rows read,
    not all of them) and writes them back: the top of the distribution is exact, the tail
    (where sampling rarely looks) is within bf16 rounding.

    Args:
        approx: the quantised head (e.g. :class:`Int8Linear`), (..., K) -> (..., N).
        weight: (N, K) float32 matrix it approximates (a tied embedding is shared, not copied).
        k: how many of the largest logits are recomputed exactly.
    """

    def __init__(self, approx: nn.Module, weight: Tensor, k: int = 64, owned: bool = False) -> None:
        """``owned``: the matrix is this head's alone (an untied output layer), kept as a buffer
        (not saved in checkpoints) so that an exported step finds it by name; a tied embedding
        (the default) is the embedding's, shared, not a buffer here."""
        super().__init__()
        self.approx, self.k = approx, k
        if owned:
            self.register_buffer("weight", weight, persistent=False)
        else:
            self.weight = weight  # shared with the embedding, not saved twice
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        y = self.approx(x).float()  # (..., N)
        shape = y.shape
        y2, x2 = y.reshape(-1, self.out_features), x.reshape(-1, self.in_features).float()  # (M, N), (M, K)
        idx = top_indices(y2, min(self.k, self.out_features))  # (M, k), torch.topk's, faster on a long row
        rows = self.weight.float()[idx]  # (M, k, K): the only float rows read
        exact = torch.bmm(rows, x2.unsqueeze(-1)).squeeze(-1)  # (M, k) fp32 logits
        bias = getattr(self.approx, "bias", None)
        if bias is not None:
            exact = exact + bias.float()[idx]
        y2.scatter_(1, idx, exact)
        return y2.view(shape).to(x.dtype)

    def dequantize(self) -> Tensor:
        return self.weight.float()

    def extra_repr(self) -> str:
        return f"k={self.k}"


def quantize_linears(model: nn.Module, weights: str, skip: tuple[str, ...] = (),
                     group_size: int = 32, symmetric: bool = False, kernel: str | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (but those whose name ends in ``skip``) by its
    int8 (``weights="int8"``) or 4-bit (``"q4"``) form, in place (4-bit: each bias-free
    SwiGLU as one :class:`Int4SwiGLU`); returns the model.

    int8 is :class:`Q8Linear` (groups of 32, GGUF's Q8_0) on qkv's kernel where it is available
    and the shape fits (outputs a multiple of 16, inputs of 32), else :class:`Int8Linear` (rows,
    PyTorch's kernel). ``kernel="aten"`` takes PyTorch's kernels for both formats. A layer's
    bias stays float32 and is added after the quantised product. ``symmetric``: the 4-bit
    groups on Q4_0's grid rather than Q4_1's (:meth:`Int4Linear.from_float`).
    """
    if weights not in ("int8", "q4"):
        raise ValueError(f"weights must be int8 or q4 here, got {weights!r}")
    if weights == "q4":  # SwiGLU MLPs first: one fused 4-bit gate|up product each
        for name, module in list(model.named_modules()):
            if (isinstance(module, SwiGLU) and not name.endswith(skip)
                    and all(m.bias is None for m in (module.w_gate, module.w_up, module.w_down))):
                set_submodule(model, name, Int4SwiGLU.from_swiglu(module, group_size, symmetric, kernel))
    q8 = weights == "int8" and kernel != "aten" and _qkv_q8_op() is not None
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name.endswith(skip):
            continue
        w, b = module.weight, module.bias
        if weights == "q4":
            q: nn.Module = Int4Linear.from_float(w, group_size, bias=b, symmetric=symmetric, kernel=kernel)
        elif q8 and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0 and Q8Linear.fits(w):
            q = Q8Linear.from_float(w, bias=b)
        else:
            q = Int8Linear.from_float(w, bias=b)
        set_submodule(model, name, q)
    return model


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
