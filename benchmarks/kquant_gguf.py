"""A K-quant GGUF made from another: its weights whose rows are whole super-blocks
requantized (a benchmark input; llama.cpp's ``llama-quantize`` writes real ones).

Run: ``python -m benchmarks.kquant_gguf OUT.gguf [--gguf IN.gguf] [--mix Q4_K_M]
[--ggml-lib PATH/libggml-base.so]``

Every 2-D weight is dequantized and quantized again in the ``--mix``:
``Q4_K``, ``Q5_K``, ``Q6_K`` (all of them in it), or ``Q4_K_M`` /
``Q5_K_M`` as llama.cpp mixes them (Q6_K for the output head, a tied
embedding, and ``attn_v`` / ``ffn_down`` of its "more bits" layers, the rest
Q4_K or Q5_K); a weight whose rows are not whole super-blocks (SmolLM2's
576) takes llama.cpp's fallback instead (Q4_K: Q5_0, Q5_K: Q5_1, Q6_K:
Q8_0). Norms, and the metadata, are copied as they are. The K-quantizer is
ggml's own (``ggml_quantize_chunk``) with ``--ggml-lib``, else the tests'
plain min/max fit (``tests/gpu/kquant_blocks.py``); the fallbacks are
``gguf``'s.
"""

from __future__ import annotations

import argparse
import ctypes
import re
from pathlib import Path
from typing import Any

import numpy as np

from tests.gpu import kquant_blocks
from tserve.gpu.models._directory import default_gguf

_MIXES = ("Q4_K_M", "Q5_K_M", *kquant_blocks.FORMATS)
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
"""llama.cpp's format for a weight whose rows are not whole super-blocks."""


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _target(name: str, mix: str, layers: int, tied: bool) -> str:
    if mix in kquant_blocks.FORMATS:
        return mix
    base = "Q4_K" if mix == "Q4_K_M" else "Q5_K"
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    match = re.fullmatch(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight", name)
    if match and _more_bits(int(match[1]), layers):
        return "Q6_K"
    return base


class _Ggml:
    """ggml's quantizers through ctypes."""

    def __init__(self, path: str) -> None:
        self._lib = ctypes.CDLL(path)
        self._lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self._lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ]  # fmt: skip

    def quantize(self, values: np.ndarray, fmt: str) -> np.ndarray:
        import gguf

        qtype = gguf.GGMLQuantizationType[fmt]
        rows, k = values.shape
        src = np.ascontiguousarray(values, dtype=np.float32)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        out = np.empty((rows, k // block * size), dtype=np.uint8)
        written = self._lib.ggml_quantize_chunk(
            int(qtype), src.ctypes.data, out.ctypes.data, 0, rows, k, None
        )
        assert written == out.nbytes, (written, out.nbytes)
        return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kquant_gguf", description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--mix", choices=_MIXES, default="Q4_K_M")
    parser.add_argument("--ggml-lib", default=None, help="libggml-base.so: ggml's quantizer")
    args = parser.parse_args()
    import gguf

    source = args.gguf or default_gguf()
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    quantize: Any = _Ggml(args.ggml_lib).quantize if args.ggml_lib else kquant_blocks.quantize
    writer = gguf.GGUFWriter(args.out, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    counts: dict[str, int] = {}
    tied = not any(tensor.name == "output.weight" for tensor in reader.tensors)
    for tensor in reader.tensors:
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        k = int(tensor.shape[0])
        if len(tensor.shape) == 2:
            fmt = _target(tensor.name, args.mix, layers, tied)
            values = gguf.quants.dequantize(tensor.data, qtype).reshape(-1, k)
            if k % kquant_blocks.SUPER:
                fmt = _FALLBACK[fmt]
                data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[fmt])
            else:
                data = quantize(values, fmt)
            writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType[fmt])
        else:
            fmt = qtype.name
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=qtype)
        counts[fmt] = counts.get(fmt, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out}: " + ", ".join(f"{n} {f}" for f, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
