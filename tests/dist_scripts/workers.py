"""Process bodies for tests/test_distributed.py, started with torch.multiprocessing on gloo.

Every rank builds the same tiny float64 model from the same seed, computes the single-process reference
itself (cheap at this size) and then the same thing through its shard; results go to <out>/<rank>.pt for
the parent to check. Threads: one per rank (the test machine has two shared cores)."""

from __future__ import annotations

import copy
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
    """Start `world` ranks of fn(rank, world, *args) in a gloo group; return each rank's result.

    Forked where the platform allows (a spawned rank re-imports torch: ~3 s each on a loaded 2-core machine,
    a forked one starts at once). Forking after the parent used torch is safe here because every rank runs
    one thread, so no OpenMP pool is entered in the child."""
    import multiprocessing

    import torch.multiprocessing as mp

    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "fork":  # import once here what every rank needs, rather than once per rank
        import torch._dynamo  # noqa: F401  (DistributedDataParallel imports it on first use: seconds)

        import kvlm.inference.generation  # noqa: F401
        import kvlm.parallel  # noqa: F401
        from kvlm.attention import registry

        registry()
    port = free_port()
    mp.start_processes(
        _entry, args=(fn, world, port, out, args), nprocs=world, join=True, start_method=method
    )
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
    """Prefill 5 tokens, a second prefill chunk of 2, then one token at a time: all logits."""
    cache = model.new_cache(tokens.shape[0], tokens.shape[1], naive=(mode == "naive"))
    parts = [model(tokens[:, :5], cache=cache, mode=mode), model(tokens[:, 5:7], cache=cache, mode=mode)]
    for t in range(7, tokens.shape[1]):
        parts.append(model(tokens[:, t : t + 1], cache=cache, mode=mode))
    return torch.cat(parts, dim=1), cache


def tp_cases(rank, world, cases):
    """For each (attention, overrides, extra checks): sharded vs single-process logits (full forward and
    incremental decode), greedy generation (ragged prompts), and what this rank's cache holds. Extra checks:
    "modes" decodes in every attention mode, "sample" also compares seeded sampling."""
    from torch.distributed.tensor import DTensor

    from kvlm.inference.generation import generate
    from kvlm.parallel import kv_elements_per_token, shard_model, tp_plan

    results = {}
    for attention, overrides, extra in cases:
        key = f"{attention}{overrides}"
        try:
            cfg = _tiny(attention, overrides)
            model = _model(cfg)
            tp = shard_model(model, rank, world)
            g = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=g)
            r = {"plan": tp_plan(tp), "decode_err": {}}
            with torch.no_grad():
                r["full_err"] = (tp(tokens) - model(tokens)).abs().max().item()
                modes = ["auto"]
                if "modes" in extra and model.layers[0].attn.has_naive_cache:
                    modes += ["naive", "absorbed", "expand"]
                for mode in modes:
                    ref, _ = _decode(model, tokens, mode)
                    got, cache = _decode(tp, tokens, mode)
                    r["decode_err"][mode] = (got - ref).abs().max().item()
                    if mode == "auto":
                        r["logits"] = got  # every rank must hold the same bits
                        r["cache_elements_per_token"] = cache.elements_per_token
                        r["cache_nbytes"] = cache.nbytes
                        r["cache_tokens"] = cache.batch_size * cache.max_seq_len
            prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]  # ragged: left padding
            r["greedy"] = (generate(model, prompts, 5), generate(tp, prompts, 5))
            if "sample" in extra:
                kw = dict(temperature=1.0, top_k=20, seed=3)
                r["sampled"] = (generate(model, prompts, 5, **kw), generate(tp, prompts, 5, **kw))
            r["kv_elements_per_token"] = kv_elements_per_token(tp)
            # the submodules the mechanism's plan gives torch's styles hold DTensor weights, the others plain ones
            declared = model.layers[0].attn.tp_plan(rank, world).get("parallelize", {})
            r["dtensor"] = (
                sorted(n for n, p in tp.layers[0].attn.inner.named_parameters() if isinstance(p, DTensor)),
                sorted(
                    n for m in declared for n, _ in model.layers[0].attn.get_submodule(m).named_parameters(m)
                ),
                all(isinstance(p, DTensor) for p in tp.layers[0].mlp.parameters()),
            )
            results[key] = r
        except Exception as e:  # reported per case by the parent
            results[key] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return results


def ep_cases(rank, world, cases):
    """Embedding parallelism: for each eg-mla config, one DDP training step of the sharded model on this
    rank's part of a global batch vs the unsharded model on the whole batch (same loss, same gradients);
    and the sharded lookup alone with a different number of tokens on every rank."""

    import torch.nn.functional as F

    from kvlm.attention import GateEmbedding
    from kvlm.parallel import (
        GateExchange,
        ShardedGateEmbedding,
        clip_grad_norm,
        gather_gate_embeddings,
        parameter_bytes,
        shard_gate_embeddings,
        wrap_ddp,
    )

    results = {}
    for attention, overrides in cases:
        key = f"{attention}{overrides}"
        try:
            cfg = _tiny(attention, overrides)
            model = _model(cfg).train()
            B, T = 2, 10
            g = torch.Generator().manual_seed(2)
            tokens = torch.randint(0, cfg.vocab_size, (world * B, T + 1), generator=g)
            ref = copy.deepcopy(model)
            logits = ref(tokens[:, :-1])
            ref_loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            ref_loss.backward()
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}

            ep = shard_gate_embeddings(copy.deepcopy(model), rank, world)
            ddp = wrap_ddp(ep)
            mine = tokens[rank * B : (rank + 1) * B]
            loss = F.cross_entropy(ddp(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten())
            loss.backward()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            r = {"loss_err": abs(mean_loss.item() / world - ref_loss.item()), "grad_err": {}}
            for n, p in ep.named_parameters():
                want = ref_grads[n]
                if isinstance(ep.get_submodule(n.rsplit(".", 1)[0]), ShardedGateEmbedding):
                    emb = ep.get_submodule(n.rsplit(".", 1)[0])
                    want = want[:, emb.bounds[rank] : emb.bounds[rank + 1]]
                    r.setdefault("sharded", []).append((n, tuple(p.shape)))
                r["grad_err"][n] = (p.grad - want).abs().max().item()
            # gradient clipping sees the whole gradient's norm on every rank
            norm = clip_grad_norm(ep, 0.1)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
            r["norm_err"] = abs(norm.item() - ref_norm.item())
            r["clipped_err"] = 0.0
            for n, p in ep.named_parameters():
                want = ref_grads[n]
                if isinstance(ep.get_submodule(n.rsplit(".", 1)[0]), ShardedGateEmbedding):
                    emb = ep.get_submodule(n.rsplit(".", 1)[0])
                    want = want[:, emb.bounds[rank] : emb.bounds[rank + 1]]
                r["clipped_err"] = max(r["clipped_err"], (p.grad - want).abs().max().item())
            # gathering the slices gives back the original tables (what a checkpoint saves)
            full = gather_gate_embeddings(ep)
            r["gathered_err"] = max(
                (a - b).abs().max().item()
                for a, b in zip(full.state_dict().values(), model.state_dict().values())
            )
            r["param_bytes"] = parameter_bytes(ep)
            r["param_bytes_unsharded"] = parameter_bytes(model)
            r["gate_bytes"] = sum(
                p.numel() * p.element_size()
                for m in ep.modules()
                if isinstance(m, (GateEmbedding, ShardedGateEmbedding))
                for p in m.parameters()
            )
            results[key] = r
        except Exception as e:
            results[key] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}

    # ragged: rank r looks up 3 + 2 r ids; every rank must get the full-width rows of its own ids
    table = torch.randn(11, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    bounds = [0] + [len(c) for c in torch.tensor_split(torch.arange(7), world)]
    bounds = [sum(bounds[: i + 1]) for i in range(len(bounds))]
    emb = ShardedGateEmbedding(table, bounds, GateExchange(rank, world), average_grads=False)
    ids = torch.randint(0, 11, (1, 3 + 2 * rank), generator=torch.Generator().manual_seed(10 + rank))
    out = emb(ids)
    out.pow(2).sum().backward()  # d/dW of sum over all ranks' ids of |row|^2, restricted to my columns
    all_ids = [
        torch.randint(0, 11, (1, 3 + 2 * s), generator=torch.Generator().manual_seed(10 + s))
        for s in range(world)
    ]
    want_grad = torch.zeros_like(table)
    for s_ids in all_ids:
        want_grad.index_add_(0, s_ids.flatten(), 2 * table[s_ids.flatten()])
    results["ragged"] = {
        "out_err": (out - table[ids]).abs().max().item(),
        "grad_err": (emb.weight.grad - want_grad[:, bounds[rank] : bounds[rank + 1]]).abs().max().item(),
    }
    return results


def dp_cases(rank, world, cases):
    """Data-parallel attention: rank r serves its own requests (prompts of other lengths than the other
    ranks'); its logits and greedy tokens must be those one process gets for the same requests."""
    from kvlm.inference.generation import generate
    from kvlm.parallel import shard_model

    results = {}
    for attention, overrides in cases:
        key = f"{attention}{overrides}"
        try:
            cfg = _tiny(attention, overrides)
            model = _model(cfg)
            dp = shard_model(model, rank, world, attention="dp")
            g = torch.Generator().manual_seed(5)
            prompts = [
                torch.randint(0, cfg.vocab_size, (3 + i,), generator=g).tolist() for i in range(2 * world)
            ]
            mine = prompts[2 * rank : 2 * rank + 2]
            tokens = torch.tensor(mine[1][: 3 + rank])[None]  # a different length on every rank
            with torch.no_grad():
                err = (dp(tokens) - model(tokens)).abs().max().item()
            results[key] = {
                "logits_err": err,
                "greedy": (generate(model, prompts, 5)[2 * rank : 2 * rank + 2], generate(dp, mine, 5)),
                "cache_elements_per_token": dp.new_cache(1, 4).elements_per_token,
                "full_elements_per_token": cfg.kv_cache_elements_per_token(),
            }
        except Exception as e:
            results[key] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return results


def all_checks(rank, world, tp, ep, dp):
    return {"tp": tp_cases(rank, world, tp), "ep": ep_cases(rank, world, ep), "dp": dp_cases(rank, world, dp)}


def fsdp_checks(rank, world, out):
    """FSDP2 (kvlm.parallel.wrap_fsdp): two AdamW steps, each rank on its part of the global batch, against one
    process on the whole batch; then a sharded checkpoint (torch.distributed.checkpoint) saved, loaded into a
    differently initialised FSDP2 model and optimizer, and one more step on both."""
    import torch.nn.functional as F

    from kvlm.parallel import full_model_state, init_distributed, load_sharded, save_sharded, wrap_fsdp

    ctx = init_distributed("cpu", mesh_dim="dp")
    cfg = _tiny("mla", {"n_layer": 2, "q_lora_rank": 32})
    B, T = 2, 10
    tokens = torch.randint(0, cfg.vocab_size, (world * B, T + 1), generator=torch.Generator().manual_seed(2))
    mine = tokens[rank * B : (rank + 1) * B]

    def steps(model, opt, batch, n):
        for _ in range(n):
            F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()

    ref = _model(cfg).train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    steps(ref, ref_opt, tokens, 2)
    ref_state = {n: t.clone() for n, t in ref.state_dict().items()}

    model = wrap_fsdp(_model(cfg).train(), ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps(model, opt, mine, 2)
    r = {
        "local_numel": sum(p.to_local().numel() for p in model.parameters()),
        "numel": sum(p.numel() for p in ref.parameters()),
    }
    full = full_model_state(model)  # rank 0 only
    if rank == 0:
        r["train_err"] = max((full[n] - t).abs().max().item() for n, t in ref_state.items())
    save_sharded(os.path.join(out, "sharded"), model, opt)

    other = _model(cfg).train()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)  # not the saved weights
    other = wrap_fsdp(other, ctx)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    load_sharded(os.path.join(out, "sharded"), other, other_opt)
    steps(model, opt, mine, 1)
    steps(other, other_opt, mine, 1)
    r["resume_err"] = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item()
        for a, b in zip(model.parameters(), other.parameters())
    )
    steps(ref, ref_opt, tokens, 1)
    r["ref_after_3"] = {n: t.clone() for n, t in ref.state_dict().items()} if rank == 0 else None
    r["ref_after_2"] = ref_state if rank == 0 else None
    return r
