// The CPU decode kernel's MLA case in parts, torch-free, against this core's FMA peak measured in the same run:
// an FMA-only loop (16 independent register chains), the two AVX-512 micro-kernels alone on L1-resident data
// (score16: 4 rows x 4 keys over 256 + 32 features; value_block: 4 rows x 64 columns over 16 keys), and the whole
// attend_range (12 rows, one sequence of S keys, float32) with its spread prefetch as built and without.
// Then this core's sequential read rate past the L3 (the most one thread pulls from DRAM) beside the kernel's rate
// over a pool of the same size. Rounds alternate, so a shared machine slows all alike; compare within a round.
//
//   g++ -O3 -march=native -mprefer-vector-width=512 -fno-math-errno -fopenmp -I kvlm/kernels/csrc \
//       benchmarks/csrc/kernel_parts.cpp -o /tmp/kernel_parts && /tmp/kernel_parts
//   (add -DKVLM_NO_PREFETCH for a build without the software prefetch)
#include "decode_core.h"

#include <chrono>
#include <cstdio>

using namespace kvlm_decode;
using Clock = std::chrono::steady_clock;

static double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

static double peak_gflops() {  // 16 independent FMA chains: the issue rate, no loads
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_ps(i * 0.001f);
  const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(0.0001f);
  const long n = 4000000;
  const auto t0 = Clock::now();
  for (long k = 0; k < n; ++k)
    for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
  const double dt = seconds_since(t0);
  __m512 s = a[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, a[i]);
  volatile float sink = _mm512_reduce_add_ps(s);
  (void)sink;
  return n * 16.0 * 32 / dt / 1e9;
}

static double read_gbps(const std::vector<float>& a) {  // one pass of 4 independent sums
  const auto t0 = Clock::now();
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i + 64 <= a.size(); i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_loadu_ps(&a[i]));
    s1 = _mm512_add_ps(s1, _mm512_loadu_ps(&a[i + 16]));
    s2 = _mm512_add_ps(s2, _mm512_loadu_ps(&a[i + 32]));
    s3 = _mm512_add_ps(s3, _mm512_loadu_ps(&a[i + 48]));
  }
  const double dt = seconds_since(t0);
  volatile float sink = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
  (void)sink;
  return a.size() * 4.0 / dt / 1e9;
}

int main(int argc, char** argv) {
  _mm_setcsr(_mm_getcsr() | 0x8040);  // flush denormals: timing only
  const int64_t S = argc > 1 ? atoll(argv[1]) : 256, R = 12, Dk = 256, Dr = 32;
  alignas(64) static float rows[16][288], p[4][16], acc4[4][256], q4[4][288];
  for (int j = 0; j < 16; ++j)
    for (int d = 0; d < 288; ++d) rows[j][d] = 0.001f * (d % 7);
  for (int x = 0; x < 4; ++x)
    for (int d = 0; d < 288; ++d) q4[x][d] = 0.001f;
  for (int x = 0; x < 4; ++x)
    for (int j = 0; j < 16; ++j) p[x][j] = 0.01f;
  const char* rp[16];
  for (int j = 0; j < 16; ++j) rp[j] = reinterpret_cast<const char*>(rows[j]);
  const __mmask16 mk[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
  const char* none[1] = {nullptr};
  // one sequence of S keys, latent 256 + RoPE 32, as the absorbed MLA decode of one layer at batch 1
  std::vector<float> pool(S * Dk), rope(S * Dr);
  for (int64_t i = 0; i < S * Dk; ++i) pool[i] = 0.01f * ((i * 7919) % 100 - 50);
  for (int64_t i = 0; i < S * Dr; ++i) rope[i] = 0.01f * ((i * 104729) % 100 - 50);
  Job J{};
  J.B = J.G = 1;
  J.R = J.Rp = R;
  J.T = 1;
  J.Dk = J.Dv = J.Dkp = J.Dvp = Dk;
  J.Dr = J.Drp = Dr;
  J.P = S;
  J.max_blocks = 1;
  int32_t table[1] = {0}, start[1] = {0}, end[1] = {static_cast<int32_t>(S)};
  J.table = table;
  J.start = start;
  J.end = end;
  J.k = Pool{pool.data(), DType::f32, S * Dk, 0, Dk, nullptr, 0, 0, 0, Dk};
  J.v = J.k;
  J.v_is_k = true;
  J.kr = Pool{rope.data(), DType::f32, S * Dr, 0, Dr, nullptr, 0, 0, 0, Dr};
  J.scale = 0.06;
  alignas(64) static float q[12 * 256], qr[12 * 32], acc[12 * 256];
  for (auto& x : q) x = 0.01f;
  for (auto& x : qr) x = 0.01f;
  std::vector<int64_t> lo(R, 0), hi(R, S - 1);
  float m[12], l[12];
  std::vector<float> big(65536L * 288 * 4, 1.0f);  // 300 MB: the read-rate probe
  printf("per round, GFLOP/s: FMA peak | score16 | value_block | attend_range (S = %ld keys, its GB/s) | "
         "sequential read GB/s\n", (long)S);
  for (int round = 0; round < 5; ++round) {
    const double peak = peak_gflops();
    const long n = 1000000;
    const char* const* pl = none;
    __m512 s = _mm512_setzero_ps();
    auto t0 = Clock::now();
    for (long i = 0; i < n; ++i)
      s = _mm512_add_ps(s, avx512::score16<DType::f32, 4, 4>(&q4[0][0], nullptr, rp + (i & 3) * 4,
                                                              nullptr, nullptr, 288, 0, nullptr, nullptr, pl, 0));
    const double score = n * 16.0 * 288 * 2 / seconds_since(t0) / 1e9;
    t0 = Clock::now();
    for (long i = 0; i < n; ++i)
      avx512::value_block<DType::f32, 4, 4, true>(&p[0][0], 16, rp, 16, (i & 3) * 64, mk, &acc4[0][0], 256,
                                                   nullptr, pl, 0);
    const double value = n * 4.0 * 16 * 64 * 2 / seconds_since(t0) / 1e9;
    const int reps = static_cast<int>(std::max<int64_t>(20, 400000 / S));
    t0 = Clock::now();
    for (int i = 0; i < reps; ++i) {
      for (int r = 0; r < R; ++r) m[r] = -INFINITY, l[r] = 0;
      std::fill(acc, acc + 12 * 256, 0.0f);
      avx512::attend_range<DType::f32, 16, false>(J, q, qr, 0, 0, 0, S, lo.data(), hi.data(), m, l, acc);
    }
    const double dt = seconds_since(t0);
    const double whole = reps * 2.0 * R * S * (Dk + Dr + Dk) / dt / 1e9;
    const double whole_gbps = reps * S * (Dk + Dr) * 4.0 / dt / 1e9;
    printf("%6.1f | %6.1f | %6.1f | %6.1f (%4.1f GB/s) | %4.1f   (%g %g)\n", peak, score, value, whole, whole_gbps,
           read_gbps(big), _mm512_reduce_add_ps(s), acc[0]);
  }
}
