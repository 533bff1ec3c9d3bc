// Narrow rows pipelined (decode_core.h's attend_range takes it for groups of 2 or more rows with values of their
// own: GQA, MQA, MHA's new tokens): the values of tile t - 1 are computed between the score blocks of tile t, and
// tile t's value rows prefetched into L1 a share per score block, so that memory streams K and V through the whole
// tile. attend_range_t computes a tile's scores, softmax and values in turn, which left memory idle through the
// softmax and the values' burst: on one Zen 3 core GQA-3 read 10 GB/s from memory where a plain read of the same
// bytes reads 18 and the kernel in cache 19 (work and memory took turns; benchmarks/csrc/narrow_heads.cpp).
// kernel_micro.py against attend_range_t: GQA-3 1.21-1.27x; one row a group (MHA at one token, ~10 FMAs a line)
// measured 0.90-0.92x, so it stays there. Included by decode_core.h inside namespace kvlm_decode.

template <typename T, int TILE>
void attend_pipe_t(const Job& J, const T* q, const T* qr, int64_t b, int64_t g, int64_t j0, int64_t j1,
                   const int64_t* lo, const int64_t* hi, T* m, T* l, T* acc) {
  constexpr int L = Vec<T>::L;
  const int64_t R = J.R, Dkp = J.Dkp, Dvp = J.Dvp, Drp = J.Drp;
  constexpr int RB4 = kMaxRowBlock >= 4 || KVLM_AVX2_ROWS4 ? 4 : 2;
  const int RB = R >= 4 ? RB4 : 2;              // R >= 2 here
  const int64_t Rb = (R + RB - 1) / RB * RB;  // rows rounded to the row block (extra rows are zero queries)
  const bool k_direct = in_place<T>(J.k), v_direct = in_place<T>(J.v), kr_direct = J.Dr && in_place<T>(J.kr);
  // in this thread's scratch (as attend_range_t's): two tiles' scores, zero keys past the range, buffers for rows
  // widened from another dtype (none for rows read in place; the values' two tiles)
  T* s2 = scratch_array<T>(0, 2 * Rb * TILE);
  const T* zero = scratch_array<T>(1, std::max({Dkp, Dvp, Drp}) + L);
  T* kbuf = k_direct ? nullptr : scratch_array<T>(2, TILE * Dkp + L);
  T* vbuf2 = v_direct ? nullptr : scratch_array<T>(3, 2 * TILE * Dvp + L);
  T* krbuf = kr_direct ? nullptr : scratch_array<T>(4, TILE * Drp + L);
  const T* kp[TILE];
  const T* vp2[2][TILE];  // two tiles' value rows: the last tile's are read during this one
  const T* krp[TILE];
  const int32_t* tab = J.table + b * J.max_blocks;
  const T scale = static_cast<T>(J.scale);
  LineSpans ahead;  // the next tile's rows in later pages, a share prefetched before each score unit

  // A tile's work in units: score units a row block x 4 keys; value units a row block x the chunk of columns its
  // value_block holds in registers. The last tile's value units run spread evenly between this tile's score units.
  const int n_blocks = static_cast<int>(Rb / RB), ns = n_blocks * (TILE / 4);
  constexpr int ZW4 = KVLM_AVX2_ROWS4 ? 2 : 4;  // value vectors a 4-row block holds (value_block's ZW); 2 rows: 4
  const int64_t width = (RB == 4 ? ZW4 : 4) * L;
  const int nc = static_cast<int>((Dvp + width - 1) / width), nv = n_blocks * nc;
  const auto score_unit = [&](T* s, int i) {
    const int64_t r0 = (i / (TILE / 4)) * RB;
    const int y0 = (i % (TILE / 4)) * 4;
    const T* qrow[4];
    const T* qrrow[4];
    for (int x = 0; x < RB; ++x) {
      qrow[x] = q + (r0 + x) * Dkp;
      qrrow[x] = qr + (r0 + x) * Drp;
    }
    T* sb = s + r0 * TILE + y0;
    if (RB == 4 && KVLM_AVX2_ROWS4) {  // 4 x 2 blocks: 8 accumulators beside 4 queries and 2 keys (AVX2)
      score_block<T, 4, 2>(qrow, qrrow, kp + y0, krp + y0, Dkp, Drp, scale, sb, TILE);
      score_block<T, 4, 2>(qrow, qrrow, kp + y0 + 2, krp + y0 + 2, Dkp, Drp, scale, sb + 2, TILE);
    } else if (RB == 4)
      score_block<T, 4>(qrow, qrrow, kp + y0, krp + y0, Dkp, Drp, scale, sb, TILE);
    else
      score_block<T, 2>(qrow, qrrow, kp + y0, krp + y0, Dkp, Drp, scale, sb, TILE);
  };
  const auto value_unit = [&](const T* s, const T* const* rows, int n, int u) {
    const int64_t r0 = (u / nc) * RB, d0 = (u % nc) * width, d1 = std::min<int64_t>(Dvp, d0 + width);
    if (RB == 4)
      value_block<T, 4, ZW4>(s + r0 * TILE, TILE, rows, n, d1, acc + r0 * Dvp, Dvp, d0);
    else
      value_block<T, 2>(s + r0 * TILE, TILE, rows, n, d1, acc + r0 * Dvp, Dvp, d0);
  };

  int64_t page_i = j0 / J.P, row = j0 % J.P;
  int n_prev = 0;  // keys of the last tile, whose values are still to add
  for (int64_t t0 = j0, it = 0;; t0 += TILE, ++it) {
    const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(TILE, j1 - t0)));
    if (n == 0 && n_prev == 0) break;
    const int cur = static_cast<int>(it & 1);
    T* s = s2 + cur * Rb * TILE;
    const T* s_prev = s2 + (1 - cur) * Rb * TILE;
    const T** vp = vp2[cur];
    T* vbuf = v_direct ? nullptr : vbuf2 + cur * TILE * Dvp;
    page_runs(tab, J.P, n, page_i, row, [&](int64_t page, int64_t in_page, int run, int jj) {  // the tile's rows
      page_rows<T>(J.k, k_direct, page, g, in_page, run, k_direct ? nullptr : kbuf + jj * Dkp, Dkp, kp + jj);
      page_rows<T>(J.v, v_direct, page, g, in_page, run, v_direct ? nullptr : vbuf + jj * Dvp, Dvp, vp + jj);
      if (J.Dr)
        page_rows<T>(J.kr, kr_direct, page, 0, in_page, run, kr_direct ? nullptr : krbuf + jj * Drp, Drp, krp + jj);
    });
    for (int jj = n; jj < TILE; ++jj) kp[jj] = vp[jj] = krp[jj] = zero;  // past the range: zero keys, masked below
    // the next tile's rows in later pages of the block table (within a page the hardware's prefetcher is ahead);
    // its values read in place come into L1 during their own tile, below
    ahead.clear();
    if (n > 0) {
      const int64_t nn = std::min<int64_t>(TILE, j1 - t0 - n);
      const int64_t same_page = row > 0 ? std::min<int64_t>(nn, J.P - row) : 0;
#ifndef KVLM_NO_PREFETCH
      ahead.add_rows(J.k, tab, J.P, g, t0 + n + same_page, nn - same_page);
      if (!v_direct) ahead.add_rows(J.v, tab, J.P, g, t0 + n + same_page, nn - same_page);
      if (J.Dr) ahead.add_rows(J.kr, tab, J.P, 0, t0 + n + same_page, nn - same_page);
#endif
    }
    const int64_t per_unit = (ahead.total + ns - 1) / ns;
    const int nv_prev = n_prev ? nv : 0;
    int done = 0;
    for (int i = 0; n > 0 && i < ns; ++i) {
      score_unit(s, i);
      ahead.issue(per_unit);
#ifndef KVLM_NO_V_PREFETCH
      if (v_direct) {  // the unit's share of this tile's value rows: one span where they are adjacent in a page
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
    if (n == 0) break;
    tile_softmax<T, TILE>(s, R, Rb, t0, n, lo, hi, m, l, acc, Dvp);
    n_prev = n;
  }
}
