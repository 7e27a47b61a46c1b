"""The engine's outputs, under their public name (`from ember_cupy.outputs import RequestOutput`)."""
from ember_cupy.engine.outputs import CompletionOutput, DeltaAccumulator, OutputKind, RequestOutput

__all__ = ["CompletionOutput", "DeltaAccumulator", "OutputKind", "RequestOutput"]
