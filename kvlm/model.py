"""The decoder: token embedding, n_layer blocks around any registered attention, LM head.

Two block styles: "llama" (pre-RMSNorm, SwiGLU FFN, RoPE inside attention; mlra.md Appendix D) and
"gpt2" (pre-LayerNorm, GELU FFN, learned absolute positions; the nanoGPT base of eg-mla.md and
mla-small-lm.md). Parameter and KV accounting live here too, computed from modules that exist
(on the meta device when only counting), never from a table typed by hand.

Use: ``model(tokens)`` is the full causal forward (training); ``model.new_cache(B)`` then
``model(tokens, cache=cache)`` prefills or decodes, appending to the cache. After loading or training and
before decoding, call ``model.prepare_for_inference()`` once: each attention builds its derived weights from
the current parameters (the MLA family's absorbed matrices, EG-MLA's gate tables) instead of checking on every
step whether they are stale. Call it again after changing the weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvlm.attention import Attention, GateEmbedding, Step, get_attention_class
from kvlm.attention.base import GroupPacking, Linear, hooked
from kvlm.attention.linear import library_packed
from kvlm.attention.norm import RMSNorm
from kvlm.attention.watch import Watched
from kvlm.cache import CacheError, KVCache
from kvlm.config import ModelConfig
from kvlm.decode_plans import block_rows, decode_stack, kept_plan
from kvlm.hugepages import move_to_huge_pages_


class Dropout(nn.Dropout):
    """nn.Dropout that returns its input untouched when it drops nothing (eval, or p = 0): aten's dropout still
    dispatches three operators then, 39 per decode step of a 6-layer model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, True, self.inplace) if self.training and self.p > 0 else x


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.arch == "gpt2":
        return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)
    return RMSNorm(dim, cfg.norm_eps)


class SwiGLU(GroupPacking):
    """O = (SiLU(H W1) * (H W2)) W_O (mlra.md Appendix D). At decode with packed weights (``pack_for_decode``)
    W1 and W2 run as one GEMM [W1; W2] (``GroupPacking``): one weight stream and one call instead of two."""

    column_parallel = ("w1", "w2")  # split by output rows under tensor parallelism (Megatron); W_O by input
    packed_groups = (("w1", "w2"),)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.w2 = Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.wo = Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        self.dropout = Dropout(cfg.dropout)

    def output_projections(self) -> list[nn.Linear]:
        """W_O, which writes into the residual stream (initialised as the attention's W_O)."""
        return [self.wo]

    def forward(self, x):
        gate_up = self.group_outputs(("w1", "w2"), x)
        a, b = gate_up if gate_up is not None else (self.w1(x), self.w2(x))
        return self.dropout(self.wo(F.silu(a) * b))


class GeluMLP(nn.Module):
    column_parallel = ("w1",)  # as SwiGLU's

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.wo = Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        self.dropout = Dropout(cfg.dropout)

    def output_projections(self) -> list[nn.Linear]:
        return [self.wo]

    def forward(self, x):
        return self.dropout(self.wo(F.gelu(self.w1(x), approximate="tanh")))


class Block(Watched, nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.d_model)
        self.attn = get_attention_class(cfg.attention)(cfg, layer_idx)
        self.mlp_norm = make_norm(cfg, cfg.d_model)
        self.mlp = GeluMLP(cfg) if cfg.arch == "gpt2" else SwiGLU(cfg)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x, step: Step, cache=None):
        y = self.one_call(x, step, cache) if cache is not None else None
        if y is not None:
            return y
        x = x + self.dropout(self.attn(self.attn_norm(x), step, cache))
        return x + self.mlp(self.mlp_norm(x))

    def one_call(self, x: torch.Tensor, step: Step, cache) -> torch.Tensor | None:
        """The block as one kernel call at decode (``Attention.decode_block_plan``: a few new tokens a sequence, up
        to ``MAX_ROWS`` rows, inference: ``block_rows``), or None where it does not apply (the modules then run one
        by one)."""
        if not block_rows(self, x):
            return None
        plan = self.kept_plan()
        return None if plan is None else plan(x, step, cache)

    def kept_plan(self):
        """``one_call_plan``, built once and kept while nothing it was built from changes (kvlm.decode_plans)."""
        return kept_plan(self)

    def one_call_plan(self):
        """``Attention.decode_block_plan`` for this block's weights, or None (not of that form, or a module of the
        block has forward hooks: those fire only module by module)."""
        if hooked(*self.modules()):
            return None
        weights = self.decode_block_weights()
        plan = getattr(self.attn, "decode_block_plan", None)  # a tensor-parallel wrapper has none
        plan = plan(weights) if weights is not None and plan is not None else None
        if plan is not None:  # 9 to MAX_ROWS rows too, unless its modules would run them on a library's packed copy
            plan.call.wide = not library_packed(self.modules())
        return plan

    def decode_block_weights(self) -> tuple | None:
        """What ``Attention.decode_block_plan`` needs of the rest of the block (RMSNorms of one eps, a bias-free SwiGLU):
        the norms' weights, eps, [W_1, W_2], W_O and the panels of its two products where they go first (else
        None), or None where the block is not of that form."""
        an, mn, mlp = self.attn_norm, self.mlp_norm, self.mlp
        if type(an) is not RMSNorm or type(mn) is not RMSNorm or type(mlp) is not SwiGLU or an.eps != mn.eps:
            return None
        if mlp.w1.bias is not None or mlp.w2.bias is not None or mlp.wo.bias is not None:
            return None
        (up_ok, up_panels), (down_ok, down_panels) = mlp.group_panels(("w1", "w2")), mlp.wo.first_panels()
        if not (up_ok and down_ok):
            return None  # panels that would go first are stale: module by module
        return an.weight, mn.weight, an.eps, [mlp.w1.weight, mlp.w2.weight], mlp.wo.weight, up_panels, down_panels

    def forward_parts(self, x: torch.Tensor, parts: list[tuple[Step, object]], layer_idx: int) -> torch.Tensor:
        """x (N, d): the rows of several cache calls back to back (``KVLM.forward_parts``); parts: (step, view)
        of each, in that order. Attention runs per call through its view's layer ``layer_idx``; the norms and
        the MLP run once on all N rows."""
        if len(parts) == 1:  # one call (the engine's decode-only step): the block in one call, as ``forward``
            step, view = parts[0]
            view.activate()
            y = self.one_call(x.view(*step.positions.shape, -1), step, view.layers[layer_idx])
            if y is not None:
                return y.view(x.shape)
        h = self.attn_norm(x)
        out, i = [], 0
        for step, view in parts:
            B, T = step.positions.shape
            view.activate()
            o = self.attn(h[i : i + B * T].view(B, T, -1), step, view.layers[layer_idx])
            out.append(o.reshape(B * T, -1))
            i += B * T
        x = x + self.dropout(torch.cat(out) if len(out) > 1 else out[0])
        return x + self.mlp(self.mlp_norm(x))


class KVLM(nn.Module):
    """The decoder-only language model of a ``ModelConfig``: token embedding, ``n_layer`` pre-norm blocks
    (the attention mechanism ``cfg.attention`` from kvlm.attention's registry, then the MLP), final norm and LM
    head (tied to the embedding when ``cfg.tie_embeddings``).

        model = KVLM(cfg)                        # or build_model(cfg, device, dtype)
        logits = model(tokens)                   # (B, T) ids -> (B, T, vocab): the full causal forward
        cache = model.new_cache(batch_size=B)    # the mechanism's compact cache (KVCache)
        logits = model(prompt, cache)            # prefill, then model(next_ids, cache) per decode step

    ``model.cfg`` is its ModelConfig; ``parameter_counts()`` its parameters by part; ``cache_specs()`` the
    shapes each layer caches per token; call ``prepare_for_inference()`` before decoding (absorbed weights)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.arch == "gpt2" else None
        self.drop = Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        # e.g. eg-mla's layer-group sharing of the gate branch (a no-op for most mechanisms)
        get_attention_class(cfg.attention).tie_layers([b.attn for b in self.layers])
        self.norm = make_norm(cfg, cfg.d_model)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    # --- initialisation ----------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """GPT-style: N(0, init_std) for matrices and embeddings, output projections scaled by
        1/sqrt(2 n_layer) (GPT-2) or zero (cfg.zero_init_out, mlra.md Sec. 4.2.1)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layer)
        outputs = {id(m) for b in self.layers for part in (b.attn, b.mlp) for m in part.output_projections()}
        for module in self.modules():
            if isinstance(module, nn.Linear):
                if id(module) in outputs:
                    if self.cfg.zero_init_out:
                        nn.init.zeros_(module.weight)
                    else:
                        nn.init.normal_(module.weight, 0.0, out_std)
                else:
                    nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, Attention):
                module.reset_extra_parameters()

    # --- inference ----------------------------------------------------------------------------
    def prepare_for_inference(self) -> KVLM:
        """Build every attention's derived weights (absorbed matrices, gate tables) from the current parameters,
        once, before decoding; call again after the weights change. Large CPU weights move into huge pages
        (``kvlm.hugepages.move_to_huge_pages_``: a decode step streams them all; the same values and Parameter
        objects). Returns the model."""
        move_to_huge_pages_(self)
        for module in self.modules():
            if isinstance(module, Attention):
                module.prepare_for_inference()
        return self

    def pack_for_decode(self, rows: int | str | None) -> int:
        """Pack every weight GEMM and the LM head for decode (``kvlm.attention.linear``): ``rows`` an int, MKL's
        layout for steps of exactly ``rows`` = batch x new tokens rows (other row counts keep the unpacked path);
        ``ANY_ROWS``, oneDNN's layout for steps of any number of rows (the serving engine; ``PAST_KERNEL`` the same
        for the rows past the few-row kernel's, which takes those up to ``MAX_ROWS``); None drops the
        packed copies. Linears that read the same input and run as one GEMM at decode (SwiGLU's W1 and W2, MHA's
        W^Q, W^K, W^V: ``GroupPacking``) are packed together instead of one by one. Returns how many weights were
        packed (0 off CPU float32 / without the library)."""
        groups = [g for g in self.modules() if isinstance(g, GroupPacking)]
        grouped = {id(m) for g in groups for m in g.pack_for_decode(rows)}
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if rows is None:
            for m in linears:
                m.unpack()
            return 0
        for m in linears:
            if id(m) in grouped:
                m.unpack()  # runs inside its group's packed GEMM: no second packed copy
        return len(grouped) + sum(m.pack_for_decode(rows) for m in linears if id(m) not in grouped)

    # --- forward ------------------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        mode: str = "auto",
        last_only: bool = False,
        trace: list[tuple[int, str]] | None = None,
        logits_rows: list[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab) (or (B, 1, vocab) with last_only; (len(logits_rows), T or 1,
        vocab) for those batch rows only: the LM head, the largest GEMM at decode, runs on the rows that are
        sampled, e.g. the last row of each prompt in a packed batch).

        Without a cache: the full causal forward. With a cache: the new tokens are appended (prefill or
        decode) and attend to everything cached. trace: a list to which each attention layer appends
        (layer_idx, route) for the route it ran (``Step.trace``)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq), got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        if T == 0:
            raise ValueError("tokens is empty")
        self._check_token_ids(tokens, cache)
        if cache is None:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
            step = Step.build(tokens, 0, None, mode, trace)
        else:  # the cache places the tokens (KVCache: shared slots; a paged batch: per-sequence lengths)
            if not torch.compiler.is_compiling():
                self._check_cache_fits(cache)  # every call, not only the first: cheap after the first (memo)
            step = cache.begin_step(tokens, self.embed.weight.dtype, mode, trace, fits=self._check_cache_fits)
        x = self.embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(step.positions)
        x = self.drop(x)
        y = self.decode_stack(x, step, cache) if cache is not None else None
        if y is not None:
            x = y
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, step, cache.layers[i] if cache is not None else None)
        if cache is not None:
            cache.commit(step)
        if last_only:
            x = x[:, -1:]
        if logits_rows is not None:
            x = x[torch.as_tensor(logits_rows, device=x.device)]
        return self.lm_head(self.norm(x))

    def forward_parts(
        self, calls: list[tuple[torch.Tensor, object]], logits_rows: list[int] | torch.Tensor
    ) -> torch.Tensor:
        """Several cache calls as one forward: calls [(tokens (B_i, T_i), view_i)], the views of one paged cache
        (``PagedBatch`` / ``PackedBatch``) over disjoint sequences, e.g. a step's decodes and its prefill chunks.
        Each call's attention runs through its own view and ``Step``; the embedding, norms, MLP and LM head run
        once on all N = sum B_i T_i rows, so a step streams those weights once (vLLM's mixed prefill and decode
        batch), and the LM head only on ``logits_rows``: indices into the N rows, call i's B_i T_i rows
        (row-major) after those of the calls before it. Returns logits (len(logits_rows), vocab)."""
        if not calls:
            raise ValueError("forward_parts needs at least one (tokens, view) call")
        seen: set = set()
        for tokens, view in calls:
            if tokens.dim() != 2 or tokens.numel() == 0:
                raise ValueError(f"tokens must be a non-empty (batch, seq) tensor, got shape {tuple(tokens.shape)}")
            if not hasattr(view, "activate"):
                raise CacheError(f"forward_parts takes paged views (PagedBatch, PackedBatch), got {type(view).__name__}")
            ids = set(view.seq_ids)
            if seen & ids:
                raise CacheError(f"sequences {sorted(map(str, seen & ids))} appear in two calls of one forward")
            seen |= ids
            self._check_token_ids(tokens, view)
            self._check_cache_fits(view)
        dtype = self.embed.weight.dtype
        parts = [(view.begin_step(t, dtype, fits=self._check_cache_fits), view) for t, view in calls]
        flat = torch.cat([t.reshape(-1) for t, _ in calls]) if len(calls) > 1 else calls[0][0].reshape(-1)
        x = self.embed(flat)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.cat([step.positions.reshape(-1) for step, _ in parts]))
        x = self.drop(x)
        y = None
        if len(parts) == 1:  # one call (the engine's decode-only step): the blocks in one call, as ``forward``
            step, view = parts[0]
            view.activate()
            y = self.decode_stack(x.view(*step.positions.shape, -1), step, view)
        if y is not None:
            x = y.view(x.shape)
        else:
            for i, layer in enumerate(self.layers):
                x = layer.forward_parts(x, parts, i)
        for step, view in parts:
            view.commit(step)
        x = x[torch.as_tensor(logits_rows, dtype=torch.long, device=x.device)]
        return self.lm_head(self.norm(x))

    def decode_stack(self, x: torch.Tensor, step: Step, cache) -> torch.Tensor | None:
        """Every block of a decode step (a few new tokens a sequence) in one kernel call over the blocks' kept plans,
        or None where it does not apply (each block then runs on its own): kvlm.decode_plans.decode_stack."""
        return decode_stack(self, x, step, cache)

    # --- cache --------------------------------------------------------------------------------
    def cache_specs(self, naive: bool = False) -> list[dict[str, tuple[int, ...]]]:
        """Per layer, {cached tensor name: per-token shape} (e.g. MLA's c_kv and k_rope); naive=True: the
        materialised per-head K/V instead."""
        return [b.attn.cache_spec(naive=naive) for b in self.layers]

    def _check_cache_fits(self, cache: KVCache) -> None:
        """CacheError unless ``cache`` holds this model's per-layer specs in its mode (a used cache of another model
        would otherwise be read as if it were this one's, or fail with a shape error deep inside). The spec lists
        that passed are remembered by identity (a cache keeps its list; a paged batch shares its cache's), so
        a call pays one dict lookup, not a per-layer comparison."""
        memo = self.__dict__.setdefault("_fitting_specs", {})
        key = (id(cache.specs), cache.mode)
        if memo.get(key) is cache.specs:
            return
        want = self.cache_specs(naive=cache.mode == "naive")
        have = [{k: tuple(v) for k, v in s.items()} for s in cache.specs]
        if have != [{k: tuple(v) for k, v in s.items()} for s in want]:
            raise CacheError(
                f"this cache was not built for this model: it holds {len(have)} layers {have[:1]}, the model "
                f"needs {len(want)} layers {want[:1]} (mode {cache.mode!r}); use model.new_cache(...)"
            )
        if len(memo) >= 8:  # a few caches in turn (batches, beams) stay cheap; never grows without bound
            memo.clear()
        memo[key] = cache.specs

    def _check_token_ids(self, tokens: torch.Tensor, cache) -> None:
        """ValueError naming a token id outside [0, vocab_size) (embedding's bare IndexError on CPU, a device-side
        assert on CUDA). Always on CPU; on an accelerator, where reading the ids back stalls the queue, for calls
        of several tokens (prompts, training batches): a one-token decode step is fed by the sampler."""
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
        if torch.compiler.is_compiling():
            return
        if tokens.device.type != "cpu":
            if (cache is not None and tokens.shape[1] == 1) or (
                tokens.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            ):
                return
        if tokens.device.type == "cpu" and 0 < tokens.numel() <= 64:  # a decode step's few ids: one call, not three
            ids = tokens.reshape(-1).tolist()  # a view where it can be
            lo, hi = min(ids), max(ids)
        else:
            lo, hi = torch.stack(torch.aminmax(tokens)).tolist()  # one read-back, not two
        vocab = self.cfg.vocab_size
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab}) of this model (vocab_size={vocab})")

    def new_cache(
        self,
        batch_size: int,
        max_seq_len: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        naive: bool = False,
    ) -> KVCache:
        """Preallocate the compact cache (or, with naive=True, the materialised per-head K/V cache
        the benchmarks compare against). Forward with mode="naive" needs the naive cache."""
        p = self.embed.weight
        max_seq_len = max_seq_len or self.cfg.max_seq_len
        if max_seq_len > self.cfg.max_seq_len:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_seq_len={self.cfg.max_seq_len}"
            )
        needs_ids = get_attention_class(self.cfg.attention).needs_token_ids
        return KVCache(
            self.cache_specs(naive=naive),
            batch_size,
            max_seq_len,
            dtype=dtype or p.dtype,
            device=device or p.device,
            store_token_ids=needs_ids,
            mode="naive" if naive else "compact",
        )

    # --- accounting -----------------------------------------------------------------------------
    def parameter_counts(self) -> dict[str, int]:
        """Parameter counts by part (total, embedding, gate_embedding, attention, ffn, ...): parameter_counts_of."""
        return parameter_counts_of(self)


def parameter_counts_of(model: KVLM) -> dict[str, int]:
    """total: unique parameters. embedding: token (+ position) embedding. gate_embedding: eg-mla's
    per-layer token tables (``GateEmbedding``), which live off the matmul path (eg-mla.md reports them apart).
    activated: total - gate_embedding (what runs per token, as eg-mla.md Table 9's "Size")."""
    gate_tables = {id(m.weight) for m in model.modules() if isinstance(m, GateEmbedding)}
    seen: set[int] = set()
    counts = {"total": 0, "embedding": 0, "gate_embedding": 0, "attention": 0, "ffn": 0}
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        counts["total"] += n
        if name.startswith(("embed.", "pos_embed.")) or name == "lm_head.weight":
            counts["embedding"] += n
        elif id(p) in gate_tables:
            counts["gate_embedding"] += n
            counts["attention"] += n
        elif ".attn." in name:
            counts["attention"] += n
        elif ".mlp." in name:
            counts["ffn"] += n
    counts["activated"] = counts["total"] - counts["gate_embedding"]
    counts["non_embedding"] = counts["total"] - counts["embedding"] - counts["gate_embedding"]
    return counts


def build_model(
    cfg: ModelConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> KVLM:
    """A new ``KVLM`` for ``cfg`` with freshly initialised weights (seed torch first for reproducible ones),
    allocated directly on ``device`` (default: cpu) and cast to ``dtype`` if given (default: float32).

        model = build_model(ModelConfig(attention="mla", n_layer=4, d_model=256, n_head=8), device="cuda")
        model = build_model(get_preset("tiny/mla"))    # kvlm.preset_table: the papers' configurations
    """
    model = KVLM(cfg) if device is None else _build_on(cfg, device)
    if dtype is not None:
        model = model.to(dtype)
    return model


def _build_on(cfg: ModelConfig, device) -> KVLM:
    with torch.device(device):
        return KVLM(cfg)


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts without allocating weights (meta device): works for the 2.9B presets."""
    with torch.device("meta"):
        model = KVLM(cfg)
    return model.parameter_counts()
