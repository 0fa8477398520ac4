// Fused per-layer ops for CPUs on bfloat16 tensors: RMSNorm (with the residual add), SiLU-and-mul,
// in-place rotate-half RoPE, and the GEMV of GGUF Q8_0 weights.
//
// Each op reproduces the rounding steps of plinth's torch reference code (plinth/model_registry/
// layers): every bfloat16 result of a torch op is rounded to bfloat16 here at the same point, and
// the arithmetic in between is float32, so outputs agree with the reference up to float32
// summation order and the exp approximation (well below one bfloat16 ulp, bar rare rounding ties).
//
// The file includes no torch headers (it compiles in about a second) and exports C functions that
// take raw pointers and strides; rows are spread over OpenMP threads (torch's libgomp pool) when
// there is enough work to pay for waking them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

// 8-lane paths (the Q8_0 GEMV, the float32 panel GEMV) on CPUs with AVX2, FMA and F16C but no AVX512
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PLINTH_CPU_AVX2 1
#endif

#if defined(__AVX512F__) || defined(PLINTH_CPU_AVX2)
#include <immintrin.h>
#endif

// AMX tiles (bfloat16 tile products) for the panel GEMM, where the compiler targets them
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define PLINTH_CPU_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#endif

namespace {

using plinth_cpu::bf2f;
using plinth_cpu::exp_nonpositive;
using plinth_cpu::f2bf;
using plinth_cpu::half2f;
using plinth_cpu::round_bf;

constexpr int kLanes = 16;
constexpr int64_t kParallelWork = 1 << 15;   // elements below which one thread does a whole op

// out[r] = sum over the nb blocks of one Q8_0 row of d_b * (q_b . x_r,b) for the rows = 1..kMaxRows
// inputs x_r = x + r * k (float32); each block's codes are converted once for all rows.
constexpr int kMaxRows = 4;
#if defined(__AVX512F__) || defined(PLINTH_CPU_AVX2)
// bytes ahead of the current block the Q8_0 GEMV prefetches (the rows are read once, in order)
constexpr int64_t kQ8Prefetch = 1024;
#endif
#if defined(PLINTH_CPU_AVX2)
// the sum of the 8 lanes
inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
#endif
inline void q8_0_row_dot(const uint8_t* row, const float* x, int64_t k, int64_t nb, int rows, float* out) {
  constexpr int64_t kBlock = 32, kBytes = 34;
#if defined(__AVX512F__)
  __m512 acc[kMaxRows];
  for (int r = 0; r < kMaxRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(blk) + kQ8Prefetch, _MM_HINT_T0);
    uint16_t dh;
    std::memcpy(&dh, blk, sizeof(dh));
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))));
    for (int r = 0; r < rows; ++r) {
      const float* xb = x + r * k + b * kBlock;
      acc[r] = _mm512_fmadd_ps(d, _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xb))), acc[r]);
    }
  }
  for (int r = 0; r < rows; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(PLINTH_CPU_AVX2)
  // 8 lanes: the block's scale times each code first (exact in float32: 11 x 8 significant bits)
  __m256 acc[kMaxRows];
  for (int r = 0; r < kMaxRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(blk) + kQ8Prefetch, _MM_HINT_T0);
    uint16_t dh;
    std::memcpy(&dh, blk, sizeof(dh));
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
    __m256 w[4];
    for (int j = 0; j < 4; ++j) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * j));
      w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)));
    }
    for (int r = 0; r < rows; ++r) {
      const float* xb = x + r * k + b * kBlock;
      __m256 sum = acc[r];
      for (int j = 0; j < 4; ++j) sum = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), sum);
      acc[r] = sum;
    }
  }
  for (int r = 0; r < rows; ++r) out[r] = hsum8(acc[r]);
#else
  for (int r = 0; r < rows; ++r) {
    float lanes[kLanes] = {0.f};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * kBytes;
      const float d = half2f(static_cast<uint16_t>(blk[0] | (blk[1] << 8)));
      const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
      const float* xb = x + r * k + b * kBlock;
      for (int j = 0; j < kLanes; ++j)
        lanes[j] += d * static_cast<float>(qs[j]) * xb[j] + d * static_cast<float>(qs[j + kLanes]) * xb[j + kLanes];
    }
    for (int width = kLanes / 2; width > 0; width /= 2)
      for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    out[r] = lanes[0];
  }
#endif
}

}  // namespace


#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// R input rows times the bfloat16 weights of `tiles` tiles of 16 output columns, k-pair interleaved in wbuf
// ([K/2][tiles][32] bf16: per k-pair and tile, lanes (column, k parity)), accumulated in float32 per column
// (one dpbf16 per row, tile and k-pair, the row's two inputs broadcast); y rows rounded to bfloat16 once.
template <int R, int TILES>
inline void q4p_rows(const uint16_t* x, int64_t x_stride, const uint16_t* wbuf, int64_t kp_count, uint16_t* y,
                     int64_t y_stride, int64_t cols) {
  __m512 acc[R][TILES];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    __m512bh wv[TILES];
    for (int t = 0; t < TILES; ++t) wv[t] = (__m512bh)_mm512_loadu_si512(wbuf + (kp * TILES + t) * 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * kp, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xb, wv[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TILES; ++t) {
      const int64_t c0 = 16 * t;
      if (c0 >= cols) break;
      const __mmask16 keep = cols - c0 >= 16 ? static_cast<__mmask16>(0xffff)
                                             : static_cast<__mmask16>((1u << (cols - c0)) - 1u);
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[r][t]);
      _mm256_mask_storeu_epi16(y + r * y_stride + c0, keep, out);
    }
}

template <int TILES>
inline void q4p_all_rows(const uint16_t* x, int64_t x_stride, const uint16_t* wbuf, int64_t kp_count, uint16_t* y,
                         int64_t y_stride, int64_t m, int64_t cols) {
  int64_t r0 = 0;
  for (; r0 + 8 <= m; r0 += 8) q4p_rows<8, TILES>(x + r0 * x_stride, x_stride, wbuf, kp_count, y + r0 * y_stride, y_stride, cols);
  for (; r0 + 4 <= m; r0 += 4) q4p_rows<4, TILES>(x + r0 * x_stride, x_stride, wbuf, kp_count, y + r0 * y_stride, y_stride, cols);
  for (; r0 < m; ++r0) q4p_rows<1, TILES>(x + r0 * x_stride, x_stride, wbuf, kp_count, y + r0 * y_stride, y_stride, cols);
}

// a - b in float32 for 16 lanes, and whether it is exact in every lane (TwoSum: the rounding error is computed
// exactly, so the test is exact too)
inline __m512 sub_exact(__m512 a, __m512 b, bool* exact) {
  const __m512 s = _mm512_sub_ps(a, b), bb = _mm512_sub_ps(s, a);
  const __m512 err = _mm512_sub_ps(_mm512_sub_ps(a, _mm512_sub_ps(s, bb)), _mm512_add_ps(b, bb));
  *exact = _mm512_cmp_ps_mask(err, _mm512_setzero_ps(), _CMP_NEQ_UQ) == 0;
  return s;
}

// Tiles t0, t0 + tile_stride, ... (nt <= 2) of the 4-bit panel layout expanded into wbuf [K/2][nt][32] bfloat16: per k-pair
// and tile the 16 columns' weights at k parity 0 and 1 side by side, w = d q + c rounded to bfloat16 once. Per k-pair
// the 16 code bytes are broadcast to the four 128-bit lanes and a byte shuffle puts byte i at bits 16-23 of dword i;
// masking a nibble there (the high one shifted down first) and or-ing in 0x43000000 gives the float32 128 + q
// exactly (no integer conversion). Then w = d (128 + q) + (c - 128 d) in one fused multiply-add: the same float32 as
// d q + c where c - 128 d is exact in float32 (checked per block; a block where it is not subtracts the 128 from
// 128 + q instead). The codes four blocks and the scales sixteen blocks ahead are prefetched (the codes stream from
// memory once per call).
// q4p_expand_block: the 32-k block kb of tile t, as tile ti of the panel's block at `out` (16 k-pairs x nt x 32).
inline void q4p_expand_block(const uint8_t* codes, const uint16_t* dh, const uint16_t* ch, int64_t t, int64_t kb,
                             int64_t k, int64_t ti, int64_t nt, uint16_t* out) {
  const int64_t kps = k / 2, kbs = k / 32;
  const __m512i idx_b = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i idx_a = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  // dword j of 128-bit lane L takes byte 4 L + j into its bits 16-23 (0x80: zero)
  const __m512i place = _mm512_set_epi32(
      static_cast<int>(0x800f8080u), static_cast<int>(0x800e8080u), static_cast<int>(0x800d8080u),
      static_cast<int>(0x800c8080u), static_cast<int>(0x800b8080u), static_cast<int>(0x800a8080u),
      static_cast<int>(0x80098080u), static_cast<int>(0x80088080u), static_cast<int>(0x80078080u),
      static_cast<int>(0x80068080u), static_cast<int>(0x80058080u), static_cast<int>(0x80048080u),
      static_cast<int>(0x80038080u), static_cast<int>(0x80028080u), static_cast<int>(0x80018080u),
      static_cast<int>(0x80008080u));
  const __m512i nibble = _mm512_set1_epi32(0x000f0000), f128 = _mm512_set1_epi32(0x43000000);
  const uint8_t* block = codes + (t * kps + kb * 16) * 16;
  for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(block + 1024 + 64 * line), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(dh + (t * kbs + kb) * 16 + 256), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(ch + (t * kbs + kb) * 16 + 256), _MM_HINT_T0);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dh + (t * kbs + kb) * 16)));
  const __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + (t * kbs + kb) * 16)));
  const __m512 db = _mm512_permutexvar_ps(idx_b, d), da = _mm512_permutexvar_ps(idx_a, d);
  out += ti * 32;
  const __m128i* in = reinterpret_cast<const __m128i*>(block);
  bool exact;
  const __m512 c0 = sub_exact(c, _mm512_mul_ps(d, _mm512_set1_ps(128.f)), &exact);
  if (exact) {
    const __m512 cb = _mm512_permutexvar_ps(idx_b, c0), ca = _mm512_permutexvar_ps(idx_a, c0);
    for (int64_t kk = 0; kk < 16; ++kk) {
      const __m512i bytes = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(in + kk)), place);
      // (x & nibble) | f128 = 128 + q
      const __m512 qb = (__m512)_mm512_ternarylogic_epi32(bytes, nibble, f128, 0xEA);
      const __m512 qa = (__m512)_mm512_ternarylogic_epi32(_mm512_srli_epi32(bytes, 4), nibble, f128, 0xEA);
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(qa, da, ca), _mm512_fmadd_ps(qb, db, cb));
      _mm512_storeu_si512(out + kk * nt * 32, (__m512i)w);
    }
    return;
  }
  const __m512 c128 = _mm512_set1_ps(128.f);
  const __m512 cb = _mm512_permutexvar_ps(idx_b, c), ca = _mm512_permutexvar_ps(idx_a, c);
  for (int64_t kk = 0; kk < 16; ++kk) {
    const __m512i bytes = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(in + kk)), place);
    const __m512 qb = _mm512_sub_ps((__m512)_mm512_ternarylogic_epi32(bytes, nibble, f128, 0xEA), c128);
    const __m512 qa = _mm512_sub_ps((__m512)_mm512_ternarylogic_epi32(_mm512_srli_epi32(bytes, 4), nibble, f128,
                                                                      0xEA), c128);
    const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(qa, da, ca), _mm512_fmadd_ps(qb, db, cb));
    _mm512_storeu_si512(out + kk * nt * 32, (__m512i)w);
  }
}

inline void q4p_expand(const uint8_t* codes, const uint16_t* dh, const uint16_t* ch, int64_t t0, int64_t nt,
                       int64_t k, uint16_t* wbuf, int64_t tile_stride = 1) {
  for (int64_t ti = 0; ti < nt; ++ti)
    for (int64_t kb = 0; kb < k / 32; ++kb)
      q4p_expand_block(codes, dh, ch, t0 + ti * tile_stride, kb, k, ti, nt, wbuf + kb * 16 * nt * 32);
}

// The 4-bit panels as a source of the AMX GEMMs' bfloat16 panels (q4p_expand_block).
struct Q4PanelSource {
  const uint8_t* codes;
  const uint16_t* dh;
  const uint16_t* ch;
  int64_t k;
  void expand_block(int64_t t, int64_t kb, int64_t ti, int64_t nt, uint16_t* out) const {
    q4p_expand_block(codes, dh, ch, t, kb, k, ti, nt, out);
  }
};

// 8-bit panels (plinth.kernels.cpu_native.pack_q8_panels: a GGUF Q8_0 weight's codes and scales regrouped), as a
// source of the AMX GEMMs' bfloat16 panels. Per tile of 16 output rows and 32-k block: 512 code bytes in the
// panel's own order (k-pair, then column, then k parity) and the 16 columns' float16 scales. The weight
// w = d q (exact in float32) is rounded to bfloat16 once: the bits of the bfloat16 weight converted from the file.
struct Q8PanelSource {
  const int8_t* codes;     // [T][K/32][16 k-pairs][16 columns][2]
  const uint16_t* scales;  // [T][K/32][16]
  int64_t k;
  void expand_block(int64_t t, int64_t kb, int64_t ti, int64_t nt, uint16_t* out) const {
    const int64_t kbs = k / 32;
    const __m512i idx_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i idx_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const int8_t* block = codes + (t * kbs + kb) * 512;
    for (int line = 0; line < 8; ++line) _mm_prefetch(reinterpret_cast<const char*>(block + 1024 + 64 * line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(scales + (t * kbs + kb) * 16 + 64), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (t * kbs + kb) * 16)));
    const __m512 dlo = _mm512_permutexvar_ps(idx_lo, d), dhi = _mm512_permutexvar_ps(idx_hi, d);
    for (int64_t kk = 0; kk < 16; ++kk) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kk * 32));
      const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), dlo);
      const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), dhi);
      _mm512_storeu_si512(out + (kk * nt + ti) * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
};

template <class Source>
inline void panel_expand(const Source& src, int64_t t0, int64_t nt, uint16_t* wbuf, int64_t tile_stride) {
  for (int64_t ti = 0; ti < nt; ++ti)
    for (int64_t kb = 0; kb < src.k / 32; ++kb)
      src.expand_block(t0 + ti * tile_stride, kb, ti, nt, wbuf + kb * 16 * nt * 32);
}

// The panel GEMMs' pairs of 16-column tiles: pair p is tiles 2p and 2p + 1 (the last pair of an odd count one tile);
// with `halves` (n a multiple of 32), tiles p and p + n / 32: column tile p of each half (a gate/up weight's gate and
// up columns side by side).
struct PanelPairs {
  int64_t tiles, count, tile_stride;
  bool halves;

  PanelPairs(int64_t n, bool halves_)
      : tiles((n + 15) / 16), count((tiles + 1) / 2), tile_stride(halves_ ? count : 1), halves(halves_) {}
  int64_t first_tile(int64_t p) const { return halves ? p : 2 * p; }
  int64_t tile_count(int64_t p) const { return halves ? 2 : std::min<int64_t>(2, tiles - 2 * p); }
};

// The panel GEMMs' loop: the pairs spread over the threads, each expanded (q4p_expand) into the thread's panel and
// handed to multiply(wbuf, t0, nt).
template <class Multiply>
inline void q4p_for_each_pair(const uint8_t* codes, const uint16_t* dh, const uint16_t* ch, int64_t n, int64_t k,
                              bool parallel, Multiply multiply) {
  const PanelPairs pairs(n, false);
#pragma omp parallel if (parallel)
  {
    std::vector<uint16_t> wbuf(static_cast<size_t>(k * 32));   // K/2 k-pairs x 2 tiles x 32 bfloat16
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs.count; ++p) {
      q4p_expand(codes, dh, ch, pairs.first_tile(p), pairs.tile_count(p), k, wbuf.data());
      multiply(wbuf.data(), pairs.first_tile(p), pairs.tile_count(p));
    }
  }
}

// The bfloat16 rounding of 16 float32 lanes (nearest even, subnormals flushed to zero as the GEMMs' stores flush
// them), as float32.
inline __m512 round16_bf(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// f2bf of 16 lanes, bit for bit (nearest even in integer arithmetic, so subnormals stay, which vcvtneps2bf16
// flushes; NaN -> 0x7fc0): the bfloat16 bits in the low half of each dword
inline __m512i f2bf16_bits(__m512 v) {
  const __m512i w = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(w, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(w, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

// f2bf of 16 lanes as packed bfloat16 bits: vcvtneps2bf16 rounds to nearest even as f2bf does except for the
// subnormals it flushes and the NaNs whose payload it keeps; lanes of those take the integer arithmetic above
inline __m256i f2bf16_packed(__m512 v) {
#if defined(__AVX512DQ__)
  constexpr int kQuietNan = 0x01, kSubnormal = 0x20, kSignalingNan = 0x80;
  if (_mm512_fpclass_ps_mask(v, kQuietNan | kSubnormal | kSignalingNan) == 0) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  return _mm512_cvtepi32_epi16(f2bf16_bits(v));
}

// f2bf of 16 lanes, as float32
inline __m512 round16_f2bf(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f2bf16_packed(v)), 16));
}

inline __m512 load16_bf(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// 16 lanes that already hold bfloat16 values (their low 16 bits zero, e.g. round16_f2bf's), stored exactly
inline void store16_bf_exact(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

inline void store16_bf(uint16_t* p, __m512 v) {   // f2bf of each lane
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f2bf16_packed(v));
}

// silu(g) * u for 16 lanes exactly as silu_mul_rows<Bf16> computes it from bfloat16 g and u (here as float32):
// e = exp(-|g|), one quotient 1 / (1 + e), the same select, g * sig rounded to bfloat16 as f2bf rounds, times u
// (the caller stores the product through store16_bf): bit for bit the scalar loop's results.
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 neg_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
  const __m512 e = plinth_cpu::exp16_nonpositive(neg_abs);
  const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
  const __mmask16 pos = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __mmask16 below = _mm512_cmp_ps_mask(g, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  __m512 sig = _mm512_maskz_mov_ps(static_cast<__mmask16>(~below), _mm512_mul_ps(e, inv));
  sig = _mm512_mask_mov_ps(sig, pos, inv);
  return _mm512_mul_ps(round16_f2bf(_mm512_mul_ps(g, sig)), u);
}

#if defined(PLINTH_CPU_AMX)
// The right-hand operand of AmxTiles::gemm, block by block. An expanded panel (ExpandedPanel: the whole pair in a
// buffer, for inputs of more than 32 rows, which reuse it per chunk), or one expanded a 32-k block at a time into
// two small buffers in turn (StreamedPanel, for 32 rows or fewer): block kb + 1 is expanded while the tile products
// of block kb run, and the inputs, the two blocks and the sums stay in L1 where a whole panel did not.
struct ExpandedPanel {
  const uint16_t* wbuf;
  int64_t nt;
  void begin() const {}
  const uint16_t* block(int64_t kb) const { return wbuf + kb * 16 * nt * 32; }
  void after(int64_t) const {}
};

template <class Source>
struct StreamedPanel {
  const Source& src;
  int64_t t0, nt, tile_stride;
  uint16_t* buf;   // two blocks of kBlock elements (16 k-pairs x nt <= 2 tiles x 32)
  static constexpr int64_t kBlock = 16 * 2 * 32;
  void begin() const { expand(0); }
  const uint16_t* block(int64_t kb) const { return buf + (kb & 1) * kBlock; }
  void after(int64_t kb) const {
    if (kb + 1 < src.k / 32) expand(kb + 1);
  }
  void expand(int64_t kb) const {
    for (int64_t ti = 0; ti < nt; ++ti) src.expand_block(t0 + ti * tile_stride, kb, ti, nt, buf + (kb & 1) * kBlock);
  }
};

// One thread's AMX tiles for y [M, cols <= 32] = x [M, K] (bfloat16) times a k-pair-interleaved bfloat16 panel of
// nt <= 2 tiles of 16 columns (q4p_expand's layout). Tiles 0-3: float32 sums (row group g, column tile t: 2 g + t),
// 4-5: the two row groups' inputs, 6-7: the two column tiles' weights. The configuration (the row counts) is loaded
// when a chunk of rows needs another one.
//
// Each chunk of 32 rows leaves its sums in acc_, and the work that turns them into outputs (the epilogue: bfloat16
// rounding, or the gate/up activation) is done a few rows per 32-k step of the next chunk's products, or of the next
// pair's (flush() ends the last one), rather than between the chunks. The weights come a 32-k block at a time from
// `panel` (ExpandedPanel or StreamedPanel). For more than 32 rows the input tiles are loaded with the streaming hint
// (each is read once per chunk and pair): without it they evict the panel from L1 (500 rows of the q/k/v GEMM, 30
// layers, 8.6 -> 6.2 ms); 32 rows or fewer are read again for every pair, and stay in L1 beside the small panel.
class AmxTiles {
 public:
  enum class Out { kStore, kSilu, kF32 };

  // kStore: y [M, cols] bfloat16; kSilu (nt = 2: a gate tile and its up tile): act [M, 16] = silu(gate) * up, the
  // float32 sums rounded to bfloat16 first, as the unfused GEMM's output that silu_mul_rows would read; kF32 (y a
  // float pointer): y [M, cols] the float32 sums
  template <Out kOut, class Y, class Panel>
  void gemm(const uint16_t* x, int64_t x_stride, const Panel& panel, int64_t nt, int64_t k, Y* y,
            int64_t y_stride, int64_t m, int64_t cols) {
    static_assert(std::is_same_v<Y, float> == (kOut == Out::kF32), "float32 outputs go to a float pointer");
    const bool stream = m > 32;   // inputs read once per chunk and pair (see above)
    for (int64_t r0 = 0; r0 < m; r0 += 32) {
      const int rows0 = static_cast<int>(std::min<int64_t>(16, m - r0));
      const int rows1 = static_cast<int>(std::min<int64_t>(16, std::max<int64_t>(0, m - r0 - 16)));
      configure(rows0, rows1);
      const uint16_t* xr = x + r0 * x_stride;
      if (rows1 > 0) {
        if (nt == 2) run<2, 2>(xr, x_stride, panel, k, stream);
        else run<2, 1>(xr, x_stride, panel, k, stream);
      } else {
        if (nt == 2) run<1, 2>(xr, x_stride, panel, k, stream);
        else run<1, 1>(xr, x_stride, panel, k, stream);
      }
      flush();
      _tile_stored(0, acc_[0], 64);
      if (nt == 2) _tile_stored(1, acc_[1], 64);
      if (rows1 > 0) _tile_stored(2, acc_[2], 64);
      if (rows1 > 0 && nt == 2) _tile_stored(3, acc_[3], 64);
      pending_ = {kOut, y + r0 * y_stride, y_stride, cols, rows0 + rows1, 0};
    }
  }

  void flush() { epilogue(pending_.rows - pending_.next); }

  ~AmxTiles() {   // the thread's tile state back to its initial one
    if (configured_) _tile_release();
  }

 private:
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };

  struct Pending {   // the sums in acc_ not yet written out: rows next .. rows - 1
    Out out = Out::kStore;
    void* y = nullptr;
    int64_t y_stride = 0, cols = 0;
    int rows = 0, next = 0;
  };

  void configure(int rows0, int rows1) {
    if (configured_ && rows0 == rows0_ && rows1 == rows1_) return;
    Config cfg;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(rows0);
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(rows1);
    if (rows1 == 0) cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[5] = 0;
    cfg.rows[6] = cfg.rows[7] = 16;
    _tile_loadconfig(&cfg);
    configured_ = true;
    rows0_ = rows0;
    rows1_ = rows1;
  }

  template <int G, int NT, class Panel>
  void run(const uint16_t* x, int64_t x_stride, const Panel& panel, int64_t k, bool stream) {
    _tile_zero(0);
    if (NT == 2) _tile_zero(1);
    if (G == 2) _tile_zero(2);
    if (G == 2 && NT == 2) _tile_zero(3);
    const int64_t xb = x_stride * 2, wb = NT * 64, kbs = k / 32;
    const int rows_per_step = static_cast<int>((pending_.rows - pending_.next + kbs - 1) / kbs);
    // each operand tile loaded just before its first product (loads of the next block then wait only for the
    // products that read the tile before: 500 rows of the gate/up GEMM 38.4-38.8 -> 36.7-36.8 ms for 30 layers)
    panel.begin();
    for (int64_t kb = 0; kb < kbs; ++kb) {
      const uint16_t* wbuf = panel.block(kb);
      if (stream) _tile_stream_loadd(4, x + kb * 32, xb); else _tile_loadd(4, x + kb * 32, xb);
      _tile_loadd(6, wbuf, wb);
      _tile_dpbf16ps(0, 4, 6);
      if (NT == 2) _tile_loadd(7, wbuf + 32, wb);
      if (NT == 2) _tile_dpbf16ps(1, 4, 7);
      if (G == 2) {
        if (stream) _tile_stream_loadd(5, x + 16 * x_stride + kb * 32, xb);
        else _tile_loadd(5, x + 16 * x_stride + kb * 32, xb);
      }
      if (G == 2) _tile_dpbf16ps(2, 5, 6);
      if (G == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
      panel.after(kb);
      epilogue(rows_per_step);
    }
  }

  // up to `count` more rows of the pending sums written out
  void epilogue(int count) {
    Pending& p = pending_;
    for (const int end = std::min(p.rows, p.next + count); p.next < end; ++p.next) {
      const int r = p.next, g = r / 16, rr = r % 16;
      if (p.out == Out::kSilu) {
        const __m512 gate = round16_bf(_mm512_loadu_ps(acc_[2 * g][rr]));
        const __m512 up = round16_bf(_mm512_loadu_ps(acc_[2 * g + 1][rr]));
        store16_bf(static_cast<uint16_t*>(p.y) + r * p.y_stride, silu_mul16(gate, up));
        continue;
      }
      for (int t = 0; t < 2 && 16 * t < p.cols; ++t) {
        const __mmask16 keep = p.cols - 16 * t >= 16 ? static_cast<__mmask16>(0xffff)
                                                     : static_cast<__mmask16>((1u << (p.cols - 16 * t)) - 1u);
        const __m512 sums = _mm512_loadu_ps(acc_[2 * g + t][rr]);
        if (p.out == Out::kF32) {
          _mm512_mask_storeu_ps(static_cast<float*>(p.y) + r * p.y_stride + 16 * t, keep, sums);
        } else {
          _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.y) + r * p.y_stride + 16 * t, keep,
                                   (__m256i)_mm512_cvtneps_pbh(sums));
        }
      }
    }
  }

  alignas(64) float acc_[4][16][16];
  Pending pending_;
  bool configured_ = false;
  int rows0_ = -1, rows1_ = -1;
};

// The AMX panel GEMMs' loop: each thread takes a run of consecutive pairs (PanelPairs) of the weight `src` (a
// Q4PanelSource or Q8PanelSource) and multiplies each with multiply(amx, panel, t0, nt): for 32 input rows or
// fewer a StreamedPanel (each block expanded just before its products), for more an ExpandedPanel (the pair expanded
// once into one aligned buffer, then every chunk of 32 rows multiplied with it). Against expanding the next pair's
// whole panel into a second buffer a few blocks per step of this one's products, 30 layers of the q/k/v, o, gate/up
// and down GEMMs at 32 / 128 / 500 rows: 8.1 / 17.3 / 53.3 -> 6.9-7.0 / 14.2 / 45.9 ms (the inputs, the panel and
// the sums now stay in L1 for 32 rows).
template <class Source, class Multiply>
inline void amx_for_each_pair(const Source& src, int64_t n, int64_t m, bool parallel, bool halves, Multiply multiply) {
  const PanelPairs pairs(n, halves);
  const int64_t k = src.k;
#pragma omp parallel if (parallel)
  {
#if defined(_OPENMP)
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const int64_t threads = 1, me = 0;
#endif
    const int64_t begin = pairs.count * me / threads, end = pairs.count * (me + 1) / threads;
    if (begin < end) {
      // the panel buffer (K/2 k-pairs x 2 tiles x 32, or two blocks of 16 k-pairs), kept by the thread between calls
      // (a new vector was a memset of up to 192 KiB per call and thread, for every GEMM of every layer), aligned to a
      // cache line: a panel at another offset splits every 64-byte store and tile row in two lines
      static thread_local std::vector<uint16_t> panel_buf;
      const size_t need = static_cast<size_t>(std::max<int64_t>(k, 64) * 32 + 32);
      if (panel_buf.size() < need) panel_buf.resize(need);
      uint16_t* const buf = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(panel_buf.data()) + 63) &
                                                        ~static_cast<uintptr_t>(63));
      AmxTiles amx;
      for (int64_t p = begin; p < end; ++p) {
        const int64_t t0 = pairs.first_tile(p), nt = pairs.tile_count(p);
        if (m <= 32) {
          multiply(amx, StreamedPanel<Source>{src, t0, nt, pairs.tile_stride, buf}, t0, nt);
        } else {
          panel_expand(src, t0, nt, buf, pairs.tile_stride);
          multiply(amx, ExpandedPanel{buf, nt}, t0, nt);
        }
      }
      amx.flush();
    }
  }
}
#endif
#endif


#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The sum over the four 128-bit lanes of each of a0..a3 (lane dword i of a_q = row 4 q + i): rows 0..15.
inline __m512 lane_sums16(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xee));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xee));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xdd));
}

// Bytes ahead of the current position each stream of the GEMV prefetches: the hardware prefetcher alone
// leaves the arithmetic waiting (a layer's four GEMVs streamed at ~16 GB/s without, ~24 GB/s with, 2 cores).
constexpr int64_t kGemvPrefetch = 2048;

// R input rows times one 16-column tile of the 4-bit panel layout, streamed once (the GEMV of
// plinth_q4p_gemv_bf16). Per 64 bytes of codes (4 k-pairs) the nibbles become bfloat16 `128 + q` by byte
// unpacks with 0x43 (exact: 0x43qq is 128 + q), so one dpbf16 per 4 output columns multiplies them with the
// inputs' k-pairs (xq: each 128-bit lane one k-pair, broadcast); per 32-k block the sums are folded:
// y += d (s - 128 xs) + c xs with xs the block's input sum (w = d q + c, kept in float32, not rounded).
template <int R>
inline void q4p_gemv_tile(const __m512i* xq, const float* xs, int64_t kbs, const uint8_t* codes,
                          const uint16_t* dh, const uint16_t* ch, uint16_t* y, int64_t n, int64_t col) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), magic = _mm512_set1_epi8(0x43);
  const __m512 m128 = _mm512_set1_ps(128.f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < kbs; ++kb) {
    __m512 part[R][4];
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < 4; ++q) part[r][q] = _mm512_setzero_ps();
    _mm_prefetch(reinterpret_cast<const char*>(dh + kb * 16) + kGemvPrefetch / 8, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ch + kb * 16) + kGemvPrefetch / 8, _MM_HINT_T0);
    for (int j = 0; j < 4; ++j) {
      const uint8_t* cj = codes + (kb * 16 + 4 * j) * 16;
      _mm_prefetch(reinterpret_cast<const char*>(cj) + kGemvPrefetch, _MM_HINT_T0);
      const __m512i c = _mm512_loadu_si512(cj);
      const __m512i lo = _mm512_and_si512(c, low4), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
      const __m512bh w[4] = {(__m512bh)_mm512_unpacklo_epi8(lo, magic), (__m512bh)_mm512_unpackhi_epi8(lo, magic),
                             (__m512bh)_mm512_unpacklo_epi8(hi, magic), (__m512bh)_mm512_unpackhi_epi8(hi, magic)};
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xq + r * kbs * 4 + kb * 4 + j);
        for (int q = 0; q < 4; ++q) part[r][q] = _mm512_dpbf16_ps(part[r][q], w[q], xv);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dh + kb * 16)));
    const __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + kb * 16)));
    for (int r = 0; r < R; ++r) {
      const __m512 s = lane_sums16(part[r][0], part[r][1], part[r][2], part[r][3]);
      const __m512 sum_x = _mm512_set1_ps(xs[r * kbs + kb]);
      acc[r] = _mm512_fmadd_ps(d, _mm512_fnmadd_ps(m128, sum_x, s), _mm512_fmadd_ps(c, sum_x, acc[r]));
    }
  }
  const __mmask16 keep = n - col >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - col)) - 1u);
  for (int r = 0; r < R; ++r) _mm256_mask_storeu_epi16(y + r * n + col, keep, (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

constexpr int64_t kGemvMaxRows = 16;

// y [m, N] for 1 <= m <= kGemvMaxRows: per tile, the rows four at a time (the tile's codes come from memory
// once; the later row groups re-read them from L1/L2).
inline void q4p_gemv(const uint16_t* x, int64_t x_stride, const uint8_t* codes, const uint16_t* dh, const uint16_t* ch,
                     uint16_t* y, int64_t m, int64_t n, int64_t k) {
  const int64_t tiles = (n + 15) / 16, kps = k / 2, kbs = k / 32;
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
#pragma omp parallel
  {
    // per thread (each builds its own, so no thread waits for another's caches): per row, the inputs' k-pairs
    // four to a vector (128-bit lane L: k-pair 4 i + L, broadcast) and the 32-feature block sums
    static thread_local std::vector<int32_t> xq_buf;   // kept between calls: no allocation per GEMV
    static thread_local std::vector<float> xs;
    if (xq_buf.size() < static_cast<size_t>(m * kbs * 4 * 16)) xq_buf.resize(static_cast<size_t>(m * kbs * 4 * 16));
    if (xs.size() < static_cast<size_t>(m * kbs)) xs.resize(static_cast<size_t>(m * kbs));
    __m512i* xq = reinterpret_cast<__m512i*>(xq_buf.data());
    for (int64_t r = 0; r < m; ++r) {
      const uint16_t* xr = x + r * x_stride;
      for (int64_t i = 0; i < kbs * 4; ++i)
        _mm512_storeu_si512(xq + r * kbs * 4 + i, _mm512_permutexvar_epi32(
            spread, _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + 8 * i)))));
      for (int64_t kb = 0; kb < kbs; ++kb) {
        const __m512i raw = _mm512_loadu_si512(xr + 32 * kb);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
        xs[r * kbs + kb] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
      }
    }
    // one tile at a time (two at once, with twice the arrays streamed per thread, measured slower); static
    // schedule: each thread reads one contiguous range of tiles
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const uint8_t* ct = codes + t * kps * 16;
      const uint16_t* dt = dh + t * kbs * 16;
      const uint16_t* ot = ch + t * kbs * 16;
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const __m512i* xr = xq + r0 * kbs * 4;
        const float* sr = xs.data() + r0 * kbs;
        uint16_t* yr = y + r0 * n;
        switch (std::min<int64_t>(4, m - r0)) {
          case 1: q4p_gemv_tile<1>(xr, sr, kbs, ct, dt, ot, yr, n, 16 * t); break;
          case 2: q4p_gemv_tile<2>(xr, sr, kbs, ct, dt, ot, yr, n, 16 * t); break;
          case 3: q4p_gemv_tile<3>(xr, sr, kbs, ct, dt, ot, yr, n, 16 * t); break;
          default: q4p_gemv_tile<4>(xr, sr, kbs, ct, dt, ot, yr, n, 16 * t); break;
        }
      }
    }
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
// R input rows (int8 codes xq [R, K], per 32-k block scales sx and float sums xs [R, K/32]) times one pair of
// 16-column tiles of u8 weight codes (k-quad interleaved: per tile and k-quad 64 bytes, byte 4 j + i = column
// j at k = 4 kq + i) with per-block, per-column scales d and offsets c (w = d u + c): per block, integer dot
// products (vpdpbusd: u8 weights x s8 inputs, exact in int32), then acc += d sx * dot + c xs in float32.
template <int R>
inline void q8v_rows(const int8_t* xq, const float* sx, const float* xs, int64_t k, int64_t kbs,
                     const uint8_t* codes, int64_t tile_bytes, const float* d, const float* c, uint16_t* y,
                     int64_t y_stride, int64_t cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kbs; ++b) {
    __m512i iacc[R][2];
    for (int r = 0; r < R; ++r) iacc[r][0] = iacc[r][1] = _mm512_setzero_si512();
    for (int64_t q = 0; q < 8; ++q) {
      const int64_t kq = b * 8 + q;
      const __m512i w0 = _mm512_loadu_si512(codes + kq * 64);
      const __m512i w1 = _mm512_loadu_si512(codes + tile_bytes + kq * 64);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * k + 4 * kq, sizeof(quad));
        const __m512i xb = _mm512_set1_epi32(quad);
        iacc[r][0] = _mm512_dpbusd_epi32(iacc[r][0], w0, xb);
        iacc[r][1] = _mm512_dpbusd_epi32(iacc[r][1], w1, xb);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(d + b * 16), d1 = _mm512_loadu_ps(d + (kbs + b) * 16);
    const __m512 c0 = _mm512_loadu_ps(c + b * 16), c1 = _mm512_loadu_ps(c + (kbs + b) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(sx[r * kbs + b]), m = _mm512_set1_ps(xs[r * kbs + b]);
      acc[r][0] = _mm512_fmadd_ps(c0, m, _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][0]), _mm512_mul_ps(d0, s), acc[r][0]));
      acc[r][1] = _mm512_fmadd_ps(c1, m, _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][1]), _mm512_mul_ps(d1, s), acc[r][1]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 2; ++t) {
      const int64_t c0 = 16 * t;
      if (c0 >= cols) break;
      const __mmask16 keep = cols - c0 >= 16 ? static_cast<__mmask16>(0xffff)
                                             : static_cast<__mmask16>((1u << (cols - c0)) - 1u);
      _mm256_mask_storeu_epi16(y + r * y_stride + c0, keep, (__m256i)_mm512_cvtneps_pbh(acc[r][t]));
    }
}

// One row of bfloat16 inputs -> int8 codes per 32-k block (scale = max |x| / 127, round to nearest even),
// the block scales and the blocks' sums of the quantized inputs (scale x sum of codes).
inline void q8v_quantize_row(const uint16_t* x, int64_t kbs, int8_t* xq, float* sx, float* xs) {
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < kbs; ++b) {
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * b))), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * b + 16))), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign_off), _mm512_and_ps(hi, sign_off)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv));   // MXCSR: round to nearest even
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
    sx[b] = amax / 127.0f;
    // the sum of the quantized inputs, not of the inputs: the offset term then multiplies the same inputs as
    // the codes do, and the error is that of the 8-bit inputs times the (centred) weights d u + c
    xs[b] = sx[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 32 * b), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 32 * b + 16), _mm512_cvtsepi32_epi8(qhi));
  }
}
#endif

#if defined(PLINTH_CPU_AVX2)
namespace {

// bytes ahead of the current codes the float32 GEMV prefetches
constexpr int64_t kGemvF32Prefetch = 2048;
constexpr int64_t kGemvF32MaxRows = 16;

// one 32-k block's codes of a tile (256 bytes), kGemvF32Prefetch bytes ahead
inline void prefetch_block_codes(const uint8_t* cb) {
  for (int line = 0; line < 4; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(cb) + kGemvF32Prefetch + 64 * line, _MM_HINT_T0);
}

// R rows of a tile's 16 float32 sums (columns 0-7, 8-15) into y [R, n] at column col (the last tile may be
// narrower)
template <int R>
inline void store_tile_rows(const __m256 (&acc)[R][2], float* y, int64_t n, int64_t col) {
  const int64_t cols = std::min<int64_t>(16, n - col);
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[16];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    std::memcpy(y + r * n + col, out, sizeof(float) * cols);
  }
}

// R float32 input rows times one 16-column tile of the 4-bit panel layout (8 lanes, AVX2/FMA): per k-pair the 16
// code bytes become the 16 columns' codes at k and at k + 1 (a byte shuffle puts parities apart, low nibbles =
// columns 0-7, high = 8-15), multiplied with the inputs as float32; per 32-k block the sums are folded:
// y += d * s + c * xs with xs the block's input sum (w = d q + c in float32, never rounded).
template <int R>
inline void q4p_gemv_f32_tile(const float* x, int64_t x_stride, int64_t kbs, const uint8_t* codes,
                              const uint16_t* dh, const uint16_t* ch, float* y, int64_t n, int64_t col) {
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m128i parity = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < kbs; ++kb) {
    // eight independent sums per row (columns 0-7 / 8-15, k parity, even / odd k-pair): FMA latency, not
    // throughput, bounded a single chain per column half
    __m256 part[R][8];
    float xs[R];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 8; ++i) part[r][i] = _mm256_setzero_ps();
      const float* xb = x + r * x_stride + kb * 32;
      xs[r] = hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                  _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24))));
    }
    const uint8_t* cb = codes + kb * 16 * 16;
    prefetch_block_codes(cb);
    for (int64_t kp = 0; kp < 16; ++kp) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + kp * 16));
      const __m128i lo = _mm_shuffle_epi8(_mm_and_si128(bytes, low4), parity);                      // cols 0-7: k, k+1
      const __m128i hi = _mm_shuffle_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), parity);   // cols 8-15
      const __m256 q_lo0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      const __m256 q_lo1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      const __m256 q_hi0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      const __m256 q_hi1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
      const int u = static_cast<int>(kp & 1) * 4;
      for (int r = 0; r < R; ++r) {
        const float* xk = x + r * x_stride + kb * 32 + 2 * kp;
        const __m256 x0 = _mm256_broadcast_ss(xk), x1 = _mm256_broadcast_ss(xk + 1);
        part[r][u] = _mm256_fmadd_ps(q_lo0, x0, part[r][u]);
        part[r][u + 1] = _mm256_fmadd_ps(q_lo1, x1, part[r][u + 1]);
        part[r][u + 2] = _mm256_fmadd_ps(q_hi0, x0, part[r][u + 2]);
        part[r][u + 3] = _mm256_fmadd_ps(q_hi1, x1, part[r][u + 3]);
      }
    }
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + kb * 16)));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + kb * 16 + 8)));
    const __m256 c0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + kb * 16)));
    const __m256 c1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + kb * 16 + 8)));
    for (int r = 0; r < R; ++r) {
      const __m256 sx = _mm256_set1_ps(xs[r]);
      const __m256 lo = _mm256_add_ps(_mm256_add_ps(part[r][0], part[r][1]), _mm256_add_ps(part[r][4], part[r][5]));
      const __m256 hi = _mm256_add_ps(_mm256_add_ps(part[r][2], part[r][3]), _mm256_add_ps(part[r][6], part[r][7]));
      acc[r][0] = _mm256_fmadd_ps(d0, lo, _mm256_fmadd_ps(c0, sx, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(d1, hi, _mm256_fmadd_ps(c1, sx, acc[r][1]));
    }
  }
  store_tile_rows<R>(acc, y, n, col);
}


// The 8-bit-input version of the float32 panel GEMV (AVX2): the inputs quantized per row and 32-k block to
// int8 as GGUF's Q8 activations (scale max |x| / 127, round to nearest even; the block's sum is that of the
// quantized inputs, so the result is the product of the weights with the dequantized inputs). Its codes are the
// panels' in the quad order (plinth.kernels.cpu_native.q4_quad_codes, made once at load): per 32 bytes (two
// k-pairs of the tile's 16 columns) dword c of each 128-bit lane holds one column's codes at four consecutive k
// (low nibbles columns 0-7, high nibbles 8-15), so vpmaddubsw multiplies them with the row's four inputs broadcast
// as one dword, straight from the int8 row (which stays in L1), accumulating exact int16 sums (at most 8 x 2 x 15
// x 127 = 30480) over a block; per block vpmaddwd folds each column's two sums to int32 and y += d sx s + c xs in
// float32. (Reordering the panel codes per load instead, a qword permute and a byte shuffle, made the GEMM 15-20%
// slower at 8-64 rows.)
constexpr int64_t kQ8BlockRows = 64;   // rows of one block of plinth_q4p_gemm_f32q8 (their int8 codes stay in L1/L2)

// One float32 row -> int8 codes per 32-k block (scale max |x| / 127, round to nearest even), the blocks'
// scales and the sums of the quantized inputs (scale x sum of codes). With xr, also the rounding left over in
// 1/128 steps of the scale, as int8 codes (|xr| <= 64): x = scale (xq + xr / 128) to ~15 bits.
inline void q8_quantize_row_f32(const float* x, int64_t kbs, int8_t* xq, float* sx, float* xs,
                                int8_t* xr = nullptr) {
  const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < kbs; ++b) {
    const float* xb = x + 32 * b;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], sign_off));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    if (_mm256_movemask_ps(nan) != 0 || std::isinf(top)) {
      // a NaN or an infinity: the block's scale and sum are NaN, so every output it feeds is NaN (as the float32
      // product's would be) rather than the product of saturated codes
      sx[b] = xs[b] = std::nanf("");
      std::memset(xq + 32 * b, 0, 32);
      if (xr != nullptr) std::memset(xr + 32 * b, 0, 32);
      continue;
    }
    const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i q[4], rest[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 t = _mm256_mul_ps(v[j], inv);
      q[j] = _mm256_cvtps_epi32(t);   // MXCSR: round to nearest even
      // t - q is exact (|t - q| <= 1/2 and q is t's nearest integer), and so is its product with 128
      rest[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(t, _mm256_cvtepi32_ps(q[j])), _mm256_set1_ps(128.0f)));
    }
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    if (xr != nullptr) {   // 128 codes + the second plane: the sum in 1/128 steps (exact in int32)
      total = _mm256_add_epi32(_mm256_slli_epi32(total, 7), _mm256_add_epi32(_mm256_add_epi32(rest[0], rest[1]),
                                                                              _mm256_add_epi32(rest[2], rest[3])));
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    sx[b] = top / 127.0f;
    xs[b] = sx[b] * static_cast<float>(_mm_cvtsi128_si32(t)) * (xr != nullptr ? 1.0f / 128.0f : 1.0f);
    // int32 -> int8 (|q| <= 127, no saturation): packs interleave the 128-bit lanes, the permute restores order
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + 32 * b), _mm256_permutevar8x32_epi32(bytes, order));
    if (xr != nullptr) {
      const __m256i rb = _mm256_packs_epi16(_mm256_packs_epi32(rest[0], rest[1]), _mm256_packs_epi32(rest[2], rest[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xr + 32 * b), _mm256_permutevar8x32_epi32(rb, order));
    }
  }
}

// s0 += vpmaddubsw(w0, x4), s1 += vpmaddubsw(w1, x4) with x4 the four int8 inputs at `four` in every dword. Written
// as one asm statement so that the sums stay in registers: from intrinsics GCC kept a loop's eighth sum in memory,
// and the store-to-load forwarding of that spill chained the iterations (a step's GEMMs 7-30% slower at 4-64 rows).
inline void q8_quad_products(__m256i& s0, __m256i& s1, __m256i w0, __m256i w1, const int8_t* four) {
  __m256i x4, p;
  asm("vpbroadcastd %[four], %[x4]\n\t"
      "vpmaddubsw %[x4], %[w0], %[p]\n\t"
      "vpaddw %[p], %[s0], %[s0]\n\t"
      "vpmaddubsw %[x4], %[w1], %[p]\n\t"
      "vpaddw %[p], %[s1], %[s1]"
      : [s0] "+x"(s0), [s1] "+x"(s1), [x4] "=&x"(x4), [p] "=&x"(p)
      : [w0] "x"(w0), [w1] "x"(w1), [four] "m"(*reinterpret_cast<const int32_t*>(four)));
}

// R int8 input rows (row stride k) times one 16-column tile of the codes in the quad order.
template <int R>
inline void q4p_gemm_q8_tile(const int8_t* xq, const float* sx, const float* xs, int64_t k, int64_t kbs,
                             const uint8_t* codes, const uint16_t* dh, const uint16_t* ch, float* y, int64_t n,
                             int64_t col) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < kbs; ++kb) {
    const uint8_t* cb = codes + kb * 16 * 16;
    prefetch_block_codes(cb);
    __m256i sum[R][2];   // int16: per column (0-7 / 8-15) the sums of k = 4 j, 4 j + 1 and of 4 j + 2, 4 j + 3
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
    const int8_t* xb = xq + kb * 32;
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {   // k = 4 j .. 4 j + 3 of the block
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 32 * j));
      const __m256i w0 = _mm256_and_si256(v, low4);                        // columns 0-7
      const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);  // columns 8-15
      for (int r = 0; r < R; ++r) q8_quad_products(sum[r][0], sum[r][1], w0, w1, xb + r * k + 4 * j);
    }
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + kb * 16)));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + kb * 16 + 8)));
    const __m256 c0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + kb * 16)));
    const __m256 c1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + kb * 16 + 8)));
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(sx[r * kbs + kb]), total = _mm256_set1_ps(xs[r * kbs + kb]);
      for (int h = 0; h < 2; ++h) {
        const __m256i s32 = _mm256_madd_epi16(sum[r][h], ones);
        acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(h ? d1 : d0, scale), _mm256_cvtepi32_ps(s32),
                                    _mm256_fmadd_ps(h ? c1 : c0, total, acc[r][h]));
      }
    }
  }
  store_tile_rows<R>(acc, y, n, col);
}

// GGUF Q8_0 rows regrouped eight at a time (plinth.kernels.cpu_native.pack_q8_0_rows8), for the 8-bit-input GEMV:
// per tile of 8 rows and 32-k block kQ8R8Bytes bytes: the 8 rows' float16 scales, then for j = 0..7 a 32-byte
// chunk of the 8 rows' codes 4 j .. 4 j + 3 (row after row). One 32-byte load then holds four codes of each of
// the 8 rows, and vpmaddubsw + vpmaddwd against four inputs broadcast leave one int32 sum per row in each lane:
// no horizontal sums, and the scales of the 8 rows convert in one instruction.
constexpr int64_t kQ8R8Bytes = 16 + 8 * 32;
constexpr int kQ8R8MaxRows = 4;   // input rows per pass over a tile

// One block of a regrouped tile: its bytes kGemvF32Prefetch ahead asked for, the 8 rows' scales as float32
inline __m256 q8_0r8_block_scales(const uint8_t* blk) {
  for (int line = 0; line < kQ8R8Bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk) + kGemvF32Prefetch + line, _MM_HINT_T0);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
}

// R input rows quantized per 32-k block in two planes (q8_quantize_row_f32 with xr: x = sx (xq + xr / 128)) times
// one tile of 8 rows: out [R][8]. vpmaddubsw takes |q| and the inputs with q's signs (llama.cpp's way to multiply
// two signed byte vectors), exact in int16 (at most 2 x 128 x 127 per pair); per block each plane's int32 sums
// (at most 32 x 128 x 127) combine exactly as 128 p + p_r and are scaled in float32.
template <int R>
inline void q8_0r8_tile(const uint8_t* tile, const int8_t* xq, const int8_t* xr, const float* sx, int64_t k,
                        int64_t nb, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * kQ8R8Bytes;
    const __m256 d = q8_0r8_block_scales(blk);
    __m256i p[R], pr[R];
    for (int r = 0; r < R; ++r) p[r] = pr[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j));
      const __m256i aw = _mm256_abs_epi8(w);
      for (int r = 0; r < R; ++r) {
        int32_t four, four_r;
        std::memcpy(&four, xq + r * k + b * 32 + 4 * j, sizeof(four));
        std::memcpy(&four_r, xr + r * k + b * 32 + 4 * j, sizeof(four_r));
        p[r] = _mm256_add_epi32(p[r], _mm256_madd_epi16(
            _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(four), w)), ones));
        pr[r] = _mm256_add_epi32(pr[r], _mm256_madd_epi16(
            _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(four_r), w)), ones));
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(sx[r * nb + b] * (1.0f / 128.0f))),
                               _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(p[r], 7), pr[r])), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// R float32 input rows (row stride x_stride) times one tile of 8 rows of the regrouped Q8_0 layout, in float32:
// out [R][8]. Per 32-byte chunk (four codes of each of the 8 rows) a byte shuffle and a dword permute give, for each
// of the four features, the 8 rows' codes side by side; each is converted once, scaled by the rows' d, and
// multiplied into every input row (an FMA with the row's feature broadcast), the R sums held in registers.
template <int R>
inline void q8_0r8_f32_tile(const uint8_t* tile, const float* x, int64_t x_stride, int64_t nb, float* out) {
  const __m256i by_feature = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                              0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i halves = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * kQ8R8Bytes;
    const __m256 d = q8_0r8_block_scales(blk);
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      // [row][4 features] -> per 128-bit lane [feature][4 rows] -> [feature][8 rows]: 8 bytes per feature
      const __m256i v = _mm256_permutevar8x32_epi32(
          _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j)), by_feature),
          halves);
      const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
      const __m128i f[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
      const float* xk = x + b * 32 + 4 * j;
      for (int kk = 0; kk < 4; ++kk) {
        const __m256 w = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(f[kk])));   // d q, exact
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + r * x_stride + kk), w, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// Two tiles of 8 rows of the regrouped Q8_0 layout (the second may be nullptr: zeros) expanded into a float32 panel
// [K][16] (row-major: a feature's 16 weights d q side by side, exact): per 32-byte chunk (four codes of each of a
// tile's 8 rows) a byte shuffle and a dword permute give each feature's 8 codes side by side, converted once and
// scaled by the rows' d.
inline void q8_0r8_expand_pair(const uint8_t* tile0, const uint8_t* tile1, int64_t nb, float* panel) {
  const __m256i by_feature = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                              0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i halves = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* tile = half ? tile1 : tile0;
    if (tile == nullptr) {
      for (int64_t kk = 0; kk < nb * 32; ++kk) _mm256_store_ps(panel + kk * 16 + 8, _mm256_setzero_ps());
      continue;
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = tile + b * kQ8R8Bytes;
      const __m256 d = q8_0r8_block_scales(blk);
      float* dst = panel + b * 32 * 16 + 8 * half;
      for (int j = 0; j < 8; ++j) {
        // [row][4 features] -> per 128-bit lane [feature][4 rows] -> [feature][8 rows]: 8 bytes per feature
        const __m256i v = _mm256_permutevar8x32_epi32(
            _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j)), by_feature),
            halves);
        const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
        const __m128i f[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
        for (int kk = 0; kk < 4; ++kk)
          _mm256_store_ps(dst + (4 * j + kk) * 16, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(f[kk]))));
      }
    }
  }
}

// R float32 input rows (row stride x_stride) times a float32 panel [K][16]: out [R][16], each sum taken over the
// features in order with one FMA per feature (so a row's sums do not depend on R or on the other rows).
template <int R>
inline void panel16_rows(const float* panel, const float* x, int64_t x_stride, int64_t k, float* out) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m256 w0 = _mm256_load_ps(panel + kk * 16), w1 = _mm256_load_ps(panel + kk * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + kk);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + 16 * r, acc[r][0]);
    _mm256_storeu_ps(out + 16 * r + 8, acc[r][1]);
  }
}

// f(std::integral_constant<int, rows>{}) for 1 <= rows <= N: a kernel templated on its row count, called for a
// run-time one.
template <int N, class F>
inline void with_rows(int rows, F&& f) {
  if constexpr (N > 1) {
    if (rows < N) return with_rows<N - 1>(rows, f);
  }
  f(std::integral_constant<int, N>{});
}

// For every tile of 8 output rows of a regrouped Q8_0 weight (over the threads when `parallel`) and every pass
// of up to PASS input rows: tile_pass(tile, r0, rows, out) leaves the pass's sums in out [rows][8], stored at
// their columns of y [M, N] (the last tile's padded rows dropped).
template <int64_t PASS, class TilePass>
void q8_0r8_tiles(const uint8_t* packed, float* y, int64_t m, int64_t n, int64_t nb, bool parallel,
                  TilePass tile_pass) {
  const int64_t tiles = (n + 7) / 8;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* tile = packed + t * nb * kQ8R8Bytes;
    const int64_t cols = std::min<int64_t>(8, n - 8 * t);
    for (int64_t r0 = 0; r0 < m; r0 += PASS) {
      alignas(32) float out[PASS * 8];
      const int rows = static_cast<int>(std::min<int64_t>(PASS, m - r0));
      tile_pass(tile, r0, rows, out);
      for (int r = 0; r < rows; ++r) std::memcpy(y + (r0 + r) * n + 8 * t, out + 8 * r, sizeof(float) * cols);
    }
  }
}

}  // namespace
#endif

namespace {

// Element types of the per-row ops: T in memory, load/store to float32, and round(v): v rounded to T and
// back (the reference code's intermediate roundings in the activation dtype; none for float32).
struct Bf16 {
  using T = uint16_t;
  static float load(T v) { return bf2f(v); }
  static T store(float v) { return f2bf(v); }
  static float round(float v) { return round_bf(v); }
};
struct F32 {
  using T = float;
  static float load(T v) { return v; }
  static T store(float v) { return v; }
  static float round(float v) { return v; }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// One row of rms_norm_rows<Bf16> on 16-lane vectors: the same lanes, the same tree of partial sums and the same
// roundings (f2bf), so the same bits.
inline void rms_norm_row_bf16(const uint16_t* xr, const uint16_t* rr, const uint16_t* weight, uint16_t* yr, uint16_t* hr,
                              int64_t n, double eps) {
  const int64_t full = n - n % kLanes;
  __m512 part = _mm512_setzero_ps();
  if (rr != nullptr) {   // h = round(x + residual) written first, as the scalar loop does, then its squares
    for (int64_t i = 0; i < full; i += kLanes) {
      const __m512 h = round16_f2bf(_mm512_add_ps(load16_bf(xr + i), load16_bf(rr + i)));
      store16_bf_exact(hr + i, h);
      part = _mm512_fmadd_ps(h, h, part);
    }
    for (int64_t i = full; i < n; ++i) hr[i] = f2bf(bf2f(xr[i]) + bf2f(rr[i]));
    xr = hr;
  } else {
    for (int64_t i = 0; i < full; i += kLanes) {
      const __m512 v = load16_bf(xr + i);
      part = _mm512_fmadd_ps(v, v, part);
    }
  }
  // part[j] += part[j + 8], then + 4, + 2, + 1, as the scalar tree
  const __m256 p8 = _mm256_add_ps(_mm512_castps512_ps256(part), _mm512_extractf32x8_ps(part, 1));
  const __m128 p4 = _mm_add_ps(_mm256_castps256_ps128(p8), _mm256_extractf128_ps(p8, 1));
  const __m128 p2 = _mm_add_ps(p4, _mm_movehl_ps(p4, p4));
  float sum = _mm_cvtss_f32(_mm_add_ss(p2, _mm_shuffle_ps(p2, p2, 1)));
  for (int64_t i = full; i < n; ++i) sum += bf2f(xr[i]) * bf2f(xr[i]);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
  const __m512 iv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < full; i += kLanes) {
    store16_bf(yr + i, _mm512_mul_ps(load16_bf(weight + i), round16_f2bf(_mm512_mul_ps(load16_bf(xr + i), iv))));
  }
  for (int64_t i = full; i < n; ++i) yr[i] = f2bf(bf2f(weight[i]) * round_bf(bf2f(xr[i]) * inv));
}

#endif

template <class E>
void rms_norm_rows(const typename E::T* x, int64_t x_stride, const typename E::T* residual, int64_t r_stride,
                   const typename E::T* weight, typename E::T* y, typename E::T* h_out, int64_t rows, int64_t n,
                   double eps) {
#pragma omp parallel for schedule(static) if (rows * n >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<E, Bf16>) {
      rms_norm_row_bf16(x + r * x_stride, residual != nullptr ? residual + r * r_stride : nullptr, weight, y + r * n,
                        residual != nullptr ? h_out + r * n : nullptr, n, eps);
      continue;
    }
#endif
    const typename E::T* xr = x + r * x_stride;
    typename E::T* yr = y + r * n;
    float part[kLanes] = {0.f};
    const int64_t full = n - n % kLanes;
    if (residual != nullptr) {
      const typename E::T* rr = residual + r * r_stride;
      typename E::T* hr = h_out + r * n;
      for (int64_t i = 0; i < n; ++i) hr[i] = E::store(E::load(xr[i]) + E::load(rr[i]));
      xr = hr;
    }
    for (int64_t i = 0; i < full; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const float v = E::load(xr[i + j]);
        part[j] += v * v;
      }
    for (int width = kLanes / 2; width > 0; width /= 2)
      for (int j = 0; j < width; ++j) part[j] += part[j + width];
    float sum = part[0];
    for (int64_t i = full; i < n; ++i) sum += E::load(xr[i]) * E::load(xr[i]);
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) yr[i] = E::store(E::load(weight[i]) * E::round(E::load(xr[i]) * inv));
  }
}

template <class E>
void silu_mul_rows(const typename E::T* x, int64_t x_stride, typename E::T* y, int64_t rows, int64_t d) {
#pragma omp parallel for schedule(static) if (rows * d >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const typename E::T* gate = x + r * x_stride;
    const typename E::T* up = gate + d;
    typename E::T* yr = y + r * d;
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<E, Bf16>)   // 16 lanes at a time (silu_mul16: the same bits), the tail below
      for (; i + kLanes <= d; i += kLanes) store16_bf(yr + i, silu_mul16(load16_bf(gate + i), load16_bf(up + i)));
#endif
    for (; i < d; ++i) {
      const float g = E::load(gate[i]);
      const float e = exp_nonpositive(-std::fabs(g));            // exp(-|g|)
      // one quotient for both signs, then a select (no branch, so the loop vectorises): sigmoid(g) = 1 / (1 + e)
      // for g >= 0, e / (1 + e) = e * (1 / (1 + e)) below (one float32 rounding more than a second division,
      // far below the bfloat16 rounding of the product)
      const float inv = 1.f / (1.f + e);
      // below -87 exp_nonpositive stops at exp(-87): there the sigmoid underflows to 0 (torch's float32 one reaches 0
      // by -104), so g * sig is -0 for finite g and NaN for -inf, as torch's
      const float sig = g >= 0.f ? inv : (g < -87.f ? 0.f : e * inv);
      yr[i] = E::store(E::round(g * sig) * E::load(up[i]));
    }
  }
}

// One token per row of x [rows, vocab] (row stride x_stride) drawn from softmax(x / temperature[r]) by the
// inverse CDF with the uniform u[r] in [0, 1): the first token whose running sum of p = exp((x - max) / T)
// exceeds u[r] times the row's total (torch.searchsorted(cumsum, u * total, right=True) over the probabilities).
// p is exactly 0 below exp's range (z < -87), so a token of probability 0 (-inf) is never drawn; the sums are
// float32 over chunks of kSampleChunk tokens and float64 across chunks (the chosen chunk rescanned token by token),
// so the pick can differ from the float64 search of torch's float32 softmax only where u * total lies within
// float32 rounding of a boundary between two tokens. A row whose total is not a positive finite number (NaN
// logits) gets vocab - 1, as the clamped search does.
constexpr int64_t kSampleChunk = 1024;

template <class E>
void sample_rows(const typename E::T* x, int64_t x_stride, int64_t rows, int64_t vocab, const float* temperature,
                 const double* u, int64_t* out) {
  const int64_t chunks = (vocab + kSampleChunk - 1) / kSampleChunk;
#pragma omp parallel for schedule(static) if (rows * vocab >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const typename E::T* xr = x + r * x_stride;
    const float inv = 1.f / temperature[r];
    float lanes[kLanes];
    for (int j = 0; j < kLanes; ++j) lanes[j] = -std::numeric_limits<float>::infinity();
    const int64_t full = vocab - vocab % kLanes;
    for (int64_t i = 0; i < full; i += kLanes)
      for (int j = 0; j < kLanes; ++j) lanes[j] = std::max(lanes[j], E::load(xr[i + j]));
    float top = lanes[0];
    for (int j = 1; j < kLanes; ++j) top = std::max(top, lanes[j]);
    for (int64_t i = full; i < vocab; ++i) top = std::max(top, E::load(xr[i]));
    const auto prob = [top, inv](float v) {
      const float z = (v - top) * inv;
      return z < -87.f ? 0.f : exp_nonpositive(z);
    };
    std::vector<double> sums(static_cast<size_t>(chunks));
    double total = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t lo = c * kSampleChunk, hi = std::min(vocab, lo + kSampleChunk);
      const int64_t body = lo + (hi - lo) / kLanes * kLanes;
      float part[kLanes] = {0.f};
      for (int64_t i = lo; i < body; i += kLanes)
        for (int j = 0; j < kLanes; ++j) part[j] += prob(E::load(xr[i + j]));
      double sum = 0.0;
      for (int j = 0; j < kLanes; ++j) sum += part[j];
      for (int64_t i = body; i < hi; ++i) sum += prob(E::load(xr[i]));
      sums[c] = sum;
      total += sum;
    }
    if (!(total > 0.0) || !std::isfinite(total)) {
      out[r] = vocab - 1;
      continue;
    }
    const double target = u[r] * total;
    double run = 0.0;
    int64_t c = 0;
    while (c + 1 < chunks && run + sums[c] <= target) run += sums[c++];
    int64_t pick = -1, last = -1;
    for (int64_t i = c * kSampleChunk; i < std::min(vocab, (c + 1) * kSampleChunk); ++i) {
      const float p = prob(E::load(xr[i]));
      if (p <= 0.f) continue;
      last = i;
      run += p;
      if (run > target) {
        pick = i;
        break;
      }
    }
    // the float32 chunk sums and the token-by-token sum round differently: past the chunk's end, its last
    // token with a probability (or the row's, when the chunk has none)
    for (int64_t i = vocab - 1; pick < 0 && last < 0 && i >= 0; --i)
      if (prob(E::load(xr[i])) > 0.f) last = i;
    out[r] = pick >= 0 ? pick : last;
  }
}

template <class E>
void rotary_heads(typename E::T* q, int64_t q_tok, int64_t q_head, int64_t hq, typename E::T* k, int64_t k_tok,
                  int64_t k_head, int64_t hk, const typename E::T* cos, const typename E::T* sin, int64_t c_stride,
                  int64_t tokens, int64_t rot_dim) {
  const int64_t half = rot_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * (hq + hk) * rot_dim >= kParallelWork)
  for (int64_t t = 0; t < tokens; ++t) {
    const typename E::T* c = cos + t * c_stride;
    const typename E::T* s = sin + t * c_stride;
    for (int64_t h = 0; h < hq + hk; ++h) {
      typename E::T* x = h < hq ? q + t * q_tok + h * q_head : k + t * k_tok + (h - hq) * k_head;
      int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if constexpr (std::is_same_v<E, Bf16>) {   // 16 lanes at a time, the same products, roundings and sums
        const __m512 sign = _mm512_set1_ps(-0.f);
        for (; i + kLanes <= half; i += kLanes) {
          const __m512 x1 = load16_bf(x + i), x2 = load16_bf(x + i + half);
          const __m512 a1 = round16_f2bf(_mm512_mul_ps(x1, load16_bf(c + i)));
          const __m512 b1 = round16_f2bf(_mm512_mul_ps(_mm512_xor_ps(x2, sign), load16_bf(s + i)));
          const __m512 a2 = round16_f2bf(_mm512_mul_ps(x2, load16_bf(c + i + half)));
          const __m512 b2 = round16_f2bf(_mm512_mul_ps(x1, load16_bf(s + i + half)));
          store16_bf(x + i, _mm512_add_ps(a1, b1));
          store16_bf(x + i + half, _mm512_add_ps(a2, b2));
        }
      }
#endif
      for (; i < half; ++i) {
        const float x1 = E::load(x[i]);
        const float x2 = E::load(x[i + half]);
        const float a1 = E::round(x1 * E::load(c[i]));
        const float b1 = E::round(-x2 * E::load(s[i]));
        const float a2 = E::round(x2 * E::load(c[i + half]));
        const float b2 = E::round(x1 * E::load(s[i + half]));
        x[i] = E::store(a1 + b1);
        x[i + half] = E::store(a2 + b2);
      }
    }
  }
}

// GGUF blocks of 32 weights -> float32, as the format's reference dequantization computes them in float32 (ggml's
// published layouts): Q4_0 (float16 d, 16 code bytes) d (q - 8); Q4_1 (float16 d and m, 16 code bytes) d q + m, the
// product rounded before the sum (never fused: the file compiles with the ISO default of no FP contraction); Q8_0
// (float16 d, 32 int8 codes) d q. Nibbles: the low ones are weights 0-15, the high ones 16-31.
constexpr int64_t kGgufQ4_0 = 2, kGgufQ4_1 = 3, kGgufQ8_0 = 8;   // ggml type ids

template <int64_t Type>
inline void gguf_dequant_block(const uint8_t* blk, float* out) {
  uint16_t dh;
  std::memcpy(&dh, blk, sizeof(dh));
  const float d = half2f(dh);
  if constexpr (Type == kGgufQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
  } else if constexpr (Type == kGgufQ4_0) {
    const uint8_t* q = blk + 2;
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>(static_cast<int>(q[i] & 0x0f) - 8);
      out[i + 16] = d * static_cast<float>(static_cast<int>(q[i] >> 4) - 8);
    }
  } else {
    uint16_t mh;
    std::memcpy(&mh, blk + 2, sizeof(mh));
    const float m = half2f(mh);
    const uint8_t* q = blk + 4;
    for (int i = 0; i < 16; ++i) {
      const float lo = d * static_cast<float>(q[i] & 0x0f), hi = d * static_cast<float>(q[i] >> 4);
      out[i] = lo + m;
      out[i + 16] = hi + m;
    }
  }
}

template <int64_t Type>
void gguf_dequant_blocks(const uint8_t* blocks, int64_t n_blocks, int64_t type_size, float* out) {
#pragma omp parallel for schedule(static) if (n_blocks * 32 >= kParallelWork)
  for (int64_t b = 0; b < n_blocks; ++b) gguf_dequant_block<Type>(blocks + b * type_size, out + b * 32);
}

}  // namespace

extern "C" {

int64_t plinth_cpu_ops_abi() { return 14; }

// n_blocks GGUF blocks of ggml type `type` (Q4_0, Q4_1 or Q8_0) -> out [n_blocks * 32] float32. Returns 0, or -1
// for another type (nothing written).
int64_t plinth_gguf_dequant_f32(const uint8_t* blocks, int64_t n_blocks, int64_t type, float* out) {
  switch (type) {
    case kGgufQ4_0: gguf_dequant_blocks<kGgufQ4_0>(blocks, n_blocks, 18, out); return 0;
    case kGgufQ4_1: gguf_dequant_blocks<kGgufQ4_1>(blocks, n_blocks, 20, out); return 0;
    case kGgufQ8_0: gguf_dequant_blocks<kGgufQ8_0>(blocks, n_blocks, 34, out); return 0;
    default: return -1;
  }
}

// y = w * round(h * rsqrt(mean(h^2) + eps)) per row, h = x (no residual) or round(x + residual), round() to
// the activation dtype (bfloat16; float32: none), y rounded once; with a residual, h is written to h_out.
// x/residual rows are strided, y/h_out contiguous [rows, n].
void plinth_rms_norm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* residual, int64_t r_stride,
                          const uint16_t* weight, uint16_t* y, uint16_t* h_out, int64_t rows, int64_t n,
                          double eps) {
  rms_norm_rows<Bf16>(x, x_stride, residual, r_stride, weight, y, h_out, rows, n, eps);
}

void plinth_rms_norm_f32(const float* x, int64_t x_stride, const float* residual, int64_t r_stride,
                         const float* weight, float* y, float* h_out, int64_t rows, int64_t n, double eps) {
  rms_norm_rows<F32>(x, x_stride, residual, r_stride, weight, y, h_out, rows, n, eps);
}

// One token per row of x [rows, vocab] drawn from softmax(x / temperature) with the uniforms u (sample_rows).
void plinth_sample_rows_bf16(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t vocab, const float* temperature,
                             const double* u, int64_t* out) {
  sample_rows<Bf16>(x, x_stride, rows, vocab, temperature, u, out);
}

void plinth_sample_rows_f32(const float* x, int64_t x_stride, int64_t rows, int64_t vocab, const float* temperature,
                            const double* u, int64_t* out) {
  sample_rows<F32>(x, x_stride, rows, vocab, temperature, u, out);
}

// y[t, i] = round(round(silu(x[t, i])) * x[t, d + i]) for x [rows, 2d] (row stride x_stride), y [rows, d].
void plinth_silu_mul_bf16(const uint16_t* x, int64_t x_stride, uint16_t* y, int64_t rows, int64_t d) {
  silu_mul_rows<Bf16>(x, x_stride, y, rows, d);
}

void plinth_silu_mul_f32(const float* x, int64_t x_stride, float* y, int64_t rows, int64_t d) {
  silu_mul_rows<F32>(x, x_stride, y, rows, d);
}

// Rotate-half RoPE in place on the first rot_dim features of every head of q [T, hq, D] and
// k [T, hk, D] (strides per token and per head; features contiguous), with cos/sin [T, rot_dim]
// (the activation dtype, row stride c_stride): out = round(round(x * cos) + round(rotate_half(x) * sin)).
void plinth_rotary_bf16(uint16_t* q, int64_t q_tok, int64_t q_head, int64_t hq, uint16_t* k, int64_t k_tok,
                        int64_t k_head, int64_t hk, const uint16_t* cos, const uint16_t* sin, int64_t c_stride,
                        int64_t tokens, int64_t rot_dim) {
  rotary_heads<Bf16>(q, q_tok, q_head, hq, k, k_tok, k_head, hk, cos, sin, c_stride, tokens, rot_dim);
}

void plinth_rotary_f32(float* q, int64_t q_tok, int64_t q_head, int64_t hq, float* k, int64_t k_tok,
                       int64_t k_head, int64_t hk, const float* cos, const float* sin, int64_t c_stride,
                       int64_t tokens, int64_t rot_dim) {
  rotary_heads<F32>(q, q_tok, q_head, hq, k, k_tok, k_head, hk, cos, sin, c_stride, tokens, rot_dim);
}

// y [M, N] = x [M, K] @ W^T for W [N, K] in GGUF Q8_0 blocks: 34 bytes per 32 weights, a float16
// scale d then 32 int8 values q; w = d * q. x bfloat16 (row stride x_stride); float32 accumulation (each
// weight as d * q in float32, exact). y float32 (y_f32 = 1: the sums as they are, e.g. an LM head's logits,
// which bfloat16 would round to steps of 1/8 at magnitude 16-32) or bfloat16 (rounded once).
extern "C++" {   // templates need C++ linkage
namespace {

// y [M, N] of a Q8_0 weight: per output row, the input rows kMaxRows at a time through
// dot(row, r0, rows, dots) (the weight row stays in L1 between them)
template <class Dot>
void q8_0_gemv_outputs(const uint8_t* blocks, void* y, int64_t y_f32, int64_t m, int64_t n, int64_t k, Dot dot) {
  const int64_t nb = k / 32;
  float* yf = static_cast<float*>(y);
  uint16_t* yb = static_cast<uint16_t*>(y);
#pragma omp parallel for schedule(static) if (n * k >= kParallelWork)
  for (int64_t o = 0; o < n; ++o) {
    const uint8_t* row = blocks + o * nb * 34;
    float dots[kMaxRows];
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
      dot(row, r0, rows, dots);
      for (int r = 0; r < rows; ++r) {
        if (y_f32) yf[(r0 + r) * n + o] = dots[r];
        else yb[(r0 + r) * n + o] = f2bf(dots[r]);
      }
    }
  }
}

// the rows of plinth_q8_0_gemv on float32 inputs xs [M, K] (contiguous)
void q8_0_gemv_rows(const float* xs, const uint8_t* blocks, void* y, int64_t y_f32, int64_t m, int64_t n,
                    int64_t k) {
  const int64_t nb = k / 32;
  q8_0_gemv_outputs(blocks, y, y_f32, m, n, k, [&](const uint8_t* row, int64_t r0, int rows, float* dots) {
    q8_0_row_dot(row, xs + r0 * k, k, nb, rows, dots);
  });
}

}  // namespace
}  // extern "C++"

void plinth_q8_0_gemv(const uint16_t* x, int64_t x_stride, const uint8_t* blocks, void* y, int64_t y_f32,
                      int64_t m, int64_t n, int64_t k) {
  std::vector<float> xf(static_cast<size_t>(m * k));   // the inputs in float32, converted once
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) xf[r * k + i] = bf2f(x[r * x_stride + i]);
  q8_0_gemv_rows(xf.data(), blocks, y, y_f32, m, n, k);
}

// the same for float32 inputs x (row stride x_stride), used as they are
void plinth_q8_0_gemv_f32(const float* x, int64_t x_stride, const uint8_t* blocks, void* y, int64_t y_f32,
                          int64_t m, int64_t n, int64_t k) {
  std::vector<float> xf;
  if (x_stride != k) {   // q8_0_row_dot reads rows k apart
    xf.resize(static_cast<size_t>(m * k));
    for (int64_t r = 0; r < m; ++r) std::memcpy(xf.data() + r * k, x + r * x_stride, sizeof(float) * k);
    x = xf.data();
  }
  q8_0_gemv_rows(x, blocks, y, y_f32, m, n, k);
}

// y [M, N] (float32) = x [M, K] (float32, row stride x_stride) @ W^T for a Q8_0 weight regrouped by
// plinth.kernels.cpu_native.pack_q8_0_rows8 (ceil(N / 8) tiles, the last one padded with zero rows), the inputs
// quantized per row and 32-k block to two int8 planes (~15 bits, so that an LM head's logits stay within ~1e-4 of
// float32 inputs' and greedy near-ties keep their order): the weights times the dequantized inputs. Returns 0, -1
// where the library was built without AVX2, -2 for M < 1.
int64_t plinth_q8_0r8_gemv_f32q8(const float* x, int64_t x_stride, const uint8_t* packed, float* y, int64_t m,
                                 int64_t n, int64_t k) {
#if defined(PLINTH_CPU_AVX2)
  if (m < 1) return -2;
  const int64_t nb = k / 32;
  thread_local std::vector<int8_t> xq, xr;
  thread_local std::vector<float> sx, xs;
  xq.resize(static_cast<size_t>(m * k));
  xr.resize(static_cast<size_t>(m * k));
  sx.resize(static_cast<size_t>(m * nb));
  xs.resize(static_cast<size_t>(m * nb));
  for (int64_t r = 0; r < m; ++r) q8_quantize_row_f32(x + r * x_stride, nb, xq.data() + r * k, sx.data() + r * nb,
                                                      xs.data() + r * nb, xr.data() + r * k);
  const int8_t* xqp = xq.data();
  const int8_t* xrp = xr.data();
  const float* sxp = sx.data();
  q8_0r8_tiles<kQ8R8MaxRows>(packed, y, m, n, nb, n * k >= kParallelWork,
                             [&](const uint8_t* tile, int64_t r0, int rows, float* out) {
    const int8_t* q = xqp + r0 * k;
    const int8_t* qr = xrp + r0 * k;
    const float* sr = sxp + r0 * nb;
    switch (rows) {
      case 1: q8_0r8_tile<1>(tile, q, qr, sr, k, nb, out); break;
      case 2: q8_0r8_tile<2>(tile, q, qr, sr, k, nb, out); break;
      case 3: q8_0r8_tile<3>(tile, q, qr, sr, k, nb, out); break;
      default: q8_0r8_tile<4>(tile, q, qr, sr, k, nb, out); break;
    }
  });
  return 0;
#else
  (void)x; (void)x_stride; (void)packed; (void)y; (void)m; (void)n; (void)k;
  return -1;
#endif
}

// y [M, N] (float32) = x [M, K] (float32, row stride x_stride) @ W^T for a Q8_0 weight regrouped by
// plinth.kernels.cpu_native.pack_q8_0_rows8, in float32 (each weight d q exact, float32 sums): the inputs as they
// are, any M >= 1. Up to kQ8R8TileMaxRows rows take 8 rows per pass over a tile (its codes then come from L1/L2);
// more rows expand each pair of tiles once into a float32 panel [K][16] and multiply 6 rows per pass with it. Both
// add each row's products in feature order with one FMA each, so a row's sums are the same bits whatever M.
// Returns 0, -1 where the library was built without AVX2, -2 for M < 1.
//
// The most rows that take the tile passes; more expand the weights (2-core AMD EPYC, AVX2, 49,152 x 576 with the
// weights out of the caches, ms, tile passes / panel: 8 rows 5.7 / 5.8, 16 rows 11.9 / 9.2, 31 rows 24.9 / 16.8, 64 rows
// 50.3 / 30.2)
constexpr int64_t kQ8R8TileMaxRows = 8;
int64_t plinth_q8_0r8_gemm_f32(const float* x, int64_t x_stride, const uint8_t* packed, float* y, int64_t m,
                               int64_t n, int64_t k) {
#if defined(PLINTH_CPU_AVX2)
  if (m < 1) return -2;
  const int64_t nb = k / 32, tiles = (n + 7) / 8, pairs = (tiles + 1) / 2;
  if (m <= kQ8R8TileMaxRows) {   // too few rows to pay for expanding the weights: 8 rows per pass over a tile
    q8_0r8_tiles<8>(packed, y, m, n, nb, m * n * k >= kParallelWork,
                    [&](const uint8_t* tile, int64_t r0, int rows, float* out) {
      const float* xr = x + r0 * x_stride;
      with_rows<8>(rows, [&](auto r) { q8_0r8_f32_tile<r.value>(tile, xr, x_stride, nb, out); });
    });
    return 0;
  }
  constexpr int kPass = 6;   // input rows per pass: 12 accumulators, two weight vectors, a broadcast
#pragma omp parallel if (m * n * k >= kParallelWork)
  {
    thread_local std::vector<float> panel_buf;
    panel_buf.resize(static_cast<size_t>(k * 16 + 16));
    float* panel = panel_buf.data() + (16 - (reinterpret_cast<uintptr_t>(panel_buf.data()) / sizeof(float)) % 16) % 16;
#pragma omp for schedule(guided)   // (as plinth_q4p_gemm_f32q8's tiles)
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8_t* t0 = packed + 2 * p * nb * kQ8R8Bytes;
      q8_0r8_expand_pair(t0, 2 * p + 1 < tiles ? t0 + nb * kQ8R8Bytes : nullptr, nb, panel);
      const int64_t cols = std::min<int64_t>(16, n - 16 * p);
      for (int64_t r0 = 0; r0 < m; r0 += kPass) {
        alignas(32) float out[kPass * 16];
        const int rows = static_cast<int>(std::min<int64_t>(kPass, m - r0));
        const float* xr = x + r0 * x_stride;
        with_rows<kPass>(rows, [&](auto r) { panel16_rows<r.value>(panel, xr, x_stride, k, out); });
        for (int r = 0; r < rows; ++r) std::memcpy(y + (r0 + r) * n + 16 * p, out + 16 * r, sizeof(float) * cols);
      }
    }
  }
  return 0;
#else
  (void)x; (void)x_stride; (void)packed; (void)y; (void)m; (void)n; (void)k;
  return -1;
#endif
}

// y [M, N] = x [M, K] @ W^T for W in plinth's panel layout of 4-bit weights (built from GGUF Q4_0/Q4_1
// blocks by plinth.kernels.cpu_native.pack_q4): tiles of 16 output columns; codes [T, K/2, 16] bytes
// (byte j of a k-pair: low nibble = column j/2 at k parity j%2, high nibble = column 8 + j/2), per tile and
// 32-k block float16 scales d and offsets c [T, K/32, 16]: w = d * q + c, rounded to bfloat16 (the model's
// dequantized weights). Each thread expands two tiles at a time into a k-pair-interleaved bfloat16 panel and
// multiplies every input row with it (dpbf16, inputs broadcast). Returns 0, or -1 without AVX512-BF16.
int64_t plinth_q4p_gemm_bf16(const uint16_t* x, int64_t x_stride, const uint8_t* codes, const uint16_t* dh,
                             const uint16_t* ch, uint16_t* y, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  q4p_for_each_pair(codes, dh, ch, n, k, true, [&](const uint16_t* wbuf, int64_t t0, int64_t nt) {
    const int64_t cols = std::min<int64_t>(32, n - 16 * t0);
    if (nt == 2) q4p_all_rows<2>(x, x_stride, wbuf, k / 2, y + 16 * t0, n, m, cols);
    else q4p_all_rows<1>(x, x_stride, wbuf, k / 2, y + 16 * t0, n, m, cols);
  });
  return 0;
#else
  (void)x; (void)x_stride; (void)codes; (void)dh; (void)ch; (void)y; (void)m; (void)n; (void)k;
  return -1;
#endif
}

// Asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; granted to the whole
// process, once): 0 when the tile instructions may run, -1 where the library was built without AMX-BF16 or the
// kernel refuses.
int64_t plinth_amx_init() {
#if defined(PLINTH_CPU_AMX)
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0 ? 0 : -1;
#else
  return -1;
#endif
}

// plinth_q4p_gemm_bf16 with AMX tiles: each thread expands two tiles of 16 columns into the same k-pair-interleaved
// bfloat16 panel, which is already the tile layout of AMX's right-hand operand (per 32-k block 16 rows of k-pairs,
// 64 bytes each), then per 32 input rows and 32-k block two input tiles times the two weight tiles (tdpbf16ps,
// float32 sums) into four accumulator tiles; y rounded to bfloat16 once. The same bfloat16-rounded weights and
// float32 sums as plinth_q4p_gemm_bf16 (in another order). Returns 0, or -1 without AMX-BF16 (call
// plinth_amx_init first: without the tile state the instructions fault).
int64_t plinth_q4p_gemm_amx(const uint16_t* x, int64_t x_stride, const uint8_t* codes, const uint16_t* dh,
                            const uint16_t* ch, uint16_t* y, int64_t m, int64_t n, int64_t k) {
#if defined(PLINTH_CPU_AMX)
  amx_for_each_pair(Q4PanelSource{codes, dh, ch, k}, n, m, n > 32 && m * n * k >= kParallelWork, false,
                    [&](AmxTiles& amx, const auto& panel, int64_t t0, int64_t nt) {
    amx.gemm<AmxTiles::Out::kStore>(x, x_stride, panel, nt, k, y + 16 * t0, n, m, std::min<int64_t>(32, n - 16 * t0));
  });
  return 0;
#else
  (void)x; (void)x_stride; (void)codes; (void)dh; (void)ch; (void)y; (void)m; (void)n; (void)k;
  return -1;
#endif
}

// act [M, N/2] = silu(x @ W_gate^T) * (x @ W_up^T) for a gate/up weight of N = 2 I columns (gate rows, then up
// rows; I a multiple of 16), x [M, K] bfloat16: plinth_q4p_gemm_amx over pairs of a gate tile and its up tile, the
// activation applied to the tiles' sums (rounded to bfloat16 first) before anything is written: the bits of
// plinth_q4p_gemm_amx followed by plinth_silu_mul_bf16, without the [M, N] intermediate. Returns 0, -1 without
// AMX-BF16 (call plinth_amx_init first), -2 for N not a multiple of 32.
int64_t plinth_q4p_gemm_amx_silu(const uint16_t* x, int64_t x_stride, const uint8_t* codes, const uint16_t* dh,
                                 const uint16_t* ch, uint16_t* act, int64_t m, int64_t n, int64_t k) {
#if defined(PLINTH_CPU_AMX)
  if (n % 32 != 0) return -2;
  const int64_t inter = n / 2;
  amx_for_each_pair(Q4PanelSource{codes, dh, ch, k}, n, m, m * n * k >= kParallelWork, true,
                    [&](AmxTiles& amx, const auto& panel, int64_t t0, int64_t nt) {
    amx.gemm<AmxTiles::Out::kSilu>(x, x_stride, panel, nt, k, act + 16 * t0, inter, m, 16);
  });
  return 0;
#else
  (void)x; (void)x_stride; (void)codes; (void)dh; (void)ch; (void)act; (void)m; (void)n; (void)k;
  return -1;
#endif
}

// y [M, N] float32 = x [M, K] (bfloat16) @ W^T for a GGUF Q8_0 weight regrouped into 8-bit panels
// (plinth.kernels.cpu_native.pack_q8_panels: codes [ceil(N/16)][K/32][512], float16 scales [ceil(N/16)][K/32][16];
// padding columns zero) on AMX tiles: each pair of 16-column tiles expanded to bfloat16 w = d q (the bfloat16
// weight the file converts to), float32 sums written unrounded (an LM head's logits). Returns 0, or -1 without
// AMX-BF16 (call plinth_amx_init first).
int64_t plinth_q8p_gemm_amx(const uint16_t* x, int64_t x_stride, const int8_t* codes, const uint16_t* scales,
                            float* y, int64_t m, int64_t n, int64_t k) {
#if defined(PLINTH_CPU_AMX)
  amx_for_each_pair(Q8PanelSource{codes, scales, k}, n, m, n > 32 && m * n * k >= kParallelWork, false,
                    [&](AmxTiles& amx, const auto& panel, int64_t t0, int64_t nt) {
    amx.gemm<AmxTiles::Out::kF32>(x, x_stride, panel, nt, k, y + 16 * t0, n, m, std::min<int64_t>(32, n - 16 * t0));
  });
  return 0;
#else
  (void)x; (void)x_stride; (void)codes; (void)scales; (void)y; (void)m; (void)n; (void)k;
  return -1;
#endif
}

// y [M, N] = x [M, K] @ W^T for 1 <= M <= 16 rows over the same panel layout as plinth_q4p_gemm_bf16, reading the
// codes once in memory order (no bfloat16 panel in between): the small-batch decode GEMV. The weights are
// w = d * q + c in float32 (not rounded to bfloat16 first); float32 accumulation, y rounded to bfloat16 once.
// Returns 0, -1 without AVX512-BF16, -2 for M outside 1..16.
int64_t plinth_q4p_gemv_bf16(const uint16_t* x, int64_t x_stride, const uint8_t* codes, const uint16_t* dh,
                             const uint16_t* ch, uint16_t* y, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (m < 1 || m > kGemvMaxRows) return -2;
  q4p_gemv(x, x_stride, codes, dh, ch, y, m, n, k);
  return 0;
#else
  (void)x; (void)x_stride; (void)codes; (void)dh; (void)ch; (void)y; (void)m; (void)n; (void)k;
  return -1;
#endif
}


// y [M, N] (float32) = x [M, K] (float32, row stride x_stride) @ W^T over the panel layout of
// plinth_q4p_gemm_bf16, for 1 <= M <= 16: the decode GEMV of float32 models on CPUs without native bfloat16.
// w = d * q + c in float32, float32 inputs as they are, float32 accumulation. Returns 0, -1 where the library
// was built without AVX2/FMA/F16C, -2 for M outside 1..16.
int64_t plinth_q4p_gemv_f32(const float* x, int64_t x_stride, const uint8_t* codes, const uint16_t* dh,
                            const uint16_t* ch, float* y, int64_t m, int64_t n, int64_t k) {
#if defined(PLINTH_CPU_AVX2)
  if (m < 1 || m > kGemvF32MaxRows) return -2;
  const int64_t tiles = (n + 15) / 16, kps = k / 2, kbs = k / 32;
#pragma omp parallel for schedule(static) if (n * k >= kParallelWork)
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* ct = codes + t * kps * 16;
    const uint16_t* dt = dh + t * kbs * 16;
    const uint16_t* cht = ch + t * kbs * 16;
    for (int64_t r0 = 0; r0 < m; r0 += 4) {   // rows four at a time (the tile's codes stay in L1/L2)
      const float* xr = x + r0 * x_stride;
      float* yr = y + r0 * n;
      switch (std::min<int64_t>(4, m - r0)) {
        case 1: q4p_gemv_f32_tile<1>(xr, x_stride, kbs, ct, dt, cht, yr, n, t * 16); break;
        case 2: q4p_gemv_f32_tile<2>(xr, x_stride, kbs, ct, dt, cht, yr, n, t * 16); break;
        case 3: q4p_gemv_f32_tile<3>(xr, x_stride, kbs, ct, dt, cht, yr, n, t * 16); break;
        default: q4p_gemv_f32_tile<4>(xr, x_stride, kbs, ct, dt, cht, yr, n, t * 16); break;
      }
    }
  }
  return 0;
#else
  (void)x; (void)x_stride; (void)codes; (void)dh; (void)ch; (void)y; (void)m; (void)n; (void)k;
  return -1;
#endif
}

// y [M, N] (float32) = x [M, K] (float32, row stride x_stride) @ W^T over the panel codes in the quad order and
// the panels' scales and offsets, any M >= 1, with the inputs quantized to int8 per row and 32-k block (see
// q4p_gemm_q8_tile): the product of the weights with the dequantized inputs, in float32. The rows are quantized
// by the threads together; then rows go in blocks of kQ8BlockRows (their int8 codes stay in L1/L2), each block's
// tiles spread over the threads in guided chunks (a
// static split left one thread waiting for the other whenever the machine slowed one down: 32 rows 28.6 against
// 25.2 ms a step's GEMMs then; the same where neither was), four rows at a time per tile (its codes then come from
// L1). Returns 0, -1 where the library was built without AVX2/FMA/F16C, -2 for M < 1.
int64_t plinth_q4p_gemm_f32q8(const float* x, int64_t x_stride, const uint8_t* codes, const uint16_t* dh,
                              const uint16_t* ch, float* y, int64_t m, int64_t n, int64_t k) {
#if defined(PLINTH_CPU_AVX2)
  if (m < 1) return -2;
  const int64_t tiles = (n + 15) / 16, kps = k / 2, kbs = k / 32;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> sx, xs;
  xq.resize(static_cast<size_t>(m * k));
  sx.resize(static_cast<size_t>(m * kbs));
  xs.resize(static_cast<size_t>(m * kbs));
  int8_t* xqd = xq.data();   // (the calling thread's buffers: their pointers go to the team)
  float* sxd = sx.data();
  float* xsd = xs.data();
#pragma omp parallel if (n * k >= kParallelWork)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r)
      q8_quantize_row_f32(x + r * x_stride, kbs, xqd + r * k, sxd + r * kbs, xsd + r * kbs);
    for (int64_t b0 = 0; b0 < m; b0 += kQ8BlockRows) {
      const int64_t rows = std::min<int64_t>(kQ8BlockRows, m - b0);
      const int8_t* xqp = xqd + b0 * k;
      const float* sxp = sxd + b0 * kbs;
      const float* xsp = xsd + b0 * kbs;
      float* yb = y + b0 * n;
#pragma omp for schedule(guided) nowait
      for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t* ct = codes + t * kps * 16;
        const uint16_t* dt = dh + t * kbs * 16;
        const uint16_t* cht = ch + t * kbs * 16;
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
          const int8_t* xr = xqp + r0 * k;
          const float* sr = sxp + r0 * kbs;
          const float* tr = xsp + r0 * kbs;
          float* yr = yb + r0 * n;
          switch (std::min<int64_t>(4, rows - r0)) {   // (not with_rows: through its lambda GCC made this 50% slower)
            case 1: q4p_gemm_q8_tile<1>(xr, sr, tr, k, kbs, ct, dt, cht, yr, n, t * 16); break;
            case 2: q4p_gemm_q8_tile<2>(xr, sr, tr, k, kbs, ct, dt, cht, yr, n, t * 16); break;
            case 3: q4p_gemm_q8_tile<3>(xr, sr, tr, k, kbs, ct, dt, cht, yr, n, t * 16); break;
            default: q4p_gemm_q8_tile<4>(xr, sr, tr, k, kbs, ct, dt, cht, yr, n, t * 16); break;
          }
        }
      }
    }
  }
  return 0;
#else
  (void)x; (void)x_stride; (void)codes; (void)dh; (void)ch; (void)y; (void)m; (void)n; (void)k;
  return -1;
#endif
}

// y [M, N] = x [M, K] @ W^T with 8-bit arithmetic (AVX512-VNNI): W as u8 codes in plinth's VNNI panel layout
// (built by plinth.kernels.cpu_native.pack_vnni_panels: tiles of 16 output columns in pairs, codes
// [T, K/4, 64], per tile and 32-k block float32 scales d and offsets c [T, K/32, 16], w = d u + c; GGUF
// Q4_0/Q4_1/Q8_0 blocks map exactly), the inputs quantized per row and 32-k block to int8 (as GGUF's Q8
// activations). Returns 0, or -1 where the library was built without AVX512-VNNI/BF16.
int64_t plinth_q8v_gemm_bf16(const uint16_t* x, int64_t x_stride, const uint8_t* codes, const float* d,
                             const float* c, uint16_t* y, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  const int64_t kbs = k / 32, pairs = (n + 31) / 32, tile_bytes = (k / 4) * 64;
  std::vector<int8_t> xq(static_cast<size_t>(m * k));
  std::vector<float> sx(static_cast<size_t>(m * kbs)), xs(static_cast<size_t>(m * kbs));
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) q8v_quantize_row(x + r * x_stride, kbs, xq.data() + r * k, sx.data() + r * kbs, xs.data() + r * kbs);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8_t* cp = codes + 2 * p * tile_bytes;
      const float* dp = d + 2 * p * kbs * 16;
      const float* op = c + 2 * p * kbs * 16;
      const int64_t cols = std::min<int64_t>(32, n - 32 * p);
      uint16_t* yp = y + 32 * p;
      int64_t r0 = 0;
      for (; r0 + 4 <= m; r0 += 4)
        q8v_rows<4>(xq.data() + r0 * k, sx.data() + r0 * kbs, xs.data() + r0 * kbs, k, kbs, cp, tile_bytes, dp, op, yp + r0 * n, n, cols);
      for (; r0 < m; ++r0)
        q8v_rows<1>(xq.data() + r0 * k, sx.data() + r0 * kbs, xs.data() + r0 * kbs, k, kbs, cp, tile_bytes, dp, op, yp + r0 * n, n, cols);
    }
  }
  return 0;
#else
  (void)x; (void)x_stride; (void)codes; (void)d; (void)c; (void)y; (void)m; (void)n; (void)k;
  return -1;
#endif
}

}  // extern "C"

namespace {
// The keys (half 0) and values (half 1) of `tokens` tokens into a [2, slots, ...] cache: copy(half, t, slot) for each
// token whose slot lies in the cache (negative ones are skipped). A prompt's two halves are written by two threads:
// they lie in different pages, and a prompt's slots are often pages the cache has not used yet, whose first write
// makes the kernel zero them (a 2 MiB page at a time under transparent huge pages), so they fault in side by side.
template <class Copy>
void scatter_kv(int64_t tokens, const int64_t* slots, int64_t num_slots, int64_t work, Copy copy) {
#pragma omp parallel for schedule(static, 1) if (work >= kParallelWork)
  for (int64_t half = 0; half < 2; ++half)
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t s = slots[t];
      if (s >= 0 && s < num_slots) copy(half, t, s);
    }
}

// x rounded to FP8 E4M3 (torch.float8_e4m3fn) as torch rounds x.clamp(-448, 448): magnitudes clamped to 448, nearest
// even, below 2^-6 multiples of 2^-9; NaN as 0xFF.
inline uint8_t e4m3_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if (std::isnan(x)) return 0xFF;
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const float a = std::min(std::fabs(x), 448.f);
  if (a < 0.015625f) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));
  std::memcpy(&u, &a, sizeof(u));
  return sign | static_cast<uint8_t>(((u + 0x7FFFFu + ((u >> 20) & 1u)) >> 20) - 0x3C0u);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// e4m3_of on 16 lanes
inline __m128i e4m3_of16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(448.f));
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
  const __m512i ua = _mm512_castps_si512(a);
  const __m512i even = _mm512_and_si512(_mm512_srli_epi32(ua, 20), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_sub_epi32(
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(ua, _mm512_set1_epi32(0x7FFFF)), even), 20),
      _mm512_set1_epi32(0x3C0));
  const __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.f)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(small, normal, sub), sign);
  code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0xFF));
  return _mm512_cvtepi32_epi8(code);
}
#endif
}  // namespace

extern "C" {

// Scatter the keys and values of `tokens` tokens (rows of `row_bytes` bytes: heads x head size x element size, token
// strides k_stride/v_stride bytes) into a [2, slots, row] cache at slots[t] (scatter_kv).
void plinth_kv_write(const uint8_t* key, int64_t k_stride, const uint8_t* value, int64_t v_stride, uint8_t* cache,
                     int64_t num_slots, const int64_t* slots, int64_t tokens, int64_t row_bytes) {
  scatter_kv(tokens, slots, num_slots, tokens * row_bytes, [&](int64_t half, int64_t t, int64_t s) {
    const uint8_t* src = half == 0 ? key + t * k_stride : value + t * v_stride;
    std::memcpy(cache + (half * num_slots + s) * row_bytes, src, row_bytes);
  });
}

// plinth_kv_write into a bfloat16 cache: float32 keys and values (rows of `row` elements, token strides k_stride /
// v_stride elements) rounded to the nearest bfloat16, ties to even (NaN stays NaN), as torch's conversion rounds.
void plinth_kv_write_f32_bf16(const float* key, int64_t k_stride, const float* value, int64_t v_stride,
                              uint16_t* cache, int64_t num_slots, const int64_t* slots, int64_t tokens, int64_t row) {
  scatter_kv(tokens, slots, num_slots, tokens * row, [&](int64_t half, int64_t t, int64_t s) {
    const float* x = half == 0 ? key + t * k_stride : value + t * v_stride;
    uint16_t* y = cache + (half * num_slots + s) * row;
    for (int64_t i = 0; i < row; ++i) y[i] = f2bf(x[i]);
  });
}

// plinth_kv_write into an FP8 E4M3 cache: bfloat16 keys and values (rows of `row` elements, token strides k_stride /
// v_stride elements) rounded by e4m3_of into a [2, slots, row] byte cache.
void plinth_kv_write_e4m3(const uint16_t* key, int64_t k_stride, const uint16_t* value, int64_t v_stride,
                          uint8_t* cache, int64_t num_slots, const int64_t* slots, int64_t tokens, int64_t row) {
  scatter_kv(tokens, slots, num_slots, tokens * row, [&](int64_t half, int64_t t, int64_t s) {
    const uint16_t* x = half == 0 ? key + t * k_stride : value + t * v_stride;
    uint8_t* y = cache + (half * num_slots + s) * row;
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    for (; i + 16 <= row; i += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), e4m3_of16(load16_bf(x + i)));
#endif
    for (; i < row; ++i) y[i] = e4m3_of(bf2f(x[i]));
  });
}


// ---- a whole decode step of a standard decoder over 4-bit panel weights, in one call ----------------------
// The layers of plinth.worker.cpu_decode_plan run back to back without returning to Python between kernels:
// per layer the same calls, in the same order and on the same buffers, as the plan's Python loop (so the
// results are bit-identical to it), for 1..16 rows. Attention is the paged-attention library's decode entry
// point, passed in as a function pointer (same signature as plinth_cpu_paged_decode).
typedef void (*plinth_attention_fn)(const void*, const void*, const int32_t*, const int32_t*, const int32_t*, void*,
                                    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                    int64_t, double, int64_t, int64_t);

struct PlinthPanelWeight {   // one GEMM's 4-bit panels: codes [T, K/2, 16] (the 8-bit-input step's: in the quad
                             // order), scales/offsets [T, K/32, 16] float16
  const uint8_t* codes;
  const uint16_t* scales;
  const uint16_t* offsets;
  int64_t n, k;
};

struct PlinthDecodeLayer {
  PlinthPanelWeight qkv, o, gate_up, down;
  const void* in_norm;             // [H], the activation dtype (bfloat16 or float32)
  const void* post_norm;
  double eps, post_eps;
  void* kv_cache;                  // [2, num_blocks, block_size, Hkv, D], the activation dtype
  int64_t num_blocks, num_heads, num_kv_heads, head_size;
  double scale;
  int64_t sliding_window;          // <= 0: none
  int64_t kv_narrow;               // 1: kv_cache holds a narrower type than the activations: FP8 E4M3 bytes under
                                   // bfloat16 (attention dtype code 2), bfloat16 under float32 (code 3)
};

struct PlinthDecodeStep {          // every buffer in the activation dtype except the integer ones
  int64_t rows, width, block_size, table_width, rot_dim, threads;
  void* residual;                  // [B, H]: the embedding output in, the residual stream (updated in place)
  const void* cos;                 // [B, rot_dim]
  const void* sin;
  const int64_t* slots;            // [B]
  const int32_t* lens;             // [B]
  const int32_t* starts;           // [B + 1]
  const int32_t* tables;           // [B, table_width]
  void* normed;                    // [B, H]
  void* qkv;                       // [B, (Hq + 2 Hkv) D]
  void* attn;                      // [B, Hq D]
  void* o;                         // [B, H]
  void* gate_up;                   // [B, 2 I]
  void* act;                       // [B, I]
  void* down;                      // [B, H]
  void* out;                       // [B, H]: the final norm's output
  const void* final_norm;
  double final_eps;
  plinth_attention_fn attention;
};

}  // extern "C"

namespace {

// The layers of one decode step for element type E (Bf16 or F32, see rms_norm_rows) with panel GEMV Gemv;
// `dtype` is the attention entry point's dtype code (0 float32, 1 bfloat16).
// GateUpAct, when given, computes the MLP's activation straight from the gate/up weight (returning 0), or returns
// non-zero to leave it to the GEMM and silu_mul_rows.
using PanelGemmFn = int64_t (*)(const uint16_t*, int64_t, const uint8_t*, const uint16_t*, const uint16_t*, uint16_t*,
                                int64_t, int64_t, int64_t);
template <class E, int64_t (*Gemv)(const typename E::T*, int64_t, const uint8_t*, const uint16_t*, const uint16_t*,
                                   typename E::T*, int64_t, int64_t, int64_t),
          PanelGemmFn GateUpAct = nullptr>
int64_t decode_layers(const PlinthDecodeLayer* layers, int64_t num_layers, const PlinthDecodeStep* st,
                      int64_t dtype) {
  using T = typename E::T;
  const int64_t b = st->rows, width = st->width;
  T* residual = static_cast<T*>(st->residual);
  const T* hidden = residual;
  T* normed = static_cast<T*>(st->normed);
  const T* cos = static_cast<const T*>(st->cos);
  const T* sin = static_cast<const T*>(st->sin);
  constexpr int64_t elem = sizeof(T);
  auto gemv = [&](const PlinthPanelWeight& w, const T* x, int64_t x_stride, void* y) {
    return Gemv(x, x_stride, w.codes, w.scales, w.offsets, static_cast<T*>(y), b, w.n, w.k);
  };
  for (int64_t i = 0; i < num_layers; ++i) {
    const PlinthDecodeLayer& lay = layers[i];
    const T* in_norm = static_cast<const T*>(lay.in_norm);
    if (i == 0)   // the residual stream starts as the embedding output itself: nothing to add
      rms_norm_rows<E>(hidden, width, nullptr, 0, in_norm, normed, nullptr, b, width, lay.eps);
    else
      rms_norm_rows<E>(hidden, width, residual, width, in_norm, normed, residual, b, width, lay.eps);
    if (int64_t rc = gemv(lay.qkv, normed, width, st->qkv); rc != 0) return rc;
    const int64_t d = lay.head_size, hq = lay.num_heads, hkv = lay.num_kv_heads, row = lay.qkv.n;
    T* q = static_cast<T*>(st->qkv);
    T* k = q + hq * d;
    T* v = q + (hq + hkv) * d;
    rotary_heads<E>(q, row, d, hq, k, row, d, hkv, cos, sin, st->rot_dim, b, st->rot_dim);
    const int64_t num_slots = lay.num_blocks * st->block_size;
    int64_t attn_dtype = dtype;
    if (lay.kv_narrow && std::is_same_v<E, Bf16> && d != 64 && d != 128) return -1;   // what the FP8 decode reads
    if constexpr (std::is_same_v<E, Bf16>) {
      if (lay.kv_narrow) {
        plinth_kv_write_e4m3(k, row, v, row, static_cast<uint8_t*>(lay.kv_cache), num_slots, st->slots, b, hkv * d);
        attn_dtype = 2;
      }
    } else {
      if (lay.kv_narrow) {
        plinth_kv_write_f32_bf16(k, row, v, row, static_cast<uint16_t*>(lay.kv_cache), num_slots, st->slots, b,
                                 hkv * d);
        attn_dtype = 3;
      }
    }
    if (attn_dtype == dtype)
      plinth_kv_write(reinterpret_cast<const uint8_t*>(k), row * elem, reinterpret_cast<const uint8_t*>(v), row * elem,
                      static_cast<uint8_t*>(lay.kv_cache), num_slots, st->slots, b, hkv * d * elem);
    st->attention(q, lay.kv_cache, st->tables, st->lens, st->starts, st->attn, attn_dtype, b, hq, hkv, d,
                  lay.num_blocks, st->block_size, st->table_width, row, hq * d, lay.scale, lay.sliding_window,
                  st->threads);
    if (int64_t rc = gemv(lay.o, static_cast<const T*>(st->attn), hq * d, st->o); rc != 0) return rc;
    rms_norm_rows<E>(static_cast<const T*>(st->o), width, residual, width, static_cast<const T*>(lay.post_norm),
                     normed, residual, b, width, lay.post_eps);
    const int64_t inter = lay.gate_up.n / 2;
    bool fused = false;
    if constexpr (GateUpAct != nullptr)
      fused = GateUpAct(normed, width, lay.gate_up.codes, lay.gate_up.scales, lay.gate_up.offsets,
                        static_cast<T*>(st->act), b, lay.gate_up.n, lay.gate_up.k) == 0;
    if (!fused) {
      if (int64_t rc = gemv(lay.gate_up, normed, width, st->gate_up); rc != 0) return rc;
      silu_mul_rows<E>(static_cast<const T*>(st->gate_up), lay.gate_up.n, static_cast<T*>(st->act), b, inter);
    }
    if (int64_t rc = gemv(lay.down, static_cast<const T*>(st->act), inter, st->down); rc != 0) return rc;
    hidden = static_cast<const T*>(st->down);
  }
  rms_norm_rows<E>(hidden, width, residual, width, static_cast<const T*>(st->final_norm), static_cast<T*>(st->out),
                   residual, b, width, st->final_eps);
  return 0;
}

#if defined(PLINTH_CPU_AMX)
// The GEMM of the AMX decode step: the panel GEMV up to kGemvAmxMaxRows rows (it reads the codes once), the AMX panel
// GEMM past them (its cost is the bfloat16 expansion, the same for any row count). plinth.kernels.cpu_native routes
// rows the same way (Q4_GEMV_AMX_MAX_ROWS), so the fused step equals the plan's Python loop.
constexpr int64_t kGemvAmxMaxRows = 8;
int64_t q4p_gemm_amx_step(const uint16_t* x, int64_t x_stride, const uint8_t* codes, const uint16_t* dh,
                          const uint16_t* ch, uint16_t* y, int64_t m, int64_t n, int64_t k) {
  return m <= kGemvAmxMaxRows ? plinth_q4p_gemv_bf16(x, x_stride, codes, dh, ch, y, m, n, k)
                              : plinth_q4p_gemm_amx(x, x_stride, codes, dh, ch, y, m, n, k);
}
// The gate/up GEMM of the AMX decode step with the activation fused (the rows the AMX GEMM takes; 1 otherwise)
int64_t q4p_gate_up_amx_step(const uint16_t* x, int64_t x_stride, const uint8_t* codes, const uint16_t* dh,
                             const uint16_t* ch, uint16_t* act, int64_t m, int64_t n, int64_t k) {
  return m <= kGemvAmxMaxRows ? 1 : plinth_q4p_gemm_amx_silu(x, x_stride, codes, dh, ch, act, m, n, k);
}
#endif

}  // namespace

extern "C" {

// Returns 0, -1 without AVX512-BF16 (nothing written), -2 for a row count outside 1..16.
int64_t plinth_decode_layers_bf16(const PlinthDecodeLayer* layers, int64_t num_layers, const PlinthDecodeStep* st) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (st->rows < 1 || st->rows > kGemvMaxRows) return -2;
  return decode_layers<Bf16, plinth_q4p_gemv_bf16>(layers, num_layers, st, 1);
#else
  (void)layers; (void)num_layers; (void)st;
  return -1;
#endif
}

// The same for any row count >= 1 with the GEMMs of more than kGemvAmxMaxRows rows on AMX tiles (plinth_amx_init
// first). Returns 0, -1 where the library was built without AMX-BF16 (nothing written), -2 for no rows.
int64_t plinth_decode_layers_amx(const PlinthDecodeLayer* layers, int64_t num_layers, const PlinthDecodeStep* st) {
#if defined(PLINTH_CPU_AMX)
  if (st->rows < 1) return -2;
  return decode_layers<Bf16, q4p_gemm_amx_step, q4p_gate_up_amx_step>(layers, num_layers, st, 1);
#else
  (void)layers; (void)num_layers; (void)st;
  return -1;
#endif
}

// The same for float32 models over the float32 panel GEMV (CPUs with AVX2/FMA/F16C): returns 0, -1 where the
// library was built without them (nothing written), -2 for a row count outside 1..16.
int64_t plinth_decode_layers_f32(const PlinthDecodeLayer* layers, int64_t num_layers, const PlinthDecodeStep* st) {
#if defined(PLINTH_CPU_AVX2)
  if (st->rows < 1 || st->rows > kGemvF32MaxRows) return -2;
  return decode_layers<F32, plinth_q4p_gemv_f32>(layers, num_layers, st, 0);
#else
  (void)layers; (void)num_layers; (void)st;
  return -1;
#endif
}

// The same with the 8-bit-input GEMM (plinth_q4p_gemm_f32q8, its codes in the quad order) for every projection, for
// any row count >= 1.
int64_t plinth_decode_layers_f32q8(const PlinthDecodeLayer* layers, int64_t num_layers, const PlinthDecodeStep* st) {
#if defined(PLINTH_CPU_AVX2)
  if (st->rows < 1) return -2;
  return decode_layers<F32, plinth_q4p_gemm_f32q8>(layers, num_layers, st, 0);
#else
  (void)layers; (void)num_layers; (void)st;
  return -1;
#endif
}

}  // extern "C"

// One decode token of a gated DeltaNet layer for each of `batch` sequences, every value head: the state of head h of
// sequence b is state[rows[b] * row_stride + h * kd * vd ...] ([kd, vd] float32, row-major), updated in place:
//   e = exp(g), S = e S, w = beta (v - S^T k), S = S + k w^T, out = S^T q
// computed as r_k = S^T k and r_q = S^T q over the state before the decay (one read), w = beta (v - e r_k),
// out = e r_q + (k . q) w, then S = e S + k w^T (one write; a head's state stays in cache between the two). q, k
// [batch, heads, kd], v and out [batch, heads, vd], g and beta [batch, heads], all float32 and contiguous.
// Returns 0, or -1 for a value head size over 512 (nothing written).
extern "C" int64_t plinth_gated_delta_step_f32(float* state, int64_t row_stride, const int64_t* rows, int64_t batch,
                                               int64_t heads, int64_t kd, int64_t vd, const float* q, const float* k,
                                               const float* v, const float* g, const float* beta, float* out) {
  constexpr int64_t kMaxV = 512;
  if (vd > kMaxV) return -1;
  const int64_t items = batch * heads;
#pragma omp parallel for schedule(static) if (items * kd * vd >= (1 << 15))
  for (int64_t item = 0; item < items; ++item) {
    const int64_t b = item / heads, h = item % heads;
    float* s = state + rows[b] * row_stride + h * kd * vd;
    const float* qi = q + item * kd;
    const float* ki = k + item * kd;
    const float* vi = v + item * vd;
    float* oi = out + item * vd;
    const float e = std::exp(g[item]), bt = beta[item];
    float rk[kMaxV], rq[kMaxV], w[kMaxV];
    for (int64_t j = 0; j < vd; ++j) rk[j] = rq[j] = 0.f;
    float kq = 0.f;
    for (int64_t i = 0; i < kd; ++i) {
      const float* si = s + i * vd;
      const float a = ki[i], c = qi[i];
      kq += a * c;
      for (int64_t j = 0; j < vd; ++j) {
        rk[j] += si[j] * a;
        rq[j] += si[j] * c;
      }
    }
    for (int64_t j = 0; j < vd; ++j) {
      w[j] = bt * (vi[j] - e * rk[j]);
      oi[j] = e * rq[j] + kq * w[j];
    }
    for (int64_t i = 0; i < kd; ++i) {
      float* si = s + i * vd;
      const float a = ki[i];
      for (int64_t j = 0; j < vd; ++j) si[j] = e * si[j] + a * w[j];
    }
  }
  return 0;
}
