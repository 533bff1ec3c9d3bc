// AVX2 pieces of the portable decode path (decode_core.h includes this where KVLM_AVX2): horizontal sums of score
// accumulators. 16 registers of 8 floats hold at most 2 query rows x 6 keys of accumulators, the 2 query vectors
// and a key; decode_core.h's score_block takes that shape for the wide (latent) tiles, 4 x 2 for narrow ones (GQA's
// 4 rows a group; 2 x 4 for 2 rows) and 1 x 8 for one row.
#pragma once

namespace kvlm_decode {

namespace avx2 {
// 8 vectors -> their 8 lane sums in one vector: two levels of horizontal adds leave the sums of each vector's
// two 128-bit halves side by side, one add across the halves finishes them (7 instructions for 8 sums).
inline __m256 tree8(const __m256 (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // halves of a0..a3, of a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
// 4 vectors -> their 4 lane sums: two levels of horizontal adds, then the two 128-bit halves added.
inline __m128 tree4(const __m256* a) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}
}  // namespace avx2

// 2 rows x 4 keys of scores in one tree8; 1 row x 4 keys in two levels of horizontal adds
template <>
inline void store_sums<float, 2, 4>(Vec<float>::type (&a)[2][4], float scale, float* s, int stride) {
  const __m256(&v)[8] = reinterpret_cast<const __m256(&)[8]>(a);
  const __m256 f = _mm256_mul_ps(avx2::tree8(v), _mm256_set1_ps(scale));
  _mm_storeu_ps(s, _mm256_castps256_ps128(f));
  _mm_storeu_ps(s + stride, _mm256_extractf128_ps(f, 1));
}
template <>
inline void store_sums<float, 1, 4>(Vec<float>::type (&a)[1][4], float scale, float* s, int) {
  _mm_storeu_ps(s, _mm_mul_ps(avx2::tree4(reinterpret_cast<const __m256*>(&a[0][0])), _mm_set1_ps(scale)));
}
// 1 row x 8 keys (one narrow row) in one tree8
template <>
inline void store_sums<float, 1, 8>(Vec<float>::type (&a)[1][8], float scale, float* s, int) {
  _mm256_storeu_ps(s, _mm256_mul_ps(avx2::tree8(reinterpret_cast<const __m256(&)[8]>(a)), _mm256_set1_ps(scale)));
}
// 4 rows x 2 keys (narrow rows) in one tree8
template <>
inline void store_sums<float, 4, 2>(Vec<float>::type (&a)[4][2], float scale, float* s, int stride) {
  alignas(32) float f[8];  // f[x * 2 + y]
  _mm256_store_ps(f, _mm256_mul_ps(avx2::tree8(reinterpret_cast<const __m256(&)[8]>(a)), _mm256_set1_ps(scale)));
  for (int x = 0; x < 4; ++x) {
    s[x * stride] = f[2 * x];
    s[x * stride + 1] = f[2 * x + 1];
  }
}
// 2 rows x 6 keys: tree8 over row 0's six and row 1's first two, two levels of horizontal adds for row 1's last four
template <>
inline void store_sums<float, 2, 6>(Vec<float>::type (&a)[2][6], float scale, float* s, int stride) {
  const __m256* v = reinterpret_cast<const __m256*>(&a[0][0]);  // v[x * 6 + y] = a[x][y]
  const __m256 f = _mm256_mul_ps(avx2::tree8(reinterpret_cast<const __m256(&)[8]>(*v)), _mm256_set1_ps(scale));
  const __m128 g = _mm_mul_ps(avx2::tree4(v + 8), _mm_set1_ps(scale));
  alignas(32) float row0[8];
  _mm256_store_ps(row0, f);
  for (int y = 0; y < 6; ++y) s[y] = row0[y];
  s[stride] = row0[6];
  s[stride + 1] = row0[7];
  _mm_storeu_ps(s + stride + 2, g);
}

}  // namespace kvlm_decode
