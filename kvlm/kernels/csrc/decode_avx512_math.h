// Vector helpers of the AVX-512 decode micro-kernels (decode_avx512.h): the shuffle tree that turns 16
// accumulators into 16 scores, a value pinned in a register, and exp of non-positive arguments.
#pragma once

#include <immintrin.h>

namespace kvlm_decode {
namespace avx512 {

// 16 vectors -> one vector whose lane i is the sum of the lanes of a[i]: four levels of "add the two halves of
// each pair" (30 two-source permutes, 15 adds) instead of 16 horizontal sums of ~8 steps each.
inline __m512 tree16(const __m512 (&a)[16]) {
  // after level k the partial sums of vector i sit in lanes whose index has bit (3 - k) equal to i's; inputs in
  // bit-reversed order make lane i of the result the sum of a[i]
  static constexpr int rev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  const __m512i lo1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i hi1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i hi2 = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512i lo3 = _mm512_setr_epi32(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
  const __m512i hi3 = _mm512_setr_epi32(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const __m512i lo4 = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
  const __m512i hi4 = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  __m512 u[8], w[4], z[2];
#pragma GCC unroll 16
  for (int i = 0; i < 8; ++i) {
    const __m512 x = a[rev[2 * i]], y = a[rev[2 * i + 1]];
    u[i] = _mm512_add_ps(_mm512_permutex2var_ps(x, lo1, y), _mm512_permutex2var_ps(x, hi1, y));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_add_ps(_mm512_permutex2var_ps(u[2 * i], lo2, u[2 * i + 1]),
                         _mm512_permutex2var_ps(u[2 * i], hi2, u[2 * i + 1]));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_permutex2var_ps(w[2 * i], lo3, w[2 * i + 1]),
                         _mm512_permutex2var_ps(w[2 * i], hi3, w[2 * i + 1]));
  return _mm512_add_ps(_mm512_permutex2var_ps(z[0], lo4, z[1]), _mm512_permutex2var_ps(z[0], hi4, z[1]));
}

// v as it is, which the compiler must then hold in a register: a vector loaded once and used by several FMAs is
// otherwise folded into each of them as a memory operand (GCC 12 did so in score16: RB loads of each key vector
// instead of one, 17 loads to 16 FMAs, so the score pass was bound by the load ports)
inline __m512 in_register(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

// exp(x) for x <= 0 (scores minus their running max): Cephes' expf polynomial as decode_core.h's vexp, the
// power of two applied by scalef; below -87.3 (exp < FLT_MIN) it gives exp(-87.3) ~ 1e-38 instead of a denormal
// (masked keys are zeroed by the caller).
inline __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365478515625f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace avx512
}  // namespace kvlm_decode
