"""The MLRA authors' checkpoints (github.com/SongtaoLiu0823/MLRA) import into kvlm with the same logits.

``their_forward`` restates their model files' forward (model/mla.py, mlra_2.py, mlra_4.py: CausalSelfAttention,
MLP, Block, GPT) on a state dict in their names, flash_attn_func replaced by causal SDPA with its default scale
1/sqrt(d_h + d_h^R): their RMSNorm (eps 1e-6, float32), Rotary (base 10000, half split), q_scale / kv_scale, and
for MLRA-2 their branch A (blocks 0, 1 over the two halves of the heads) + branch B (blocks 2, 3), each branch
scaled by 1/sqrt(2); MLRA-4 four branches of all heads scaled by 1/2."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kvlm.checkpoint import save_checkpoint
from kvlm.interop.mlra_import import BLOCK_ORDER, import_mlra_authors

THEIR_CFG = dict(n_layer=2, n_head=4, n_embd=64, intermediate_size=96, block_size=32, q_lora_rank=32,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, vocab_size=101, bias=False,
                 dropout=0.0, model_type="gpt2")  # fmt: skip


def their_state(kind: str, c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=0.1: torch.randn(*shape, generator=g, dtype=torch.float64) * s  # noqa: E731
    norm = lambda n: 1 + r(n, s=0.3)  # noqa: E731  (not ones: a lost or misplaced norm weight shows)
    d, h, dn, dr, dq, dc, f = (c[k] for k in ("n_embd", "n_head", "qk_nope_head_dim", "qk_rope_head_dim",
                                               "q_lora_rank", "kv_lora_rank", "intermediate_size"))  # fmt: skip
    s = {"transformer.wte.weight": r(c["vocab_size"], d, s=0.5), "layernorm.weight": norm(d)}
    s["lm_head.weight"] = s["transformer.wte.weight"]
    for i in range(c["n_layer"]):
        p = f"transformer.h.{i}."
        s |= {p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
              p + "mlp.c_fc1.weight": r(f, d), p + "mlp.c_fc2.weight": r(f, d), p + "mlp.c_proj.weight": r(d, f),
              p + "attn.q_a_proj.weight": r(dq, d), p + "attn.q_a_layernorm.weight": norm(dq),
              p + "attn.q_b_proj.weight": r(h * (dn + dr), dq), p + "attn.kv_a_proj_with_mqa.weight": r(dc + dr, d),
              p + "attn.c_proj.weight": r(d, h * dn)}  # fmt: skip
        if kind == "mla":
            s[p + "attn.kv_a_layernorm.weight"] = norm(dc)
            s[p + "attn.kv_b_proj.weight"] = r(h * 2 * dn, dc)
        else:
            heads = h // 2 if kind == "mlra_2" else h
            for j in range(4):
                s[f"{p}attn.kv_a_layernorms.{j}.weight"] = norm(dc // 4)
            s[p + "attn.kv_b_proj"] = r(4, dc // 4, heads * 2 * dn)
    return s


def _rms(x, w):
    # their RMSNorm computes in float32; in float64 runs it is kept in float64 so that the comparison is exact
    x32 = x if x.dtype == torch.float64 else x.to(torch.float32)
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _rope(x):  # (B, T, H, D), their Rotary + apply_rotary_emb
    T, D = x.shape[1], x.shape[3]
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).to(x.dtype) / D))  # float32 in theirs (see _rms)
    fr = torch.outer(torch.arange(T).to(x.dtype), inv)
    cos, sin = fr.cos().to(x.dtype)[None, :, None], fr.sin().to(x.dtype)[None, :, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def _attn(q, k, v):  # flash_attn_func(q, k, v, causal=True): (B, T, H, D) in and out
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)  # fmt: skip


def their_forward(kind: str, c: dict, s: dict, idx: torch.Tensor) -> torch.Tensor:
    d, h, dn, dr, dq, dc = (c[k] for k in ("n_embd", "n_head", "qk_nope_head_dim", "qk_rope_head_dim",
                                           "q_lora_rank", "kv_lora_rank"))  # fmt: skip
    B, T = idx.shape
    x = s["transformer.wte.weight"][idx]
    for i in range(c["n_layer"]):
        p = f"transformer.h.{i}.attn."
        a = _rms(x, s[f"transformer.h.{i}.input_layernorm.weight"])
        cq = _rms(a @ s[p + "q_a_proj.weight"].T, s[p + "q_a_layernorm.weight"]) * (d / dq) ** 0.5
        q = (cq @ s[p + "q_b_proj.weight"].T).view(B, T, h, dn + dr)
        q = torch.cat([q[..., :dn], _rope(q[..., dn:])], -1)
        ckv, k_pe = (a @ s[p + "kv_a_proj_with_mqa.weight"].T).split([dc, dr], -1)
        k_pe = _rope(k_pe.view(B, T, 1, dr)).expand(B, T, h, dr)
        if kind == "mla":
            ckv = _rms(ckv, s[p + "kv_a_layernorm.weight"]) * (d / dc) ** 0.5
            kv = (ckv @ s[p + "kv_b_proj.weight"].T).view(B, T, h, 2 * dn)
            y = _attn(q, torch.cat([kv[..., :dn], k_pe], -1), kv[..., dn:])
        else:
            dl = dc // 4
            lat = torch.stack([_rms(z, s[f"{p}kv_a_layernorms.{j}.weight"]) * (d / dl) ** 0.5
                               for j, z in enumerate(ckv.split(dl, -1))], dim=2)  # fmt: skip
            kv = torch.einsum("btld,ldo->btlo", lat, s[p + "kv_b_proj"])
            if kind == "mlra_2":
                kv = kv.view(B, T, 4, h // 2, 2 * dn)
                branches = [kv[:, :, :2].reshape(B, T, h, 2 * dn), kv[:, :, 2:].reshape(B, T, h, 2 * dn)]
            else:
                kv = kv.view(B, T, 4, h, 2 * dn)
                branches = [kv[:, :, j] for j in range(4)]
            y = sum(_attn(q, torch.cat([br[..., :dn], k_pe], -1), br[..., dn:]) / len(branches) ** 0.5
                    for br in branches)  # fmt: skip
        x = x + y.reshape(B, T, h * dn) @ s[p + "c_proj.weight"].T
        m = _rms(x, s[f"transformer.h.{i}.post_attention_layernorm.weight"])
        pm = f"transformer.h.{i}.mlp."
        x = (
            x
            + (F.silu(m @ s[pm + "c_fc1.weight"].T) * (m @ s[pm + "c_fc2.weight"].T))
            @ s[pm + "c_proj.weight"].T
        )
    return _rms(x, s["layernorm.weight"]) @ s["lm_head.weight"].T


@pytest.mark.parametrize("kind", ["mla", "mlra_2", "mlra_4"])
def test_authors_checkpoint_imports_with_equal_logits(tmp_path, kind):
    state = their_state(kind, THEIR_CFG)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(THEIR_CFG))
    torch.save({k: v.float() for k, v in state.items()}, tmp_path / "src" / "pytorch_model.bin")
    model = import_mlra_authors(tmp_path / "src", kind)
    assert model.cfg.attention == kind.replace("_", "-") and model.cfg.norm_eps == 1e-6
    idx = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(3))
    ref = their_forward(kind, THEIR_CFG, state, idx)
    model64 = import_mlra_authors((THEIR_CFG, state), kind).double()
    with torch.no_grad():
        assert (model64(idx) - ref).abs().max() < 1e-10
        assert (model(idx) - ref.float()).abs().max() < 1e-4
        # the absorbed decode over the cache (what kvlm adds) agrees as well
        from kvlm.inference.generation import generate

        save_checkpoint(tmp_path / "ck", model)
    greedy = their_forward(kind, THEIR_CFG, state, idx[:1, :6])
    ids = idx[0, :6].tolist()
    out = generate(model64, ids, 1)
    assert out == [int(greedy[0, -1].argmax())]


def test_mlra_2_blocks_are_renumbered_to_the_papers_pairing():
    """Without the renumbering (their order taken as kvlm's) the logits differ: the pairing matters."""
    assert BLOCK_ORDER["mlra_2"] == [0, 2, 1, 3]
    state = their_state("mlra_2", THEIR_CFG)
    idx = torch.randint(0, 101, (1, 16), generator=torch.Generator().manual_seed(4))
    ref = their_forward("mlra_2", THEIR_CFG, state, idx)
    BLOCK_ORDER["mlra_2"] = [0, 1, 2, 3]
    try:
        wrong = import_mlra_authors((THEIR_CFG, state), "mlra_2").double()
    finally:
        BLOCK_ORDER["mlra_2"] = [0, 2, 1, 3]
    with torch.no_grad():
        assert (wrong(idx) - ref).abs().max() > 1e-3


def test_import_hf_cli_reads_an_authors_folder(tmp_path, capsys):
    from kvlm.checkpoint import load_checkpoint
    from kvlm.cli import main

    state = their_state("mlra_2", THEIR_CFG)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(THEIR_CFG))
    torch.save({k: v.float() for k, v in state.items()}, tmp_path / "src" / "pytorch_model.bin")
    args = ["import-hf", str(tmp_path / "src"), str(tmp_path / "ck"), "--mlra-code", "mlra_2", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["attention"] == "mlra-2"
    model, _, _ = load_checkpoint(tmp_path / "ck")
    idx = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (model(idx) - their_forward("mlra_2", THEIR_CFG, state, idx).float()).abs().max() < 1e-4
