// A parallel loop whose threads take over each other's unfinished work (the weight products of a decode step).
//
// at::parallel_for gives each thread one contiguous run of the items and waits for the slowest. A decode step
// makes ~40 such calls of 0.1-0.5 ms, each streaming a few MB of weights; on a shared machine one core often
// streams slower than the other for a while (another tenant on its memory path), and every call then waits for
// it. Here each thread still starts on its own contiguous run, front to back (one sequential stream, as before);
// a thread that finishes takes the items left at the back of the others' runs, one at a time, as llama.cpp's
// threads take chunks of a matrix product from a shared counter. Measured on the Zen 4 EPYC, 2 threads, the same
// model with the weight products and the attention kernel switched between the two loops call by call: decode
// steps at batch 8 / 4096 cached tokens 1.00-1.05x faster than at::parallel_for's split when the machine read
// ~34 GB/s; when it read ~58, MHA and GQA-3 1.05-1.08x, absorbed MLA 0.97x (compute-bound, even items: nothing
// to take; the run before, in the slow state, 1.02-1.05x), batch 1 / 8192 0.99-1.06x; the one-token step
// 1.00-1.03x.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace kvlm_decode {

// Takes one item of a run [front, back), packed as front << 32 | back: its front (the owner) or its back (another
// thread); false when the run is empty.
inline bool take(std::atomic<uint64_t>& span, bool front, int64_t& item) {
  uint64_t v = span.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t f = v >> 32, b = v & 0xFFFFFFFFu;
    if (f >= b) return false;
    if (span.compare_exchange_weak(v, front ? v + (uint64_t(1) << 32) : v - 1, std::memory_order_relaxed)) {
      item = static_cast<int64_t>(front ? f : b - 1);
      return true;
    }
  }
}

// f(i) for every i in [0, n), each exactly once, over at::get_num_threads() threads (serially inside a parallel
// region or for n < 2).
template <typename F>
inline void steal_for(int64_t n, F&& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads < 2 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  struct alignas(64) Run {  // a cache line each: the owners' fronts do not contend
    std::atomic<uint64_t> span;
  };
  std::vector<Run> runs(threads);
  for (int64_t t = 0; t < threads; ++t)
    runs[t].span.store(uint64_t(n * t / threads) << 32 | uint64_t(n * (t + 1) / threads), std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    int64_t i;
    for (int64_t t = t0; t < t1; ++t) {
      while (take(runs[t].span, true, i)) f(i);  // own run, front to back
      for (int64_t k = 1; k < threads; ++k)      // then the others', back to front
        while (take(runs[(t + k) % threads].span, false, i)) f(i);
    }
  });
}

}  // namespace kvlm_decode
