// Paged decode attention for CPUs, read in place from the KV cache.
//
// Cache layout: [2, num_blocks, block_size, num_kv_heads, head_size] (0 = keys, 1 = values).
// One work item is one sequence and a range of its KV heads (all of them when there are enough
// sequences to keep the threads busy, else one). It walks the sequence's blocks through its
// block-table row (prefetching the next block), scores every query head of each GQA group against
// the block's keys, and keeps a float32 online softmax (running max, running sum, rescaled
// accumulator) per query head. Nothing is gathered: one block's keys/values of one head are
// converted to float32 at a time. A sliding window starts the walk at the window's first token.
//
// The file includes no torch headers (it compiles in about a second) and exports C functions that
// take raw pointers; work items are spread over OpenMP threads (the libgomp runtime torch loads).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"

#if defined(__AVX512F__)
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

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, head_size, block_size, table_width;
  int64_t q_row, out_row, kv_half, block_stride, token_stride;
};

// kD > 0: the head size as a compile-time constant (loops over it unroll fully); 0: sh.head_size.
template <typename scalar_t, int64_t kD>
void decode(const scalar_t* query, const scalar_t* kv_cache, const int32_t* tables, const int32_t* lens,
            const int32_t* starts, scalar_t* out, const Shape& sh, float scale, int64_t sliding_window,
            int num_threads) {
  const int64_t group = sh.num_heads / sh.num_kv_heads, bs = sh.block_size;
  const int64_t d_size = kD > 0 ? kD : sh.head_size;
  // A work item is one sequence and a range of its KV heads: all heads when there are enough
  // sequences to keep the threads busy (each block is then read once, front to back), else one.
  const int64_t heads_per_item = sh.num_seqs >= 4 * num_threads ? sh.num_kv_heads : 1;
  const int64_t items_per_seq = sh.num_kv_heads / heads_per_item;
  const int64_t items = sh.num_seqs * items_per_seq;
  const int64_t rows = heads_per_item * group;  // query heads per item
  const scalar_t* k_cache = kv_cache;
  const scalar_t* v_cache = kv_cache + sh.kv_half;
  const float neg_inf = -std::numeric_limits<float>::infinity();

#pragma omp parallel num_threads(num_threads)
  {
    // per-thread scratch: the item's queries and accumulators [rows, D], one block's keys/values
    // of one head in float32 [BS, D], scores [BS]
    std::vector<float> q(rows * d_size), acc(rows * d_size), kblk(bs * d_size), vblk(bs * d_size), scores(bs),
        row_max(rows), row_sum(rows), gscores(group * bs);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t s = item / items_per_seq, h0 = (item % items_per_seq) * heads_per_item;
      const int64_t row = starts[s];
      if (starts[s + 1] == row) continue;  // no query token for this sequence in this step
      const int64_t seq_len = lens[s];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      to_float(query + row * sh.q_row + h0 * group * d_size, q.data(), rows * d_size);
      for (int64_t i = 0; i < rows * d_size; ++i) q[i] *= scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), neg_inf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      const int32_t* table = tables + s * sh.table_width;
      for (int64_t b = first / bs; b * bs < seq_len; ++b) {
        const int64_t lo = std::max<int64_t>(first - b * bs, 0);     // tokens lo..hi-1 of this block count
        const int64_t hi = std::min<int64_t>(seq_len - b * bs, bs);
        const int64_t n = hi - lo;
        if ((b + 1) * bs < seq_len) {  // the next block sits elsewhere in memory: fetch it while this one runs
          const int64_t next = static_cast<int64_t>(table[b + 1]) * sh.block_stride + h0 * d_size;
          const int64_t row_bytes = heads_per_item * d_size * static_cast<int64_t>(sizeof(scalar_t));
          for (int64_t t = 0; t < bs; ++t) {
            const char* k_row = reinterpret_cast<const char*>(k_cache + next + t * sh.token_stride);
            const char* v_row = reinterpret_cast<const char*>(v_cache + next + t * sh.token_stride);
            for (int64_t off = 0; off < row_bytes; off += 64) {
              __builtin_prefetch(k_row + off);
              __builtin_prefetch(v_row + off);
            }
          }
        }
        for (int64_t hh = 0; hh < heads_per_item; ++hh) {
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
      for (int64_t r = 0; r < rows; ++r) {
        float* ar = acc.data() + r * d_size;
        const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
        for (int64_t d = 0; d < d_size; ++d) ar[d] *= inv;
      }
      from_float(acc.data(), out + row * sh.out_row + h0 * group * d_size, rows * d_size);
    }
  }
}

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

}  // namespace

extern "C" {

// The ABI version the Python side checks before calling.
int64_t plinth_cpu_paged_abi() { return 1; }

// query [T, H, D] rows of q_row elements; kv_cache [2, N, BS, Hkv, D] contiguous; tables [B, W] int32;
// lens [B] int32 (tokens in the cache, this step's included); starts [B + 1] int32 (query row of each
// sequence); out [T, H, D] rows of out_row elements, written for the sequences' rows only.
// dtype: 0 = float32, 1 = bfloat16. sliding_window <= 0: none.
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
  if (dtype == 0) {
    dispatch_head_size(static_cast<const float*>(query), static_cast<const float*>(kv_cache), tables, lens, starts,
                       static_cast<float*>(out), sh, static_cast<float>(scale), sliding_window, threads);
  } else {
    dispatch_head_size(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(kv_cache), tables, lens,
                       starts, static_cast<uint16_t*>(out), sh, static_cast<float>(scale), sliding_window, threads);
  }
}

}  // extern "C"
