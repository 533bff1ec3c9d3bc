// AVX-512 loads of the CPU decode kernel's cached element types (float32, bf16, int8, float8 e4m3), widened to
// float32 vectors in registers; included by decode_avx512.h.
#pragma once

#include <immintrin.h>

namespace kvlm_decode {
namespace avx512 {

template <DType DT>
struct Elem;  // bytes per cached element
template <>
struct Elem<DType::f32> {
  static constexpr int size = 4;
};
template <>
struct Elem<DType::bf16> {
  static constexpr int size = 2;
};
template <>
struct Elem<DType::i8> {
  static constexpr int size = 1;
};
template <>
struct Elem<DType::f8> {
  static constexpr int size = 1;
};

// 16 cached elements at p as floats; the masked form reads only the lanes of m (the others are 0).
template <DType DT>
inline __m512 load(const char* p);
template <DType DT>
inline __m512 load(const char* p, __mmask16 m);
template <>
inline __m512 load<DType::f32>(const char* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load<DType::f32>(const char* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
template <>  // bf16 is the top half of a float32: widen, shift
inline __m512 load<DType::bf16>(const char* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
template <>
inline __m512 load<DType::bf16>(const char* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
template <>
inline __m512 load<DType::i8>(const char* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
template <>
inline __m512 load<DType::i8>(const char* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

// 16 float8 e4m3fn codes (widened to int32 lanes) as floats, decode_core.h's e4m3_to_float in vector form:
// normal codes by moving the exponent and mantissa bits into place, subnormal ones (exponent 0) as m 2^-9.
inline __m512 e4m3_to_ps(__m512i b) {
  const __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23));
  const __m512i sub = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / 512.0f)));
  __m512i v = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8)), normal, sub);
  v = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7F)), v,
                              _mm512_set1_epi32(0x7FC00000));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(v, sign));
}
template <>
inline __m512 load<DType::f8>(const char* p) {
  return e4m3_to_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
template <>
inline __m512 load<DType::f8>(const char* p, __mmask16 m) {
  return e4m3_to_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

inline __mmask16 tail_mask(int64_t n) {  // the first n % 16 lanes, or all 16
  const int r = static_cast<int>(n % 16);
  return r ? static_cast<__mmask16>((1u << r) - 1) : static_cast<__mmask16>(0xFFFF);
}

}  // namespace avx512
}  // namespace kvlm_decode
