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

// score_block apart from its caller: inlined into attend_range_t, GCC's register allocation of the 2 x 6 block
// moved with the code around it (spilled accumulators: MLA's tiles 0.70-0.96x as fast, one change to the next)
template <typename T, int RB, int KB>
__attribute__((noinline)) void score_block_apart(const T* const* q, const T* const* qr, const T* const* kp,
                                                 const T* const* krp, int64_t Dk, int64_t Dr, T scale, T* s,
                                                 int stride) {
  score_block<T, RB, KB>(q, qr, kp, krp, Dk, Dr, scale, s, stride);
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

// One work item: rows [0, R) of group g of sequence b against keys [j0, j1); updates the running max m,
// sum l and accumulator acc (rows padded to Rp, widths to Dkp / Dvp / Drp).
template <typename T, int TILE>
void attend_range_t(const Job& J, const T* q, const T* qr, int64_t b, int64_t g, int64_t j0, int64_t j1,
                  const int64_t* lo, const int64_t* hi, T* m, T* l, T* acc) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  constexpr int VT = TILE / L;  // vectors per tile row of scores
  const int64_t R = J.R, Dkp = J.Dkp, Dvp = J.Dvp, Drp = J.Drp;
  // AVX2, narrow rows (GQA / MHA heads of 64): 4 rows in blocks of 4 x 2 scores and 4 rows x 2 value vectors, so that
  // each key and value vector is loaded once for 4 rows (8 accumulators); wide rows take the 2 x 6 blocks below
  constexpr bool k6 = kWideKeys<T> > 0 && TILE % kWideKeys<T> == 0;
  constexpr bool rows4 = kMaxRowBlock >= 4 || (KVLM_AVX2_ROWS4 && !k6);
  const int RB = R >= 4 && rows4 ? 4 : (R >= 2 ? 2 : 1);
  const int64_t Rb = (R + RB - 1) / RB * RB;  // rows rounded to the row block (extra rows are zero queries)
  // narrow rows with values of their own, 2 or more a group (GQA; MHA's new tokens): the values of tile t - 1 are
  // computed between the score blocks of tile t, and tile t's value rows prefetched a share per score block, so that
  // memory streams K and V through the whole tile; a tile's scores, softmax and values in turn left memory idle
  // through the softmax and the values' burst (one core, GQA-3 from memory read 10 GB/s where a plain read of the
  // same bytes reads 18: work and memory took turns; narrow_heads.cpp). kernel_micro.py, Zen 3, against
  // KVLM_NO_PIPE: GQA-3 1.21-1.27x; one row a group (MHA at one token, ~10 FMAs a line) 0.90-0.92x: not there.
#ifndef KVLM_NO_PIPE
  const bool pipe = !J.v_is_k && !(k6 && RB == 2) && RB >= 2;
#else
  const bool pipe = false;
#endif
  const bool k_direct = in_place<T>(J.k), v_direct = in_place<T>(J.v), kr_direct = J.Dr && in_place<T>(J.kr);
  // buffers for rows widened from another dtype (none for rows read in place), zero keys past the range, scores
  std::vector<V> kbuf_v(k_direct ? 0 : TILE * Dkp / L + 1),
      vbuf_v(v_direct || J.v_is_k ? 0 : 2 * TILE * Dvp / L + 1),  // two tiles' when pipelined
      krbuf_v(kr_direct ? 0 : TILE * Drp / L + 1), zero_v(std::max({Dkp, Dvp, Drp}) / L + 1), s_v(2 * Rb * VT);
  T* kbuf = reinterpret_cast<T*>(kbuf_v.data());
  T* krbuf = reinterpret_cast<T*>(krbuf_v.data());
  const T* zero = reinterpret_cast<const T*>(zero_v.data());
  const T* kp[TILE];
  const T* vp2[2][TILE];  // a tile's value rows; two when pipelined (the last tile's are read during this one)
  const T* krp[TILE];
  const int32_t* tab = J.table + b * J.max_blocks;
  const T ninf = -std::numeric_limits<T>::infinity();
  const T scale = static_cast<T>(J.scale);
  V iota[VT];  // key offsets 0 .. TILE - 1 within a tile
  for (int u = 0; u < VT; ++u)
    for (int i = 0; i < L; ++i) iota[u][i] = static_cast<T>(u * L + i);
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
  LineSpans ahead;  // rows of later tiles to prefetch, a share per block of work
  const auto list_tile = [&](int64_t t) {  // the rows of the tile at t (none past j1)
    ahead.clear();
    const int64_t nt = std::max<int64_t>(0, std::min<int64_t>(TILE, j1 - t));
    ahead.add_rows(J.k, tab, J.P, g, t, nt);
    if (J.Dr) ahead.add_rows(J.kr, tab, J.P, 0, t, nt);
  };
  int64_t per_block = 0;
  for (int k = 1; spread && k < kSpreadTiles; ++k) list_tile(j0 + k * TILE), ahead.issue(ahead.total);

  // A tile's work in units, so that one tile's values can run between the next one's scores (narrow rows). Score
  // units: a row block x KU keys (one row: 8, its score block). Value units: a row block x a chunk of the columns its
  // value_block holds in registers (pipelined), or x all of them.
  constexpr int KW = k6 ? kWideKeys<T> : 4;
  const int n_blocks = static_cast<int>(Rb / RB), KU = RB == 1 ? 8 : 4;
  const int ns = n_blocks * (TILE / KU);
  const int64_t width = pipe ? (RB == 4 ? (KVLM_AVX2_ROWS4 ? 2 : 4) : RB == 2 ? 4 : 8) * L : Dvp;
  const int nc = static_cast<int>((Dvp + width - 1) / width), nv = n_blocks * nc;
  const auto score_unit = [&](T* s, int i) __attribute__((always_inline)) {  // row block i / (TILE / KU)
    const int64_t r0 = (i / (TILE / KU)) * RB;
    const int y0 = (i % (TILE / KU)) * KU;
    const T* qrow[4];
    const T* qrrow[4];
    for (int x = 0; x < RB; ++x) {
      qrow[x] = q + (r0 + x) * Dkp;
      qrrow[x] = qr + (r0 + x) * Drp;
    }
    T* sb = s + r0 * TILE + y0;
    if (RB == 4 && KVLM_AVX2_ROWS4) {
      score_block<T, 4, 2>(qrow, qrrow, kp + y0, krp + y0, Dkp, Drp, scale, sb, TILE);
      score_block<T, 4, 2>(qrow, qrrow, kp + y0 + 2, krp + y0 + 2, Dkp, Drp, scale, sb + 2, TILE);
    } else if (RB == 4)
      score_block<T, 4>(qrow, qrrow, kp + y0, krp + y0, Dkp, Drp, scale, sb, TILE);
    else if (RB == 2)
      score_block<T, 2>(qrow, qrrow, kp + y0, krp + y0, Dkp, Drp, scale, sb, TILE);
    else  // one row: 8 keys a block (8 FMA chains), the tile's 32 keys in 4
      score_block<T, 1, 8>(qrow, qrrow, kp + y0, krp + y0, Dkp, Drp, scale, sb, TILE);
  };
  const auto value_unit = [&](const T* s, const T* const* rows, int n, int u) {
    const int64_t r0 = (u / nc) * RB, d0 = (u % nc) * width, d1 = std::min<int64_t>(Dvp, d0 + width);
    const T* pb = s + r0 * TILE;
    T* ab = acc + r0 * Dvp;
    if (RB == 4)
      value_block<T, 4, KVLM_AVX2_ROWS4 ? 2 : 4>(pb, TILE, rows, n, d1, ab, Dvp, d0);
    else if (RB == 2) {
      if (spread) ahead.issue(per_block);
      value_block<T, 2>(pb, TILE, rows, n, d1, ab, Dvp, d0);
    } else
      value_block<T, 1, 8>(pb, TILE, rows, n, d1, ab, Dvp, d0);  // 8 FMA chains
  };

  int64_t page_i = j0 / J.P, row = j0 % J.P;
  int n_prev = 0;  // keys of the last tile, whose values are still to add (pipelined)
  for (int64_t t0 = j0, it = 0;; t0 += TILE, ++it) {
    const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(TILE, j1 - t0)));
    if (n == 0 && n_prev == 0) break;
    const int cur = pipe ? static_cast<int>(it & 1) : 0;
    T* s = reinterpret_cast<T*>(s_v.data()) + cur * Rb * TILE;
    const T* s_prev = reinterpret_cast<T*>(s_v.data()) + (1 - cur) * Rb * TILE;
    const T** vp = vp2[cur];
    const T* const* vrows = J.v_is_k ? kp : vp;  // the value rows: a latent's are its keys
    T* vbuf = v_direct ? nullptr : reinterpret_cast<T*>(vbuf_v.data()) + cur * TILE * Dvp;
    // the tile's rows page by page: a run of rows in one page steps by the pool's row stride (a pointer per row
    // from its page, group and row cost more instructions than MHA's dot products)
    for (int jj = 0; jj < n;) {
      const int64_t page = tab[page_i];
      const int run = static_cast<int>(std::min<int64_t>(n - jj, J.P - row));
      page_rows<T>(J.k, k_direct, page, g, row, run, k_direct ? nullptr : kbuf + jj * Dkp, Dkp, kp + jj);
      if (!J.v_is_k) {
        page_rows<T>(J.v, v_direct, page, g, row, run, v_direct ? nullptr : vbuf + jj * Dvp, Dvp, vp + jj);
        // not pipelined: the values into L1 while the tile's scores are computed: the value loop's first touch of
        // each row otherwise waits on L2 / memory (AVX2, kernel_micro: GQA-3 1.02-1.14x, MHA 1.00-1.04x)
#ifndef KVLM_NO_V_PREFETCH
        if (v_direct && !pipe) prefetch_rows(vp[jj], run, J.v.s_row, J.v.D);
#endif
      }
      if (J.Dr) page_rows<T>(J.kr, kr_direct, page, 0, row, run, kr_direct ? nullptr : krbuf + jj * Drp, Drp,
                            krp + jj);
      jj += run;
      row += run;
      if (row == J.P) {
        row = 0;
        ++page_i;
      }
    }
    for (int jj = n; jj < TILE; ++jj) kp[jj] = vp[jj] = krp[jj] = zero;  // past the range: zero keys, masked below
    if (n > 0 && spread) {
      list_tile(t0 + kSpreadTiles * TILE);
      const int64_t blocks = (TILE / std::max(1, kWideKeys<T>) + 1) * (Rb / 2);  // the tile's score and value blocks
      per_block = (ahead.total + blocks - 1) / blocks;
    } else if (n > 0) {
      // else the next tile's rows into L2 while this one is computed, those in later pages of the block table
      // only: the hardware's sequential prefetcher does not know the table, but it runs ahead within a page, where
      // prefetching too measured 0.95-0.97x (AVX2, pages of a whole sequence; pages of 16: 1.02-1.05x with it).
      // Pipelined, a share before each score unit (the values: into L1 a tile ahead below), else all now.
      const int nn = static_cast<int>(std::min<int64_t>(TILE, j1 - t0 - n));
      const int same_page = row > 0 ? static_cast<int>(std::min<int64_t>(nn, J.P - row)) : 0;  // hardware's stream
      ahead.clear();
#ifndef KVLM_NO_PREFETCH
      ahead.add_rows(J.k, tab, J.P, g, t0 + n + same_page, nn - same_page);
      if (!J.v_is_k && !(pipe && v_direct)) ahead.add_rows(J.v, tab, J.P, g, t0 + n + same_page, nn - same_page);
      if (J.Dr) ahead.add_rows(J.kr, tab, J.P, 0, t0 + n + same_page, nn - same_page);
#endif
      per_block = pipe ? (ahead.total + ns - 1) / ns : ahead.total;
      if (!pipe) ahead.issue(per_block);
    }
    // the tile's scores; pipelined, the last tile's values between them (their units spread evenly) and this
    // tile's value rows into L1 a share per score unit (read a whole tile later)
    const int nv_prev = pipe && n_prev ? nv : 0;
    int done = 0;
    if (n > 0 && k6 && RB == 2)  // AVX2, wide rows: blocks of 2 rows x 6 keys, keys outer so that 6 keys stay in L1
      for (int y0 = 0; y0 < TILE; y0 += KW)
        for (int64_t r0 = 0; r0 < Rb; r0 += 2) {
          const T* qx[2] = {q + r0 * Dkp, q + (r0 + 1) * Dkp};
          const T* qrx[2] = {qr + r0 * Drp, qr + (r0 + 1) * Drp};
          if (spread) ahead.issue(per_block);
          score_block<T, 2, KW>(qx, qrx, kp + y0, krp + y0, Dkp, Drp, scale, s + r0 * TILE + y0, TILE);
        }
    for (int i = 0; n > 0 && !(k6 && RB == 2) && i < ns; ++i) {
      score_unit(s, i);
      if (pipe) ahead.issue(per_block);
#ifndef KVLM_NO_V_PREFETCH
      if (pipe && v_direct) {  // the unit's share of rows: one span where they are adjacent in a page
        const int a = i * n / ns, e = (i + 1) * n / ns;
        if (e > a && vp[e - 1] == vp[a] + (e - 1 - a) * J.v.s_row)
          prefetch_rows(vp[a], e - a, J.v.s_row, J.v.D);
        else
          for (int jj = a; jj < e; ++jj) prefetch_rows(vp[jj], 1, J.v.s_row, J.v.D);
      }
#endif
      for (const int e = (2 * (i + 1) * nv_prev + ns) / (2 * ns); done < e; ++done)
        value_unit(s_prev, vp2[1 - cur], n_prev, done);
    }
    for (; done < nv_prev; ++done) value_unit(s_prev, vp2[1 - cur], n_prev, done);  // the last tile's, after the range
    n_prev = 0;
    if (n == 0) break;
    // online softmax per row, TILE scores as VT vectors: mask, tile max, rescale, probabilities in place
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
    if (pipe)
      n_prev = n;
    else
      for (int u = 0; u < nv; ++u) value_unit(s, vrows, n, u);
  }
}

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
  if (J.Dkp + J.Drp >= 256)
    attend_range_t<T, kWideTile<T>>(J, q, qr, b, g, j0, j1, lo, hi, m, l, acc);
  else
    attend_range_t<T, 32>(J, q, qr, b, g, j0, j1, lo, hi, m, l, acc);
}

}  // namespace kvlm_decode
