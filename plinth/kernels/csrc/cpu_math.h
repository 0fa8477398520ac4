// Helpers shared by plinth's native CPU kernels: bfloat16 and float16 conversions, and an exp for non-positive
// arguments that vectorises (and its 8-lane AVX2 and 16-lane AVX512 forms). Header-only; included with
// -I plinth/kernels/csrc.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace plinth_cpu {

inline float bf2f(uint16_t v) {  // bfloat16 bits -> float32 (exact)
  uint32_t word = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &word, sizeof(float));
  return f;
}

inline uint16_t f2bf(float f) {  // round to nearest even, as torch's float -> bfloat16 cast
  uint32_t word;
  std::memcpy(&word, &f, sizeof(float));
  if ((word & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
}

inline float round_bf(float f) { return bf2f(f2bf(f)); }

inline float half2f(uint16_t h) {  // IEEE float16 bits -> float32 (exact)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t word;
  if (exp == 0x1fu) {
    word = sign | 0x7f800000u | (man << 13);            // inf / NaN
  } else if (exp != 0) {
    word = sign | ((exp + 112u) << 23) | (man << 13);   // normal: rebias 15 -> 127
  } else if (man == 0) {
    word = sign;                                         // zero
  } else {                                               // subnormal: man * 2^-24
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&word, &f, sizeof(float));
    word |= sign;
  }
  float out;
  std::memcpy(&out, &word, sizeof(float));
  return out;
}

// 2^f for f in [-1/2, 1/2] as a degree-6 polynomial in f (Horner, highest degree first), shared by every width of
// exp_nonpositive below
constexpr float kExp2Poly[7] = {1.5403530393381609e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
                                5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f};

// exp(x) for x <= 0 in plain arithmetic (vectorises): 2^(x log2 e) = 2^n * 2^f with f in [-0.5, 0.5],
// 2^f from a degree-6 polynomial (relative error about 2e-7); arguments below -87 give about 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float y = x * 1.44269504088896341f;
  const float n = std::nearbyint(y);
  const float f = y - n;
  float p = kExp2Poly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Poly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 8 lanes (the same reduction and polynomial)
inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);   // (maxps returns its second operand for NaN: x stays NaN)
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#if defined(__AVX512F__)
inline __m512 exp2_poly16(__m512 f) {   // 2^f for f in [-1/2, 1/2] on 16 lanes: exp_nonpositive's polynomial
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return p;
}

// exp_nonpositive of 16 lanes: the same clamp, polynomial and power-of-two scaling as the scalar version.
inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), x);   // (maxps returns its second operand for NaN: x stays NaN)
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 p = exp2_poly16(_mm512_sub_ps(y, n));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 2^y for y <= 0, for arguments already in base 2 (a softmax's scale times log2(e) folded into one multiply-add):
// exp16_nonpositive's polynomial, its limit (2^-125 below it) and 2^n applied with one vscalefps.
inline __m512 exp2_16_nonpositive(__m512 y) {
  y = _mm512_max_ps(_mm512_set1_ps(-125.f), y);   // (NaN stays NaN)
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp2_poly16(_mm512_sub_ps(y, n)), n);
}
#endif

}  // namespace plinth_cpu
