// Decode's weight products at a few rows on a decode-time copy of the weight in panels (kvlm.kernels.few_rows.
// pack_panels; Linear.pack_for_decode(PANELS)), y = x W^T (+ b), AVX-512 only.
//
// Panel p holds weight rows [32 p, 32 p + 32) column by column: P[p][k][j] = W[32 p + j][k] (zeros past N). The
// product is an outer product: each step reads the 32 weights of one k (two consecutive lines) and adds x[r][k]
// times them to 2 accumulators of each of the RB rows, so the copy is read as one sequential stream a thread, the
// 32 sums of a row come out whole (no shuffle tree, no partial sums carried), and x is read as one sequential
// stream too (transposed, (K, M), 8 rows of a k in 32 bytes). The plain-weight kernel (few_rows.h) reads two
// weight rows side by side over whole rows of x, which streams 1.2-1.3x below the plain read at 8 FMAs a line
// (benchmarks/stream_shapes.py); on the reference shape's 268 MB this copy read 1.06-1.29x faster at 2-8 rows,
// level at 1, and 1.14-1.17x faster than oneDNN's layout at 12-16 (benchmarks/decode-limit.md).
#pragma once

#if KVLM_AVX512
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "steal.h"

namespace kvlm_decode {
namespace few_rows {

constexpr int64_t kPanel = 32;  // weight rows a panel: two 64-byte lines a step

// y[r * ys + j] (+ bias[j]) for the RB rows of xt (x transposed: x[r][k] at xt[k * xs + r]) and the first nb
// (<= 32) weight rows of the panel at p (K x 32).
template <int RB>
inline void panel_rows(const float* xt, int64_t xs, const float* p, int64_t K, int nb, float* y, int64_t ys,
                       const float* bias) {
  __m512 a[RB][2];
  for (int r = 0; r < RB; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* pk = p + kPanel * k;
    // ordinary loads, not load_w's non-temporal ones: those cap a loop that uses each weight vector for several
    // rows (few_rows.h, load_w)
    const __m512 w0 = avx512::in_register(_mm512_loadu_ps(pk));
    const __m512 w1 = avx512::in_register(_mm512_loadu_ps(pk + 16));
    _mm_prefetch(reinterpret_cast<const char*>(pk) + kFarBytes, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(pk + 16) + kFarBytes, _MM_HINT_T1);
    for (int r = 0; r < RB; ++r) {
      const __m512 xb = _mm512_set1_ps(xt[k * xs + r]);
      a[r][0] = _mm512_fmadd_ps(xb, w0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(xb, w1, a[r][1]);
    }
  }
  const __mmask16 m0 = static_cast<__mmask16>(nb >= 16 ? 0xFFFF : (1u << nb) - 1);
  const __mmask16 m1 = static_cast<__mmask16>(nb >= 32 ? 0xFFFF : nb > 16 ? (1u << (nb - 16)) - 1 : 0);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < RB; ++r) {
    _mm512_mask_storeu_ps(y + r * ys, m0, _mm512_add_ps(a[r][0], b0));
    _mm512_mask_storeu_ps(y + r * ys + 16, m1, _mm512_add_ps(a[r][1], b1));
  }
}

// x (..., K) against the panels p (ceil(N / 32), 32 K) of a weight of N rows, with bias (N,) or none: (..., N).
inline at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& p, int64_t N,
                               const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "panel_linear: x must be a float32 CPU tensor");
  const int64_t K = x.size(-1), panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K > 0 && N > 0, "panel_linear: x has no columns or the weight no rows");
  TORCH_CHECK(p.dim() == 2 && p.size(0) == panels && p.size(1) == kPanel * K && p.scalar_type() == at::kFloat &&
                  p.is_contiguous() && p.device().is_cpu(),
              "panel_linear: the panels must be a contiguous float32 CPU matrix (", panels, ", ", kPanel * K,
              ") for ", N, " rows of ", K, " columns");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                            bias->is_contiguous() && bias->device().is_cpu()),
              "panel_linear: bias must be a contiguous float32 CPU vector of ", N);
  const int64_t M = x.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  auto y = at::empty(shape, x.options());
  if (M == 0) return y;
  const auto xt = x.reshape({M, K}).t().contiguous();  // (K, M): the rows of one k side by side
  const float* xp = xt.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // panels split over the threads: each thread streams a contiguous run of the copy (then helps the slower one)
  steal_for(panels, [&](int64_t i) {
    const int64_t n0 = i * kPanel;
    const int nb = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
    row_blocks<8>(M, [&](auto tag, int64_t r) {  // past 8 rows the panel again, from L2
      constexpr int RB = decltype(tag)::value;
      panel_rows<RB>(xp + r, M, pp + i * kPanel * K, K, nb, yp + r * N + n0, N, bp ? bp + n0 : nullptr);
    });
  });
  return y;
}

}  // namespace few_rows
}  // namespace kvlm_decode
#endif
