// A few-row GEMM y = x W^T on the plain (N, K) weight, for benchmarks/few_rows_gemm.py only (not part of the
// package): an experiment of issue 15 ("weight GEMMs at batch 1-8 read weights near bandwidth"), kept so the
// numbers on benchmarks/decode-limit.md can be re-run.
//
// Dot-product form, no repacking: for RB rows of x (8, 4, 2 or 1) and NB = 16 / RB weight rows, 16 AVX-512
// accumulators run over K, then one tree of shuffles turns them into the 16 sums (decode_avx512.h's tree16,
// included from the package's sources).
// Weight rows are split over the threads in blocks of 16; each weight block is read from memory once and from
// L1 by the further row blocks. `pfd` > 0: software prefetch of every weight row pfd bytes ahead into L1
// (< 0: -pfd bytes ahead into L2, and `near` > 0 bytes ahead into L1 as well); `max_rb` caps the row block.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#include "decode_core.h"  // kvlm/kernels/csrc: avx512::tree16, the kernels' shuffle tree
#include <algorithm>

namespace {
// y[x][n0 + j] for RB rows x, NB = 16 / RB weight rows
template <int RB>
inline void block(const float* x, int64_t xs, const float* w, int64_t K, float* y, int64_t ys, int64_t n0, int nb, int64_t pfd, int64_t near) {
  constexpr int NB = 16 / RB;
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  const float* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = w + (n0 + std::min(j, nb - 1)) * K;
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(wr[j] + k);
    if (pfd > 0) for (int j = 0; j < NB; ++j) _mm_prefetch((const char*)(wr[j] + k) + pfd, _MM_HINT_T0);
    if (pfd < 0) for (int j = 0; j < NB; ++j) _mm_prefetch((const char*)(wr[j] + k) - pfd, _MM_HINT_T1);
    if (pfd < 0 && near > 0) for (int j = 0; j < NB; ++j) _mm_prefetch((const char*)(wr[j] + k) + near, _MM_HINT_T0);
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * xs + k);
      for (int j = 0; j < NB; ++j) a[r * NB + j] = _mm512_fmadd_ps(xv, wv[j], a[r * NB + j]);
    }
  }
  if (K16 < K) {
    const __mmask16 m = (1u << (K - K16)) - 1;
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(m, wr[j] + K16);
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * xs + K16);
      for (int j = 0; j < NB; ++j) a[r * NB + j] = _mm512_fmadd_ps(xv, wv[j], a[r * NB + j]);
    }
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, kvlm_decode::avx512::tree16(a));
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < nb; ++j) y[r * ys + n0 + j] = s[r * NB + j];
}

at::Tensor few_rows(const at::Tensor& x, const at::Tensor& w, int64_t pfd, int64_t max_rb, int64_t near) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (M, K) and w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "contiguous x and w only");
  TORCH_CHECK(max_rb == 4 || max_rb == 8, "max_rb is 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // N split over threads in blocks of 16 weight rows
  const int64_t nblk = (N + 15) / 16;
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n_lo = b * 16, n_hi = std::min(N, n_lo + 16);
      int64_t r = 0;
      auto run = [&](auto tag) {
        constexpr int RB = decltype(tag)::value, NB = 16 / RB;
        for (int64_t n0 = n_lo; n0 < n_hi; n0 += NB)
          block<RB>(xp + r * K, K, wp, K, yp + r * N, N, n0, (int)std::min<int64_t>(NB, n_hi - n0), pfd, near);
        r += RB;
      };
      while (max_rb >= 8 && M - r >= 8) run(std::integral_constant<int, 8>());
      while (max_rb >= 4 && M - r >= 4) run(std::integral_constant<int, 4>());
      if (M - r >= 2) run(std::integral_constant<int, 2>());
      if (M - r >= 1) run(std::integral_constant<int, 1>());
    }
  });
  return y;
}
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("few_rows", &few_rows); }
