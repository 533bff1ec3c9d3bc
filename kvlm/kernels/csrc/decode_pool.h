// Cached rows as the decode kernel reads them (decode_core.h): the pool of pages behind a block table, its element
// types, one row widened (and dequantized by its per-token scale) into a float / double buffer, rows' addresses
// page by page, and the lines of rows to prefetch (LineSpans).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

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

#if defined(__F16C__) && defined(__AVX2__)
// float8 e4m3fn codes -> float32, 8 at a time, in registers: the code's 7 low bits shifted into a float16's
// exponent and mantissa fields give 2^-8 times its value, normal and subnormal alike (float16's exponent bias 15 is
// e4m3's 7 + 8), widened by vcvtph2ps; S.1111.111 is NaN. The elements done (a multiple of 8); the caller does the
// rest. (The table's lookups took the widening's time, and moved with where the row buffer fell against the table.)
inline int64_t widen_e4m3(const uint8_t* src, int64_t D, float s, float* dst) {
  const __m128i low7 = _mm_set1_epi16(0x7F), sign = _mm_set1_epi16(0x80);
  const __m256 two8 = _mm256_set1_ps(256.0f), sv = _mm256_set1_ps(s), nan = _mm256_set1_ps(NAN);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    __m128i w;
    std::memcpy(&w, src + d, 8);
    w = _mm_cvtepu8_epi16(w);
    const __m128i em = _mm_and_si128(w, low7);
    const __m128i h = _mm_or_si128(_mm_slli_epi16(em, 7), _mm_slli_epi16(_mm_and_si128(w, sign), 8));
    const __m256 f = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(h), two8), sv);  // exact, then one rounding
    const __m256 is_nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(em, low7)));
    _mm256_storeu_ps(dst + d, _mm256_blendv_ps(f, nan, is_nan));
  }
  return d;
}
#endif

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
      int64_t d = 0;
#if defined(__F16C__) && defined(__AVX2__)
      if constexpr (std::is_same<T, float>::value) d = widen_e4m3(src, D, s, dst);
#endif
      for (; d < D; ++d) dst[d] = static_cast<T>(kE4M3.f[src[d]]) * s;
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

template <typename T>
inline const T* row_ptr(const Pool& p, int64_t page, int64_t g, int64_t row) {
  return static_cast<const T*>(p.data) + page * p.s_page + g * p.s_group + row * p.s_row;
}

// Row (page, group, row) of `p` as bytes, and the row's length in bytes.
inline const char* row_bytes(const Pool& p, int64_t page, int64_t g, int64_t row, int64_t* len) {
  static const int size[] = {4, 8, 2, 1, 1};  // bytes per element of DType f32, f64, bf16, i8, f8
  const int es = size[static_cast<int>(p.dtype)];
  *len = p.D * es;
  return static_cast<const char*>(p.data) + (page * p.s_page + g * p.s_group + row * p.s_row) * es;
}

// Row (page, group, row) of `p` into L2.
inline void prefetch_row(const Pool& p, int64_t page, int64_t g, int64_t row) {
  int64_t len;
  const char* base = row_bytes(p, page, g, row, &len);
#ifndef KVLM_NO_PREFETCH
  for (int64_t off = 0; off < len; off += 64) __builtin_prefetch(base + off, 0, 2);
#endif
}

// Rows [t, t + n) of group g of `p` (pages of P rows through the block table tab) as stretches of adjacent 64-byte
// lines: f(first byte, lines) for a run of adjacent rows in one page, or for each row where rows are apart.
template <typename F>
inline void row_stretches(const Pool& p, const int32_t* tab, int64_t P, int64_t g, int64_t t, int64_t n, F&& f) {
  for (int64_t j = t; j < t + n;) {
    const int64_t run = std::min(t + n - j, P - j % P);
    int64_t len;
    const char* base = row_bytes(p, tab[j / P], g, j % P, &len);
    const int64_t stride = p.D ? len / p.D * p.s_row : 0;
    if (stride == len)
      f(base, (run * len + 63) / 64);
    else
      for (int64_t u = 0; u < run; ++u) f(base + u * stride, (len + 63) / 64);
    j += run;
  }
}

// Lines to prefetch a share at a time, as spans of adjacent 64-byte lines (row_stretches; decode_pipe.h, and
// attend_range_t's spread: listed one line at a time, with a store each, the listing took ~8 % of MLA's kernel in
// cache on the Zen 3 EPYC; as spans, MLA's kernel 1.02-1.07x, the step at batch 1 / 8192 1.05x).
struct LineSpans {
  struct Span {
    const char* p;
    int64_t lines;
  };
  std::vector<Span> spans;
  int64_t total = 0;  // lines listed
  size_t next = 0;    // the span and line within it that issue() prefetches next
  int64_t next_line = 0;
  void clear() {
    spans.clear();
    total = next_line = 0;
    next = 0;
  }
  // rows [t, t + n) of group g of `p` (pages of P rows through the block table tab)
  void add_rows(const Pool& p, const int32_t* tab, int64_t P, int64_t g, int64_t t, int64_t n) {
    row_stretches(p, tab, P, g, t, n, [&](const char* first, int64_t lines) {
      spans.push_back({first, lines});
      total += lines;
    });
  }
  // the next `count` lines into L2
  void issue(int64_t count) {
    for (; count > 0 && next < spans.size(); ++next, next_line = 0) {
      const Span& sp = spans[next];
      const int64_t k = std::min(count, sp.lines - next_line);
      for (int64_t i = next_line; i < next_line + k; ++i) __builtin_prefetch(sp.p + i * 64, 0, 2);
      count -= k;
      if ((next_line += k) < sp.lines) return;
    }
  }
};

// Rows [row, row + n) of one page of `p` as pointers: in place, or widened into buf (rows Dp apart).
template <typename T>
inline void page_rows(const Pool& p, bool direct, int64_t page, int64_t g, int64_t row, int n, T* buf, int64_t Dp,
                      const T** out) {
  if (direct) {
    const T* first = row_ptr<T>(p, page, g, row);
    for (int u = 0; u < n; ++u) out[u] = first + u * p.s_row;
    return;
  }
  for (int u = 0; u < n; ++u) {
    load_row<T>(p, page, g, row + u, buf + u * Dp, Dp);
    out[u] = buf + u * Dp;
  }
}

// A tile's n rows from (page_i, row) of the block table tab (pages of P rows), run by run within a page:
// f(page, row, run, jj) for each run (jj: its first row in the tile); leaves page_i, row after the tile.
template <typename F>
inline void page_runs(const int32_t* tab, int64_t P, int n, int64_t& page_i, int64_t& row, F&& f) {
  for (int jj = 0; jj < n;) {
    const int run = static_cast<int>(std::min<int64_t>(n - jj, P - row));
    f(tab[page_i], row, run, jj);
    jj += run;
    row += run;
    if (row == P) {
      row = 0;
      ++page_i;
    }
  }
}

// n rows of D elements from `first`, `stride` apart, into L1; adjacent rows as one span of lines.
template <typename T>
inline void prefetch_rows(const T* first, int n, int64_t stride, int64_t D) {
  constexpr int64_t line = 64 / sizeof(T);
  const int64_t span = stride == D ? n * D : D, rows = stride == D ? 1 : n;
  for (int64_t u = 0; u < rows; ++u)
#pragma GCC unroll 4
    for (int64_t off = 0; off < span; off += line) __builtin_prefetch(first + u * stride + off, 0, 3);
}

}  // namespace kvlm_decode
