// AVX-512 micro-kernels of the CPU decode kernel (float32 queries; float32 / bf16 / int8 cache), included by
// decode_core.h, whose portable vector-extension code stays the path for float64 and for CPUs without AVX-512.
//
// One tile of TILE cached keys of one (sequence, group) against all R query rows of the group:
//   scores   S[R][TILE] = Q K^T by 16-score blocks (RB rows x KB keys, RB KB = 16): RB x KB accumulators over
//            the feature axis, every loaded key vector used by RB rows, then one tree of shuffles turns the 16
//            accumulators into one vector of 16 scores (not 16 horizontal sums);
//   softmax  online, per row, vectorised (only the tiles at a range's ends are masked);
//   values   O[R][Dv] += P[R][TILE] V[TILE][Dv] by RB rows x ZC vectors of O held in registers across the whole
//            tile (broadcast P, FMA with the V row).
// With fewer than kWidenRows rows (GQA / MHA: memory-bound) bf16 and int8 rows are widened in registers as they
// are loaded; an int8 row's per-token scale is folded into its scores (multiplied into the accumulators before
// the RoPE part) and into its P value, so the codes are used as they are. With more rows (MLA) each tile is
// widened once into a float tile, which costs fewer conversions than widening in every pass (measured: 3 %).
// For MLA the key and the value are the same latent row: a tile is read from memory once for both (it stays in
// L1 between the two passes). Later tiles' rows are prefetched (the hardware prefetcher does not follow the
// block table across pages; see kPrefetchTiles for how: spread over a tile's work, or in a burst).
// Build knobs, for measuring only: KVLM_NO_PREFETCH, KVLM_PREFETCH_TILES=n, KVLM_WIDEN_ROWS=n, KVLM_PF_HINT=hint,
// KVLM_NARROW_TILE=n (decode_core.h), KVLM_NO_AVX512 (the portable path).
#pragma once

#include <immintrin.h>

#ifndef KVLM_PF_HINT  // software prefetches into L1, or L2 (_MM_HINT_T1) where kvlm/kernels/cpu.py's build_flags
                      // finds an L1d under 48 KiB: the measurements are there
#define KVLM_PF_HINT _MM_HINT_T0
#endif

#include "decode_avx512_loads.h"  // Elem, load<DT>, tail_mask
#include "decode_avx512_math.h"   // tree16, in_register, exp_nonpos
#include "scratch.h"

namespace kvlm_decode {
namespace avx512 {

// Lane x KB + y = q_x . k_y (+ qr_x . kr_y), for RB rows of q and qr interleaved by vectors (the 16 features
// from d of row x at q + RB d + 16 x: one pointer for all rows, which leaves general registers for the loop;
// zero-padded to whole vectors; interleave_rows) and KB key rows k[y] (Dk elements of DT, scaled by ks[y] when
// ks is given) with RoPE rows kr[y] (Dr floats). pk: the next tile's KB key rows (and pkr their RoPE rows) to
// prefetch, or null; pl: the spread prefetch list (kPrefetchTiles), one line of it per step of 16 features when
// pls, advanced.
template <DType DT, int RB, int KB>
inline __m512 score16(const float* q, const float* qr, const char* const* k,
                      const char* const* kr, const float* ks, int64_t Dk, int64_t Dr, const char* const* pk,
                      const char* const* pkr, const char* const*& pl, int pls) {
  static_assert(RB * KB == 16, "a block is 16 scores");
  constexpr int ES = Elem<DT>::size;
  constexpr int64_t line = 64 / ES;  // elements per cache line: prefetch once per line
  const char* const* pf = pl;  // a local copy stays in a register (the reference would be stored every step)
  // GCC keeps the 16 accumulators in registers through all the loops below (scalar replacement of `a`) only if
  // every access has a constant index when that pass runs, hence the unroll pragmas on the loops over x, y and i;
  // without them GCC 12 kept `a` on the stack between the loops of score16 compiled alone (the RoPE and tail
  // loops read and wrote it there)
  __m512 a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  const int64_t Dk16 = Dk & ~int64_t(15);
  if constexpr (RB == 1) {  // one query row (MHA): each key row read whole, in memory order (measured on an AMD
                            // EPYC: MHA's kernel 1.11-1.13x faster than the feature-major order below)
    for (int i = 0; i < pls * (Dk16 / 16); ++i) _mm_prefetch(*pf++, KVLM_PF_HINT);
    for (int y = 0; y < KB; ++y) {  // the next tile's row y prefetched beside row y's loads (measured: 1.08-1.12x
                                    // faster than all 16 rows' lines issued at once, which fill the miss buffers)
      if (pk)
        for (int64_t d = 0; d < Dk16; d += line) _mm_prefetch(pk[y] + d * ES, KVLM_PF_HINT);
      for (int64_t d = 0; d < Dk16; d += 16) a[y] = _mm512_fmadd_ps(_mm512_load_ps(q + d), load<DT>(k[y] + d * ES), a[y]);
    }
  } else
#pragma GCC unroll 4  // loop overhead once per 4 steps: MLA with int8 / fp8 latents 1.13-1.15x faster (AMD EPYC)
  for (int64_t d = 0; d < Dk16; d += 16) {
    __m512 qv[RB];
    for (int x = 0; x < RB; ++x) qv[x] = _mm512_load_ps(q + RB * d + 16 * x);
    if (pls) _mm_prefetch(*pf++, KVLM_PF_HINT);
    if (pk && d % line == 0)
      for (int y = 0; y < KB; ++y) _mm_prefetch(pk[y] + d * ES, KVLM_PF_HINT);
    for (int y = 0; y < KB; ++y) {
      const __m512 kv = in_register(load<DT>(k[y] + d * ES));
      for (int x = 0; x < RB; ++x) a[x * KB + y] = _mm512_fmadd_ps(qv[x], kv, a[x * KB + y]);
    }
  }
  if (Dk16 < Dk) {
    const __mmask16 m = tail_mask(Dk);
#pragma GCC unroll 16
    for (int y = 0; y < KB; ++y) {
      const __m512 kv = load<DT>(k[y] + Dk16 * ES, m);
#pragma GCC unroll 16
      for (int x = 0; x < RB; ++x) a[x * KB + y] = _mm512_fmadd_ps(_mm512_load_ps(q + RB * Dk16 + 16 * x), kv, a[x * KB + y]);
    }
  }
  if (ks) {
#pragma GCC unroll 16
    for (int y = 0; y < KB; ++y) {
      const __m512 s = _mm512_set1_ps(ks[y]);
#pragma GCC unroll 16
      for (int x = 0; x < RB; ++x) a[x * KB + y] = _mm512_mul_ps(a[x * KB + y], s);
    }
  }
  for (int64_t d = 0; d < Dr; d += 16) {
    const __mmask16 m = d + 16 <= Dr ? static_cast<__mmask16>(0xFFFF) : tail_mask(Dr);
    if (pls) _mm_prefetch(*pf++, KVLM_PF_HINT);
    if (pkr)
      for (int y = 0; y < KB; ++y) _mm_prefetch(pkr[y] + 4 * d, KVLM_PF_HINT);
    __m512 qv[RB];
    for (int x = 0; x < RB; ++x) qv[x] = _mm512_load_ps(qr + RB * d + 16 * x);
#pragma GCC unroll 16
    for (int y = 0; y < KB; ++y) {
      const __m512 kv = _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(kr[y]) + d);
#pragma GCC unroll 16
      for (int x = 0; x < RB; ++x) a[x * KB + y] = _mm512_fmadd_ps(qv[x], kv, a[x * KB + y]);
    }
  }
  pl = pf;
  return tree16(a);
}

// acc[x][d0 + 16 z + i] += sum_{j < n} p[x][j] v_j[d0 + 16 z + i] for RB rows and ZC vectors (mask mk[z] on the
// loads: the tail of Dv reads as 0; FULL: no tail, plain loads), the RB x ZC accumulators in registers across
// the tile. pv: the next tile's value rows to prefetch (the same columns), or null; pl: the spread prefetch
// list, one line of it per key when pls.
template <DType DT, int RB, int ZC, bool FULL = false>
inline void value_block(const float* p, int ps, const char* const* v, int n, int64_t d0, const __mmask16* mk,
                        float* acc, int64_t as, const char* const* pv, const char* const*& pl, int pls) {
  constexpr int ES = Elem<DT>::size;
  const char* const* pf = pl;
  __m512 a[RB][ZC];
  for (int x = 0; x < RB; ++x)
    for (int z = 0; z < ZC; ++z) a[x][z] = _mm512_load_ps(acc + x * as + d0 + 16 * z);
  for (int j = 0; j < n; ++j) {
    __m512 vv[ZC];
    for (int z = 0; z < ZC; ++z)
      vv[z] = FULL ? load<DT>(v[j] + (d0 + 16 * z) * ES) : load<DT>(v[j] + (d0 + 16 * z) * ES, mk[z]);
    for (int i = 0; i < pls; ++i) _mm_prefetch(*pf++, KVLM_PF_HINT);
    if (pv)
      for (int off = 0; off < 16 * ZC * ES; off += 64) _mm_prefetch(pv[j] + d0 * ES + off, KVLM_PF_HINT);
    for (int x = 0; x < RB; ++x) {
      const __m512 px = _mm512_set1_ps(p[x * ps + j]);
      for (int z = 0; z < ZC; ++z) a[x][z] = _mm512_fmadd_ps(px, vv[z], a[x][z]);
    }
  }
  for (int x = 0; x < RB; ++x)
    for (int z = 0; z < ZC; ++z) _mm512_store_ps(acc + x * as + d0 + 16 * z, a[x][z]);
  pl = pf;
}

// Columns [16 z0, 16 (z0 + 4)) of Dv (fewer at the end; nv vectors in all, the last masked by `last`) for
// RB rows.
template <DType DT, int RB>
inline void values_chunk(const float* p, int ps, const char* const* v, int n, int64_t nv, __mmask16 last,
                         int64_t z0, float* acc, int64_t as, const char* const* pv, const char* const*& pl,
                         int pls) {
  const int left = static_cast<int>(std::min<int64_t>(4, nv - z0));
  __mmask16 mk[4];
  for (int z = 0; z < left; ++z) mk[z] = z0 + z == nv - 1 ? last : static_cast<__mmask16>(0xFFFF);
  if (left == 4 && mk[3] == 0xFFFF)  // whole vectors: plain loads (a masked load costs an extra uop on SKX)
    value_block<DT, RB, 4, true>(p, ps, v, n, 16 * z0, mk, acc, as, pv, pl, pls);
  else if (left == 4)
    value_block<DT, RB, 4>(p, ps, v, n, 16 * z0, mk, acc, as, pv, pl, pls);
  if (left == 3) value_block<DT, RB, 3>(p, ps, v, n, 16 * z0, mk, acc, as, pv, pl, pls);
  if (left == 2) value_block<DT, RB, 2>(p, ps, v, n, 16 * z0, mk, acc, as, pv, pl, pls);
  if (left == 1) value_block<DT, RB, 1>(p, ps, v, n, 16 * z0, mk, acc, as, pv, pl, pls);
}

#ifndef KVLM_WIDEN_ROWS
#define KVLM_WIDEN_ROWS 8
#endif
constexpr int64_t kWidenRows = KVLM_WIDEN_ROWS;  // rows from which bf16 / int8 tiles are widened (attend_range)

// Row pointers (and int8 scales) of the keys [t, t + n) of sequence `tab` in pool p, group g; the rest of the
// TILE slots point at `zero` (scale 0).
template <int TILE>
inline void tile_rows(const Pool& p, int es, const int32_t* tab, int64_t P, int64_t g, int64_t t, int n,
                      const char* zero, const char** rows, float* scales) {
  const char* base = static_cast<const char*>(p.data);
  const int64_t step = p.s_row * es;
  int j = 0;
  for (int64_t page_i = t / P, row = t % P; j < n; ++page_i, row = 0) {  // one block-table lookup per page
    const int64_t page = tab[page_i];
    const int run = static_cast<int>(std::min<int64_t>(n - j, P - row));
    const char* ptr = base + (page * p.s_page + g * p.s_group + row * p.s_row) * es;
    for (int i = 0; i < run; ++i, ptr += step) rows[j + i] = ptr;
    if (scales) {
      const float* sp = p.scale + page * p.sc_page + g * p.sc_group + row * p.sc_row;
      for (int i = 0; i < run; ++i) scales[j + i] = sp[i * p.sc_row];
    }
    j += run;
  }
  for (; j < TILE; ++j) {
    rows[j] = zero;
    if (scales) scales[j] = 0.0f;
  }
}

// Rows [0, n) of a tile of DT widened to floats (times their int8 scales) into dst (row stride Dp, the tail of
// D zero); out[j] points at row j, or at `zero` past n.
template <DType DT, int TILE>
inline void widen(const char* const* rows, const float* scales, int n, int64_t D, float* dst, int64_t Dp,
                  const char* zero, const char** out) {
  constexpr int ES = Elem<DT>::size;
  const int64_t D16 = D & ~int64_t(15);
  const __mmask16 tm = tail_mask(D);
  for (int j = 0; j < n; ++j) {
    float* o = dst + j * Dp;
    const __m512 sc = _mm512_set1_ps(scales ? scales[j] : 1.0f);
    for (int64_t d = 0; d < D16; d += 16) _mm512_store_ps(o + d, _mm512_mul_ps(load<DT>(rows[j] + d * ES), sc));
    if (D16 < D) _mm512_store_ps(o + D16, _mm512_mul_ps(load<DT>(rows[j] + D16 * ES, tm), sc));
    out[j] = reinterpret_cast<const char*>(o);
  }
  for (int j = n; j < TILE; ++j) out[j] = zero;
}

// Software prefetch of later tiles (the hardware prefetcher does not follow the block table across
// pages). With many rows (MLA: compute-heavy tiles) the lines of the tile kPrefetchTiles ahead are issued one
// per step of the micro-kernels' loops, spread over the whole tile, so memory streams while the FMAs run
// (measured, MLA fp32 at 4096 keys: 12-20 % faster than issuing them from the first row block, whose burst
// fills the line-fill buffers and leaves nothing in flight for the rest of the tile). With few rows (GQA / MHA:
// memory-bound, short tiles) and for widened bf16 / int8 tiles (a half / a quarter of the bytes) the next
// tile's rows are prefetched by the first row block beside its own loads (measured: the spread list costs GQA /
// MHA 15 % and MLA int8 5 %), and so with 32 rows or more (MLA with T = 4: 4x the FMAs per byte; measured: 3-9 %
// slower spread).
#ifndef KVLM_PREFETCH_TILES
#define KVLM_PREFETCH_TILES 2
#endif
constexpr int kPrefetchTiles = KVLM_PREFETCH_TILES;

// Rows [r0, r0 + RB) of q (R rows of width W, stride W, a multiple of 16) into dst + r0 W interleaved by
// vectors, as score16 reads them: the 16 values from d of row r0 + x at dst + r0 W + RB d + 16 x.
template <int RB>
inline void interleave_rows(const float* q, int64_t W, int64_t r0, float* dst) {
  for (int64_t d = 0; d < W; d += 16)
    for (int x = 0; x < RB; ++x)
      std::memcpy(dst + r0 * W + RB * d + 16 * x, q + (r0 + x) * W + d, 16 * sizeof(float));
}

// One work item, as kvlm_decode::attend_range_t: rows [0, R) of group g of sequence b against keys [j0, j1);
// the key and value pools both of DT (the RoPE pool float32).
//
// WIDEN: bf16 / int8 rows are first widened into a float tile (scales applied) that the micro-kernels then read
// as float32. Widening in registers costs two conversions per loaded vector in each of the 2 R / 4 passes over
// the tile (for MLA's 12 rows, 50 % more vector instructions than FMAs); widening once costs them once, so it
// is the choice for many rows (kWidenRows) and in-register loads the choice for few (GQA / MHA, memory-bound).
// Float32 tiles are copied so (a plain copy into rows of stride Dkp) from 4 kWidenRows rows on (MLA verifying
// T = 4 tokens: 48 rows), where they are otherwise read in place and the next tile prefetched in a burst:
// measured 1.04-1.05x faster there (kernel_micro.py mla-T4, 2 threads and 1), 0.96x at 24 rows, 0.81x at 12.
template <DType DT, int TILE, bool WIDEN, bool SPREAD>
void attend_range(const Job& J, const float* q, const float* qr, int64_t b, int64_t g, int64_t j0, int64_t j1,
                  const int64_t* lo, const int64_t* hi, float* m, float* l, float* acc) {
  constexpr int ES = Elem<DT>::size;
  constexpr DType LD = WIDEN ? DType::f32 : DT;  // what the micro-kernels read
  constexpr int NV = TILE / 16;  // score vectors per row of the tile
  const int64_t R = J.R, Dk = J.Dk, Dv = J.Dv, Dr = J.Dr, Dkp = J.Dkp, Dvp = J.Dvp, Drp = J.Drp;
  const bool quant = DT == DType::i8 || DT == DType::f8;  // codes with a per-token scale
  const bool latent = J.v_is_k;
  // scores / probabilities (R x TILE) and a zero row for the slots past the range, in the thread's scratch
  float* s = scratch_array<float>(0, R * TILE, false);  // written whole by the score blocks
  const char* zero = reinterpret_cast<const char*>(scratch_array<float>(1, std::max({Dkp, Dvp, Drp, int64_t(16)})));
  const char *kp[2][TILE], *vp[2][TILE], *krp[2][TILE];  // this tile's rows and the next one's
  float ks[2][TILE], vs[2][TILE];
  float* wk = WIDEN ? scratch_array<float>(2, TILE * Dkp, false) : nullptr;  // widen writes the rows it fills
  float* wv = WIDEN && !latent ? scratch_array<float>(3, TILE * Dvp, false) : nullptr;
  const char *wkp[TILE], *wvp[TILE];
  // q and qr by the row blocks of the score pass (4, then 2, then 1 rows), interleaved for score16
  float* qi = scratch_array<float>(4, R * Dkp, false);  // all written by interleave_rows
  float* qri = scratch_array<float>(5, std::max<int64_t>(R * Drp, 16), false);
  for (int64_t r0 = 0, rb; r0 < R; r0 += rb) {
    rb = R - r0 >= 4 ? 4 : R - r0 >= 2 ? 2 : 1;
    auto each = [&](auto tag) {
      interleave_rows<decltype(tag)::value>(q, Dkp, r0, qi);
      if (Drp) interleave_rows<decltype(tag)::value>(qr, Drp, r0, qri);
    };
    if (rb == 4) each(std::integral_constant<int, 4>());
    if (rb == 2) each(std::integral_constant<int, 2>());
    if (rb == 1) each(std::integral_constant<int, 1>());
  }
  const int32_t* tab = J.table + b * J.max_blocks;
  int64_t max_lo = j0, min_hi = j1 - 1;  // every row sees [max_lo, min_hi] of the range
  for (int64_t r = 0; r < R; ++r) {
    max_lo = std::max(max_lo, lo[r]);
    min_hi = std::min(min_hi, hi[r]);
  }
  // spread prefetch: the lines of the tile kPrefetchTiles ahead, one per step of the micro-kernels (a step: 16
  // FMAs) until the list is done; what the steps of a tile do not cover is issued at its end. One line a step, not
  // a count of them: the loop a count needs cost MLA's kernel 7 % (measured in cache, one thread)
  static_assert(!(SPREAD && WIDEN), "a widened tile is prefetched in a burst");
#ifdef KVLM_NO_PREFETCH
  constexpr bool spread = false;
#else
  constexpr bool spread = SPREAD;
#endif
  const int64_t row_lines = (Dk * ES + 63) / 64 + (latent ? 0 : (Dv * ES + 63) / 64) + (Dr * 4 + 63) / 64;
  const int64_t call_steps = std::max<int64_t>((Dk + 15) / 16 + (Dr + 15) / 16, TILE);  // at most, in one call
  const int64_t pl_n = spread ? TILE * row_lines + call_steps : 1;
  const char** pl_list = scratch_array<const char*>(6, pl_n, false);
  std::fill(pl_list, pl_list + pl_n, zero);
  const char* prow[TILE];
  auto list_lines = [&](int64_t t) {
    const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(TILE, j1 - t)));
    const char** o = pl_list;
    auto add = [&](int64_t bytes) {
      for (int j = 0; j < n; ++j)
        for (int64_t off = 0; off < bytes; off += 64) *o++ = prow[j] + off;
    };
    tile_rows<TILE>(J.k, ES, tab, J.P, g, t, n, zero, prow, nullptr);
    add(Dk * ES);
    if (!latent) {
      tile_rows<TILE>(J.v, ES, tab, J.P, g, t, n, zero, prow, nullptr);
      add(Dv * ES);
    }
    if (Dr) {
      tile_rows<TILE>(J.kr, 4, tab, J.P, 0, t, n, zero, prow, nullptr);
      add(Dr * 4);
    }
    return o;
  };
  const float ninf = -std::numeric_limits<float>::infinity();
  const __m512 vninf = _mm512_set1_ps(ninf);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const float scale = static_cast<float>(J.scale);
  const int64_t R4 = R / 4 * 4, nvv = (Dv + 15) / 16;
  const __mmask16 last_v = tail_mask(Dv);
  // the running sums as vectors (reduced at the end), the caller's l in lane 0
  __m512* lv = reinterpret_cast<__m512*>(scratch_array<float>(7, R * 16, false));
  for (int64_t r = 0; r < R; ++r) lv[r] = _mm512_set_ps(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, l[r]);
  for (int k = 1; spread && k < kPrefetchTiles; ++k) {  // the tiles before the first one prefetched in the loop
    for (const char* const *p = pl_list, *const* e = list_lines(j0 + k * TILE); p < e; ++p)
      _mm_prefetch(*p, KVLM_PF_HINT);
  }
  auto fill = [&](int c, int64_t t) {  // the rows of the tile at t into slot c (nothing past j1)
    const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(TILE, j1 - t)));
    tile_rows<TILE>(J.k, ES, tab, J.P, g, t, n, zero, kp[c], quant ? ks[c] : nullptr);
    if (!latent) tile_rows<TILE>(J.v, ES, tab, J.P, g, t, n, zero, vp[c], quant ? vs[c] : nullptr);
    if (Dr) tile_rows<TILE>(J.kr, 4, tab, J.P, 0, t, n, zero, krp[c], nullptr);
  };
  fill(0, j0);
  int cur = 0;
  for (int64_t t0 = j0; t0 < j1; t0 += TILE, cur ^= 1) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, j1 - t0));
    const bool more = t0 + TILE < j1;
    if (more) fill(cur ^ 1, t0 + TILE);
    bool burst = !spread && more;
#ifdef KVLM_NO_PREFETCH
    burst = false;
#endif
    const char* const* pl_end = spread ? list_lines(t0 + kPrefetchTiles * TILE) : pl_list;
    const char* const* pl = pl_list;
    const char* const* K = kp[cur];
    const char* const* Vr = latent ? kp[cur] : vp[cur];
    const char* const* KR = krp[cur];
    const float* kscale = quant ? ks[cur] : nullptr;
    const float* vscale = quant ? (latent ? ks[cur] : vs[cur]) : nullptr;
    if (WIDEN) {
      widen<DT, TILE>(K, kscale, n, Dk, wk, Dkp, zero, wkp);
      if (!latent) widen<DT, TILE>(Vr, vscale, n, Dv, wv, Dvp, zero, wvp);
      K = wkp;
      Vr = latent ? wkp : wvp;
      kscale = vscale = nullptr;
    }
    // scores: blocks of 4 rows x 4 keys, then the 2 or 3 rows left by 2 x 8 and 1 x 16; each row block runs
    // over the whole tile, which stays in L1 while the blocks take turns (measured: the other order, every
    // 4-key block used by all rows before the next, is 10 % slower for MLA's 12 rows)
    auto block = [&](auto rb_tag, int64_t r0, int y0) {
      constexpr int RB = decltype(rb_tag)::value, KB = 16 / RB;
      const bool first = r0 == 0 && burst;
      const __m512 sv = score16<LD, RB, KB>(qi + r0 * Dkp, qri + r0 * Drp, K + y0, KR + y0,
                                            kscale ? kscale + y0 : nullptr, Dk, Dr, first ? kp[cur ^ 1] + y0 : nullptr,
                                            first && Dr ? krp[cur ^ 1] + y0 : nullptr, pl, spread && pl < pl_end);
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, _mm512_mul_ps(sv, _mm512_set1_ps(scale)));
      for (int x = 0; x < RB; ++x) std::memcpy(s + (r0 + x) * TILE + y0, tmp + x * KB, KB * sizeof(float));
    };
    for (int64_t r0 = 0; r0 < R4; r0 += 4)
      for (int y0 = 0; y0 < TILE; y0 += 4) block(std::integral_constant<int, 4>(), r0, y0);
    if (R - R4 >= 2)
      for (int y0 = 0; y0 < TILE; y0 += 8) block(std::integral_constant<int, 2>(), R4, y0);
    if ((R - R4) % 2)
      for (int y0 = 0; y0 < TILE; y0 += 16) block(std::integral_constant<int, 1>(), R - 1, y0);
    // online softmax per row; only a tile at an end of some row's visible range is masked. The running max
    // moves rarely after the first tiles: a compare finds whether it does, and only then is the tile's max
    // reduced and the row's accumulators rescaled. The sums stay vectors (lv) until the end.
    const bool masked = t0 < max_lo || t0 + TILE - 1 > min_hi;
    __m512 vsc[NV];
    if (vscale)
      for (int u = 0; u < NV; ++u) vsc[u] = _mm512_loadu_ps(vscale + 16 * u);
    for (int64_t r = 0; r < R; ++r) {
      __m512 sr[NV];
      __mmask16 vis[NV];
      __m512 vm = _mm512_set1_ps(m[r]);
      __mmask16 up = 0;
      for (int u = 0; u < NV; ++u) {
        sr[u] = _mm512_load_ps(s + r * TILE + 16 * u);
        if (masked) {
          const __m512 idx = _mm512_add_ps(iota, _mm512_set1_ps(static_cast<float>(t0 + 16 * u)));
          const float h = static_cast<float>(std::min<int64_t>(hi[r], t0 + n - 1));
          vis[u] = _mm512_cmp_ps_mask(idx, _mm512_set1_ps(static_cast<float>(lo[r])), _CMP_GE_OQ) &
                   _mm512_cmp_ps_mask(idx, _mm512_set1_ps(h), _CMP_LE_OQ);
          sr[u] = _mm512_mask_blend_ps(vis[u], vninf, sr[u]);
        }
        up |= _mm512_cmp_ps_mask(sr[u], vm, _CMP_GT_OQ);
      }
      float* pr = s + r * TILE;
      if (up) {  // a new running max (the first visible keys included): rescale what the row has summed
        __m512 mx = sr[0];
        for (int u = 1; u < NV; ++u) mx = _mm512_max_ps(mx, sr[u]);
        const float mn = _mm512_reduce_max_ps(mx);
        const __m512 va = _mm512_set1_ps(std::exp(m[r] - mn));  // 0 on the first visible tile
        float* ar = acc + r * Dvp;
        for (int64_t d = 0; d < Dvp; d += 16) _mm512_store_ps(ar + d, _mm512_mul_ps(_mm512_load_ps(ar + d), va));
        lv[r] = _mm512_mul_ps(lv[r], va);
        m[r] = mn;
        vm = _mm512_set1_ps(mn);
      } else if (m[r] == ninf) {  // nothing visible yet
        for (int u = 0; u < NV; ++u) _mm512_store_ps(pr + 16 * u, _mm512_setzero_ps());
        continue;
      }
      __m512 sum = lv[r];
      for (int u = 0; u < NV; ++u) {
        __m512 p = exp_nonpos(_mm512_sub_ps(sr[u], vm));
        if (masked) p = _mm512_maskz_mov_ps(vis[u], p);
        sum = _mm512_add_ps(sum, p);
        _mm512_store_ps(pr + 16 * u, vscale ? _mm512_mul_ps(p, vsc[u]) : p);
      }
      lv[r] = sum;
    }
    // values: row blocks of 4, then 2, then 1, each over chunks of 4 vectors of Dv; in a burst, the next tile's
    // value rows prefetched by the first block (GQA / MHA; MLA's value is its key, prefetched already)
    int64_t r0 = 0;
    auto vrows = [&](auto rb_tag) {
      constexpr int RB = decltype(rb_tag)::value;
      for (int64_t z0 = 0; z0 < nvv; z0 += 4)
        values_chunk<LD, RB>(s + r0 * TILE, TILE, Vr, n, nvv, last_v, z0, acc + r0 * Dvp, Dvp,
                             r0 == 0 && burst && !latent ? vp[cur ^ 1] : nullptr, pl, spread && pl < pl_end);
      r0 += RB;
    };
    while (R - r0 >= 4) vrows(std::integral_constant<int, 4>());
    if (R - r0 >= 2) vrows(std::integral_constant<int, 2>());
    if (R - r0 >= 1) vrows(std::integral_constant<int, 1>());
    if constexpr (spread)
      while (pl < pl_end) _mm_prefetch(*pl++, KVLM_PF_HINT);  // lines the steps did not reach
  }
  for (int64_t r = 0; r < R; ++r) l[r] = _mm512_reduce_add_ps(lv[r]);
}

}  // namespace avx512
}  // namespace kvlm_decode
