"""ember-cupy: a low-dependency LLM inference engine (continuous batching, paged KV cache,
CUDA kernels through CuPy, NumPy on CPU)."""
from ember_cupy.config import EngineConfig, ModelConfig
from ember_cupy.engine.pooling import PoolingParams
from ember_cupy.llm import LLM
from ember_cupy.outputs import CompletionOutput, RequestOutput
from ember_cupy.sampling_params import SamplingParams
from ember_cupy.version import __version__

__all__ = ["LLM", "SamplingParams", "PoolingParams", "EngineConfig", "ModelConfig", "RequestOutput",
           "CompletionOutput", "__version__"]
