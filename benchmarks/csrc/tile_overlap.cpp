// Does a tiled K / V stream overlap its memory reads with the work done on each tile? (issue 15: the few-row
// attention kernels, GQA and MHA, read ~20 GB/s on one thread of the Zen 4 EPYC where a plain read gets ~30.)
//
//   g++ -O3 -march=native -o /tmp/tile_overlap benchmarks/csrc/tile_overlap.cpp && /tmp/tile_overlap
//
// One thread, 256 MB in 2 MiB pages, laid out as the kernel's contiguous caches are: items of 4096 K rows then
// 4096 V rows of 64 floats. Each tile of 32 keys reads its K rows (4 vectors, 4 FMAs a row), then optional work
// that touches no memory, then its V rows (as the kernel's score pass, softmax, value pass). Arms: the software
// prefetch of the next tile's lines (the kernel's burst: every line, `_MM_HINT_T1`, 8 KiB ahead, beside each
// row's loads), none (the hardware's stream prefetcher alone) or sparse (one line per 1 KiB); the work: none, a
// dependent chain of FMAs (latency) or independent FMAs on 8 accumulators (throughput). Prints GB/s, the median
// of 11 interleaved rounds (min, max). The results are on benchmarks/decode-limit.md (2026-11-28, 12:49 on).
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

float* huge_buffer(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, bytes, MADV_HUGEPAGE);
  float* f = static_cast<float*>(p);
  for (size_t i = 0; i < bytes / 4; ++i) f[i] = (i % 7) * 0.1f;
  return f;
}

enum class Prefetch { none, every_line, sparse };

struct Arm {
  const char* name;
  Prefetch prefetch;
  int chain;  // dependent FMAs a tile (each waits ~4 cycles on the one before)
  int indep;  // rounds of 8 independent FMAs a tile
  long ahead = 8192;  // prefetch distance in bytes; one tile of K (or V) rows: the kernel's burst distance
};

constexpr size_t kRows = 4096, kRowFloats = 64, kRowBytes = kRowFloats * 4, kTile = 32;

void prefetch_row(const float* row, Prefetch p, long ahead, size_t y) {
  const char* c = reinterpret_cast<const char*>(row) + ahead;
  if (p == Prefetch::every_line)
    for (size_t off = 0; off < kRowBytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
  if (p == Prefetch::sparse && y % 4 == 0) _mm_prefetch(c, _MM_HINT_T1);
}

__attribute__((noinline)) float tiles(const float* base, size_t items, const Arm& a) {
  __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_set1_ps(1e-3f);
  for (size_t it = 0; it < items; ++it) {
    const float* K = base + it * 2 * kRows * kRowFloats;
    const float* V = K + kRows * kRowFloats;
    for (size_t t0 = 0; t0 < kRows; t0 += kTile) {
      for (size_t y = 0; y < kTile; ++y) {
        const float* k = K + (t0 + y) * kRowFloats;
        prefetch_row(k, a.prefetch, a.ahead, y);
        for (size_t d = 0; d < kRowFloats; d += 16) acc = _mm512_fmadd_ps(_mm512_load_ps(k + d), acc2, acc);
      }
      __m512 w = acc;
      for (int i = 0; i < a.chain; ++i) w = _mm512_fmadd_ps(w, w, acc2);
      __m512 u[8];
      for (int j = 0; j < 8; ++j) u[j] = _mm512_set1_ps(j);
      for (int i = 0; i < a.indep; ++i)
        for (int j = 0; j < 8; ++j) u[j] = _mm512_fmadd_ps(u[j], acc2, acc);
      for (int j = 0; j < 8; ++j) w = _mm512_add_ps(w, u[j]);
      acc2 = _mm512_add_ps(acc2, _mm512_mul_ps(w, _mm512_set1_ps(1e-30f)));
      for (size_t y = 0; y < kTile; ++y) {
        const float* v = V + (t0 + y) * kRowFloats;
        prefetch_row(v, a.prefetch, a.ahead, y);
        for (size_t d = 0; d < kRowFloats; d += 16) acc2 = _mm512_add_ps(_mm512_load_ps(v + d), acc2);
      }
    }
  }
  return _mm512_reduce_add_ps(acc) + _mm512_reduce_add_ps(acc2);
}

__attribute__((noinline)) float plain_sum(const float* base, size_t n) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (size_t i = 0; i < n; i += 64)
    for (int j = 0; j < 4; ++j) a[j] = _mm512_add_ps(a[j], _mm512_load_ps(base + i + 16 * j));
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}

}  // namespace

int main() {
  const size_t bytes = size_t(256) << 20, items = bytes / (2 * kRows * kRowBytes);
  const float* buf = huge_buffer(bytes);
  const std::vector<Arm> arms = {
      {"every line (the kernel's), no work", Prefetch::every_line, 0, 0},
      {"every line, chain of 100 FMAs", Prefetch::every_line, 100, 0},
      {"every line 16 KiB ahead, chain of 100", Prefetch::every_line, 100, 0, 16384},
      {"every line 32 KiB ahead, chain of 100", Prefetch::every_line, 100, 0, 32768},
      {"none, chain of 100 FMAs", Prefetch::none, 100, 0},
      {"every line, 800 independent FMAs", Prefetch::every_line, 0, 100},
      {"none, 800 independent FMAs", Prefetch::none, 0, 100},
      {"1 line per KiB, 800 independent FMAs", Prefetch::sparse, 0, 100},
      {"every line, 1600 independent FMAs", Prefetch::every_line, 0, 200},
      {"none, 1600 independent FMAs", Prefetch::none, 0, 200},
      {"1 line per KiB, 1600 independent FMAs", Prefetch::sparse, 0, 200},
  };
  std::vector<std::vector<double>> gbs(arms.size() + 1);
  float sink = 0;
  for (int round = 0; round < 11; ++round) {
    double t = now();
    sink += plain_sum(buf, bytes / 4);
    gbs[0].push_back(bytes / (now() - t) / 1e9);
    for (size_t a = 0; a < arms.size(); ++a) {
      t = now();
      sink += tiles(buf, items, arms[a]);
      gbs[a + 1].push_back(bytes / (now() - t) / 1e9);
    }
  }
  for (size_t a = 0; a <= arms.size(); ++a) {
    std::sort(gbs[a].begin(), gbs[a].end());
    std::printf("%-40s %5.1f GB/s (%.1f-%.1f)\n", a ? arms[a - 1].name : "plain read", gbs[a][5], gbs[a][0],
                gbs[a].back());
  }
  return sink == 12345.0f;  // keeps the sums live
}
