"""The engine process: plain blocking pyzmq, no trio; torch only where the
model needs it (a GGUF file served as it is on CPU runs on ``_native.py``
without it: ``_engine.py`` and every module that path imports import no
torch at module level). Imports only
:mod:`tserve.protocol` (and :mod:`tserve.validity`, :mod:`tserve.grammar`)
of the rest of tserve.

Modules:

* ``__main__.py`` — the process's entry point (``python -m tserve.gpu``).
* ``_process.py`` — the numbered step loop around a core: shutdown, engine
  death, dropping the requests of a peer that is gone.
* ``_heap.py`` — the process's glibc heap: a step's memory kept, what
  loading freed given back once.
* ``_bind.py`` — the ROUTER socket: its bounds; on a network address, ZMTP
  heartbeats and CURVE with pyzmq's ZAP authenticator.
* ``_lifeline.py`` — why an engine stops on its own: its parent gone (started
  by an API process) or SIGTERM/SIGINT (``tserve engine``), also mid-load.
* ``_outbox.py`` — per-peer output that never blocks a step (coalesces at HWM).
* ``_pulse.py`` — the heartbeats while a step runs, from a thread, only while
  the step makes progress; an orphaned engine ends even mid-step.
* ``_core.py`` — the :class:`Core` protocol the loop drives, and the
  bookkeeping every core shares: aborts, counters, the test-only forward
  fault; the tokenizer files sent to an API process on another host.
* ``_engine.py`` — :class:`EngineCore`, generation: scheduler + model runner +
  sampler, one forward pass per step.
* ``_engine_load.py`` — loading the model a config names: which runner
  serves it (native or torch's forward pass) and why, EOS ids, sampling
  metadata.
* ``_embed_core.py`` — :class:`EmbedCore`, embeddings: batched encoder passes,
  mean pooling.
* ``_echo_core.py`` — :class:`EchoCore`, no model: paced tokens echoing the
  prompt, to measure the frontend alone.
* ``_scheduler.py`` — continuous batching: which tokens of which requests run
  in a step (plain Python).
* ``_budget.py`` — a step's prefill budget beside its decodes (plain Python).
* ``_kv.py`` — KV-cache accounting: the paged block allocator, a block table
  per layer group, blocks behind a sliding window given back (plain Python).
* ``_kv_groups.py`` — which layers share a KV block: groups of one window each.
* ``_sequence.py`` — one record per request and the chunk of work in a step.
* ``_placement.py`` — the one decision of runner, device, dtype and KV
  dtype, from the config and the machine; no torch.
* ``_model_runner.py`` — one forward pass over the scheduled chunks; owns the
  KV pool; from the placement's device and dtype, picks the glue kernels,
  decode attention, tuning and the forward pass (``model_impl``).
* ``_architectures.py`` — the decoder architectures tserve's own forward pass
  runs, as data: one :class:`Architecture` row per family (biases, Q/K norms,
  GGUF Q/K order), looked up by GGUF or transformers name; no torch.
* ``_llama.py`` — :class:`PagedLlama`, tserve's own forward pass for every
  architecture of ``_architectures.py``: fused products over the loaded
  weights, the head on sampled rows only; its glue as :class:`StepOps`.
* ``_native.py`` — a GGUF file served without torch: :class:`NativeModel`
  (its weights as numpy arrays the C kernels read) and :class:`NativeRunner`
  (one step: embedding, the fused decoder in calls of at most 64 tokens, the
  head on sampled rows), logits bit for bit the torch path's fused step's.
* ``_decoder.py`` — every layer of a quantized model's short step in one C
  call (``_decoder_kernels.c``), for the model runner to hand ``_llama.py``.
* ``_gguf.py`` — a GGUF file as a :class:`PagedLlama` over its tensors in their
  own formats.
* ``_gguf_convert.py`` — ``--dequantize``: a GGUF file as an fp32 transformers
  directory, by the weight plan, with its tokenizer; no torch.
* ``_gguf_file.py`` — reading a GGUF file without torch: its tensors as numpy
  views of the mapping, its metadata as a config, its tokenizer's directory.
* ``_gguf_plan.py`` — the weight plan both GGUF builders read: the model a
  file's metadata describe (``GgufConfig``), which tensors
  make each part of a layer per architecture, windows, embedding scale, RoPE.
* ``_gguf_vocab.py`` — a GGUF file's tokenizer from its metadata, as llama.cpp
  reads it (SentencePiece and byte-level BPE), and the ids that end a
  generation; no torch.
* ``_step_layout.py`` — a step's tokens over the paged pool (positions, K/V
  slots, block tables) as numpy arrays, for both runners.
* ``_quant_abi.py`` — the quantized formats and the C entry points both runners
  call (products, dequantized rows, packing), no torch.
* ``_decoder_abi.py`` — ``_decoder_kernels.c``'s structs and calls over raw
  pointers, no torch.
* ``_quant.py`` — linear layers and embeddings over quantized (Q8_0, Q4_0,
  Q4_1; K-quants Q4_K, Q5_K, Q6_K) and 16-bit weights, through
  ``_quant_kernels.c`` and ``_kquant_kernels.c``.
* ``_attention.py`` — paged attention over the KV pool, plugged into
  transformers.
* ``_gemm.py`` — CPU linear layers on the library measured fastest.
* ``_cpu_kernels.py`` — fused fp32 CPU kernels for ``_llama.py`` (residual
  add + RMSNorm, RoPE + K/V store, paged decode attention) as torch ops.
* ``_library.py`` — loads the library ``setup.py`` compiles at install from
  the ``.c`` files (ctypes); its OpenMP threads; no torch.
* ``_sampler.py`` — the next token per request from its logits (numpy,
  no torch: the torch and the torch-free runners share it).
* ``_sampling_defaults.py`` — what a model recommends sampling with
  (``--generation-config``), for requests that leave it unset.
* ``_constraints.py`` — structured outputs: grammars compiled in a worker
  thread (bounded cache), each constrained row's mask (numpy), its matcher.
* ``_models.py`` — finding, converting and loading models and encoders.
"""
