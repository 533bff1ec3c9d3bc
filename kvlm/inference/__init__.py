"""Inference: generation on the compact KV cache, sampling, and evaluation of a trained model.

- ``generation.py``: ``generate(model, prompts, max_new_tokens, ...)`` (also ``kvlm.generate``): left-pads a
  batch of prompts into one cache (``KVCache.set_left_padding``), prefills it (logits of the last prompt token
  only), then decodes one token per step through the model's route (``mode``: auto, absorbed, expand, naive);
  ``return_stats=True`` adds prefill and decode timings. ``TextStream``: ids -> text as they arrive.
- ``sampling.py``: ``sample`` (temperature, top-k, top-p, a seeded generator; temperature 0 is argmax),
  ``filter_logits``, ``check_sampling`` and ``StopTracker`` (which sequences stopped, and why).
- ``evaluation.py``: ``perplexity`` over (sliding) windows with a window-level standard error,
  ``repetition_metrics`` (distinct-n, rep-n) of ``sample_continuations``, ``load_eval_tokens`` from prepared
  data or raw text (``kvlm eval``).
"""
