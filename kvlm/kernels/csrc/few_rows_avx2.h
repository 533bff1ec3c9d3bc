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


// The 4 x 3 block's loop over its first K16 (a multiple of 16) columns, written in assembly: 12 accumulators
// (ymm0-11), the 3 weight vectors of a step held (ymm12-14) and one x vector (ymm15), so 7 loads feed 12 FMAs, two
// steps of 8 columns an iteration, and PF lines from `pf` prefetched into L1 an iteration (`pf` advances). GCC
// compiled the same loop from intrinsics with the weight loads folded into the FMAs (16 loads to 12 FMAs) or one
// accumulator spilled, from one build to the next; on the Zen 3 EPYC, one core, all in cache: 45-72 GFLOP/s
// against 81-94 here (an FMA-only loop: 100). The sums in a[] come out bit-identical to the intrinsics' loop.
template <int PF>
inline void loop_4x3(const float* x, const float* w, int64_t K, int64_t K16, const char* pf, __m256 (&a)[12]) {
  const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
  alignas(32) __m256 out[12];
  int64_t k = 0;
#define KVLM_STEP_4X3(o)                                                                                           \
  "vmovups " #o "(%[w0],%[k],4), %%ymm12\n\t"                                                                     \
  "vmovups " #o "(%[w1],%[k],4), %%ymm13\n\t"                                                                     \
  "vmovups " #o "(%[w2],%[k],4), %%ymm14\n\t"                                                                     \
  "vmovups " #o "(%[x0],%[k],4), %%ymm15\n\t"                                                                     \
  "vfmadd231ps %%ymm12, %%ymm15, %%ymm0\n\t"                                                                      \
  "vfmadd231ps %%ymm13, %%ymm15, %%ymm1\n\t"                                                                      \
  "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n\t"                                                                      \
  "vmovups " #o "(%[x1],%[k],4), %%ymm15\n\t"                                                                     \
  "vfmadd231ps %%ymm12, %%ymm15, %%ymm3\n\t"                                                                      \
  "vfmadd231ps %%ymm13, %%ymm15, %%ymm4\n\t"                                                                      \
  "vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n\t"                                                                      \
  "vmovups " #o "(%[x2],%[k],4), %%ymm15\n\t"                                                                     \
  "vfmadd231ps %%ymm12, %%ymm15, %%ymm6\n\t"                                                                      \
  "vfmadd231ps %%ymm13, %%ymm15, %%ymm7\n\t"                                                                      \
  "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n\t"                                                                      \
  "vmovups " #o "(%[x3],%[k],4), %%ymm15\n\t"                                                                     \
  "vfmadd231ps %%ymm12, %%ymm15, %%ymm9\n\t"                                                                      \
  "vfmadd231ps %%ymm13, %%ymm15, %%ymm10\n\t"                                                                     \
  "vfmadd231ps %%ymm14, %%ymm15, %%ymm11\n\t"
  asm volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"
      "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"
      "vxorps %%ymm2, %%ymm2, %%ymm2\n\t"
      "vxorps %%ymm3, %%ymm3, %%ymm3\n\t"
      "vxorps %%ymm4, %%ymm4, %%ymm4\n\t"
      "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n\t"
      "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"
      "vxorps %%ymm8, %%ymm8, %%ymm8\n\t"
      "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"
      "vxorps %%ymm10, %%ymm10, %%ymm10\n\t"
      "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
      "test %[n], %[n]\n\t"
      "jle 2f\n\t"
      ".p2align 6\n"
      "1:\n\t"  // two steps of 8 columns, then PF prefetches
      KVLM_STEP_4X3(0) KVLM_STEP_4X3(32)
      ".rept %c[npf]\n\t"
      KVLM_FEW_SPREAD_INSN " (%[pf])\n\t"
      "add $64, %[pf]\n\t"
      ".endr\n\t"
      "add $16, %[k]\n\t"
      "cmp %[n], %[k]\n\t"
      "jl 1b\n"
      "2:\n\t"
      "vmovaps %%ymm0, 0(%[out])\n\t"
      "vmovaps %%ymm1, 32(%[out])\n\t"
      "vmovaps %%ymm2, 64(%[out])\n\t"
      "vmovaps %%ymm3, 96(%[out])\n\t"
      "vmovaps %%ymm4, 128(%[out])\n\t"
      "vmovaps %%ymm5, 160(%[out])\n\t"
      "vmovaps %%ymm6, 192(%[out])\n\t"
      "vmovaps %%ymm7, 224(%[out])\n\t"
      "vmovaps %%ymm8, 256(%[out])\n\t"
      "vmovaps %%ymm9, 288(%[out])\n\t"
      "vmovaps %%ymm10, 320(%[out])\n\t"
      "vmovaps %%ymm11, 352(%[out])\n\t"
      : [k] "+r"(k), [pf] "+r"(pf)
      : [w0] "r"(w0), [w1] "r"(w1), [w2] "r"(w2), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3),
        [n] "r"(K16), [out] "r"(out), [npf] "i"(PF)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#undef KVLM_STEP_4X3
  for (int i = 0; i < 12; ++i) a[i] = out[i];
}

// 4 rows of x x NB (1-3) weight rows as 4 NB accumulators (NB = 3: + 3 weight vectors and an x vector, all 16
// registers; 7 loads to 12 FMAs where block<8> has 9 to 8). The caller runs it for each 4 rows over the same weight
// rows in turn, the later passes reading them from L1. One pass (4-7 rows, SPREAD false): every line of the weight
// rows prefetched kFarBytes ahead into L2 and kNearBytes into L1. Several passes (SPREAD): `pf_lines` lines from
// `pf` into L1, spread one or two a step over the loop (each pass its share of what follows: few_rows.h's
// rows_block says why), and each x vector loaded once for its NB FMAs (GCC otherwise folds the load into each FMA:
// 15 loads to 12 FMAs; at one pass the folded form measured faster, 0.95x with the x vector held). PF >= 0 (NB = 3,
// several passes): the first K & ~15 columns by loop_4x3, PF lines from `pf` an iteration of 16 columns.
template <int NB, bool SPREAD, int PF = -1>
inline void block_4xn(const float* x, const float* w, int64_t K, float* y, int64_t ys, const float* bias, bool far,
                      const char* pf, int64_t pf_lines) {
  __m256 a[4 * NB];
  for (int i = 0; i < 4 * NB; ++i) a[i] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  const __m256i m = tail_mask(K - K8);
  int64_t k0 = 0;
  if constexpr (PF >= 0) {
    static_assert(NB == 3 && SPREAD, "loop_4x3: 3 weight rows, several passes");
    k0 = K & ~int64_t(15);
    loop_4x3<PF>(x, w, K, k0, pf, a);
    pf_lines = 0;
  }
  const int64_t steps = std::max<int64_t>(1, K8 / 8), per_step = (pf_lines + steps - 1) / steps;
  for (int64_t k = k0; k < K8; k += 8) {
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
