"""A Hugging Face model folder with a damaged or mismatched file is refused with a ValueError that
names the file (or the tensor) and what is wrong, never a KeyError, a TypeError, a
SafetensorError or a failed concatenation (model/hf_loader.py, model/checkpoint.py)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ember_cupy import LLM
from tiny_gguf import write_tiny_gguf
from tiny_model import write_tiny_checkpoint


def _safetensors(folder) -> str:
    return str(next(folder.glob("*.safetensors")))


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _cut(path: str, size: int):
    with open(path, "r+b") as f:
        f.truncate(size)


def _reshape_q(folder):
    path = _safetensors(folder)
    tensors = load_file(path)
    name = next(k for k in tensors if "q_proj" in k)
    tensors[name] = np.zeros((3, 5), tensors[name].dtype)
    save_file(tensors, path)


def _header_a_list(folder):
    path = _safetensors(folder)
    data = open(path, "rb").read()
    header = b"[1, 2]"
    rest = data[8 + int.from_bytes(data[:8], "little"):]
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + rest)


DAMAGE = {
    "safetensors header not an object": (_header_a_list, r"model.safetensors: a damaged safetensors header"),
    "safetensors cut in its data": (lambda d: _cut(_safetensors(d), os.path.getsize(_safetensors(d)) // 2),
                                    r"model.safetensors: tensor .* lies beyond the end of the file .*cut short"),
    "safetensors cut in its header": (lambda d: _cut(_safetensors(d), 20),
                                      r"model.safetensors: the file ends inside its safetensors header"),
    "config.json not JSON": (lambda d: (d / "config.json").write_text('{"hidden_size": '),
                             r"config.json: not valid JSON"),
    "config.json a list": (lambda d: (d / "config.json").write_text("[1, 2]"), r"config.json: not a JSON object"),
    "a size as a string": (lambda d: _edit_config(d, hidden_size="32"),
                           r"config.json: hidden_size must be a positive whole number, got '32'"),
    "a size missing": (lambda d: _edit_config(d, num_hidden_layers=None),
                       r"config.json: num_hidden_layers must be a positive whole number, got None"),
    "zero heads": (lambda d: _edit_config(d, num_attention_heads=0), r"num_attention_heads must be a positive"),
    "tokenizer.json damaged": (lambda d: (d / "tokenizer.json").write_text('{"model": 3}'),
                               r"tokenizer.json: not a tokenizer the tokenizers library can read"),
    "tokenizer_config.json damaged": (lambda d: (d / "tokenizer_config.json").write_text("[1,2"),
                                      r"tokenizer_config.json: not valid JSON"),
    "a tensor of the wrong shape": (_reshape_q, r"tensor layers.0.q has shape \(3, 5\); the model's configuration "
                                                r"asks for \(32, 32\)"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_folder_is_a_value_error_saying_what_and_where(tmp_path, damage):
    write_tiny_checkpoint(tmp_path)
    LLM(str(tmp_path), num_kv_blocks=16)         # whole, it loads
    change, message = DAMAGE[damage]
    change(tmp_path)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), num_kv_blocks=16)


def test_a_gguf_whose_tensor_disagrees_with_its_metadata_names_the_tensor(tmp_path):
    config = write_tiny_checkpoint(tmp_path / "hf")
    weights = {**config}
    name = next(k for k in weights if "up_proj" in k)
    weights[name] = weights[name][:-2]               # fewer rows than intermediate_size
    path = write_tiny_gguf(tmp_path / "tiny.gguf", weights, json.loads((tmp_path / "hf" / "config.json").read_text()))
    with pytest.raises(ValueError, match=r"tiny.gguf: tensor layers.0.up has shape \(62, 32\); the model's configuration "
                                         r"asks for \(64, 32\)"):
        LLM(path, num_kv_blocks=16)
