"""Interop: kvlm models in the Hugging Face and lm-evaluation-harness worlds, and models from them into kvlm.

Modules (each imports its optional dependency, transformers or lm-eval, at its top, so importing this package
imports neither):

- ``hf_config.py``: ``KVLMConfig``, the transformers configuration (model_type "kvlm") around a kvlm
  ``ModelConfig``.
- ``hf_modeling.py``: ``KVLMForCausalLM`` (``PreTrainedModel`` + ``GenerationMixin`` around a ``KVLM``) and
  ``KVLMCache``, which keeps kvlm's compact cache (MLA's latent ``c_kv``, never per-head K/V) under
  transformers' ``generate``, beam search included.
- ``hf.py``: importing it registers "kvlm" with ``AutoConfig`` / ``AutoModelForCausalLM`` (``import
  kvlm.interop.hf``; ``import kvlm`` alone registers nothing); ``to_hf(model)``, ``hf_tokenizer``, and
  ``export_hf(checkpoint, out)`` (``kvlm export-hf``): a transformers folder, loadable with or without kvlm.
- ``remote_code.py``: the code an exported folder carries for ``trust_remote_code=True`` (kvlm's modules as
  flat files, their kvlm imports made relative by the parser; two small entry files).
- ``lm_eval.py``: lm-eval's model "kvlm" (``HFLM`` around ``KVLMForCausalLM``) and ``run_lm_eval``
  (``kvlm eval --tasks``).
- ``deepseek_v3.py`` / ``llama.py``: kvlm MLA <-> transformers' own ``DeepseekV3ForCausalLM`` (both ways) and
  kvlm MHA/GQA/MQA -> ``LlamaForCausalLM``: ``kvlm export-hf --format deepseek-v3 | llama``, folders that stock
  transformers, vLLM and SGLang load without kvlm; what a format cannot hold is refused by name (FormatError).
- ``mlra_import.py``: checkpoints of the MLRA authors' code (their model/mla.py, mlra_2.py, mlra_4.py) -> kvlm
  (``kvlm import-hf --mlra-code``), their MLRA-2 block pairing renumbered to the paper's.
- ``hf_folder.py``: ``load_model_folder``, a kvlm checkpoint or a Hugging Face folder (any export, Llama, dense
  DeepseekV3) as a kvlm model (``kvlm generate`` / ``kvlm eval`` take either).
- ``tokenizer_meta.py``: special-token roles and chat template kept in a checkpoint's meta.json on import, given
  back on export.
- ``convert.py``: ``import_llama`` (a Llama-architecture HF model -> kvlm mha/gqa/mqa, same logits) and
  ``gqa_to_mla`` (TransMLA / MHA2MLA-style conversion to MLA, exact at full rank) (``kvlm import-hf``).
"""
