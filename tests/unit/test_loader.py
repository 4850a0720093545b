"""Model path resolution and error messages; the GGUF Q/K un-permutation."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.model.loader import ModelLoadError, gguf_to_hf_name, load_model, unpermute_qk


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=str(missing)):
        load_model(str(missing))


def test_directory_without_model_says_what_was_expected(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_broken_gguf_names_the_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.gguf"):
        load_model(str(bad))


def test_hf_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 10, '
                                          '"hidden_size": 8, "intermediate_size": 8, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 2}')
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path))


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (the forward direction)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


@settings(max_examples=50, deadline=None)
@given(n_head=st.integers(1, 8), half_dim=st.integers(1, 8), cols=st.integers(0, 5))
def test_unpermute_inverts_llama_cpp_permute(n_head, half_dim, cols):
    rows = n_head * half_dim * 2
    shape = (rows, cols) if cols else (rows,)
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(w, n_head), n_head), w)


def test_gguf_names():
    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("blk.2.attn_k_norm.weight") == "model.layers.2.self_attn.k_norm.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    # Gemma 2/3: ffn_norm is the pre-MLP norm; two more norms follow attention and the MLP
    assert gguf_to_hf_name("blk.1.ffn_norm.weight", "gemma3") == \
        "model.layers.1.pre_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.1.post_ffw_norm.weight", "gemma2") == \
        "model.layers.1.post_feedforward_layernorm.weight"


def test_fast_gguf_reader_parses_what_gguf_reader_parses(tmp_path):
    """Every field (parts, data indices, types, contents) and tensor of a file with scalar,
    string, empty and nested arrays is what gguf's own reader gives."""
    import gguf

    from server.model.files import gguf_reader

    path = str(tmp_path / "fields.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("t.strings", ["", "a", "héllo", "x" * 300])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.0])
    w.add_array("t.bools", [True, False])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.string", "plain")
    w.add_uint32("t.u32", 42)
    w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want, got = gguf.GGUFReader(path), gguf_reader(path)
    assert list(got.fields) == list(want.fields)
    for name, f in want.fields.items():
        g = got.fields[name]
        assert (g.offset, g.data, g.types) == (f.offset, f.data, f.types), name
        assert len(g.parts) == len(f.parts), name
        for a, b in zip(g.parts, f.parts):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
        assert g.contents() == f.contents(), name
    assert got.fields["t.strings"].contents() == ["", "a", "héllo", "x" * 300]
    assert np.array_equal(got.tensors[0].data, want.tensors[0].data)
