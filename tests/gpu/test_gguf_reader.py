"""tserve's GGUF reader (``tserve/gpu/gguf/_file.py``) reads every metadata field
and tensor as the ``gguf`` package's own reader does, its arrays in one pass:
the same fields, parts, indices, types and contents, in either byte order; a
file cut short inside an array is the one-line refusal of any truncated file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.gpu.tiny_vocabs import PIECES, sentencepiece_vocab
from tserve.gpu.gguf._file import _reader, read_vocab
from tserve.gpu.models._directory import ModelLoadError, default_gguf


def _file(path: Path, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    """A GGUF file with a tokenizer (strings, floats, ints), empty arrays, an
    array of bools, scalars of several types and two small tensors."""
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    sentencepiece_vocab(PIECES).write(writer)
    writer.add_array("test.empty_strings", [])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.unicode", ["é", "日本", ""])
    writer.add_uint8("test.uint8", 7)
    writer.add_float64("test.float64", 0.25)
    writer.add_string("test.string", "a string")
    writer.add_tensor("a", np.arange(6, dtype=np.float32))  # in the file's order
    writer.add_tensor("b", np.ones((2, 3), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _same_as_the_package(path: Path) -> None:
    theirs, ours = gguf.GGUFReader(path, "c"), _reader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types)
        assert [(p.dtype, p.shape, p.tobytes()) for p in mine.parts] == [
            (p.dtype, p.shape, p.tobytes()) for p in field.parts
        ], name
        assert mine.contents() == field.contents(), name
    assert [(t.name, t.data_offset, t.data.tobytes()) for t in ours.tensors] == [
        (t.name, t.data_offset, t.data.tobytes()) for t in theirs.tensors
    ]


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_field_reads_as_the_gguf_package_reads_it(
    tmp_path: Path, endianess: gguf.GGUFEndian
) -> None:
    _same_as_the_package(_file(tmp_path / "m.gguf", endianess))


def test_the_default_model_reads_as_the_gguf_package_reads_it() -> None:
    _same_as_the_package(default_gguf())  # 49k tokens and 48k merges


def test_a_file_cut_inside_its_token_list_is_refused_in_one_line(tmp_path: Path) -> None:
    path = _file(tmp_path / "m.gguf")
    data = path.read_bytes()
    start = data.index(b"hello")  # a token of tokenizer.ggml.tokens
    path.write_bytes(data[: start + 2])
    with pytest.raises(ModelLoadError) as raised:
        read_vocab(path)
    assert str(raised.value) == (
        f"m.gguf: the file is cut short: it has {start + 2:,} bytes and its contents "
        f"run to byte {start + 5:,} at least"
    )
