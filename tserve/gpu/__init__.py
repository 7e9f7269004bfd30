"""The engine process: plain blocking pyzmq, no trio; torch only where the
model needs it (a GGUF file served as it is on CPU runs on
:mod:`tserve.gpu.forward._native` without it: the engine loop and every
module that path imports import no torch at module level). Imports only
:mod:`tserve.protocol` (and :mod:`tserve.validity`, :mod:`tserve.grammar`)
of the rest of tserve.

Sub-packages by job, each importing only those listed before it:

* ``kernels`` — the compiled C kernels, their formats and entry points
  (ctypes, no torch), the fused fp32 ops as torch ops, the process's heap.
  A new weight format goes here: its kernels, and a row of the formats' table.
* ``models`` — what a model is and where it runs: the architectures as data
  (a new family is a row there), finding and caching model directories, the
  placement (runner, device, dtypes), the model's recommended sampling.
* ``gguf`` — GGUF files: reading one, its weight plan (which tensors make
  each part of a layer), its tokenizer, ``--dequantize``'s conversion.
* ``scheduling`` — continuous batching and the KV cache's accounting
  (plain Python).
* ``sampling`` — the next token per row and structured outputs' grammars.
* ``forward`` — the forward passes (tserve's own over torch, the native one
  over numpy and C), the model runner, loading the runner a placement picks.
* ``engine`` — the step loop around a core, the socket, liveness, the cores
  (generation, embeddings, echo).

``__main__.py`` is the process's entry point (``python -m tserve.gpu``).
"""
