"""The compiled kernels and how Python reaches them; imports nothing else of
:mod:`tserve.gpu`.

``setup.py`` builds ``_cpu_kernels.c`` (fused fp32 ops, the dense panel
product), ``_quant_kernels.c`` (the block formats' products),
``_kquant_kernels.c`` (the K-quants'), ``_attention_kernels.c`` (flash
attention tiles) and ``_decoder_kernels.c`` (a quantized step's every layer
in one call) into one library; the ISA is chosen at run time.

* ``_library.py`` — loads that library once (ctypes); its OpenMP threads; no
  torch.
* ``_quant_abi.py`` — the quantized formats' table and the C entry points
  both runners call (products, dequantized rows, packing at load); no torch.
* ``_decoder_abi.py`` — ``_decoder_kernels.c``'s structs and calls over raw
  pointers; no torch.
* ``_cpu_kernels.py`` — the fused fp32 kernels (add + RMSNorm, RoPE + K/V
  store, paged decode attention, the few-rows panel product) as torch ops.
* ``_heap.py`` — the engine process's glibc heap: a step's memory kept,
  what loading freed given back once.
"""
