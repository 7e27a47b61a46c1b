"""The engine's outputs, under their public name (`from ember_cupy.outputs import RequestOutput`)."""
from ember_cupy.engine.outputs import (
    CompletionOutput,
    DeltaAccumulator,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    OutputKind,
    RequestOutput,
)

__all__ = ["CompletionOutput", "DeltaAccumulator", "EmbeddingOutput", "EmbeddingRequestOutput", "OutputKind",
           "RequestOutput"]
