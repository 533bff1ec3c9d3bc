// Flash-decoding attention over a block-table cache on CPU (kvlm.kernels.cpu builds this on first use).
//
//   out[b, g, r] = softmax_j(scale (q[b,g,r] . k[b,g,j] + q_rope[b,g,r] . k_rope[b,j])) v[b,g,j]
//
// One kernel serves MLA's absorbed route (G = 1 group, R = H x T query rows, k = v = the cached latent c_kv,
// k_rope the shared RoPE key) and GQA/MHA decode (G = KV heads, R = query heads per KV head x T, no RoPE
// term). Every query row of a group shares each cached key, so a tile of keys is loaded once (from any page,
// int8 / bf16 widened to float) and used by all R rows: scores as a small register-blocked GEMM, an online
// softmax per row, values accumulated by a second register-blocked GEMM (decode_avx512.h for float32 queries
// on AVX-512 CPUs, decode_core.h's portable code otherwise).
// Work items are (sequence, group, split of the key axis); with few sequences the key axis is split over the
// threads and the partial (max, sum, acc) of each split are merged by log-sum-exp at the end.
//
// Query row r is new token t = r % T of its sequence, at logical slot end_b - T + t; it sees the keys
// [start_b, end_b - T + t] (causal among the new tokens). A row that sees no key there (a left-padding query
// of a padded prefill) sees its own slot only, as kvlm.attention.step.Step.build's mask says.

// ATen and torch's pybind casters only, not <torch/extension.h> (the whole C++ frontend): half the build time
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>

#include "decode_core.h"
#include "few_rows.h"
#include "few_rows_panels.h"
#include "scratch.h"
#include "steal.h"

namespace {

using namespace kvlm_decode;

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::f32;
    case at::kDouble: return DType::f64;
    case at::kBFloat16: return DType::bf16;
    case at::kChar: return DType::i8;
    case at::kFloat8_e4m3fn: return DType::f8;
    default: TORCH_CHECK(false, "unsupported cache dtype ", t);
  }
  return DType::f32;
}

// A pool (N, [G,] P, D) of pages of P rows and its optional per-row scales (N, [G,] P, 1); shapes checked here, so
// that a page axis shorter than the page size or a short scale tensor is an error, not a read past their ends.
Pool make_pool(const at::Tensor& pool, const c10::optional<at::Tensor>& scale, bool grouped, int64_t P) {
  TORCH_CHECK(pool.stride(-1) == 1, "cache pool must be contiguous in its last axis");
  TORCH_CHECK(pool.size(-2) == P, "cache pool's page axis (size ", pool.size(-2), ") is not the page size ", P);
  Pool p;
  p.data = pool.data_ptr();
  p.dtype = to_dtype(pool.scalar_type());
  p.D = pool.size(-1);
  p.s_page = pool.stride(0);
  p.s_group = grouped ? pool.stride(1) : 0;
  p.s_row = pool.stride(-2);
  if (scale.has_value() && scale->defined()) {
    const auto& s = *scale;
    TORCH_CHECK(s.scalar_type() == at::kFloat, "cache scales must be float32");
    TORCH_CHECK(s.dim() == pool.dim() && s.size(-1) == 1 && s.sizes().slice(0, s.dim() - 1) ==
                    pool.sizes().slice(0, pool.dim() - 1),
                "cache scales must be ", pool.sizes().slice(0, pool.dim() - 1), " x 1, got ", s.sizes());
    p.scale = s.data_ptr<float>();
    p.sc_page = s.stride(0);
    p.sc_group = grouped ? s.stride(1) : 0;
    p.sc_row = s.dim() >= 2 ? s.stride(grouped ? 2 : 1) : 1;
  }
  return p;
}

// x (B, G, R, D) as (B, G, Rp, Dp) rows in the calling thread's scratch buffer `slot`: each row copied whole, only
// the padding (columns past D, rows past R) zeroed
template <typename T>
T* padded_rows(const at::Tensor& x, int slot, int64_t Rp, int64_t Dp) {
  const int64_t B = x.size(0), G = x.size(1), R = x.size(2), D = x.size(3);
  T* dst = kvlm_decode::scratch_array<T>(slot, std::max<int64_t>(B * G * Rp * Dp, 1), false);
  auto xa = x.accessor<T, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < Rp; ++r) {
        T* o = dst + ((b * G + g) * Rp + r) * Dp;
        int64_t d = 0;
        if (r < R) {
          const auto row = xa[b][g][r];
          if (row.stride(0) == 1)
            std::memcpy(o, row.data(), D * sizeof(T));
          else
            for (int64_t c = 0; c < D; ++c) o[c] = row[c];
          d = D;
        }
        std::fill(o + d, o + Dp, T(0));
      }
  return dst;
}

// q (B, G, R, Dk), q_rope (B, G, R, Dr) or undefined; returns (B, G, R, Dv).
template <typename T>
at::Tensor run(const Job& J, const at::Tensor& q, const at::Tensor& q_rope, int64_t n_split) {
  using kvlm_decode::kCallSlot;
  const int64_t B = J.B, G = J.G, R = J.R, Rp = J.Rp, Dv = J.Dv, Dvp = J.Dvp;
  auto out = at::empty({B, G, R, Dv}, q.options());
  T* o = out.data_ptr<T>();
  // padded, aligned copies of the queries, (B, G, Rp, Dkp) and (B, G, Rp, Drp), and the items' partials below in
  // the calling thread's scratch (slots past the work items'), zeroed only where read before written: allocated
  // and zeroed whole per call, they were a third of a short call
  T* qpad = padded_rows<T>(q, kCallSlot, Rp, J.Dkp);
  T* qrpad = J.Dr ? padded_rows<T>(q_rope, kCallSlot + 1, Rp, J.Drp) : kvlm_decode::scratch_array<T>(kCallSlot + 1, 1);
  // per sequence: the key range read, and each row's visible slots [lo, hi]
  std::vector<int64_t> first(B), lo(B * R), hi(B * R);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s0 = J.start[b], e = J.end[b];
    first[b] = std::min(s0, std::max<int64_t>(e - J.T, 0));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t own = e - J.T + r % J.T;
      lo[b * R + r] = own < s0 ? own : s0;
      hi[b * R + r] = own;
    }
  }
  const int64_t items = B * G * n_split;
  // partials: (items, Rp) m and l (an item with no keys keeps l = 0), (items, Rp, Dvp) acc, zeroed by its item
  T* pm = kvlm_decode::scratch_array<T>(kCallSlot + 2, items * Rp, false);
  T* pl = kvlm_decode::scratch_array<T>(kCallSlot + 3, items * Rp);
  T* pacc = kvlm_decode::scratch_array<T>(kCallSlot + 4, items * Rp * Dvp, false);
  std::fill(pm, pm + items * Rp, -std::numeric_limits<T>::infinity());
  // rows r of (b, g) = acc / l, or 0 where no key was seen
  auto normalise = [&](int64_t bg, int64_t r, const T* acc, T lsum) {
    const T inv = lsum > T(0) ? T(1) / lsum : T(0);
    T* dst = o + (bg * R + r) * Dv;
    for (int64_t d = 0; d < Dv; ++d) dst[d] = acc[d] * inv;
  };
  steal_for(items, [&](int64_t it) {
    const int64_t sp = it % n_split, bg = it / n_split, b = bg / G, g = bg % G;
    const int64_t a = first[b], e = J.end[b], len = std::max<int64_t>(e - a, 0);
    const int64_t chunk = round_up((len + n_split - 1) / n_split, kTile);
    const int64_t j0 = a + sp * chunk, j1 = std::min(e, j0 + chunk);
    T* acc = pacc + it * Rp * Dvp;
    std::fill(acc, acc + Rp * Dvp, T(0));  // here, not per call: in this thread's cache, where it is used
    if (j0 < j1)
      attend_range<T>(J, qpad + bg * Rp * J.Dkp, qrpad + bg * Rp * J.Drp, b, g, j0, j1, lo.data() + b * R,
                      hi.data() + b * R, pm + it * Rp, pl + it * Rp, acc);
    if (n_split == 1)  // nothing to merge: the item writes its rows of the output
      for (int64_t r = 0; r < R; ++r) normalise(bg, r, acc + r * Dvp, pl[it * Rp + r]);
  });
  if (n_split == 1) return out;
  // merge the splits by log-sum-exp and normalise
  std::vector<T> merged(Dv);
  for (int64_t bg = 0; bg < B * G; ++bg) {
    for (int64_t r = 0; r < R; ++r) {
      T M = -std::numeric_limits<T>::infinity();
      for (int64_t sp = 0; sp < n_split; ++sp) M = std::max(M, pm[(bg * n_split + sp) * Rp + r]);
      T Lsum = 0;
      std::fill(merged.begin(), merged.end(), T(0));
      for (int64_t sp = 0; sp < n_split; ++sp) {
        const int64_t it = bg * n_split + sp;
        if (pl[it * Rp + r] == T(0)) continue;
        const T w = std::exp(pm[it * Rp + r] - M);
        Lsum += pl[it * Rp + r] * w;
        const T* ar = pacc + (it * Rp + r) * Dvp;
        for (int64_t d = 0; d < Dv; ++d) merged[d] += ar[d] * w;
      }
      normalise(bg, r, merged.data(), Lsum);
    }
  }
  return out;
}

at::Tensor check_table(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kInt, what, " must be int32");
  return t.contiguous();
}

// The op. k_pool (N, G, P, Dk); v_pool (N, G, P, Dv) (the same tensor as k_pool for a latent: read once);
// kr_pool (N, P, Dr) shared by the groups; scales (N, G, P, 1) float32 for int8 / fp8 (e4m3fn) pools.
at::Tensor decode_attention(const at::Tensor& q, const c10::optional<at::Tensor>& q_rope, const at::Tensor& k_pool,
                            const c10::optional<at::Tensor>& k_scale, const at::Tensor& v_pool,
                            const c10::optional<at::Tensor>& v_scale, const c10::optional<at::Tensor>& kr_pool,
                            const at::Tensor& block_table, const at::Tensor& start, const at::Tensor& end,
                            int64_t page_size, int64_t n_new, double scale, int64_t n_split) {
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 4 && v_pool.dim() == 4, "q, k_pool, v_pool must be 4-D");
  TORCH_CHECK(q.device().is_cpu(), "the CPU decode kernel takes CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, "q must be float32 or float64");
  const bool has_rope = q_rope.has_value() && q_rope->defined();
  TORCH_CHECK(has_rope == (kr_pool.has_value() && kr_pool->defined()), "q_rope and kr_pool go together");
  TORCH_CHECK(!has_rope || (q_rope->dim() == 4 && q_rope->sizes().slice(0, 3) == q.sizes().slice(0, 3)),
              "q_rope must be (B, G, R, d_R) with q's B, G, R");
  TORCH_CHECK(page_size >= 1 && n_new >= 1, "page_size and n_new must be >= 1, got ", page_size, " and ", n_new);
  auto table = check_table(block_table, "block_table");
  auto st = check_table(start, "start");
  auto en = check_table(end, "end");
  TORCH_CHECK(table.dim() == 2 && st.dim() == 1 && en.dim() == 1, "block_table must be (B, pages), start and end (B,)");
  Job J;
  J.B = q.size(0);
  J.G = q.size(1);
  J.R = q.size(2);
  J.T = n_new;
  J.Dk = q.size(3);
  J.Dv = v_pool.size(-1);
  J.Dr = has_rope ? q_rope->size(3) : 0;
  J.P = page_size;
  J.max_blocks = table.size(1);
  TORCH_CHECK(k_pool.size(1) == J.G && v_pool.size(1) == J.G, "pools must have G = q.size(1) groups");
  TORCH_CHECK(k_pool.size(-1) == J.Dk, "k_pool width differs from q's");
  TORCH_CHECK(J.R % J.T == 0, "rows must be heads x new tokens");
  TORCH_CHECK(table.size(0) == J.B && st.size(0) == J.B && en.size(0) == J.B, "block_table, start, end must have B rows");
  TORCH_CHECK(v_pool.size(0) == k_pool.size(0), "v_pool must have k_pool's ", k_pool.size(0), " pages");
  const int64_t L = q.scalar_type() == at::kFloat ? Vec<float>::L : Vec<double>::L;
  J.Dkp = round_up(J.Dk, L);
  J.Dvp = round_up(J.Dv, L);
  J.Drp = J.Dr ? round_up(J.Dr, L) : 0;
  J.Rp = round_up(J.R, 4);
  J.table = table.data_ptr<int32_t>();
  J.start = st.data_ptr<int32_t>();
  J.end = en.data_ptr<int32_t>();
  // bad slots or pages would read outside the pools: one clear error instead
  const int64_t n_pages = k_pool.size(0);
  for (int64_t b = 0; b < J.B; ++b) {
    const int64_t s0 = J.start[b], e = J.end[b];
    TORCH_CHECK(s0 >= 0 && e >= J.T && e <= J.max_blocks * J.P, "sequence ", b, ": slots [", s0, ", ", e,
                ") do not fit its block table of ", J.max_blocks, " pages of ", J.P, " with ", J.T, " new tokens");
    for (int64_t i = std::min(s0, e - J.T) / J.P; i < (e + J.P - 1) / J.P; ++i) {
      const int64_t page = J.table[b * J.max_blocks + i];
      TORCH_CHECK(page >= 0 && page < n_pages, "sequence ", b, ": block table entry ", i, " = ", page,
                  " is not a page of the pool (", n_pages, " pages)");
    }
  }
  J.k = make_pool(k_pool, k_scale, true, J.P);
  J.v = make_pool(v_pool, v_scale, true, J.P);
  J.v_is_k = v_pool.data_ptr() == k_pool.data_ptr() && v_pool.strides() == k_pool.strides() &&
             v_pool.sizes() == k_pool.sizes();
  if (has_rope) {
    TORCH_CHECK(kr_pool->dim() == 3 && kr_pool->size(-1) == J.Dr, "kr_pool must be (N, P, d_R)");
    TORCH_CHECK(kr_pool->size(0) == n_pages, "kr_pool must have k_pool's ", n_pages, " pages");
    J.kr = make_pool(*kr_pool, c10::nullopt, false, J.P);
  }
  J.scale = scale;
  at::Tensor qr = has_rope ? *q_rope : at::Tensor();
  n_split = std::max<int64_t>(1, n_split);
  if (q.scalar_type() == at::kFloat) return run<float>(J, q, qr, n_split);
  return run<double>(J, q, qr, n_split);
}

// RMSNorm in one pass per row: y = x / sqrt(mean(x^2) + eps) * w, the sum of squares in double. torch's CPU
// rms_norm runs as ~10 separate operators, ~30-80 us each call at decode's few rows (issue 15, "the rest of the
// step"); this is one. Rows split over the threads only when there are many (a prefill), not for decode's few.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t D, double eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      T* yr = y + r * D;
      double ss = 0;
#pragma omp simd reduction(+ : ss)  // lets the compiler reorder the sum into vector lanes
      for (int64_t d = 0; d < D; ++d) ss += double(xr[d]) * double(xr[d]);
      const T inv = T(1.0 / std::sqrt(ss / double(D) + eps));
      for (int64_t d = 0; d < D; ++d) yr[d] = xr[d] * inv * w[d];
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm takes CPU tensors");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must have one dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, "x must be float32 or float64");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be (x.size(-1),)");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto y = at::empty_like(xc);
  const int64_t D = x.size(-1), rows = D ? xc.numel() / D : 0;
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows<float>(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), rows, D, eps);
  else
    rms_norm_rows<double>(xc.data_ptr<double>(), wc.data_ptr<double>(), y.data_ptr<double>(), rows, D, eps);
  return y;
}

// Which thread ran each of n items of steal_for (tests): -2 where an item ran more than once, -1 where never;
// items [0, slow) each spin `us` microseconds, so that a thread with the others' runs done takes some of them.
at::Tensor steal_for_threads(int64_t n, int64_t slow, double us) {
  std::vector<std::atomic<int>> ran(n);
  for (auto& r : ran) r.store(-1);
  steal_for(n, [&](int64_t i) {
    if (i < slow) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(us);
      while (std::chrono::steady_clock::now() < until) {
      }
    }
    if (ran[i].exchange(at::get_thread_num()) != -1) ran[i].store(-2);
  });
  auto out = at::empty({n}, at::kInt);
  for (int64_t i = 0; i < n; ++i) out[i] = ran[i].load();
  return out;
}

#if KVLM_AVX512 || KVLM_AVX2
#include "decode_block.h"  // on the few-row kernel's products
#include "decode_stack.h"  // the blocks of a model in one call
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "flash-decoding attention over a block-table cache (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last axis in one pass (CPU)");
  m.def("steal_for_threads", &steal_for_threads, "which thread ran each item of steal_for (tests)");
  m.attr("avx2") = pybind11::bool_(KVLM_AVX2);  // the AVX2 micro-kernels (kvlm.kernels.cpu.avx2_only's guess)
#if KVLM_AVX512
  m.def("panel_linear", &kvlm_decode::few_rows::panel_linear, "x W^T + b on W's panels (AVX-512 CPU)");
#endif
#if KVLM_AVX512 || KVLM_AVX2
  m.def("head_products", &kvlm_decode::few_rows::head_products, "x_h W_h per head at a few rows (AVX-512 / AVX2 CPU)");
  m.def("few_rows_linear", &kvlm_decode::few_rows::linear, "[x W_i^T + b_i] at a few rows of x (AVX-512 / AVX2 CPU)");
  m.def("gqa_block", &gqa_block, "one MHA / GQA decoder block at a few new tokens a sequence (AVX-512 / AVX2 CPU)");
  m.def("mla_block", &mla_block, "one absorbed-MLA decoder block at a few new tokens a sequence (AVX-512 / AVX2 CPU)");
  pybind11::class_<BlockStack>(m, "BlockStack", "a model's decoder blocks at decode in one call (AVX-512 / AVX2 CPU)")
      .def(pybind11::init<>())
      .def("add_gqa", &BlockStack::add_gqa)
      .def("add_mla", &BlockStack::add_mla)
      .def("run", &BlockStack::run)
      .def("__len__", [](const BlockStack& s) { return s.layers.size(); });
#ifdef KVLM_SECTION_TIMES
  m.def("section_times", []() {
    std::vector<double> v(std::begin(section_seconds), std::end(section_seconds));
    std::fill(std::begin(section_seconds), std::end(section_seconds), 0.0);
    return v;
  }, "seconds in each part of the blocks since the last call (KVLM_SECTION_TIMES builds)");
#endif
#endif
}
