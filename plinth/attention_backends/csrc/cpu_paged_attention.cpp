// Paged decode attention for CPUs, read in place from the KV cache.
//
// Cache layout: [2, num_blocks, block_size, num_kv_heads, head_size] (0 = keys, 1 = values).
// One work item is one sequence and a range of its KV heads (all of them when there are enough
// sequences to keep the threads busy, or on AMX tiles; else one), and with fewer items than two per thread a
// range of the sequence's blocks (the ranges' softmax states merged at the end). It walks its blocks through the
// block-table row (prefetching the next block; on AMX tiles, each segment's rows read first with loads only),
// scores every query head of each GQA group against the block's keys, and keeps a float32 softmax state (running
// max, running sum, rescaled accumulator) per query head. Nothing is gathered: with AVX512 or AVX2 (head sizes 64
// and 128) the keys and values are read in place, converted in registers (on AMX tiles the keys are loaded as
// tiles straight from the cache); otherwise one block's keys/values of one head are converted to float32 at a time.
// A sliding window starts the walk at the window's first token.
//
// The file includes no torch headers (it compiles in about a second) and exports C functions that
// take raw pointers; work items are spread over OpenMP threads (the libgomp runtime torch loads).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define PLINTH_ATTN_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const uint16_t* src, float* dst, int64_t n) {  // bfloat16 bits -> float32
  for (int64_t i = 0; i < n; ++i) dst[i] = plinth_cpu::bf2f(src[i]);
}

inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void from_float(const float* src, uint16_t* dst, int64_t n) {  // float32 -> bfloat16, nearest even
  for (int64_t i = 0; i < n; ++i) dst[i] = plinth_cpu::f2bf(src[i]);
}

using plinth_cpu::exp_nonpositive;
#if defined(__AVX512F__)
using plinth_cpu::exp16_nonpositive;
using plinth_cpu::exp2_16_nonpositive;
#endif
#if defined(__AVX2__) && defined(__FMA__)
using plinth_cpu::exp8_nonpositive;
#endif

// Dot product over kLanes independent partial sums, then a pairwise tree: vectorises without
// reassociation flags and keeps the final reduction's dependency chain short.
constexpr int kLanes = 16;
inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float part[kLanes] = {0.f};
  const int64_t full = n - n % kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
    for (int j = 0; j < kLanes; ++j) part[j] += a[i + j] * b[i + j];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) part[j] += part[j + width];
  float total = part[0];
  for (int64_t i = full; i < n; ++i) total += a[i] * b[i];
  return total;
}

// acc[:n] += p * v[:n]
inline void scale_add(float* __restrict__ acc, const float* __restrict__ v, float p, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] += p * v[d];
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// One block of one KV head for the `group` query rows q [group, kD] (scaled, float32): scores of the
// block's tokens lo..hi-1, then the online-softmax update of row_max/row_sum and acc [group, kD].
// Keys and values are read straight from the cache in their dtype, 16 features per vector.
template <typename scalar_t, int64_t kD>
inline void block_update_avx512(const scalar_t* k_base, const scalar_t* v_base, int64_t token_stride, int64_t lo,
                                int64_t hi, const float* q, float* acc, float* row_max, float* row_sum,
                                int64_t group, float* scores /* [group, BS] */, int64_t bs) {
  constexpr int64_t kV = kD / 16;
  const int64_t n = hi - lo;
  for (int64_t t = 0; t < n; ++t) {
    const scalar_t* kr = k_base + (lo + t) * token_stride;
    __m512 kv[kV];
    for (int64_t j = 0; j < kV; ++j) kv[j] = load16(kr + 16 * j);
    for (int64_t r = 0; r < group; ++r) {
      __m512 s = _mm512_mul_ps(load16(q + r * kD), kv[0]);
      for (int64_t j = 1; j < kV; ++j) s = _mm512_fmadd_ps(load16(q + r * kD + 16 * j), kv[j], s);
      scores[r * bs + t] = _mm512_reduce_add_ps(s);
    }
  }
  for (int64_t r = 0; r < group; ++r) {
    float* sc = scores + r * bs;
    float block_max = row_max[r];
    for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sc[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      sc[t] = exp_nonpositive(sc[t] - block_max);
      sum += sc[t];
    }
    const float correction = std::exp(row_max[r] - block_max);  // 0 on the first block (exp(-inf))
    row_max[r] = block_max;
    row_sum[r] = row_sum[r] * correction + sum;
    const __m512 c = _mm512_set1_ps(correction);
    for (int64_t j = 0; j < kV; ++j) _mm512_storeu_ps(acc + r * kD + 16 * j, _mm512_mul_ps(c, load16(acc + r * kD + 16 * j)));
  }
  for (int64_t t = 0; t < n; ++t) {
    const scalar_t* vr = v_base + (lo + t) * token_stride;
    __m512 vv[kV];
    for (int64_t j = 0; j < kV; ++j) vv[j] = load16(vr + 16 * j);
    for (int64_t r = 0; r < group; ++r) {
      const __m512 p = _mm512_set1_ps(scores[r * bs + t]);
      float* ar = acc + r * kD;
      for (int64_t j = 0; j < kV; ++j) _mm512_storeu_ps(ar + 16 * j, _mm512_fmadd_ps(p, vv[j], load16(ar + 16 * j)));
    }
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Key bytes of one decode work item per segment on the AVX2 path: the segment's keys and values (2 x this) are read
// once with loads only (touch_blocks), then stay in L2 while block_update_avx2 works on them block by block
constexpr int64_t kAvx2SegmentBytes = 128 * 1024;

// Read the rows (row_bytes from element `off` of each token's row) of blocks sb..se-1 of one sequence (its tokens
// first..seq_len-1) in both cache halves once, one load per cache line and nothing else, so that the most misses are
// in flight at once: the vector work on a block, with a software prefetch of the next one in between, left a core
// waiting on each block's rows (the float32 decode of 32 sequences x 330 tokens ran at ~10 GB/s from L3).
template <typename T>
inline void touch_blocks(const T* k_cache, const T* v_cache, const int32_t* table, int64_t block_stride,
                         int64_t token_stride, int64_t bs, int64_t first, int64_t seq_len, int64_t sb, int64_t se,
                         int64_t off, int64_t row_bytes) {
  const int64_t token_bytes = token_stride * static_cast<int64_t>(sizeof(T));
  __m256i sink = _mm256_setzero_si256();
  for (int64_t b = sb; b < se; ++b) {
    const int64_t lo = std::max<int64_t>(first - b * bs, 0), hi = std::min<int64_t>(seq_len - b * bs, bs);
    const int64_t base = static_cast<int64_t>(table[b]) * block_stride + off;
    const char* kr = reinterpret_cast<const char*>(k_cache + base);
    const char* vr = reinterpret_cast<const char*>(v_cache + base);
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t o = 0; o < row_bytes; o += 64) {
        sink = _mm256_or_si256(sink, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kr + t * token_bytes + o)));
        sink = _mm256_or_si256(sink, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + t * token_bytes + o)));
      }
  }
  asm volatile("" : : "x"(sink));   // the loads stay
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 -> float32
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// C score vectors (a[i]: key i's products, lanes to be summed) folded into the keys' scores, stored at out[0..C-1]
// (out[C..3] or out[C..7] are written too, with junk: the caller leaves room). hadd(x, y) = [x0+x1, x2+x3, y0+y1,
// y2+y3 | the same of lanes 4-7], so two levels leave keys 0-3 summed within each 128-bit half.
template <int C>
inline void fold_scores(const __m256 (&a)[C], float* out) {
  __m256 b[C <= 4 ? 4 : 8];   // a, then zeros
  for (int i = 0; i < (C <= 4 ? 4 : 8); ++i) b[i] = _mm256_setzero_ps();
  for (int i = 0; i < C; ++i) b[i] = a[i];
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
  if constexpr (C <= 4) {
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
  } else {
    const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(b[4], b[5]), _mm256_hadd_ps(b[6], b[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31)));
  }
}

// The scores of R query rows (q [R][kD], float32) against C consecutive keys (rows token_stride apart), into
// scores[r * stride + 0..C-1]: a register block of R x C partial-sum vectors, so each key vector loaded (and
// widened) serves every row and each query vector every key (the loads, not the multiply-adds, bound a
// one-row loop here).
template <int64_t kD, int R, int C, typename kv_t>
inline void scores_block(const float* q, const kv_t* keys, int64_t token_stride, float* scores, int64_t stride) {
  __m256 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < C; ++i) a[r][i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < kD / 8; ++j) {
    __m256 kv[C];
    for (int i = 0; i < C; ++i) kv[i] = load8(keys + i * token_stride + 8 * j);
    for (int r = 0; r < R; ++r) {
      const __m256 qj = _mm256_loadu_ps(q + r * kD + 8 * j);
      for (int i = 0; i < C; ++i) a[r][i] = _mm256_fmadd_ps(qj, kv[i], a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) fold_scores<C>(a[r], scores + r * stride);
}

// The keys per register block of scores_block for R rows (the R x C sums, C keys and a query vector in the 16
// registers)
template <int R>
constexpr int kScoreKeys = R == 1 ? 8 : R == 2 ? 4 : 3;

// The scores of R rows against keys lo..hi-1 of a block: register blocks of kScoreKeys<R> keys, the last keys
// one register block of fewer
template <int64_t kD, int R, typename kv_t>
inline void block_scores(const float* q, const kv_t* keys, int64_t token_stride, int64_t n, float* scores,
                         int64_t stride) {
  constexpr int C = kScoreKeys<R>;
  int64_t t = 0;
  for (; t + C <= n; t += C) scores_block<kD, R, C>(q, keys + t * token_stride, token_stride, scores + t, stride);
  const kv_t* rest = keys + t * token_stride;
  switch (n - t) {
    case 0: break;
    case 1: scores_block<kD, R, 1>(q, rest, token_stride, scores + t, stride); break;
    case 2: scores_block<kD, R, 2>(q, rest, token_stride, scores + t, stride); break;
    case 3: if constexpr (C > 3) scores_block<kD, R, 3>(q, rest, token_stride, scores + t, stride); break;
    case 4: if constexpr (C > 4) scores_block<kD, R, 4>(q, rest, token_stride, scores + t, stride); break;
    case 5: if constexpr (C > 5) scores_block<kD, R, 5>(q, rest, token_stride, scores + t, stride); break;
    case 6: if constexpr (C > 6) scores_block<kD, R, 6>(q, rest, token_stride, scores + t, stride); break;
    default: if constexpr (C > 7) scores_block<kD, R, 7>(q, rest, token_stride, scores + t, stride); break;
  }
}

// acc[r] = acc[r] * correction[r] + sum over the block's keys t of p[r][t] v[t], for R rows (acc [R][kD],
// p rows `stride` apart): kD in chunks of kPvVectors<R> vectors, the R rows' accumulators of a chunk in registers
// across the keys, each value vector loaded (and widened) once for all R rows.
template <int R>
constexpr int kPvVectors = R == 1 ? 8 : 4;

template <int64_t kD, int R, typename kv_t>
inline void block_pv(const kv_t* values, int64_t token_stride, int64_t n, const float* p, int64_t stride,
                     const float* correction, float* acc) {
  constexpr int kV = static_cast<int>(kD / 8), W = std::min(kPvVectors<R>, kV);
  static_assert(kV % W == 0, "the head size is a multiple of the chunk");
  for (int c0 = 0; c0 < kV; c0 += W) {
    __m256 a[R][W];
    for (int r = 0; r < R; ++r) {
      const __m256 cr = _mm256_set1_ps(correction[r]);
      for (int j = 0; j < W; ++j) a[r][j] = _mm256_mul_ps(cr, _mm256_loadu_ps(acc + r * kD + 8 * (c0 + j)));
    }
    for (int64_t t = 0; t < n; ++t) {
      const kv_t* vr = values + t * token_stride + 8 * c0;
      __m256 pr[R];
      for (int r = 0; r < R; ++r) pr[r] = _mm256_broadcast_ss(p + r * stride + t);
      for (int j = 0; j < W; ++j) {
        const __m256 v = load8(vr + 8 * j);
        for (int r = 0; r < R; ++r) a[r][j] = _mm256_fmadd_ps(pr[r], v, a[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < W; ++j) _mm256_storeu_ps(acc + r * kD + 8 * (c0 + j), a[r][j]);
  }
}

// The online-softmax update of R query rows over one block's keys lo..hi-1: scores (block_scores), each row's
// maximum, exponentials 8 at a time, then P V (block_pv).
template <int64_t kD, int R, typename kv_t>
inline void block_rows_avx2(const kv_t* k_base, const kv_t* v_base, int64_t token_stride, int64_t lo, int64_t hi,
                            const float* q, float* acc, float* row_max, float* row_sum, float* scores,
                            int64_t stride) {
  const int64_t n = hi - lo, n8 = n - n % 8;
  block_scores<kD, R>(q, k_base + lo * token_stride, token_stride, n, scores, stride);
  float correction[R];
  for (int r = 0; r < R; ++r) {
    float* sr = scores + r * stride;
    __m256 top = _mm256_set1_ps(row_max[r]);
    for (int64_t t = 0; t < n8; t += 8) top = _mm256_max_ps(_mm256_loadu_ps(sr + t), top);   // (NaN passed over)
    float block_max = hmax8(top);
    for (int64_t t = n8; t < n; ++t) block_max = std::max(block_max, sr[t]);
    const __m256 bm = _mm256_set1_ps(block_max);
    __m256 total = _mm256_setzero_ps();
    for (int64_t t = 0; t < n8; t += 8) {
      const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sr + t), bm));
      _mm256_storeu_ps(sr + t, e);
      total = _mm256_add_ps(total, e);
    }
    float sum = hsum8(total);
    for (int64_t t = n8; t < n; ++t) {
      sr[t] = exp_nonpositive(sr[t] - block_max);
      sum += sr[t];
    }
    correction[r] = std::exp(row_max[r] - block_max);  // 0 on the first block (exp(-inf))
    row_max[r] = block_max;
    row_sum[r] = row_sum[r] * correction[r] + sum;
  }
  block_pv<kD, R>(v_base + lo * token_stride, token_stride, n, scores, stride, correction, acc);
}

// Room per query row in block_update_avx2's score buffer beyond the block's tokens (fold_scores writes whole
// vectors)
constexpr int64_t kScoreSlack = 8;

// block_update_avx512 for CPUs with AVX2/FMA but no AVX512: the same online-softmax update of one block of one
// KV head, 8 features per vector, keys and values read in place from the cache in their dtype (kv_t: the queries'
// scalar_t, or bfloat16 bits under float32 queries, widened exactly as they are loaded). The GQA group's rows go
// three at a time (block_rows_avx2), so every key and value vector loaded serves up to three rows.
// scores: [3][BS + kScoreSlack].
template <typename scalar_t, int64_t kD, typename kv_t = scalar_t>
inline void block_update_avx2(const kv_t* k_base, const kv_t* v_base, int64_t token_stride, int64_t lo,
                              int64_t hi, const float* q, float* acc, float* row_max, float* row_sum, int64_t group,
                              float* scores, int64_t bs) {
  const int64_t stride = bs + kScoreSlack;
  for (int64_t r = 0, rows = 0; r < group; r += rows) {
    rows = group - r == 4 || group - r == 2 ? 2 : std::min<int64_t>(3, group - r);   // no single row after others
    const float* qr = q + r * kD;
    float* ar = acc + r * kD;
    float *mr = row_max + r, *sr = row_sum + r;
    switch (rows) {
      case 1: block_rows_avx2<kD, 1>(k_base, v_base, token_stride, lo, hi, qr, ar, mr, sr, scores, stride); break;
      case 2: block_rows_avx2<kD, 2>(k_base, v_base, token_stride, lo, hi, qr, ar, mr, sr, scores, stride); break;
      default: block_rows_avx2<kD, 3>(k_base, v_base, token_stride, lo, hi, qr, ar, mr, sr, scores, stride); break;
    }
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// 16 rows of 16 dwords, transposed in place: afterwards r[e] holds dword e of rows 0..15 (lane t = row t).
inline void transpose16_epi32(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {   // lane L of t[i]: r_i[4L], r_i+1[4L], r_i[4L+1], r_i+1[4L+1]; t[i+1]: 4L+2, 4L+3
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {   // lane L of u[i + k]: rows i..i+3 of dword 4L + k
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {       // lane L of u[k], u[4 + k], u[8 + k], u[12 + k] side by side: dword 4L + k
    const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88), d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    r[k] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(a, c, 0xdd);
    r[4 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(b, d, 0xdd);
  }
}
#endif


#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// 32 cache elements as 32 bfloat16 values: a bfloat16 cache's as they are
struct Bf16Rows {
  using T = uint16_t;
  __m512i load32(const uint16_t* p) const { return _mm512_loadu_si512(p); }
};

// An FP8 E4M3 cache's (torch.float8_e4m3fn: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no infinities,
// S.1111.111 NaN): every such value is a bfloat16 value, looked up by its 7 magnitude bits in a 128-entry table
// (two vpermi2w over 64 entries each), the sign put back.
struct E4m3Rows {
  using T = uint8_t;
  struct alignas(64) Table {
    uint16_t v[128];
  };
  // the table, made once per process
  static const Table& table() {
    static const Table made = [] {
      Table tb{};
      for (int m = 0; m < 128; ++m) {
        const int e = m >> 3, f = m & 7;
        const float x = e == 0 ? std::ldexp(static_cast<float>(f), -9) : std::ldexp(1.f + f / 8.f, e - 7);
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof(bits));
        tb.v[m] = m == 127 ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(bits >> 16);   // 3 mantissa bits
      }
      return tb;
    }();
    return made;
  }
  __m512i tab[4];
  E4m3Rows() {
    for (int i = 0; i < 4; ++i) tab[i] = _mm512_load_si512(table().v + 32 * i);
  }
  __m512i load32(const uint8_t* p) const {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i lo = _mm512_permutex2var_epi16(tab[0], b, tab[1]);   // magnitudes 0..63 (index bits 0-5)
    const __m512i hi = _mm512_permutex2var_epi16(tab[2], b, tab[3]);   // 64..127
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)), lo, hi);
    return _mm512_or_si512(mag, _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
  }
};

// The bfloat16 pairs of m <= 16 consecutive keys (rows token_stride apart from keys[0]; missing ones zero)
// transposed to ktb [kD/2] dwords: lane t of ktb[i] is pair i of key t.
template <int64_t kD, typename L = Bf16Rows>
inline void transpose_keys16(const typename L::T* keys, int64_t token_stride, int64_t m, __m512i* ktb,
                             const L& rows = L()) {
  for (int64_t w = 0; w < kD / 32; ++w) {
    __m512i rows16[16];
    for (int64_t t = 0; t < 16; ++t)
      rows16[t] = t < m ? rows.load32(keys + t * token_stride + 32 * w) : _mm512_setzero_si512();
    transpose16_epi32(rows16);
    for (int64_t e = 0; e < 16; ++e) ktb[16 * w + e] = rows16[e];
  }
}

// The 16 scores of one bfloat16 query row qr against keys transposed by transpose_keys16, times sc: kD/2
// vdpbf16ps with the row's pairs broadcast, in two independent sums.
template <int64_t kD>
inline __m512 scores16_bf16(const __m512i* ktb, const uint16_t* qr, __m512 sc) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (int64_t pr = 0; pr < kD / 2; pr += 2) {
    int32_t pair0, pair1;
    std::memcpy(&pair0, qr + 2 * pr, sizeof(pair0));
    std::memcpy(&pair1, qr + 2 * pr + 2, sizeof(pair1));
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)ktb[pr], (__m512bh)_mm512_set1_epi32(pair0));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)ktb[pr + 1], (__m512bh)_mm512_set1_epi32(pair1));
  }
  return _mm512_mul_ps(_mm512_add_ps(a0, a1), sc);
}

// The scores of one bfloat16 query row qr against G chunks of 16 keys (each transposed by transpose_keys16),
// times sc: each of the row's pairs is broadcast once for all G chunks; two independent sums per chunk.
template <int64_t kD, int G>
inline void scores_chunks_bf16(const __m512i (*ktb)[kD / 2], int gn, const uint16_t* qr, __m512 sc, __m512* out) {
  __m512 a0[G], a1[G];
  for (int j = 0; j < G; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
  for (int64_t pr = 0; pr < kD / 2; pr += 2) {
    int32_t pair0, pair1;
    std::memcpy(&pair0, qr + 2 * pr, sizeof(pair0));
    std::memcpy(&pair1, qr + 2 * pr + 2, sizeof(pair1));
    const __m512bh b0 = (__m512bh)_mm512_set1_epi32(pair0), b1 = (__m512bh)_mm512_set1_epi32(pair1);
    for (int j = 0; j < G; ++j) {
      if (j >= gn) break;
      a0[j] = _mm512_dpbf16_ps(a0[j], (__m512bh)ktb[j][pr], b0);
      a1[j] = _mm512_dpbf16_ps(a1[j], (__m512bh)ktb[j][pr + 1], b1);
    }
  }
  for (int j = 0; j < G; ++j)
    if (j < gn) out[j] = _mm512_mul_ps(_mm512_add_ps(a0[j], a1[j]), sc);
}

// 32 bfloat16 features of two keys a and b interleaved into dwords (a's in the low halves): pair[0] features 0-15,
// pair[1] features 16-31.
inline void interleave_pair(__m512i a, __m512i b, __m512i* pair) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  pair[0] = _mm512_permutex2var_epi16(a, lo, b);
  pair[1] = _mm512_permutex2var_epi16(a, _mm512_add_epi16(lo, _mm512_set1_epi16(16)), b);
}

// The bfloat16 values of m <= 16 consecutive keys (rows token_stride apart; missing ones zero) as dwords
// vp [8][kD]: dword d of pair kp holds dimension d of keys 2 kp (low half) and 2 kp + 1 (high half).
template <int64_t kD>
inline void interleave_value_pairs(const uint16_t* values, int64_t token_stride, int64_t m, uint32_t* vp) {
  for (int64_t kp = 0; kp < 8; ++kp) {
    for (int64_t w = 0; w < kD / 32; ++w) {
      const int64_t t0 = 2 * kp, t1 = 2 * kp + 1;
      const __m512i a = t0 < m ? _mm512_loadu_si512(values + t0 * token_stride + 32 * w) : _mm512_setzero_si512();
      const __m512i b = t1 < m ? _mm512_loadu_si512(values + t1 * token_stride + 32 * w) : _mm512_setzero_si512();
      __m512i pair[2];
      interleave_pair(a, b, pair);
      _mm512_storeu_si512(vp + kp * kD + 32 * w, pair[0]);
      _mm512_storeu_si512(vp + kp * kD + 32 * w + 16, pair[1]);
    }
  }
}

// Fetch the rows t_lo..t_hi-1 (row_bytes each, token_bytes apart) of a block into L2. An asm statement, not
// __builtin_prefetch: GCC's pure-function analysis counts the builtin as free of side effects and drops calls of a
// helper (a lambda) whose only effect it is.
inline void prefetch_rows(const char* block, int64_t token_bytes, int64_t row_bytes, int64_t t_lo, int64_t t_hi) {
  for (int64_t t = t_lo; t < t_hi; ++t)
    for (int64_t off = 0; off < row_bytes; off += 64)
      asm volatile("prefetcht1 %0" : : "m"(*(block + t * token_bytes + off)));
}

// Keys of one decode work item taken per segment: at most this many bytes of the item's key rows (the values as
// many), so a segment's scores stay in L1/L2 and its values (on AMX tiles its keys too: touch_segment) in L2
constexpr int64_t kSegmentBytes = 128 * 1024;

// One decode work item in bfloat16: KV heads h0..h0+heads-1 of one sequence over its blocks b_lo..b_hi-1
// (tokens first..seq_len-1 of the sequence), for the item's `heads * group` query rows qraw. The blocks go in
// segments (kSegmentBytes of keys); within a segment two passes over the keys instead of an online softmax:
// every score first (each 16-key chunk's bfloat16 pairs transposed once, vdpbf16ps with the rows' pairs
// broadcast) into `scores` [rows][segment keys rounded up to 16 per block] (then a factor per row), then each row's maximum, then per
// chunk the probabilities (rounded to bfloat16; the row's sum adds the rounded values) and P V as vdpbf16ps over
// key pairs (two keys' values interleaved into dwords once for the head's rows). No per-chunk rescaling (the
// chunks' work is independent, so it overlaps); one rescale of the sums and accumulators per segment. Expects
// row_max = -inf, row_sum = 0, acc = 0 [rows][kD] and leaves each row's maximum, sum and unnormalised accumulator.
template <int64_t kD, typename L = Bf16Rows>
inline void decode_item_bf16(const typename L::T* k_cache, const typename L::T* v_cache, const int32_t* table,
                             int64_t block_stride, int64_t token_stride, int64_t bs, int64_t first, int64_t seq_len,
                             int64_t b_lo, int64_t b_hi, int64_t h0, int64_t heads, int64_t group,
                             const uint16_t* const* qraw, float scale, std::vector<float>& scores, float* acc,
                             float* row_max, float* row_sum, const L& loader = L()) {
  using kv_t = typename L::T;
  constexpr int64_t kV = kD / 16;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 sc = _mm512_set1_ps(scale);
  const int64_t rows = heads * group;
  const int64_t token_bytes = token_stride * static_cast<int64_t>(sizeof(kv_t));
  const int64_t row_bytes = heads * kD * static_cast<int64_t>(sizeof(kv_t));
  const int64_t head_bytes = kD * static_cast<int64_t>(sizeof(kv_t));
  const int64_t head_off = h0 * kD;
  const int64_t seg_blocks = std::max<int64_t>(1, kSegmentBytes / (bs * row_bytes));
  const int64_t slots_cap = seg_blocks * ((bs + 15) / 16 * 16);
  if (static_cast<int64_t>(scores.size()) < rows * (slots_cap + 1)) scores.resize(rows * (slots_cap + 1));
  float* sc_all = scores.data();
  float* corr = sc_all + rows * slots_cap;   // per row: what the earlier segments' state is scaled by
  // block b's visible tokens lo..hi-1 and its rows of the item's heads (of `cache`: keys or values)
  auto block_rows = [&](const kv_t* cache, int64_t b, int64_t& lo, int64_t& hi) -> const char* {
    lo = std::max<int64_t>(first - b * bs, 0);
    hi = std::min<int64_t>(seq_len - b * bs, bs);
    return reinterpret_cast<const char*>(cache + static_cast<int64_t>(table[b]) * block_stride + head_off);
  };
  // share `part` of `parts` of block b's rows (bytes [off, off + bytes) of each) fetched into L2 ahead of their use:
  // the next block's, a share per step of the current block's work (a burst of a whole block stalls on the few
  // misses a core can have in flight)
  auto fetch_share = [&](const kv_t* cache, int64_t b, int64_t off, int64_t bytes, int64_t part, int64_t parts) {
    if (b >= b_hi) return;
    int64_t lo, hi;
    const char* base = block_rows(cache, b, lo, hi) + off;
    const int64_t n = hi - lo;
    prefetch_rows(base, token_bytes, bytes, lo + n * part / parts, lo + n * (part + 1) / parts);
  };
  for (int64_t sb = b_lo; sb < b_hi; sb += seg_blocks) {
    const int64_t se = std::min<int64_t>(b_hi, sb + seg_blocks);
    int64_t slots = 0;   // the segment's key slots: each block's visible tokens in chunks of 16
    for (int64_t b = sb; b < se; ++b) {
      int64_t lo, hi;
      block_rows(k_cache, b, lo, hi);
      slots += (hi - lo + 15) / 16 * 16;
    }
    // pass 1: scores, block by block (all the item's heads of a block together: its rows are adjacent in memory)
    int64_t slot = 0;
    for (int64_t b = sb; b < se; ++b) {
      int64_t lo, hi;
      const kv_t* kb = reinterpret_cast<const kv_t*>(block_rows(k_cache, b, lo, hi));
      const int64_t steps = (hi - lo + 15) / 16 * heads;   // (chunk, head) steps of this block
      int64_t step = 0;
      for (int64_t c0 = lo; c0 < hi; c0 += 16) {
        const int64_t m = std::min<int64_t>(16, hi - c0);
        const __mmask16 vis = static_cast<__mmask16>(m >= 16 ? 0xffffu : (1u << m) - 1u);
        for (int64_t hh = 0; hh < heads; ++hh, ++step) {
          if (b + 1 < se) fetch_share(k_cache, b + 1, 0, row_bytes, step, steps);
          else fetch_share(v_cache, sb, 0, row_bytes, step, steps);   // the segment's first values, for pass 3
          __m512i ktb[kD / 2];
          transpose_keys16<kD, L>(kb + c0 * token_stride + hh * kD, token_stride, m, ktb, loader);
          for (int64_t u = 0; u < group; ++u) {
            const int64_t r = hh * group + u;
            _mm512_storeu_ps(sc_all + r * slots + slot,
                             _mm512_mask_blend_ps(vis, _mm512_set1_ps(neg_inf), scores16_bf16<kD>(ktb, qraw[r], sc)));
          }
        }
        slot += 16;
      }
    }
    // pass 2: each row's maximum so far, and what the earlier segments' sums and accumulators are scaled by
    for (int64_t r = 0; r < rows; ++r) {
      const float* sr = sc_all + r * slots;
      __m512 top = _mm512_set1_ps(neg_inf);
      for (int64_t i = 0; i < slots; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(sr + i));
      const float new_max = std::max(row_max[r], _mm512_reduce_max_ps(top));
      corr[r] = std::exp(row_max[r] - new_max);   // 0 on the first segment (exp(-inf))
      row_max[r] = new_max;
    }
    // pass 3: probabilities and P V, one head at a time (the segment's values stay in L2 for the next heads)
    for (int64_t hh = 0; hh < heads; ++hh)
      for (int64_t r0 = hh * group; r0 < (hh + 1) * group; r0 += 4) {
        const int64_t nr = std::min<int64_t>(4, (hh + 1) * group - r0);
        __m512 a[4][kV], sums[4], tops[4];
        for (int64_t u = 0; u < 4; ++u) {
          sums[u] = _mm512_setzero_ps();
          tops[u] = _mm512_set1_ps(u < nr ? row_max[r0 + u] : 0.f);
          for (int64_t j = 0; j < kV; ++j)
            a[u][j] = u < nr ? _mm512_mul_ps(_mm512_set1_ps(corr[r0 + u]), _mm512_loadu_ps(acc + (r0 + u) * kD + 16 * j))
                             : _mm512_setzero_ps();
        }
        slot = 0;
        for (int64_t b = sb; b < se; ++b) {
          int64_t lo, hi;
          const kv_t* vb = reinterpret_cast<const kv_t*>(block_rows(v_cache, b, lo, hi)) + hh * kD;
          const int64_t pairs_in_block = (hi - lo + 1) / 2;   // the steps of a head's pass over the block
          for (int64_t c0 = lo; c0 < hi; c0 += 16, slot += 16) {
            const int64_t m = std::min<int64_t>(16, hi - c0);
            const __mmask16 vis = static_cast<__mmask16>(m >= 16 ? 0xffffu : (1u << m) - 1u);
            alignas(32) int32_t pairs[4][8];
            for (int64_t u = 0; u < nr; ++u) {
              const __m512 sv = _mm512_loadu_ps(sc_all + (r0 + u) * slots + slot);
              const __m512 pv = _mm512_maskz_mov_ps(vis, exp16_nonpositive(_mm512_sub_ps(sv, tops[u])));
              const __m256i pb = (__m256i)_mm512_cvtneps_pbh(pv);
              _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[u]), pb);
              sums[u] = _mm512_add_ps(sums[u], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
            }
            for (int64_t kp = 0; 2 * kp < m; ++kp) {
              if (r0 == hh * group) {   // each head's pass fetches its rows of the next block (the first
                const int64_t step = (c0 - lo) / 2 + kp;   // head's: the next segment's first keys at the end)
                if (b + 1 < se) fetch_share(v_cache, b + 1, hh * head_bytes, head_bytes, step, pairs_in_block);
                else if (hh == 0) fetch_share(k_cache, se, 0, row_bytes, step, pairs_in_block);
              }
              const kv_t* v0 = vb + (c0 + 2 * kp) * token_stride;
              const bool second = 2 * kp + 1 < m;   // a lone last key pairs with zeros
              __m512i vv[kV];
              for (int64_t w = 0; w < kD / 32; ++w) {
                const __m512i x = loader.load32(v0 + 32 * w);
                const __m512i y = second ? loader.load32(v0 + token_stride + 32 * w) : _mm512_setzero_si512();
                interleave_pair(x, y, vv + 2 * w);
              }
              for (int64_t u = 0; u < 4; ++u) {
                if (u >= nr) break;
                const __m512bh pp = (__m512bh)_mm512_set1_epi32(pairs[u][kp]);
                for (int64_t j = 0; j < kV; ++j) a[u][j] = _mm512_dpbf16_ps(a[u][j], pp, (__m512bh)vv[j]);
              }
            }
          }
        }
        for (int64_t u = 0; u < nr; ++u) {
          row_sum[r0 + u] = row_sum[r0 + u] * corr[r0 + u] + _mm512_reduce_add_ps(sums[u]);
          for (int64_t j = 0; j < kV; ++j) _mm512_storeu_ps(acc + (r0 + u) * kD + 16 * j, a[u][j]);
        }
      }
  }
}
#endif

#if defined(PLINTH_ATTN_AMX)
// A tile configuration (palette 1): each tile's bytes per row and rows
struct alignas(64) AttnTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether Linux lets this process use the AMX tile state (asked once per process)
inline bool amx_granted() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;   // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// The tiles of decode_item_amx, for a thread's items of `group` query heads per KV head: 0 the scores of 16 keys
// [16 keys][16 query rows] float32; 1 16 keys' rows (left operand) or 16 key pairs' values (right operand), 64
// bytes each; 2 the queries' bfloat16 pairs (right operand); 3-6 P V outputs [group rows][16 dimensions]; 7 the
// probabilities of one head's rows [group rows][16 key pairs].
inline void decode_amx_config(int64_t group) {
  AttnTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t < 3 ? 16 : group);
  }
  _tile_loadconfig(&cfg);
}

// Whether decode() takes AMX tiles where it can (plinth_cpu_paged_set_decode_amx)
bool g_decode_amx = true;

// Per-thread buffers of decode_item_amx
struct AmxDecodeScratch {
  std::vector<uint32_t> qb;              // the queries as right operands [heads][kD / 32][16 pairs][16 rows]
  std::vector<float> st;                 // a segment's scores [key slots][16 rows]
  std::vector<const uint16_t*> vrow;     // each key slot's value row (of the item's first head), null if not visible
  alignas(64) uint32_t pbuf[16 * 16];    // probabilities [row][16 key pairs]
  alignas(64) uint32_t vbuf[8 * 256];    // values as right operands [kD / 16 column tiles][16 key pairs][16]
  alignas(64) float obuf[4][16 * 16];    // P V outputs of four column tiles [row][16]
};

// blocks whose keys and values touch_segment reads side by side: the L2 prefetcher follows the four streams at once
// (one 2-thread cache sweep from memory: 21-22 GB/s in one stream, 26-27 in four; the 32 x 330-token decode of
// plinth_cpu_paged_decode 0.55-0.61 -> 0.52-0.57 ms a layer)
constexpr int64_t kTouchBlocks = 2;

// Read the key and value rows of one decode work item's blocks sb..se-1 (its tokens first..seq_len-1; row_bytes
// from `off` elements into each token's row) once, with loads only, before any work on them (decode_item_amx). A
// loop of nothing but loads keeps the most cache misses in flight: 32 sequences x 330 tokens (4 KiB pages) took
// 0.77-0.78 ms a layer from memory on AMX tiles without it, 0.78-0.82 with software prefetches of the next block
// between the products (a core stalls on them), 0.67-0.68 with it. The vector kernel keeps its prefetches: its work
// takes longer, so they overlap with more of it; with this pass instead, 8 sequences x 300 tokens from L3 took
// 0.091-0.093 against 0.080-0.081 ms (32 x 330 from memory: 0.531 against 0.559).
inline void touch_segment(const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table, int64_t block_stride,
                          int64_t token_stride, int64_t bs, int64_t first, int64_t seq_len, int64_t sb, int64_t se,
                          int64_t off, int64_t row_bytes) {
  const int64_t token_bytes = token_stride * 2;
  __m512i sink = _mm512_setzero_si512();
  for (int64_t b0 = sb; b0 < se; b0 += kTouchBlocks) {   // kTouchBlocks blocks' keys and values side by side
    const char* rows[2 * kTouchBlocks];
    int64_t lo[kTouchBlocks], hi[kTouchBlocks], t_lo = bs, t_hi = 0;
    for (int64_t i = 0; i < kTouchBlocks; ++i) {
      const int64_t b = std::min(b0 + i, se - 1);
      lo[i] = b0 + i < se ? std::max<int64_t>(first - b * bs, 0) : 0;
      hi[i] = b0 + i < se ? std::min<int64_t>(seq_len - b * bs, bs) : 0;
      if (hi[i] > lo[i]) {
        t_lo = std::min(t_lo, lo[i]);
        t_hi = std::max(t_hi, hi[i]);
      }
      const int64_t base = static_cast<int64_t>(table[b]) * block_stride + off;
      rows[2 * i] = reinterpret_cast<const char*>(k_cache + base);
      rows[2 * i + 1] = reinterpret_cast<const char*>(v_cache + base);
    }
    for (int64_t t = t_lo; t < t_hi; ++t)
      for (int64_t o = 0; o < row_bytes; o += 64)
        for (int64_t i = 0; i < kTouchBlocks; ++i)
          if (t >= lo[i] && t < hi[i]) {
            sink = _mm512_or_si512(sink, _mm512_loadu_si512(rows[2 * i] + t * token_bytes + o));
            sink = _mm512_or_si512(sink, _mm512_loadu_si512(rows[2 * i + 1] + t * token_bytes + o));
          }
  }
  asm volatile("" : : "v"(sink));   // the loads stay
}

// decode_item_bf16 on AMX tiles, for items of at most 16 query rows (bfloat16 cache, block sizes that are multiples
// of 16, a positive scale; the thread's tiles configured by decode_amx_config(group)). Per segment: the scores
// transposed, S^T = K Q^T, 16 keys at a time with the keys' rows loaded as left operands straight from the cache
// (so no key is transposed) against the queries' pairs, each head's product adding to its own rows' columns (the
// other heads' columns of its right operand are zero); each row's maximum; then per 32 keys the probabilities
// (rounded to bfloat16, the sums over the rounded values) transposed back to rows, and P V per head as tiles of
// the head's rows times 16-dimension columns of the values' key pairs (interleaved from the cache into a buffer).
// Same contract as decode_item_bf16 (row_max in scaled scores).
template <int64_t kD>
inline void decode_item_amx(const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table,
                            int64_t block_stride, int64_t token_stride, int64_t bs, int64_t first, int64_t seq_len,
                            int64_t b_lo, int64_t b_hi, int64_t h0, int64_t heads, int64_t group,
                            const uint16_t* const* qraw, float scale, AmxDecodeScratch& sc, float* acc,
                            float* row_max, float* row_sum) {
  constexpr int64_t kHalves = kD / 32, kColTiles = kD / 16;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t rows = heads * group;
  const int64_t token_bytes = token_stride * 2, row_bytes = heads * kD * 2;
  const int64_t head_off = h0 * kD;
  sc.qb.assign(static_cast<size_t>(heads * kHalves * 256), 0u);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t half = 0; half < kHalves; ++half) {
      uint32_t* dst = sc.qb.data() + ((r / group) * kHalves + half) * 256 + r;
      for (int64_t k = 0; k < 16; ++k) std::memcpy(dst + 16 * k, qraw[r] + 32 * half + 2 * k, 4);
    }
  const int64_t seg_blocks = std::max<int64_t>(1, kSegmentBytes / (bs * row_bytes));
  const int64_t slots_cap = seg_blocks * bs + 32;
  if (static_cast<int64_t>(sc.st.size()) < slots_cap * 16) {
    sc.st.resize(static_cast<size_t>(slots_cap * 16));
    sc.vrow.resize(static_cast<size_t>(slots_cap));
  }
  float* st = sc.st.data();
  const float c2 = scale * 1.44269504088896341f;
  const __m512 cv = _mm512_set1_ps(c2);
  const __m512i pair_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                           39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  alignas(64) float corr[16], tops[16];
  for (int64_t sb = b_lo; sb < b_hi; sb += seg_blocks) {
    const int64_t se = std::min<int64_t>(b_hi, sb + seg_blocks);
    touch_segment(k_cache, v_cache, table, block_stride, token_stride, bs, first, seq_len, sb, se, head_off, row_bytes);
    // pass 1: scores, 16 keys at a time
    int64_t slots = 0;
    for (int64_t b = sb; b < se; ++b) {
      const int64_t lo = std::max<int64_t>(first - b * bs, 0), hi = std::min<int64_t>(seq_len - b * bs, bs);
      const int64_t base = static_cast<int64_t>(table[b]) * block_stride + head_off;
      for (int64_t c0 = lo / 16 * 16; c0 < hi; c0 += 16) {
        _tile_zero(0);
        for (int64_t hh = 0; hh < heads; ++hh)
          for (int64_t half = 0; half < kHalves; ++half) {
            _tile_loadd(1, k_cache + base + c0 * token_stride + hh * kD + 32 * half, token_bytes);
            _tile_loadd(2, sc.qb.data() + (hh * kHalves + half) * 256, 64);
            _tile_dpbf16ps(0, 1, 2);
          }
        float* s = st + slots * 16;
        _tile_stored(0, s, 64);
        for (int64_t t = 0; t < 16; ++t) {
          const bool visible = c0 + t >= lo && c0 + t < hi;
          sc.vrow[slots + t] = visible ? v_cache + base + (c0 + t) * token_stride : nullptr;
          if (!visible) _mm512_storeu_ps(s + 16 * t, _mm512_set1_ps(neg_inf));
        }
        slots += 16;
      }
    }
    if (slots % 32 != 0) {   // P V takes 32 keys at a time: a last half of nothing
      for (int64_t t = 0; t < 16; ++t) {
        sc.vrow[slots + t] = nullptr;
        _mm512_storeu_ps(st + (slots + t) * 16, _mm512_set1_ps(neg_inf));
      }
      slots += 16;
    }
    // pass 2: each row's maximum (raw scores: the scale is positive), the rescale of earlier segments' state
    __m512 top = _mm512_set1_ps(neg_inf);
    for (int64_t i = 0; i < slots; ++i) top = _mm512_max_ps(top, _mm512_loadu_ps(st + 16 * i));
    _mm512_store_ps(tops, top);
    for (int64_t r = 0; r < rows; ++r) {
      const float new_max = std::max(row_max[r], tops[r] * scale);
      corr[r] = std::exp(row_max[r] - new_max);   // 0 on the first segment (exp(-inf))
      row_max[r] = new_max;
      tops[r] = new_max * 1.44269504088896341f;   // the row's maximum in base-2 units
      for (int64_t j = 0; j < kD; j += 16)
        _mm512_storeu_ps(acc + r * kD + j, _mm512_mul_ps(_mm512_set1_ps(corr[r]), _mm512_loadu_ps(acc + r * kD + j)));
    }
    for (int64_t r = rows; r < 16; ++r) tops[r] = 0.f;
    const __m512 tv = _mm512_load_ps(tops);
    __m512 sums = _mm512_setzero_ps();
    // pass 3: per 32 keys, the probabilities and P V
    for (int64_t c0 = 0; c0 < slots; c0 += 32) {
      __m512i x[16];   // x[j]: dword r = row r's probabilities of keys 2j, 2j + 1 (bfloat16)
      for (int64_t j = 0; j < 16; ++j) {
        __m256i pb[2];
        for (int64_t e = 0; e < 2; ++e) {
          const int64_t slot = c0 + 2 * j + e;
          if (sc.vrow[slot] == nullptr) {
            pb[e] = _mm256_setzero_si256();
            continue;
          }
          const __m512 p = exp2_16_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(st + 16 * slot), cv, tv));
          pb[e] = (__m256i)_mm512_cvtneps_pbh(p);
          sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb[e]), 16)));
        }
        x[j] = _mm512_permutex2var_epi16(_mm512_castsi256_si512(pb[0]), pair_lo, _mm512_castsi256_si512(pb[1]));
      }
      transpose16_epi32(x);   // x[r]: row r's 16 key pairs
      for (int64_t r = 0; r < rows; ++r) _mm512_store_si512(sc.pbuf + 16 * r, x[r]);
      for (int64_t hh = 0; hh < heads; ++hh) {
        _tile_loadd(7, sc.pbuf + 16 * hh * group, 64);
        // the head's values of the 32 keys as key pairs: vbuf[ct][j] = dimensions 16 ct.. of keys 2j, 2j + 1
        for (int64_t j = 0; j < 16; ++j) {
          const uint16_t* va = sc.vrow[c0 + 2 * j];
          const uint16_t* vb = sc.vrow[c0 + 2 * j + 1];
          for (int64_t w = 0; w < kHalves; ++w) {
            const __m512i a = va ? _mm512_loadu_si512(va + hh * kD + 32 * w) : _mm512_setzero_si512();
            const __m512i b = vb ? _mm512_loadu_si512(vb + hh * kD + 32 * w) : _mm512_setzero_si512();
            __m512i pair[2];
            interleave_pair(a, b, pair);
            _mm512_store_si512(sc.vbuf + (2 * w) * 256 + 16 * j, pair[0]);
            _mm512_store_si512(sc.vbuf + (2 * w + 1) * 256 + 16 * j, pair[1]);
          }
        }
        for (int64_t ct0 = 0; ct0 < kColTiles; ct0 += 4) {
          _tile_zero(3);
          _tile_zero(4);
          _tile_zero(5);
          _tile_zero(6);
          _tile_loadd(1, sc.vbuf + (ct0 + 0) * 256, 64);
          _tile_dpbf16ps(3, 7, 1);
          _tile_loadd(1, sc.vbuf + (ct0 + 1) * 256, 64);
          _tile_dpbf16ps(4, 7, 1);
          _tile_loadd(1, sc.vbuf + (ct0 + 2) * 256, 64);
          _tile_dpbf16ps(5, 7, 1);
          _tile_loadd(1, sc.vbuf + (ct0 + 3) * 256, 64);
          _tile_dpbf16ps(6, 7, 1);
          _tile_stored(3, sc.obuf[0], 64);
          _tile_stored(4, sc.obuf[1], 64);
          _tile_stored(5, sc.obuf[2], 64);
          _tile_stored(6, sc.obuf[3], 64);
          for (int64_t u = 0; u < group; ++u) {
            float* o = acc + (hh * group + u) * kD + 16 * ct0;
            for (int64_t c = 0; c < 4; ++c)
              _mm512_storeu_ps(o + 16 * c, _mm512_add_ps(_mm512_loadu_ps(o + 16 * c), _mm512_load_ps(sc.obuf[c] + 16 * u)));
          }
        }
      }
    }
    alignas(64) float sum_lanes[16];
    _mm512_store_ps(sum_lanes, sums);
    for (int64_t r = 0; r < rows; ++r) row_sum[r] = row_sum[r] * corr[r] + sum_lanes[r];
  }
}
#endif

#if defined(PLINTH_ATTN_AMX)
// KV heads per decode_item_amx call for a bfloat16 cache's items of `heads` KV heads with `group` query heads each,
// or 0 where decode stays on vectors: tiles where Linux grants them (and plinth_cpu_paged_set_decode_amx has not
// turned them off) for calls of at least 8 query rows (16 at most). With fewer rows (a KV head or two of a small
// GQA group) most of the tiles' and the exponentials' lanes idle and the vectors are faster.
inline int64_t decode_amx_heads(int64_t group, int64_t heads, int64_t bs, float scale) {
  if (!g_decode_amx || group > 16 || bs % 16 != 0 || !(scale > 0.f) || !amx_granted()) return 0;
  const int64_t per_call = std::min<int64_t>(heads, 16 / group);
  return per_call * group >= 8 ? per_call : 0;
}
#endif

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, head_size, block_size, table_width;
  int64_t q_row, out_row, kv_half, block_stride, token_stride;
};

// kD > 0: the head size as a compile-time constant (loops over it unroll fully); 0: sh.head_size. kv_t: the cache's
// elements, the query's (scalar_t) or FP8 E4M3 bytes (uint8_t: bfloat16 queries, kD a multiple of 32, AVX512-BF16).
template <typename scalar_t, int64_t kD, typename kv_t = scalar_t>
void decode(const scalar_t* query, const kv_t* kv_cache, const int32_t* tables, const int32_t* lens,
            const int32_t* starts, scalar_t* out, const Shape& sh, float scale, int64_t sliding_window,
            int num_threads) {
  constexpr bool kFp8 = std::is_same_v<kv_t, uint8_t>;
  const int64_t group = sh.num_heads / sh.num_kv_heads, bs = sh.block_size;
  const int64_t d_size = kD > 0 ? kD : sh.head_size;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  constexpr bool kBf16Blocks = std::is_same_v<scalar_t, uint16_t> && kD > 0 && kD % 32 == 0;
#else
  constexpr bool kBf16Blocks = false;
#endif
  static_assert(!kFp8 || kBf16Blocks, "an FP8 cache is read by the bfloat16 block kernel only");
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  constexpr bool kTouch = kD > 0 && kD % 16 == 0;   // block_update_avx2's items touch each segment first
#else
  constexpr bool kTouch = false;
#endif
  // A work item is one sequence and a range of its KV heads: all heads when there are enough
  // sequences to keep the threads busy (each block is then read once, front to back), else one.
  int64_t heads_per_item = sh.num_seqs >= 4 * num_threads ? sh.num_kv_heads : 1;
#if defined(PLINTH_ATTN_AMX)
  // AMX items take all of a sequence's KV heads whatever the batch (few sequences split their blocks into parts
  // instead): their rows are then adjacent in memory for touch_segment, and the tiles have the most rows
  int64_t amx_heads = 0;   // KV heads per decode_item_amx call; 0: vectors
  if constexpr (kBf16Blocks && !kFp8) amx_heads = decode_amx_heads(group, sh.num_kv_heads, bs, scale);
  if (amx_heads > 0) heads_per_item = sh.num_kv_heads;
  const bool use_amx = amx_heads > 0;
#endif
  const int64_t items_per_seq = sh.num_kv_heads / heads_per_item;
  const int64_t seq_items = sh.num_seqs * items_per_seq;
  const int64_t rows = heads_per_item * group;  // query heads per item
  // Each sequence's blocks are split into parts (ranges taken by different threads, whose partial softmax states
  // -- max, sum, unnormalised accumulator per row -- are merged afterwards), so that every thread has work however
  // few sequences and KV heads there are. A sequence's part count depends on its own length and the thread count
  // only, never on the rest of the batch (a part per kPartBlocks blocks, at most two per thread): the same sums
  // in the same order whatever else the step holds, so a sequence's outputs do not change with the batch (the
  // 8-bit decode inputs would amplify such a change from float rounding to their own rounding steps). Except on
  // the AVX512-BF16 vector path (bfloat16 or FP8 caches off AMX tiles): there a part longer than one softmax
  // segment (decode_item_bf16: kSegmentBytes of the item's heads) has its segment bounds set by heads_per_item,
  // which does depend on the batch.
  constexpr int64_t kPartBlocks = 2;
  std::vector<int64_t> first_item(sh.num_seqs + 1, 0);   // per sequence: its first item; items per head-item: parts
  std::vector<int64_t> seq_parts(sh.num_seqs, 1);
  bool split = false;
  for (int64_t s = 0; s < sh.num_seqs; ++s) {
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, lens[s] - sliding_window) : 0;
    const int64_t blocks = (lens[s] + bs - 1) / bs - first / bs;
    if (num_threads > 1) seq_parts[s] = std::clamp<int64_t>(blocks / kPartBlocks, 1, 2 * num_threads);
    split |= seq_parts[s] > 1;
    first_item[s + 1] = first_item[s] + items_per_seq * seq_parts[s];
  }
  const int64_t items = first_item[sh.num_seqs];
  // the parts' states: [items][rows] max and sum, [items][rows][D] accumulators
  std::vector<float> part_max(split ? items * rows : 0), part_sum(split ? items * rows : 0),
      part_acc(split ? items * rows * d_size : 0);
  const kv_t* k_cache = kv_cache;
  const kv_t* v_cache = kv_cache + sh.kv_half;
  const float neg_inf = -std::numeric_limits<float>::infinity();

#pragma omp parallel num_threads(num_threads)
  {
#if defined(PLINTH_ATTN_AMX)
    AmxDecodeScratch amx_scratch;
    if (use_amx) decode_amx_config(group);
#endif
    // per-thread scratch: the item's queries and accumulators [rows, D], one block's keys/values
    // of one head in float32 [BS, D], scores [BS]
    std::vector<float> q(rows * d_size), acc(rows * d_size), kblk(bs * d_size), vblk(bs * d_size), scores(bs),
        row_max(rows), row_sum(rows), gscores(std::max<int64_t>(group, 3) * (bs + 8));   // (+8: AVX2's slack)
    std::vector<const scalar_t*> qraw(rows);   // bfloat16: each row's query in the input
    std::vector<float> scores_all;             // bfloat16: the item's scores [rows][keys]
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const std::conditional_t<kFp8, E4m3Rows, Bf16Rows> loader;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t s = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t parts = seq_parts[s], local = item - first_item[s];
      const int64_t part = local % parts, h0 = (local / parts) * heads_per_item;
      const int64_t row = starts[s];
      if (starts[s + 1] == row) continue;  // no query token for this sequence in this step
      const int64_t seq_len = lens[s];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      // this part's blocks: b_lo .. b_hi - 1 of the sequence's first / bs .. ceil(seq_len / bs) - 1
      const int64_t b_first = first / bs, b_count = (seq_len + bs - 1) / bs - b_first;
      const int64_t b_lo = b_first + b_count * part / parts, b_hi = b_first + b_count * (part + 1) / parts;
      if constexpr (kBf16Blocks) {   // the bfloat16 block update reads the raw query rows
        for (int64_t r = 0; r < rows; ++r) qraw[r] = query + row * sh.q_row + (h0 * group + r) * d_size;
      } else {
        to_float(query + row * sh.q_row + h0 * group * d_size, q.data(), rows * d_size);
        for (int64_t i = 0; i < rows * d_size; ++i) q[i] *= scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), neg_inf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      const int32_t* table = tables + s * sh.table_width;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if constexpr (kBf16Blocks) {
        bool done = false;
#if defined(PLINTH_ATTN_AMX)
        if constexpr (!kFp8) {
          if (use_amx && b_hi > b_lo) {
            for (int64_t hs = 0; hs < heads_per_item; hs += amx_heads)
              decode_item_amx<kD>(k_cache, v_cache, table, sh.block_stride, sh.token_stride, bs, first, seq_len, b_lo,
                                  b_hi, h0 + hs, std::min(amx_heads, heads_per_item - hs), group,
                                  qraw.data() + hs * group, scale, amx_scratch, acc.data() + hs * group * kD,
                                  row_max.data() + hs * group, row_sum.data() + hs * group);
            done = true;
          }
        }
#endif
        if (!done && b_hi > b_lo)
          decode_item_bf16<kD>(k_cache, v_cache, table, sh.block_stride, sh.token_stride, bs, first, seq_len, b_lo, b_hi,
                               h0, heads_per_item, group, qraw.data(), scale, scores_all, acc.data(), row_max.data(),
                               row_sum.data(), loader);
      }
#endif
      const int64_t row_bytes = heads_per_item * d_size * static_cast<int64_t>(sizeof(kv_t));   // a token's, of the item's heads
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
      const int64_t touch_seg = std::max<int64_t>(1, kAvx2SegmentBytes / (bs * row_bytes));   // blocks per segment
#endif
      if constexpr (!kFp8)
      for (int64_t b = b_lo; b < b_hi && !kBf16Blocks; ++b) {
        const int64_t lo = std::max<int64_t>(first - b * bs, 0);     // tokens lo..hi-1 of this block count
        const int64_t hi = std::min<int64_t>(seq_len - b * bs, bs);
        const int64_t n = hi - lo;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        if constexpr (kTouch) {   // each segment's rows read once with loads only, before any work on them
          if ((b - b_lo) % touch_seg == 0)
            touch_blocks(k_cache, v_cache, table, sh.block_stride, sh.token_stride, bs, first, seq_len, b,
                         std::min(b_hi, b + touch_seg), h0 * d_size, row_bytes);
        }
#endif
        for (int64_t hh = 0; hh < heads_per_item; ++hh) {
          // the next block sits elsewhere in memory: fetch it into L2 while this one runs, a share of its
          // tokens before each head's update (a burst of the whole block at once left most of it unfetched
          // in time: 32 sequences x 330 tokens per layer 1.03 -> 0.70 ms from a cold cache)
          if (!kTouch && b + 1 < b_hi) {
            const int64_t next = static_cast<int64_t>(table[b + 1]) * sh.block_stride + h0 * d_size;
            for (int64_t t = hh * bs / heads_per_item; t < (hh + 1) * bs / heads_per_item; ++t) {
              const char* k_row = reinterpret_cast<const char*>(k_cache + next + t * sh.token_stride);
              const char* v_row = reinterpret_cast<const char*>(v_cache + next + t * sh.token_stride);
              for (int64_t off = 0; off < row_bytes; off += 64) {
                __builtin_prefetch(k_row + off, 0, 2);
                __builtin_prefetch(v_row + off, 0, 2);
              }
            }
          }
          const int64_t base = static_cast<int64_t>(table[b]) * sh.block_stride + (h0 + hh) * d_size;
#if defined(__AVX512F__)
          if constexpr (kD > 0 && kD % 16 == 0) {
            block_update_avx512<scalar_t, kD>(k_cache + base, v_cache + base, sh.token_stride, lo, hi,
                                              q.data() + hh * group * kD, acc.data() + hh * group * kD,
                                              row_max.data() + hh * group, row_sum.data() + hh * group, group,
                                              gscores.data(), bs);
            continue;
          }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
          if constexpr (kD > 0 && kD % 16 == 0) {
            block_update_avx2<scalar_t, kD, kv_t>(k_cache + base, v_cache + base, sh.token_stride, lo, hi,
                                                  q.data() + hh * group * kD, acc.data() + hh * group * kD,
                                                  row_max.data() + hh * group, row_sum.data() + hh * group, group,
                                                  gscores.data(), bs);
            continue;
          }
#endif
          for (int64_t t = lo; t < hi; ++t) {
            to_float(k_cache + base + t * sh.token_stride, kblk.data() + (t - lo) * d_size, d_size);
            to_float(v_cache + base + t * sh.token_stride, vblk.data() + (t - lo) * d_size, d_size);
          }
          for (int64_t r = hh * group; r < (hh + 1) * group; ++r) {
            const float* qr = q.data() + r * d_size;
            float* __restrict__ sc = scores.data();
            float block_max = row_max[r];
            for (int64_t t = 0; t < n; ++t) {
              sc[t] = dot(qr, kblk.data() + t * d_size, d_size);
              block_max = std::max(block_max, sc[t]);
            }
            for (int64_t t = 0; t < n; ++t) sc[t] = exp_nonpositive(sc[t] - block_max);  // vectorised
            float sum = 0.f;
            for (int64_t t = 0; t < n; ++t) sum += sc[t];
            float* ar = acc.data() + r * d_size;
            const float correction = std::exp(row_max[r] - block_max);  // 0 on the first block (exp(-inf))
            for (int64_t d = 0; d < d_size; ++d) ar[d] *= correction;
            for (int64_t t = 0; t < n; ++t) scale_add(ar, vblk.data() + t * d_size, sc[t], d_size);
            row_max[r] = block_max;
            row_sum[r] = row_sum[r] * correction + sum;
          }
        }
      }
      if (split) {   // this part's state, merged below
        std::copy(row_max.begin(), row_max.end(), part_max.begin() + item * rows);
        std::copy(row_sum.begin(), row_sum.end(), part_sum.begin() + item * rows);
        std::copy(acc.begin(), acc.end(), part_acc.begin() + item * rows * d_size);
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* ar = acc.data() + r * d_size;
        const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
        for (int64_t d = 0; d < d_size; ++d) ar[d] *= inv;
      }
      from_float(acc.data(), out + row * sh.out_row + h0 * group * d_size, rows * d_size);
    }
    if (split) {
      // (the loop above ends with the implicit barrier of `omp for`) one query head of one item at a time:
      // rescale each part's accumulator to the common maximum, add, divide by the summed rescaled sums (a
      // sequence of one part: its own state, times exp(0) = 1 and divided by its sum, as without the split)
#pragma omp for schedule(static)
      for (int64_t ir = 0; ir < seq_items * rows; ++ir) {
        const int64_t seq_item = ir / rows, r = ir % rows;
        const int64_t s = seq_item / items_per_seq, h0 = (seq_item % items_per_seq) * heads_per_item;
        if (starts[s + 1] == starts[s]) continue;
        const int64_t parts = seq_parts[s], base = first_item[s] + (seq_item % items_per_seq) * parts;
        float top = neg_inf;
        for (int64_t p = 0; p < parts; ++p) top = std::max(top, part_max[(base + p) * rows + r]);
        float* ar = acc.data();
        std::fill(ar, ar + d_size, 0.f);
        float total = 0.f;
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t at = (base + p) * rows + r;
          // a part without keys (sum 0) adds nothing; NaN scores (max -inf, sum NaN) make the output NaN, as
          // without the split
          if (part_sum[at] == 0.f) continue;
          const float w = std::exp(part_max[at] - top);
          total += part_sum[at] * w;
          const float* pa = part_acc.data() + at * d_size;
          for (int64_t d = 0; d < d_size; ++d) ar[d] += pa[d] * w;
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t d = 0; d < d_size; ++d) ar[d] *= inv;
        from_float(ar, out + starts[s] * sh.out_row + (h0 * group + r) * d_size, d_size);
      }
    }
#if defined(PLINTH_ATTN_AMX)
    if (use_amx) _tile_release();
#endif
  }
}

// query positions per prefill work item
constexpr int64_t kTile = 16;

// The prefill work items' tiles: (sequence, first query position) of every kTile positions of every sequence
inline void prefill_tiles(const int32_t* starts, int64_t num_seqs, std::vector<int64_t>& seq,
                          std::vector<int64_t>& pos) {
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t i = starts[s]; i < starts[s + 1]; i += kTile) {
      seq.push_back(s);
      pos.push_back(i - starts[s]);
    }
}

// The keys positions lo_pos..last of one sequence and KV head h may see, in chunks of `width` keys inside its
// blocks (block sizes are multiples of 16): each chunk's first key position, its offset in the cache half and its
// length. Chunks wholly before lo_pos (the window of the tile's first row) are visible to none of its rows.
inline void visible_chunks(const int32_t* table, int64_t block_stride, int64_t token_stride, int64_t block_size,
                           int64_t head_offset, int64_t seq_len, int64_t lo_pos, int64_t last, int64_t width,
                           std::vector<int64_t>& key, std::vector<int64_t>& base, std::vector<int64_t>& len) {
  key.clear();
  base.clear();
  len.clear();
  for (int64_t b = lo_pos / block_size; b * block_size <= last; ++b) {
    const int64_t start = static_cast<int64_t>(table[b]) * block_stride + head_offset;
    const int64_t n = std::min<int64_t>(block_size, seq_len - b * block_size);   // tokens of this block in the cache
    for (int64_t c0 = std::max<int64_t>(0, (lo_pos - b * block_size) / width * width);
         c0 < n && b * block_size + c0 <= last; c0 += width) {
      key.push_back(b * block_size + c0);
      base.push_back(start + c0 * token_stride);
      len.push_back(std::min<int64_t>(width, n - c0));
    }
  }
}

// A prefill work item's tile of query positions of one sequence and one KV head h: rows = positions x group
struct PrefillTile {
  int64_t s, h, i0, rows;
};

// Start work item `item`: its rows' queries scaled into q [rows][d] (position-major, the group's heads side by side:
// row r = position i0 + r / group, head h * group + r % group; qraw, where given, the raw rows), each row's position
// in row_pos, the softmax state reset (acc 0, row_max -inf, row_sum 0), and the key chunks of `width` the tile may
// see (visible_chunks, from the window of its first row to its last position).
template <typename scalar_t>
inline PrefillTile begin_prefill_item(int64_t item, const std::vector<int64_t>& item_seq,
                                      const std::vector<int64_t>& item_pos, const scalar_t* query,
                                      const int32_t* tables, const int32_t* lens, const int32_t* starts,
                                      const Shape& sh, int64_t d, float scale, int64_t sliding_window, int64_t width,
                                      float* q, const scalar_t** qraw, float* acc, float* row_max, float* row_sum,
                                      int64_t* row_pos, std::vector<int64_t>& chunk_key,
                                      std::vector<int64_t>& chunk_base, std::vector<int64_t>& chunk_len) {
  const int64_t group = sh.num_heads / sh.num_kv_heads;
  const int64_t tile = item / sh.num_kv_heads, h = item % sh.num_kv_heads;
  const int64_t s = item_seq[tile], i0 = item_pos[tile];
  const int64_t q_len = starts[s + 1] - starts[s], seq_len = lens[s], ctx = seq_len - q_len;
  const int64_t npos = std::min<int64_t>(kTile, q_len - i0), rows = npos * group;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r / group, head = h * group + r % group;
    const scalar_t* qr = query + (starts[s] + i) * sh.q_row + head * d;
    if (qraw != nullptr) qraw[r] = qr;
    to_float(qr, q + r * d, d);
    for (int64_t j = 0; j < d; ++j) q[r * d + j] *= scale;
    row_pos[r] = ctx + i;
  }
  std::fill(acc, acc + rows * d, 0.f);
  std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + rows, 0.f);
  const int64_t last = ctx + i0 + npos - 1;                      // the tile's last position
  const int64_t lo_pos = sliding_window > 0 ? std::max<int64_t>(0, ctx + i0 + 1 - sliding_window) : 0;
  visible_chunks(tables + s * sh.table_width, sh.block_stride, sh.token_stride, sh.block_size, h * d, seq_len, lo_pos,
                 last, width, chunk_key, chunk_base, chunk_len);
  return {s, h, i0, rows};
}

// A finished prefill item: each row's accumulator over its softmax sum, written to its (position, head) in out
template <typename scalar_t>
inline void store_prefill_rows(float* acc, const float* row_sum, int64_t rows, int64_t d_size, int64_t group,
                               int64_t h, int64_t first_row, scalar_t* out, int64_t out_row) {
  for (int64_t r = 0; r < rows; ++r) {
    float* ar = acc + r * d_size;
    const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    for (int64_t d = 0; d < d_size; ++d) ar[d] *= inv;
    from_float(ar, out + (first_row + r / group) * out_row + (h * group + r % group) * d_size, d_size);
  }
}

#if defined(__AVX512F__)
// Attention of query rows that may be many per sequence (prefill chunks, mixed with decode rows), causal over
// each sequence's cache. A work item is one sequence, one KV head and a tile of up to kTile consecutive query
// positions (with all query heads of the KV head: rows = positions x group). The visible keys go in chunks of
// 16, kGroup chunks per online-softmax update. Each chunk's keys are transposed once (bfloat16 pairs for
// vdpbf16ps with a bfloat16 cache on AVX512-BF16, else [D][16] float32 for fused multiply-adds), so a row's
// scores need no horizontal sum per key; P V runs on vdpbf16ps over the values of two keys per dword (the
// probabilities rounded to bfloat16, and the softmax sum taken over the rounded values) or in float32.
// key chunks of 16 per online-softmax update in prefill
constexpr int64_t kGroup = 4;

template <typename scalar_t, int64_t kD>
void prefill(const scalar_t* query, const scalar_t* kv_cache, const int32_t* tables, const int32_t* lens,
             const int32_t* starts, scalar_t* out, const Shape& sh, float scale, int64_t sliding_window,
             int num_threads) {
  constexpr int64_t kV = kD / 16;
  const int64_t group = sh.num_heads / sh.num_kv_heads;
  const scalar_t* k_cache = kv_cache;
  const scalar_t* v_cache = kv_cache + sh.kv_half;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // work items: (sequence, KV head, tile of query positions); the tiles of all sequences in one list
  std::vector<int64_t> item_seq, item_pos;
  prefill_tiles(starts, sh.num_seqs, item_seq, item_pos);
  const int64_t tiles = static_cast<int64_t>(item_seq.size()), items = tiles * sh.num_kv_heads;
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t max_rows = kTile * group;
    std::vector<float> q(max_rows * kD), acc(max_rows * kD), row_max(max_rows), row_sum(max_rows),
        kt(kGroup * kD * 16), vb(kGroup * 16 * kD), p(kGroup * 16);
    std::vector<int64_t> chunk_key, chunk_base, chunk_len;
    std::vector<uint32_t> vp(kGroup * 8 * kD);   // bfloat16 V, two keys per dword: [chunk][key pair][D]
    std::vector<int64_t> row_pos(max_rows);
    std::vector<const scalar_t*> qraw(max_rows);   // bfloat16: each row's query in the input
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      // the visible keys in chunks of 16 (blocks hold a multiple of 16 tokens), taken kGroup chunks at a time:
      // one online-softmax update (max, exponentials, rescale) per group instead of per chunk
      const auto [s, h, i0, rows] = begin_prefill_item<scalar_t>(
          item, item_seq, item_pos, query, tables, lens, starts, sh, kD, scale, sliding_window, 16, q.data(),
          std::is_same_v<scalar_t, uint16_t> ? qraw.data() : nullptr, acc.data(), row_max.data(), row_sum.data(),
          row_pos.data(), chunk_key, chunk_base, chunk_len);
      const int64_t nchunks = static_cast<int64_t>(chunk_key.size());
      for (int64_t g0 = 0; g0 < nchunks; g0 += kGroup) {
        const int64_t gn = std::min<int64_t>(kGroup, nchunks - g0);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        // bfloat16: the keys' bfloat16 pairs transposed to [D/2][16] dwords (no conversion), for vdpbf16ps
        constexpr bool kPairs = std::is_same_v<scalar_t, uint16_t> && kD % 32 == 0;
        __m512i ktb[kGroup][kPairs ? kD / 2 : 1];
#else
        constexpr bool kPairs = false;
#endif
        for (int64_t j = 0; j < gn; ++j) {
          const int64_t m = chunk_len[g0 + j];
          const scalar_t* kc = k_cache + chunk_base[g0 + j];
          const scalar_t* vc = v_cache + chunk_base[g0 + j];
          float* kt_j = kt.data() + j * kD * 16;
          float* vb_j = vb.data() + j * 16 * kD;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
          if constexpr (kPairs) {
            transpose_keys16<kD>(reinterpret_cast<const uint16_t*>(kc), sh.token_stride, m, ktb[j]);
            interleave_value_pairs<kD>(reinterpret_cast<const uint16_t*>(vc), sh.token_stride, m, vp.data() + j * 8 * kD);
            continue;
          }
#endif
          for (int64_t t = 0; t < 16; ++t) {                           // K^T [D][16], V [16][D] in float32
            if (t < m) {
              if constexpr (!kPairs) {
                to_float(kc + t * sh.token_stride, vb_j + t * kD, kD);
                for (int64_t d = 0; d < kD; ++d) kt_j[d * 16 + t] = vb_j[t * kD + d];
              }
              to_float(vc + t * sh.token_stride, vb_j + t * kD, kD);
            } else {
              if constexpr (!kPairs)
                for (int64_t d = 0; d < kD; ++d) kt_j[d * 16 + t] = 0.f;
              std::fill(vb_j + t * kD, vb_j + (t + 1) * kD, 0.f);
            }
          }
        }
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
          // the scores of 4 rows against each chunk of the group
          __m512 s4[4][kGroup];
          const int64_t r_end = std::min<int64_t>(rows, r0 + 4);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
          if constexpr (kPairs) {   // the raw bfloat16 query rows, two features per dword, scaled afterwards
            const __m512 sc = _mm512_set1_ps(scale);
            for (int64_t r = r0; r < r_end; ++r)
              scores_chunks_bf16<kD, kGroup>(ktb, static_cast<int>(gn), qraw[r], sc, s4[r - r0]);
          }
#endif
          for (int64_t j = 0; j < gn && !kPairs; ++j) {
            for (int u = 0; u < 4; ++u) s4[u][j] = _mm512_setzero_ps();
            const float* kt_j = kt.data() + j * kD * 16;
            if (r_end - r0 == 4) {
              const float* q0 = q.data() + r0 * kD;
              for (int64_t d = 0; d < kD; ++d) {
                const __m512 kd = _mm512_loadu_ps(kt_j + d * 16);
                for (int u = 0; u < 4; ++u) s4[u][j] = _mm512_fmadd_ps(_mm512_set1_ps(q0[u * kD + d]), kd, s4[u][j]);
              }
            } else {
              for (int64_t r = r0; r < r_end; ++r)
                for (int64_t d = 0; d < kD; ++d)
                  s4[r - r0][j] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * kD + d]), _mm512_loadu_ps(kt_j + d * 16),
                                                  s4[r - r0][j]);
            }
          }
          for (int64_t r = r0; r < r_end; ++r) {
            const int64_t pos = row_pos[r];
            const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, pos + 1 - sliding_window) : 0;
            // visible keys of chunk j: key0 + t in [first, pos] and t < m
            __mmask16 vis[kGroup];
            __m512 top = _mm512_set1_ps(neg_inf);
            bool any = false;
            for (int64_t j = 0; j < gn; ++j) {
              const int64_t key0 = chunk_key[g0 + j], m = chunk_len[g0 + j];
              const int64_t t_lo = std::clamp<int64_t>(first - key0, 0, 16);
              const int64_t t_hi = std::clamp<int64_t>(pos - key0 + 1, 0, m);
              vis[j] = t_hi > t_lo ? static_cast<__mmask16>(((1u << t_hi) - 1u) & ~((1u << t_lo) - 1u)) : 0;
              any = any || vis[j] != 0;
              s4[r - r0][j] = _mm512_mask_blend_ps(vis[j], _mm512_set1_ps(neg_inf), s4[r - r0][j]);
              top = _mm512_max_ps(top, s4[r - r0][j]);
            }
            if (!any) continue;                                        // no visible key in the group
            const float block_max = std::max(row_max[r], _mm512_reduce_max_ps(top));
            const __m512 bm = _mm512_set1_ps(block_max);
            __m512 total = _mm512_setzero_ps();
            for (int64_t j = 0; j < gn; ++j) {
              __m512 pv = _mm512_maskz_mov_ps(vis[j], exp16_nonpositive(_mm512_sub_ps(s4[r - r0][j], bm)));
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
              // P V takes the probabilities in bfloat16: normalise by the sum of the same rounded values
              if constexpr (kPairs)
                pv = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(pv)), 16));
#endif
              _mm512_storeu_ps(p.data() + 16 * j, pv);
              total = _mm512_add_ps(total, pv);
            }
            const float correction = std::exp(row_max[r] - block_max);   // 0 on the first visible keys
            row_max[r] = block_max;
            row_sum[r] = row_sum[r] * correction + _mm512_reduce_add_ps(total);
            float* ar = acc.data() + r * kD;
            __m512 a[kV];
            const __m512 c = _mm512_set1_ps(correction);
            for (int64_t v = 0; v < kV; ++v) a[v] = _mm512_mul_ps(c, _mm512_loadu_ps(ar + 16 * v));
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
            if constexpr (kPairs) {   // P V with vdpbf16ps: the probabilities of two keys per dword, rounded to bf16
              for (int64_t j = 0; j < gn; ++j) {
                if (!vis[j]) continue;
                const __m256i pb = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p.data() + 16 * j));
                alignas(32) int32_t pairs[8];
                _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), pb);
                const uint32_t* vp_j = vp.data() + j * 8 * kD;
                const int kp_lo = __builtin_ctz(vis[j]) / 2;
                const int kp_hi = (16 - __builtin_clz(static_cast<unsigned>(vis[j]) << 16) + 1) / 2;
                for (int kp = kp_lo; kp < kp_hi; ++kp) {
                  const __m512bh pp = (__m512bh)_mm512_set1_epi32(pairs[kp]);
                  for (int64_t v = 0; v < kV; ++v)
                    a[v] = _mm512_dpbf16_ps(a[v], pp, (__m512bh)_mm512_loadu_si512(vp_j + kp * kD + 16 * v));
                }
              }
              for (int64_t v = 0; v < kV; ++v) _mm512_storeu_ps(ar + 16 * v, a[v]);
              continue;
            }
#endif
            for (int64_t j = 0; j < gn; ++j) {
              if (!vis[j]) continue;
              const float* vb_j = vb.data() + j * 16 * kD;
              const int t_lo = __builtin_ctz(vis[j]), t_hi = 16 - __builtin_clz(static_cast<unsigned>(vis[j]) << 16);
              for (int t = t_lo; t < t_hi; ++t) {
                const __m512 pt = _mm512_set1_ps(p[16 * j + t]);
                for (int64_t v = 0; v < kV; ++v) a[v] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vb_j + t * kD + 16 * v), a[v]);
              }
            }
            for (int64_t v = 0; v < kV; ++v) _mm512_storeu_ps(ar + 16 * v, a[v]);
          }
        }
      }
      store_prefill_rows(acc.data(), row_sum.data(), rows, kD, group, h, starts[s] + i0, out, sh.out_row);
    }
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// 8 rows of 8 floats transposed in place: afterwards r[i] holds element i of rows 0..7
inline void transpose8_ps(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// prefill() for CPUs with AVX2/FMA but no AVX512: the same work items (sequence, KV head, kTile query positions
// with the group's heads), keys in chunks of 8 (a block size that is a multiple of 16 holds whole chunks),
// kPrefillChunks chunks per online-softmax update. Each chunk's keys are transposed once to [D][8] float32, so a
// row's 8 scores are plain multiply-adds (two rows at a time, a query feature broadcast once for every chunk);
// the exponentials are vectorised; P V keeps 8 vectors of a row's accumulator in registers over the keys.
// float32 throughout (a bfloat16 cache is converted as it is read).
constexpr int64_t kPrefillChunks = 4;

template <typename scalar_t, int64_t kD, typename kv_t = scalar_t>
void prefill_avx2(const scalar_t* query, const kv_t* kv_cache, const int32_t* tables, const int32_t* lens,
                  const int32_t* starts, scalar_t* out, const Shape& sh, float scale, int64_t sliding_window,
                  int num_threads) {
  constexpr int64_t kV = kD / 8;
  const int64_t group = sh.num_heads / sh.num_kv_heads;
  const kv_t* k_cache = kv_cache;
  const kv_t* v_cache = kv_cache + sh.kv_half;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> item_seq, item_pos;
  prefill_tiles(starts, sh.num_seqs, item_seq, item_pos);
  const int64_t tiles = static_cast<int64_t>(item_seq.size()), items = tiles * sh.num_kv_heads;
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t max_rows = kTile * group;
    std::vector<float> q(max_rows * kD), acc(max_rows * kD), row_max(max_rows), row_sum(max_rows),
        kt(kPrefillChunks * kD * 8), vb(kPrefillChunks * 8 * kD), p(kPrefillChunks * 8),
        sc(max_rows * kPrefillChunks * 8);
    std::vector<int64_t> chunk_key, chunk_base, chunk_len, row_pos(max_rows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const auto [s, h, i0, rows] = begin_prefill_item<scalar_t>(
          item, item_seq, item_pos, query, tables, lens, starts, sh, kD, scale, sliding_window, 8, q.data(),
          nullptr, acc.data(), row_max.data(), row_sum.data(), row_pos.data(), chunk_key, chunk_base, chunk_len);
      const int64_t nchunks = static_cast<int64_t>(chunk_key.size());
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      for (int64_t g0 = 0; g0 < nchunks; g0 += kPrefillChunks) {
        const int64_t gn = std::min<int64_t>(kPrefillChunks, nchunks - g0);
        for (int64_t j = 0; j < kPrefillChunks; ++j) {   // K^T [D][8] and V [8][D] in float32, missing keys zero
          const int64_t m = j < gn ? chunk_len[g0 + j] : 0;
          const kv_t* kc = k_cache + (j < gn ? chunk_base[g0 + j] : 0);
          const kv_t* vc = v_cache + (j < gn ? chunk_base[g0 + j] : 0);
          float* kt_j = kt.data() + j * kD * 8;
          float* vb_j = vb.data() + j * 8 * kD;
          for (int64_t d0 = 0; d0 < kD; d0 += 8) {   // 8 keys x 8 features at a time, transposed in registers
            __m256 r[8];
            for (int64_t t = 0; t < 8; ++t) r[t] = t < m ? load8(kc + t * sh.token_stride + d0) : _mm256_setzero_ps();
            transpose8_ps(r);
            for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(kt_j + (d0 + i) * 8, r[i]);
          }
          for (int64_t t = 0; t < 8; ++t)
            for (int64_t d0 = 0; d0 < kD; d0 += 8)
              _mm256_storeu_ps(vb_j + t * kD + d0, t < m ? load8(vc + t * sh.token_stride + d0) : _mm256_setzero_ps());
        }
        // the scores of every row against the group's chunks (all kPrefillChunks, so that the sums stay in
        // registers; a group's missing chunks are zero and masked below), two rows at a time
        for (int64_t r0 = 0; r0 < rows; r0 += 2) {
          const bool two = r0 + 1 < rows;
          __m256 s0[kPrefillChunks], s1[kPrefillChunks];
          for (int64_t j = 0; j < kPrefillChunks; ++j) s0[j] = s1[j] = _mm256_setzero_ps();
          const float* q0 = q.data() + r0 * kD;
          const float* q1 = two ? q0 + kD : q0;
          for (int64_t d = 0; d < kD; ++d) {
            const __m256 a = _mm256_broadcast_ss(q0 + d), b = _mm256_broadcast_ss(q1 + d);
            for (int64_t j = 0; j < kPrefillChunks; ++j) {
              const __m256 kd = _mm256_loadu_ps(kt.data() + j * kD * 8 + d * 8);
              s0[j] = _mm256_fmadd_ps(a, kd, s0[j]);
              s1[j] = _mm256_fmadd_ps(b, kd, s1[j]);
            }
          }
          for (int64_t j = 0; j < kPrefillChunks; ++j) {   // (a constant trip count keeps s0, s1 in registers)
            _mm256_storeu_ps(sc.data() + (r0 * kPrefillChunks + j) * 8, s0[j]);
            if (two) _mm256_storeu_ps(sc.data() + ((r0 + 1) * kPrefillChunks + j) * 8, s1[j]);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t pos = row_pos[r];
          const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, pos + 1 - sliding_window) : 0;
          // visible keys of chunk j: key0 + t in [first, pos] and t < m
          __m256 vis[kPrefillChunks];
          __m256 top = _mm256_set1_ps(neg_inf);
          bool any = false;
          for (int64_t j = 0; j < gn; ++j) {
            const int64_t key0 = chunk_key[g0 + j], m = chunk_len[g0 + j];
            const int32_t t_lo = static_cast<int32_t>(std::clamp<int64_t>(first - key0, 0, 8));
            const int32_t t_hi = static_cast<int32_t>(std::clamp<int64_t>(pos - key0 + 1, 0, m));
            any = any || t_hi > t_lo;
            vis[j] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(t_hi), lane),
                                                          _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(t_lo - 1))));
            const __m256 sv = _mm256_blendv_ps(_mm256_set1_ps(neg_inf),
                                               _mm256_loadu_ps(sc.data() + (r * kPrefillChunks + j) * 8), vis[j]);
            _mm256_storeu_ps(p.data() + 8 * j, sv);
            top = _mm256_max_ps(top, sv);
          }
          if (!any) continue;                                        // no visible key in the group
          __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
          t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
          t4 = _mm_max_ss(t4, _mm_movehdup_ps(t4));
          const float block_max = std::max(row_max[r], _mm_cvtss_f32(t4));
          const __m256 bm = _mm256_set1_ps(block_max);
          __m256 total = _mm256_setzero_ps();
          for (int64_t j = 0; j < gn; ++j) {
            const __m256 pv = _mm256_and_ps(vis[j], exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p.data() + 8 * j), bm)));
            _mm256_storeu_ps(p.data() + 8 * j, pv);
            total = _mm256_add_ps(total, pv);
          }
          const float correction = std::exp(row_max[r] - block_max);   // 0 on the first visible keys
          row_max[r] = block_max;
          row_sum[r] = row_sum[r] * correction + hsum8(total);
          float* ar = acc.data() + r * kD;
          const __m256 c = _mm256_set1_ps(correction);
          for (int64_t v0 = 0; v0 < kV; v0 += 8) {   // 8 vectors of the accumulator at a time
            __m256 a[8];
            for (int64_t v = 0; v < 8; ++v) a[v] = _mm256_mul_ps(c, _mm256_loadu_ps(ar + 8 * (v0 + v)));
            for (int64_t j = 0; j < gn; ++j) {
              const float* vb_j = vb.data() + j * 8 * kD;
              for (int64_t t = 0; t < 8; ++t) {
                const float pt = p[8 * j + t];
                if (pt == 0.f) continue;
                const __m256 pb = _mm256_set1_ps(pt);
                for (int64_t v = 0; v < 8; ++v)
                  a[v] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(vb_j + t * kD + 8 * (v0 + v)), a[v]);
              }
            }
            for (int64_t v = 0; v < 8; ++v) _mm256_storeu_ps(ar + 8 * (v0 + v), a[v]);
          }
        }
      }
      store_prefill_rows(acc.data(), row_sum.data(), rows, kD, group, h, starts[s] + i0, out, sh.out_row);
    }
  }
}
#endif

template <typename scalar_t>
void dispatch_head_size(const scalar_t* query, const scalar_t* kv_cache, const int32_t* tables, const int32_t* lens,
                        const int32_t* starts, scalar_t* out, const Shape& sh, float scale, int64_t sliding_window,
                        int num_threads) {
  switch (sh.head_size) {
    case 64:
      decode<scalar_t, 64>(query, kv_cache, tables, lens, starts, out, sh, scale, sliding_window, num_threads);
      break;
    case 128:
      decode<scalar_t, 128>(query, kv_cache, tables, lens, starts, out, sh, scale, sliding_window, num_threads);
      break;
    default:
      decode<scalar_t, 0>(query, kv_cache, tables, lens, starts, out, sh, scale, sliding_window, num_threads);
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// the prefill kernel this build has: AVX512, else AVX2
template <typename scalar_t, int64_t kD>
void prefill_native(const scalar_t* query, const scalar_t* kv_cache, const int32_t* tables, const int32_t* lens,
                    const int32_t* starts, scalar_t* out, const Shape& sh, float scale, int64_t sliding_window,
                    int num_threads) {
#if defined(__AVX512F__)
  prefill<scalar_t, kD>(query, kv_cache, tables, lens, starts, out, sh, scale, sliding_window, num_threads);
#else
  prefill_avx2<scalar_t, kD>(query, kv_cache, tables, lens, starts, out, sh, scale, sliding_window, num_threads);
#endif
}
#endif

#if defined(PLINTH_ATTN_AMX)
// Causal attention of one sequence on AMX tiles (bfloat16): its L query rows [L, H, kD] are the last L of its S
// positions; keys and values [S, Hkv, kD] contiguous. Flash-style: per work item 32 query rows of one query head,
// key blocks of 32 in order; S = Q K^T as 2 x 2 tiles (rows x keys, the head dimension in 32-wide steps), an online
// softmax on the rows in float32 (probabilities rounded to bfloat16, the sums over the rounded values), P V as
// tiles of 32 keys times 16-dimension value columns two at a time, the float32 output rescaled and added per block.
// Keys and values are first packed into the tiles' right-hand layouts once per call: keys as transposed bfloat16
// pairs (16 keys x kD/2 pairs per tile of keys), values as key pairs (16 pairs x 16 dimensions per tile).
template <int64_t kD>
void amx_prefill(const uint16_t* query, int64_t q_row, const uint16_t* key, const uint16_t* value, int64_t kv_row,
                 uint16_t* out, int64_t out_row, int64_t L, int64_t S, int64_t H, int64_t Hkv, float scale,
                 int num_threads) {
  constexpr int64_t kPairs = kD / 2, kColTiles = kD / 16;
  const int64_t group = H / Hkv, kblocks = (S + 31) / 32, qblocks = (L + 31) / 32;
  // keys: [Hkv][kblocks * 2 tiles][kD/2 pairs][16 keys] dwords; values: [Hkv][kblocks][kD/16][16 pairs][16] dwords
  const int64_t kt_head = kblocks * 2 * kPairs * 16, vt_head = kblocks * kColTiles * 256;
  std::vector<uint32_t> kt(static_cast<size_t>(Hkv * kt_head)), vt(static_cast<size_t>(Hkv * vt_head));
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < Hkv * kblocks; ++item) {
      const int64_t h = item / kblocks, kb = item % kblocks;
      for (int64_t half = 0; half < 2; ++half) {   // keys 32 kb + 16 half .. + 15
        const int64_t j0 = kb * 32 + half * 16, m = std::max<int64_t>(0, std::min<int64_t>(16, S - j0));
        __m512i ktb[kPairs];
        transpose_keys16<kD>(key + std::min(j0, S - 1) * kv_row + h * kD, kv_row, m, ktb);
        uint32_t* dst = kt.data() + h * kt_head + (kb * 2 + half) * kPairs * 16;
        for (int64_t i = 0; i < kPairs; ++i) _mm512_storeu_si512(dst + i * 16, ktb[i]);
      }
      uint32_t vp[16 * kD];   // [pair 0..15][kD] dwords
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t j0 = kb * 32 + half * 16, m = std::max<int64_t>(0, std::min<int64_t>(16, S - j0));
        interleave_value_pairs<kD>(value + std::min(j0, S - 1) * kv_row + h * kD, kv_row, m, vp + half * 8 * kD);
      }
      uint32_t* dst = vt.data() + h * vt_head + kb * kColTiles * 256;
      for (int64_t ct = 0; ct < kColTiles; ++ct)
        for (int64_t kp = 0; kp < 16; ++kp)
          std::memcpy(dst + ct * 256 + kp * 16, vp + kp * kD + ct * 16, 64);
    }
    AttnTileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    alignas(64) uint16_t qbuf[32 * kD];
    alignas(64) uint16_t pbuf[32 * 32];
    alignas(64) float sbuf[2][32 * 32], cbuf[4][16 * 16], obuf[32 * kD];
    float row_max[32], row_sum[32], corr[32], new_max[32];
    alignas(64) uint32_t ones[256];   // a right-hand tile of bfloat16 pairs (1, 1)
    for (uint32_t& w : ones) w = 0x3F803F80u;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < H * qblocks; ++item) {
      const int64_t qh = item / qblocks, qb = item % qblocks, h = qh / group;
      const int64_t i0 = qb * 32, rows = std::min<int64_t>(32, L - i0);
      const int64_t first_pos = S - L + i0;   // the position of the item's first row
      for (int64_t r = 0; r < 32; ++r) {
        if (r < rows) std::memcpy(qbuf + r * kD, query + (i0 + r) * q_row + qh * kD, kD * sizeof(uint16_t));
        else std::memset(qbuf + r * kD, 0, kD * sizeof(uint16_t));
        row_max[r] = new_max[r] = neg_inf;
        row_sum[r] = 0.f;
      }
      std::memset(pbuf, 0, sizeof(pbuf));
      std::memset(obuf, 0, sizeof(obuf));
      const uint32_t* kth = kt.data() + h * kt_head;
      const uint32_t* vth = vt.data() + h * vt_head;
      const int64_t nkb = (first_pos + rows - 1) / 32 + 1;   // key blocks up to the last row's position
      // scores of key block kb into sb: tiles 0-3 = (rows 0-15 | 16-31) x (keys 0-15 | 16-31)
      auto scores = [&](int64_t kb, float* sb) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t dh = 0; dh < kD / 32; ++dh) {
          _tile_loadd(4, qbuf + 32 * dh, kD * 2);
          _tile_loadd(5, qbuf + 16 * kD + 32 * dh, kD * 2);
          _tile_loadd(6, kth + ((kb * 2) * kPairs + 16 * dh) * 16, 64);
          _tile_loadd(7, kth + ((kb * 2 + 1) * kPairs + 16 * dh) * 16, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, sb, 128);
        _tile_stored(1, sb + 16, 128);
        _tile_stored(2, sb + 16 * 32, 128);
        _tile_stored(3, sb + 16 * 32 + 16, 128);
      };
      // pipelined: the next block's scores run on the tiles while this block's probabilities, just written by
      // vector stores, settle before the P V tiles load them. Row maxima are kept in raw scores (the scale is
      // positive) and the scale goes into the base-2 exponent with log2(e): exp(scale (s - m)) = 2^(c s - c m).
      const float c2 = scale * 1.44269504088896341f;
      const __m512 cv = _mm512_set1_ps(c2);
      scores(0, sbuf[0]);
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const float* sb = sbuf[kb & 1];
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t visible = first_pos + r - kb * 32 + 1;   // keys 0 .. visible-1 of the block are visible
          new_max[r] = row_max[r];
          if (visible <= 0) {   // none yet: the row's probabilities are 0 and its state stays
            std::memset(pbuf + r * 32, 0, 64);
            continue;
          }
          __m512 s0 = _mm512_loadu_ps(sb + r * 32), s1 = _mm512_loadu_ps(sb + r * 32 + 16);
          __mmask16 m0 = 0xffff, m1 = 0xffff;
          if (visible < 32) {   // the causal edge inside the block
            m0 = visible >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << visible) - 1u);
            m1 = visible <= 16 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << (visible - 16)) - 1u);
            s0 = _mm512_mask_blend_ps(m0, _mm512_set1_ps(neg_inf), s0);
            s1 = _mm512_mask_blend_ps(m1, _mm512_set1_ps(neg_inf), s1);
          }
          const float top = std::max(row_max[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
          const __m512 tv = _mm512_set1_ps(top * c2);
          __m512 e0 = exp2_16_nonpositive(_mm512_fmsub_ps(s0, cv, tv));
          __m512 e1 = exp2_16_nonpositive(_mm512_fmsub_ps(s1, cv, tv));
          if (visible < 32) {   // exactly 0 past the edge
            e0 = _mm512_maskz_mov_ps(m0, e0);
            e1 = _mm512_maskz_mov_ps(m1, e1);
          }
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbuf + r * 32), (__m256i)_mm512_cvtneps_pbh(e0));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbuf + r * 32 + 16), (__m256i)_mm512_cvtneps_pbh(e1));
          new_max[r] = top;
        }
        // the rows' rescale factors 2^(c (old max - new max)) (~0 on the first visible keys; 1 without new keys)
        for (int64_t r0 = 0; r0 < 32; r0 += 16) {
          const __m512 old = _mm512_loadu_ps(row_max + r0), top = _mm512_loadu_ps(new_max + r0);
          const __mmask16 same = _mm512_cmp_ps_mask(old, top, _CMP_EQ_OQ);
          const __m512 c = _mm512_mask_blend_ps(same, exp2_16_nonpositive(_mm512_mul_ps(_mm512_sub_ps(old, top), cv)),
                                                _mm512_set1_ps(1.f));
          _mm512_storeu_ps(corr + r0, c);
          _mm512_storeu_ps(row_max + r0, top);
        }
        if (kb + 1 < nkb) scores(kb + 1, sbuf[(kb + 1) & 1]);
        // P V, two 16-dimension column tiles at a time; the output rescaled and added
        _tile_loadd(4, pbuf, 64);
        _tile_loadd(5, pbuf + 16 * 32, 64);
        for (int64_t cp = 0; cp < kColTiles / 2; ++cp) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          _tile_loadd(6, vth + (kb * kColTiles + 2 * cp) * 256, 64);
          _tile_loadd(7, vth + (kb * kColTiles + 2 * cp + 1) * 256, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
          _tile_stored(0, cbuf[0], 64);
          _tile_stored(1, cbuf[1], 64);
          _tile_stored(2, cbuf[2], 64);
          _tile_stored(3, cbuf[3], 64);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t g = r / 16, rr = r % 16;
            float* o = obuf + r * kD + 32 * cp;
            const __m512 c = _mm512_set1_ps(corr[r]);
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), c, _mm512_loadu_ps(cbuf[2 * g] + rr * 16)));
            _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16), c, _mm512_loadu_ps(cbuf[2 * g + 1] + rr * 16)));
          }
        }
        // the rows' sums of the block's probabilities as rounded (every column of P times a tile of ones)
        _tile_zero(0);
        _tile_zero(2);
        _tile_loadd(6, ones, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        _tile_stored(0, cbuf[0], 64);
        _tile_stored(2, cbuf[2], 64);
        for (int64_t r = 0; r < rows; ++r) row_sum[r] = row_sum[r] * corr[r] + cbuf[2 * (r / 16)][(r % 16) * 16];
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f);
        uint16_t* dst = out + (i0 + r) * out_row + qh * kD;
        for (int64_t j = 0; j < kD / 16; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * j),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(obuf + r * kD + 16 * j), inv)));
      }
    }
    _tile_release();
  }
}
#endif

}  // namespace

extern "C" {

// The ABI version the Python side checks before calling.
int64_t plinth_cpu_paged_abi() { return 6; }

// Whether this build reads a bfloat16 cache under float32 queries (dtype 3 of the decode and prefill entry points):
// the AVX2 kernels without AVX512.
int64_t plinth_cpu_paged_has_f32_bf16() {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

// query [T, H, D] rows of q_row elements; kv_cache [2, N, BS, Hkv, D] contiguous; tables [B, W] int32;
// lens [B] int32 (tokens in the cache, this step's included); starts [B + 1] int32 (query row of each
// sequence); out [T, H, D] rows of out_row elements, written for the sequences' rows only.
// dtype: 0 = float32, 1 = bfloat16, 2 = bfloat16 queries and outputs over an FP8 E4M3 cache (torch.float8_e4m3fn
// bytes, the same layout; head sizes 64 and 128, builds where plinth_cpu_paged_has_fp8(): each key and value row is
// widened to bfloat16, exactly, as it is read, then attended as a bfloat16 cache is); 3 = float32 queries and outputs
// over a bfloat16 cache (builds where plinth_cpu_paged_has_f32_bf16(): each key and value widened to float32, exactly,
// as it is read: the outputs of a float32 cache holding the same values). sliding_window <= 0: none.
void plinth_cpu_paged_decode(const void* query, const void* kv_cache, const int32_t* tables, const int32_t* lens,
                             const int32_t* starts, void* out, int64_t dtype, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_size, int64_t num_blocks, int64_t block_size,
                             int64_t table_width, int64_t q_row, int64_t out_row, double scale,
                             int64_t sliding_window, int64_t num_threads) {
  const int64_t token_stride = num_kv_heads * head_size;
  const int64_t block_stride = block_size * token_stride;
  const Shape sh{num_seqs, num_heads, num_kv_heads, head_size, block_size, table_width,
                 q_row, out_row, num_blocks * block_stride, block_stride, token_stride};
  const int threads = static_cast<int>(std::max<int64_t>(1, num_threads));
  if (dtype == 2) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const auto* q = static_cast<const uint16_t*>(query);
    const auto* kv = static_cast<const uint8_t*>(kv_cache);
    auto* o = static_cast<uint16_t*>(out);
    if (head_size == 64)
      decode<uint16_t, 64, uint8_t>(q, kv, tables, lens, starts, o, sh, static_cast<float>(scale), sliding_window, threads);
    else if (head_size == 128)
      decode<uint16_t, 128, uint8_t>(q, kv, tables, lens, starts, o, sh, static_cast<float>(scale), sliding_window, threads);
#endif
  } else if (dtype == 3) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    const auto* q = static_cast<const float*>(query);
    const auto* kv = static_cast<const uint16_t*>(kv_cache);
    auto* o = static_cast<float*>(out);
    if (head_size == 64)
      decode<float, 64, uint16_t>(q, kv, tables, lens, starts, o, sh, static_cast<float>(scale), sliding_window, threads);
    else if (head_size == 128)
      decode<float, 128, uint16_t>(q, kv, tables, lens, starts, o, sh, static_cast<float>(scale), sliding_window, threads);
    else
      decode<float, 0, uint16_t>(q, kv, tables, lens, starts, o, sh, static_cast<float>(scale), sliding_window, threads);
#endif
  } else if (dtype == 0) {
    dispatch_head_size(static_cast<const float*>(query), static_cast<const float*>(kv_cache), tables, lens, starts,
                       static_cast<float*>(out), sh, static_cast<float>(scale), sliding_window, threads);
  } else {
    dispatch_head_size(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(kv_cache), tables, lens,
                       starts, static_cast<uint16_t*>(out), sh, static_cast<float>(scale), sliding_window, threads);
  }
}

// The first `tokens` token rows of one sequence in one half (keys or values) of an FP8 E4M3 cache ([N, BS, row]
// bytes, row = Hkv x D a multiple of 32; the sequence's blocks in table) widened to bfloat16 into out [tokens, row]
// (exactly: every E4M3 value is a bfloat16 value). Returns 0; -1 without AVX512-BF16 or for another row size.
int64_t plinth_cpu_gather_e4m3(const void* cache_half, const int32_t* table, int64_t tokens, int64_t block_size,
                               int64_t row, void* out, int64_t num_threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (row % 32 != 0) return -1;
  const auto* cache = static_cast<const uint8_t*>(cache_half);
  auto* dst = static_cast<uint16_t*>(out);
#pragma omp parallel num_threads(static_cast<int>(std::max<int64_t>(1, num_threads))) if (tokens * row >= (1 << 15))
  {
    const E4m3Rows rows;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const uint8_t* src = cache + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row;
      for (int64_t i = 0; i < row; i += 32) _mm512_storeu_si512(dst + t * row + i, rows.load32(src + i));
    }
  }
  return 0;
#else
  (void)cache_half; (void)table; (void)tokens; (void)block_size; (void)row; (void)out; (void)num_threads;
  return -1;
#endif
}

// Whether plinth_cpu_paged_decode runs bfloat16 caches on AMX tiles where the CPU and Linux allow (on = 1, the
// default) or on AVX512-BF16 vectors (0); returns 1 where this build and process can use the tiles, else 0.
int64_t plinth_cpu_paged_set_decode_amx(int64_t on) {
#if defined(PLINTH_ATTN_AMX)
  g_decode_amx = on != 0;
  return amx_granted() ? 1 : 0;
#else
  (void)on;
  return 0;
#endif
}

// The KV heads per AMX call plinth_cpu_paged_decode takes for a bfloat16 cache of this shape (any batch: AMX work
// items take all of a sequence's KV heads), or 0 where it runs on vectors (with a positive scale).
int64_t plinth_cpu_paged_decode_amx_heads(int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                                          int64_t block_size) {
#if defined(PLINTH_ATTN_AMX)
  if ((head_size != 64 && head_size != 128) || num_kv_heads < 1 || num_heads % num_kv_heads != 0) return 0;
  return decode_amx_heads(num_heads / num_kv_heads, num_kv_heads, block_size, 1.f);
#else
  (void)num_heads; (void)num_kv_heads; (void)head_size; (void)block_size;
  return 0;
#endif
}

// Whether plinth_cpu_paged_decode takes dtype 2 (an FP8 E4M3 cache): builds with AVX512-BF16.
int64_t plinth_cpu_paged_has_fp8() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return 1;
#else
  return 0;
#endif
}

// Causal attention of any number of query rows per sequence (prefill chunks and decode rows mixed): the rows of
// sequence s are starts[s]..starts[s+1]-1 and sit at the last positions of its lens[s] cached tokens (this
// step's keys and values already written). Same layouts as plinth_cpu_paged_decode; head sizes that are
// multiples of 16 with AVX512 and block sizes that are multiples of 16; dtype as for the decode (0, 1, and 3 in AVX2
// builds; the AVX512 kernel declines 3). Returns 0, or -1 where unsupported.
int64_t plinth_cpu_paged_prefill(const void* query, const void* kv_cache, const int32_t* tables, const int32_t* lens,
                                 const int32_t* starts, void* out, int64_t dtype, int64_t num_seqs, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_size, int64_t num_blocks, int64_t block_size,
                                 int64_t table_width, int64_t q_row, int64_t out_row, double scale,
                                 int64_t sliding_window, int64_t num_threads) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (block_size % 16 != 0 || (head_size != 64 && head_size != 128)) return -1;
  const int64_t token_stride = num_kv_heads * head_size;
  const int64_t block_stride = block_size * token_stride;
  const Shape sh{num_seqs, num_heads, num_kv_heads, head_size, block_size, table_width,
                 q_row, out_row, num_blocks * block_stride, block_stride, token_stride};
  const int threads = static_cast<int>(std::max<int64_t>(1, num_threads));
  const float sc = static_cast<float>(scale);
  if (dtype == 3) {   // float32 queries over a bfloat16 cache (the AVX2 kernel only)
#if !defined(__AVX512F__)
    const auto* q = static_cast<const float*>(query);
    const auto* kv = static_cast<const uint16_t*>(kv_cache);
    if (head_size == 64)
      prefill_avx2<float, 64, uint16_t>(q, kv, tables, lens, starts, static_cast<float*>(out), sh, sc, sliding_window,
                                        threads);
    else
      prefill_avx2<float, 128, uint16_t>(q, kv, tables, lens, starts, static_cast<float*>(out), sh, sc, sliding_window,
                                         threads);
    return 0;
#else
    return -1;
#endif
  }
  if (dtype == 0 && head_size == 64)
    prefill_native<float, 64>(static_cast<const float*>(query), static_cast<const float*>(kv_cache), tables, lens, starts,
                              static_cast<float*>(out), sh, sc, sliding_window, threads);
  else if (dtype == 0)
    prefill_native<float, 128>(static_cast<const float*>(query), static_cast<const float*>(kv_cache), tables, lens, starts,
                               static_cast<float*>(out), sh, sc, sliding_window, threads);
  else if (head_size == 64)
    prefill_native<uint16_t, 64>(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(kv_cache), tables, lens,
                                 starts, static_cast<uint16_t*>(out), sh, sc, sliding_window, threads);
  else
    prefill_native<uint16_t, 128>(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(kv_cache), tables, lens,
                                  starts, static_cast<uint16_t*>(out), sh, sc, sliding_window, threads);
  return 0;
#else
  (void)query; (void)kv_cache; (void)tables; (void)lens; (void)starts; (void)out; (void)dtype; (void)num_seqs;
  (void)num_heads; (void)num_kv_heads; (void)head_size; (void)num_blocks; (void)block_size; (void)table_width;
  (void)q_row; (void)out_row; (void)scale; (void)sliding_window; (void)num_threads;
  return -1;
#endif
}


// Causal attention of one sequence's L bfloat16 query rows (query [L, H, D], rows q_row elements apart; the last L
// of its S positions) over its S keys and values ([S, Hkv, D], rows kv_row elements apart) on AMX tiles, into out
// [L, H, D] (rows out_row apart). Head sizes 64 and 128. Returns 0; -1 where the library was built without AMX-BF16
// or Linux refuses the tile state; -2 for shapes it does not take.
int64_t plinth_cpu_amx_prefill(const void* query, int64_t q_row, const void* key, const void* value, int64_t kv_row,
                               void* out, int64_t out_row, int64_t L, int64_t S, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_size, double scale, int64_t num_threads) {
#if defined(PLINTH_ATTN_AMX)
  if (!amx_granted()) return -1;
  // (a positive scale: the row maxima are kept in raw scores)
  if ((head_size != 64 && head_size != 128) || L < 1 || S < L || num_kv_heads < 1 || num_heads % num_kv_heads != 0 ||
      !(scale > 0))
    return -2;
  const int threads = static_cast<int>(std::max<int64_t>(1, num_threads));
  const auto* q = static_cast<const uint16_t*>(query);
  const auto* k = static_cast<const uint16_t*>(key);
  const auto* v = static_cast<const uint16_t*>(value);
  auto* o = static_cast<uint16_t*>(out);
  if (head_size == 64)
    amx_prefill<64>(q, q_row, k, v, kv_row, o, out_row, L, S, num_heads, num_kv_heads, static_cast<float>(scale), threads);
  else
    amx_prefill<128>(q, q_row, k, v, kv_row, o, out_row, L, S, num_heads, num_kv_heads, static_cast<float>(scale), threads);
  return 0;
#else
  (void)query; (void)q_row; (void)key; (void)value; (void)kv_row; (void)out; (void)out_row; (void)L; (void)S;
  (void)num_heads; (void)num_kv_heads; (void)head_size; (void)scale; (void)num_threads;
  return -1;
#endif
}

}  // extern "C"
