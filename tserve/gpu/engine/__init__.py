"""The engine process's loop, socket and liveness, and the cores it drives.

* ``_process.py`` — the numbered step loop around a core: shutdown, engine
  death, dropping the requests of a peer that is gone.
* ``_bind.py`` — the ROUTER socket: its bounds; on a network address, ZMTP
  heartbeats and CURVE with pyzmq's ZAP authenticator.
* ``_outbox.py`` — per-peer output that never blocks a step (coalesces at
  the high-water mark).
* ``_pulse.py`` — heartbeats while a step runs, from a thread, only while
  the step makes progress; an orphaned engine ends even mid-step.
* ``_lifeline.py`` — why an engine stops on its own: its parent gone, or
  SIGTERM/SIGINT (``tserve engine``), also mid-load.
* ``_core.py`` — the :class:`Core` protocol the loop drives, and the
  bookkeeping every core shares.
* ``_engine_core.py`` — :class:`EngineCore`, generation: scheduler + model
  runner + sampler, one forward pass per step.
* ``_embed_core.py`` — :class:`EmbedCore`, embeddings: batched encoder
  passes, mean pooling.
* ``_echo_core.py`` — :class:`EchoCore`, no model: paced tokens, to measure
  the frontend alone.
"""
