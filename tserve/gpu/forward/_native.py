"""A GGUF model served without torch: numpy buffers and the C kernels alone.

On CPU every layer of a quantized step already runs in one C call
(``_decoder_kernels.c``); what torch adds around it in the engine process
is its import, about 220 MB of its 391 MB resident after loading the default
model. :class:`NativeModel` holds a GGUF file's weights as the kernels read
them (numpy arrays: packed panels for int8 products, the file's rows where
they lie in the mapping otherwise, norms and the RoPE table), and
:class:`NativeRunner` runs a step over them with the same contract as
:meth:`~tserve.gpu.forward._runner.ModelRunner.execute`:

1. the embedding of every token (the C dequantizer's rows, or an F32
   table's rows);
2. every layer by :class:`~tserve.gpu.kernels._decoder_abi.DecoderStep` over the
   step's tokens in schedule order, in calls of at most
   :data:`~tserve.gpu.kernels._decoder_abi.MAX_FUSED_TOKENS` tokens: attention reads
   the pool through per-token block tables, so a later call attends to the
   K/V an earlier one wrote (a piece of one token attends as a decode does,
   any longer piece exactly as within the whole);
3. the final RMSNorm and the output head on the sampled rows only.

Each is the kernel the torch forward pass runs on CPU (the fused decoder,
``tserve_add_rms_norm``, the head's product by its route), so a step gives
the logits of the torch path's fused step bit for bit. The torch path runs
a long prefill chunk through its SDPA and dequantized-weight products
instead; those agree with the kernels' results up to float rounding.

Every file :class:`~tserve.gpu.gguf._file.GgufFile` reads qualifies, in any
mix of its formats (:data:`~tserve.gpu.kernels._quant_abi.FORMATS`) across and
within layers: a product whose tensors differ in format (Q4_K_M's Q6_K
``attn_v`` beside Q4_K ``attn_q`` and ``attn_k``) runs as one product of
parts, each on its own format's kernel, and F32 weights on the F32 kernel.
Only an absent compiled library keeps a file on the torch path
(:func:`native_problem`).

Threads: the products' OpenMP threads, set by the engine
(:func:`~tserve.gpu.kernels._library.set_threads`, ``--threads``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import numpy as np

from tserve.gpu.gguf._file import (
    EMBEDDING,
    F32,
    OUTPUT_NORM,
    GgufFile,
    tokenizer_dir,
)
from tserve.gpu.gguf._plan import (
    embed_scale,
    head_name,
    layer_norms,
    layer_products,
    layer_vectors,
    layer_window,
    rope_tables,
)
from tserve.gpu.kernels._decoder_abi import (
    ACTIVATIONS,
    MAX_FUSED_TOKENS,
    DecoderShape,
    DecoderStep,
    LayerPointers,
    Part,
    Product,
    add_rms_norm,
    decoder_step,
    product,
    product_route,
    run_product,
)
from tserve.gpu.kernels._heap import WeightArena, untouched_pages
from tserve.gpu.kernels._library import KV_CODES
from tserve.gpu.kernels._quant_abi import Activations, QuantLibrary, quant_library
from tserve.gpu.models._architectures import soft_cap
from tserve.gpu.models._directory import ModelLoadError, ProgressCallback
from tserve.gpu.scheduling._kv_groups import KVGroups
from tserve.gpu.scheduling._sequence import ScheduledChunk
from tserve.gpu.scheduling._step_layout import lay_out, token_tables

__all__ = ["KV_STORAGE", "NativeModel", "NativeRunner", "native_problem"]

KV_STORAGE: Final[dict[str, type[np.generic]]] = {
    "fp32": np.float32,
    "fp16": np.float16,
    "bf16": np.uint16,
}
"""What the pool's arrays hold per ``--kv-cache-dtype``: bf16 as its 16 bits
(numpy has no bf16; the C code reads and writes them by ``KV_CODES``)."""


def _address(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _untouched(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
    """Zeros of ``shape`` that take no memory until written (:func:`untouched_pages`)."""
    count = math.prod(shape)
    pages = untouched_pages(count * np.dtype(dtype).itemsize)
    return np.frombuffer(pages, dtype=dtype, count=count).reshape(shape)


def native_problem(file: GgufFile) -> str | None:
    """Why :class:`NativeModel` cannot run ``file``, or None when it can."""
    if quant_library() is None:
        return "tserve's compiled kernels are not built"
    return None


class NativeModel:
    """A GGUF file's weights as ``_decoder_kernels.c`` reads them (numpy), for a
    file :func:`native_problem` accepts; raises ModelLoadError otherwise. Its
    products treat their activations as ``activations`` says
    (:mod:`tserve.gpu.forward._quant`), as the torch path's do.

    Keeps every array the kernels point into (and, through them, the file's
    mapping); the pages of tensors it holds only as a copy (joined, reordered,
    packed) are let go once it is built. Blocks (file IO and packing).
    """

    def __init__(
        self,
        file: GgufFile,
        *,
        cache_dir: Path,
        progress: ProgressCallback,
        activations: Activations = "fp32",
    ) -> None:
        quant = quant_library()
        problem = native_problem(file)
        if problem is not None or quant is None:
            raise ModelLoadError(f"{file.path.name} cannot run natively: {problem}")
        progress(file.describe())
        self.quant: QuantLibrary = quant
        self.config = config = file.config
        self.sampling = file.sampling
        self.formats = file.formats
        self._file = file
        self._activations = activations
        self._held: list[np.ndarray] = []  # every array a pointer below points into
        # The products' weights, in the order a step reads them, on huge pages
        # (packed, or copied from the file). Bound: the file's size and a margin
        # for packing (at most 3 % more) and alignment; past it, the heap.
        self._arena = WeightArena(int(file.path.stat().st_size * 1.05) + (8 << 20))
        self.product_bytes = 0
        """Bytes of the products' weights: what one decode step reads."""
        self.rope_cos, self.rope_sin = (self._hold(t) for t in rope_tables(config))
        self.local_rope: tuple[int, int] | None = None
        """The sliding-window layers' own RoPE table (addresses), or None: the global one."""
        if config.local_rope_theta:
            cos, sin = (_address(self._hold(t)) for t in rope_tables(config, local=True))
            self.local_rope = cos, sin
        self.embed_scale = np.float32(embed_scale(config))
        self.layers = [self._layer(i) for i in range(config.num_hidden_layers)]
        self.head, self._head_packed = self._product([head_name(config)], [None])
        self.norm = self._hold(file.vector(OUTPUT_NORM))
        self._embed_rows: np.ndarray | None = None  # an F32 table's rows
        if config.tie_word_embeddings and self._head_packed:
            # One copy of the tied rows, packed: the head's bytes, unpacked per token.
            head = self.head.parts[0]
            self._embed_fmt, self._embed_data = head.fmt, int(head.data)
            self._embed_packed = True
        else:
            self._embed_fmt, rows = file.rows(EMBEDDING)
            self._embed_data, self._embed_packed = _address(self._hold(rows)), False
            if self._embed_fmt == F32:
                self._embed_rows = self._held[-1].view(np.float32)
        file.release_unused((_address(a), _address(a) + a.nbytes) for a in self._held)
        self.tokenizer_dir = tokenizer_dir(file.path, cache_dir, progress, file.vocab)

    def _hold(self, a: np.ndarray) -> np.ndarray:
        held = np.ascontiguousarray(a)
        self._held.append(held)
        return held

    def _product(self, names: list[str], permutes: list[int | None]) -> tuple[Product, bool]:
        """The product over ``names``' rows, one part per run of a format, and
        whether its first part reads a packed weight."""
        k = self._file.in_features(names[0])
        parts, packs = [], []
        for fmt, rows in self._file.parts(names, permutes):
            n = rows.shape[0]
            route, packed = product_route(fmt, self._activations)
            arena = self._arena
            data = self._hold(
                self.quant.pack(fmt, rows, n, k, arena.take) if packed else arena.copy(rows)
            )
            self.product_bytes += data.nbytes
            parts.append(Part(_address(data), n, route, fmt))
            packs.append(packed)
        return product(k, parts), packs[0]

    def _layer(self, i: int) -> tuple[tuple[Product, ...], tuple[int, ...], dict[str, int]]:
        """Layer ``i``'s ``(qkv, o, gate_up, down)``, ``(attn_norm, mlp_norm)`` and
        the addresses of its architecture's optional vectors by
        :class:`~tserve.gpu.kernels._decoder_abi.LayerPointers` field."""
        products = [self._product(*spec)[0] for spec in layer_products(self.config, i).values()]
        norms = [_address(self._hold(self._file.vector(n))) for n in layer_norms(i).values()]
        extras = {
            name: _address(self._hold(self._file.joined(names)))
            for name, names in layer_vectors(self.config, i).items()
        }
        window = extras["window"] = layer_window(self.config, i)
        if window and self.local_rope is not None:
            extras["rope_cos"], extras["rope_sin"] = self.local_rope
        return tuple(products), tuple(norms), extras

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """fp32 ``[len(tokens), hidden]``: the embedding rows of ``tokens`` (int64)."""
        hidden = self.config.hidden_size
        if self._embed_rows is not None:
            rows: np.ndarray = self._embed_rows[tokens]
        else:
            rows = np.empty((len(tokens), hidden), dtype=np.float32)
            index = np.ascontiguousarray(tokens, dtype=np.int64)
            self.quant.dequantize_rows(
                self._embed_fmt, self._embed_data, hidden, index, rows, packed=self._embed_packed
            )
        if self.embed_scale != 1:
            rows *= self.embed_scale  # a copy already (fancy indexing or the dequantized rows)
        return rows


class NativeRunner:
    """Executes scheduled chunks over :class:`NativeModel` with a paged KV pool of
    ``num_blocks * block_size`` slots in ``kv_dtype`` (``fp32``, ``fp16``,
    ``bf16``); the pool's pages are taken only as K/V is written. A step runs
    in fused calls of at most ``max_tokens`` tokens.
    Owns the pool. Not thread-safe: one owner calls it; :attr:`progress` may be
    read from any thread."""

    def __init__(
        self,
        model: NativeModel,
        *,
        num_blocks: int,
        block_size: int,
        kv_dtype: str = "fp32",
        max_tokens: int = MAX_FUSED_TOKENS,
        kv_groups: KVGroups | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        config = model.config
        groups = kv_groups or KVGroups.single(config.num_hidden_layers)
        if groups.num_layers != config.num_hidden_layers:
            raise ValueError(
                f"{groups.num_layers} layers in KV groups, not {config.num_hidden_layers}"
            )
        self.kv_groups = groups
        self.model = model
        self.vocab_size = config.vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_dtype = kv_dtype
        slots = num_blocks * block_size
        shape = (groups.group_size, config.num_key_value_heads, slots, config.head_dim)
        self.k_pool, self.v_pool = (_untouched(shape, KV_STORAGE[kv_dtype]) for _ in "kv")
        library = model.quant.library
        self._library = library
        layers = []
        for i, ((qkv, o, gate_up, down), (attn_norm, mlp_norm), extras) in enumerate(model.layers):
            group, row = groups.place(i)
            pools = _address(self.k_pool[row]), _address(self.v_pool[row])
            layers.append(
                LayerPointers(
                    qkv, o, gate_up, down, attn_norm, mlp_norm, *pools, **extras, group=group
                )
            )
        shape_ = DecoderShape(
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rope_cos=_address(model.rope_cos),
            rope_sin=_address(model.rope_sin),
            num_slots=slots,
            block_size=block_size,
            eps=config.rms_norm_eps,
            kv_type=KV_CODES[kv_dtype],
            isa=model.quant.best_isa,
            activation=ACTIVATIONS[config.architecture.activation],
            softcap=config.attn_softcap,
        )
        self.progress = np.zeros(1, dtype=np.int64)
        """Layers run so far (int64 ``[1]``): the C code adds one after each layer
        of each fused call, so it grows while :meth:`execute` works."""
        step = decoder_step(library, layers, shape_, max_tokens, _address(self.progress))
        if step is None:
            raise ModelLoadError(
                f"the model's layers differ in their products' shapes (max_tokens {max_tokens})"
            )
        self._step: DecoderStep = step

    @property
    def max_tokens(self) -> int:
        """The most tokens one call of the fused decoder takes: longer steps split."""
        return self._step.max_tokens

    def execute(self, chunks: Sequence[ScheduledChunk]) -> np.ndarray:
        """Run ``chunks`` (any mix of prefill chunks and decodes) as one step.

        Writes each chunk's K/V into its sequence's slots and returns fp32
        logits ``[n, vocab]`` for the chunks with ``sample=True``, in chunk
        order. Blocks until done. Token ids must be < vocab size (checked at
        admission, not here).
        """
        if not chunks:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        groups = self.kv_groups.num_groups
        layout = lay_out(chunks, self.block_size, groups)
        tables, rows = token_tables(chunks, layout.offsets, self.block_size, groups)
        tokens = layout.tokens
        positions, slots = layout.positions, layout.slots  # rows of one C array: contiguous
        residual = self.model.embed(tokens)  # [T, hidden]; the sums accumulate here
        hidden = residual.shape[1]
        width, step = tables.shape[2], self._step.max_tokens
        strides = {"slot_stride": len(tokens), "table_stride": tables[0].size}
        for start in range(0, len(tokens), step):
            count = min(step, len(tokens) - start)
            self._step(
                _address(residual) + 4 * hidden * start,
                count,
                _address(positions) + 8 * start,
                _address(slots) + 8 * start,
                _address(tables),
                width,
                _address(rows) + 8 * start,
                **strides,
            )
        keep = [layout.offsets[i + 1] - 1 for i, c in enumerate(chunks) if c.sample]
        return self._head(residual[keep])

    def _head(self, last: np.ndarray) -> np.ndarray:
        """The final norm and the output head over the rows ``last`` [r, hidden]."""
        model = self.model
        rows, hidden = last.shape
        logits = np.empty((rows, self.vocab_size), dtype=np.float32)
        if rows:
            normed = np.empty_like(last)
            add_rms_norm(self._library)(
                _address(last), None, _address(model.norm), _address(normed), rows, hidden,
                model.config.rms_norm_eps, 0,
            )  # fmt: skip
            run_product(self._library, model.head, model.quant.best_isa, _address(normed),
                        rows, _address(logits))  # fmt: skip
            if model.config.final_softcap:
                soft_cap(logits, model.config.final_softcap)
        return logits
