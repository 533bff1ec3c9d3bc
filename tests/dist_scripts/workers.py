"""Process bodies for tests/test_distributed.py, started with torch.multiprocessing.spawn on gloo.

Every rank builds the same tiny float64 model from the same seed, computes the single-process reference
itself (cheap at this size) and then the same thing through its shard; results go to <out>/<rank>.pt for
the parent to check. Threads: one per rank (the test machine has two shared cores)."""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(fn, world: int, out: str, *args) -> list[dict]:
    """Spawn `world` ranks of fn(rank, world, port, out, *args); return each rank's saved result."""
    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(_entry, args=(fn, world, port, out, args), nprocs=world, join=True)
    return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world)]


def _entry(rank, fn, world, port, out, args):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out, f"{rank}.pt"))
    except Exception:
        traceback.print_exc(file=sys.stderr)
        raise
    finally:
        dist.destroy_process_group()


def _tiny(attention, overrides):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from conftest import tiny_config

    return tiny_config(attention, **overrides)


def _model(cfg):
    from kvlm import build_model

    torch.manual_seed(0)
    model = build_model(cfg).to(torch.float64)
    with torch.no_grad():  # random norms and biases, so every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _decode(model, tokens, mode="auto"):
    """Prefill 5 tokens, a second prefill chunk of 3, then one token at a time: all logits."""
    cache = model.new_cache(tokens.shape[0], tokens.shape[1], naive=(mode == "naive"))
    parts = [model(tokens[:, :5], cache=cache, mode=mode), model(tokens[:, 5:8], cache=cache, mode=mode)]
    for t in range(8, tokens.shape[1]):
        parts.append(model(tokens[:, t : t + 1], cache=cache, mode=mode))
    return torch.cat(parts, dim=1), cache


def tp_cases(rank, world, cases):
    """For each (attention, overrides): sharded vs single-process logits (full forward, incremental
    decode in every mode), greedy generation, and what this rank's cache holds."""
    from kvlm.distributed import kv_elements_per_token, shard_model, tp_plan
    from kvlm.generate import generate

    results = {}
    for attention, overrides in cases:
        key = f"{attention}{overrides}"
        try:
            cfg = _tiny(attention, overrides)
            model = _model(cfg)
            tp = shard_model(model, rank, world)
            g = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
            r = {"plan": tp_plan(tp)}
            with torch.no_grad():
                ref_full = model(tokens)
                r["full_err"] = (tp(tokens) - ref_full).abs().max().item()
                modes = ["auto"] + (["naive", "absorbed", "expand"] if model.layers[0].attn.has_naive_cache else [])
                r["decode_err"] = {}
                for mode in modes:
                    ref, _ = _decode(model, tokens, mode)
                    got, cache = _decode(tp, tokens, mode)
                    r["decode_err"][mode] = (got - ref).abs().max().item()
                    if mode == "auto":
                        r["logits"] = got  # to check every rank got the same bits
                        r["cache_elements_per_token"] = cache.elements_per_token
                        r["cache_nbytes"] = cache.nbytes
                        r["cache_shape"] = {k: tuple(v.shape) for k, v in cache.layers[0].items()}
            prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
            r["greedy_ref"] = generate(model, prompts, 6)
            r["greedy_tp"] = generate(tp, prompts, 6)
            r["sampled_tp"] = generate(tp, prompts, 6, temperature=1.0, top_k=20, seed=3)
            r["sampled_ref"] = generate(model, prompts, 6, temperature=1.0, top_k=20, seed=3)
            r["kv_elements_per_token"] = kv_elements_per_token(tp)
            results[key] = r
        except Exception as e:  # reported per case by the parent
            results[key] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return results
