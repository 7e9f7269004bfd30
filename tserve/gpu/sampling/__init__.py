"""The next token of each row: numpy, no torch (every runner shares it).

* ``_sampler.py`` — each request's next token from its logits, one request
  failing alone.
* ``_constraints.py`` — structured outputs: grammars compiled off the step
  loop (bounded cache), each constrained row's mask, its matcher.
"""
