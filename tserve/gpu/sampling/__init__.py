"""The next token of each row: numpy and the compiled kernels, no torch (every runner shares it).

* ``_sampler.py`` — each request's next token from its logits, one request
  failing alone.
* ``_candidates.py`` — a sampled row's candidates under temperature, top-k
  and top-p, and the draw among them (numpy, and the compiled pass where
  most of a row can be drawn).
* ``_compiler.py`` — structured outputs' grammars, compiled off the step loop
  in one thread (a bounded cache, failures cached with their errors).
* ``_constraints.py`` — each constrained request's matcher and masks: which
  requests are ready, each row's mask in the mask threads, each token fed.
"""
