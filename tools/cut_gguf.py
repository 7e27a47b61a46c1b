"""Cut a GGUF model to its first N transformer blocks: metadata (tokenizer included), embedding,
output norm, LM head and blocks 0..N-1 are copied byte for byte; `<arch>.block_count` becomes N.

The default model (98.4 MB) is over what can travel with a device call (64 MiB); its first 12
blocks are ~56 MiB. The cut model is a different model (fewer layers), so a device check compares
it with the NumPy backend running the same cut file.

    python tools/cut_gguf.py OUT.gguf [--layers 12] [--model IN.gguf]
"""
from __future__ import annotations

import argparse
import re
import sys

import gguf

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def cut_gguf(source: str, destination: str, num_layers: int) -> int:
    """Write the first `num_layers` blocks of `source` to `destination`; returns tensors written."""
    reader = gguf.GGUFReader(source)
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    block_count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = _field(reader, block_count_key)
    if not 1 <= num_layers <= total:
        raise ValueError(f"{source} has {total} blocks; cannot keep {num_layers}")
    writer = gguf.GGUFWriter(destination, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue   # written by GGUFWriter itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = num_layers if field.name == block_count_key else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    kept = [t for t in reader.tensors if not _BLOCK.match(t.name) or int(_BLOCK.match(t.name)[1]) < num_layers]
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return len(kept)


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    if field is None:
        raise ValueError(f"GGUF file has no {key!r}")
    return field.contents()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--model", default=None, help="input GGUF (default: the default model)")
    args = parser.parse_args(argv)
    if args.model is None:
        from ember_cupy.model.loader import default_model_path
        args.model = default_model_path()
    count = cut_gguf(args.model, args.output, args.layers)
    print(f"{args.output}: {count} tensors, first {args.layers} blocks of {args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
