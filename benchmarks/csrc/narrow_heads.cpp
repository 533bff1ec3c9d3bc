// The portable decode path (decode_core.h's attend_range) on 64-wide heads, one thread, torch-free: MHA (1 row a
// group) and GQA (4 rows a group) in cache and from memory, next to a plain read of the same bytes. An experiment
// of issue 15 (benchmarks/decode-limit.md, "AVX2: the portable path's work per tile", 2026-11-29): how much of a
// few-row kernel's time is its own work (in cache) and how much is memory's.
//
//   g++ -O3 -march=native -fno-math-errno -falign-loops=64 -I kvlm/kernels/csrc \
//       benchmarks/csrc/narrow_heads.cpp -o /tmp/narrow_heads
//   /tmp/narrow_heads 1 1 256 0      # 1 group, 1 row, 256 keys (K + V 128 KiB, in L2), called again and again
//   /tmp/narrow_heads 12 1 8192 4    # 12 groups, 1 row (MHA b1 / 8192), 4 copies of 50 MB: from memory
//   /tmp/narrow_heads 3 4 8192 16    # GQA-3
//
// Prints ns per key (all rows of a group) and GB/s of K and V read; from memory also a plain read (one vector add
// chain per stream, in the kernel's order: a tile of K rows, then its V rows).
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "decode_core.h"
using namespace kvlm_decode;
using Clock = std::chrono::steady_clock;

static float* buffer(size_t bytes) {  // in 2 MiB pages, as the package's caches are
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, bytes, MADV_HUGEPAGE);
  float* f = static_cast<float*>(p);
  for (size_t i = 0; i < bytes / 4; ++i) f[i] = (rand() % 1000) * 1e-4f;
  return f;
}

int main(int argc, char** argv) {
  if (argc < 5) return fprintf(stderr, "usage: narrow_heads GROUPS ROWS KEYS COPIES (0: in cache)\n"), 1;
  const int64_t G = atoi(argv[1]), R = atoi(argv[2]), S = atoll(argv[3]), copies = atoi(argv[4]), D = 64;
  const bool hot = copies == 0;
  const int64_t n_copies = hot ? 1 : copies, calls = hot ? std::max<int64_t>(1, 20000000 / (G * S)) : 1;
  const size_t per = G * S * D;  // floats of one copy of K (and of V)
  float* k = buffer(per * n_copies * 4);
  float* v = buffer(per * n_copies * 4);
  float* q = static_cast<float*>(std::aligned_alloc(64, G * R * D * 4 + 64));
  float* acc = static_cast<float*>(std::aligned_alloc(64, 4 * D * 4));
  for (int64_t i = 0; i < G * R * D; ++i) q[i] = (rand() % 1000) * 1e-3f;
  float m[4], l[4];
  int32_t table = 0, start = 0, end = static_cast<int32_t>(S);
  int64_t lo[4] = {0, 0, 0, 0}, hi[4] = {S - 1, S - 1, S - 1, S - 1};
  double best = 1e30, best_read = 1e30;
  float sink = 0;
  for (int rep = 0; rep < 7; ++rep) {
    auto t0 = Clock::now();
    for (int64_t c = 0; c < n_copies; ++c) {
      Job J{};
      J.B = 1, J.G = G, J.R = R, J.T = 1, J.Dk = J.Dv = D, J.Dr = 0, J.P = S, J.max_blocks = 1;
      J.Dkp = J.Dvp = D, J.Drp = 0, J.Rp = 4, J.table = &table, J.start = &start, J.end = &end;
      J.k.data = k + c * per, J.k.dtype = DType::f32, J.k.s_page = G * S * D, J.k.s_group = S * D, J.k.s_row = D;
      J.k.D = D;
      J.v = J.k, J.v.data = v + c * per, J.kr = J.k, J.kr.D = 0, J.v_is_k = false, J.scale = 0.125;
      for (int64_t i = 0; i < calls; ++i)
        for (int64_t g = 0; g < G; ++g) {
          std::fill(m, m + 4, -INFINITY), std::fill(l, l + 4, 0.f), std::fill(acc, acc + 4 * D, 0.f);
          attend_range<float>(J, q + g * R * D, q, 0, g, 0, S, lo, hi, m, l, acc);
          sink += acc[0];
        }
    }
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    if (hot) continue;
    t0 = Clock::now();
    for (int64_t c = 0; c < n_copies; ++c)
      for (int64_t g = 0; g < G; ++g) {
        const float* kp = k + c * per + g * S * D;
        const float* vp = v + c * per + g * S * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int64_t t = 0; t < S * D; t += 32 * D) {
          for (int64_t i = t; i < t + 32 * D; i += 8) a0 = _mm256_add_ps(a0, _mm256_load_ps(kp + i));
          for (int64_t i = t; i < t + 32 * D; i += 8) a1 = _mm256_add_ps(a1, _mm256_load_ps(vp + i));
        }
        sink += a0[0] + a1[1];
      }
    best_read = std::min(best_read, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double keys = double(G) * S * n_copies * calls, bytes = keys * 2 * D * 4;
  printf("groups %ld, rows %ld, keys %ld, %s: %.2f ns per key, %.1f GB/s", (long)G, (long)R, (long)S,
         hot ? "in cache" : "from memory", best / keys * 1e9, bytes / best / 1e9);
  if (!hot) printf(" | plain read %.1f GB/s", bytes / best_read / 1e9);
  printf("   (%g)\n", sink);
}
