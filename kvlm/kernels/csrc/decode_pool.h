// Cached rows as the decode kernel reads them (decode_core.h): the pool of pages behind a block table, its element
// types, and one row widened (and dequantized by its per-token scale) into a float / double buffer.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvlm_decode {

enum class DType { f32, f64, bf16, i8, f8 };  // f8: float8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa)

// One float8 e4m3fn code as a float: normal 2^(e - 7) (1 + m / 8), subnormal (e = 0) m 2^-9, NaN for S.1111.111
// (the format has no infinities).
inline float e4m3_to_float(uint8_t b) {
  const uint32_t em = b & 0x7F;
  uint32_t bits;
  if (em == 0x7F) {
    bits = 0x7FC00000u;
  } else if (em < 8) {
    const float f = static_cast<float>(em) * (1.0f / 512.0f);
    std::memcpy(&bits, &f, 4);
  } else {
    bits = (em << 20) + (120u << 23);  // exponent bias 7 -> 127, mantissa 3 -> 23 bits
  }
  bits |= static_cast<uint32_t>(b & 0x80) << 24;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Every float8 e4m3fn code as a float: the portable path widens a row by lookups (a code's bit fields cost a
// branch or two per element).
inline const struct E4M3Table {
  float f[256];
  E4M3Table() {
    for (int b = 0; b < 256; ++b) f[b] = e4m3_to_float(static_cast<uint8_t>(b));
  }
} kE4M3;

// A cached tensor read through the block table: pool (N, [G,] P, D) with arbitrary strides, optional
// per-token scale (N, [G,] P, 1).
struct Pool {
  const void* data = nullptr;
  DType dtype = DType::f32;
  int64_t s_page = 0, s_group = 0, s_row = 0;
  const float* scale = nullptr;
  int64_t sc_page = 0, sc_group = 0, sc_row = 0;
  int64_t D = 0;
};

// Row (page, group, row) of `p` -> dst[0:D] in T, zero-padded to Dp (dequantized by the per-token scale).
template <typename T>
inline void load_row(const Pool& p, int64_t page, int64_t g, int64_t row, T* dst, int64_t Dp) {
  const int64_t off = page * p.s_page + g * p.s_group + row * p.s_row;
  const int64_t D = p.D;
  switch (p.dtype) {
    case DType::f32: {
      const float* src = static_cast<const float*>(p.data) + off;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d]);
      break;
    }
    case DType::f64: {
      const double* src = static_cast<const double*>(p.data) + off;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d]);
      break;
    }
    case DType::bf16: {  // bf16 is the top half of a float32: widen by a shift
      const uint16_t* src = static_cast<const uint16_t*>(p.data) + off;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        uint32_t bits = static_cast<uint32_t>(src[d]) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        dst[d] = static_cast<T>(f);
      }
      break;
    }
    case DType::f8: {
      const uint8_t* src = static_cast<const uint8_t*>(p.data) + off;
      const T s = p.scale ? static_cast<T>(p.scale[page * p.sc_page + g * p.sc_group + row * p.sc_row]) : T(1);
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(kE4M3.f[src[d]]) * s;
      break;
    }
    case DType::i8: {
      const int8_t* src = static_cast<const int8_t*>(p.data) + off;
      const T s = p.scale ? static_cast<T>(p.scale[page * p.sc_page + g * p.sc_group + row * p.sc_row]) : T(1);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d]) * s;
      break;
    }
    default:
      break;  // the binding admits only the dtypes above
  }
  for (int64_t d = D; d < Dp; ++d) dst[d] = T(0);
}

}  // namespace kvlm_decode
