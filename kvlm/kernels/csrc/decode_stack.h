// A model's decoder blocks at decode (T new tokens a sequence) in one call (kvlm.kernels.block_stack): the
// blocks of decode_block.h one after another, their weights held here from when the stack is built, so that a
// step crosses from Python once for all its layers. Run module by module or block by block, each layer costs a
// decode step Python between the kernels: ~60-105 us a layer at the bench reference shape, the interpreter's
// code and objects cold after each weight stream; a loop here instead left the step 0.6-1.3 ms faster (6
// layers, batch 1 and 8, benchmarks/decode-limit.md). Included by decode.cpp after decode_block.h.

struct BlockStack {
  struct Layer {
    bool mla = false;
    at::Tensor attn_norm, mlp_norm;
    double eps = 0;
    std::vector<at::Tensor> w_in;  // [W^Q, W^K, W^V] (GQA), or [W^Q, W^DKV] (MLA)
    c10::optional<at::Tensor> kv_norm;
    double kv_eps = 0, alpha = 1;
    at::Tensor w_uk, w_uv, w_o;
    std::vector<at::Tensor> w_up;
    at::Tensor w_down;
    int64_t n_head = 0;
    double scale = 1;
    std::vector<c10::optional<at::Tensor>> panels;
  };
  std::vector<Layer> layers;

  void add_gqa(const at::Tensor& attn_norm, const at::Tensor& mlp_norm, double eps, const std::vector<at::Tensor>& w_qkv,
               const at::Tensor& w_o, const std::vector<at::Tensor>& w_up, const at::Tensor& w_down, int64_t n_head,
               double scale, const std::vector<c10::optional<at::Tensor>>& panels) {
    Layer l;
    l.attn_norm = attn_norm, l.mlp_norm = mlp_norm, l.eps = eps, l.w_in = w_qkv, l.w_o = w_o, l.w_up = w_up;
    l.w_down = w_down, l.n_head = n_head, l.scale = scale, l.panels = panels;
    layers.push_back(std::move(l));
  }

  void add_mla(const at::Tensor& attn_norm, const at::Tensor& mlp_norm, double eps, const at::Tensor& w_q,
               const at::Tensor& w_kv_a, const c10::optional<at::Tensor>& kv_norm, double kv_eps, double alpha,
               const at::Tensor& w_uk, const at::Tensor& w_uv, const at::Tensor& w_o, const std::vector<at::Tensor>& w_up,
               const at::Tensor& w_down, double scale, const std::vector<c10::optional<at::Tensor>>& panels) {
    Layer l;
    l.mla = true, l.attn_norm = attn_norm, l.mlp_norm = mlp_norm, l.eps = eps, l.w_in = {w_q, w_kv_a};
    l.kv_norm = kv_norm, l.kv_eps = kv_eps, l.alpha = alpha, l.w_uk = w_uk, l.w_uv = w_uv, l.w_o = w_o;
    l.w_up = w_up, l.w_down = w_down, l.scale = scale, l.panels = panels;
    layers.push_back(std::move(l));
  }

  // x (B, T, d) through every layer: layer i reads and writes pools a[i], b[i] (K and V, or c_kv and k_rope) on
  // one page table; all layers share the RoPE tables and the key axis's split. Each block checks its call
  // before it writes anything, so a bad layer stops the stack there (the layers before it have written their
  // new token's slot, which the step's retry overwrites).
  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& a,
                 const std::vector<at::Tensor>& b, const at::Tensor& block_table, const at::Tensor& start,
                 const at::Tensor& end, int64_t n_split) const {
    TORCH_CHECK(a.size() == layers.size() && b.size() == layers.size(), "block stack: ", layers.size(),
                " layers take as many pools, got ", a.size(), " and ", b.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      x = l.mla ? mla_block(x, l.attn_norm, l.mlp_norm, l.eps, l.w_in[0], l.w_in[1], l.kv_norm, l.kv_eps, l.alpha,
                            l.w_uk, l.w_uv, l.w_o, l.w_up, l.w_down, cos, sin, a[i], b[i], block_table, start, end,
                            l.scale, n_split, l.panels)
                : gqa_block(x, l.attn_norm, l.mlp_norm, l.eps, l.w_in, l.w_o, l.w_up, l.w_down, cos, sin, a[i], b[i],
                            block_table, start, end, l.n_head, l.scale, n_split, l.panels);
    }
    return x;
  }
};
