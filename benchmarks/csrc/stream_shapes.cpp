// Access patterns of the 8-row weight product, stripped of everything else, for benchmarks/stream_shapes.py only
// (not part of the package): an experiment of issue 15 (why the few-row kernel streams weights at 8 rows well
// below the machine's read bandwidth). Each pattern streams a buffer once, split over the threads, with the
// 8-row product's arithmetic: 8 FMAs per 64-byte line of "weights" against 8 rows of a 24 KiB "x" held in L1,
// 16 accumulators, and a software prefetch of every line 32 KiB ahead into L2 (few_rows.h's far prefetch).
//   0 plain read: one load per line, no FMA, no software prefetch (the probe's shape)
//   1 one stream: two consecutive lines a step, read as two weight rows at one k (one x load serves both):
//     the order an interleaved-pairs layout would give (4 x loads a line)
//   2 two rows side by side: the package's block<8> order on the plain (N, K) weight, rows of 768 floats, two at
//     a time, one line of each a step (4 x loads a line)
//   3 one row at a time: two consecutive lines of one row a step, each line its own 8 x loads (8 x loads a line)
// and each with x's loads over whole rows (24 KiB) or cycling through the first x_cycle floats of each row.
#include <ATen/ATen.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>
#include <immintrin.h>

namespace {
constexpr int64_t kRow = 768, kFar = 32768;

inline __m512 reg(__m512 v) {  // keep a loaded vector in a register (no load folded into each FMA)
  asm("" : "+v"(v));
  return v;
}

template <int P>
float stream(const float* w, int64_t n, const float* x, int64_t x_cycle) {
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t per = n / T / (2 * kRow) * (2 * kRow), b = t * per, e = b + per;
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t blk = b; blk < e; blk += 2 * kRow) {  // a block: two rows of kRow floats
      for (int64_t kk = 0; kk < kRow; kk += 16) {
        const float* w0 = P == 2 ? w + blk + kk : w + blk + 2 * kk;
        const float* w1 = P == 2 ? w0 + kRow : w0 + 16;
        const __m512 v0 = reg(_mm512_loadu_ps(w0)), v1 = reg(_mm512_loadu_ps(w1));
        if (P == 0) {
          a[0] = _mm512_add_ps(a[0], v0);
          a[1] = _mm512_add_ps(a[1], v1);
          continue;
        }
        _mm_prefetch(reinterpret_cast<const char*>(w0) + kFar, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w1) + kFar, _MM_HINT_T1);
        // one stream and two rows: both rows at k; one row: two k a step. x_cycle < kRow: the loads of x cycle
        // through the first x_cycle floats of each row (as a product tiled along K would keep them)
        const int64_t k = (P == 3 ? (2 * kk) % kRow : kk) % x_cycle;
        for (int r = 0; r < 8; ++r) {
          const __m512 x0 = reg(_mm512_loadu_ps(x + r * kRow + k));
          const __m512 x1 = P == 3 ? reg(_mm512_loadu_ps(x + r * kRow + k + 16)) : x0;
          a[2 * r] = _mm512_fmadd_ps(x0, v0, a[2 * r]);
          a[2 * r + 1] = _mm512_fmadd_ps(x1, v1, a[2 * r + 1]);
        }
      }
    }
    __m512 s = a[0];
    for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, a[i]);
    total += _mm512_reduce_add_ps(s);
  }
  return total;
}

float run(const at::Tensor& w, const at::Tensor& x, int64_t pattern, int64_t x_cycle) {
  TORCH_CHECK(x_cycle >= 32 && x_cycle <= kRow && x_cycle % 32 == 0, "x_cycle: a multiple of 32 up to 768");
  TORCH_CHECK(w.is_contiguous() && x.is_contiguous() && x.numel() >= 8 * kRow, "contiguous w, x of 8 x 768");
  const float* wp = w.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  switch (pattern) {
    case 0: return stream<0>(wp, w.numel(), xp, x_cycle);
    case 1: return stream<1>(wp, w.numel(), xp, x_cycle);
    case 2: return stream<2>(wp, w.numel(), xp, x_cycle);
    default: return stream<3>(wp, w.numel(), xp, x_cycle);
  }
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run, "stream w once in one access pattern"); }
