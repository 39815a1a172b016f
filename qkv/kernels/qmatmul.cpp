// qkv's quantised matrix products for decoding, y = x Wᵀ, W stored as GGUF stores it:
//
// - int4_mm: groups of 32 weights that share a scale d and an offset m (w = d·q + m, q in 0..15:
//   Q4_1; Q4_0 is m = −8d);
// - q8_mm: groups of 32 with one scale (w = d·q, q in −127..127: Q8_0).
//
// x is rounded on the fly per group of 32 to int8 twice, x ≈ dx·(xq + xr/256) (quantize_rows),
// and multiplied by integer dot products (AVX512-VNNI's vpdpbusd: 64 products an instruction;
// AVX2's vpmaddubsw), then one float multiply-add per group:
//
//   int4: y[n] = Σ_g d[n,g]·dx[g]/256·(256·<q, xq> + <q, xr>)  +  m[n,g]·Σ_i x[g,i]
//
// (the offset term uses the exact float sum of the group's activations). llama.cpp's trick,
// without its coarser activations (one int8 code). Decoding one token reads every weight once:
// PyTorch's own kernels widen each weight to a float first and are bound by that arithmetic,
// not by memory (BENCHMARKS.md). Built by qkv/kernels/__init__.py with -march=native for the
// CPU it runs on, loaded with torch.ops.load_library.
//
// 4-bit packed layout (qkv/kernels/__init__.py: pack_int4), 16 output rows per block:
//   w  uint8   (N/16, K/32, 4, 64): block, group, chunk c of 8 inputs; byte 4j + b holds row j's
//              code for input 8c + b in its low nibble and for input 8c + 4 + b in its high one
//   dm float16 (N/16, K/32, 2, 16): the 16 rows' d, then their m
// (8-bit layout: above block8.) Shapes: x (M, K) float32 or bfloat16 -> y (M, N) float32.
//
// Both ops are one function, qmatmul<Format>: the argument checks, x's quantisation, y and the
// threads over blocks of 16 output rows; a Format (Q4, Q8) gives its layout's sizes and the
// kernel of one block (block4, block8), each compiled for AVX512-VNNI, AVX2 or plain C++.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t ROWS = 16, GROUP = 32;
// From this many rows of x on, the AVX2 path widens each group's weights to int16 once and
// multiplies every row by one 16-bit product per pair of inputs against x's two codes joined,
// 256·xq + xr (one vpmaddwd, where one row alone takes two vpmaddubsw and a vpmaddwd): the same
// integers, so the same floats as a row alone, bit for bit (a running batch decodes each row
// as it would alone), at ~2/3 of the multiplies per row. One row alone keeps the 8-bit products
// (widening the weights would cost it more than it saves).
constexpr int64_t WIDE_FROM = 2;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
constexpr const char* PATH = "avx512-vnni";
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr const char* PATH = "avx2";
#else
constexpr const char* PATH = "scalar";
#endif

// Each row of x (M, K) and each group of 32: x ≈ dx·(xq + xr/256), two int8 codes per value (the
// second the rounding residual of the first, in steps of dx/256), the scale dx = max|x| / 127
// and the float sum. One int8 code alone (llama.cpp's Q8 activations) rounds each value by up
// to dx/2, which on a real model's activations (a few large channels set dx) moves the next-token
// distribution ~20x further from the float model's than bf16 does; with the residual, x is
// carried to dx/512, finer than bf16 (measured in BENCHMARKS.md).
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, int8_t* xr, float* dx, float* sx) {
  const int64_t G = K / GROUP;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const T* p = x + m * K + g * GROUP;
      float v[GROUP];
      float amax = 0.f, s = 0.f;
      for (int i = 0; i < GROUP; ++i) {
        v[i] = static_cast<float>(p[i]);
        amax = std::max(amax, std::fabs(v[i]));
        s += v[i];
      }
      int8_t* q = xq + m * K + g * GROUP;
      int8_t* r = xr + m * K + g * GROUP;
      if (!std::isfinite(s) || !std::isfinite(amax)) {  // a NaN or inf activation: NaN out, as a float product
        std::fill(q, q + GROUP, 0);
        std::fill(r, r + GROUP, 0);
        dx[m * G + g] = std::numeric_limits<float>::quiet_NaN();
        sx[m * G + g] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float d = amax / 127.f, inv = d >= std::numeric_limits<float>::min() ? 1.f / d : 0.f;
      for (int i = 0; i < GROUP; ++i) {
        const float u = std::clamp(v[i] * inv, -127.f, 127.f), c = std::nearbyint(u);
        q[i] = static_cast<int8_t>(c);
        r[i] = static_cast<int8_t>(std::clamp(std::nearbyint((u - c) * 256.f), -127.f, 127.f));
      }
      dx[m * G + g] = d;
      sx[m * G + g] = s;
    }
  }
}

// x quantised once per call and read by every block of output rows: per value its int8 code xq
// and residual xr (M, K); per row and group of 32 (M, K/32) the scale dx, the float sum sx and,
// for a format whose weight codes are stored offset (8-bit: q + 128), the code sums sq = Σxq
// and sr = Σxr (empty otherwise).
struct Activations {
  int64_t M, K, G;
  std::vector<int8_t> xq, xr;
  std::vector<float> dx, sx;
  std::vector<int32_t> sq, sr;
  std::vector<int16_t> x16;  // 256·xq + xr (|.| <= 32,639), where the AVX2 path reads it (M >= 2)
};

// x (M, K) float32 or bfloat16 -> its Activations; op names the caller in the message.
Activations quantize(const at::Tensor& x, bool code_sums, const char* op) {
  const int64_t M = x.size(0), K = x.size(1), G = K / GROUP;
  Activations a{M, K, G, std::vector<int8_t>(M * K), std::vector<int8_t>(M * K), std::vector<float>(M * G),
                std::vector<float>(M * G), {}, {}};
  if (x.scalar_type() == at::kFloat)
    quantize_rows(x.data_ptr<float>(), M, K, a.xq.data(), a.xr.data(), a.dx.data(), a.sx.data());
  else if (x.scalar_type() == at::kBFloat16)
    quantize_rows(x.data_ptr<c10::BFloat16>(), M, K, a.xq.data(), a.xr.data(), a.dx.data(), a.sx.data());
  else
    TORCH_CHECK(false, op, ": x must be float32 or bfloat16");
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)) && defined(__AVX2__) && \
    defined(__F16C__) && defined(__FMA__)
  if (M >= WIDE_FROM) {
    a.x16.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) a.x16[i] = static_cast<int16_t>(256 * a.xq[i] + a.xr[i]);
  }
#endif
  if (code_sums) {
    a.sq.assign(M * G, 0);
    a.sr.assign(M * G, 0);
    for (int64_t i = 0; i < M * G; ++i)
      for (int k = 0; k < GROUP; ++k) {
        a.sq[i] += a.xq[i * GROUP + k];
        a.sr[i] += a.xr[i * GROUP + k];
      }
  }
  return a;
}

// ---------------------------------------------------------------- the front both ops share
//
// y = x Wᵀ for one weight format. What differs between formats is a Format's (Q4, Q8 below):
//   NAME                      the op, for messages ("qkv::int4_mm")
//   CHUNKS                    w's third dimension: 64-byte chunks per group of a block
//   SCALES                    float16 scales per group of a block
//   SCALES_ARG, SCALES_SHAPE  the scales' argument name and layout, for messages
//   CODE_SUMS                 whether its block reads the code sums sq, sr (Activations)
//   block(w, scales, a, out)  one block of 16 output rows: out (M, 16) += w's products with x
// Format::block is resolved at compile time (a template argument, not a function pointer), so
// each op's hot loop is compiled and inlined as if written out for it alone.
template <class Format>
at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  constexpr const char* op = Format::NAME;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous (M, K) matrix");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kByte && w.size(2) == Format::CHUNKS && w.size(3) == 64 &&
                  w.is_contiguous(),
              op, ": w must be packed as (N/16, K/32, ", Format::CHUNKS, ", 64) uint8");
  const int64_t M = x.size(0), K = x.size(1), NB = w.size(0), G = w.size(1), N = NB * ROWS;
  TORCH_CHECK(K == G * GROUP, op, ": x has ", K, " columns, the weight ", G * GROUP);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == NB * G * Format::SCALES &&
                  scales.is_contiguous(),
              op, ": ", Format::SCALES_ARG, " must be ", Format::SCALES_SHAPE, " float16");
  const Activations a = quantize(x, Format::CODE_SUMS, op);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  float* yp = y.data_ptr<float>();
  // The NB blocks of 16 output rows are shared among threads; each block's outputs for every row
  // of x accumulate in the thread's out (M, 16), then go to their 16 columns of y.
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> out(M * ROWS);
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(out.begin(), out.end(), 0.f);
      Format::block(wp + b * G * Format::CHUNKS * 64, sp + b * G * Format::SCALES, a, out.data());
      for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * N + b * ROWS, out.data() + m * ROWS, ROWS * sizeof(float));
    }
  });
  return y;
}

// ---------------------------------------------------------------- 4-bit weights (GGUF's Q4_0, Q4_1)

// One block of 16 output rows for every row m of x; out (M, 16) accumulates.
void block4(const uint8_t* w, const c10::Half* dm, const int8_t* xq, const int8_t* xr, const int16_t* x16,
            const float* dx, const float* sx, int64_t M, int64_t K, float* out) {
  const int64_t G = K / GROUP;
  (void)x16;  // read by the AVX2 path only
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * 256;
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wp + c * 64);
      lo[c] = _mm512_and_si512(v, low);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32)));
    const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32 + 16)));
    for (int64_t m = 0; m < M; ++m) {
      int32_t xw[8], rw[8];
      std::memcpy(xw, xq + m * K + g * GROUP, sizeof(xw));
      std::memcpy(rw, xr + m * K + g * GROUP, sizeof(rw));
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      __m512i r0 = _mm512_setzero_si512(), r1 = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        a0 = _mm512_dpbusd_epi32(a0, lo[c], _mm512_set1_epi32(xw[2 * c]));
        a1 = _mm512_dpbusd_epi32(a1, hi[c], _mm512_set1_epi32(xw[2 * c + 1]));
        r0 = _mm512_dpbusd_epi32(r0, lo[c], _mm512_set1_epi32(rw[2 * c]));
        r1 = _mm512_dpbusd_epi32(r1, hi[c], _mm512_set1_epi32(rw[2 * c + 1]));
      }
      // 256·<q, xq> + <q, xr>: |.| <= 257·60,960, well inside int32
      const __m512i both =
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a0, a1), 8), _mm512_add_epi32(r0, r1));
      __m512 acc = _mm512_loadu_ps(out + m * ROWS);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(d, _mm512_set1_ps(dx[m * G + g] * (1.f / 256.f))),
                            acc);
      acc = _mm512_fmadd_ps(z, _mm512_set1_ps(sx[m * G + g]), acc);
      _mm512_storeu_ps(out + m * ROWS, acc);
    }
  }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  if (x16 != nullptr) {  // M >= WIDE_FROM: int16 weights against 256·xq + xr
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wp = w + g * 256;
      // wv[h][c][k]: rows 8h..8h+7 of chunk c as int16, k: low nibbles' rows (0, 1 | 4, 5),
      // their rows (2, 3 | 6, 7), high nibbles' the same; each 32-bit lane two inputs of one row
      __m256i wv[2][4][4];
      for (int c = 0; c < 4; ++c)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + c * 64 + h * 32));
          const __m256i l = _mm256_and_si256(v, low), u = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          wv[h][c][0] = _mm256_unpacklo_epi8(l, zero);
          wv[h][c][1] = _mm256_unpackhi_epi8(l, zero);
          wv[h][c][2] = _mm256_unpacklo_epi8(u, zero);
          wv[h][c][3] = _mm256_unpackhi_epi8(u, zero);
        }
      __m256 d[2], z[2];
      for (int h = 0; h < 2; ++h) {
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 8 * h)));
        z[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 16 + 8 * h)));
      }
      for (int64_t m = 0; m < M; ++m) {
        const int16_t* xp = x16 + m * K + g * GROUP;
        __m256i xa[4], xb[4];  // inputs 8c..8c+3 (low nibbles) and 8c+4..8c+7 (high), four int16 repeated
        for (int c = 0; c < 4; ++c) {
          int64_t a8, b8;
          std::memcpy(&a8, xp + 8 * c, sizeof(a8));
          std::memcpy(&b8, xp + 8 * c + 4, sizeof(b8));
          xa[c] = _mm256_set1_epi64x(a8);
          xb[c] = _mm256_set1_epi64x(b8);
        }
        const __m256 scale = _mm256_set1_ps(dx[m * G + g] * (1.f / 256.f)), sum = _mm256_set1_ps(sx[m * G + g]);
        for (int h = 0; h < 2; ++h) {
          __m256i p = _mm256_setzero_si256(), q = _mm256_setzero_si256();  // rows 0, 1 | 4, 5; 2, 3 | 6, 7
          for (int c = 0; c < 4; ++c) {
            // code (0..15) x (256·xq + xr): pairs |.| <= 979,170; 32 products <= 15.7M in int32
            p = _mm256_add_epi32(p, _mm256_add_epi32(_mm256_madd_epi16(wv[h][c][0], xa[c]),
                                                     _mm256_madd_epi16(wv[h][c][2], xb[c])));
            q = _mm256_add_epi32(q, _mm256_add_epi32(_mm256_madd_epi16(wv[h][c][1], xa[c]),
                                                     _mm256_madd_epi16(wv[h][c][3], xb[c])));
          }
          const __m256i both = _mm256_hadd_epi32(p, q);  // rows 8h..8h+7 in order: 256·<q, xq> + <q, xr>
          __m256 o = _mm256_loadu_ps(out + m * ROWS + 8 * h);
          o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(both), _mm256_mul_ps(d[h], scale), o);
          o = _mm256_fmadd_ps(z[h], sum, o);
          _mm256_storeu_ps(out + m * ROWS + 8 * h, o);
        }
      }
    }
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * 256;
    __m256i lo[4][2], hi[4][2];
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h) {  // rows 0-7, rows 8-15
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + c * 64 + h * 32));
        lo[c][h] = _mm256_and_si256(v, low);
        hi[c][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
    __m256 d[2], z[2];
    for (int h = 0; h < 2; ++h) {
      d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 8 * h)));
      z[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 16 + 8 * h)));
    }
    for (int64_t m = 0; m < M; ++m) {
      int32_t xw[8], rw[8];
      std::memcpy(xw, xq + m * K + g * GROUP, sizeof(xw));
      std::memcpy(rw, xr + m * K + g * GROUP, sizeof(rw));
      const __m256 scale = _mm256_set1_ps(dx[m * G + g] * (1.f / 256.f)), sum = _mm256_set1_ps(sx[m * G + g]);
      for (int h = 0; h < 2; ++h) {
        __m256i acc = _mm256_setzero_si256(), res = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          // code (0..15) x activation (-127..127), pairs summed in int16 (|.| <= 7,620), then in int32
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c][h], _mm256_set1_epi32(xw[2 * c])),
                                             _mm256_maddubs_epi16(hi[c][h], _mm256_set1_epi32(xw[2 * c + 1])));
          const __m256i r = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c][h], _mm256_set1_epi32(rw[2 * c])),
                                             _mm256_maddubs_epi16(hi[c][h], _mm256_set1_epi32(rw[2 * c + 1])));
          acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
          res = _mm256_add_epi32(res, _mm256_madd_epi16(r, ones));
        }
        const __m256i both = _mm256_add_epi32(_mm256_slli_epi32(acc, 8), res);
        __m256 o = _mm256_loadu_ps(out + m * ROWS + 8 * h);
        o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(both), _mm256_mul_ps(d[h], scale), o);
        o = _mm256_fmadd_ps(z[h], sum, o);
        _mm256_storeu_ps(out + m * ROWS + 8 * h, o);
      }
    }
  }
#else
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * 256;
    for (int j = 0; j < ROWS; ++j) {
      const float d = static_cast<float>(dm[g * 32 + j]), z = static_cast<float>(dm[g * 32 + 16 + j]);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xp = xq + m * K + g * GROUP;
        const int8_t* rp = xr + m * K + g * GROUP;
        int32_t acc = 0, res = 0;
        for (int c = 0; c < 4; ++c)
          for (int b = 0; b < 4; ++b) {
            const uint8_t byte = wp[c * 64 + j * 4 + b];
            acc += (byte & 0x0F) * xp[c * 8 + b] + (byte >> 4) * xp[c * 8 + 4 + b];
            res += (byte & 0x0F) * rp[c * 8 + b] + (byte >> 4) * rp[c * 8 + 4 + b];
          }
        out[m * ROWS + j] += static_cast<float>(acc * 256 + res) * (d * (dx[m * G + g] * (1.f / 256.f))) +
                             z * sx[m * G + g];
      }
    }
  }
#endif
}

// The 4-bit layout for qmatmul: w (N/16, K/32, 4, 64): 256 bytes per group of a block;
// dm (N/16, K/32, 2, 16): 16 d then 16 m per group; the offset term reads the float sums sx.
struct Q4 {
  static constexpr const char* NAME = "qkv::int4_mm";
  static constexpr int64_t CHUNKS = 4, SCALES = 32;
  static constexpr const char* SCALES_ARG = "dm";
  static constexpr const char* SCALES_SHAPE = "(N/16, K/32, 2, 16)";
  static constexpr bool CODE_SUMS = false;
  static void block(const uint8_t* w, const c10::Half* dm, const Activations& a, float* out) {
    block4(w, dm, a.xq.data(), a.xr.data(), a.x16.empty() ? nullptr : a.x16.data(), a.dx.data(), a.sx.data(),
           a.M, a.K, out);
  }
};

// ---------------------------------------------------------------- 8-bit weights (GGUF's Q8_0)
//
// w = d·q, q in -127..127, one float16 d per group of 32 inputs of a row (the file's own blocks).
// Packed, 16 output rows per block:
//   w  uint8   (N/16, K/32, 8, 64): block, group, chunk c of 4 inputs; byte 4j + b holds
//              q + 128 for row j, input 4c + b (unsigned, as vpdpbusd's first operand wants)
//   ds float16 (N/16, K/32, 16): the 16 rows' d
// y[n] = Σ_g d[n,g]·dx[g]/256·(256·<q, xq> + <q, xr>), where <q + 128, x> − 128·Σx = <q, x>.

void block8(const uint8_t* w, const c10::Half* ds, const int8_t* xq, const int8_t* xr, const int16_t* x16,
            const float* dx, const int32_t* sq, const int32_t* sr, int64_t M, int64_t K, float* out) {
  const int64_t G = K / GROUP;
  (void)x16;  // read by the AVX2 path only
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * 512;
    __m512i v[8];
    for (int c = 0; c < 8; ++c) v[c] = _mm512_loadu_si512(wp + c * 64);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ds + g * 16)));
    for (int64_t m = 0; m < M; ++m) {
      int32_t xw[8], rw[8];
      std::memcpy(xw, xq + m * K + g * GROUP, sizeof(xw));
      std::memcpy(rw, xr + m * K + g * GROUP, sizeof(rw));
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      __m512i r0 = _mm512_setzero_si512(), r1 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        a0 = _mm512_dpbusd_epi32(a0, v[c], _mm512_set1_epi32(xw[c]));
        a1 = _mm512_dpbusd_epi32(a1, v[c + 1], _mm512_set1_epi32(xw[c + 1]));
        r0 = _mm512_dpbusd_epi32(r0, v[c], _mm512_set1_epi32(rw[c]));
        r1 = _mm512_dpbusd_epi32(r1, v[c + 1], _mm512_set1_epi32(rw[c + 1]));
      }
      // 256·(<q+128, xq> − 128·Σxq) + <q+128, xr> − 128·Σxr: |.| < 2^29
      const int32_t offset = 128 * (256 * sq[m * G + g] + sr[m * G + g]);
      const __m512i both = _mm512_sub_epi32(
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a0, a1), 8), _mm512_add_epi32(r0, r1)),
          _mm512_set1_epi32(offset));
      __m512 acc = _mm512_loadu_ps(out + m * ROWS);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(d, _mm512_set1_ps(dx[m * G + g] * (1.f / 256.f))),
                            acc);
      _mm512_storeu_ps(out + m * ROWS, acc);
    }
  }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  if (x16 != nullptr) {  // M >= WIDE_FROM: int16 weights against 256·xq + xr
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wp = w + g * 512;
      __m256i wv[2][8][2];  // rows 8h..8h+7 of chunk c as int16: rows (0, 1 | 4, 5), rows (2, 3 | 6, 7)
      for (int c = 0; c < 8; ++c)
        for (int h = 0; h < 2; ++h) {
          const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + c * 64 + h * 32)), flip);
          const __m256i sign = _mm256_cmpgt_epi8(zero, q);
          wv[h][c][0] = _mm256_unpacklo_epi8(q, sign);
          wv[h][c][1] = _mm256_unpackhi_epi8(q, sign);
        }
      __m256 d[2];
      for (int h = 0; h < 2; ++h)
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + g * 16 + 8 * h)));
      for (int64_t m = 0; m < M; ++m) {
        const int16_t* xp = x16 + m * K + g * GROUP;
        __m256i xa[8];  // inputs 4c..4c+3, four int16 repeated
        for (int c = 0; c < 8; ++c) {
          int64_t a8;
          std::memcpy(&a8, xp + 4 * c, sizeof(a8));
          xa[c] = _mm256_set1_epi64x(a8);
        }
        const __m256 scale = _mm256_set1_ps(dx[m * G + g] * (1.f / 256.f));
        for (int h = 0; h < 2; ++h) {
          __m256i p = _mm256_setzero_si256(), q = _mm256_setzero_si256();
          for (int c = 0; c < 8; ++c) {
            // code (-127..127) x (256·xq + xr): 32 products |.| <= 133M in int32
            p = _mm256_add_epi32(p, _mm256_madd_epi16(wv[h][c][0], xa[c]));
            q = _mm256_add_epi32(q, _mm256_madd_epi16(wv[h][c][1], xa[c]));
          }
          const __m256i both = _mm256_hadd_epi32(p, q);
          __m256 o = _mm256_loadu_ps(out + m * ROWS + 8 * h);
          o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(both), _mm256_mul_ps(d[h], scale), o);
          _mm256_storeu_ps(out + m * ROWS + 8 * h, o);
        }
      }
    }
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * 512;
    __m256 d[2];
    for (int h = 0; h < 2; ++h)
      d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + g * 16 + 8 * h)));
    for (int64_t m = 0; m < M; ++m) {
      int32_t xw[8], rw[8];
      std::memcpy(xw, xq + m * K + g * GROUP, sizeof(xw));
      std::memcpy(rw, xr + m * K + g * GROUP, sizeof(rw));
      const __m256 scale = _mm256_set1_ps(dx[m * G + g] * (1.f / 256.f));
      for (int h = 0; h < 2; ++h) {
        __m256i acc = _mm256_setzero_si256(), res = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          // signed weights; |x| times w with x's sign (llama.cpp's trick): pairs <= 32,258 in int16
          const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + c * 64 + h * 32)), flip);
          const __m256i xb = _mm256_set1_epi32(xw[c]), rb = _mm256_set1_epi32(rw[c]);
          acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(ws, xb)), ones));
          res = _mm256_add_epi32(res, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(rb), _mm256_sign_epi8(ws, rb)), ones));
        }
        const __m256i both = _mm256_add_epi32(_mm256_slli_epi32(acc, 8), res);
        __m256 o = _mm256_loadu_ps(out + m * ROWS + 8 * h);
        o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(both), _mm256_mul_ps(d[h], scale), o);
        _mm256_storeu_ps(out + m * ROWS + 8 * h, o);
      }
    }
  }
#else
  (void)sq;
  (void)sr;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * 512;
    for (int j = 0; j < ROWS; ++j) {
      const float d = static_cast<float>(ds[g * 16 + j]);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xp = xq + m * K + g * GROUP;
        const int8_t* rp = xr + m * K + g * GROUP;
        int32_t acc = 0, res = 0;
        for (int c = 0; c < 8; ++c)
          for (int b = 0; b < 4; ++b) {
            const int32_t q = static_cast<int32_t>(wp[c * 64 + j * 4 + b]) - 128;
            acc += q * xp[c * 4 + b];
            res += q * rp[c * 4 + b];
          }
        out[m * ROWS + j] += static_cast<float>(acc * 256 + res) * (d * (dx[m * G + g] * (1.f / 256.f)));
      }
    }
  }
#endif
}

// The 8-bit layout for qmatmul: w (N/16, K/32, 8, 64): 512 bytes per group of a block;
// ds (N/16, K/32, 16): 16 d per group; the codes' offset (q + 128) takes the code sums sq, sr.
struct Q8 {
  static constexpr const char* NAME = "qkv::q8_mm";
  static constexpr int64_t CHUNKS = 8, SCALES = 16;
  static constexpr const char* SCALES_ARG = "ds";
  static constexpr const char* SCALES_SHAPE = "(N/16, K/32, 16)";
  static constexpr bool CODE_SUMS = true;
  static void block(const uint8_t* w, const c10::Half* ds, const Activations& a, float* out) {
    block8(w, ds, a.xq.data(), a.xr.data(), a.x16.empty() ? nullptr : a.x16.data(), a.dx.data(), a.sq.data(),
           a.sr.data(), a.M, a.K, out);
  }
};

// The ops: torch calls these (schemas below).
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dm) { return qmatmul<Q4>(x, w, dm); }
at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ds) { return qmatmul<Q8>(x, w, ds); }

std::string int4_path() { return PATH; }

}  // namespace

// The namespace is qkv unless the build names another (the tests load every code path at once).
#ifndef QKV_NAMESPACE
#define QKV_NAMESPACE qkv
#endif
#define QKV_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define QKV_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

QKV_LIBRARY(QKV_NAMESPACE, m) {
  m.def("int4_mm(Tensor x, Tensor w, Tensor dm) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor w, Tensor ds) -> Tensor");
  m.def("int4_path() -> str", &int4_path);
}
QKV_LIBRARY_IMPL(QKV_NAMESPACE, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("q8_mm", &q8_mm);
}
