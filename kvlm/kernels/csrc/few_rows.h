// The weight products of decode at a few rows, y = x W^T (+ b), on the plain (N, K) float32 weight (AVX-512, or
// AVX2 + FMA through few_rows_avx2.h's micro-kernel; kvlm.kernels.few_rows_linear, used by
// kvlm.attention.linear.Linear up to Linear.few_rows rows).
//
// Decode multiplies batch x new-token rows (1-8) by every weight, so its time is the time to read the weights.
// BLAS libraries handle these shapes as a matrix-vector product or pack for a wide GEMM, and on some CPUs stream
// the weights far below bandwidth (AMD EPYC, MKL: 10-17 GB/s where this reaches 35-56; benchmarks/
// few_rows_gemm.py). Here each weight row is read from memory once, in the layout it has, for all rows of x:
// dot-product form, RB rows of x x NB = 16 / RB weight rows as 16 AVX-512 accumulators over K, then one tree of
// shuffles (avx512::tree16) turns them into the 16 sums (at one or two rows of x each weight row is read whole,
// one after another: one sequential stream a thread, as the MHA score pass reads its keys; measured on the AMD
// EPYC, 268 MB of weights: at 1 row 1.02-1.07x faster than 16 rows side by side when the probe read ~50 GB/s and
// 1.085-1.10x when it read ~80, at the probe's rate both times; at 2 rows 1.01-1.07x, at 3 rows 1.00-1.05x).
// The units of weight rows (kUnitRows: 16 on AVX-512, 48 on AVX2) of all the weights of a call (q/k/v, gate/up: one
// input) are split over the threads in one parallel loop, each thread streaming a contiguous run of them (steal.h:
// then the back of a slower one's).
// From 4 rows on (compute-dense enough that the core's own window of misses no longer covers memory's latency) each
// weight row is prefetched twice: 32 KiB ahead into L2 and 2 KiB ahead into L1. A prefetch into L1 holds one of the
// core's few L1 miss buffers until the line arrives from memory, which caps a core's stream; into L2 it does not,
// and the near one then only moves lines from L2. Measured on the AMD EPYC at 8 rows (benchmarks/few_rows_gemm.py,
// interleaved): 1.35-1.48x faster than 16 KiB ahead into L1 alone while the machine streamed 55-60 GB/s, 1.05x while
// others held it at ~37 (a prefetch into L1 alone was itself 1.3-1.6x faster than none); at 1-2 rows the hardware
// prefetchers alone are fastest. AVX2 (few_rows_avx2.h) from 8 rows spreads its prefetch over the passes instead
// (groups_4xn below).
#pragma once

#if KVLM_AVX512 || KVLM_AVX2
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "steal.h"

namespace kvlm_decode {
namespace few_rows {

#ifndef KVLM_FEW_FAR  // build knobs for measuring: the prefetch distances
#define KVLM_FEW_FAR 32768
#define KVLM_FEW_NEAR 2048
#endif
constexpr int64_t kFarBytes = KVLM_FEW_FAR, kNearBytes = KVLM_FEW_NEAR;  // into L2, into L1: from 4 rows on
#ifndef KVLM_FEW_SPREAD  // build knob for measuring: AVX2's spread prefetch distance (groups_4xn, from 8 rows)
#define KVLM_FEW_SPREAD 16384
#endif
#ifndef KVLM_FEW_SPREAD_PASSES  // build knob: the spread prefetch from this many passes of 4 rows (else far / near)
#define KVLM_FEW_SPREAD_PASSES 2
#endif
#ifdef KVLM_FEW_SPREAD_L2  // build knob: the spread prefetch into L2 (else L1)
#define KVLM_FEW_SPREAD_HINT _MM_HINT_T1
#define KVLM_FEW_SPREAD_INSN "prefetcht1"
#else
#define KVLM_FEW_SPREAD_HINT _MM_HINT_T0
#define KVLM_FEW_SPREAD_INSN "prefetcht0"
#endif
constexpr int64_t kSpreadBytes = KVLM_FEW_SPREAD;
#ifndef KVLM_FEW_MAX_RB  // build knob for measuring: the largest row block (8 or 4)
#define KVLM_FEW_MAX_RB 8
#endif

}  // namespace few_rows
}  // namespace kvlm_decode

#if KVLM_AVX2
#include "few_rows_avx2.h"  // load_w, block<RB> and kBlockOut for AVX2
#else
namespace kvlm_decode {
namespace few_rows {

constexpr int kBlockOut = 16;  // outputs of one micro-kernel call

// A weight vector, loaded non-temporally where 64-byte aligned (vmovntdqa; the unaligned rest as usual). A step
// streams ~250 MB of weights through the caches in ~25 products; between them its norms, RoPE, cache writes and
// Python run cold, their code and data evicted. On the Zen 4 EPYC non-temporal loads of a 98 MB stream left the
// few operators after it 1.8-2.4x faster (350 -> 146-196 us) at the same read rate, and the whole step at one
// cached token 1.03-1.08x faster at batch 1 (weights read whole here, no software prefetch), level at batch 8,
// where the prefetch into L2 below brings each line in first (an NTA prefetch instead: 0.76-0.81x). On write-back
// memory a core may also treat it as an ordinary load (Intel's manual allows it): then nothing changes.
// Only where a weight vector feeds one or two rows of x: in a loop that uses it for several rows (4 or 8 rows
// side by side here, the panels at any row count) the Zen 4 EPYC issued them too slowly for the FMAs. One thread,
// ordinary against non-temporal loads: 4 rows from memory 30.0 against 18.1 GB/s, the panels at 8 rows 24.5
// against 10.1 (16 rows 12.7 against 5.1), and 1.6-2.4x in cache; at 1 row from memory 32.2 against 33.3.
inline __m512 load_w(const float* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 63) == 0)
    return _mm512_castsi512_ps(_mm512_stream_load_si512(const_cast<float*>(p)));
  return _mm512_loadu_ps(p);
}

// y[r * ys + j] = x_r . w_j (+ bias[j]) for the RB rows x_r of x (stride K) and the nb <= 16 / RB weight rows
// w_j of w (stride K); the block's missing weight rows repeat its last one (their sums are not stored).
template <int RB>
inline void block(const float* x, const float* w, int64_t K, int nb, float* y, int64_t ys, const float* bias) {
  constexpr int NB = 16 / RB;
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  const float* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = w + std::min(j, nb - 1) * K;
  const int64_t K16 = K & ~int64_t(15);
  const __mmask16 m = static_cast<__mmask16>((1u << (K - K16)) - 1);  // the tail of K
  if constexpr (RB <= 2) {  // one or two rows of x: each weight row read whole, in memory order (one stream a thread)
    for (int j = 0; j < NB; ++j) {
      const float* wj = wr[j];
      __m512 s0[RB], s1[RB];
      for (int r = 0; r < RB; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 32 <= K16; k += 32) {
        const __m512 w0 = load_w(wj + k), w1 = load_w(wj + k + 16);
        for (int r = 0; r < RB; ++r) {
          s0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), w0, s0[r]);
          s1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k + 16), w1, s1[r]);
        }
      }
      if (k < K16) {
        const __m512 w0 = load_w(wj + k);
        for (int r = 0; r < RB; ++r) s0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), w0, s0[r]);
      }
      if (K16 < K) {
        const __m512 w1 = _mm512_maskz_loadu_ps(m, wj + K16);
        for (int r = 0; r < RB; ++r) s1[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + r * K + K16), w1, s1[r]);
      }
      for (int r = 0; r < RB; ++r) a[r * NB + j] = _mm512_add_ps(s0[r], s1[r]);
    }
  } else {  // 4 or 8 rows: the NB weight rows side by side, each weight vector used by all RB rows
    for (int64_t k = 0; k < K16; k += 16) {
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(wr[j] + k);  // not load_w: see above
      for (int j = 0; j < NB; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + kFarBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + kNearBytes, _MM_HINT_T0);
      }
      for (int r = 0; r < RB; ++r) {
        const __m512 xv = _mm512_loadu_ps(x + r * K + k);
        for (int j = 0; j < NB; ++j) a[r * NB + j] = _mm512_fmadd_ps(xv, wv[j], a[r * NB + j]);
      }
    }
    if (K16 < K) {
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(m, wr[j] + K16);
      for (int r = 0; r < RB; ++r) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * K + K16);
        for (int j = 0; j < NB; ++j) a[r * NB + j] = _mm512_fmadd_ps(xv, wv[j], a[r * NB + j]);
      }
    }
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, avx512::tree16(a));
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < nb; ++j) y[r * ys + j] = s[r * NB + j] + (bias ? bias[j] : 0.0f);
}

}  // namespace few_rows
}  // namespace kvlm_decode
#endif

namespace kvlm_decode {
namespace few_rows {

// f(std::integral_constant<int, RB>(), r) for row blocks [r, r + RB) covering M rows: RB = MAX as often as it
// fits, then 4 (where MAX > 4), 2 and 1 once each at most, so that each block size is a compile-time constant.
template <int MAX, typename F>
inline void row_blocks(int64_t M, F&& f) {
  int64_t r = 0;
  for (; M - r >= MAX; r += MAX) f(std::integral_constant<int, MAX>(), r);
  if constexpr (MAX > 4)
    if (M - r >= 4) f(std::integral_constant<int, 4>(), r), r += 4;
  if (M - r >= 2) f(std::integral_constant<int, 2>(), r), r += 2;
  if (M - r >= 1) f(std::integral_constant<int, 1>(), r);
}

#ifndef KVLM_FEW_UNIT  // build knob for measuring: weight rows a work unit
#define KVLM_FEW_UNIT (KVLM_AVX2 ? 48 : 16)
#endif
// Weight rows a work unit of the threads: AVX-512's micro-kernel takes 16 at a time; AVX2's groups of 3 (from 4 rows
// of x) fit 48 whole, where 16 left two groups of 2 (8 accumulators: 6 loads to 8 FMAs).
constexpr int64_t kUnitRows = KVLM_FEW_UNIT;

#if KVLM_AVX2 && !defined(KVLM_NO_4X3)
// AVX2, M4 = 4, 8, ... rows of x: the weight rows [n0, n1) in groups of 3 (the last 4 or 2 as 2 + 2: no FMAs on
// repeated rows), each group against each 4 rows of x in turn (few_rows_avx2.h's block_4xn: one pass a 4 rows).
// From two passes on (8 rows) each pass prefetches into L1 its share of the group's size in lines kSpreadBytes
// ahead, one or two a step: prefetched by the first pass alone, memory stood idle while the later passes computed
// from L1 (memory and work took turns on the Zen 3 EPYC: 8 rows x 268 MB of weights 1.14x faster spread,
// benchmarks/decode-limit.md; 9-32 KiB ahead level, 4 KiB 0.87x).
template <bool SPREAD>
inline void groups_4xn(const float* x, int64_t M4, const float* w, int64_t K, int64_t n0, int64_t n1, float* y,
                       int64_t ys, const float* bias) {
  const int64_t passes = M4 / 4;
  for (int64_t n = n0; n < n1;) {
    const int64_t left = n1 - n, nb = left == 4 || left == 2 ? 2 : std::min<int64_t>(3, left);
    const int64_t lines = SPREAD ? (nb * K * 4 + 63) / 64 : 0;
    const char* ahead = reinterpret_cast<const char*>(w + n * K) + kSpreadBytes;
    for (int64_t r = 0; r < M4; r += 4) {
      const int64_t l0 = lines * (r / 4) / passes, l1 = lines * (r / 4 + 1) / passes;
      const auto run = [&](auto nb_tag) {
        block_4xn<decltype(nb_tag)::value, SPREAD>(x + r * K, w + n * K, K, y + r * ys + n, ys,
                                                   bias ? bias + n : nullptr, r == 0, ahead + l0 * 64, l1 - l0);
      };
      // 3 rows, several passes: loop_4x3, pass p prefetching its share of the group's 3 lines an iteration of
      // 16 columns (2 + 1 at 8 rows), starting where the passes before it stopped
      const int64_t p = r / 4, share = 3 / passes + (p < 3 % passes), iters = K / 16;
      const char* from = ahead + (p * (3 / passes) + std::min<int64_t>(p, 3 % passes)) * iters * 64;
      const auto run3 = [&](auto pf_tag) {
        block_4xn<3, true, decltype(pf_tag)::value>(x + r * K, w + n * K, K, y + r * ys + n, ys,
                                                    bias ? bias + n : nullptr, false, from, 0);
      };
      if (nb == 3 && SPREAD && share == 2) run3(std::integral_constant<int, 2>());
      else if (nb == 3 && SPREAD && share == 1) run3(std::integral_constant<int, 1>());
      else if (nb == 3 && SPREAD) run3(std::integral_constant<int, 0>());
      else if (nb == 3) run(std::integral_constant<int, 3>());
      else if (nb == 2) run(std::integral_constant<int, 2>());
      else run(std::integral_constant<int, 1>());
    }
    n += nb;
  }
}
#endif

// A unit's weight rows [n0, n1) of one weight against every row of x (M rows), by row blocks of 8, 4, 2, 1.
inline void rows_block(const float* x, int64_t M, const float* w, int64_t K, int64_t n0, int64_t n1, float* y,
                       int64_t ys, const float* bias) {
#if KVLM_AVX2 && !defined(KVLM_NO_4X3)
  if (M >= 4) {  // AVX2: groups of weight rows against each 4 rows of x, then the rest
    const int64_t M4 = M / 4 * 4;
    if (M4 / 4 >= KVLM_FEW_SPREAD_PASSES) groups_4xn<true>(x, M4, w, K, n0, n1, y, ys, bias);
    else groups_4xn<false>(x, M4, w, K, n0, n1, y, ys, bias);
    if (M4 < M) rows_block(x + M4 * K, M - M4, w, K, n0, n1, y + M4 * ys, ys, bias);
    return;
  }
#endif
  row_blocks<KVLM_FEW_MAX_RB>(M, [&](auto tag, int64_t r) {
    constexpr int RB = decltype(tag)::value, NB = kBlockOut / RB;
    for (int64_t n = n0; n < n1; n += NB)
      block<RB>(x + r * K, w + n * K, K, static_cast<int>(std::min<int64_t>(NB, n1 - n)), y + r * ys + n, ys,
                bias ? bias + n : nullptr);
  });
}

// x (..., K) against weights W_i (N_i, K) with biases b_i (N_i,) or none: (..., sum N_i), [x W_1^T + b_1, ...]
// (the leading axes kept here, not by two more Python calls on every product).
inline at::Tensor linear(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                         const std::vector<c10::optional<at::Tensor>>& biases) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "few_rows_linear: x must be a contiguous float32 CPU tensor");
  TORCH_CHECK(!weights.empty() && biases.size() == weights.size(), "few_rows_linear: one bias (or None) per weight");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K > 0, "few_rows_linear: x has no columns");
  const int64_t M = x.numel() / K;
  std::vector<int64_t> offset{0};  // output column of each weight's first row
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                    w.device().is_cpu(),
                "few_rows_linear: weight ", i, " must be a contiguous float32 CPU matrix of ", K, " columns");
    const auto& b = biases[i];
    TORCH_CHECK(!b.has_value() || !b->defined() ||
                    (b->dim() == 1 && b->size(0) == w.size(0) && b->scalar_type() == at::kFloat && b->is_contiguous()),
                "few_rows_linear: bias ", i, " must be a contiguous float32 vector of ", w.size(0));
    offset.push_back(offset.back() + w.size(0));
  }
  const int64_t N = offset.back();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  auto y = at::empty(shape, x.options());
  // the units of kUnitRows weight rows of every weight, in order: (weight, first row)
  std::vector<std::pair<int, int64_t>> blocks;
  for (size_t i = 0; i < weights.size(); ++i)
    for (int64_t n = 0; n < weights[i].size(0); n += kUnitRows) blocks.emplace_back(static_cast<int>(i), n);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M == 0) return y;
  steal_for(static_cast<int64_t>(blocks.size()), [&](int64_t b) {
    const int i = blocks[b].first;
    const int64_t n = blocks[b].second, rows = weights[i].size(0);
    const auto& bias = biases[i];
    const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
    rows_block(xp, M, weights[i].data_ptr<float>(), K, n, std::min(rows, n + kUnitRows), yp + offset[i], N, bp);
  });
  return y;
}

#if KVLM_AVX2
// y[r][0, 8 NV) = sum_k x[r][k] W[k][0, 8 NV) for RB rows of x (stride xs) and NV vectors of W's columns (rows of W
// N apart), y's rows ys apart: outer products, each W vector loaded once for the RB rows (2 rows x 4 vectors:
// 8 accumulators, 4 weights and a broadcast in AVX2's 16 registers)
template <int RB, int NV>
inline void head_columns(const float* x, int64_t xs, const float* w, int64_t K, int64_t N, float* y, int64_t ys) {
  __m256 a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[NV];
    for (int i = 0; i < NV; ++i) {
      wv[i] = _mm256_loadu_ps(w + k * N + 8 * i);
      asm("" : "+x"(wv[i]));  // held in a register for the RB rows (not folded into each FMA as a load)
    }
    for (int r = 0; r < RB; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * xs + k);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm256_fmadd_ps(xb, wv[i], a[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(y + r * ys + 8 * i, a[r][i]);
}
#endif

// Per-head products y_h = x_h W_h at a few rows (MLA's absorption: q^C W~^UK and z W~^UV, one small matrix a
// head): x (H, M, K) strided (unit stride along K, so (B, h, 1, a) is read in place), W (H, K, N) contiguous as the
// model keeps it (N a multiple of 16); y (M, H, N). Outer-product form, so each W_h is read once for all M rows
// and no transposed copy is kept: on AVX-512 the attention kernel's value micro-kernel (avx512::values_chunk: rows
// of x broadcast against rows of W, 4 x 4 output vectors in registers), work items (head, 64 output columns); on
// AVX2 head_columns, work items (head, 32 output columns).
inline at::Tensor head_products(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && x.size(0) == w.size(0) && x.size(2) == w.size(1),
              "head_products: x (H, M, K) and w (H, K, N)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.stride(2) == 1 &&
                  w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "head_products: float32 CPU tensors, x with unit stride along K, w contiguous");
  const int64_t H = x.size(0), M = x.size(1), K = x.size(2), N = w.size(2);
  TORCH_CHECK(N % 16 == 0 && x.stride(1) < (int64_t(1) << 30) && K < (int64_t(1) << 30),
              "head_products: N a multiple of 16");
  const int64_t sh = x.stride(0);
  const int xs = static_cast<int>(x.stride(1));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
#if KVLM_AVX512
  auto y = at::zeros({M, H, N}, x.options());  // the micro-kernel adds into its output
  if (M == 0 || N == 0 || H == 0) return y;
  float* yp = y.data_ptr<float>();
  const int64_t nv = N / 16, chunks = (nv + 3) / 4;
  steal_for(H * chunks, [&](int64_t i) {
    thread_local std::vector<const char*> rows;
    rows.resize(std::max<int64_t>(K, 1));
    const char* const* pl = nullptr;  // no prefetch list
    const int64_t h = i / chunks, z0 = (i % chunks) * 4;
    for (int64_t k = 0; k < K; ++k) rows[k] = reinterpret_cast<const char*>(wp + (h * K + k) * N);
    row_blocks<4>(M, [&](auto tag, int64_t r) {
      constexpr int RB = decltype(tag)::value;
      avx512::values_chunk<DType::f32, RB>(xp + h * sh + r * xs, xs, rows.data(), static_cast<int>(K), nv,
                                           static_cast<__mmask16>(0xFFFF), z0, yp + (r * H + h) * N, H * N,
                                           nullptr, pl, 0);
    });
  });
#else
  auto y = at::empty({M, H, N}, x.options());
  if (M == 0 || N == 0 || H == 0) return y;
  float* yp = y.data_ptr<float>();
  const int64_t chunks = (N + 31) / 32;  // the last one 16 columns where N is an odd multiple of 16
  steal_for(H * chunks, [&](int64_t i) {
    const int64_t h = i / chunks, c0 = (i % chunks) * 32;
    const bool whole = N - c0 >= 32;
    row_blocks<2>(M, [&](auto tag, int64_t r) {
      constexpr int RB = decltype(tag)::value;
      const float* xr = xp + h * sh + r * xs;
      const float* wh = wp + h * K * N + c0;
      float* yr = yp + (r * H + h) * N + c0;
      if (whole)
        head_columns<RB, 4>(xr, xs, wh, K, N, yr, H * N);
      else
        head_columns<RB, 2>(xr, xs, wh, K, N, yr, H * N);
    });
  });
#endif
  return y;
}

}  // namespace few_rows
}  // namespace kvlm_decode
#endif
