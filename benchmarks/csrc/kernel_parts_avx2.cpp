// The portable decode kernel's MLA case on an AVX2 CPU, torch-free (the AVX-512 one is kernel_parts.cpp): an
// FMA loop for this core's peak, the portable score and value loops alone on L1-resident data (score_block at
// 2 rows x 4 keys, the narrow tiles' block, and 2 x 6, the latent tiles', over 256 + 32 features; value_block at
// 2 rows over 16 keys of 256), and the whole attend_range
// (12 rows, one sequence of S keys, float32). benchmarks/decode-limit.md, "An AVX2 machine".
//
//   g++ -O3 -march=native -fno-math-errno -falign-loops=64 -I kvlm/kernels/csrc \
//       benchmarks/csrc/kernel_parts_avx2.cpp -o /tmp/kernel_parts_avx2 && /tmp/kernel_parts_avx2 4096
#include "decode_core.h"
#include <chrono>
#include <cstdio>
#include <cstdlib>
using namespace kvlm_decode;
using Clock = std::chrono::steady_clock;
static double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
static double peak() {
  __m256 a[10]; for (int i = 0; i < 10; ++i) a[i] = _mm256_set1_ps(i * 0.001f);
  const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
  const long n = 20000000; auto t0 = Clock::now();
  for (long k = 0; k < n; ++k) for (int i = 0; i < 10; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
  double t = since(t0); float s = 0; for (int i = 0; i < 10; ++i) s += a[i][0];
  if (s == 12345) printf("x");
  return n * 10.0 * 16 / t / 1e9;
}
int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const int64_t S = argc > 1 ? atoll(argv[1]) : 4096, R = 12, Dk = 256, Dr = 32;
  printf("peak 1 core %.1f GFLOP/s\n", peak());
  // score_block alone on L1 data: 2 rows x 4 keys
  {
    alignas(64) static float q[2][288], k[4][288], s[2][4];
    for (int i = 0; i < 288; ++i) { q[0][i] = q[1][i] = 0.001f * i; for (int y = 0; y < 4; ++y) k[y][i] = 0.002f * i; }
    const float* qp[2] = {q[0], q[1]}; const float* qr[2] = {q[0] + 256, q[1] + 256};
    const float* kp[4] = {k[0], k[1], k[2], k[3]}; const float* kr[4] = {k[0] + 256, k[1] + 256, k[2] + 256, k[3] + 256};
    const long n = 2000000; auto t0 = Clock::now();
    for (long i = 0; i < n; ++i) { score_block<float, 2>(qp, qr, kp, kr, 256, 32, 1.0f, &s[0][0], 4); asm volatile("" ::: "memory"); }
    double t = since(t0);
    printf("score_block<2> L1: %.1f GFLOP/s\n", n * 2.0 * 2 * 4 * 288 / t / 1e9);
  }
  {
    alignas(64) static float q[2][288], k[6][288], s[2][6];
    for (int i = 0; i < 288; ++i) { q[0][i] = q[1][i] = 0.001f * i; for (int y = 0; y < 6; ++y) k[y][i] = 0.002f * i; }
    const float* qp[2] = {q[0], q[1]}; const float* qr[2] = {q[0] + 256, q[1] + 256};
    const float* kp[6]; const float* kr[6];
    for (int y = 0; y < 6; ++y) { kp[y] = k[y]; kr[y] = k[y] + 256; }
    const long n = 2000000; auto t0 = Clock::now();
    for (long i = 0; i < n; ++i) { score_block<float, 2, 6>(qp, qr, kp, kr, 256, 32, 1.0f, &s[0][0], 6); asm volatile("" ::: "memory"); }
    double t = since(t0);
    printf("score_block<2, 6> L1: %.1f GFLOP/s\n", n * 2.0 * 2 * 6 * 288 / t / 1e9);
  }
  {
    alignas(64) static float p[2][16], v[16][256], acc[2][256];
    for (int j = 0; j < 16; ++j) { p[0][j] = p[1][j] = 0.01f; for (int i = 0; i < 256; ++i) v[j][i] = 0.001f * i; }
    const float* vp[16]; for (int j = 0; j < 16; ++j) vp[j] = v[j];
    const long n = 2000000; auto t0 = Clock::now();
    for (long i = 0; i < n; ++i) { value_block<float, 2>(&p[0][0], 16, vp, 16, 256, &acc[0][0], 256); asm volatile("" ::: "memory"); }
    double t = since(t0);
    printf("value_block<2> L1: %.1f GFLOP/s\n", n * 2.0 * 2 * 16 * 256 / t / 1e9);
  }
  // whole attend_range: one sequence, S keys, contiguous pool
  {
    float* poolp = (float*)std::aligned_alloc(64, S * 288 * 4); float* qp_ = (float*)std::aligned_alloc(64, R * 256 * 4);
    float* qrp = (float*)std::aligned_alloc(64, R * 32 * 4 + 64); float* accp = (float*)std::aligned_alloc(64, R * 256 * 4);
    std::vector<float> m(R), l(R);
    for (long i = 0; i < S * 288; ++i) poolp[i] = (rand() % 1000) * 1e-4f;
    for (long i = 0; i < R * 256; ++i) qp_[i] = (rand() % 1000) * 1e-4f;
    for (long i = 0; i < R * 32; ++i) qrp[i] = (rand() % 1000) * 1e-4f;
    std::vector<int32_t> table(1, 0), st(1, 0), en(1, S);
    Job J{};
    J.B = 1; J.G = 1; J.R = R; J.T = 1; J.Dk = 256; J.Dv = 256; J.Dr = 32; J.P = S; J.max_blocks = 1;
    J.Dkp = 256; J.Dvp = 256; J.Drp = 32; J.Rp = R; J.table = table.data(); J.start = st.data(); J.end = en.data();
    J.k.data = poolp; J.k.dtype = DType::f32; J.k.s_page = S * 288; J.k.s_row = 288; J.k.D = 256;
    J.v = J.k; J.kr = J.k; J.kr.data = poolp + 256; J.kr.D = 32; J.v_is_k = true; J.scale = 0.05;
    std::vector<int64_t> lo(R, 0), hi(R, S - 1);
    for (int rep = 0; rep < 3; ++rep) {
      const int n = 50; auto t0 = Clock::now();
      for (int i = 0; i < n; ++i) {
        std::fill(m.begin(), m.end(), -INFINITY); std::fill(l.begin(), l.end(), 0.f); std::fill(accp, accp + R * 256, 0.f);
        attend_range<float>(J, qp_, qrp, 0, 0, 0, S, lo.data(), hi.data(), m.data(), l.data(), accp);
      }
      double t = since(t0);
      printf("attend_range S=%ld: %.1f GFLOP/s (%.2f ms)\n", (long)S, n * 2.0 * R * S * (288 + 256) / t / 1e9, t / n * 1e3);
    }
  }
}
