"""GGUF files, read without torch: the weight plan both forward passes
consume, so their parity is structural.

* ``_file.py`` — a file's tensors as numpy views of the mapping (Q/K rows
  back in rotate-half order), its metadata as a config, its tokenizer's
  directory; bad files refused in one line.
* ``_plan.py`` — the weight plan: the model the metadata describe
  (``GgufConfig``), which tensors make each part of a layer per
  architecture, the windows, the embedding scale, the RoPE tables.
* ``_vocab.py`` — the file's tokenizer from its metadata as llama.cpp reads
  it (SentencePiece and byte-level BPE), and the ids that end a generation.
* ``_convert.py`` — ``--dequantize``: the file as an fp32 transformers
  directory, by the weight plan, with its tokenizer.
"""
