// The few-row product's micro-kernel on AVX2 + FMA CPUs without AVX-512 (few_rows.h includes it there in place of
// its own): the same dot-product form on 8-float vectors, RB rows of x x NB = 8 / RB weight rows as 8
// accumulators (16 registers: 8 accumulators, up to 4 weight vectors and a row of x fit), then avx2::tree8
// (decode_core.h) turns them into the 8 sums; from 4 rows of x, block_4xn (4 rows x 3 weight rows, 12
// accumulators; the whole step at batch 8 and one cached token 1.00-1.12x, benchmarks/decode-limit.md). On a Zen 3
// EPYC torch's products (MKL's, kept off its fast paths on AMD) streamed the reference shape's weights at 14-15
// GB/s at one row and 6 at 8 rows where the machine read 33-37.
#pragma once

namespace kvlm_decode {
namespace few_rows {

constexpr int kBlockOut = 8;  // outputs of one micro-kernel call

// A weight vector, loaded non-temporally where 32-byte aligned (as few_rows.h's AVX-512 load_w, which says why).
inline __m256 load_w(const float* p) {
#ifndef KVLM_NO_NT_LOADS  // build knob for measuring (ordinary loads)
  if ((reinterpret_cast<uintptr_t>(p) & 31) == 0)
    return _mm256_castsi256_ps(_mm256_stream_load_si256(reinterpret_cast<const __m256i*>(p)));
#endif
  return _mm256_loadu_ps(p);
}

// The first n (0-7) lanes set: maskload reads only those (none past a row's end).
inline __m256i tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// y[r * ys + j] = x_r . w_j (+ bias[j]) for the RB rows x_r of x (stride K) and the nb <= 8 / RB weight rows w_j of
// w (stride K); the block's missing weight rows repeat its last one (their sums are not stored).
template <int RB>
inline void block(const float* x, const float* w, int64_t K, int nb, float* y, int64_t ys, const float* bias) {
  constexpr int NB = kBlockOut / RB;
  __m256 a[kBlockOut];
  for (int i = 0; i < kBlockOut; ++i) a[i] = _mm256_setzero_ps();
  const float* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = w + std::min(j, nb - 1) * K;
  const int64_t K8 = K & ~int64_t(7);
  const __m256i m = tail_mask(K - K8);  // the tail of K
  if constexpr (RB <= 2) {  // one or two rows of x: each weight row read whole, in memory order
    for (int j = 0; j < NB; ++j) {
      const float* wj = wr[j];
      __m256 s0[RB], s1[RB];
      for (int r = 0; r < RB; ++r) s0[r] = s1[r] = _mm256_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= K8; k += 16) {
        const __m256 w0 = load_w(wj + k), w1 = load_w(wj + k + 8);
        for (int r = 0; r < RB; ++r) {
          s0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, s0[r]);
          s1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, s1[r]);
        }
      }
      if (k < K8) {
        const __m256 w0 = load_w(wj + k);
        for (int r = 0; r < RB; ++r) s0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, s0[r]);
      }
      if (K8 < K) {
        const __m256 w1 = _mm256_maskload_ps(wj + K8, m);
        for (int r = 0; r < RB; ++r) s1[r] = _mm256_fmadd_ps(_mm256_maskload_ps(x + r * K + K8, m), w1, s1[r]);
      }
      for (int r = 0; r < RB; ++r) a[r * NB + j] = _mm256_add_ps(s0[r], s1[r]);
    }
  } else {  // 4 or 8 rows: the NB weight rows side by side, each weight vector used by all RB rows
    for (int64_t k = 0; k < K8; k += 8) {
      __m256 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(wr[j] + k);
      if ((k & 15) == 0)  // once a 64-byte line: into L2 far ahead, into L1 near (few_rows.h says why)
        for (int j = 0; j < NB; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + kFarBytes, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + kNearBytes, _MM_HINT_T0);
        }
      for (int r = 0; r < RB; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * K + k);
        for (int j = 0; j < NB; ++j) a[r * NB + j] = _mm256_fmadd_ps(xv, wv[j], a[r * NB + j]);
      }
    }
    if (K8 < K) {
      __m256 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm256_maskload_ps(wr[j] + K8, m);
      for (int r = 0; r < RB; ++r) {
        const __m256 xv = _mm256_maskload_ps(x + r * K + K8, m);
        for (int j = 0; j < NB; ++j) a[r * NB + j] = _mm256_fmadd_ps(xv, wv[j], a[r * NB + j]);
      }
    }
  }
  alignas(32) float s[kBlockOut];
  _mm256_store_ps(s, avx2::tree8(a));
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < nb; ++j) y[r * ys + j] = s[r * NB + j] + (bias ? bias[j] : 0.0f);
}


// 4 rows of x x NB (1-3) weight rows as 4 NB accumulators (NB = 3: + 3 weight vectors and an x vector, all 16
// registers; 7 loads to 12 FMAs where block<8> has 9 to 8). The caller runs it for each 4 rows over the same weight
// rows in turn, the later passes reading them from L1. One pass (4-7 rows, SPREAD false): every line of the weight
// rows prefetched kFarBytes ahead into L2 and kNearBytes into L1. Several passes (SPREAD): `pf_lines` lines from
// `pf` into L1, spread one or two a step over the loop (each pass its share of what follows: few_rows.h's
// rows_block says why), and each x vector loaded once for its NB FMAs (GCC otherwise folds the load into each FMA:
// 15 loads to 12 FMAs; at one pass the folded form measured faster, 0.95x with the x vector held).
template <int NB, bool SPREAD>
inline void block_4xn(const float* x, const float* w, int64_t K, float* y, int64_t ys, const float* bias, bool far,
                      const char* pf, int64_t pf_lines) {
  __m256 a[4 * NB];
  for (int i = 0; i < 4 * NB; ++i) a[i] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  const __m256i m = tail_mask(K - K8);
  const int64_t steps = std::max<int64_t>(1, K8 / 8), per_step = (pf_lines + steps - 1) / steps;
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    if (!SPREAD && far && (k & 15) == 0)
      for (int j = 0; j < NB; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k) + kFarBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k) + kNearBytes, _MM_HINT_T0);
      }
    if (SPREAD)
      for (int64_t i = 0; i < per_step && pf_lines > 0; ++i, --pf_lines, pf += 64)
        _mm_prefetch(pf, KVLM_FEW_SPREAD_HINT);
    for (int r = 0; r < 4; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * K + k);
      if (SPREAD) asm("" : "+x"(xv));
      for (int j = 0; j < NB; ++j) a[r * NB + j] = _mm256_fmadd_ps(xv, wv[j], a[r * NB + j]);
    }
  }
  if (K8 < K) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_maskload_ps(w + j * K + K8, m);
    for (int r = 0; r < 4; ++r) {
      const __m256 xv = _mm256_maskload_ps(x + r * K + K8, m);
      for (int j = 0; j < NB; ++j) a[r * NB + j] = _mm256_fmadd_ps(xv, wv[j], a[r * NB + j]);
    }
  }
  alignas(32) float s[4 * NB];
  if constexpr (NB == 3) {
    const __m256 lo[8] = {a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]};  // copies: a[] stays in registers
    _mm256_store_ps(s, avx2::tree8(lo));
    _mm_storeu_ps(s + 8, avx2::tree4(a + 8));
  } else if constexpr (NB == 2) {
    const __m256 all[8] = {a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]};
    _mm256_store_ps(s, avx2::tree8(all));
  } else {
    _mm_store_ps(s, avx2::tree4(a));
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < NB; ++j) y[r * ys + j] = s[r * NB + j] + (bias ? bias[j] : 0.0f);
}

}  // namespace few_rows
}  // namespace kvlm_decode
