"""Reading a GGUF file's key/value metadata: shared by the model loader and the tokenizer,
which reads its vocabulary from the same file (so neither has to import the other)."""
from __future__ import annotations


def field_value(reader, key: str, default=None):
    """The decoded value of metadata `key` of a GGUFFile (ember_cupy/gguf_file.py) or a
    gguf.GGUFReader, or default when absent."""
    metadata = getattr(reader, "metadata", None)
    if metadata is not None:
        return metadata.get(key, default)
    field = reader.fields.get(key)
    return default if field is None else field.contents()
