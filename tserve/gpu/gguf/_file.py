"""Reading a GGUF file: its tensors as numpy views of the mapping, its metadata
as a config, its tokenizer's directory; no torch.

:class:`GgufFile` maps the file (``gguf.GGUFReader``, copy-on-write, so
nothing is written back), checks its architecture (one of
:data:`~tserve.gpu.models._architectures.ARCHITECTURES`; any other is refused in one
line) and that every tensor is in a format tserve
multiplies by (one of :data:`~tserve.gpu.kernels._quant_abi.FORMATS`; any
other is a :class:`~tserve.gpu.models._directory.ModelLoadError` naming the tensor
and its format: ``--dequantize`` serves the file through the fp32 conversion
instead), and reads its metadata into a :class:`GgufConfig`. Weights come
out as raw rows (one per output feature, as GGUF stores them), Q and K rows
in the rotate-half order tserve's RoPE uses (llama.cpp's converter stores a
``llama`` file's in interleaved-pair order: they are put back). The torch forward pass builds its
modules over them (:mod:`tserve.gpu.forward._gguf`), the native runner its arrays
(:mod:`tserve.gpu.forward._native`); whatever a model holds a copy of, the file's
pages can leave the process's resident set (:meth:`GgufFile.release_unused`).

The tokenizer comes from files beside the file (``tokenizer.json`` in the
same directory) or else from its metadata (:mod:`tserve.gpu.gguf._vocab`),
written once into a small cache directory as a model directory's tokenizer
files, which the API process reads as it reads any model directory's.

Blocks (file IO; the first build of a file's tokenizer takes seconds).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import mmap
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from tserve.gpu.gguf._plan import EMBEDDING, OUTPUT_NORM, GgufConfig, head_name, tensor_shapes
from tserve.gpu.gguf._vocab import (
    GgufVocab,
    VocabError,
    end_of_generation_ids,
    write_tokenizer_files,
)
from tserve.gpu.kernels._quant_abi import FORMATS
from tserve.gpu.models._architectures import Architecture, UnknownArchitecture, gguf_architecture
from tserve.gpu.models._directory import ModelLoadError, ProgressCallback, publish_dir, staging_dir
from tserve.gpu.models._sampling_defaults import GGUF_SAMPLING_PREFIX

__all__ = [
    "EMBEDDING",
    "F32",
    "OUTPUT_NORM",
    "GgufConfig",
    "GgufFile",
    "read_vocab",
    "sampling_metadata",
    "tokenizer_dir",
]

F32: Final = 0
"""GGML's id of F32, the format of plain fp32 tensors (no kernel of its own)."""
_TOKENIZER_COMPLETE: Final = ".tserve-tokenizer"
# The cache's layout version: a directory written by an older builder is not reused.
_TOKENIZER_VERSION: Final = 2


def _reader(path: Path) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` (copy-on-write mapping) over a plain
    ndarray view of its mapping: slicing the ``np.memmap`` it makes costs a
    memmap object per metadata item (30 s for SmolLM2's 49k-token vocabulary
    on a busy machine, 5 s this way). Tensors' data stay views of the mapping.

    Its metadata arrays are read in one pass each (:func:`_array_parts`)
    rather than one recursive call per item, into the same fields: every load
    reads the whole vocabulary (about 2 s of a cold load for SmolLM2's
    tokens and merges on a busy machine, 0.1 s this way)."""
    from gguf import GGUFReader, GGUFValueType

    class Reader(GGUFReader):
        _plain: np.ndarray

        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapping: np.ndarray) -> None:
            self._plain = np.asarray(mapping)

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            # Every read of the header, the metadata and the tensors' data passes here.
            end = offset + np.dtype(dtype).itemsize * int(count)
            if end > self._plain.shape[0]:
                raise _Truncated(
                    f"{path.name}: the file is cut short: it has {self._plain.shape[0]:,} bytes "
                    f"and its contents run to byte {end:,} at least"
                )
            return super()._get(offset, dtype, count, override_order)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type == GGUFValueType.ARRAY:
                parts = _array_parts(self, orig_offs)
                if parts is not None:
                    return parts
            return super()._get_field_parts(orig_offs, raw_type)

    return Reader(path, "c")


def _array_parts(reader: Any, offset: int) -> Any:
    """``GGUFReader._get_field_parts`` for the array at ``offset`` when its items
    are scalars or strings, in one pass: the same parts (one view per item,
    two per string: its length and its bytes), indices and types; None for
    an array of arrays (the reader's own recursion reads those)."""
    from gguf import GGUFValueType

    raw_itype = reader._get(offset, np.uint32)
    alen = reader._get(offset + 4, np.uint64)
    itype, count = GGUFValueType(int(raw_itype[0])), int(alen[0])
    types = [GGUFValueType.ARRAY] + ([itype] if count else [])
    start = offset + 12
    scalar = reader.gguf_scalar_to_np.get(itype)
    if scalar is not None:
        values = reader._get(start, scalar, count)
        parts = [raw_itype, alen, *values.reshape(count, 1)]
        return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), types
    if itype != GGUFValueType.STRING:
        return None
    plain: np.ndarray = reader._plain
    size = plain.shape[0]
    length_type = np.dtype(np.uint64).newbyteorder(reader.byte_order)
    unpack = struct.Struct(">Q" if length_type.byteorder == ">" else "<Q").unpack_from
    parts, at, raw = [raw_itype, alen], start, plain.data
    for _ in range(count):
        end = at + 8
        if end > size:
            reader._get(at, np.uint64)  # raises that the file is cut short
        (length,) = unpack(raw, at)
        if end + length > size:
            reader._get(end, np.uint8, length)  # the same
        parts.append(plain[at:end].view(length_type))
        parts.append(plain[end : end + length])
        at = end + length
    return at - offset, parts, list(range(3, 3 + 2 * count, 2)), types


class _Truncated(ValueError):
    """A GGUF file that ends before its header, metadata or tensors do."""


def _open(path: Path) -> Any:
    try:
        return _reader(path)
    except _Truncated as exc:
        raise ModelLoadError(str(exc)) from None
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read {str(path)!r} as GGUF: {exc}") from exc


class _Metadata:
    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def with_prefix(self, prefix: str) -> dict[str, Any]:
        return {
            key: field.contents() for key, field in self._fields.items() if key.startswith(prefix)
        }

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self._path.name}: no {key!r} in its metadata")
        return value


class GgufFile:
    """A GGUF file of an architecture tserve runs whose every tensor it runs.

    ``has_kernels`` False (the compiled library is absent) makes any tensor
    not in F32 an error; ``dequantize`` (its fp32 conversion) allows any
    format. Raises ModelLoadError naming the file, and the tensor where one
    is the problem. The arrays it hands out are views of
    the file's mapping (or copies where rows are reordered or joined).
    """

    def __init__(self, path: Path, *, has_kernels: bool, dequantize: bool = False) -> None:
        self.path = path
        reader = _open(path)
        self._tensors: dict[str, Any] = {tensor.name: tensor for tensor in reader.tensors}
        meta = _Metadata(reader, path)
        try:
            arch = gguf_architecture(meta.get("general.architecture"))
        except UnknownArchitecture as exc:
            raise ModelLoadError(f"{path.name}: {exc}") from exc
        self.formats = _check_formats(path, self._tensors.values(), has_kernels, dequantize)
        """GGUF format name -> tensors in it."""
        self.vocab = None if _tokenizer_beside(path) else _vocab(meta)
        """Its ``tokenizer.*`` metadata (a vocabulary tserve builds), or None
        where a ``tokenizer.json`` beside the file is its tokenizer."""
        config = _config(meta, self._tensors, arch)
        _check_tensors(path, self._tensors, config, meta, self.vocab)
        if self.vocab is not None:
            eog = end_of_generation_ids(self.vocab)
            config = dataclasses.replace(config, end_of_generation_ids=eog)
        self.config = config
        self.sampling: dict[str, Any] = meta.with_prefix(GGUF_SAMPLING_PREFIX)
        """Its ``general.sampling.*`` metadata (full key -> value)."""

    def describe(self) -> str:
        """One line: the file's name and its tensors by format."""
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.formats.items()))
        return f"{self.path.name}: {counts} tensors"

    def _tensor(self, name: str) -> Any:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path.name}: no tensor {name!r}")
        return tensor

    def has(self, name: str) -> bool:
        return name in self._tensors

    def fmt(self, name: str) -> int:
        """GGML format id of tensor ``name``."""
        return int(self._tensor(name).tensor_type)

    def in_features(self, name: str) -> int:
        """The values in one row of weight ``name``."""
        return int(self._tensor(name).shape[0])

    def rows(self, name: str, permute_heads: int | None = None) -> tuple[int, np.ndarray]:
        """``(format, raw rows [out, bytes] uint8)``; with ``permute_heads``, Q/K
        rows of that many heads back in rotate-half order (a strided view)."""
        tensor = self._tensor(name)
        out = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1
        rows = tensor.data.view(np.uint8).reshape(out, -1)
        if permute_heads is not None:
            # GGUF rows of a head: pairs (i, i + D/2) interleaved; back to halves.
            rows = rows.reshape(permute_heads, -1, 2, rows.shape[1]).swapaxes(1, 2)
            rows = rows.reshape(out, -1)
        return int(tensor.tensor_type), rows

    def parts(
        self, names: Sequence[str], permute_heads: Sequence[int | None] | None = None
    ) -> list[tuple[int, np.ndarray]]:
        """``(format, rows)`` of one weight whose outputs are ``names``' outputs,
        concatenated: neighbours of one format joined (a copy when more than
        one), one part per run of a format, in order."""
        heads = permute_heads or [None] * len(names)
        runs: list[tuple[int, list[np.ndarray]]] = []
        for name, h in zip(names, heads, strict=True):
            fmt, rows = self.rows(name, h)
            if runs and runs[-1][0] == fmt:
                runs[-1][1].append(rows)
            else:
                runs.append((fmt, [rows]))
        return [(fmt, rows[0] if len(rows) == 1 else np.concatenate(rows)) for fmt, rows in runs]

    def vector(self, name: str) -> np.ndarray:
        """A 1-D weight (a norm's) in fp32: a view of the file where it is F32."""
        tensor = self._tensor(name)
        if int(tensor.tensor_type) != F32:
            return np.asarray(tensor.data, dtype=np.float32).reshape(-1)
        data: np.ndarray = tensor.data.reshape(-1)
        return data

    def joined(self, names: Sequence[str]) -> np.ndarray:
        """The 1-D weights ``names`` one after another, in fp32 (a new array)."""
        return np.concatenate([self.vector(name) for name in names])

    def release_unused(self, held: Iterable[tuple[int, int]]) -> None:
        """Let go of the pages of every tensor whose bytes lie in none of the
        address ranges ``held`` (``[start, end)``: what a model holds in place;
        it holds a copy of the rest: joined, reordered or packed), by
        :func:`_release_pages`. Blocks for a moment."""
        spans = list(held)
        for tensor in self._tensors.values():
            low = tensor.data.ctypes.data
            high = low + tensor.data.nbytes
            if not any(start < high and low < end for start, end in spans):
                _release_pages(tensor.data)


def sampling_metadata(path: Path) -> dict[str, Any]:
    """``path``'s ``general.sampling.*`` metadata (full key -> value), for a file
    served through its fp32 conversion, which keeps none of it. Blocking: the
    whole metadata is read (seconds for a large vocabulary)."""
    return _Metadata(_open(path), path).with_prefix(GGUF_SAMPLING_PREFIX)


def _check_formats(
    path: Path, tensors: Iterable[Any], has_kernels: bool, dequantize: bool
) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in tensors:
        name = tensor.tensor_type.name
        if dequantize:
            counts[name] = counts.get(name, 0) + 1
            continue
        if name != "F32" and name not in FORMATS:
            raise ModelLoadError(
                f"{path.name}: tensor {tensor.name!r} is {name}, which tserve has no kernel "
                f"for (it runs {', '.join(FORMATS)}); --dequantize serves the file as fp32"
            )
        if name != "F32" and not has_kernels:
            raise ModelLoadError(
                f"{path.name}: tensor {tensor.name!r} is {name}, and tserve's compiled kernels "
                "are not built (pip install -e . builds them); --dequantize serves it as fp32"
            )
        counts[name] = counts.get(name, 0) + 1
    return counts


def _check_tensors(
    path: Path,
    tensors: dict[str, Any],
    config: GgufConfig,
    meta: _Metadata,
    vocab: GgufVocab | None,
) -> None:
    """That every tensor the weight plan reads is there in the shape the metadata
    give it, and that the embedding, the output head, the metadata and the
    tokenizer (``vocab``: the file's own) agree on the vocabulary's size;
    else ModelLoadError, one line naming what disagrees. Reads no weight."""
    rows = config.vocab_size
    sizes = {f"the output head ({head_name(config)!r})": _shape(tensors[head_name(config)])[-1]}
    stated = meta.get(f"{config.architecture.name}.vocab_size")
    if stated is not None:
        sizes[f"'{config.architecture.name}.vocab_size'"] = int(stated)
    if vocab is not None:
        sizes["its tokenizer"] = len(vocab.tokens)
    for what, size in sizes.items():
        if size != rows:
            raise ModelLoadError(
                f"{path.name}: the vocabulary has {size:,} tokens by {what} "
                f"but {rows:,} by the embedding ({EMBEDDING!r})"
            )
    for name, want in tensor_shapes(config).items():
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{path.name}: no tensor {name!r}")
        if _shape(tensor) != want:
            raise ModelLoadError(
                f"{path.name}: tensor {name!r} has shape {list(_shape(tensor))}, not the "
                f"{list(want)} its metadata give it"
            )


def _shape(tensor: Any) -> tuple[int, ...]:
    """A tensor's shape in GGUF's order (a row's length first), trailing 1s dropped."""
    dims = [int(d) for d in tensor.shape]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(dims)


def _config(meta: _Metadata, tensors: dict[str, Any], architecture: Architecture) -> GgufConfig:
    """The model that the metadata describes."""
    arch = architecture.name
    rope_factors = any(name.startswith("rope_factors_") for name in tensors)
    if rope_factors or meta.get(f"{arch}.rope.scaling.type") not in (
        None,
        "none",
        "linear",
    ):
        raise ModelLoadError(
            f"{meta._path.name}: its RoPE scaling is not one tserve reads from GGUF; "
            "--dequantize serves it through transformers"
        )
    heads = int(meta.need(f"{arch}.attention.head_count"))
    hidden = int(meta.need(f"{arch}.embedding_length"))
    linear = meta.get(f"{arch}.rope.scaling.type") == "linear"
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{meta._path.name}: RoPE on {rope_dims} of each head's {head_dim} dimensions "
            "(partial rotary) is not one tserve runs"
        )
    factors: tuple[float, ...] = ()
    if "rope_freqs.weight" in tensors:
        data = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        if data.shape[0] != head_dim // 2 or int(tensors["rope_freqs.weight"].tensor_type) != F32:
            raise ModelLoadError(
                f"{meta._path.name}: 'rope_freqs.weight' holds {data.shape[0]} factors, "
                f"not one F32 factor for each of its {head_dim // 2} RoPE frequencies"
            )
        factors = tuple(float(x) for x in data)
    embed = tensors[EMBEDDING]
    return GgufConfig(
        architecture=architecture,
        vocab_size=int(embed.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(meta.need(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta.need(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_linear_factor=float(meta.need(f"{arch}.rope.scaling.factor")) if linear else 1.0,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        rope_freq_factors=factors,
        attn_softcap=float(meta.get(f"{arch}.attn_logit_softcapping", architecture.attn_softcap)),
        final_softcap=float(
            meta.get(f"{arch}.final_logit_softcapping", architecture.final_softcap)
        ),
        sliding_window=int(meta.get(f"{arch}.attention.sliding_window", 0))
        if architecture.sliding_pattern
        else 0,
        local_rope_theta=float(
            meta.get(f"{arch}.rope.freq_base_swa", architecture.local_rope_base)
        ),
    )


_MADV_DONTNEED: Final = getattr(mmap, "MADV_DONTNEED", None)


@functools.cache
def _madvise() -> Any:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = (
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
        ctypes.c_int,
    )
    return madvise


def _release_pages(data: np.ndarray) -> None:
    """Drop the whole pages inside ``data``, a part of the file's private
    mapping that nothing wrote, from this process's resident set (``madvise``
    ``MADV_DONTNEED``): the page cache keeps them, and a later read faults them
    in again from the file, unchanged. Where there is no ``MADV_DONTNEED``, or
    the call fails, they stay resident; nothing else changes."""
    if _MADV_DONTNEED is None:
        return
    page = mmap.PAGESIZE
    start = -(-data.ctypes.data // page) * page
    end = (data.ctypes.data + data.nbytes) // page * page
    if end > start:
        _madvise()(start, end - start, _MADV_DONTNEED)


def tokenizer_dir(
    path: Path, cache_dir: Path, progress: ProgressCallback, vocab: GgufVocab | None = None
) -> Path:
    """The directory of the file's tokenizer files: beside it, or built once from
    its metadata (``vocab``, else :func:`read_vocab`'s) into ``cache_dir``.
    Blocking; raises ModelLoadError for a vocabulary tserve cannot build."""
    if _tokenizer_beside(path):
        return path.parent
    stat = path.stat()
    key = hashlib.blake2b(
        f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{_TOKENIZER_VERSION}".encode(),
        digest_size=8,
    ).hexdigest()
    target = cache_dir / "gguf-tokenizers" / f"{path.stem}-{key}"
    if (target / _TOKENIZER_COMPLETE).is_file():
        return target
    vocab = vocab or read_vocab(path)
    progress(f"writing {path.name}'s tokenizer ({vocab.model}) into {target} (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with staging_dir(target.parent) as staging:
        write_tokenizer_files(vocab, staging)
        publish_dir(staging, target, _TOKENIZER_COMPLETE, f"{path}\n")
    return target


def _tokenizer_beside(path: Path) -> bool:
    """Whether GGUF file ``path`` has a ``tokenizer.json`` beside it (which wins)."""
    return (path.parent / "tokenizer.json").is_file()


def read_vocab(path: Path) -> GgufVocab:
    """The ``tokenizer.*`` metadata of GGUF file ``path``. Blocking (the whole
    metadata is read: seconds for a large vocabulary); raises ModelLoadError
    naming the file for a vocabulary tserve cannot build."""
    return _vocab(_Metadata(_open(path), path))


def _vocab(meta: _Metadata) -> GgufVocab:
    try:
        keys = meta.with_prefix("tokenizer.")
        return GgufVocab.from_metadata({**keys, "general.name": meta.get("general.name")})
    except VocabError as exc:
        raise ModelLoadError(f"{meta._path.name}: {exc}") from exc
