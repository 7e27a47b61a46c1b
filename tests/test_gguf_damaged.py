"""A GGUF cut short (an interrupted download) or damaged is refused with a ValueError that names the
file, wherever the damage lies: in the magic, the metadata, the tensor table or the tensor data;
never a struct.error, an IndexError or a silently shorter value (ember_cupy/gguf_file.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ember_cupy.gguf_file import GGUFFile
from ember_cupy.model.loader import default_model_path
from tiny_gguf import write_out

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _header_bytes() -> int:
    """Where the default model's tensor data starts (its header: metadata, vocabulary, tensor table)."""
    gguf = GGUFFile(default_model_path())
    return min(t.data.ctypes.data for t in gguf.tensors) - gguf._map.ctypes.data


def _first_bytes(tmp_path, count: int, name: str = "cut.gguf"):
    path = tmp_path / name
    with open(default_model_path(), "rb") as source:
        path.write_bytes(source.read(count))
    return path


@pytest.mark.parametrize("where", [0, 3, 4, 8, 23, 24, 40, 1000, 0.25, 0.5, 0.9, 0.999, 1.0, "data"])
def test_a_file_cut_short_anywhere_is_a_value_error_naming_it(tmp_path, where):
    header = _header_bytes()
    if where == "data":
        count = header + (1 << 20)
    else:
        count = where if isinstance(where, int) else int(header * where)
    path = _first_bytes(tmp_path, count)
    with pytest.raises(ValueError, match="cut.gguf"):
        GGUFFile(str(path))


def test_damaged_header_bytes_parse_or_raise_a_value_error(tmp_path):
    """Random bytes of the header changed, 60 files: each parses or raises ValueError."""
    header = _header_bytes()
    original = np.fromfile(default_model_path(), dtype=np.uint8, count=header + 4096)
    rng = np.random.default_rng(26)
    for trial in range(60):
        damaged = original.copy()
        at = rng.integers(4, header, size=rng.integers(1, 4))
        damaged[at] = rng.integers(0, 256, size=at.size)
        path = tmp_path / f"damaged-{trial}.gguf"
        damaged.tofile(path)
        try:
            GGUFFile(str(path))
        except ValueError:
            pass
        path.unlink()


def test_serve_on_a_cut_short_file_says_so_and_exits_non_zero(tmp_path):
    path = _first_bytes(tmp_path, 100_000)
    done = subprocess.run([sys.executable, "-m", "ember_cupy.cli", "serve", str(path), "--port", "0",
                           "--no-progress"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert done.returncode != 0
    assert "cut.gguf: the file ends inside its GGUF header" in done.stderr and "struct.error" not in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("the file ends inside its GGUF header") == 1


def _rewritten(source: str, out: str, edit) -> str:
    """`source` written again with its metadata passed through edit(dict) first."""
    import gguf
    src = GGUFFile(source)
    metadata = dict(src.metadata)
    edit(metadata)
    writer = gguf.GGUFWriter(out, metadata.pop("general.architecture"))
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
    for tensor in src.tensors:
        shape = tuple(reversed(tensor.shape))
        if tensor.tensor_type.name == "F32":
            writer.add_tensor(tensor.name, np.frombuffer(tensor.data.tobytes(), np.float32).reshape(shape))
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    write_out(writer)
    return out


METADATA_DAMAGE = {
    "embedding_length missing": (lambda m, a: m.pop(f"{a}.embedding_length"),
                                 r"{a}.embedding_length must be a positive whole number, got None"),
    "head_count a string": (lambda m, a: m.__setitem__(f"{a}.attention.head_count", "four"),
                            r"{a}.attention.head_count must be a positive whole number, got 'four'"),
    "head_count zero": (lambda m, a: m.__setitem__(f"{a}.attention.head_count", 0),
                        r"{a}.attention.head_count must be a positive whole number, got 0"),
    "block_count missing": (lambda m, a: m.pop(f"{a}.block_count"), r"{a}.block_count must be a positive"),
    "vocabulary missing": (lambda m, a: m.pop("tokenizer.ggml.tokens"),
                           r"tokenizer.ggml.tokens is missing or not a list of strings"),
    "token types short": (lambda m, a: m.__setitem__("tokenizer.ggml.token_type", m["tokenizer.ggml.token_type"][:-1]),
                          r"tokenizer.ggml.token_type holds \d+ entries for \d+ tokens"),
}


@pytest.mark.parametrize("damage", list(METADATA_DAMAGE))
def test_damaged_metadata_is_a_value_error_naming_the_key(tmp_path, damage):
    import json

    from ember_cupy import LLM
    from tiny_gguf import write_tiny_gguf
    from tiny_model import write_tiny_checkpoint
    weights = write_tiny_checkpoint(tmp_path / "hf")
    good = write_tiny_gguf(tmp_path / "good.gguf", weights, json.loads((tmp_path / "hf" / "config.json").read_text()))
    arch = GGUFFile(good).metadata["general.architecture"]
    LLM(_rewritten(good, str(tmp_path / "same.gguf"), lambda m: None), num_kv_blocks=16)   # the copy loads
    edit, message = METADATA_DAMAGE[damage]
    path = _rewritten(good, str(tmp_path / "damaged.gguf"), lambda m: edit(m, arch))
    with pytest.raises(ValueError, match="damaged.gguf: .*" + message.format(a=arch)):
        LLM(path, num_kv_blocks=16)
