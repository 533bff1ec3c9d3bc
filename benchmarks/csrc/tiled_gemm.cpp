// A few-row GEMM y = x W^T (+ b) on a copy of W laid out in the order the product reads it, for
// benchmarks/tiled_gemm.py only (not part of the package): an experiment of issue 15 (the weights at 4-8 rows),
// kept so the numbers on benchmarks/decode-limit.md can be re-run, and the lead for whoever packs it for decode.
//
// The plain-weight kernel (few_rows.h) at 4-8 rows shares each load of x between weight rows read side by side,
// over whole rows of x (24 KiB at 8 rows of 768). Stripped to their access patterns (benchmarks/stream_shapes.py:
// 8 FMAs a line against 8 rows of x, every line prefetched 32 KiB ahead into L2) that streams 1.2-1.3x below the
// plain read, whatever the order of the weight rows; one sequential stream whose loads of x stay within 12 KiB
// reads at the plain read's rate. This layout (tiled_gemm.py's tile) gives that stream: each block of 16 weight rows is cut along K into
// chunks of kChunk floats (8 rows of x: 8 KiB), and within a chunk pair i holds rows 2i and 2i + 1 interleaved by
// 16 floats, so one step reads two consecutive lines, the two rows at one k, and one load of x serves both:
//   block b, chunk c (k0 = c kChunk, kc = its width), pair q, step s, row j, t -> W[16 b + 2 q + j][k0 + 16 s + t]
// at offset 16 b Kp + 16 k0 + 2 q kc + 32 s + 16 j + t (Kp: K rounded up to 16; zeros past N and K).
// The 16 accumulators of a register tile carry from one chunk to the next through a per-thread scratch in L1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>

#include "decode_core.h"  // kvlm/kernels/csrc: avx512::tree16 and in_register
#include "few_rows.h"     // kFarBytes, the package kernel's far prefetch distance

namespace {
using namespace kvlm_decode;
using kvlm_decode::few_rows::kFarBytes;

constexpr int64_t kChunk = 256;  // floats of K a chunk (x's working set: rows x 1 KiB)

// The 16 weight rows of one block at pb against the RB rows of x (stride K): y[r * ys + j] (+ bias[j]) for the
// block's first nb rows. A register tile is NP = 8 / RB pairs (RB x 2 NP accumulators), read one pair after the
// other; the block's RB tiles carry their accumulators between chunks in acc (RB x 16 vectors).
template <int RB>
inline void tiled_block(const float* x, int64_t K, const float* pb, int64_t Kp, int nb, float* y, int64_t ys,
                        const float* bias, __m512* acc) {
  constexpr int NP = 8 / RB, NB = 2 * NP;
  const int64_t K16 = K & ~int64_t(15);
  const __mmask16 m = static_cast<__mmask16>((1u << (K - K16)) - 1);  // the tail of K (the layout holds zeros)
  for (int64_t k0 = 0; k0 < Kp; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, Kp - k0), full = std::min(K16, k0 + kc) - k0;  // steps with all of x
    const bool first = k0 == 0, last = k0 + kc >= Kp;
    const float* pc = pb + 16 * k0;
    for (int t = 0; t < RB; ++t) {
      if (t * NB >= nb) break;  // tiles wholly past the weight's end
      __m512 a[16];
      for (int i = 0; i < 16; ++i) a[i] = first ? _mm512_setzero_ps() : acc[t * 16 + i];
      for (int qi = 0; qi < NP; ++qi) {
        const float* pq = pc + (t * NP + qi) * 2 * kc;
        for (int64_t s = 0; s < full; s += 16) {
          const __m512 v0 = avx512::in_register(_mm512_loadu_ps(pq + 2 * s));
          const __m512 v1 = avx512::in_register(_mm512_loadu_ps(pq + 2 * s + 16));
          _mm_prefetch(reinterpret_cast<const char*>(pq + 2 * s) + kFarBytes, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(pq + 2 * s + 16) + kFarBytes, _MM_HINT_T1);
          for (int r = 0; r < RB; ++r) {
            const __m512 xv = avx512::in_register(_mm512_loadu_ps(x + r * K + k0 + s));
            a[r * NB + 2 * qi] = _mm512_fmadd_ps(xv, v0, a[r * NB + 2 * qi]);
            a[r * NB + 2 * qi + 1] = _mm512_fmadd_ps(xv, v1, a[r * NB + 2 * qi + 1]);
          }
        }
        if (full < kc) {  // the last 16 floats of K, x masked
          const __m512 v0 = _mm512_loadu_ps(pq + 2 * full), v1 = _mm512_loadu_ps(pq + 2 * full + 16);
          for (int r = 0; r < RB; ++r) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * K + k0 + full);
            a[r * NB + 2 * qi] = _mm512_fmadd_ps(xv, v0, a[r * NB + 2 * qi]);
            a[r * NB + 2 * qi + 1] = _mm512_fmadd_ps(xv, v1, a[r * NB + 2 * qi + 1]);
          }
        }
      }
      if (!last) {
        for (int i = 0; i < 16; ++i) acc[t * 16 + i] = a[i];
        continue;
      }
      alignas(64) float sums[16];
      _mm512_store_ps(sums, avx512::tree16(a));
      const int n0 = t * NB, n1 = std::min(nb, n0 + NB);
      for (int r = 0; r < RB; ++r)
        for (int j = n0; j < n1; ++j) y[r * ys + j] = sums[r * NB + j - n0] + (bias ? bias[j] : 0.0f);
    }
  }
}

// x (..., K) against the tiled copy p (ceil(N / 16), 16 Kp) of a weight of N rows, with bias (N,) or none: (..., N).
inline at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& p, int64_t N,
                               const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "tiled_linear: x must be a contiguous float32 CPU tensor");
  const int64_t K = x.size(-1), Kp = (K + 15) / 16 * 16, blocks = (N + 15) / 16;
  TORCH_CHECK(K > 0 && N > 0, "tiled_linear: x has no columns or the weight no rows");
  TORCH_CHECK(p.dim() == 2 && p.size(0) == blocks && p.size(1) == 16 * Kp && p.scalar_type() == at::kFloat &&
                  p.is_contiguous() && p.device().is_cpu(),
              "tiled_linear: the tiled weight must be a contiguous float32 CPU matrix (", blocks, ", ", 16 * Kp,
              ") for ", N, " rows of ", K, " columns");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                            bias->is_contiguous()),
              "tiled_linear: bias must be a contiguous float32 vector of ", N);
  const int64_t M = x.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  auto y = at::empty(shape, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // blocks of 16 weight rows split over the threads: each thread streams a contiguous run of the copy
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) __m512 acc[8 * 16];
    // the steps prefetch kFarBytes ahead: the start of the thread's run is asked for here, not missed line by line
    const char* start = reinterpret_cast<const char*>(pp + b0 * 16 * Kp);
    const int64_t ramp = std::min<int64_t>(kFarBytes, (b1 - b0) * 16 * Kp * 4);
    for (int64_t off = 0; off < ramp; off += 64) _mm_prefetch(start + off, _MM_HINT_T1);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 16;
      const int nb = static_cast<int>(std::min<int64_t>(16, N - n0));
      const float* pb = pp + b * 16 * Kp;
      int64_t r = 0;
      auto run = [&](auto tag) {
        constexpr int RB = decltype(tag)::value;
        tiled_block<RB>(xp + r * K, K, pb, Kp, nb, yp + r * N + n0, N, bp ? bp + n0 : nullptr, acc);
        r += RB;
      };
      while (M - r >= 8) run(std::integral_constant<int, 8>());
      if (M - r >= 4) run(std::integral_constant<int, 4>());
      if (M - r >= 2) run(std::integral_constant<int, 2>());
      if (M - r >= 1) run(std::integral_constant<int, 1>());
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("tiled_linear", &tiled_linear, "x W^T + b on the tiled copy"); }
