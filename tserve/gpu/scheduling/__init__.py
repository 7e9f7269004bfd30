"""Continuous batching and the KV cache's accounting: plain Python and
sans-IO (no torch, zmq or trio), and nothing else of :mod:`tserve.gpu`.

* ``_scheduler.py`` — which tokens of which requests run in a step.
* ``_budget.py`` — a step's prefill budget beside its decodes.
* ``_sequence.py`` — one record per request, and one chunk of work in a step.
* ``_kv.py`` — the paged block allocator with the prefix cache, a block
  table per layer group, blocks behind a sliding window given back.
* ``_kv_groups.py`` — which layers share a KV block: groups of one window
  each.
* ``_step_layout.py`` — a step's tokens over the paged pool (positions, K/V
  slots, block tables) as numpy arrays, for both runners.
"""
