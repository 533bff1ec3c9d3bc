// The torch-free core of the CPU decode kernel (see decode.cpp): tiles, scores, online softmax, values.
// Kept apart from the binding so it compiles in seconds for a standalone check (g++ -O3 -march=native).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "decode_pool.h"
#include "decode_vec.h"
#include "scratch.h"

namespace kvlm_decode {

// The largest block of query rows the portable score and value loops hold in registers: 4 rows x 4 keys (or
// value vectors) are 16 accumulators, which with the keys and a query fit AVX-512's 32 registers, not AVX2's 16.
#ifndef KVLM_MAX_ROW_BLOCK
#define KVLM_MAX_ROW_BLOCK (KVLM_AVX2 ? 2 : 4)
#endif
constexpr int kMaxRowBlock = KVLM_MAX_ROW_BLOCK;
#if KVLM_AVX2 && !defined(KVLM_NO_AVX2_ROWS4)
#define KVLM_AVX2_ROWS4 1  // narrow rows in blocks of 4 on AVX2 all the same (attend_range_t)
#else
#define KVLM_AVX2_ROWS4 0
#endif
constexpr int kTile = 32;      // the largest key tile; splits of the key axis are multiples of it
// Keys per score block of 2 rows over wide key rows, 0 where the portable path keeps 4 (see decode_avx2.h), and
// the key tile of wide rows: 4 such blocks, else 16 keys.
template <typename T>
constexpr int kWideKeys = KVLM_AVX2 && std::is_same<T, float>::value ? 6 : 0;
template <typename T>
constexpr int kWideTile = kWideKeys<T> ? 4 * kWideKeys<T> : 16;
#ifndef KVLM_SPREAD_TILES  // build knob for measuring: how many tiles ahead wide rows are prefetched (attend_range_t)
#define KVLM_SPREAD_TILES 2
#endif
constexpr int kSpreadTiles = KVLM_SPREAD_TILES;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Job {
  int64_t B, G, R, T, Dk, Dv, Dr, P, max_blocks;
  int64_t Dkp, Dvp, Drp, Rp;  // padded widths (multiples of the vector length) and rows (multiple of 4)
  const int32_t* table;
  const int32_t* start;
  const int32_t* end;
  Pool k, v, kr;
  bool v_is_k;
  double scale;
};

// scores s[x][y] = scale (q_x . k_y + qr_x . kr_y) for RB rows x and KB keys y: the RB query vectors of a step in
// registers, each key vector loaded once for RB FMAs.
template <typename T, int RB, int KB = 4>
inline void score_block(const T* const* q, const T* const* qr, const T* const* kp, const T* const* krp, int64_t Dk,
                        int64_t Dr, T scale, T* s, int stride) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  V a[RB][KB] = {};
  auto steps = [&](const T* const* qx, const T* const* ky, int64_t D) {
    for (int64_t d = 0; d < D; d += L) {
      V qv[RB];
      for (int x = 0; x < RB; ++x) qv[x] = *reinterpret_cast<const V*>(qx[x] + d);
      for (int y = 0; y < KB; ++y) {
        V kv = loadu(ky[y] + d);
#if KVLM_AVX2
        if (KB > 4 || RB > 2) asm("" : "+x"(kv));  // one load per key: GCC would fold it into each of the RB FMAs
#endif
        for (int x = 0; x < RB; ++x) a[x][y] += qv[x] * kv;
      }
    }
  };
  steps(q, kp, Dk);
  steps(qr, krp, Dr);
  store_sums<T, RB, KB>(a, scale, s, stride);
}

// acc[x] += sum_j p[x][j] v_j for RB rows, columns [d0, Dv): two vectors of the value width at a time, so 2 RB
// independent FMA chains hide the FMA latency (one vector per row is only RB chains: half the FMA throughput).
// ZW vectors at a time first: RB = 4 on AVX2 holds 2 (4 x 4 accumulators would be all 16 registers), one row 8.
template <typename T, int RB, int ZW = 4>
inline void value_block(const T* p, int stride, const T* const* vp, int n, int64_t Dv, T* acc, int64_t acc_stride,
                        int64_t d0 = 0) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  int64_t d = d0;
  for (; d + ZW * L <= Dv; d += ZW * L) {  // RB ZW accumulators: each value vector and probability loaded for ZW FMAs
    V a[RB][ZW];
    for (int x = 0; x < RB; ++x)
      for (int z = 0; z < ZW; ++z) a[x][z] = *reinterpret_cast<const V*>(acc + x * acc_stride + d + z * L);
    for (int jj = 0; jj < n; ++jj) {
      V vv[ZW];
      for (int z = 0; z < ZW; ++z) vv[z] = loadu(vp[jj] + d + z * L);
      for (int x = 0; x < RB; ++x) {
        const T px = p[x * stride + jj];
        for (int z = 0; z < ZW; ++z) a[x][z] += px * vv[z];
      }
    }
    for (int x = 0; x < RB; ++x)
      for (int z = 0; z < ZW; ++z) *reinterpret_cast<V*>(acc + x * acc_stride + d + z * L) = a[x][z];
  }
  for (; d + 2 * L <= Dv; d += 2 * L) {
    V a[RB][2];
    for (int x = 0; x < RB; ++x)
      for (int z = 0; z < 2; ++z) a[x][z] = *reinterpret_cast<const V*>(acc + x * acc_stride + d + z * L);
    for (int jj = 0; jj < n; ++jj) {
      const V v0 = loadu(vp[jj] + d), v1 = loadu(vp[jj] + d + L);
      for (int x = 0; x < RB; ++x) {
        const T px = p[x * stride + jj];
        a[x][0] += px * v0;
        a[x][1] += px * v1;
      }
    }
    for (int x = 0; x < RB; ++x)
      for (int z = 0; z < 2; ++z) *reinterpret_cast<V*>(acc + x * acc_stride + d + z * L) = a[x][z];
  }
  for (; d < Dv; d += L) {
    V a[RB];
    for (int x = 0; x < RB; ++x) a[x] = *reinterpret_cast<const V*>(acc + x * acc_stride + d);
    for (int jj = 0; jj < n; ++jj) {
      const V vv = loadu(vp[jj] + d);
      for (int x = 0; x < RB; ++x) a[x] += p[x * stride + jj] * vv;
    }
    for (int x = 0; x < RB; ++x) *reinterpret_cast<V*>(acc + x * acc_stride + d) = a[x];
  }
}

// Whether rows of `p` can be read in place as T vectors (no dequantization, width a whole number of vectors).
template <typename T>
inline bool in_place(const Pool& p) {
  const bool same = std::is_same<T, float>::value ? p.dtype == DType::f32 : p.dtype == DType::f64;
  return same && p.D % Vec<T>::L == 0;
}

// The online softmax of one tile, TILE scores a row in s (rows Rb, the first R real): mask the keys outside each
// row's window [lo, hi] (and past t0 + n), move the running max m (rescaling the sum l and the accumulator acc
// only when it moves), and leave the probabilities in s.
template <typename T, int TILE>
inline void tile_softmax(T* s, int64_t R, int64_t Rb, int64_t t0, int n, const int64_t* lo, const int64_t* hi, T* m,
                         T* l, T* acc, int64_t Dvp) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  constexpr int VT = TILE / L;
  const T ninf = -std::numeric_limits<T>::infinity();
  V iota[VT];  // key offsets 0 .. TILE - 1 within a tile
  for (int u = 0; u < VT; ++u)
    for (int i = 0; i < L; ++i) iota[u][i] = static_cast<T>(u * L + i);
  for (int64_t r = 0; r < Rb; ++r) {
    V* sr = reinterpret_cast<V*>(s + r * TILE);
    if (r >= R) {
      for (int u = 0; u < VT; ++u) sr[u] = V{};
      continue;
    }
    const int64_t hi_r = std::min<int64_t>(hi[r], t0 + n - 1);
    if (lo[r] > t0 || hi_r < t0 + TILE - 1)  // keys outside the row's window (or past the range): -inf
      for (int u = 0; u < VT; ++u) {
        const V jv = iota[u] + static_cast<T>(t0);
        sr[u] = (jv < static_cast<T>(lo[r])) | (jv > static_cast<T>(hi_r)) ? V{} + ninf : sr[u];
      }
    // the running max moves rarely after the first tiles: a compare finds whether it does (a branch the core
    // predicts, so that the exponentials need not wait on a reduction), and only then is the tile's max reduced
    // and what the row has summed rescaled
    V vm = V{} + m[r];
    auto up = sr[0] > vm;
    for (int u = 1; u < VT; ++u) up |= sr[u] > vm;
    if (any_lane<T>(up)) {
      V mv = sr[0];
      for (int u = 1; u < VT; ++u) mv = mv > sr[u] ? mv : sr[u];
      T mt = mv[0];
      for (int i = 1; i < L; ++i) mt = std::max(mt, mv[i]);
      const T alpha = std::exp(m[r] - mt);  // exp(-inf) = 0 on the first visible tile
      l[r] *= alpha;
      m[r] = mt;
      vm = V{} + mt;
      T* ar = acc + r * Dvp;
      for (int64_t d = 0; d < Dvp; d += L) *reinterpret_cast<V*>(ar + d) *= alpha;
    } else if (m[r] == ninf) {  // nothing visible yet
      for (int u = 0; u < VT; ++u) sr[u] = V{};
      continue;
    }
    V sum = V{};
    for (int u = 0; u < VT; ++u) {
      const V p = vexp<T>(sr[u] - vm);
      sr[u] = sr[u] == ninf ? V{} : p;
      sum += sr[u];
    }
    l[r] += hsum<T>(sum);
  }
}

// One work item: rows [0, R) of group g of sequence b against keys [j0, j1); updates the running max m,
// sum l and accumulator acc (rows padded to Rp, widths to Dkp / Dvp / Drp).
template <typename T, int TILE>
void attend_range_t(const Job& J, const T* q, const T* qr, int64_t b, int64_t g, int64_t j0, int64_t j1,
                  const int64_t* lo, const int64_t* hi, T* m, T* l, T* acc) {
  constexpr int L = Vec<T>::L;
  const int64_t R = J.R, Dkp = J.Dkp, Dvp = J.Dvp, Drp = J.Drp;
  // AVX2, narrow rows (GQA / MHA heads of 64): 4 rows in blocks of 4 x 2 scores and 4 rows x 2 value vectors, so that
  // each key and value vector is loaded once for 4 rows (8 accumulators); wide rows take the 2 x 6 blocks below
  constexpr bool k6 = kWideKeys<T> > 0 && TILE % kWideKeys<T> == 0;
  constexpr bool rows4 = kMaxRowBlock >= 4 || (KVLM_AVX2_ROWS4 && !k6);
  const int RB = R >= 4 && rows4 ? 4 : (R >= 2 ? 2 : 1);
  const int64_t Rb = (R + RB - 1) / RB * RB;  // rows rounded to the row block (extra rows are zero queries)
  const bool k_direct = in_place<T>(J.k), v_direct = in_place<T>(J.v), kr_direct = J.Dr && in_place<T>(J.kr);
  // in this thread's scratch (scratch.h: ~100 work items a layer at batch 8, each allocating and zeroing its own
  // buffers cost more than the attention at a few cached keys): a tile's scores, zero keys past the range, and
  // buffers for rows widened from another dtype (none for rows read in place)
  T* s = scratch_array<T>(0, Rb * TILE);
  const T* zero = scratch_array<T>(1, std::max({Dkp, Dvp, Drp}) + L);
  T* kbuf = k_direct ? nullptr : scratch_array<T>(2, TILE * Dkp + L);
  T* vbuf = v_direct ? nullptr : scratch_array<T>(3, TILE * Dvp + L);
  T* krbuf = kr_direct ? nullptr : scratch_array<T>(4, TILE * Drp + L);
  const T* kp[TILE];
  const T* vp[TILE];
  const T* const* vrows = J.v_is_k ? kp : vp;  // the value rows: a latent's are its keys
  const T* krp[TILE];
  const T* qrow[4];
  const T* qrrow[4];
  const int32_t* tab = J.table + b * J.max_blocks;
  const T scale = static_cast<T>(J.scale);
  // wide rows read in place (MLA's float32 latent: compute-heavy tiles): the lines of the tile kSpreadTiles ahead
  // into L2, a share of them before each score and value block, so that memory streams while the FMAs run (left to
  // the hardware's stream, memory stood idle while a tile was computed; as the AVX-512 path's SPREAD). Measured
  // on the Zen 3 EPYC (kernel_micro.py): MLA 1.09x, pages of 16 1.16x; 1 tile ahead 0.97x of 2, 3 level; for int8 /
  // fp8 latents, widened at the tile's start, 0.95-0.96x (not spread)
#ifndef KVLM_NO_SPREAD
  const bool spread = k6 && RB == 2 && J.v_is_k && k_direct && (!J.Dr || kr_direct);
#else
  const bool spread = false;
#endif
  LineSpans lines;  // the tile's lines as spans of adjacent lines (decode_pool.h)
  const auto list_lines = [&](int64_t t) {  // the lines of the tile at t (none past j1)
    lines.clear();
    const int64_t nt = std::max<int64_t>(0, std::min<int64_t>(TILE, j1 - t));
    lines.add_rows(J.k, tab, J.P, g, t, nt);
    if (J.Dr) lines.add_rows(J.kr, tab, J.P, 0, t, nt);
  };
  int64_t per_block = 0;
  for (int k = 1; spread && k < kSpreadTiles; ++k) list_lines(j0 + k * TILE), lines.issue(lines.total);
  int64_t page_i = j0 / J.P, row = j0 % J.P;
  for (int64_t t0 = j0; t0 < j1; t0 += TILE) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, j1 - t0));
    // the tile's rows page by page: a run of rows in one page steps by the pool's row stride (a pointer per row
    // from its page, group and row cost more instructions than MHA's dot products)
    page_runs(tab, J.P, n, page_i, row, [&](int64_t page, int64_t in_page, int run, int jj) {
      page_rows<T>(J.k, k_direct, page, g, in_page, run, k_direct ? nullptr : kbuf + jj * Dkp, Dkp, kp + jj);
      if (!J.v_is_k) {
        page_rows<T>(J.v, v_direct, page, g, in_page, run, v_direct ? nullptr : vbuf + jj * Dvp, Dvp, vp + jj);
        // the values (MHA / GQA) into L1 while the tile's scores are computed: the value loop's first touch of each
        // row otherwise waits on L2 / memory (AVX2, kernel_micro: GQA-3 1.02-1.14x, MHA 1.00-1.04x)
#ifndef KVLM_NO_V_PREFETCH
        if (v_direct) prefetch_rows(vp[jj], run, J.v.s_row, J.v.D);
#endif
      }
      if (J.Dr)
        page_rows<T>(J.kr, kr_direct, page, 0, in_page, run, kr_direct ? nullptr : krbuf + jj * Drp, Drp, krp + jj);
    });
    for (int jj = n; jj < TILE; ++jj) kp[jj] = vp[jj] = krp[jj] = zero;  // past the range: zero keys, masked below
    if (spread) {
      list_lines(t0 + kSpreadTiles * TILE);
      const int64_t blocks = (TILE / std::max(1, kWideKeys<T>) + 1) * (Rb / 2);  // the tile's score and value blocks
      per_block = (lines.total + blocks - 1) / blocks;
    } else {
      // else the next tile's rows into L2 while this one is computed, those in later pages of the block table
      // only: the hardware's sequential prefetcher does not know the table, but it runs ahead within a page, where
      // prefetching too measured 0.95-0.97x (AVX2, pages of a whole sequence; pages of 16: 1.02-1.05x with it)
      const int nn = static_cast<int>(std::min<int64_t>(TILE, j1 - t0 - n));
      const int same_page = row > 0 ? static_cast<int>(std::min<int64_t>(nn, J.P - row)) : 0;  // hardware's stream
      int64_t pi = page_i + (row + same_page == J.P), rw = (row + same_page) % J.P;
      for (int jj = same_page; jj < nn; ++jj) {
        const int64_t page = tab[pi];
        prefetch_row(J.k, page, g, rw);
        if (!J.v_is_k) prefetch_row(J.v, page, g, rw);
        if (J.Dr) prefetch_row(J.kr, page, 0, rw);
        if (++rw == J.P) {
          rw = 0;
          ++pi;
        }
      }
    }
    // AVX2, wide rows: blocks of 2 rows x 6 keys, keys outer so that 6 keys stay in L1 for all rows
    if (k6 && RB == 2) {
      constexpr int KW = k6 ? kWideKeys<T> : 4;
      for (int y0 = 0; y0 < TILE; y0 += KW)
        for (int64_t r0 = 0; r0 < Rb; r0 += 2) {
          const T* qx[2] = {q + r0 * Dkp, q + (r0 + 1) * Dkp};
          const T* qrx[2] = {qr + r0 * Drp, qr + (r0 + 1) * Drp};
          if (spread) lines.issue(per_block);
          score_block<T, 2, KW>(qx, qrx, kp + y0, krp + y0, Dkp, Drp, scale, s + r0 * TILE + y0, TILE);
        }
    } else {
      for (int64_t r0 = 0; r0 < Rb; r0 += RB) {
        for (int x = 0; x < RB; ++x) {
          qrow[x] = q + (r0 + x) * Dkp;
          qrrow[x] = qr + (r0 + x) * Drp;
        }
        for (int y0 = 0; y0 < TILE; y0 += 4) {
          T* sb = s + r0 * TILE + y0;
          if (RB == 4 && KVLM_AVX2_ROWS4) {
            score_block<T, 4, 2>(qrow, qrrow, kp + y0, krp + y0, Dkp, Drp, scale, sb, TILE);
            score_block<T, 4, 2>(qrow, qrrow, kp + y0 + 2, krp + y0 + 2, Dkp, Drp, scale, sb + 2, TILE);
          } else if (RB == 4)
            score_block<T, 4>(qrow, qrrow, kp + y0, krp + y0, Dkp, Drp, scale, sb, TILE);
          else if (RB == 2)
            score_block<T, 2>(qrow, qrrow, kp + y0, krp + y0, Dkp, Drp, scale, sb, TILE);
          else if (y0 % 8 == 0)  // one row: 8 keys a block (8 FMA chains), the tile's 32 keys in 4
            score_block<T, 1, 8>(qrow, qrrow, kp + y0, krp + y0, Dkp, Drp, scale, sb, TILE);
        }
      }
    }
    tile_softmax<T, TILE>(s, R, Rb, t0, n, lo, hi, m, l, acc, Dvp);
    for (int64_t r0 = 0; r0 < Rb; r0 += RB) {
      const T* pb = s + r0 * TILE;
      T* ab = acc + r0 * Dvp;
      if (RB == 4)
        value_block<T, 4, KVLM_AVX2_ROWS4 ? 2 : 4>(pb, TILE, vrows, n, Dvp, ab, Dvp);
      else if (RB == 2) {
        if (spread) lines.issue(per_block);
        value_block<T, 2>(pb, TILE, vrows, n, Dvp, ab, Dvp);
      } else
        value_block<T, 1, 8>(pb, TILE, vrows, n, Dvp, ab, Dvp);  // 8 FMA chains
    }
  }
}

#include "decode_pipe.h"  // (inside the namespace)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && KVLM_VEC_BYTES == 64 && \
    !defined(KVLM_NO_AVX512)
#define KVLM_AVX512 1
#ifndef KVLM_NARROW_TILE
#define KVLM_NARROW_TILE 32
#endif
}  // namespace kvlm_decode
#include "decode_avx512.h"
namespace kvlm_decode {
#else
#define KVLM_AVX512 0
#endif

// The key tile: 16 keys when they are wide (the tile of 16 x (256 + 32) floats stays in a 32 KiB L1 while every
// row block reads it), 32 when narrow (per-tile overhead dominates); measured on AVX-512, MLA 12 x (256 + 32):
// +10 %, GQA 4 x 64: -8 % the other way round.
template <typename T>
void attend_range(const Job& J, const T* q, const T* qr, int64_t b, int64_t g, int64_t j0, int64_t j1,
                  const int64_t* lo, const int64_t* hi, T* m, T* l, T* acc) {
#if KVLM_AVX512
  if constexpr (std::is_same<T, float>::value) {  // float queries, K and V pools of one dtype: the micro-kernels
    const bool wide = J.Dkp + J.Drp >= 256;
    const DType dt = J.k.dtype;
    if (dt == J.v.dtype && (dt == DType::f32 || dt == DType::bf16 || dt == DType::i8 || dt == DType::f8)) {
      auto run = [&](auto dt_tag) {
        constexpr DType DT = decltype(dt_tag)::value;
        // widened once per tile: bf16 / int8 / fp8 from kWidenRows rows, float32 (a copy) from 4 kWidenRows; float32
        // read in place from kWidenRows rows (MLA) prefetches later tiles spread over the work, in an instantiation
        // of its own (SPREAD), so that the code for fewer rows (GQA, MHA) carries none of it
        const bool widen = (DT != DType::f32 || J.R >= 4 * avx512::kWidenRows) && J.R >= avx512::kWidenRows;
        auto* run_range = widen ? (wide ? &avx512::attend_range<DT, 16, true, false>
                                        : &avx512::attend_range<DT, 32, true, false>)
                                : (wide ? &avx512::attend_range<DT, 16, false, false>
                                        : &avx512::attend_range<DT, KVLM_NARROW_TILE, false, false>);
        if constexpr (DT == DType::f32)
          if (!widen && J.R >= avx512::kWidenRows)
            run_range = wide ? &avx512::attend_range<DT, 16, false, true>
                             : &avx512::attend_range<DT, KVLM_NARROW_TILE, false, true>;
        run_range(J, q, qr, b, g, j0, j1, lo, hi, m, l, acc);
      };
      if (dt == DType::f32) run(std::integral_constant<DType, DType::f32>());
      if (dt == DType::bf16) run(std::integral_constant<DType, DType::bf16>());
      if (dt == DType::i8) run(std::integral_constant<DType, DType::i8>());
      if (dt == DType::f8) run(std::integral_constant<DType, DType::f8>());
      return;
    }
  }
#endif
#ifndef KVLM_NO_PIPE
  if (!J.v_is_k && J.R >= 2 && J.Dkp + J.Drp < 256)  // narrow rows, 2 or more a group: pipelined (decode_pipe.h)
    return attend_pipe_t<T, 32>(J, q, qr, b, g, j0, j1, lo, hi, m, l, acc);
#endif
  if (J.Dkp + J.Drp >= 256)
    attend_range_t<T, kWideTile<T>>(J, q, qr, b, g, j0, j1, lo, hi, m, l, acc);
  else
    attend_range_t<T, 32>(J, q, qr, b, g, j0, j1, lo, hi, m, l, acc);
}

}  // namespace kvlm_decode
