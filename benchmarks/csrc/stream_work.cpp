// Memory and work finely interleaved: does a core stream while it computes? (issue 15, benchmarks/decode-limit.md,
// "AVX2: spread prefetch ...", 2026-11-29). 256 MB in 2 MiB pages read once a round, 4 vectors of 8 floats a
// step, each feeding an FMA, and F - 1 more FMAs a loaded vector on 8 independent accumulators (no memory): F = 8
// is the weight products' work at 8 rows (8 FMAs a weight vector). Arms: no software prefetch (the hardware's
// stream alone), or one line in every 64 bytes read PF bytes ahead with hint H (3 = T0 into L1, 2 = T1, 1 = T2).
// Prints GB/s from memory (best of 5) and in cache (the first 256 KiB again and again), and what memory and work
// would give if they took turns (1 / (1/cache + 1/plain)) or overlapped (min(cache, plain)).
//
//   g++ -O3 -march=native -pthread -o /tmp/stream_work benchmarks/csrc/stream_work.cpp
//   /tmp/stream_work          # one thread
//   NT=2 /tmp/stream_work     # two threads, each on its half
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <int F, int PF, int H>
__attribute__((noinline)) float run(const float* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m256 wk[8];
  for (int i = 0; i < 8; ++i) wk[i] = _mm256_set1_ps(0.1f * i);
  const __m256 w0 = _mm256_set1_ps(1.0001f), w1 = _mm256_set1_ps(0.9999f);
  for (size_t i = 0; i < n; i += 32) {
    if (PF) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i) + PF, static_cast<_mm_hint>(H));
      _mm_prefetch(reinterpret_cast<const char*>(p + i + 16) + PF, static_cast<_mm_hint>(H));
    }
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(p + i), w0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(p + i + 8), w0, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(p + i + 16), w0, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(p + i + 24), w0, a3);
#pragma GCC unroll 256
    for (int f = 0; f < 4 * (F - 1); ++f) wk[f & 7] = _mm256_fmadd_ps(wk[f & 7], w0, w1);
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  for (int i = 0; i < 8; ++i) s = _mm256_add_ps(s, wk[i]);
  float o[8];
  _mm256_storeu_ps(o, s);
  return o[0];
}

float* P;
size_t N;
int NT = 1;
float sink;

template <int F, int PF, int H>
double stream() {  // seconds for the whole buffer, NT threads on their halves
  const double t = now();
  if (NT == 1) {
    sink += run<F, PF, H>(P, N);
  } else {
    std::thread other([] { sink += run<F, PF, H>(P + N / 2, N / 2); });
    sink += run<F, PF, H>(P, N / 2);
    other.join();
  }
  return now() - t;
}

template <int F, int PF, int H = 3>
void arm(double plain) {
  double mem = 1e9, cache = 1e9;
  for (int r = 0; r < 5; ++r) {
    mem = std::min(mem, stream<F, PF, H>());
    const double t = now();
    for (int k = 0; k < 512; ++k) sink += run<F, PF, H>(P, 64 << 10);
    cache = std::min(cache, now() - t);
  }
  const double gm = N * 4.0 / mem / 1e9, gc = NT * 512.0 * (256 << 10) / cache / 1e9;
  printf("F %2d  PF %5d  H %d   memory %5.1f GB/s   cache %5.1f   taking turns %5.1f   overlapped %5.1f\n", F, PF, H,
         gm, gc, 1 / (1 / gc + 1 / plain), std::min(gc, plain));
}

}  // namespace

int main() {
  const size_t bytes = 256ull << 20, pad = 4 << 20;
  void* m = mmap(nullptr, bytes + pad, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(m, bytes + pad, MADV_HUGEPAGE);
  P = static_cast<float*>(m);
  for (size_t i = 0; i < (bytes + pad) / 4; ++i) P[i] = (i % 7) * 0.1f;
  N = bytes / 4;
  NT = getenv("NT") ? atoi(getenv("NT")) : 1;
  double best = 1e9;
  for (int r = 0; r < 5; ++r) best = std::min(best, stream<1, 0, 3>());
  const double plain = N * 4.0 / best / 1e9;
  printf("%d thread(s), plain read (one FMA a vector) %.1f GB/s\n", NT, plain);
  arm<4, 0>(plain), arm<8, 0>(plain), arm<12, 0>(plain), arm<16, 0>(plain);
  arm<8, 1024>(plain), arm<8, 2048>(plain), arm<8, 4096>(plain), arm<8, 8192>(plain);
  arm<8, 2048, 2>(plain), arm<8, 8192, 2>(plain);
  arm<12, 1024>(plain), arm<16, 1024>(plain);
  return sink > 1e30;
}
