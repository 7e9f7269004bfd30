"""Loading the model an :class:`~tserve.protocol.EngineConfig` names, for one of the runners.

:func:`load_engine_model` decides which runner serves it: the native runner
(numpy and the C kernels, no torch) for a GGUF file served as it is on CPU,
in whatever mix of formats, unless ``--gguf-runner`` or the device says
otherwise (the load log says which and why); else torch's forward pass
(``_load_torch``, the only place the engine imports torch). It blocks while
it reads, converts or packs the weights; the KV pool is sized later, by the
engine, from what it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tserve.gpu.gguf._file import GgufFile, read_vocab, sampling_metadata
from tserve.gpu.gguf._plan import layer_window
from tserve.gpu.gguf._vocab import end_of_generation_ids
from tserve.gpu.models import _placement as placement
from tserve.gpu.models._directory import (
    DEFAULT_MODEL_NAME,
    ModelLoadError,
    default_cache_root,
    default_gguf,
)
from tserve.gpu.scheduling._kv_groups import KVGroups
from tserve.gpu.scheduling._sequence import ScheduledChunk
from tserve.protocol import EngineConfig

__all__ = ["LoadedModel", "Progress", "Runner", "is_default_gguf", "load_engine_model"]

Progress = Callable[[str], None]


class Runner(Protocol):
    """What the engine needs of a runner (ModelRunner, NativeRunner)."""

    @property
    def num_blocks(self) -> int: ...

    # int64 [1]: grows with each layer ``execute`` finishes; read from another thread.
    progress: np.ndarray

    def execute(self, chunks: list[ScheduledChunk]) -> Any: ...


@dataclasses.dataclass
class LoadedModel:
    """A model loaded for one of the runners, before its KV pool is sized."""

    config: Any  # a transformers config or a GgufConfig: read alike
    model_path: Path  # the directory of its tokenizer files
    model_name: str  # its name in EngineReady
    tokenizer: object | None  # a transformers tokenizer, or None: the files'
    eos_token_ids: tuple[int, ...]
    gguf_sampling: dict[str, Any]  # a GGUF file's general.sampling.*
    defaults_dir: Path  # where a generation_config.json would be
    device: str
    kv_dtype: str  # a --kv-cache-dtype name, "auto" resolved
    kv_itemsize: int
    layer_windows: tuple[int, ...]  # each layer's sliding window as its runner runs it (0: none)
    runner: Callable[[int, KVGroups], Runner]  # given the KV pool's blocks and layer groups
    bundled: bool = False  # the bundled default model's file (its card's sampling values)


def load_engine_model(config: EngineConfig, progress: Progress) -> LoadedModel:
    """The model ``config`` names, on the runner that serves it (see the module)."""
    default = config.model == "default"
    path = default_gguf() if default else Path(config.model).expanduser()
    cache = Path(config.cache_dir) if config.cache_dir else default_cache_root()
    bundled = default or is_default_gguf(path)
    is_gguf = path.suffix == ".gguf" and path.is_file()
    as_is = is_gguf and not config.dequantize
    native, file = _choose_runner(config, path, progress) if as_is else (False, None)
    if native:
        assert file is not None
        loaded = _load_native(config, file, cache, progress)
    else:
        loaded = _load_torch(config, path, cache, progress, default=default, as_is=as_is, file=file)
    if default:
        loaded.model_name = "SmolLM2-135M-Instruct"
    loaded.bundled = bundled
    if is_gguf and not as_is:
        # Its conversion keeps neither its end-of-turn markers nor its
        # sampling metadata (the bundled file states none: its card's apply).
        loaded.eos_token_ids = tuple(sorted({*loaded.eos_token_ids, *_file_eog_ids(path)}))
        if config.generation_config == "auto" and not bundled:
            loaded.gguf_sampling = sampling_metadata(path)
    return loaded


def _file_eog_ids(path: Path) -> tuple[int, ...]:
    """The ids that end a generation by GGUF file ``path``'s vocabulary (none
    where tserve cannot read it: its conversion's tokenizer then decides)."""
    try:
        return end_of_generation_ids(read_vocab(path))
    except ModelLoadError:
        return ()


def _choose_runner(
    config: EngineConfig, path: Path, progress: Progress
) -> tuple[bool, GgufFile | None]:
    """Whether the native runner serves GGUF file ``path`` (the engine then
    imports no torch), and the file where it was read to decide; the reason
    said when not. Raises ModelLoadError where ``gguf_runner`` "native" was
    asked for and cannot be."""
    from tserve.gpu.forward._native import native_problem

    file = None
    problem = placement.native_config_problem(config, cuda=placement.cuda_possible())
    if problem is None:
        file = GgufFile(path, has_kernels=True)
        problem = native_problem(file)
        if problem is None:
            return True, file
    if config.gguf_runner == "native":
        raise ModelLoadError(f"--gguf-runner native cannot serve {path.name}: {problem}")
    progress(f"{path.name} runs on torch's forward pass, not the native runner: {problem}")
    return False, file


def _load_native(
    config: EngineConfig, file: GgufFile, cache: Path, progress: Progress
) -> LoadedModel:
    """``file`` on the native runner: numpy and the C kernels, no torch."""
    from tserve.gpu.forward._native import KV_STORAGE, NativeModel, NativeRunner
    from tserve.gpu.kernels._library import set_threads

    where = _on("cpu", config.threads)
    progress(f"loading {file.path} as it is, on {where}, on the native runner (no torch)")
    activations = config.gguf_activations
    model = NativeModel(file, cache_dir=cache, progress=progress, activations=activations)
    set_threads(model.quant.library, config.threads)
    kv_dtype = placement.kv_dtype(config, "float32")

    def runner(num_blocks: int, groups: KVGroups) -> Runner:
        return NativeRunner(
            model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            kv_dtype=kv_dtype,
            kv_groups=groups,
        )

    return LoadedModel(
        config=model.config,
        model_path=model.tokenizer_dir.resolve(),
        model_name=file.path.name,
        tokenizer=None,  # llguidance reads the tokenizer.json there
        eos_token_ids=_eos_ids(model.config, None),
        gguf_sampling=model.sampling,
        defaults_dir=file.path.parent,
        device="cpu",
        kv_dtype=kv_dtype,
        kv_itemsize=np.dtype(KV_STORAGE[kv_dtype]).itemsize,
        layer_windows=tuple(
            layer_window(model.config, i) for i in range(model.config.num_hidden_layers)
        ),
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
) -> LoadedModel:
    """``path`` on torch's forward pass (the only place the engine imports torch):
    a GGUF file as it is (CPU fp32; ``file``: it, read already), a GGUF file's
    fp32 conversion, or a model directory."""
    import torch

    from tserve.gpu.forward._gguf import load_gguf
    from tserve.gpu.forward._quant import quant_kernels
    from tserve.gpu.forward._runner import (
        KV_CACHE_DTYPES,
        ModelRunner,
        kv_windows,
        resolve_device,
    )
    from tserve.gpu.gguf._convert import converted_gguf_dir
    from tserve.gpu.models._directory import load_model

    torch.set_num_threads(max(1, config.threads))
    device, dtype = resolve_device(config)
    dtype_name = str(dtype).removeprefix("torch.")
    model: Any
    if as_is:
        problem = placement.as_is_problem(path.name, str(device), dtype_name)
        if problem is not None:
            raise ModelLoadError(problem)
        progress(
            f"loading {path} as it is, on {_on(str(device), config.threads)}, "
            "on torch's forward pass"
        )
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
        progress(f"loading {path} on {_on(str(device), config.threads)} ({dtype})")
        model, tokenizer = load_model(path, device=device, dtype=dtype)
        model_config, model_path, sampling = model.config, path.resolve(), {}
        eos = _eos_ids(model, tokenizer)
    kv_name = placement.kv_dtype(config, dtype_name)
    kv_dtype = KV_CACHE_DTYPES[kv_name]

    def runner(num_blocks: int, groups: KVGroups) -> Runner:
        return ModelRunner(
            model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            cpu_gemm=config.cpu_gemm,
            model_impl=config.model_impl,
            kv_groups=groups,
        )

    return LoadedModel(
        config=model_config,
        model_path=model_path,
        model_name=path.name,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        gguf_sampling=sampling,
        defaults_dir=defaults_dir,
        device=str(device),
        kv_dtype=kv_name,
        kv_itemsize=kv_dtype.itemsize,
        layer_windows=kv_windows(model, config.model_impl),
        runner=runner,
    )


def is_default_gguf(path: Path) -> bool:
    """Whether ``path`` is the bundled default model's file (named by its path)."""
    try:
        return path.suffix == ".gguf" and path.resolve() == default_gguf().resolve()
    except ModelLoadError:  # the package is not installed: it cannot be
        return False


def _eos_ids(model: object, tokenizer: object) -> tuple[int, ...]:
    """EOS ids of a model (its generation config and config) or of a config (a
    GGUF file's: every id that ends a generation), and the tokenizer's."""
    ids: set[int] = set()
    sources = (getattr(model, "generation_config", None), getattr(model, "config", model))
    for source in sources:
        ids.update(getattr(source, "end_of_generation_ids", ()))
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return tuple(sorted(ids))


def _on(device: str, threads: int) -> str:
    """Where a model runs, as its loading line says it: on CPU with its threads."""
    if device != "cpu":
        return device
    count = max(1, threads)
    return f"cpu, {count} thread" if count == 1 else f"cpu, {count} threads"
