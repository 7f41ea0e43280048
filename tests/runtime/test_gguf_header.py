"""runtime/model/gguf_header.py reads what llama.cpp's own reader (gguf.GGUFReader) reads: every metadata value,
every tensor's name, dimensions, type, place and bytes; a file cut anywhere in its header is a ValueError."""

import numpy as np
import pytest

from runtime.model.gguf_header import GGUFHeader


def _reference_value(field):
    """A gguf.GGUFReader field's value as the header gives it: a scalar, or a list for an array."""
    if len(field.types) > 1 and field.types[0].name == "ARRAY":
        return [field.contents(i) for i in range(len(field.data))]
    return field.contents()


def _assert_reads_as_gguf_reader(path):
    import gguf

    reader, header = gguf.GGUFReader(str(path)), GGUFHeader(path)
    keys = [name for name in reader.fields if not name.startswith("GGUF.")]
    assert keys and all(header.has(key) for key in keys)
    for key in keys:
        assert header.value(key) == _reference_value(reader.fields[key]), key
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.dims == tuple(int(d) for d in theirs.shape) and ours.qtype == int(theirs.tensor_type)
        assert (ours.data_offset, ours.n_bytes) == (int(theirs.data_offset), int(theirs.n_bytes))
        data = header.data(ours)
        assert data.dtype == theirs.data.dtype and data.shape == theirs.data.shape
        assert np.array_equal(data.view(np.uint8), theirs.data.view(np.uint8))


def test_a_real_file_reads_as_llama_cpps_reader_reads_it(smollm2_gguf):
    """SmolLM2's GGUF: 49,152 tokens and their merges (arrays of strings), scalars of several types, 272 tensors."""
    _assert_reads_as_gguf_reader(smollm2_gguf)


def _every_kind_of_value(path):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("test.u8", 200)
    writer.add_int8("test.i8", -100)
    writer.add_uint16("test.u16", 60000)
    writer.add_int16("test.i16", -30000)
    writer.add_uint32("test.u32", 4_000_000_000)
    writer.add_int32("test.i32", -2_000_000_000)
    writer.add_float32("test.f32", 0.1)
    writer.add_uint64("test.u64", 2**63 + 5)
    writer.add_int64("test.i64", -(2**62))
    writer.add_float64("test.f64", 1e-300)
    writer.add_bool("test.bool", True)
    writer.add_string("test.text", "naïve ☃")
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_array("test.floats", [0.5, -2.25])
    writer.add_array("test.strings", ["a", "", "ünï"])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((64,)).astype(np.float16))
    blocks = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_kind_of_value_reads_as_llama_cpps_reader_reads_it(tmp_path):
    path = _every_kind_of_value(tmp_path / "kinds.gguf")
    _assert_reads_as_gguf_reader(path)
    header = GGUFHeader(path)
    assert header.value("test.strings") == ["a", "", "ünï"] and header.value("test.ints") == [3, -1, 7]
    assert header.value("test.u64") == 2**63 + 5 and header.value("test.text") == "naïve ☃"


def test_a_header_cut_short_anywhere_is_a_value_error_naming_the_byte(tmp_path):
    whole = _every_kind_of_value(tmp_path / "kinds.gguf").read_bytes()
    header_end = GGUFHeader(tmp_path / "kinds.gguf").tensors[0].data_offset
    for cut in (6, 20, 60, header_end // 2, header_end - 40):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=r"cut short: \d+ bytes needed at byte \d+"):
            GGUFHeader(path)
    (tmp_path / "text.gguf").write_text("not a model at all")
    with pytest.raises(ValueError, match="magic"):
        GGUFHeader(tmp_path / "text.gguf")
