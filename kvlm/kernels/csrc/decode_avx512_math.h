// Vector helpers of the AVX-512 decode micro-kernels (decode_avx512.h): the shuffle tree that turns 16
// accumulators into 16 scores, a value pinned in a register, and exp of non-positive arguments.
#pragma once

#include <immintrin.h>

namespace kvlm_decode {
namespace avx512 {

// 16 vectors -> one vector whose lane i is the sum of the lanes of a[i]: four levels of "add the two halves of
// each pair" (30 shuffles, 15 adds) instead of 16 horizontal sums of ~8 steps each. The first two levels move
// 128-bit chunks (vshuff32x4), the last two lanes within chunks (vshufps): on the Zen 4 EPYC MLA's attention
// kernel ran 1.02-1.06x faster than with two-source lane permutes (vpermt2ps) at every level (benchmarks/
// decode-limit.md), and without any shuffles (a wrong sum, for the bound) 1.06-1.08x.
inline __m512 tree16(const __m512 (&a)[16]) {
  // after the chunk levels, chunk c of w[k] holds 4 partial sums of one input; inputs in this order make lane i
  // of the result the sum of a[i]
  static constexpr int ord[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
  __m512 u[8], w[4], t[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // chunks [x0 + x2, x1 + x3, y0 + y2, y1 + y3]
    const __m512 x = a[ord[2 * i]], y = a[ord[2 * i + 1]];
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // chunks [x, y, z, v]: one input's 4 partial sums each
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // within each chunk: pairs of adjacent lanes
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x88), _mm512_shuffle_ps(t[0], t[1], 0xDD));
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
