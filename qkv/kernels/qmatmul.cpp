// qkv's quantised matrix products for decoding, y = x Wᵀ, W stored as GGUF stores it:
//
// - int4_mm: groups of 32 weights that share a scale d and an offset m (w = d·q + m, q in 0..15:
//   Q4_1; Q4_0 is m = −8d);
// - q8_mm: groups of 32 with one scale (w = d·q, q in −127..127: Q8_0);
// - Decoder: a Llama-shaped decoder's whole one-token step on those products (at the end).
//
// x is rounded on the fly per group of 32 to int8 twice, x ≈ dx·(xq + xr/256) (quantize_rows),
// and multiplied by integer dot products (AVX512-VNNI's vpdpbusd: 64 products an instruction;
// AVX2's vpmaddubsw, or AVX-VNNI's 256-bit vpdpbusd where the CPU has it; AMX tiles for 12 rows and
// more of a 4-bit product: 16 rows x 16 outputs x 32 inputs a tile multiply), then one float
// multiply-add per group:
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
// kernel of one block (block4, block8), each compiled for AVX512-VNNI (block4 also AMX), AVX2 (with
// AVX-VNNI where the build has it) or plain C++.

#include <torch/library.h>
#include <torch/custom_class.h>
#include <omp.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <type_traits>
#include <functional>
#include <memory>
#include <utility>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// The namespace is qkv unless the build names another (the tests load every code path at once).
#ifndef QKV_NAMESPACE
#define QKV_NAMESPACE qkv
#endif

namespace {

constexpr int64_t ROWS = 16, GROUP = 32;
// One row's products read each group's weights this many groups ahead (_mm_prefetch): decoding
// streams ~95 MB a token from memory, and a product of 0.2-1 MB is over before the hardware's
// prefetchers ramp up. Measured by hand on a Zen 3 (AVX2; BENCHMARKS.md, issue 53), a token's 30
// layers of SmolLM2's 4-bit shapes from memory: 4.08 -> 3.58 ms at 8 groups ahead (4: 3.82, 16:
// 3.72); its int8 head 2.02 -> 1.80 ms.
constexpr int64_t AHEAD = 8;
// ... and, where the activations ask for it (Activations::far), into L2 FAR groups ahead: from
// DRAM (a model larger than the last-level cache, as every model is on an AMD EPYC's 32 MB of L3
// a CCD) the L1 prefetches alone may keep too few lines in flight while the core multiplies.
// Measured on the Emerald Rapids Xeon with SmolLM2's blocks repeated to 695 MB, not settled: in
// a calm half hour (by hand, 6 alternated rounds, every prefetch far) the AVX-512 build's native
// step 1.11x the tokens/s (rounds 1.09-1.13), the AVX2 build's 1.13x (1.08-1.16), 40 groups ahead
// instead of 24 0.98x of that; in a noisy hour 1.00x (0.86-1.08; benchmarks/from_memory.py) and 1.04x
// (0.86-1.28, by hand). From L3 (SmolLM2 there) 0.9994x the step's time (native_ab.py, 150 blocks;
// 1.039x in an earlier run): the decoder asks for it for a model larger than the last-level cache
// only (qkv/generation/native_step.py: prefetch_far; QKV_NATIVE_PREFETCH=near turns it off).
constexpr int64_t FAR = 3 * AHEAD;
// The decoder's head: the largest logit of each block of this many first (its top-k and argmax).
constexpr int64_t SPAN_OF_MAX = 128;
// The decoder: bytes of a thread's next product asked for while it waits at a barrier (warm).
constexpr int64_t WARM_BYTES = 2048;
// From this many rows of x on, the AVX2 path widens each group's weights to int16 once and
// multiplies every row by one 16-bit product per pair of inputs against x's two codes joined,
// 256·xq + xr (one vpmaddwd, where one row alone takes two vpmaddubsw and a vpmaddwd): the same
// integers, so the same floats as a row alone, bit for bit (a running batch decodes each row
// as it would alone), at ~2/3 of the multiplies per row. One row alone keeps the 8-bit products
// (widening the weights would cost it more than it saves).
constexpr int64_t WIDE_FROM = 2;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
constexpr const char* PATH = "avx512-vnni";
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && defined(__AVXVNNI__)
// AVX2 with AVX-VNNI's 256-bit integer dot products (Intel's Alder Lake and later cores, Sierra
// Forest): one vpdpbusd where AVX2 takes vpmaddubsw, vpmaddwd and an add (the same integers)
constexpr const char* PATH = "avx2-vnni";
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr const char* PATH = "avx2";
#else
constexpr const char* PATH = "scalar";
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// The narrow AVX2 paths of block4 and block8 take one row (x16 is set from two rows on).
static_assert(WIDE_FROM == 2, "the AVX2 one-row paths assume every product of two or more rows is wide");
// Ask for the cache lines of bytes [p, p + n) ahead of their use (see AHEAD), and with far, into
// L2, those FAR groups ahead: p is AHEAD groups of n bytes ahead of the group in use.
inline void prefetch(const void* p, int64_t n, bool far) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
  if (far)
    for (int64_t i = 0; i < n; i += 64) _mm_prefetch(c + (FAR - AHEAD) * n + i, _MM_HINT_T1);
}
// 8 values of x from p as float32 (bfloat16: its bits are the top half of a float32's)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
inline float hsum8(__m256 v) {  // ((v0+v4)+(v2+v6))+((v1+v5)+(v3+v7)), a fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// four vectors of 8 int32 (each in -127..127) -> 32 int8 in order
inline __m256i pack32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
// 4 int8 activations at p repeated 16 times, read straight from memory: a broadcast load
// (vpbroadcastd from memory, or vpdpbusd's {1to16} operand), which the load ports do alone;
// broadcasting from a general register instead costs a shuffle-port instruction per product,
// which made the shuffle port the one-row bound on an Intel Xeon (issue 53).
typedef int32_t unaligned_i32 __attribute__((aligned(1), may_alias));
inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const unaligned_i32*>(p)); }
#endif

// AMX tiles (Sapphire Rapids and later Xeons), for the 4-bit products of many rows of x (a prompt;
// a running batch of AMX_FROM rows or more): per group of 32 inputs, one tile multiply (TDPBSUD: signed int8 x
// unsigned int8, summed in int32) gives up to 16 rows x 16 outputs of <xq, q> and another of
// <xr, q>, the same integers the VNNI path sums, so the same floats follow, bit for bit (a row in
// a batch is decoded as it would be alone). Linux lends a process the tile state only when asked
// (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA): asked once; where that fails, the VNNI path runs.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512F__) && defined(__linux__)
#define QKV_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
// From this many rows of x on, 4-bit products take the tiles. Measured on an Intel Xeon (family 6
// model 207, 2 cores; a token's 120 products of SmolLM2's shapes, alternated, BENCHMARKS.md issue
// 53): tiles ÷ VNNI rows 0.81x at 4 rows, 0.92-1.14x at 8, 1.36x at 12, 1.34-1.47x at 16, 1.27-1.33x
// at 32. The tiles' share is the integer sums; the float work per row and group (scales, sums) stays.
constexpr int64_t AMX_FROM = 12;
bool amx_ready() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}
// The tile configuration of a product of M rows, loaded by each thread before its blocks: tiles
// 0, 1: xq and xr (rows x 32 bytes), 2: a group's weights (8 rows of 4 inputs x 16 outputs), 4,
// 5: the two sums (rows x 16 int32); rows = min(M, 16).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
void amx_begin(int64_t M) {
  TileConfig c;
  const uint8_t r = static_cast<uint8_t>(std::min<int64_t>(M, 16));
  c.colsb[0] = c.colsb[1] = 32, c.rows[0] = c.rows[1] = r;
  c.colsb[2] = 64, c.rows[2] = 8;
  c.colsb[4] = c.colsb[5] = 64, c.rows[4] = c.rows[5] = r;
  // the whole configuration an input of the instruction: GCC's builtin reads only its first byte
  // as far as the optimiser knows, and once amx_begin was compiled out of line it dropped every
  // other store (the tiles left unconfigured: the first tile load raised SIGILL)
  asm volatile("" : : "m"(c) : "memory");
  _tile_loadconfig(&c);
}
#else
#define QKV_AMX 0
#endif

// Each row of x (M, K) and each group of 32: x ≈ dx·(xq + xr/256), two int8 codes per value (the
// second the rounding residual of the first, in steps of dx/256), the scale dx = max|x| / 127
// and the float sum; where sq is given, also the code sums Σxq and Σxr. One int8 code alone
// (llama.cpp's Q8 activations) rounds each value by up to dx/2, which on a real model's
// activations (a few large channels set dx) moves the next-token distribution ~20x further from
// the float model's than bf16 does; with the residual, x is carried to dx/512, finer than bf16
// (measured in BENCHMARKS.md). AVX2 rounds 8 values an instruction (half to even, as nearbyint).
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, int8_t* xr, float* dx, float* sx,
                   int32_t* sq, int32_t* sr) {
  const int64_t G = K / GROUP;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const T* p = x + m * K + g * GROUP;
      int8_t* q = xq + m * K + g * GROUP;
      int8_t* r = xr + m * K + g * GROUP;
      const int64_t i = m * G + g;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
      __m256 v[4];
      for (int k = 0; k < 4; ++k) v[k] = load8(p + 8 * k);
      const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      const float s = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
      const float amax = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                             _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask))));
      if (!std::isfinite(s) || !std::isfinite(amax)) {  // a NaN or inf activation: NaN out, as a float product
        std::memset(q, 0, GROUP);
        std::memset(r, 0, GROUP);
        dx[i] = sx[i] = std::numeric_limits<float>::quiet_NaN();
        if (sq != nullptr) sq[i] = sr[i] = 0;
        continue;
      }
      const float d = amax / 127.f, inv = d >= std::numeric_limits<float>::min() ? 1.f / d : 0.f;
      const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f),
                   k256 = _mm256_set1_ps(256.f);
      constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      __m256i ci[4], ri[4];
      __m256 csum = _mm256_setzero_ps(), rsum = _mm256_setzero_ps();
      for (int k = 0; k < 4; ++k) {
        const __m256 u = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[k], vinv), lo), hi);
        const __m256 c = _mm256_round_ps(u, RN);
        const __m256 e = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(u, c), k256), RN), lo), hi);
        ci[k] = _mm256_cvtps_epi32(c);
        ri[k] = _mm256_cvtps_epi32(e);
        csum = _mm256_add_ps(csum, c);  // integers: exact
        rsum = _mm256_add_ps(rsum, e);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), pack32(ci[0], ci[1], ci[2], ci[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r), pack32(ri[0], ri[1], ri[2], ri[3]));
      if (sq != nullptr) {
        sq[i] = static_cast<int32_t>(hsum8(csum));
        sr[i] = static_cast<int32_t>(hsum8(rsum));
      }
      dx[i] = d;
      sx[i] = s;
#else
      float v[GROUP];
      float amax = 0.f, s = 0.f;
      for (int k = 0; k < GROUP; ++k) {
        v[k] = static_cast<float>(p[k]);
        amax = std::max(amax, std::fabs(v[k]));
        s += v[k];
      }
      int32_t cs = 0, rs = 0;
      if (!std::isfinite(s) || !std::isfinite(amax)) {  // a NaN or inf activation: NaN out, as a float product
        std::fill(q, q + GROUP, 0);
        std::fill(r, r + GROUP, 0);
        dx[i] = sx[i] = std::numeric_limits<float>::quiet_NaN();
      } else {
        const float d = amax / 127.f, inv = d >= std::numeric_limits<float>::min() ? 1.f / d : 0.f;
        for (int k = 0; k < GROUP; ++k) {
          const float u = std::clamp(v[k] * inv, -127.f, 127.f), c = std::nearbyint(u);
          q[k] = static_cast<int8_t>(c);
          r[k] = static_cast<int8_t>(std::clamp(std::nearbyint((u - c) * 256.f), -127.f, 127.f));
          cs += q[k];
          rs += r[k];
        }
        dx[i] = d;
        sx[i] = s;
      }
      if (sq != nullptr) {
        sq[i] = cs;
        sr[i] = rs;
      }
#endif
    }
  }
}

// x quantised once per call and read by every block of output rows: per value its int8 code xq
// and residual xr (M, K); per row and group of 32 (M, K/32) the scale dx, the float sum sx and,
// for a format whose weight codes are stored offset (8-bit: q + 128), the code sums sq = Σxq
// and sr = Σxr. The buffers are the calling thread's own, kept from call to call (a token's
// 121 products would otherwise allocate and free them each time).
struct Activations {
  int64_t M = 0, K = 0, G = 0;
  std::vector<int8_t> xq, xr;
  std::vector<float> dx, sx;
  std::vector<int32_t> sq, sr;
  std::vector<int16_t> x16;  // 256·xq + xr (|.| <= 32,639), where the AVX2 path reads it (M >= 2)
  bool wide = false;         // x16 holds this call's values
  bool amx = false;          // the 4-bit products of this call take AMX tiles (xq, xr padded with
                             // zero rows to a multiple of 16, which the tiles read and discard)
  bool far = false;          // the products also ask for their weights FAR groups ahead (see FAR;
                             // the paths that prefetch: AVX512-VNNI's, AVX2's one row; not AMX tiles
                             // nor AVX2's wide rows, which prefetch nothing)
};

// x (M, K) of type T quantised into a (its buffers sized to it; wide and amx unset): the ops' front
// below, and the decoder's one row at a time.
// a's buffers sized for x (M, K) (wide and amx unset), to be filled by quantize_rows
inline void size_for(int64_t M, int64_t K, bool code_sums, Activations& a) {
  const int64_t G = K / GROUP;
  a.M = M, a.K = K, a.G = G, a.wide = false, a.amx = false;
  a.xq.resize(M * K), a.xr.resize(M * K), a.dx.resize(M * G), a.sx.resize(M * G);
  a.sq.resize(code_sums ? M * G : 0), a.sr.resize(code_sums ? M * G : 0);
}

template <typename T>
void quantize_into(const T* x, int64_t M, int64_t K, bool code_sums, Activations& a) {
  size_for(M, K, code_sums, a);
  quantize_rows(x, M, K, a.xq.data(), a.xr.data(), a.dx.data(), a.sx.data(), code_sums ? a.sq.data() : nullptr,
                code_sums ? a.sr.data() : nullptr);
}

// What a's M rows take beyond their codes: AMX tiles (a format whose block reads them, tiles; from
// AMX_FROM rows, xq and xr padded with zero rows to a multiple of 16) or, on AVX2, the joined
// 16-bit codes (from WIDE_FROM rows). The ops' front and the decoder's rows alike.
inline void for_rows(Activations& a, bool tiles) {
  const int64_t M = a.M, K = a.K;
  (void)tiles, (void)M, (void)K;  // read where AMX or AVX2 is compiled in
#if QKV_AMX
  if (tiles && M >= AMX_FROM && amx_ready()) {
    const int64_t padded = (M + 15) / 16 * 16;
    a.xq.resize(padded * K), a.xr.resize(padded * K);
    std::fill(a.xq.begin() + M * K, a.xq.end(), 0), std::fill(a.xr.begin() + M * K, a.xr.end(), 0);
    a.amx = true;
  }
#endif
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)) && defined(__AVX2__) && \
    defined(__F16C__) && defined(__FMA__)
  if (M >= WIDE_FROM) {
    a.x16.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) a.x16[i] = static_cast<int16_t>(256 * a.xq[i] + a.xr[i]);
    a.wide = true;
  }
#endif
}

// x (M, K) float32 or bfloat16 -> its Activations (this thread's, valid until its next call); op
// names the caller in the message; tiles: the format's block can take AMX tiles (Format::TILES).
const Activations& quantize(const at::Tensor& x, bool code_sums, bool tiles, const char* op) {
  thread_local Activations a;
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kFloat)
    quantize_into(x.data_ptr<float>(), M, K, code_sums, a);
  else if (x.scalar_type() == at::kBFloat16)
    quantize_into(x.data_ptr<c10::BFloat16>(), M, K, code_sums, a);
  else
    TORCH_CHECK(false, op, ": x must be float32 or bfloat16");
  for_rows(a, tiles);
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
//   TILES                     whether its block takes AMX tiles for many rows (Activations::amx)
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
  const Activations& a = quantize(x, Format::CODE_SUMS, Format::TILES, op);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  float* yp = y.data_ptr<float>();
  // The NB blocks of 16 output rows are shared among threads, at least SPLIT groups of a block
  // each (starting a second thread costs ~2 µs: a product smaller than that runs on one); each
  // block's outputs for every row of x accumulate in the thread's out (M, 16), then go to their
  // 16 columns of y.
  constexpr int64_t SPLIT = 256;
  at::parallel_for(0, NB, std::max<int64_t>(1, SPLIT / (G * M)), [&](int64_t b0, int64_t b1) {
#if QKV_AMX
    if (a.amx) amx_begin(M);  // this thread's tiles (a.amx: only a format that reads them sets it)
#endif
    float small[16 * ROWS];
    std::vector<float> large(M > 16 ? M * ROWS : 0);
    float* out = M > 16 ? large.data() : small;
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(out, out + M * ROWS, 0.f);
      Format::block(wp + b * G * Format::CHUNKS * 64, sp + b * G * Format::SCALES, a, out);
      for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * N + b * ROWS, out + m * ROWS, ROWS * sizeof(float));
    }
#if QKV_AMX
    if (a.amx) _tile_release();
#endif
  });
  return y;
}

// ---------------------------------------------------------------- 4-bit weights (GGUF's Q4_0, Q4_1)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
// f(m0, MB) for the rows of x in runs of up to 8 from m0, MB a compile-time count (an
// std::integral_constant: the row kernels below keep MB rows' outputs in registers).
template <class F>
inline void in_eights(int64_t M, F&& f) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: f(m0, std::integral_constant<int, 1>{}); break;
      case 2: f(m0, std::integral_constant<int, 2>{}); break;
      case 3: f(m0, std::integral_constant<int, 3>{}); break;
      case 4: f(m0, std::integral_constant<int, 4>{}); break;
      case 5: f(m0, std::integral_constant<int, 5>{}); break;
      case 6: f(m0, std::integral_constant<int, 6>{}); break;
      case 7: f(m0, std::integral_constant<int, 7>{}); break;
      default: f(m0, std::integral_constant<int, 8>{}); break;
    }
  }
}

// MB rows of x (xq, xr, dx, sx from their first) against one block of 16 outputs, each row's 16
// outputs in a register over all groups and the group's weights unpacked once for the MB rows,
// read AHEAD groups early: the integers and float operations of the one-row path, in its order,
// for each row. (Accumulated in memory a row and group at a time, with no prefetch, a running
// batch's step of 2 rows took 2.4x one row's; measured in benchmarks/batch_rows.py, issue 53.)
template <int MB>
inline void block4_rows(const uint8_t* w, const c10::Half* dm, const int8_t* xq, const int8_t* xr, const float* dx,
                        const float* sx, int64_t K, float* out, bool far) {
  const int64_t G = K / GROUP;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 o[MB];
  for (int i = 0; i < MB; ++i) o[i] = _mm512_loadu_ps(out + i * ROWS);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * 256;
    prefetch(wp + AHEAD * 256, 256, far);
    prefetch(dm + (g + AHEAD) * 32, 64, far);
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wp + c * 64);
      lo[c] = _mm512_and_si512(v, low);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32)));
    const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32 + 16)));
    for (int i = 0; i < MB; ++i) {
      const int8_t* xp = xq + i * K + g * GROUP;
      const int8_t* rp = xr + i * K + g * GROUP;
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      __m512i r0 = _mm512_setzero_si512(), r1 = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        a0 = _mm512_dpbusd_epi32(a0, lo[c], bcast4(xp + 8 * c));
        a1 = _mm512_dpbusd_epi32(a1, hi[c], bcast4(xp + 8 * c + 4));
        r0 = _mm512_dpbusd_epi32(r0, lo[c], bcast4(rp + 8 * c));
        r1 = _mm512_dpbusd_epi32(r1, hi[c], bcast4(rp + 8 * c + 4));
      }
      // 256·<q, xq> + <q, xr>: |.| <= 257·60,960, well inside int32
      const __m512i both =
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a0, a1), 8), _mm512_add_epi32(r0, r1));
      o[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(d, _mm512_set1_ps(dx[i * G + g] * (1.f / 256.f))),
                             o[i]);
      o[i] = _mm512_fmadd_ps(z, _mm512_set1_ps(sx[i * G + g]), o[i]);
    }
  }
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out + i * ROWS, o[i]);
}
#endif

// One block of 16 output rows for every row m of x; out (M, 16) accumulates.
void block4(const uint8_t* w, const c10::Half* dm, const int8_t* xq, const int8_t* xr, const int16_t* x16,
            const float* dx, const float* sx, int64_t M, int64_t K, float* out, bool amx, bool far) {
  const int64_t G = K / GROUP;
  (void)x16;  // read by the AVX2 path only
  (void)amx;  // read by the AMX path only
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
  const __m512i low = _mm512_set1_epi8(0x0F);
  if (M == 1) {  // one row: the 16 outputs stay in a register over all groups, weights prefetched
    __m512 o = _mm512_loadu_ps(out);
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wp = w + g * 256;
      prefetch(wp + AHEAD * 256, 256, far);
      prefetch(dm + (g + AHEAD) * 32, 64, far);
      const int8_t* xp = xq + g * GROUP;
      const int8_t* rp = xr + g * GROUP;
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      __m512i r0 = _mm512_setzero_si512(), r1 = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(wp + c * 64);
        const __m512i l = _mm512_and_si512(v, low), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        a0 = _mm512_dpbusd_epi32(a0, l, bcast4(xp + 8 * c));
        a1 = _mm512_dpbusd_epi32(a1, h, bcast4(xp + 8 * c + 4));
        r0 = _mm512_dpbusd_epi32(r0, l, bcast4(rp + 8 * c));
        r1 = _mm512_dpbusd_epi32(r1, h, bcast4(rp + 8 * c + 4));
      }
      // the same integers and float operations, in the same order, as the rows below
      const __m512i both =
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a0, a1), 8), _mm512_add_epi32(r0, r1));
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32)));
      const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32 + 16)));
      o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(d, _mm512_set1_ps(dx[g] * (1.f / 256.f))), o);
      o = _mm512_fmadd_ps(z, _mm512_set1_ps(sx[g]), o);
    }
    _mm512_storeu_ps(out, o);
    return;
  }
#if QKV_AMX
  if (amx) {  // tiles configured by the caller (amx_begin); xq, xr padded to 16-row chunks
    alignas(64) uint8_t wb[8 * 64];
    alignas(64) int32_t c1[16 * 16], c2[16 * 16];
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wp = w + g * 256;
      // the group's codes as the tile wants them: row 2c the low nibbles of chunk c (inputs 8c..8c+3
      // of each of the 16 outputs), row 2c + 1 its high nibbles (inputs 8c+4..8c+7)
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(wp + c * 64);
        _mm512_store_si512(wb + 2 * c * 64, _mm512_and_si512(v, low));
        _mm512_store_si512(wb + (2 * c + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
      _tile_loadd(2, wb, 64);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32)));
      const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32 + 16)));
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        _tile_loadd(0, xq + m0 * K + g * GROUP, K);
        _tile_loadd(1, xr + m0 * K + g * GROUP, K);
        _tile_zero(4);
        _tile_zero(5);
        _tile_dpbsud(4, 0, 2);  // <xq, q> for up to 16 rows x 16 outputs
        _tile_dpbsud(5, 1, 2);  // <xr, q>
        _tile_stored(4, c1, 64);
        _tile_stored(5, c2, 64);
        for (int64_t i = 0, n = std::min<int64_t>(16, M - m0); i < n; ++i) {  // as the VNNI rows below
          const int64_t m = m0 + i;
          const __m512i both = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c1 + 16 * i), 8),
                                                _mm512_load_si512(c2 + 16 * i));
          __m512 acc = _mm512_loadu_ps(out + m * ROWS);
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both),
                                _mm512_mul_ps(d, _mm512_set1_ps(dx[m * G + g] * (1.f / 256.f))), acc);
          acc = _mm512_fmadd_ps(z, _mm512_set1_ps(sx[m * G + g]), acc);
          _mm512_storeu_ps(out + m * ROWS, acc);
        }
      }
    }
    return;
  }
#endif
  in_eights(M, [&](int64_t m0, auto mb) {  // up to 8 rows at a time, their outputs in registers
    block4_rows<decltype(mb)::value>(w, dm, xq + m0 * K, xr + m0 * K, dx + m0 * G, sx + m0 * G, K, out + m0 * ROWS,
                                     far);
  });
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
#if defined(__AVXVNNI__)  // vpdpwssd: the pairs' sums added in the same instruction
            p = _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(p, wv[h][c][0], xa[c]), wv[h][c][2], xb[c]);
            q = _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(q, wv[h][c][1], xa[c]), wv[h][c][3], xb[c]);
#else
            p = _mm256_add_epi32(p, _mm256_add_epi32(_mm256_madd_epi16(wv[h][c][0], xa[c]),
                                                     _mm256_madd_epi16(wv[h][c][2], xb[c])));
            q = _mm256_add_epi32(q, _mm256_add_epi32(_mm256_madd_epi16(wv[h][c][1], xa[c]),
                                                     _mm256_madd_epi16(wv[h][c][3], xb[c])));
#endif
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
  // One row (M = 1): 8-bit products against xq and xr, pairs summed in int16 and kept there over
  // the group's 4 chunks (8 pairs of code (0..15) x activation (-127..127): |.| <= 30,480), then
  // widened once: 256·<q, xq> + <q, xr> per output row. The 16 rows' outputs stay in registers
  // over all groups.
  const __m256i k256 = _mm256_set1_epi16(256);
  __m256 o[2] = {_mm256_loadu_ps(out), _mm256_loadu_ps(out + 8)};
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * 256;
    prefetch(wp + AHEAD * 256, 256, far);
    prefetch(dm + (g + AHEAD) * 32, 64, far);
    int32_t xw[8], rw[8];
    std::memcpy(xw, xq + g * GROUP, sizeof(xw));
    std::memcpy(rw, xr + g * GROUP, sizeof(rw));
    __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    __m256i res[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int c = 0; c < 4; ++c) {
      const __m256i xa = _mm256_set1_epi32(xw[2 * c]), xb = _mm256_set1_epi32(xw[2 * c + 1]);
      const __m256i ra = _mm256_set1_epi32(rw[2 * c]), rb = _mm256_set1_epi32(rw[2 * c + 1]);
      for (int h = 0; h < 2; ++h) {  // rows 0-7, rows 8-15
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + c * 64 + h * 32));
        const __m256i l = _mm256_and_si256(v, low), u = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#if defined(__AVXVNNI__)  // each row's 4-byte sums straight into int32
        acc[h] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc[h], l, xa), u, xb);
        res[h] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(res[h], l, ra), u, rb);
#else
        acc[h] = _mm256_add_epi16(acc[h], _mm256_add_epi16(_mm256_maddubs_epi16(l, xa), _mm256_maddubs_epi16(u, xb)));
        res[h] = _mm256_add_epi16(res[h], _mm256_add_epi16(_mm256_maddubs_epi16(l, ra), _mm256_maddubs_epi16(u, rb)));
#endif
      }
    }
    const __m256 scale = _mm256_set1_ps(dx[g] * (1.f / 256.f)), sum = _mm256_set1_ps(sx[g]);
    for (int h = 0; h < 2; ++h) {
#if defined(__AVXVNNI__)
      const __m256i both = _mm256_add_epi32(_mm256_slli_epi32(acc[h], 8), res[h]);
#else
      const __m256i both = _mm256_add_epi32(_mm256_madd_epi16(acc[h], k256), _mm256_madd_epi16(res[h], ones));
#endif
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 8 * h)));
      const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + g * 32 + 16 + 8 * h)));
      o[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(both), _mm256_mul_ps(d, scale), o[h]);
      o[h] = _mm256_fmadd_ps(z, sum, o[h]);
    }
  }
  _mm256_storeu_ps(out, o[0]);
  _mm256_storeu_ps(out + 8, o[1]);
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
  static constexpr bool CODE_SUMS = false, TILES = true;
  static void block(const uint8_t* w, const c10::Half* dm, const Activations& a, float* out) {
    block4(w, dm, a.xq.data(), a.xr.data(), a.wide ? a.x16.data() : nullptr, a.dx.data(), a.sx.data(),
           a.M, a.K, out, a.amx, a.far);
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
// MB rows of x (xq, xr, dx and the code sums sq, sr from their first) against one block: as
// block4_rows, each row's outputs in a register over all groups, the weights read AHEAD early.
template <int MB>
inline void block8_rows(const uint8_t* w, const c10::Half* ds, const int8_t* xq, const int8_t* xr, const float* dx,
                        const int32_t* sq, const int32_t* sr, int64_t K, float* out, bool far) {
  const int64_t G = K / GROUP;
  __m512 o[MB];
  for (int i = 0; i < MB; ++i) o[i] = _mm512_loadu_ps(out + i * ROWS);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * 512;
    prefetch(wp + AHEAD * 512, 512, far);
    prefetch(ds + (g + AHEAD) * 16, 32, far);
    __m512i v[8];
    for (int c = 0; c < 8; ++c) v[c] = _mm512_loadu_si512(wp + c * 64);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ds + g * 16)));
    for (int i = 0; i < MB; ++i) {
      const int8_t* xp = xq + i * K + g * GROUP;
      const int8_t* rp = xr + i * K + g * GROUP;
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      __m512i r0 = _mm512_setzero_si512(), r1 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        a0 = _mm512_dpbusd_epi32(a0, v[c], bcast4(xp + 4 * c));
        a1 = _mm512_dpbusd_epi32(a1, v[c + 1], bcast4(xp + 4 * c + 4));
        r0 = _mm512_dpbusd_epi32(r0, v[c], bcast4(rp + 4 * c));
        r1 = _mm512_dpbusd_epi32(r1, v[c + 1], bcast4(rp + 4 * c + 4));
      }
      // 256·(<q+128, xq> − 128·Σxq) + <q+128, xr> − 128·Σxr: |.| < 2^29
      const int32_t offset = 128 * (256 * sq[i * G + g] + sr[i * G + g]);
      const __m512i both = _mm512_sub_epi32(
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a0, a1), 8), _mm512_add_epi32(r0, r1)),
          _mm512_set1_epi32(offset));
      o[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(d, _mm512_set1_ps(dx[i * G + g] * (1.f / 256.f))),
                             o[i]);
    }
  }
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out + i * ROWS, o[i]);
}
#endif

void block8(const uint8_t* w, const c10::Half* ds, const int8_t* xq, const int8_t* xr, const int16_t* x16,
            const float* dx, const int32_t* sq, const int32_t* sr, int64_t M, int64_t K, float* out,
            bool far) {
  const int64_t G = K / GROUP;
  (void)x16;  // read by the AVX2 path only
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
  if (M == 1) {  // one row: the 16 outputs stay in a register over all groups, weights prefetched
    __m512 o = _mm512_loadu_ps(out);
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wp = w + g * 512;
      prefetch(wp + AHEAD * 512, 512, far);
      prefetch(ds + (g + AHEAD) * 16, 32, far);
      const int8_t* xp = xq + g * GROUP;
      const int8_t* rp = xr + g * GROUP;
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      __m512i r0 = _mm512_setzero_si512(), r1 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        const __m512i v0 = _mm512_loadu_si512(wp + c * 64), v1 = _mm512_loadu_si512(wp + c * 64 + 64);
        a0 = _mm512_dpbusd_epi32(a0, v0, bcast4(xp + 4 * c));
        a1 = _mm512_dpbusd_epi32(a1, v1, bcast4(xp + 4 * c + 4));
        r0 = _mm512_dpbusd_epi32(r0, v0, bcast4(rp + 4 * c));
        r1 = _mm512_dpbusd_epi32(r1, v1, bcast4(rp + 4 * c + 4));
      }
      const int32_t offset = 128 * (256 * sq[g] + sr[g]);  // as the rows below
      const __m512i both = _mm512_sub_epi32(
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a0, a1), 8), _mm512_add_epi32(r0, r1)),
          _mm512_set1_epi32(offset));
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ds + g * 16)));
      o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(d, _mm512_set1_ps(dx[g] * (1.f / 256.f))), o);
    }
    _mm512_storeu_ps(out, o);
    return;
  }
  in_eights(M, [&](int64_t m0, auto mb) {  // up to 8 rows at a time, their outputs in registers
    block8_rows<decltype(mb)::value>(w, ds, xq + m0 * K, xr + m0 * K, dx + m0 * G, sq + m0 * G, sr + m0 * G, K,
                                     out + m0 * ROWS, far);
  });
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
#if defined(__AVXVNNI__)
            p = _mm256_dpwssd_avx_epi32(p, wv[h][c][0], xa[c]);
            q = _mm256_dpwssd_avx_epi32(q, wv[h][c][1], xa[c]);
#else
            p = _mm256_add_epi32(p, _mm256_madd_epi16(wv[h][c][0], xa[c]));
            q = _mm256_add_epi32(q, _mm256_madd_epi16(wv[h][c][1], xa[c]));
#endif
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
  // One row (M = 1): the 16 rows' outputs stay in registers over all groups.
  __m256 o[2] = {_mm256_loadu_ps(out), _mm256_loadu_ps(out + 8)};
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wp = w + g * 512;
    prefetch(wp + AHEAD * 512, 512, far);
    prefetch(ds + (g + AHEAD) * 16, 32, far);
    int32_t xw[8], rw[8];
    std::memcpy(xw, xq + g * GROUP, sizeof(xw));
    std::memcpy(rw, xr + g * GROUP, sizeof(rw));
    __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    __m256i res[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int c = 0; c < 8; ++c) {
      const __m256i xb = _mm256_set1_epi32(xw[c]), rb = _mm256_set1_epi32(rw[c]);
      const __m256i xa = _mm256_abs_epi8(xb), ra = _mm256_abs_epi8(rb);
      for (int h = 0; h < 2; ++h) {  // rows 0-7, rows 8-15
        // signed weights; |x| times w with x's sign (llama.cpp's trick): pairs <= 32,258 in int16
        const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + c * 64 + h * 32)), flip);
#if defined(__AVXVNNI__)  // the same products, 4-byte sums straight into int32
        acc[h] = _mm256_dpbusd_avx_epi32(acc[h], xa, _mm256_sign_epi8(ws, xb));
        res[h] = _mm256_dpbusd_avx_epi32(res[h], ra, _mm256_sign_epi8(ws, rb));
#else
        acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(ws, xb)), ones));
        res[h] = _mm256_add_epi32(res[h], _mm256_madd_epi16(_mm256_maddubs_epi16(ra, _mm256_sign_epi8(ws, rb)), ones));
#endif
      }
    }
    const __m256 scale = _mm256_set1_ps(dx[g] * (1.f / 256.f));
    for (int h = 0; h < 2; ++h) {
      const __m256i both = _mm256_add_epi32(_mm256_slli_epi32(acc[h], 8), res[h]);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + g * 16 + 8 * h)));
      o[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(both), _mm256_mul_ps(d, scale), o[h]);
    }
  }
  _mm256_storeu_ps(out, o[0]);
  _mm256_storeu_ps(out + 8, o[1]);
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
  static constexpr bool CODE_SUMS = true, TILES = false;
  static void block(const uint8_t* w, const c10::Half* ds, const Activations& a, float* out) {
    block8(w, ds, a.xq.data(), a.xr.data(), a.wide ? a.x16.data() : nullptr, a.dx.data(), a.sq.data(),
           a.sr.data(), a.M, a.K, out, a.far);
  }
};

// The ops: torch calls these (schemas below).
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dm) { return qmatmul<Q4>(x, w, dm); }
at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ds) { return qmatmul<Q8>(x, w, ds); }

// The code path the 4-bit products take here: PATH, with "+amx" where several rows take AMX tiles.
std::string int4_path() {
#if QKV_AMX
  if (amx_ready()) return std::string(PATH) + "+amx";
#endif
  return PATH;
}


// ---------------------------------------------------------------- one token through a whole decoder
//
// qkv::Decoder: a decoder-only Transformer's one-token step (the eager model's arithmetic, written
// out once more for speed: tests hold it to the eager model, qkv/generation/native_step.py binds
// it). One token costs the eager model ~1,460 dispatched PyTorch operations; a saved (AOTInductor)
// step still allocates, dispatches and joins threads between them (measured: ~45% of a saved
// step's token was not the weights' products). Here the threads enter one parallel region per
// token and meet at barriers, five per layer (six where a head is not whole blocks of 16):
//
//   h = rmsnorm(x)·w1                       each thread (576 values: cheaper than a barrier)
//   [q | k | v] = h Wqkvᵀ (+ b)             whole heads claimed by the threads, each rotating
//                                           (RoPE, rotate-half) the q and k heads it computed, k and v
//                                           into the cache at pos                          | barrier
//   o_h = softmax(q_h·Kᵀ/√D)·V, per head    in two halves of the positions, the (kv head, half, query
//                                           head) units shared among threads              | barrier
//                                           each thread merging every head's halves (flash-decoding)
//   x += o Woᵀ (+ b)                        output blocks claimed, each thread adding those | barrier
//   h = rmsnorm(x)·w2; g|u = h Wguᵀ         each claim the gate blocks and the up blocks of one range
//   a = silu(g)·u                           on that range, by the thread that claimed it (one
//                                           row: a quantized there too, once)              | barrier
//   x += a Wdᵀ                              output blocks claimed                          | barrier
//
// (a product's units claimed as the threads come for them: each starts on its own share, then
// takes what is left of the others'; see claimed) then the final norm, the 8-bit head (its blocks
// of 128 logits claimed) and, where the model's head keeps
// its top logits exact (TopKRefinedLinear), the k largest recomputed in fp32 from the float matrix.
// Every product is the very block kernel int4_mm/q8_mm run (block4, block8) on activations
// quantised the same way, so a product's outputs are the ops'; the float work between them
// (norms, RoPE, softmax) sums in another order than PyTorch's: ~1e-6 relative.
// Lectures: CS189 Lec 21-22 (one query against every cached key), CS231N Lec 8.

// e^x for float32, vectorisable (Cephes' expf: range reduction by ln 2, degree-6 polynomial;
// ~1 ulp on [-87, 88], 0 below).
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Σ a·b, Σ a and max a over n floats: in vector lanes (explicitly: GCC leaves a 16-float lane
// array's maximum scalar), the lanes reduced as a tree, then the tail. max ignores a NaN, as
// std::max keeps its first operand (and as maxps returns its second: the running maximum).
#if defined(__AVX512F__)
// four accumulators: a long sum waits on the adder's latency with one
#define QKV_LANES4(OP, INIT, LOAD, REDUCE, TAIL)                                      \
  __m512 acc0 = INIT, acc1 = INIT, acc2 = INIT, acc3 = INIT;                          \
  int64_t i = 0;                                                                      \
  for (; i + 64 <= n; i += 64) {                                                      \
    acc0 = OP(LOAD(i), acc0), acc1 = OP(LOAD(i + 16), acc1);                          \
    acc2 = OP(LOAD(i + 32), acc2), acc3 = OP(LOAD(i + 48), acc3);                     \
  }                                                                                   \
  for (; i + 16 <= n; i += 16) acc0 = OP(LOAD(i), acc0);                              \
  float s = REDUCE(OP(OP(acc0, acc1), OP(acc2, acc3)));                               \
  for (; i < n; ++i) TAIL;                                                            \
  return s;
inline float dot(const float* a, const float* b, int64_t n) {
#define LOAD_AB(i) _mm512_mul_ps(_mm512_loadu_ps(a + (i)), _mm512_loadu_ps(b + (i)))
  QKV_LANES4(_mm512_add_ps, _mm512_setzero_ps(), LOAD_AB, _mm512_reduce_add_ps, s += a[i] * b[i])
#undef LOAD_AB
}
inline float sum_of(const float* a, int64_t n) {
#define LOAD_A(i) _mm512_loadu_ps(a + (i))
  QKV_LANES4(_mm512_add_ps, _mm512_setzero_ps(), LOAD_A, _mm512_reduce_add_ps, s += a[i])
}
inline float max_of(const float* a, int64_t n) {
  const __m512 low = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  QKV_LANES4(_mm512_max_ps, low, LOAD_A, _mm512_reduce_max_ps, s = s < a[i] ? a[i] : s)
#undef LOAD_A
}
// The first i < n with a[i] == v, or n.
inline int64_t first_equal(const float* a, int64_t n, float v) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(a + i), _mm512_set1_ps(v), _CMP_EQ_OQ);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
  for (; i < n && a[i] != v; ++i) {}
  return i;
}
// f(i) for every i < n with a[i] >= v (a NaN is not), in order.
template <class F>
inline void each_at_least(const float* a, int64_t n, float v, F&& f) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (__mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(a + i), _mm512_set1_ps(v), _CMP_GE_OQ); hit != 0;
         hit &= hit - 1)
      f(i + __builtin_ctz(hit));
  for (; i < n; ++i)
    if (a[i] >= v) f(i);
}
#undef QKV_LANES4
#elif defined(__AVX2__) && defined(__FMA__)
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum8(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}
inline float sum_of(const float* a, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(_mm256_loadu_ps(a + i), acc);
  float s = hsum8(acc);
  for (; i < n; ++i) s += a[i];
  return s;
}
inline float max_of(const float* a, int64_t n) {
  __m256 acc = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(_mm256_loadu_ps(a + i), acc);
  float m = hmax8(acc);
  for (; i < n; ++i) m = m < a[i] ? a[i] : m;
  return m;
}
inline int64_t first_equal(const float* a, int64_t n, float v) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(a + i), _mm256_set1_ps(v), _CMP_EQ_OQ));
    if (hit != 0) return i + __builtin_ctz(hit);
  }
  for (; i < n && a[i] != v; ++i) {}
  return i;
}
template <class F>
inline void each_at_least(const float* a, int64_t n, float v, F&& f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(a + i), _mm256_set1_ps(v), _CMP_GE_OQ));
         hit != 0; hit &= hit - 1)
      f(i + __builtin_ctz(hit));
  for (; i < n; ++i)
    if (a[i] >= v) f(i);
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float lane[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lane[j] += a[i + j] * b[i + j];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  float s = lane[0];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}
inline float sum_of(const float* a, int64_t n) {
  float lane[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lane[j] += a[i + j];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  float s = lane[0];
  for (; i < n; ++i) s += a[i];
  return s;
}
inline float max_of(const float* a, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = m < a[i] ? a[i] : m;
  return m;
}
inline int64_t first_equal(const float* a, int64_t n, float v) {
  int64_t i = 0;
  for (; i < n && a[i] != v; ++i) {}
  return i;
}
template <class F>
inline void each_at_least(const float* a, int64_t n, float v, F&& f) {
  for (int64_t i = 0; i < n; ++i)
    if (a[i] >= v) f(i);
}
#endif

// One query's scores against n cached keys: s[p] = (q·K_p)·scale, K (n, D) rows. A key's dot
// product ends in a sum across a vector's lanes; done one key at a time that sum is most of the
// arithmetic (D = 64: four multiply-adds, then eight shuffles and adds). Keys are taken a
// vector's width at a time instead and their lane sums made together, as a transpose: ~3
// instructions a key (Lanes::W keys: one vector of scores). Measured on SmolLM2 at positions
// 32-160 (issue 53): attention ~240 -> ~205 µs of a ~2.5 ms token on one thread; what is left
// is reading the float32 cache from L3 (the weights streamed since evict it; asking for it
// early, beside the gate|up product, cost that product more than it saved: tried, not kept).
// Lanes: this build's float vector (AVX-512: 16 floats, AVX2: 8) and what attention asks of it;
// sums(v) takes W vectors to one whose lane j is the sum of v[j]'s lanes.
#if defined(__AVX512F__)
#define QKV_LANES 1
struct Lanes {
  using V = __m512;
  static constexpr int64_t W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V sums(const V* v) {
    V t[8], u[4], w[2];
    for (int k = 0; k < 8; ++k)  // each 128-bit lane: pairs of v[2k], v[2k+1] half summed
      t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; ++k)  // each 128-bit lane: v[4k..4k+4)'s sums over that lane
      u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 2; ++k)  // the 128-bit lanes summed in pairs
      w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define QKV_LANES 1
struct Lanes {
  using V = __m256;
  static constexpr int64_t W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V sums(const V* v) {
    const V u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const V u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};
#else
#define QKV_LANES 0
#endif

#if QKV_LANES
// Lanes::W keys' scores, one vector of them (D a multiple of W)
inline void key_scores(const float* q, const float* K, int64_t D, float scale, float* s) {
  Lanes::V acc[Lanes::W];
  for (int64_t j = 0; j < Lanes::W; ++j) {
    const float* k = K + j * D;
    Lanes::V a = Lanes::mul(Lanes::load(q), Lanes::load(k));
    for (int64_t c = Lanes::W; c < D; c += Lanes::W) a = Lanes::fma(Lanes::load(q + c), Lanes::load(k + c), a);
    acc[j] = a;
  }
  Lanes::store(s, Lanes::mul(Lanes::sums(acc), Lanes::set1(scale)));
}
#endif

inline void scores(const float* q, const float* K, int64_t n, int64_t D, float scale, float* s) {
  int64_t p = 0;
#if QKV_LANES
  if (D % Lanes::W == 0)
    for (; p + Lanes::W <= n; p += Lanes::W) key_scores(q, K + p * D, D, scale, s + p);
#endif
  for (; p < n; ++p) s[p] = dot(q, K + p * D, D) * scale;
}

// out_i = Σ_p w[i·n + p]·V_p for r query heads (out (r, D), V (n, D) rows): each value row read
// once for the r heads; the r heads' sums of a vector's width of columns held in registers
// over all n rows (up to 8 heads at a time).
inline void weighted_values(const float* w, int64_t r, const float* V, int64_t n, int64_t D, float* out) {
#if QKV_LANES
  if (D % Lanes::W == 0) {
    for (int64_t i0 = 0; i0 < r; i0 += 8) {
      const int64_t m = std::min<int64_t>(8, r - i0);
      for (int64_t c = 0; c < D; c += Lanes::W) {
        Lanes::V acc[8];
        for (int64_t i = 0; i < m; ++i) acc[i] = Lanes::zero();
        for (int64_t p = 0; p < n; ++p) {
          const Lanes::V v = Lanes::load(V + p * D + c);
          for (int64_t i = 0; i < m; ++i) acc[i] = Lanes::fma(Lanes::set1(w[(i0 + i) * n + p]), v, acc[i]);
        }
        for (int64_t i = 0; i < m; ++i) Lanes::store(out + (i0 + i) * D + c, acc[i]);
      }
    }
    return;
  }
#endif
  std::fill(out, out + r * D, 0.f);
  for (int64_t p = 0; p < n; ++p)
    for (int64_t i = 0; i < r; ++i) {
      const float wi = w[i * n + p];
      for (int64_t d = 0; d < D; ++d) out[i * D + d] += wi * V[p * D + d];
    }
}

// y = x·w / sqrt(mean(x²) + eps), float32 (PyTorch's rms_norm).
inline void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  const float ss = dot(x, x, n);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

// Thread t's share [first, last) of n items among T threads.
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int T) {
  return {n * t / T, n * (t + 1) / T};
}

// Blocks [b0, b1) of 16 outputs of one product with a's M rows: y[m·N + 16b .. m·N + 16b + 16) (+ bias).
template <class Format>
inline void product_blocks(const uint8_t* w, const c10::Half* s, const Activations& a, int64_t b0, int64_t b1,
                           float* y, int64_t N, const float* bias) {
  const int64_t G = a.G, M = a.M;
  float small[16 * ROWS];
  thread_local std::vector<float> large;
  if (M > 16) large.resize(M * ROWS);
  float* out = M > 16 ? large.data() : small;
  for (int64_t b = b0; b < b1; ++b) {
    std::fill(out, out + M * ROWS, 0.f);
    Format::block(w + b * G * Format::CHUNKS * 64, s + b * G * Format::SCALES, a, out);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < ROWS; ++j)
        y[m * N + b * ROWS + j] = bias != nullptr ? out[m * ROWS + j] + bias[b * ROWS + j] : out[m * ROWS + j];
  }
}

// The start of a thread's share of its next product asked for (its first weights into L1, their
// scales into L2) just before it waits at a barrier: a product starts cold (its first groups
// miss until the prefetchers ramp up) and the wait is idle time. Blocks from b of a product of
// G groups. Measured in one process against the step without it (issue 53): 2 KB 0.8% faster a
// token, 1 KB 0.5%; 4 KB into L2 0.7% slower.
template <class Format>
inline void warm(const uint8_t* w, const c10::Half* s, int64_t G, int64_t b) {
  const char* p = reinterpret_cast<const char*>(w + b * G * Format::CHUNKS * 64);
  for (int64_t i = 0; i < WARM_BYTES; i += 64) __builtin_prefetch(p + i, 0, 3);
  const char* q = reinterpret_cast<const char*>(s + b * G * Format::SCALES);
  for (int64_t i = 0; i < WARM_BYTES / 8; i += 64) __builtin_prefetch(q + i, 0, 2);
}

// x (D,) at position pos rotated by RoPE's rotate-half pairing (i, i + D/2): cos, sin (P, D).
inline void rope(const float* x, const float* cos, const float* sin, int64_t D, float* y) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) {
    y[i] = x[i] * cos[i] - x[i + h] * sin[i];
    y[i + h] = x[i + h] * cos[i + h] + x[i] * sin[i + h];
  }
}

// The threads of one step meet here between its phases: a counter and a phase word in cache
// lines of their own; the last to arrive starts the next phase, the others spin on it, a pause a
// turn, and yield the core after 256 turns (~10 µs on a Xeon, whose pause is ~140 cycles; a wait
// between phases is a few µs): another thread or process may hold the core this one waits for.
// Measured with two decoding processes on 2 cores: yielding after 65,536 turns took ~200 ms a
// token, after 256 turns 8-16 ms, OpenMP's own barrier 16-19 ms (BENCHMARKS.md, issue 53).
struct Barrier {
  alignas(64) std::atomic<int> count{0};
  alignas(64) std::atomic<int> phase{0};
  void wait(int n) {
    const int ph = phase.load(std::memory_order_relaxed);
    if (count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count.store(0, std::memory_order_relaxed);
      phase.store(ph + 1, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; phase.load(std::memory_order_acquire) == ph; ++spins) {
#if defined(__x86_64__) || defined(__i386__)
      _mm_pause();
#endif
      if (spins > 256) std::this_thread::yield();
    }
  }
};

// Where the decoder's step spends its time, by phase and thread, where asked for (Decoder::profile):
// each thread reads the clock at the end of each phase and adds the time since its last reading
// to that phase. Off, a phase's end costs a branch; on, a clock read (~23 ns on the Emerald Rapids
// Xeon; 14 a layer, 15 where a head is not whole blocks of 16, and 2 a token).
// The phases, in the order of a layer (qkv/generation/native_step.py: PROFILE_PHASES names them):
enum Phase : int {
  NORM1,       // the first norm and the activations quantized
  QKV,         // the q|k|v product, the heads rotated and placed into the cache
  WAIT_QKV,    // at the barrier after it
  ATTENTION,   // each thread's pieces of softmax(q·Kᵀ/√D)·V
  WAIT_ATT,    // at the barrier after them
  MERGE,       // the pieces merged into heads, quantized
  OUT,         // the out product and the residual
  WAIT_OUT,    // at the barrier after it
  NORM2,       // the second norm, quantized
  GATE_UP,     // the gate|up product and SwiGLU
  WAIT_GATE_UP,
  QUANT_MLP,   // SwiGLU's outputs quantized (rows of a running batch; one row's, in gate|up)
  DOWN,        // the down product and the residual
  WAIT_DOWN,
  FINAL,       // (a token) the final norm, quantized
  HEAD,        // (a token) the int8 head's product, its blocks' maxima and NaN check
  SERIAL,      // (a token, thread 0) the embedding, the threads' start and join, top-k and argmax
  PHASES
};
constexpr int PROFILE_STRIDE = 32;  // doubles a thread's row (256 bytes: rows far apart)
static_assert(PHASES <= PROFILE_STRIDE, "a thread's row holds every phase");
struct Stopwatch {
  bool on;
  double* seconds;  // this thread's row
  int64_t* count;
  std::chrono::steady_clock::time_point last;
  Stopwatch(bool on_, double* s, int64_t* n) : on(on_), seconds(s), count(n) {
    if (on) last = std::chrono::steady_clock::now();
  }
  void mark(Phase p) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    seconds[p] += std::chrono::duration<double>(now - last).count();
    ++count[p];
    last = now;
  }
};

// A product's units (blocks of 16 outputs, heads, gate|up's groups of 32 outputs, or the head's
// blocks of 128 logits) shared among
// the step's threads as they go: each thread starts on its own share, share(n, t, T), and claims
// it a piece at a time (a third of what is left, at least one unit) from its own word; a thread
// done with its share claims what is left of the others' (each claim a compare-and-swap on that
// thread's word). A core slower for the moment (another process, the host) is helped instead of
// waited for; a unit is computed by one thread whichever, by the same code, so the floats are the
// same. A word holds the product's number (epoch, counted alike by every thread) and the next
// unclaimed unit: a word still of an earlier product stands for its share's start, so nothing is
// reset between products. Measured against fixed shares (benchmarks/busy_core.py, issue 53):
// 1.03x the tokens/s idle, 1.08x beside another process spinning on half of one core.
struct alignas(64) Claim {
  std::atomic<uint64_t> word{0};
};
// units of a product < 2^24 (the decoder checks its shapes); the epoch in the word's other 40 bits,
// counted modulo 2^40: a word 2^40 products old would read as current (~250 days of decoding at
// 50,000 products a second, and only the word of a thread whose share held no unit all that time)
constexpr int CLAIM_BITS = 24;
constexpr uint64_t CLAIM_UNITS = uint64_t{1} << CLAIM_BITS, CLAIM_EPOCHS = uint64_t{1} << (64 - CLAIM_BITS);
inline bool claim(Claim& c, uint64_t epoch, int64_t start, int64_t end, int64_t& i, int64_t& n) {
  epoch &= CLAIM_EPOCHS - 1;
  uint64_t v = c.word.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t at = (v >> CLAIM_BITS) == epoch ? static_cast<int64_t>(v & (CLAIM_UNITS - 1)) : start;
    if (at >= end) return false;
    const int64_t k = std::max<int64_t>(1, (end - at) / 3);
    if (c.word.compare_exchange_weak(v, (epoch << CLAIM_BITS) | static_cast<uint64_t>(at + k),
                                     std::memory_order_relaxed, std::memory_order_relaxed)) {
      i = at, n = k;
      return true;
    }
  }
}
// f(u0, u1) for every piece [u0, u1) of n units thread t of T claims in the product of this epoch,
// from share (t + first) % T on (first: 0, its own; a test's 1: each thread starts on another's).
template <class F>
inline void claimed(Claim* claims, uint64_t epoch, int64_t n, int t, int T, int first, F&& f) {
  for (int j = 0; j < T; ++j) {
    const int o = (t + first + j) % T;
    const auto [start, end] = share(n, o, T);
    int64_t i = 0, k = 0;
    while (claim(claims[o], epoch, start, end, i, k)) f(i, i + k);
  }
}

struct DecoderLayer {
  const float *norm1 = nullptr, *norm2 = nullptr;
  const uint8_t *wqkv = nullptr, *wo = nullptr, *wgu = nullptr, *wd = nullptr;
  const c10::Half *sqkv = nullptr, *so = nullptr, *sgu = nullptr, *sd = nullptr;
  const float *bqkv = nullptr, *bo = nullptr;  // nullptr: no bias
};

// x (M, V) float32 -> (M,) int64: each row's first largest entry, as torch.argmax (a NaN counts as
// the largest: the first NaN). A sum (a NaN, or +inf beside -inf, makes it NaN: then a plain scan
// decides) and the maximum in vector lanes, then the first entry equal to it. Greedy
// decoding's choice from a 49,152-token row: ~7 µs from Python, where PyTorch's argmax takes ~80 µs and the
// two-pass argmax of qkv/nn/top.py ~23 µs (four dispatched operations).
// torch.argmax of a (n,) entry by entry, in its order: the first NaN, else the first largest.
inline int64_t argmax_scan(const float* a, int64_t n) {
  int64_t at = 0;
  float m = a[0];
  for (int64_t i = 1; i < n && !std::isnan(m); ++i)
    if (std::isnan(a[i]) || a[i] > m) m = a[i], at = i;
  return at;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "qkv::argmax_rows: x must be (M, V) float32, contiguous, V > 0");
  const int64_t M = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    const float* a = x.data_ptr<float>() + r * V;
    // a NaN (or +inf beside -inf) makes the sum NaN: then torch.argmax's order, entry by entry
    o[r] = std::isnan(sum_of(a, V)) ? argmax_scan(a, V) : first_equal(a, V, max_of(a, V));
  }
  return out;
}

// Sampling's draw, a row at a time: what qkv.generation.sampling.sample_next computes in PyTorch
// (logits / T; top-k keeps every logit >= the k-th largest; top-p drops a token when the tokens
// before it in descending order already hold p of the kept mass, the first always stays; the id
// whose interval of the kept weights' cumulative sum, float64 in id order, holds u times their
// total), in one call on the calling thread. On SmolLM2's 49,152 logits at T 0.8 and top-k 200
// PyTorch's ops take 80-100 µs on its own rows, 535 µs on a N(0, 9) row (topk over the row,
// softmax, a float64 cumsum; with top-p a sort of the whole row: up to ~5 ms); this, 16-61 µs. Here the row's blocks of 128 are read once for their maxima; the k-th
// largest block maximum bounds the k-th largest logit from below (k blocks hold a logit at least
// that large), so only the blocks reaching it are read again. max commutes with / T (rounding is
// monotone): blocks are chosen on the logits, and only their entries are divided.
struct SampleScratch {
  std::vector<float> bmax, z, w, tmp;
  std::vector<double> bsum;
  std::vector<int32_t> id;
  std::vector<uint64_t> order;
  void take(int64_t i, float zi) { id.push_back(static_cast<int32_t>(i)), z.push_back(zi); }
};

// Σ w over n floats in float64, eight lanes (vectorised; a long sum in one would wait on the adder).
inline double sum64(const float* w, int64_t n) {
  double lane[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += w[i + l];
  double t = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
  for (; i < n; ++i) t += w[i];
  return t;
}

// Σ w[i] over the i < n with z[i] >= t, in float64 lanes.
inline double mass_at_least(const float* w, const float* z, int64_t n, float t) {
  double lane[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += z[i + l] >= t ? w[i + l] : 0.f;
  double s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
  for (; i < n; ++i) s += z[i] >= t ? w[i] : 0.f;
  return s;
}

// f(i) for each i in [from, to) with x[i] >= t, in order: a vector compared at a time (most
// entries of a logits row are below such a bound: a branch an entry would mostly be the loop).
template <class F>
inline void each_at_least(const float* x, int64_t from, int64_t to, float t, F&& f) {
  int64_t i = from;
#if defined(__AVX512F__)
  for (const __m512 vt = _mm512_set1_ps(t); i + 16 <= to; i += 16)
    for (__mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vt, _CMP_GE_OQ); hit; hit &= hit - 1)
      f(i + __builtin_ctz(hit));
#elif defined(__AVX2__)
  for (const __m256 vt = _mm256_set1_ps(t); i + 8 <= to; i += 8)
    for (int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vt, _CMP_GE_OQ)); hit; hit &= hit - 1)
      f(i + __builtin_ctz(hit));
#endif
  for (; i < to; ++i)
    if (x[i] >= t) f(i);
}

// Appends (i, a[i] / T) for each i in [from, to) with a[i] / T >= t: the logits at or above lo,
// a bound below t·T, then divided (a division a vector took most of this op's time).
inline void take_at_least(const float* a, int64_t from, int64_t to, float T, float t, float lo, SampleScratch& s) {
  each_at_least(a, from, to, lo, [&](int64_t j) {
    if (a[j] / T >= t) s.take(j, a[j] / T);  // IEEE division: the quotient PyTorch's division gives
  });
}

// The id drawn from the row a (V) with u in [0, 1), or -1 where PyTorch's softmax is not a
// distribution (a NaN, +inf, a logit / T overflowing, every logit -inf; or T past float32's range,
// where PyTorch divides by inf): sample_next then takes PyTorch's path, which says what is wrong,
// or draws with the same u. k <= 0 or k >= V: no top-k; p <= 0 or p >= 1: no top-p.
inline int64_t sample_row(const float* a, int64_t V, float T, int64_t k, double p, double u, SampleScratch& s) {
  constexpr int64_t B = 128;
  if (!std::isfinite(T)) return -1;  // T past float's range: PyTorch's path (z = a / inf)
  const int64_t nb = (V + B - 1) / B;
  s.bmax.resize(nb);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < nb; ++b) {  // the block's sum from L1 after its maximum: one pass
    const int64_t len = std::min(B, V - b * B);
    s.bmax[b] = max_of(a + b * B, len) / T;
    if (std::isnan(sum_of(a + b * B, len)))  // a NaN, or lanes overflowing to +inf and -inf: look
      for (int64_t i = b * B; i < b * B + len; ++i)
        if (std::isnan(a[i])) return -1;  // (+inf itself makes m +inf below)
    m = std::max(m, s.bmax[b]);
  }
  if (!std::isfinite(m)) return -1;
  const bool every = !(k > 0 && k < V);  // every id a candidate: id[j] = j, not stored
  s.id.clear(), s.z.clear();
  if (!every) {
    float t0 = -std::numeric_limits<float>::infinity();
    if (k <= nb) {  // the k-th largest block maximum: at most k-1 blocks lie above it
      s.tmp.assign(s.bmax.begin(), s.bmax.end());
      std::nth_element(s.tmp.begin(), s.tmp.begin() + (k - 1), s.tmp.end(), std::greater<float>());
      t0 = s.tmp[k - 1];
    }
    // a / T rounded >= t0 needs a / T > the float below t0 (rounding is monotone), so a > that
    // float times T: exact in float64 (two floats' product), rounded to a float and stepped down.
    const float inf = std::numeric_limits<float>::infinity();
    const float lo = std::nextafter(static_cast<float>(static_cast<double>(std::nextafter(t0, -inf)) * T), -inf);
    for (int64_t b = 0; b < nb; ++b)
      if (s.bmax[b] >= t0) take_at_least(a, b * B, std::min(V, b * B + B), T, t0, lo, s);
    if (static_cast<int64_t>(s.z.size()) < k) {  // cannot happen (k blocks reach t0); were it to, all
      s.id.clear(), s.z.clear();
      take_at_least(a, 0, V, T, -inf, -inf, s);
    }
    s.tmp.assign(s.z.begin(), s.z.end());  // at least k candidates, every logit >= the k-th among them
    std::nth_element(s.tmp.begin(), s.tmp.begin() + (k - 1), s.tmp.end(), std::greater<float>());
    const float kth = s.tmp[k - 1];
    size_t n = 0;
    for (size_t j = 0; j < s.z.size(); ++j)
      if (s.z[j] >= kth) s.id[n] = s.id[j], s.z[n] = s.z[j], ++n;
    s.id.resize(n), s.z.resize(n);
  } else {
    s.z.resize(V);
    for (int64_t i = 0; i < V; ++i) s.z[i] = a[i] / T;
  }
  const int64_t n = static_cast<int64_t>(s.z.size());
  s.w.resize(n);
  // exp(z - max): 0 where it would be subnormal (< 1.2e-38 of the largest weight: as good as never)
  for (int64_t j = 0; j < n; ++j) {
    const float d = s.z[j] - m;
    s.w[j] = d < -87.3f ? 0.f : exp_approx(d);
  }
  auto id_of = [&](int64_t j) -> int64_t { return every ? j : s.id[j]; };
  if (p > 0 && p < 1) {
    // The order: descending z, ties the lower id first (PyTorch's sort leaves ties' order open),
    // as one integer key a candidate: z's bits made to order as integers, inverted, above the
    // candidate's index (candidates are in id order).
    auto key = [&](int64_t j) -> uint64_t {
      uint32_t b;
      const float zj = s.z[j] + 0.f;  // -0 as +0: a tie, as the floats compare
      std::memcpy(&b, &zj, sizeof(b));
      b ^= (b >> 31) ? 0xffffffffu : 0x80000000u;  // ascending as the floats
      return (static_cast<uint64_t>(~b) << 32) | static_cast<uint64_t>(j);
    };
    const double goal = p * sum64(s.w.data(), n);
    // Most of the order need not be looked at: where the tokens within d of the largest logit
    // already hold p·total, the nucleus ends among them (the rest come after them in the order).
    float floor = -std::numeric_limits<float>::infinity();
    for (float d : {8.f, 16.f, 32.f})
      if (mass_at_least(s.w.data(), s.z.data(), n, m - d) >= goal) {
        floor = m - d;
        break;
      }
    s.order.clear();
    each_at_least(s.z.data(), 0, n, floor, [&](int64_t j) { s.order.push_back(key(j)); });
    // The fewest first tokens in that order whose mass reaches p·total, without sorting them:
    // halve [lo, hi) around its middle until it is short, then sort it. Invariant: the mass
    // before lo (acc) < p·total, the mass before hi >= p·total (or hi is the end).
    auto weight = [&](uint64_t key_j) { return s.w[key_j & 0xffffffffu]; };
    double acc = 0;
    int64_t lo = 0, hi = static_cast<int64_t>(s.order.size());
    while (hi - lo > 32) {
      const int64_t mid = lo + (hi - lo) / 2;
      std::nth_element(s.order.begin() + lo, s.order.begin() + mid, s.order.begin() + hi);
      double left = 0;
      for (int64_t j = lo; j < mid; ++j) left += weight(s.order[j]);
      if (acc + left >= goal) hi = mid;
      else acc += left, lo = mid;
    }
    std::sort(s.order.begin() + lo, s.order.begin() + hi);
    int64_t j = lo;
    while (j < hi && acc < goal) acc += weight(s.order[j++]);
    if (j < n) {  // the rest of the order dropped (j > lo: acc < goal on entry)
      const uint64_t last = s.order[j - 1];
      for (int64_t i = 0; i < n; ++i)
        s.w[i] = key(i) > last ? 0.f : s.w[i];
    }
  }
  // The draw: the cumulative sum in blocks of 128 (each block's sum in float64 lanes), the block
  // where it passes x = u·total, then the entry in that block where a running sum passes it. The
  // block's two sums differ in order only (~1e-16): where the running one falls short of x, the
  // block's last positive weight. A zero weight is never drawn.
  constexpr int64_t C = 128;
  const int64_t nc = (n + C - 1) / C;
  std::vector<double>& bs = s.bsum;
  bs.resize(nc);
  double total = 0;
  for (int64_t c = 0; c < nc; ++c) total += (bs[c] = sum64(s.w.data() + c * C, std::min(C, n - c * C)));
  const double x = std::min(u * total, std::nextafter(total, 0.0));  // < total, always
  double cum = 0;
  for (int64_t c = 0; c < nc; ++c) {
    if (cum + bs[c] <= x) {
      cum += bs[c];
      continue;
    }
    int64_t last = -1;
    for (int64_t j = c * C, e = std::min(n, j + C); j < e; ++j) {
      if (s.w[j] <= 0.f) continue;
      last = j;
      if ((cum += s.w[j]) > x) break;
    }
    return id_of(last);  // bs[c] > 0: the block holds a positive weight
  }
  return -1;  // not reached: the blocks' sums end at total > x (the top token weighs 1)
}

// x (M, V) float32 logits, u (M,) float64 in [0, 1) -> (M,) int64 ids; a row whose softmax is not
// a distribution (see sample_row) raises c10::ValueError.
at::Tensor sample_rows(const at::Tensor& x, double temperature, int64_t top_k, double top_p, const at::Tensor& u) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "qkv::sample_rows: x must be (M, V) float32, contiguous, V > 0");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.is_contiguous() && u.size(0) == x.size(0),
              "qkv::sample_rows: u must be (M,) float64");
  TORCH_CHECK(temperature > 0 && std::isfinite(temperature), "qkv::sample_rows: temperature must be > 0");
  TORCH_CHECK(x.size(1) < std::numeric_limits<int32_t>::max(), "qkv::sample_rows: V must fit int32");
  const int64_t M = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  static thread_local SampleScratch scratch;
  const float T = temperature > std::numeric_limits<float>::max() ? std::numeric_limits<float>::infinity()
                                                                   : static_cast<float>(temperature);
  for (int64_t r = 0; r < M; ++r) {
    o[r] = sample_row(x.data_ptr<float>() + r * V, V, T, top_k, top_p, u.data_ptr<double>()[r], scratch);
    // a ValueError in Python (sample_next falls back on that type; bad arguments are RuntimeErrors)
    TORCH_CHECK_VALUE(o[r] >= 0, "qkv::sample_rows: row ", r, " is not a distribution (a NaN or an infinite "
                      "logit, or a temperature past float32's range)");
  }
  return out;
}

// In a namespace of the build's name: two builds' classes in one process are two types.
namespace QKV_NAMESPACE {

class Decoder : public torch::CustomClassHolder {
 public:
  // tensors: [token embedding (V, dim) f32, RoPE cos (P, D) f32, sin (P, D) f32, final norm (dim,),
  //           head w (V/16, dim/32, 8, 64) u8, head ds (V/16, dim/32, 16) f16, head bias (V,) or empty,
  //           exact head matrix (V, dim) f32 or empty,
  //           then per layer: norm1, wqkv, sqkv, bqkv or empty, wo, so, bo or empty, norm2, wgu, sgu, wd, sd,
  //           and optionally the head in 4 bits for greedy_step: w (V/16, dim/32, 4, 64) u8, dm (V/16, dim/32, 2, 16) f16]
  // ints: [layers, dim, heads, kv heads, head dim, mlp hidden, vocabulary, top-k (0: none), embed scale (0/1),
  //        and optionally far (0/1): the products also ask for their weights FAR groups ahead (see FAR),
  //        then first: thread t starts on share (t + first) % T (claimed; 0, its own, unless a test asks)]
  // floats: [the blocks' norm eps, the final norm's eps]
  Decoder(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, std::vector<double> floats)
      : held_(std::move(tensors)) {
    TORCH_CHECK(ints.size() >= 9 && ints.size() <= 11 && floats.size() == 2,
                "qkv::Decoder: 9 to 11 ints and 2 floats");
    far_ = ints.size() >= 10 && ints[9] != 0;
    first_ = ints.size() == 11 ? static_cast<int>(ints[10] & 63) : 0;
    L_ = ints[0], dim_ = ints[1], H_ = ints[2], KV_ = ints[3], D_ = ints[4], F_ = ints[5], V_ = ints[6];
    topk_ = ints[7], scale_ = ints[8] != 0 ? static_cast<float>(std::sqrt(static_cast<double>(dim_))) : 1.f;
    eps_ = static_cast<float>(floats[0]), eps_final_ = static_cast<float>(floats[1]);
    TORCH_CHECK(static_cast<int64_t>(held_.size()) == 8 + 12 * L_ || static_cast<int64_t>(held_.size()) == 10 + 12 * L_,
                "qkv::Decoder: ", 8 + 12 * L_, " or ", 10 + 12 * L_, " tensors");
    TORCH_CHECK(H_ % KV_ == 0 && D_ % 2 == 0 && dim_ % GROUP == 0 && F_ % ROWS == 0 && V_ % ROWS == 0 &&
                    (H_ * D_) % GROUP == 0 && F_ % GROUP == 0 && dim_ % ROWS == 0,
                "qkv::Decoder: unsupported shape");
    const int64_t Gd = dim_ / GROUP, Ga = H_ * D_ / GROUP, Gf = F_ / GROUP, nqkv = (H_ + 2 * KV_) * D_;
    TORCH_CHECK(nqkv % ROWS == 0, "qkv::Decoder: q|k|v width not a multiple of 16");
    TORCH_CHECK(std::max({nqkv, 2 * F_, V_, dim_}) / ROWS < static_cast<int64_t>(CLAIM_UNITS),
                "qkv::Decoder: a product of 2^24 blocks or more");
    auto f32 = [&](int64_t i, std::vector<int64_t> shape, bool optional = false) -> const float* {
      const at::Tensor& t = held_[i];
      if (optional && t.numel() == 0) return nullptr;
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes().vec() == shape,
                  "qkv::Decoder: tensor ", i, " must be float32 ", c10::IntArrayRef(shape));
      return t.data_ptr<float>();
    };
    auto u8 = [&](int64_t i, std::vector<int64_t> shape) -> const uint8_t* {
      const at::Tensor& t = held_[i];
      TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.sizes().vec() == shape,
                  "qkv::Decoder: tensor ", i, " must be uint8 ", c10::IntArrayRef(shape));
      return t.data_ptr<uint8_t>();
    };
    auto f16 = [&](int64_t i, std::vector<int64_t> shape) -> const c10::Half* {
      const at::Tensor& t = held_[i];
      TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.sizes().vec() == shape,
                  "qkv::Decoder: tensor ", i, " must be float16 ", c10::IntArrayRef(shape));
      return t.data_ptr<c10::Half>();
    };
    emb_ = f32(0, {V_, dim_});
    P_ = held_[1].size(0);
    cos_ = f32(1, {P_, D_}), sin_ = f32(2, {P_, D_});
    final_norm_ = f32(3, {dim_});
    hw_ = u8(4, {V_ / ROWS, Gd, Q8::CHUNKS, 64}), hs_ = f16(5, {V_ / ROWS, Gd, Q8::SCALES});
    hbias_ = f32(6, {V_}, true);
    exact_ = topk_ > 0 ? f32(7, {V_, dim_}) : nullptr;
    for (int64_t l = 0; l < L_; ++l) {
      const int64_t i = 8 + 12 * l;
      DecoderLayer y;
      y.norm1 = f32(i, {dim_});
      y.wqkv = u8(i + 1, {nqkv / ROWS, Gd, Q4::CHUNKS, 64}), y.sqkv = f16(i + 2, {nqkv / ROWS, Gd, 2, 16});
      y.bqkv = f32(i + 3, {nqkv}, true);
      y.wo = u8(i + 4, {dim_ / ROWS, Ga, Q4::CHUNKS, 64}), y.so = f16(i + 5, {dim_ / ROWS, Ga, 2, 16});
      y.bo = f32(i + 6, {dim_}, true);
      y.norm2 = f32(i + 7, {dim_});
      y.wgu = u8(i + 8, {2 * F_ / ROWS, Gd, Q4::CHUNKS, 64}), y.sgu = f16(i + 9, {2 * F_ / ROWS, Gd, 2, 16});
      y.wd = u8(i + 10, {dim_ / ROWS, Gf, Q4::CHUNKS, 64}), y.sd = f16(i + 11, {dim_ / ROWS, Gf, 2, 16});
      layers_.push_back(y);
    }
    if (static_cast<int64_t>(held_.size()) == 10 + 12 * L_) {  // the greedy steps' 4-bit head
      TORCH_CHECK(topk_ > 0, "qkv::Decoder: a 4-bit head for greedy steps needs the exact top-k");
      hw4_ = u8(8 + 12 * L_, {V_ / ROWS, Gd, Q4::CHUNKS, 64}), hs4_ = f16(9 + 12 * L_, {V_ / ROWS, Gd, 2, 16});
    }
    x_.resize(dim_), qkv_.resize(nqkv), q_.resize(H_ * D_), o_.resize(dim_);
    piece_max_.resize(2 * H_), piece_sum_.resize(2 * H_), piece_out_.resize(2 * H_ * D_);
    gu_.resize(2 * F_), a_.resize(F_), hf_.resize(dim_);
  }

  // The token `token` at position `pos` through every layer: its keys and values written into k, v
  // (layers, 1, K, S, D) at pos, its rotated queries into q (layers, 1, H, 1, D) where q is not
  // empty; returns the logits (1, 1, V).
  at::Tensor step(int64_t token, int64_t pos, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q) {
    return one_row(token, pos, k, v, q, false);
  }

  // step for greedy decoding, whose caller reads argmax() (and at most the top-k logits): the
  // approximate head's pass reads its 4-bit copy where the decoder has one (0.59 of the 8-bit
  // head's bytes), then the top-k are recomputed exactly as in step. The top-k logits are step's
  // exact ones and argmax() is theirs (unless the true largest falls out of the 4-bit pass's
  // top-k); the other logits are within the 4-bit head's error, not the 8-bit one's.
  at::Tensor greedy_step(int64_t token, int64_t pos, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q) {
    return one_row(token, pos, k, v, q, hw4_ != nullptr);
  }

  // Whether greedy_step reads a 4-bit copy of the head.
  bool greedy_head() const { return hw4_ != nullptr; }

  // A running batch's step: row m's token tokens[m] at position pos[m] (n rows, the cache's first
  // n of R), its keys and values written into row m of k, v (layers, R, K, S, D), its rotated
  // queries into q (layers, R, H, 1, D) where q is not empty; returns the logits (n, 1, V). The
  // products take the n rows at once (each weight read once for every row); a row's numbers are
  // those step gives it alone, bit for bit: the block kernels give every row of a product the
  // integers and floats it gets alone, and attention's pieces are a row's own.
  at::Tensor step_rows(const at::Tensor& tokens, const at::Tensor& pos, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& q) {
    return rows(tokens, pos, k, v, q, false);
  }

  // step_rows for rows that all decode greedily (their callers read each row's argmax and at most
  // its top-k logits): the head's first pass reads its 4-bit copy where the decoder has one (see
  // greedy_step); every row's other numbers are step_rows' own.
  at::Tensor greedy_step_rows(const at::Tensor& tokens, const at::Tensor& pos, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& q) {
    return rows(tokens, pos, k, v, q, hw4_ != nullptr);
  }

  // The index of the first largest of the last step's logits (torch.argmax), found in the step:
  // its first row's.
  int64_t argmax() const { return argmax_.empty() ? 0 : argmax_[0]; }

  // Where the steps since the last call spent their time (see Phase): (threads, PHASES, 2) float64,
  // [..., 0] seconds and [..., 1] the phase's count, a row for each thread the steps ran on (none
  // where nothing was timed); then cleared, and the steps to come timed where on.
  at::Tensor profile(bool on) {
    at::Tensor out = at::zeros({profile_threads_, PHASES, 2}, at::TensorOptions().dtype(at::kDouble));
    double* o = out.data_ptr<double>();
    for (int64_t t = 0; t < profile_threads_; ++t)
      for (int p = 0; p < PHASES; ++p) {
        o[(t * PHASES + p) * 2] = profile_seconds_[t * PROFILE_STRIDE + p];
        o[(t * PHASES + p) * 2 + 1] = static_cast<double>(profile_count_[t * PROFILE_STRIDE + p]);
      }
    std::fill(profile_seconds_.begin(), profile_seconds_.end(), 0.);
    std::fill(profile_count_.begin(), profile_count_.end(), 0);
    profile_threads_ = 0, profile_wall_ = 0.;
    profile_ = on;
    return out;
  }

 private:
  // step and greedy_step: four, the head's first pass reads its 4-bit copy.
  at::Tensor one_row(int64_t token, int64_t pos, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q,
                     bool four) {
    check_cache(k, v, q, 1);
    TORCH_CHECK(k.size(1) == 1, "qkv::Decoder: step takes a one-row cache (layers, 1, K, S, D); rows of a "
                "running batch: step_rows");
    check_row(token, pos, k.size(3));
    at::Tensor logits = at::empty({1, 1, V_}, k.options());
    run(1, &token, &pos, 1, k.size(3), k.data_ptr<float>(), v.data_ptr<float>(),
        q.numel() > 0 ? q.data_ptr<float>() : nullptr, logits.data_ptr<float>(), four);
    return logits;
  }

  // step_rows and greedy_step_rows: four, the head's first pass reads its 4-bit copy.
  at::Tensor rows(const at::Tensor& tokens, const at::Tensor& pos, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& q, bool four) {
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
                    tokens.device().is_cpu() && pos.dim() == 1 && pos.scalar_type() == at::kLong &&
                    pos.is_contiguous() && pos.device().is_cpu() && pos.size(0) == tokens.size(0) &&
                    tokens.size(0) >= 1,
                "qkv::Decoder: tokens and positions must be (n,) int64 on the CPU, n >= 1");
    const int64_t n = tokens.size(0);
    check_cache(k, v, q, n);
    const int64_t* tok = tokens.data_ptr<int64_t>();
    const int64_t* where = pos.data_ptr<int64_t>();
    for (int64_t m = 0; m < n; ++m) check_row(tok[m], where[m], k.size(3));
    at::Tensor logits = at::empty({n, 1, V_}, k.options());
    run(n, tok, where, k.size(1), k.size(3), k.data_ptr<float>(), v.data_ptr<float>(),
        q.numel() > 0 ? q.data_ptr<float>() : nullptr, logits.data_ptr<float>(), four);
    return logits;
  }

  // k, v: float32 (layers, R, K, S, D), contiguous, R >= n rows; q: empty or (layers, R, H, 1, D).
  void check_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& q, int64_t n) const {
    for (const at::Tensor* c : {&k, &v})
      TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous() && c->device().is_cpu() && c->dim() == 5 &&
                      c->size(0) == L_ && c->size(1) >= n && c->size(2) == KV_ && c->size(4) == D_ &&
                      c->sizes() == k.sizes(),
                  "qkv::Decoder: the cache must be float32 (layers, rows, K, S, D) on the CPU, contiguous, ", n,
                  " rows or more");
    if (q.numel() > 0)
      TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.device().is_cpu() && q.dim() == 5 &&
                      q.size(0) == L_ && q.size(1) == k.size(1) && q.size(2) == H_ && q.size(3) == 1 &&
                      q.size(4) == D_,
                  "qkv::Decoder: the queries must be float32 (layers, rows, H, 1, D) on the CPU, contiguous");
  }

  void check_row(int64_t token, int64_t pos, int64_t S) const {
    TORCH_CHECK(token >= 0 && token < V_, "qkv::Decoder: token ", token, " outside the vocabulary");
    TORCH_CHECK(pos >= 0 && pos < S && pos < P_, "qkv::Decoder: position ", pos,
                " outside the cache or RoPE's table");
  }

  // M rows through every layer (see step_rows): tok, pos (M,); the cache R rows of S positions;
  // qk: the kept queries or nullptr; y: the logits (M, V); four: the head's pass reads its 4-bit copy.
  void run(int64_t M, const int64_t* tok, const int64_t* pos, int64_t R, int64_t S, float* kc, float* vc,
           float* qk, float* y, bool four) {
    const bool timed = profile_;
    const auto began = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    const int64_t nqkv = (H_ + 2 * KV_) * D_, group = H_ / KV_, nb = (V_ + SPAN_OF_MAX - 1) / SPAN_OF_MAX;
    x_.resize(M * dim_), qkv_.resize(M * nqkv), q_.resize(M * H_ * D_), o_.resize(M * dim_);
    gu_.resize(M * 2 * F_), a_.resize(M * F_), hf_.resize(M * dim_);
    piece_max_.resize(M * 2 * H_), piece_sum_.resize(M * 2 * H_), piece_out_.resize(M * 2 * H_ * D_);
    int64_t longest = 0;  // the most positions a row attends over
    for (int64_t m = 0; m < M; ++m) {
      const float* e = emb_ + tok[m] * dim_;
      for (int64_t i = 0; i < dim_; ++i) x_[m * dim_ + i] = e[i] * scale_;
      longest = std::max(longest, pos[m] + 1);
    }
    const int T = std::max(1, std::min<int>(at::get_num_threads(), 64));
    if (static_cast<int>(acts_.size()) < T) acts_.resize(T), norm_.resize(T);
    const bool whole = V_ % SPAN_OF_MAX == 0;  // the head's blocks of 128 logits
    const bool by_head = D_ % ROWS == 0;       // an attention head's outputs: whole blocks of 16
    best_.resize(M * nb), nan_.assign(T * M, 0);
    const float scale = 1.f / std::sqrt(static_cast<float>(D_));
#if QKV_AMX
    const bool tiles = M >= AMX_FROM && amx_ready();  // the 4-bit products take AMX tiles (for_rows)
#endif
    const bool one = M == 1;  // SwiGLU's outputs quantized once, into mlp_ (see gate|up below)
    if (one) size_for(1, F_, false, mlp_), mlp_.far = far_;
    Claim* claims = claims_.get();
    const uint64_t base = epoch_;  // the products claimed before this step
    uint64_t last = base;
#pragma omp parallel num_threads(T)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      Stopwatch clock(timed, profile_seconds_.data() + t * PROFILE_STRIDE, profile_count_.data() + t * PROFILE_STRIDE);
      if (timed && t == 0) profile_threads_ = std::max<int64_t>(profile_threads_, nt);  // (read after the region)
      uint64_t epoch = base;  // every thread counts the products alike
      Activations& a = acts_[t];
      a.far = far_;
      std::vector<float>& hv = norm_[t];
      const int64_t scratch = std::max({M * dim_, M * F_, group * longest});
      hv.resize(scratch + M * H_ * D_);
      float* h = hv.data();
      float* att = h + scratch;  // the heads' outputs, merged by each thread (M, H·D)
      const int64_t unit = by_head ? D_ / ROWS : 1, head_unit = whole ? SPAN_OF_MAX / ROWS : 1;
      const auto [q0, q1] = share(nqkv / ROWS / unit, t, nt);
      const auto [o0, o1] = share(dim_ / ROWS, t, nt);
      const int64_t g0 = share(F_ / GROUP, t, nt).first * (GROUP / ROWS);  // gate|up: units of a group
      const auto [v0, v1] = share(V_ / ROWS / head_unit, t, nt);
      const auto [u0, u1] = share(M * 2 * H_, t, nt);  // attention's units: 2 pieces of each row's query heads
      const int64_t Gd = dim_ / GROUP, Ga = H_ * D_ / GROUP, Gf = F_ / GROUP;
      // each thread quantises every row it multiplies, as the one-row step does but for SwiGLU's
      // outputs (there 576 values cost less than a barrier; with M rows, M times as many: not
      // measured against sharing them)
      auto quantized = [&](const float* x, int64_t K, bool code_sums, bool four_bit) {
        quantize_into(x, M, K, code_sums, a);
        for_rows(a, four_bit);
      };
#if QKV_AMX
      if (tiles) amx_begin(M);
#endif
      for (int64_t l = 0; l < L_; ++l) {
        const DecoderLayer& Y = layers_[l];
        for (int64_t m = 0; m < M; ++m) rms_norm(x_.data() + m * dim_, Y.norm1, dim_, eps_, h + m * dim_);
        quantized(h, dim_, false, true);
        clock.mark(NORM1);
        // q|k|v shared in whole heads where a head is whole blocks of 16: each thread then rotates
        // (or copies) the heads it computed, from its own cache, before the one barrier; else in
        // blocks, and the heads rotated after a second barrier
        // head j of row m's q|k|v: its query rotated, its key rotated into the cache, its value copied
        auto place = [&](int64_t m, int64_t j) {
          const float* x = qkv_.data() + m * nqkv + j * D_;
          const float* cs = cos_ + pos[m] * D_;
          const float* sn = sin_ + pos[m] * D_;
          const int64_t row = (l * R + m) * KV_;  // this layer's and row's first kv head in the cache
          if (j < H_) {
            float* qj = q_.data() + (m * H_ + j) * D_;
            rope(x, cs, sn, D_, qj);
            if (qk != nullptr) std::memcpy(qk + ((l * R + m) * H_ + j) * D_, qj, D_ * sizeof(float));
          } else if (j < H_ + KV_) {
            rope(x, cs, sn, D_, kc + ((row + j - H_) * S + pos[m]) * D_);
          } else {
            std::memcpy(vc + ((row + j - H_ - KV_) * S + pos[m]) * D_, x, D_ * sizeof(float));
          }
        };
        claimed(claims, ++epoch, nqkv / ROWS / unit, t, nt, first_, [&](int64_t c0, int64_t c1) {
          product_blocks<Q4>(Y.wqkv, Y.sqkv, a, c0 * unit, c1 * unit, qkv_.data(), nqkv, Y.bqkv);
          if (by_head)
            for (int64_t m = 0; m < M; ++m)
              for (int64_t j = c0; j < c1; ++j) place(m, j);
        });
        warm<Q4>(Y.wo, Y.so, Ga, o0);  // asked again before attention's barrier; this one, before
        clock.mark(QKV);
        sync_.wait(nt);                // attention, measured 0.1-0.8% faster kept than dropped
        clock.mark(WAIT_QKV);
        if (!by_head) {  // (q|k|v and its wait counted twice a layer: the placing, then its barrier)
          auto [p0, p1] = share(H_ + 2 * KV_, t, nt);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t j = p0; j < p1; ++j) place(m, j);
          clock.mark(QKV);
          sync_.wait(nt);
          clock.mark(WAIT_QKV);
        }
        // softmax(q·Kᵀ/√D)·V over a row's positions 0..pos in two pieces, [0, n/2) and [n/2, n),
        // each piece of a query head a unit of work; the units in the order (row, kv head, piece,
        // query head) shared among the threads in even runs: each key and value row is read once,
        // by one thread, for the query heads that share it (GQA), and the threads' shares are even
        // (by heads, 9 over 2 threads were 4 and 5, and a kv head's rows read by both). A piece
        // keeps its maximum score m, Σ e^(s-m) and Σ e^(s-m)·V, merged after the barrier. The
        // pieces are the same on any thread count and in any batch: so are the floats. Measured
        // against the runs of whole heads (benchmarks/native_ab.py, issue 53): 0.999 of its time at
        // positions 32-160, 0.962 at 400-528, 0.909 at 960-1088 (attention reads ~1 MB a layer there).
        for (int64_t u = u0; u < u1;) {
          const int64_t m = u / (2 * H_), w0 = u % (2 * H_);
          const int64_t kv = w0 / (2 * group), piece = (w0 / group) % 2, i0 = w0 % group;
          const int64_t end = std::min(u1, (u / group + 1) * group), r = end - u;  // 2H: whole groups
          const int64_t n = pos[m] + 1;
          const int64_t p0 = piece == 0 ? 0 : n / 2, len = piece == 0 ? n / 2 : n - n / 2;
          const int64_t kvr = (l * R + m) * KV_ + kv;  // the cache's rows of this kv head
          const int64_t first = (m * 2 + piece) * H_ + kv * group + i0;  // this run's first piece
          float* out = piece_out_.data() + first * D_;
          for (int64_t i = 0; i < r; ++i) {
            float* w = h + i * len;
            float top = -std::numeric_limits<float>::infinity(), total = 0.f;
            if (len > 0) {
              scores(q_.data() + (m * H_ + kv * group + i0 + i) * D_, kc + (kvr * S + p0) * D_, len, D_, scale, w);
              top = max_of(w, len);
              for (int64_t p = 0; p < len; ++p) w[p] = exp_approx(w[p] - top);
              total = sum_of(w, len);
            }
            piece_max_[first + i] = top, piece_sum_[first + i] = total;
          }
          if (len > 0)
            weighted_values(h, r, vc + (kvr * S + p0) * D_, len, D_, out);
          else
            std::fill(out, out + r * D_, 0.f);
          u = end;
        }
        warm<Q4>(Y.wo, Y.so, Ga, o0);
        clock.mark(ATTENTION);
        sync_.wait(nt);
        clock.mark(WAIT_ATT);
        for (int64_t m = 0; m < M; ++m)  // every head's two pieces merged, by each thread for itself
          for (int64_t j = 0; j < H_; ++j) {
            const int64_t i0 = m * 2 * H_ + j, i1 = i0 + H_;
            const float m0 = piece_max_[i0], m1 = piece_max_[i1], top = std::max(m0, m1);
            const float f0 = exp_approx(m0 - top), f1 = exp_approx(m1 - top);
            const float inv = 1.f / (f0 * piece_sum_[i0] + f1 * piece_sum_[i1]);
            const float *o0p = piece_out_.data() + i0 * D_, *o1p = piece_out_.data() + i1 * D_;
            float* o = att + (m * H_ + j) * D_;
#pragma omp simd
            for (int64_t d = 0; d < D_; ++d) o[d] = (f0 * o0p[d] + f1 * o1p[d]) * inv;
          }
        quantized(att, H_ * D_, false, true);
        clock.mark(MERGE);
        claimed(claims, ++epoch, dim_ / ROWS, t, nt, first_, [&](int64_t b0, int64_t b1) {
          product_blocks<Q4>(Y.wo, Y.so, a, b0, b1, o_.data(), dim_, Y.bo);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t i = b0 * ROWS; i < b1 * ROWS; ++i) x_[m * dim_ + i] += o_[m * dim_ + i];
        });
        warm<Q4>(Y.wgu, Y.sgu, Gd, g0);
        warm<Q4>(Y.wgu, Y.sgu, Gd, F_ / ROWS + g0);
        clock.mark(OUT);
        sync_.wait(nt);
        clock.mark(WAIT_OUT);
        for (int64_t m = 0; m < M; ++m) rms_norm(x_.data() + m * dim_, Y.norm2, dim_, eps_, h + m * dim_);
        quantized(h, dim_, false, true);
        clock.mark(NORM2);
        // gate|up in units of a group of 32 outputs: SwiGLU's outputs quantized where they are
        // computed, by the thread that claimed them (one row: the down product's activations,
        // shared; rows of a running batch: each thread quantises them all after the barrier).
        // Measured against each thread quantising the row after the barrier (native_ab.py, 150
        // blocks, SmolLM2 from L3, issue 53): 0.994x the step's time
        claimed(claims, ++epoch, F_ / GROUP, t, nt, first_, [&](int64_t c0, int64_t c1) {
          const int64_t b0 = c0 * (GROUP / ROWS), b1 = c1 * (GROUP / ROWS);
          product_blocks<Q4>(Y.wgu, Y.sgu, a, b0, b1, gu_.data(), 2 * F_, nullptr);
          product_blocks<Q4>(Y.wgu, Y.sgu, a, F_ / ROWS + b0, F_ / ROWS + b1, gu_.data(), 2 * F_, nullptr);
          for (int64_t m = 0; m < M; ++m) {
            const float* g = gu_.data() + m * 2 * F_;
            const float* u = g + F_;
            float* am = a_.data() + m * F_;
#pragma omp simd
            for (int64_t i = b0 * ROWS; i < b1 * ROWS; ++i) am[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
          }
          if (one)  // the groups of one row, as quantize_into would (each group's codes and scales its own)
            quantize_rows(a_.data() + c0 * GROUP, 1, (c1 - c0) * GROUP, mlp_.xq.data() + c0 * GROUP,
                          mlp_.xr.data() + c0 * GROUP, mlp_.dx.data() + c0, mlp_.sx.data() + c0, nullptr, nullptr);
        });
        warm<Q4>(Y.wd, Y.sd, Gf, o0);
        clock.mark(GATE_UP);
        sync_.wait(nt);
        clock.mark(WAIT_GATE_UP);
        if (!one) quantized(a_.data(), F_, false, true);
        clock.mark(QUANT_MLP);
        const Activations& down = one ? mlp_ : a;
        claimed(claims, ++epoch, dim_ / ROWS, t, nt, first_, [&](int64_t b0, int64_t b1) {
          product_blocks<Q4>(Y.wd, Y.sd, down, b0, b1, o_.data(), dim_, nullptr);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t i = b0 * ROWS; i < b1 * ROWS; ++i) x_[m * dim_ + i] += o_[m * dim_ + i];
        });
        if (l + 1 < L_)
          warm<Q4>(layers_[l + 1].wqkv, layers_[l + 1].sqkv, Gd, q0 * unit);
        else if (four)
          warm<Q4>(hw4_, hs4_, Gd, v0 * head_unit);
        else
          warm<Q8>(hw_, hs_, Gd, v0 * head_unit);
        clock.mark(DOWN);
        sync_.wait(nt);
        clock.mark(WAIT_DOWN);
      }
      for (int64_t m = 0; m < M; ++m)
        rms_norm(x_.data() + m * dim_, final_norm_, dim_, eps_final_, h + m * dim_);
      if (t == 0) std::memcpy(hf_.data(), h, M * dim_ * sizeof(float));
      quantized(h, dim_, !four, four);
      clock.mark(FINAL);
      // the head's outputs shared in whole blocks of 128 where V allows: each thread then takes
      // the maxima of its own blocks and looks for a NaN in them where it has just written them
      // (in its own cache, not the other core's)
      claimed(claims, ++epoch, V_ / ROWS / head_unit, t, nt, first_, [&](int64_t c0, int64_t c1) {
        if (four)
          product_blocks<Q4>(hw4_, hs4_, a, c0 * head_unit, c1 * head_unit, y, V_, hbias_);
        else
          product_blocks<Q8>(hw_, hs_, a, c0 * head_unit, c1 * head_unit, y, V_, hbias_);
        if (whole)
          for (int64_t m = 0; m < M; ++m) {
            const float* ym = y + m * V_;
            for (int64_t b = c0; b < c1; ++b) best_[m * nb + b] = max_of(ym + b * SPAN_OF_MAX, SPAN_OF_MAX);
            if (std::isnan(sum_of(ym + c0 * SPAN_OF_MAX, (c1 - c0) * SPAN_OF_MAX))) nan_[t * M + m] = 1;
          }
      });
#if QKV_AMX
      if (tiles) _tile_release();  // (after the head: a 4-bit head's rows take the tiles too)
#endif
      clock.mark(HEAD);
      if (t == 0) last = epoch;  // (every thread's count is the same)
    }
    epoch_ = last;  // after the region: its end joins the threads
    argmax_.resize(M);
    for (int64_t m = 0; m < M; ++m) {
      float* ym = y + m * V_;
      bool nan = !whole && std::isnan(sum_of(ym, V_));
      for (int i = 0; i < T && whole; ++i) nan = nan || nan_[i * M + m];
      cand_.clear();
      if (topk_ > 0) refine(ym, best_.data() + m * nb, hf_.data() + m * dim_, whole);
      argmax_[m] = pick(ym, nan);
    }
    if (timed) {  // thread 0 is this one: the steps' time not in its phases is their serial part
      profile_wall_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
      double inside = 0.;
      for (int p = 0; p < SERIAL; ++p) inside += profile_seconds_[p];
      profile_seconds_[SERIAL] = profile_wall_ - inside;
      ++profile_count_[SERIAL];
    }
  }

  // The top_ largest of y (V,) recomputed in fp32 from the float matrix (TopKRefinedLinear) and
  // hf (dim,), the final norm's output: the largest of each block of 128 first; the k-th largest
  // block maximum bounds the k-th value from below, so only blocks reaching it can hold the k
  // largest. best: the block maxima, already taken by the threads where ready.
  void refine(float* y, float* best, const float* hf, bool ready) {
    constexpr int64_t B = SPAN_OF_MAX;
    const int64_t k = std::min(topk_, V_), nb = (V_ + B - 1) / B;
    for (int64_t b = 0; b < nb && !ready; ++b) best[b] = max_of(y + b * B, std::min(V_, (b + 1) * B) - b * B);
    // fewer blocks than k: every block may hold some of the k largest
    floor_ = -std::numeric_limits<float>::infinity();
    float& floor = floor_;
    if (nb > k) {
      sorted_.assign(best, best + nb);
      std::nth_element(sorted_.begin(), sorted_.begin() + k - 1, sorted_.end(), std::greater<float>());
      floor = sorted_[k - 1];
    }
    cand_.clear();
    for (int64_t b = 0; b < nb; ++b) {
      if (!(best[b] >= floor)) continue;  // (a NaN block maximum: none of its values is taken)
      const int64_t end = std::min(V_, (b + 1) * B);
      // its values at or above the floor, in order, a vector's lanes compared at once (against a
      // scalar scan: native_ab.py, 150 blocks, issue 53: 0.996x the step's time; the scan and the
      // choice of candidates were ~11 us of a token's 24 in refine, the exact rows' fetch ~10)
      const float* yb = y + b * B;
      each_at_least(yb, end - b * B, floor, [&](int64_t j) { cand_.emplace_back(yb[j], b * B + j); });
    }
    const int64_t m = std::min<int64_t>(k, cand_.size());
    std::nth_element(cand_.begin(), cand_.begin() + m - 1, cand_.end(),
                     [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
                       return a.first > b.first || (a.first == b.first && a.second < b.second);
                     });
    for (int64_t c = 0; c < m; ++c)  // the rows' cache lines asked for at once, not one row at a time
      for (int64_t d = 0; d < dim_; d += 16) __builtin_prefetch(exact_ + cand_[c].second * dim_ + d);
    for (int64_t c = 0; c < m; ++c) {
      const int64_t i = cand_[c].second;
      const float s = dot(exact_ + i * dim_, hf, dim_);
      y[i] = hbias_ != nullptr ? s + hbias_[i] : s;
    }
  }

  // torch.argmax of y (V,): the first NaN where there is one; after refine, the largest of the
  // candidates (every entry at or above floor_, refined or not) where it is still at or above
  // floor_ (every other entry is below it), the first of them on a tie; else a pass over y.
  // nan: a sum over the products' logits was NaN (a NaN, or +inf beside -inf); refine's may make
  // more, among the candidates, looked for here. Then entry by entry, as argmax_rows.
  int64_t pick(const float* y, bool nan) const {
    for (const auto& c : cand_) nan = nan || std::isnan(y[c.second]);
    if (nan) return argmax_scan(y, V_);
    if (topk_ > 0 && !cand_.empty()) {
      float top = -std::numeric_limits<float>::infinity();
      for (const auto& c : cand_) top = std::max(top, y[c.second]);
      if (top >= floor_) {
        int64_t at = V_;
        for (const auto& c : cand_)
          if (y[c.second] == top) at = std::min(at, c.second);
        return at;
      }
    }
    return first_equal(y, V_, max_of(y, V_));
  }

  std::vector<at::Tensor> held_;  // the model's tensors, kept alive; read in place
  std::vector<DecoderLayer> layers_;
  int64_t L_ = 0, dim_ = 0, H_ = 0, KV_ = 0, D_ = 0, F_ = 0, V_ = 0, P_ = 0, topk_ = 0;
  bool far_ = false;  // the products' prefetches also FAR groups ahead (a model from DRAM)
  float scale_ = 1.f, eps_ = 0.f, eps_final_ = 0.f;
  const float *emb_ = nullptr, *cos_ = nullptr, *sin_ = nullptr, *final_norm_ = nullptr, *hbias_ = nullptr,
              *exact_ = nullptr;
  const uint8_t* hw_ = nullptr;
  const c10::Half* hs_ = nullptr;
  const uint8_t* hw4_ = nullptr;  // greedy steps' 4-bit copy of the head (Q4_1's grid) or none
  const c10::Half* hs4_ = nullptr;
  std::vector<float> x_, qkv_, q_, o_, gu_, a_, hf_, best_;  // per row: (M, .)
  std::vector<float> piece_max_, piece_sum_, piece_out_;  // attention's two pieces a head: (M, 2, H), (M, 2, H, D)
  std::vector<std::pair<float, int64_t>> cand_;  // refine's candidates (value, index)
  std::vector<float> sorted_;                      // refine's block maxima, partly ordered
  float floor_ = 0.f;                              // refine's bound: every other entry is below it
  std::vector<char> nan_;                          // per thread and row: a NaN among its logits
  std::vector<int64_t> argmax_;                   // each row's, from the last step
  std::vector<Activations> acts_;
  Activations mlp_;  // one row's SwiGLU outputs quantized by the threads that computed them
  std::vector<std::vector<float>> norm_;
  Barrier sync_;
  std::unique_ptr<Claim[]> claims_{new Claim[64]};  // a word per thread (at most 64), see claimed
  uint64_t epoch_ = 0;                               // the products claimed so far
  bool profile_ = false;                             // the steps timed by phase (profile)
  int64_t profile_threads_ = 0;                      // the most threads a timed step ran on
  double profile_wall_ = 0.;                         // the timed steps' time since the last profile
  std::vector<double> profile_seconds_ = std::vector<double>(64 * PROFILE_STRIDE);  // (thread, phase)
  std::vector<int64_t> profile_count_ = std::vector<int64_t>(64 * PROFILE_STRIDE);
  int first_ = 0;                                    // claimed's first share: t + first_
};

}  // namespace QKV_NAMESPACE

}  // namespace

#define QKV_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define QKV_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

QKV_LIBRARY(QKV_NAMESPACE, m) {
  m.def("int4_mm(Tensor x, Tensor w, Tensor dm) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor w, Tensor ds) -> Tensor");
  m.def("int4_path() -> str", &int4_path);
  m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
  m.def("sample_rows(Tensor x, float temperature, int top_k, float top_p, Tensor u) -> Tensor", &sample_rows);
  m.class_<QKV_NAMESPACE::Decoder>("Decoder")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("step", &QKV_NAMESPACE::Decoder::step)
      .def("greedy_step", &QKV_NAMESPACE::Decoder::greedy_step)
      .def("greedy_step_rows", &QKV_NAMESPACE::Decoder::greedy_step_rows)
      .def("greedy_head", &QKV_NAMESPACE::Decoder::greedy_head)
      .def("step_rows", &QKV_NAMESPACE::Decoder::step_rows)
      .def("argmax", &QKV_NAMESPACE::Decoder::argmax)
      .def("profile", &QKV_NAMESPACE::Decoder::profile);
}
QKV_LIBRARY_IMPL(QKV_NAMESPACE, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("q8_mm", &q8_mm);
}
