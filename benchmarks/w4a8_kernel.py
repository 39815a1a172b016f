"""A measurement, not a feature: what int8 activations x 4-bit weights with integer dot products
(AVX-512 VNNI, llama.cpp's own trick) could buy qkv's q4 decoding over PyTorch's int4 kernel.

qkv's q4 products call ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (bf16 activations, the
4-bit codes unpacked and multiplied in floating point). Here a small C++ kernel, compiled for
this CPU with ``torch.utils.cpp_extension`` into a temporary folder, does what llama.cpp's
Q4_1 x Q8_1 dot does: the activation row is quantised to int8 per group of 32 (scale d_x and
d_x·Σq_x kept), and each output is Σ_g d_w·d_x·(q_w·q_x) + m_w·d_x·Σq_x, the integer dot
q_w·q_x done 64 pairs at a time by ``vpdpbusd`` (u8 codes x s8 activations). Codes are stored
so that one 64-byte load holds 128 values of a row (byte j = v[j] | v[j + 64] << 4; a tail of 64
values as byte j = v[j] | v[j + 32] << 4), scales and minimums as fp16 per group (Q4_1's bytes).

Measured, batch 1 (one token), on the products of one SmolLM2-135M token (30 layers: q/k/v
576->960, o 576->576, gate+up 576->3072, down 1536->576; each layer's weights distinct, so the
weights stream from memory as in decoding, not from a warm cache): microseconds per token for
PyTorch's kernel and for this one, alternated over ``--rounds`` rounds, 2 threads; and the error
of each against float64 products of the same dequantised weights (this kernel also rounds the
activations to int8, as llama.cpp does).

    python benchmarks/w4a8_kernel.py            # ~1 minute (the kernel compiles in ~20 s)

Needs an x86 CPU with AVX-512 VNNI (Zen 4/5, Sapphire Rapids), a C++ compiler and ninja
(``pip install ninja``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402

NAME = "w4a8_kernel"

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

// x (K,) fp32 -> q (K,) int8, d (G,), s (G,) = d * sum(q): per group of 32 (llama.cpp's Q8_1)
static void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const float* xg = x + g * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float dd = amax / 127.f, id = dd > 0.f ? 1.f / dd : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = (int)std::nearbyint(xg[i] * id);
      q[g * 32 + i] = (int8_t)v;
      sum += v;
    }
    d[g] = dd;
    s[g] = dd * (float)sum;
  }
}

// x (K,) fp32; codes (N, K/2) uint8; scale, minimum (N, K/32) fp16 -> (N,) fp32
torch::Tensor w4a8_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, torch::Tensor minimum) {
  const int64_t K = x.size(-1), N = codes.size(0), G = K / 32, full = K / 128;
  auto xf = x.contiguous().to(torch::kFloat);
  std::vector<int8_t> q(K + 64);
  std::vector<float> d(G), s(G);
  quantize_row(xf.data_ptr<float>(), K, q.data(), d.data(), s.data());
  auto y = torch::empty({N}, torch::kFloat);
  const uint8_t* W = codes.data_ptr<uint8_t>();
  const uint16_t* SC = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* MN = reinterpret_cast<const uint16_t*>(minimum.data_ptr<at::Half>());
  float* Y = y.data_ptr<float>();
  const int8_t* Q = q.data();
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m256i m4y = _mm256_set1_epi8(0x0F);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = W + n * (K / 2);
      const uint16_t* sc = SC + n * G;
      const uint16_t* mn = MN + n * G;
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      float rest = 0.f;
      for (int64_t b = 0; b < full; ++b) {  // 128 values: 4 groups, one 64-byte load
        const int64_t g = 4 * b;
        const __m512i p = _mm512_loadu_si512((const void*)(w + b * 64));
        const __m512i lo = _mm512_and_si512(p, m4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
        const __m512i x0 = _mm512_loadu_si512((const void*)(Q + g * 32));
        const __m512i x1 = _mm512_loadu_si512((const void*)(Q + g * 32 + 64));
        const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x0);
        const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, x1);
        const __m256 a0 = _mm256_set1_ps(_cvtsh_ss(sc[g]) * d[g]);
        const __m256 a1 = _mm256_set1_ps(_cvtsh_ss(sc[g + 1]) * d[g + 1]);
        const __m256 a2 = _mm256_set1_ps(_cvtsh_ss(sc[g + 2]) * d[g + 2]);
        const __m256 a3 = _mm256_set1_ps(_cvtsh_ss(sc[g + 3]) * d[g + 3]);
        const __m512 s0 = _mm512_insertf32x8(_mm512_castps256_ps512(a0), a1, 1);
        const __m512 s1 = _mm512_insertf32x8(_mm512_castps256_ps512(a2), a3, 1);
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), s0, acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), s1, acc1);
      }
      if (K % 128) {  // a tail of 64 values: 2 groups, one 32-byte load
        const int64_t g = 4 * full;
        const __m256i p = _mm256_loadu_si256((const __m256i*)(w + full * 64));
        const __m256i lo = _mm256_and_si256(p, m4y);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4y);
        const __m256i x0 = _mm256_loadu_si256((const __m256i*)(Q + g * 32));
        const __m256i x1 = _mm256_loadu_si256((const __m256i*)(Q + g * 32 + 32));
        const __m256i d0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x0);
        const __m256i d1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi, x1);
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(_cvtsh_ss(sc[g]) * d[g]));
        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(_cvtsh_ss(sc[g + 1]) * d[g + 1]), t);
        acc0 = _mm512_add_ps(acc0, _mm512_zextps256_ps512(t));  // the upper 8 lanes: zero
      }
      for (int64_t g = 0; g < G; ++g) rest += _cvtsh_ss(mn[g]) * s[g];
      Y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + rest;
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("w4a8_gemv", &w4a8_gemv); }
"""

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # one SmolLM2 layer's products (N, K)
LAYERS = 30


def pack_w4a8(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K/2) bytes: per 128 values byte j = v[j] | v[j+64] << 4; a
    64-value tail byte j = v[j] | v[j+32] << 4."""
    N, K = codes.shape
    full = K // 128 * 128
    body = codes[:, :full].reshape(N, -1, 2, 64)
    parts = [(body[:, :, 0] | (body[:, :, 1] << 4)).reshape(N, -1)]
    if K > full:
        tail = codes[:, full:].reshape(N, 2, 32)
        parts.append(tail[:, 0] | (tail[:, 1] << 4))
    return torch.cat(parts, 1).contiguous()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine))
    from torch.utils.cpp_extension import is_ninja_available, load_inline

    if not is_ninja_available():
        print("needs ninja to compile the kernel: pip install ninja")
        return 1
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        print("this PyTorch has no CPU int4 kernel to compare with")
        return 1
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qkv-w4a8-") as build:
        try:
            ext = load_inline("qkv_w4a8_bench", cpp_sources=[SOURCE], extra_cflags=["-O3", "-march=native"],
                              build_directory=build, verbose=False)
        except Exception as e:  # no VNNI, no compiler: say so in one line
            print(f"the kernel did not build here ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            return 1
        compile_s = time.perf_counter() - t0
        print(f"kernel compiled in {compile_s:.0f} s")
        g = torch.Generator().manual_seed(0)
        layers = []
        errors: dict[str, list[float]] = {"torch_int4": [], "w4a8": []}
        for _ in range(LAYERS):
            for N, K in SHAPES:
                G = K // 32
                codes = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)
                scale = (torch.rand(N, G, generator=g) * 0.02 + 0.002).half()
                minimum = (-8 * scale.float() + torch.randn(N, G, generator=g) * 0.002).half()
                x = torch.randn(K, generator=g)
                packed_t = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
                # torch's zero is the value at code 8: minimum + 8·scale
                sz = torch.stack([scale.float().t(), (minimum.float() + 8 * scale.float()).t()], -1)
                sz = sz.contiguous().to(torch.bfloat16)
                layers.append((x, packed_t, sz, pack_w4a8(codes), scale, minimum))
                if len(layers) <= len(SHAPES):  # the error, on the first layer's products
                    w = (codes.view(N, G, 32).double() * scale.double()[..., None]
                         + minimum.double()[..., None]).view(N, K)
                    ref = w @ x.double()
                    yt = torch.ops.aten._weight_int4pack_mm_for_cpu(x.view(1, K).bfloat16(), packed_t, 32,
                                                                     layers[-1][2])[0].double()
                    yw = ext.w4a8_gemv(x, layers[-1][3], scale, minimum).double()
                    errors["torch_int4"].append(float((yt - ref).norm() / ref.norm()))
                    errors["w4a8"].append(float((yw - ref).norm() / ref.norm()))

        hot = layers[: len(SHAPES)] * LAYERS  # one layer's weights 30 times: they stay in cache

        def run_torch(which: list) -> None:
            for x, pt, sz, *_ in which:
                torch.ops.aten._weight_int4pack_mm_for_cpu(x.view(1, -1).bfloat16(), pt, 32, sz)

        def run_w4a8(which: list) -> None:
            for x, _, _, pw, sc, mn in which:
                ext.w4a8_gemv(x, pw, sc, mn)

        times: dict[str, list[float]] = {"torch_int4": [], "w4a8": [], "torch_int4_hot": [], "w4a8_hot": []}
        with torch.inference_mode():
            for fn in (run_torch, run_w4a8):  # warm up
                fn(layers)
            for r in range(args.rounds):
                order = [("torch_int4", run_torch), ("w4a8", run_w4a8)]
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    for suffix, which in (("", layers), ("_hot", hot)):
                        n = 20
                        t = time.perf_counter()
                        for _ in range(n):
                            fn(which)
                        times[name + suffix].append((time.perf_counter() - t) / n * 1e6)
                last = {k: round(v[-1]) for k, v in times.items()}
                print(f"round {r + 1}: us per token's products {last}", flush=True)
    ratios = [a / b for a, b in zip(times["torch_int4"], times["w4a8"], strict=True)]
    hot_ratios = [a / b for a, b in zip(times["torch_int4_hot"], times["w4a8_hot"], strict=True)]
    errors["torch_int4_hot"], errors["w4a8_hot"] = errors["torch_int4"], errors["w4a8"]
    weight_bytes = sum(N * K // 2 + 2 * 2 * N * K // 32 for N, K in SHAPES) * LAYERS
    med = {k: C.median(v) for k, v in times.items()}
    C.print_table(f"the products of one SmolLM2 token ({LAYERS} layers, {weight_bytes / 1e6:.1f} MB of codes "
                  "and fp16 scales), batch 1", ["kernel", "us per token (median)", "GB/s of weights",
                                                "rel. error vs float64 (first layer, max)"],
                  [[k, f"{med[k]:.0f}", f"{weight_bytes / med[k] / 1e3:.1f}", f"{max(errors[k]):.4f}"]
                   for k in times])
    for label, rs in (("weights from memory", ratios), ("one layer, cache-hot", hot_ratios)):
        print(f"w4a8 / torch int4 speed, {label}: median {C.median(rs):.2f}x "
              f"(rounds {min(rs):.2f}-{max(rs):.2f})")
    out = C.write_json(NAME, {"machine": machine, "compile_s": compile_s, "times_us": times,
                              "ratios": ratios, "hot_ratios": hot_ratios, "errors": errors,
                              "weight_bytes": weight_bytes}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
