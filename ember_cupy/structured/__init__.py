"""Constrained decoding with llguidance: what a request asks for (params), its compiled grammar
(compiler), one sequence's matcher (constraint), and the token bitmask (bitmask)."""
from ember_cupy.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
