"""The engine's step loop, in process and without sockets.

:class:`EngineCore` joins the scheduler (plain Python), the model runner and
the sampler. The runner is :class:`~tserve.gpu._native.NativeRunner` (numpy
and the C kernels) for a GGUF file served as it is on CPU whose every layer
fuses (``--gguf-runner``, its load log says which and why), else
:class:`~tserve.gpu._model_runner.ModelRunner`: torch is imported only then
(``_load_torch``), so an engine on the default model never imports it. One
:meth:`EngineCore.step` is one forward pass over every scheduled request.
Everything about ONE request — invalid parameters, token ids out of the
vocabulary, a prompt that can never fit, an error while sampling it — ends
that request alone with ``FinishReason.ERROR`` and frees its KV; only an
exception out of the batch itself (the forward pass, the device) escapes
``step()``, and the process treats that as fatal.

A request that leaves temperature, top_p or top_k unset samples with the
model's recommended value (read once at load, ``_sampling_defaults.py``),
else OpenAI's; the values are reported in ``EngineReady``.

It is a :class:`~tserve.gpu._core.Core`; the bookkeeping it shares with the
other cores (aborts, counters, the test-only forward fault) is in ``_core.py``.

A constrained request (``params.constraint``) waits in :class:`Constraints`
until its grammar is compiled (off the step loop), then joins the scheduler;
each step masks its row before sampling, feeds its sampled token to its
matcher, and ends it with STOP once the grammar is complete (see
``_constraints.py``). A token its grammar rejects, a grammar that fails or
times out, ends that request alone with ERROR.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tserve.gpu._constraints import Constraints, GrammarCompiler, MaskResult
from tserve.gpu._core import CoreBookkeeping, PeerOutput
from tserve.gpu._gguf_file import GgufFile, sampling_metadata
from tserve.gpu._kv import BlockManager, kv_budget_blocks, kv_token_bytes
from tserve.gpu._models import (
    DEFAULT_MODEL_NAME,
    ModelLoadError,
    converted_gguf_dir,
    default_cache_root,
    default_gguf,
)
from tserve.gpu._sampler import Sampler
from tserve.gpu._sampling_defaults import read_sampling_defaults
from tserve.gpu._scheduler import Scheduler
from tserve.gpu._sequence import ScheduledChunk, Sequence, SequenceStatus
from tserve.protocol import (
    AddRequest,
    EngineConfig,
    EngineStats,
    FinishReason,
    RequestOutput,
    TokenLogprob,
)
from tserve.validity import generation_problem

__all__ = ["EngineCore"]


Progress = Callable[[str], None]

# A step with nothing to run but grammars compiling waits this long (s) for
# one, instead of spinning; new frames wait at most this long for the loop.
_IDLE_COMPILE_WAIT = 0.005


class _Runner(Protocol):
    """What the engine needs of a runner (ModelRunner, NativeRunner)."""

    @property
    def num_blocks(self) -> int: ...

    def execute(self, chunks: list[ScheduledChunk]) -> Any: ...


@dataclasses.dataclass
class _Loaded:
    """A model loaded for one of the runners, before its KV pool is sized."""

    config: Any  # a transformers config or a GgufConfig: read alike
    model_path: Path  # the directory of its tokenizer files
    name_path: Path  # its name in EngineReady (unless the default model)
    tokenizer: object | None  # a transformers tokenizer, or None: the files'
    eos_token_ids: tuple[int, ...]
    gguf_sampling: dict[str, Any]  # a GGUF file's general.sampling.*
    defaults_dir: Path  # where a generation_config.json would be
    device: str
    kv_dtype: str  # a --kv-cache-dtype name, "auto" resolved
    kv_itemsize: int
    runner: Callable[[int], _Runner]  # given the KV pool's blocks


class EngineCore(CoreBookkeeping[Sequence]):
    """Continuous batching over one model. Not thread-safe; one owner calls it."""

    eos_token_ids: tuple[int, ...]

    def __init__(self, config: EngineConfig, progress: Progress = print) -> None:
        super().__init__()
        default = config.model == "default"
        path = default_gguf() if default else Path(config.model).expanduser()
        cache = Path(config.cache_dir) if config.cache_dir else default_cache_root()
        is_default = default or _is_default_gguf(path)
        as_is = path.suffix == ".gguf" and path.is_file() and not config.dequantize
        native, file = _choose_runner(config, path, progress) if as_is else (False, None)
        if native:
            assert file is not None
            loaded = _load_native(config, file, cache, progress)
        else:
            loaded = _load_torch(
                config, path, cache, progress, default=default, as_is=as_is, file=file
            )
        converted = not as_is and path.suffix == ".gguf" and path.is_file()
        if converted and config.generation_config == "auto" and not is_default:
            # Its conversion keeps none of its sampling metadata; the
            # bundled file states none (its card's values apply).
            loaded.gguf_sampling = sampling_metadata(path)
        model_config = loaded.config
        self.model_path = loaded.model_path
        self.eos_token_ids = loaded.eos_token_ids
        self.model_name = "SmolLM2-135M-Instruct" if default else loaded.name_path.name
        self.sampling_defaults = read_sampling_defaults(
            config.generation_config,
            model_dir=loaded.defaults_dir,
            gguf_metadata=loaded.gguf_sampling,
            default_model=is_default,
        )
        progress(self.sampling_defaults.describe())
        self.vocab_size = int(model_config.vocab_size)
        self.device = loaded.device
        token_bytes = kv_token_bytes(model_config, loaded.kv_itemsize)
        num_blocks = kv_budget_blocks(
            kv_cache_tokens=config.kv_cache_tokens,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            bytes_per_token=token_bytes,
            block_size=config.block_size,
        )
        model_len = int(getattr(model_config, "max_position_embeddings", 0) or 2048)
        # The context is capped by the model and by the whole KV budget.
        self.max_model_len = min(
            config.max_model_len or model_len, model_len, num_blocks * config.block_size
        )
        self.config = config
        self.runner = loaded.runner(num_blocks)
        tokenizer = loaded.tokenizer
        self.sampler = Sampler()
        self.blocks = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            max_decode_slowdown=config.max_decode_slowdown,
        )
        compiler = GrammarCompiler(
            _tokenizer_json(tokenizer, self.model_path),
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            cache_size=config.grammar_cache_size,
        )
        self.constraints = Constraints(
            compiler,
            compile_timeout=config.grammar_compile_timeout,
            vocab_size=self.vocab_size,
            threads=config.threads,
        )
        # Logprobs of tokens sampled but not yet reported; one entry per token.
        self._logprobs: dict[str, list[TokenLogprob]] = {}
        kv_tokens = num_blocks * config.block_size
        progress(
            f"engine ready: {self.model_name}, {kv_tokens} KV tokens "
            f"({loaded.kv_dtype}, {kv_tokens * token_bytes / 2**20:.0f} MiB)"
        )

    # -- requests in ---------------------------------------------------------

    def add(self, request: AddRequest, peer: bytes) -> None:
        """Queue a request; a request that can never run is answered with an error.

        An id already live for the SAME peer is dropped (see ``_core.py``); the
        same id from another peer is rejected to that peer alone.
        """
        if self._is_duplicate(request.request_id, peer):
            return
        problem = self._check(request)
        if problem is None:
            seq = Sequence(
                request.request_id,
                list(request.prompt_token_ids),
                request.params,
                peer=peer,
                deadline=request.deadline,
                defaults=self.sampling_defaults,
            )
            problem = self._queue(seq)
        if problem is not None:
            self._reject(peer, request.request_id, problem)

    def _queue(self, seq: Sequence) -> str | None:
        """Hand ``seq`` (valid: ``_check``) to the scheduler, or to the grammar
        compiler first; the problem when it can never run: its id is live (another
        peer's, waiting for its grammar or scheduled), or its grammar is refused."""
        if self.scheduler.get(seq.request_id) or self.constraints.has(seq.request_id):
            return f"request id {seq.request_id!r} is already in use"
        if seq.params.constraint is None:
            self.scheduler.add(seq)
            return None
        return self.constraints.add(seq, time.time())

    # Aborts (abort, abort_peer, abort_all) are CoreBookkeeping's; they free KV at once.

    def _matching(self, request_id: str, peer: bytes | None) -> list[Sequence]:
        seq = self.scheduler.get(request_id) or self.constraints.get_waiting(request_id)
        return [] if seq is None or (peer is not None and seq.peer != peer) else [seq]

    def _live(self) -> Iterable[Sequence]:
        return self.scheduler.sequences() + self.constraints.waiting()

    def _end_aborted(self, records: list[Sequence]) -> None:
        for seq in records:
            if self.scheduler.abort(seq.request_id) is None:  # waiting for its grammar
                self._end_unscheduled(seq, FinishReason.ABORT)
            self._finished(seq)

    def _end_unscheduled(
        self, seq: Sequence, reason: FinishReason, error: str | None = None
    ) -> None:
        """Finish a request the scheduler never got (it waited for its grammar)."""
        self.constraints.release(seq.request_id)
        seq.finish_reason = reason
        seq.error = error
        seq.transition(SequenceStatus.FINISHED)

    # -- the step --------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._pending) or bool(self.constraints.num_waiting)

    def step(self, now: float | None = None) -> list[PeerOutput]:
        """One step of continuous batching; returns (peer, output) pairs.

        At most one output per request: its new tokens (and logprobs), and
        its finish reason when it ended. ``now`` is the wall-clock time that
        deadlines are checked against (default ``time.time()``). Blocks for
        one forward pass. Raises only for a failure of the whole batch (the
        forward pass, the device), which is fatal.
        """
        now = time.time() if now is None else now
        for seq in self.scheduler.expire(now):  # 1 end expired requests
            self._finished(seq)
        self._take_compiled(now)  # 1b compiled grammars join the queue
        chunks = self.scheduler.schedule()  # 2 schedule (allocates KV)
        news: list[Sequence] = []
        if chunks:
            to_sample = [c.seq for c in chunks if c.sample]
            masks = self.constraints.start_masks(to_sample)  # 3a grammar masks, beside 3
            logits = self._forward(chunks)  # 3 ONE forward pass (fatal if it raises)
            sampled, failed = self._sample(to_sample, logits, masks())  # 4 sample, per request
            news = failed + self.scheduler.update(chunks, sampled)  # 5 update, free finished
            self._end_complete_grammars(news)
        elif self.constraints.num_waiting:
            self.constraints.wait(_IDLE_COMPILE_WAIT)  # nothing to run: do not spin
        outputs = self._take_pending()
        # A sequence is in ``news`` once: failed ones are skipped by update().
        outputs += [(seq.peer, self._output(seq)) for seq in news]  # 6 outputs
        return outputs

    def _forward(self, chunks: list[ScheduledChunk]) -> Any:
        """The sampled rows' logits: a numpy array (the native runner's) or a torch tensor."""
        self._count_step()
        return self.runner.execute(chunks)

    def _take_compiled(self, now: float) -> None:
        """Requests whose grammar is ready go to the scheduler; those whose grammar
        failed or timed out, or whose deadline passed while they waited, end."""
        ready, failed = self.constraints.take_ready(now)
        for seq in ready:
            self.scheduler.add(seq)  # valid, and its id unique: _queue
        for seq, error in failed:
            self._end_unscheduled(seq, FinishReason.ERROR, error)
            self._finished(seq)
        for seq in self.constraints.waiting():
            if seq.deadline is not None and seq.deadline <= now:
                self._end_unscheduled(seq, FinishReason.ABORT)
                self._finished(seq)

    def _end_complete_grammars(self, news: list[Sequence]) -> None:
        """End with STOP the requests whose grammar takes no more tokens."""
        for seq in news:
            if not seq.is_finished and self.constraints.finished(seq.request_id):
                self.scheduler.finish_stopped(seq.request_id)

    def _sample(
        self,
        to_sample: list[Sequence],
        logits: Any,
        grammar: MaskResult,
    ) -> tuple[dict[str, int], list[Sequence]]:
        """Sampled token per request id, and the requests that failed alone (now finished).

        ``logits [N, V]``: a numpy array, or a torch tensor on any device in any
        float dtype (brought to a CPU float32 array: zero-copy when it is one
        already). Constrained rows are masked by their grammar (``grammar``:
        their masks and the rows whose grammar failed), and their matchers
        advanced by the sampled token; a failing grammar fails its request.
        """
        masks, errors = grammar
        if not isinstance(logits, np.ndarray) and hasattr(logits, "numpy"):
            logits = logits.float().cpu().numpy()  # a torch tensor, named without torch
        results = self.sampler.sample(logits, to_sample, masks)
        sampled: dict[str, int] = {}
        failed: list[Sequence] = []
        for row, (seq, result) in enumerate(zip(to_sample, results, strict=True)):
            error = errors.get(row, result.error)
            if error is None and result.token_id is not None:
                error = self.constraints.advance(seq.request_id, result.token_id)
            if error is not None or result.token_id is None:
                self.scheduler.finish_with_error(seq.request_id, error or "no token")
                failed.append(seq)
                continue
            sampled[seq.request_id] = result.token_id
            if result.logprob is not None:
                self._logprobs.setdefault(seq.request_id, []).append(result.logprob)
        return sampled, failed

    def close(self) -> None:
        """Stop the grammar compile and mask threads: queued compiles are dropped;
        the interpreter's exit waits for the one compile in flight, if any."""
        self.constraints.close()

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting + self.constraints.num_waiting,
            kv_tokens_used=self.blocks.tokens_used,
            kv_tokens_total=self.blocks.tokens_total,
            steps=self._steps,
            aborts_received=self._aborts_received,
            prefix_cache_queries=self.blocks.prefix_cache_queries,
            prefix_cache_hits=self.blocks.prefix_cache_hits,
        )

    def _kv_tokens_total(self) -> int:
        return self.blocks.tokens_total

    def _kv_block_size(self) -> int:
        return self.blocks.block_size

    # -- internals -------------------------------------------------------------

    def _check(self, request: AddRequest) -> str | None:
        """The request's problem by the rule the API process applies first (``tserve.validity``)."""
        problem = generation_problem(
            request.prompt_token_ids,
            request.params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )
        return None if problem is None else problem.message

    def _finished(self, seq: Sequence) -> None:
        """Report a sequence that ended outside update() (abort, expiry, error)."""
        self._report(seq.peer, self._output(seq))

    def _output(self, seq: Sequence) -> RequestOutput:
        new = seq.output_token_ids[seq.num_sent :]
        seq.num_sent = len(seq.output_token_ids)
        logprobs = None
        if seq.params.logprobs is not None:
            held = self._logprobs.pop(seq.request_id, [])
            logprobs = held[-len(new) :] if new else []
        if seq.is_finished:
            self._logprobs.pop(seq.request_id, None)
            self.sampler.release(seq.request_id)
            self.constraints.release(seq.request_id)
        return RequestOutput(seq.request_id, new, seq.finish_reason, logprobs, seq.error)


def _choose_runner(
    config: EngineConfig, path: Path, progress: Progress
) -> tuple[bool, GgufFile | None]:
    """Whether the native runner serves GGUF file ``path`` (the engine then
    imports no torch), and the file where it was read to decide; the reason
    said when not. Raises ValueError where ``gguf_runner`` "native" was asked
    for and cannot be."""
    from tserve.gpu._native import native_problem

    file = None
    problem = _native_config_problem(config)
    if problem is None:
        file = GgufFile(path, has_kernels=True)
        problem = native_problem(file)
        if problem is None:
            return True, file
    if config.gguf_runner == "native":
        raise ValueError(f"--gguf-runner native cannot serve {path.name}: {problem}")
    progress(f"{path.name} runs on torch's forward pass, not the native runner: {problem}")
    return False, file


def _native_config_problem(config: EngineConfig) -> str | None:
    """What in ``config`` keeps a GGUF file off the native runner, or None."""
    if config.gguf_runner == "torch":
        return "--gguf-runner torch"
    if config.device not in ("auto", "cpu") or config.dtype not in ("auto", "float32"):
        return f"it runs on CPU in float32, not {config.device} {config.dtype}"
    if config.device == "auto" and _cuda_possible():
        return "a CUDA device may be present (--device cpu serves it natively)"
    if config.model_impl == "hf":
        return "--model-impl hf"
    return None


def _cuda_possible() -> bool:
    """Whether this machine may have a CUDA device (an NVIDIA driver's device
    files), told without importing torch."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def _load_native(config: EngineConfig, file: GgufFile, cache: Path, progress: Progress) -> _Loaded:
    """``file`` on the native runner: numpy and the C kernels, no torch."""
    from tserve.gpu._library import set_threads
    from tserve.gpu._native import KV_STORAGE, NativeModel, NativeRunner

    progress(f"loading {file.path} as it is, on cpu, on the native runner (no torch)")
    activations = config.gguf_activations
    model = NativeModel(file, cache_dir=cache, progress=progress, activations=activations)
    set_threads(model.quant.library, config.threads)
    kv_dtype = "fp32" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype

    def runner(num_blocks: int) -> _Runner:
        return NativeRunner(
            model, num_blocks=num_blocks, block_size=config.block_size, kv_dtype=kv_dtype
        )

    return _Loaded(
        config=model.config,
        model_path=model.tokenizer_dir.resolve(),
        name_path=file.path,
        tokenizer=None,  # llguidance reads the tokenizer.json there
        eos_token_ids=_eos_ids(model.config, None),
        gguf_sampling=model.sampling,
        defaults_dir=file.path.parent,
        device="cpu",
        kv_dtype=kv_dtype,
        kv_itemsize=np.dtype(KV_STORAGE[kv_dtype]).itemsize,
        runner=runner,
    )


def _load_torch(
    config: EngineConfig,
    path: Path,
    cache: Path,
    progress: Progress,
    *,
    default: bool,
    as_is: bool,
    file: GgufFile | None,
) -> _Loaded:
    """``path`` on torch's forward pass (the only place the engine imports torch):
    a GGUF file as it is (CPU fp32; ``file``: it, read already), a GGUF file's
    fp32 conversion, or a model directory."""
    import torch

    from tserve.gpu._gguf import load_gguf
    from tserve.gpu._model_runner import (
        KV_CACHE_DTYPES,
        ModelRunner,
        resolve_device,
        resolve_kv_dtype,
        runs_gguf,
    )
    from tserve.gpu._models import load_model
    from tserve.gpu._quant import quant_kernels

    torch.set_num_threads(max(1, config.threads))
    device, dtype = resolve_device(config)
    model: Any
    if as_is:
        if not runs_gguf(device, dtype):
            raise ValueError(
                f"{path.name} runs as it is on CPU in float32; on {device} ({dtype}) "
                "serve it with --dequantize"
            )
        progress(f"loading {path} as it is, on {device}, on torch's forward pass")
        gguf = load_gguf(
            path,
            kernels=quant_kernels(),
            cache_dir=cache,
            progress=progress,
            activations=config.gguf_activations,
            file=file,
        )
        model, model_config, tokenizer = gguf.model, gguf.config, None
        model_path, sampling = gguf.tokenizer_dir.resolve(), gguf.sampling
        defaults_dir = path.parent
        eos = _eos_ids(model_config, None)
    else:
        defaults_dir = path
        if path.suffix == ".gguf" and path.is_file():
            defaults_dir = path.parent
            name = DEFAULT_MODEL_NAME if default else None
            path = converted_gguf_dir(path, cache, name=name, progress=progress)
        progress(f"loading {path} on {device} ({dtype})")
        model, tokenizer = load_model(path, device=device, dtype=dtype)
        model_config, model_path, sampling = model.config, path.resolve(), {}
        eos = _eos_ids(model, tokenizer)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
    kv_name = next(name for name, d in KV_CACHE_DTYPES.items() if d == kv_dtype)

    def runner(num_blocks: int) -> _Runner:
        return ModelRunner(
            model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            cpu_gemm=config.cpu_gemm,
            model_impl=config.model_impl,
        )

    return _Loaded(
        config=model_config,
        model_path=model_path,
        name_path=path,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        gguf_sampling=sampling,
        defaults_dir=defaults_dir,
        device=str(device),
        kv_dtype=kv_name,
        kv_itemsize=kv_dtype.itemsize,
        runner=runner,
    )


def _is_default_gguf(path: Path) -> bool:
    """Whether ``path`` is the bundled default model's file (named by its path)."""
    try:
        return path.suffix == ".gguf" and path.resolve() == default_gguf().resolve()
    except ModelLoadError:  # the package is not installed: it cannot be
        return False


def _tokenizer_json(tokenizer: object, model_dir: Path) -> str:
    """The text of the model's ``tokenizer.json`` as its loaded tokenizer has it
    (the config's added tokens included), for llguidance; the file's when the
    tokenizer is not a fast one. Blocking file IO, once."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return str(backend.to_str())
    path = model_dir / "tokenizer.json"
    return path.read_text(encoding="utf-8") if path.is_file() else "{}"


def _eos_ids(model: object, tokenizer: object) -> tuple[int, ...]:
    """EOS ids of a model (its generation config and config) or of a config, and the tokenizer's."""
    ids: set[int] = set()
    sources = (getattr(model, "generation_config", None), getattr(model, "config", model))
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return tuple(sorted(ids))
