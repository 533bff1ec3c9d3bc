// Vectors of the CPU decode kernel's portable path (decode_core.h): the vector type of this machine's width, lane
// sums, exp, unaligned loads, a block's score sums (with AVX2's shuffle trees from decode_avx2.h, AVX-512's here).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvlm_decode {

#ifndef KVLM_VEC_BYTES
#ifdef __AVX512F__
#define KVLM_VEC_BYTES 64  // one AVX-512 register
#else
#define KVLM_VEC_BYTES 32  // one AVX2 register (GCC splits it further on narrower machines)
#endif
#endif
constexpr int kVecBytes = KVLM_VEC_BYTES;
// AVX2 with FMA and no AVX-512 (Zen 2 / 3, Intel's client CPUs and its servers before Skylake-SP): 16 vector
// registers of 8 floats. The few-row weight products have a micro-kernel of their own there (few_rows_avx2.h);
// attention takes decode_core.h's portable path, row blocks of 2 (kMaxRowBlock; 4 x 2 on narrow rows), tree8's sums.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && KVLM_VEC_BYTES == 32 && !defined(KVLM_NO_AVX2)
#define KVLM_AVX2 1
#else
#define KVLM_AVX2 0
#endif

template <typename T>
struct Vec {
  static constexpr int L = kVecBytes / sizeof(T);
  typedef T type __attribute__((vector_size(kVecBytes)));
};

template <typename T>
inline T hsum(typename Vec<T>::type v) {
  T s = 0;
  for (int i = 0; i < Vec<T>::L; ++i) s += v[i];
  return s;
}
#if defined(__AVX512F__) && KVLM_VEC_BYTES == 64
template <>
inline float hsum<float>(Vec<float>::type v) {
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
}
template <>
inline double hsum<double>(Vec<double>::type v) {
  return _mm512_reduce_add_pd(reinterpret_cast<__m512d>(v));
}
#endif

// exp of a vector. float: Cephes' expf (range reduction by ln 2, degree-6 polynomial, ~1 ulp), vectorised,
// because one exp per row per key would otherwise cost as much as the dot products; double: libm (tests).
template <typename T>
inline typename Vec<T>::type vexp(typename Vec<T>::type x) {
  typename Vec<T>::type y;
  for (int i = 0; i < Vec<T>::L; ++i) y[i] = std::exp(x[i]);
  return y;
}
template <>
inline Vec<float>::type vexp<float>(Vec<float>::type x) {
  typedef int32_t VI __attribute__((vector_size(kVecBytes)));
  using V = Vec<float>::type;
  const V hi = V{} + 88.3762626647949f, lo = V{} - 87.3365478515625f;
  x = x > hi ? hi : x;
  V under = x < lo ? V{} + 1.0f : V{};  // exp(x) < FLT_MIN: 0 below (masked keys come as -inf)
  x = x < lo ? lo : x;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  V n = (x * 1.44269504088896341f + magic) - magic;
  V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  V pow2;
  std::memcpy(&pow2, &e, sizeof(V));
  V out = p * pow2;
  return under > 0.0f ? V{} : out;
}

template <typename T>
inline typename Vec<T>::type loadu(const T* p) {  // unaligned vector load
  typename Vec<T>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// s[x][y] = scale * (sum of the lanes of a[x][y]).
template <typename T, int RB, int KB>
inline void store_sums(typename Vec<T>::type (&a)[RB][KB], T scale, T* s, int stride) {
  for (int x = 0; x < RB; ++x)
    for (int y = 0; y < KB; ++y) s[x * stride + y] = hsum<T>(a[x][y]) * scale;
}
#if KVLM_VEC_BYTES == 64 && !defined(KVLM_NO_TREE)
// 16 float vectors -> their 16 lane sums in one vector, by a tree of 15 shuffle-and-add steps (the sum of two
// half-interleavings halves the partial sums per vector) instead of 16 horizontal sums of ~8 steps each.
template <>
inline void store_sums<float, 4, 4>(Vec<float>::type (&a)[4][4], float scale, float* s, int stride) {
  typedef int32_t VI __attribute__((vector_size(64)));
  using V = Vec<float>::type;
  const VI lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const VI hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const VI lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const VI hi2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const VI lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const VI hi3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const VI lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const VI hi4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  V* v = &a[0][0];  // v[i] = a[i / 4][i % 4]
  V u[8], w[4], z[2];
  for (int i = 0; i < 8; ++i) u[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo1) + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi1);
  for (int i = 0; i < 4; ++i) w[i] = __builtin_shuffle(u[2 * i], u[2 * i + 1], lo2) + __builtin_shuffle(u[2 * i], u[2 * i + 1], hi2);
  for (int i = 0; i < 2; ++i) z[i] = __builtin_shuffle(w[2 * i], w[2 * i + 1], lo3) + __builtin_shuffle(w[2 * i], w[2 * i + 1], hi3);
  const V f = (__builtin_shuffle(z[0], z[1], lo4) + __builtin_shuffle(z[0], z[1], hi4)) * scale;
  // lane k of f holds the sum of v[order[k]] (traced through the four levels above)
  static constexpr int order[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  for (int k = 0; k < 16; ++k) s[(order[k] / 4) * stride + order[k] % 4] = f[k];
}
#endif

#if KVLM_AVX2
}  // namespace kvlm_decode
#include "decode_avx2.h"
namespace kvlm_decode {
#endif

// Whether any lane of a vector compare's result is set.
template <typename T, typename VI>
inline bool any_lane(VI c) {
#if KVLM_AVX2
  if constexpr (sizeof(VI) == 32) {
    const __m256i x = reinterpret_cast<__m256i>(c);
    return !_mm256_testz_si256(x, x);
  }
#endif
  for (int i = 0; i < Vec<T>::L; ++i)
    if (c[i]) return true;
  return false;
}

}  // namespace kvlm_decode
