// One pre-norm decoder block of MHA / GQA / MQA at decode (T new tokens a sequence), in one call (issue 15,
// "the rest of the step"): the step's weight products and attention are kernels already, but the ~20 small
// operators between them, and the Python around them, ran cold after each weight stream (2-13 MB a product)
// had pushed their code and data out of the caches: ~190 us a layer for GQA-3 at the bench reference shape,
// beside ~230 us of products. Here they are a few loops:
//
//   h = RMSNorm(x); [q k v] = h [W^Q; W^K; W^V]^T; q, k = RoPE(q), RoPE(k); the cache takes k, v at the new
//   token's slot; o = attention(q, cache); x1 = x + o W^O^T; h2 = RMSNorm(x1);
//   y = x1 + (SiLU(h2 W_1^T) * (h2 W_2^T)) W_O^T
//
// (kvlm.model.Block.forward, kvlm.attention.mha.MultiHeadAttention.forward and kvlm.model.SwiGLU.forward
// compute the same; kvlm.kernels.gqa_block_call checks what this takes). Included by decode.cpp inside its
// anonymous namespace, after decode_attention and rms_norm.

// Build knob for measuring only (benchmarks/step_sections.py): KVLM_SECTION_TIMES adds each part's wall time
// to section_seconds (by part, as listed below), read and cleared by the extension's section_times().
#ifdef KVLM_SECTION_TIMES
inline double section_seconds[10] = {0};
inline double section_clock() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
#define SECTION_START double section_t0 = section_clock();
#define SECTION(i)                                  \
  {                                                 \
    const double section_t1 = section_clock();      \
    section_seconds[i] += section_t1 - section_t0;  \
    section_t0 = section_t1;                        \
  }
#else
#define SECTION_START
#define SECTION(i)
#endif
// the parts: 0 norm + input product, 1 RoPE / latent norm / cache write, 2 W~^UK, 3 attention, 4 W~^UV,
// 5 W^O + residual, 6 norm + W_1, W_2, 7 SiLU gate, 8 W_O of the MLP, 9 residual

// The new tokens' K or V rows, (B, T, G, D) at row stride `rs` of `src` (row b T + t), into the pool
// (N, G, P, D): token t of sequence b at slot end_b - T + t, where the attention kernel reads its T new tokens
// (its block table). (A latent's pool (N, P, D) has no group axis: G = 1.)
inline void store_new_tokens(const float* src, int64_t rs, const at::Tensor& pool, const int32_t* table,
                             int64_t max_blocks, const int32_t* end, int64_t B, int64_t T, int64_t G, int64_t D) {
  const bool grouped = pool.dim() == 4;
  const int64_t P = pool.size(-2), s_row = pool.stride(-2), s_group = grouped ? pool.stride(1) : 0;
  float* dst = pool.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = end[b] - T + t, page = table[b * max_blocks + s / P];
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(dst + page * pool.stride(0) + g * s_group + (s % P) * s_row, src + (b * T + t) * rs + g * D,
                    D * sizeof(float));
    }
}

// The T new tokens' slots of each sequence must be pages of the pool: checked before anything is written.
inline void check_new_slots(const int32_t* table, int64_t max_blocks, const int32_t* end, int64_t B, int64_t T,
                            int64_t P, int64_t n_pages) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = end[b] - T; s < end[b]; ++s) {
      TORCH_CHECK(s >= 0 && s < max_blocks * P, "decode block: sequence ", b, "'s new slot ", s,
                  " is outside its table");
      const int64_t page = table[b * max_blocks + s / P];
      TORCH_CHECK(page >= 0 && page < n_pages, "decode block: sequence ", b, "'s page ", page, " is not a page");
    }
}

// [x W_1^T, ...] for the weights w, from their panels (few_rows_panels.h) where the caller packed them so (the
// product Linear runs first there), else from the plain weights
inline at::Tensor product(const at::Tensor& x, const std::vector<at::Tensor>& w, const c10::optional<at::Tensor>& panels) {
  if (panels.has_value() && panels->defined()) {
#if !KVLM_AVX512
    TORCH_CHECK(false, "decode block: panels are an AVX-512 layout (this build has none)");
#else
    int64_t N = 0;
    for (const auto& t : w) N += t.size(0);
    return few_rows::panel_linear(x, *panels, N, c10::nullopt);
#endif
  }
  return few_rows::linear(x, w, std::vector<c10::optional<at::Tensor>>(w.size()));
}

// What both blocks check of their call: x a contiguous float32 (B, T, d), the RoPE tables (B, 1, T, d_rope), the
// page table and ends of B sequences (returned as int32 tensors), and each new slot a page of the pool (N pages of
// P slots), before anything is written.
inline std::pair<at::Tensor, at::Tensor> check_block_call(const char* what, const at::Tensor& x, const at::Tensor& cos,
                                                          const at::Tensor& sin, int64_t d_rope,
                                                          const at::Tensor& block_table, const at::Tensor& end,
                                                          int64_t P, int64_t n_pages) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(), what,
              ": x must be a contiguous float32 (B, T, d) tensor (T new tokens a sequence)");
  const int64_t B = x.size(0), T = x.size(1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == B * T * d_rope && sin.numel() == B * T * d_rope,
              what, ": cos, sin must be contiguous float32 (B, 1, T, ", d_rope, ") whole-width tables");
  auto table = check_table(block_table, "block_table");
  auto en = check_table(end, "end");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == B && en.numel() == B, what, ": tables must have B rows");
  check_new_slots(table.data_ptr<int32_t>(), table.size(1), en.data_ptr<int32_t>(), B, T, P, n_pages);
  return {table, en};
}

// u = SiLU(a) * g over n floats, 16 at a time: SiLU(a) = a sigmoid(a), the sigmoid from e = exp(-|a|) (never
// overflows): 1 / (1 + e) for a >= 0, e / (1 + e) below. A scalar std::exp a element took ~58 us a layer at 8
// rows of the reference shape's 2048 (one core), ~0.35 ms of an 11 ms step at one cached token.
#if KVLM_AVX512
inline void silu_gate(const float* a, const float* g, float* u, int64_t n) {
  int64_t i = 0;
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 av = _mm512_maskz_loadu_ps(m, a + i), gv = _mm512_maskz_loadu_ps(m, g + i);
    const __m512 e = avx512::exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(av)));
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(av, _mm512_setzero_ps(), _CMP_GE_OQ), e,
                                            _mm512_set1_ps(1.0f));
    const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_mask_storeu_ps(u + i, m, _mm512_mul_ps(_mm512_mul_ps(av, sig), gv));
  }
}
#else  // AVX2: the same on the portable vectors (decode_core.h's vexp), the tail one by one
inline void silu_gate(const float* a, const float* g, float* u, int64_t n) {
  using V = Vec<float>::type;
  constexpr int L = Vec<float>::L;
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const V av = loadu(a + i), gv = loadu(g + i);
    const V e = vexp<float>(av < 0.0f ? av : -av);
    const V sig = (av >= 0.0f ? V{} + 1.0f : e) / (1.0f + e);
    const V out = av * sig * gv;
    std::memcpy(u + i, &out, sizeof(V));
  }
  for (; i < n; ++i) {
    const float e = std::exp(-std::fabs(a[i]));
    u[i] = a[i] * ((a[i] >= 0.0f ? 1.0f : e) / (1.0f + e)) * g[i];
  }
}
#endif


// x1 + (SiLU(h W_1^T) * (h W_2^T)) W_O^T with h = RMSNorm(x1): the SwiGLU half of a block (kvlm.model.SwiGLU)
inline at::Tensor swiglu_residual(const at::Tensor& x1, const at::Tensor& mlp_norm, double eps,
                                  const std::vector<at::Tensor>& w_up, const at::Tensor& w_down,
                                  const c10::optional<at::Tensor>& up_panels,
                                  const c10::optional<at::Tensor>& down_panels) {
  const int64_t rows = x1.size(0) * x1.size(1), F = w_up[0].size(0);
  TORCH_CHECK(w_up[1].size(0) == F, "decode block: W_1 and W_2 must have as many rows");
  SECTION_START
  auto up = product(rms_norm(x1, mlp_norm, eps), w_up, up_panels);  // (B, T, 2F): [h W_1^T, h W_2^T]
  SECTION(6)
  auto u = at::empty({x1.size(0), x1.size(1), F}, x1.options());
  const float* upp = up.data_ptr<float>();
  float* uptr = u.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) silu_gate(upp + r * 2 * F, upp + r * 2 * F + F, uptr + r * F, F);
  SECTION(7)
  auto y = product(u, {w_down}, down_panels);
  SECTION(8)
  float* yp = y.data_ptr<float>();
  const float* x1p = x1.data_ptr<float>();
  for (int64_t i = 0; i < x1.numel(); ++i) yp[i] += x1p[i];
  SECTION(9)
  return y;
}

// x + a, in a's storage
inline at::Tensor add_residual(at::Tensor a, const at::Tensor& x) {
  float* ap = a.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) ap[i] += xp[i];
  return a;
}

// RoPE of `heads` rows of D, `stride` apart, in place (Llama's half split): x [cos, cos] + roll(x, D / 2)
// [-sin, sin], as kvlm.attention.rope.apply_rope's short form computes it (the same two products, then their sum)
inline void rope_rows(float* x, int64_t heads, int64_t stride, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* r = x + h * stride;
    float rolled[512];
    for (int64_t i = 0; i < D; ++i) rolled[i] = r[(i + half) % D];
    for (int64_t i = 0; i < D; ++i) {
      const float a = r[i] * cos[i], b = rolled[i] * sin[i];
      r[i] = a + b;
    }
  }
}

at::Tensor gqa_block(const at::Tensor& x, const at::Tensor& attn_norm, const at::Tensor& mlp_norm, double eps,
                     const std::vector<at::Tensor>& w_qkv, const at::Tensor& w_o, const std::vector<at::Tensor>& w_up,
                     const at::Tensor& w_down, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                     const at::Tensor& v_pool, const at::Tensor& block_table, const at::Tensor& start,
                     const at::Tensor& end, int64_t n_head, double scale, int64_t n_split,
                     const std::vector<c10::optional<at::Tensor>>& panels) {
  TORCH_CHECK(w_qkv.size() == 3 && w_up.size() == 2 && panels.size() == 4,
              "gqa_block: [W^Q, W^K, W^V], [W_1, W_2] and the panels (or None) of its 4 products");
  const int64_t B = x.size(0), T = x.size(1), G = k_pool.size(1), D = k_pool.size(3), H = n_head, R = H / G;
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat && k_pool.dim() == 4 &&
                  v_pool.sizes() == k_pool.sizes() && k_pool.stride(3) == 1 && v_pool.stride(3) == 1,
              "gqa_block: K and V pools must be float32 (N, G, P, D) of one shape, contiguous in D");
  TORCH_CHECK(H % G == 0 && D % 2 == 0 && D <= 512 && w_qkv[0].size(0) == H * D && w_qkv[1].size(0) == G * D &&
                  w_qkv[2].size(0) == G * D,
              "gqa_block: W^Q, W^K, W^V must have ", H, " and ", G, " heads of ", D, " rows");
  const int64_t P = k_pool.size(2);
  const auto [table, en] = check_block_call("gqa_block", x, cos, sin, D, block_table, end, P, k_pool.size(0));
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* ep = en.data_ptr<int32_t>();
  const int64_t max_blocks = table.size(1);
  const int64_t row = (H + 2 * G) * D;

  SECTION_START
  auto qkv = product(rms_norm(x, attn_norm, eps), w_qkv, panels[0]);  // (B, T, (H + 2G) D)
  SECTION(0)
  float* qkvp = qkv.data_ptr<float>();
  for (int64_t r = 0; r < B * T; ++r) rope_rows(qkvp + r * row, H + G, D, D, cos.data_ptr<float>() + r * D,
                                                sin.data_ptr<float>() + r * D);  // q's heads and k's, adjacent
  store_new_tokens(qkvp + H * D, row, k_pool, tp, max_blocks, ep, B, T, G, D);
  store_new_tokens(qkvp + (H + G) * D, row, v_pool, tp, max_blocks, ep, B, T, G, D);
  SECTION(1)

  // queries (B, G, R T, D), a group's rows head by head, each head's T tokens in order (kvlm.kernels.gqa_decode):
  // at one token a view of the product's rows (the kernel copies its rows in any stride), else a small copy
  auto q = qkv.view({B, T, H + 2 * G, D}).narrow(2, 0, H).view({B, T, G, R, D}).permute({0, 2, 3, 1, 4});
  auto o = decode_attention(q.reshape({B, G, R * T, D}), c10::nullopt, k_pool, c10::nullopt, v_pool, c10::nullopt,
                            c10::nullopt, table, start, en, P, T, scale, n_split);  // (B, G, R T, D)
  SECTION(3)
  auto o_rows = o.view({B, G, R, T, D}).permute({0, 3, 1, 2, 4}).reshape({B, T, H * D});  // heads in order
  auto x1 = add_residual(product(o_rows, {w_o}, panels[1]), x);
  SECTION(5)
  return swiglu_residual(x1, mlp_norm, eps, w_up, w_down, panels[2], panels[3]);
}

// The same for MLA's absorbed route (mlra.md Sec. 2.1; kvlm.attention.mla.MLA.forward_absorbed): q = h W^Q^T
// and [c, k_R] = h W^DKV^T as one product; q^R, k^R RoPE'd; c_kv = alpha RMSNorm(c) (Eq. 41); the cache takes
// c_kv and k^R; q~ = q^C W~^UK per head; z = attention in latent space; o = z W~^UV per head; then W^O, the
// residual and the SwiGLU half as above. kv_norm (d_c,) or undefined (no latent norm).
at::Tensor mla_block(const at::Tensor& x, const at::Tensor& attn_norm, const at::Tensor& mlp_norm, double eps,
                     const at::Tensor& w_q, const at::Tensor& w_kv_a, const c10::optional<at::Tensor>& kv_norm,
                     double kv_eps, double alpha_kv, const at::Tensor& w_uk, const at::Tensor& w_uv,
                     const at::Tensor& w_o, const std::vector<at::Tensor>& w_up, const at::Tensor& w_down,
                     const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& ckv_pool, const at::Tensor& kr_pool,
                     const at::Tensor& block_table, const at::Tensor& start, const at::Tensor& end, double scale,
                     int64_t n_split, const std::vector<c10::optional<at::Tensor>>& panels) {
  const int64_t B = x.size(0), T = x.size(1), BT = B * T;
  const int64_t H = w_uk.size(0), dh = w_uk.size(1), dc = w_uk.size(2), dr = kr_pool.size(-1);
  TORCH_CHECK(w_uv.dim() == 3 && w_uv.size(0) == H && w_uv.size(1) == dc && w_uv.size(2) == dh,
              "mla_block: W~^UK (h, d_h, d_c) and W~^UV (h, d_c, d_h)");
  TORCH_CHECK(panels.size() == 5, "mla_block: the panels (or None) of its 5 products");
  TORCH_CHECK(w_q.size(0) == H * (dh + dr) && w_kv_a.size(0) == dc + dr && dr % 2 == 0 && dr <= 512,
              "mla_block: W^Q must have h (d_h + d_R) rows and W^DKV d_c + d_R");
  TORCH_CHECK(ckv_pool.dim() == 3 && kr_pool.dim() == 3 && ckv_pool.size(-1) == dc &&
                  ckv_pool.scalar_type() == at::kFloat && kr_pool.scalar_type() == at::kFloat &&
                  ckv_pool.size(1) == kr_pool.size(1) && ckv_pool.size(0) == kr_pool.size(0) &&
                  ckv_pool.stride(2) == 1 && kr_pool.stride(2) == 1,
              "mla_block: c_kv and k_rope pools must be float32 (N, P, d_c) and (N, P, d_R) on one page table");
  const bool has_norm = kv_norm.has_value() && kv_norm->defined();
  TORCH_CHECK(!has_norm || (kv_norm->numel() == dc && kv_norm->scalar_type() == at::kFloat && kv_norm->is_contiguous()),
              "mla_block: kv_norm must be a float32 vector of d_c");
  const int64_t P = ckv_pool.size(1);
  const auto [table, en] = check_block_call("mla_block", x, cos, sin, dr, block_table, end, P, ckv_pool.size(0));
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* ep = en.data_ptr<int32_t>();
  const int64_t max_blocks = table.size(1);
  const int64_t qw = H * (dh + dr), row = qw + dc + dr;

  // (B, T, h (d_h + d_R) + d_c + d_R): W^Q and W^DKV as one product on the plain weights, else one each
  SECTION_START
  const auto h = rms_norm(x, attn_norm, eps);
  const bool plain = !(panels[0].has_value() && panels[0]->defined()) && !(panels[1].has_value() && panels[1]->defined());
  auto qkv = plain ? product(h, {w_q, w_kv_a}, c10::nullopt)
                   : at::cat({product(h, {w_q}, panels[0]), product(h, {w_kv_a}, panels[1])}, -1);
  SECTION(0)
  float* p = qkv.data_ptr<float>();
  auto c_kv = at::empty({BT, dc}, x.options());
  float* cp = c_kv.data_ptr<float>();
  const float alpha = static_cast<float>(alpha_kv);
  for (int64_t b = 0; b < BT; ++b) {  // each new token's row
    float* r = p + b * row;
    const float* cb = cos.data_ptr<float>() + b * dr;
    const float* sb = sin.data_ptr<float>() + b * dr;
    rope_rows(r + dh, H, dh + dr, dr, cb, sb);  // q^R of every head
    rope_rows(r + qw + dc, 1, dr, dr, cb, sb);  // k^R
    if (has_norm)
      rms_norm_rows<float>(r + qw, kv_norm->data_ptr<float>(), cp + b * dc, 1, dc, kv_eps);
    else
      std::memcpy(cp + b * dc, r + qw, dc * sizeof(float));
    if (alpha != 1.0f)
      for (int64_t i = 0; i < dc; ++i) cp[b * dc + i] *= alpha;
  }
  store_new_tokens(cp, dc, ckv_pool, tp, max_blocks, ep, B, T, 1, dc);
  store_new_tokens(p + qw + dc, row, kr_pool, tp, max_blocks, ep, B, T, 1, dr);
  SECTION(1)

  // the attention's rows (B, 1, h T, .): head by head, each head's T tokens in order (kvlm.kernels.latent_decode);
  // at one token views, else small copies
  auto q = qkv.view({BT, row}).narrow(1, 0, qw).view({BT, H, dh + dr});
  auto q_lat = few_rows::head_products(q.narrow(2, 0, dh).transpose(0, 1), w_uk);  // (B T, h, d_c)
  SECTION(2)
  auto heads_first = [&](const at::Tensor& t) {  // (B T, h, w) -> (B, 1, h T, w)
    return t.view({B, T, H, t.size(-1)}).transpose(1, 2).reshape({B, 1, H * T, t.size(-1)});
  };
  auto pool = ckv_pool.unsqueeze(1);
  auto z = decode_attention(heads_first(q_lat), heads_first(q.narrow(2, dh, dr)), pool, c10::nullopt, pool,
                            c10::nullopt, kr_pool, table, start, en, P, T, scale, n_split);  // (B, 1, h T, d_c)
  SECTION(3)
  auto z_heads = z.view({B, H, T, dc}).transpose(0, 1).reshape({H, BT, dc});  // (h, B T, d_c)
  auto o = few_rows::head_products(z_heads, w_uv);  // (B T, h, d_h)
  SECTION(4)
  auto x1 = add_residual(product(o.view({B, T, H * dh}), {w_o}, panels[2]), x);
  SECTION(5)
  return swiglu_residual(x1, mlp_norm, eps, w_up, w_down, panels[3], panels[4]);
}
