"""What a model is and where it runs; no torch at module level, and nothing
else of :mod:`tserve.gpu`.

* ``_architectures.py`` — the decoder architectures tserve's own forward
  pass runs, as data: one :class:`Architecture` row per family (norm
  placement, activation, biases, Q/K norms, RoPE, windows, soft-caps), looked
  up by GGUF or transformers name. A new family is a row here and a test.
* ``_directory.py`` — finding, converting, caching and loading model
  directories and encoders; the default models.
* ``_placement.py`` — the one decision of runner, device, dtype and KV dtype,
  from the config, the machine and the file.
* ``_sampling_defaults.py`` — what a model recommends sampling with
  (``--generation-config``), for requests that leave it unset.
"""
