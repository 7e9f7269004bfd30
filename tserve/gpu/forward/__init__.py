"""The forward passes and the runner that drives one a step.

* ``_llama.py`` — :class:`PagedLlama`, tserve's own forward pass over torch
  for every architecture of :mod:`tserve.gpu.models._architectures`: fused
  products, the head on sampled rows only.
* ``_step_ops.py`` — the glue between a step's products as one interface
  (:class:`StepOps`), and its torch implementation for any device and dtype.
* ``_native.py`` — a GGUF file served without torch: its weights as numpy
  arrays the C kernels read, a step as the embedding, the fused decoder and
  the head (logits bit for bit the torch path's fused step's).
* ``_decoder.py`` — every layer of a quantized step in one C call.
* ``_gguf.py`` — a GGUF file as a :class:`PagedLlama` over its tensors in
  their own formats.
* ``_quant.py`` — linear layers and embeddings over quantized and 16-bit
  weights, through the kernels.
* ``_gemm.py`` — CPU linear layers on the library measured fastest.
* ``_attention_step.py`` — a step's attention layout over the KV pool, built
  once per step: padded attention groups, or each token's block tables.
* ``_attention.py`` — paged attention over the KV pool, plugged into
  transformers.
* ``_runner.py`` — one forward pass over the scheduled chunks; owns the KV
  pool; from the placement's device and dtype, the glue kernels and tuning.
* ``_load.py`` — loading the model a config names on the runner the
  placement picked, saying why; EOS ids, sampling metadata.
"""
