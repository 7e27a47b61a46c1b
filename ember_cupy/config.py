"""Frozen, validated configuration of the model and of the engine."""
from __future__ import annotations

from dataclasses import dataclass

from ember_cupy.checks import require
from ember_cupy.speculative_config import SpeculativeConfig


POLICIES = ("fcfs", "sjf", "priority")
DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "float16")
QUANTIZATIONS = ("auto", "none", "q8_0")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from GGUF metadata or config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False
    name: str = "model"
    # Family features beyond Llama's (ember_cupy/model/decoder.py; all off for Llama/Qwen2/Mistral):
    qk_norm: bool = False                  # RMSNorm over each q/k head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False           # norms after attention and MLP too (Gemma 3)
    hidden_act: str = "silu"               # MLP gate activation: silu | gelu_tanh (Gemma)
    embedding_scale: float = 1.0           # embeddings times this (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None   # None: head_dim ** -0.5
    sliding_window: int | None = None      # keys a sliding layer's query sees, itself included
    sliding_layers: tuple[bool, ...] | None = None   # which layers slide; None: all (if a window)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3); None: rope_theta

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            require(getattr(self, name) > 0, f"ModelConfig.{name} must be > 0")
        require(self.num_heads % self.num_kv_heads == 0,
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        require(self.head_dim % 2 == 0, "ModelConfig.head_dim must be even for RoPE")
        require(self.hidden_act in ("silu", "gelu_tanh"),
                f"ModelConfig.hidden_act must be silu or gelu_tanh, got {self.hidden_act!r}")
        require(self.sliding_window is None or self.sliding_window >= 1,
                "ModelConfig.sliding_window must be >= 1 or None")
        require(self.sliding_layers is None or len(self.sliding_layers) == self.num_layers,
                "ModelConfig.sliding_layers must have one entry per layer")

    def layer_window(self, index: int) -> int:
        """Attention window of layer `index` (0 = full causal attention)."""
        slides = self.sliding_layers is None or self.sliding_layers[index]
        return self.sliding_window if self.sliding_window and slides else 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# max_num_prefill_tokens on the CPU when not given; it holds while more than one sequence runs or
# waits (a lone prompt prefills in whole steps). A request arriving during a long prefill waits
# for the step in progress, then shares the next one. Measured with tools/attack_http.py (issue
# 24; SmolLM2, 2 cores of a quiet AMD EPYC, small-request p99 / idle p99, the bulk request's time):
# 32 tokens: embeddings 64 x 100 tokens 1.4-1.7x, 13.2-13.9 s; prompt logprobs 2.3-3.4x;
# 64: 3.4x, 12.0 s; 4.1x; 128: 4.1x, 9.8 s; 7.9x. Shared steps of 32 cost the bulk ~35% here.
CPU_MAX_NUM_PREFILL_TOKENS = 32
# The same where prompt rows run on AMX-BF16 tiles (prompt_activations): 64 of their tokens cost
# about what 32 int8 ones did (1B gate_up Q4_K: 16 decode rows + 64 prompt rows 7-9 ms, 48 int8
# rows 12 ms). SmolLM2, this Xeon, attack_http.py embeddings / prompt logprobs, small-request p99
# 0.100 / 0.136 s against int8 at 32 tokens' 0.092 / 0.119 s, the bulk 3 / 4 rounds in ~10.5 s
# against 2 / 3; the 1B shape's c16 1.65-1.68x -> 2.12-2.17x llama-server's (BENCHMARKS.md).
CPU_MAX_NUM_PREFILL_TOKENS_BF16 = 64


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches, schedules and sizes its KV cache."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # Prompt tokens one step computes at most (chunks of long prompts, many prompts of one
    # request, short prompts): what bounds a step's time, which a newly arrived request waits
    # for. None: CPU_MAX_NUM_PREFILL_TOKENS on the NumPy backend (..._BF16 where prompt rows run
    # on AMX-BF16 tiles), else max_num_batched_tokens.
    max_num_prefill_tokens: int | None = None
    max_model_len: int | None = None      # None: the model's context length, capped by the pool
    block_size: int = 16
    kv_cache_memory: int = 1 << 30        # bytes for the K and V pools of all layers together
    num_kv_blocks: int | None = None      # overrides kv_cache_memory when set
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    sjf_aging_steps: int = 64             # sjf: a request waiting this many steps jumps the queue
    max_waiting: int | None = None        # bound on queued requests; None = unbounded
    dtype: str = "auto"                   # weights/KV dtype; auto: float32 on NumPy, see resolve_dtype
    gpu_memory_utilization: float = 0.9   # CuPy: fraction of free device memory for weights + KV
    # Serving format of the weight matrices (ember_cupy/model/weights.py): auto = as stored
    # (GGUF blocks stay quantized, 16-bit floats 16-bit), none = dequantized to float (the exact
    # reference; on the host 16-bit floats stay 16-bit: exact already), q8_0.
    quantization: str = "auto"
    # Where the host kernels' packed matrices of a model are kept between loads (ember_cupy/model/
    # weight_cache.py): auto = $EMBER_WEIGHT_CACHE, else ~/.cache/ember-cupy/packed-weights; off;
    # or a directory. The first load packs into a file there, later ones map it.
    weight_cache: str = "auto"
    # Quantized matmuls quantize their input x in blocks of 32: 2 passes (x to 16 bits, held as two
    # int8 rows q = 255 hi + lo whose dot products the kernels combine exactly before one float
    # scaling) or 1 (llama.cpp's int8 scheme: up to 2x faster prefill and batched decode, top-1
    # agreement down to 89.5% with fp32 on the reference fixtures). The 16 bits cover the blocks
    # whose d^2 >= second_pass_threshold x the row's mean d^2 (d = max|x| / 127); the others keep
    # 255 hi alone (about int8). 0 takes every block (fidelity: docs/cpu.md). Only the portable
    # and NEON paths skip a dropped block's lo row; the SIMD and AMX paths compute it anyway (a
    # branch on x's blocks mispredicts), so a higher threshold there saves no time.
    activation_passes: int = 2
    second_pass_threshold: float = 0.0
    # Prompt tokens' matmuls: auto = x and W in bf16 on AMX-BF16 tiles where the host kernels have
    # them (sums over the whole row in float32, no per-block scaling: ~3x the int8 path's prefill
    # on 1B K-quants, x kept to 8 bits rather than ~15), else on AVX512-BF16 vectors (Zen 4:
    # 1.2-1.6x at 512 rows, slower below ~32), else as activation_passes says; int8 =
    # as the generated tokens' (activation_passes), on every machine. A row's role, not the batch,
    # picks the kernel, so outputs stay batch-invariant (cpu/matmul_bf16.h).
    prompt_activations: str = "auto"
    # Storage of the K/V pools: auto = float16 on the NumPy backend with host kernels (half the
    # bytes per block, and half what attention reads) unless quantization="none" (the exact fp32
    # reference), else the model dtype (ember_cupy/ops/cache.py: resolve_kv_cache_dtype).
    kv_cache_dtype: str = "auto"
    # The same token ids and logprobs for a request whatever else runs (the batch, prefix-cache
    # hits, chunked-prefill splits, preemption) where that costs speed: on CuPy every attention
    # query row through the decode kernel, every quantized matmul through the GEMV kernel, what
    # M may be. The host (CPU) kernels need no flag: one reduction order per row by default.
    deterministic: bool = False
    # Speculative decoding (ember_cupy/speculative_config.py): a SpeculativeConfig, a dict of its
    # fields or its JSON text (vLLM's --speculative-config); None: off.
    speculative_config: SpeculativeConfig | None = None
    # vLLM's --seed: requests without a seed draw from seeds this one derives in arrival order, so
    # the same requests in the same order sample the same tokens after a restart. None: fresh entropy.
    seed: int | None = None
    # vLLM's --chat-template: a Jinja template (its source, or a file holding it) used instead of the
    # model's own. None: the model's.
    chat_template: str | None = None
    # vLLM's --generation-config (auto | vllm | a directory) and --override-generation-config: the
    # requests' default sampling parameters (ember_cupy/generation_config.py)
    generation_config: str = "auto"
    override_generation_config: dict | None = None

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        require(self.max_num_seqs >= 1, "EngineConfig.max_num_seqs must be >= 1")
        require(self.max_num_batched_tokens >= 1,
                "EngineConfig.max_num_batched_tokens must be >= 1")
        require(self.max_num_prefill_tokens is None or self.max_num_prefill_tokens >= 1,
                "EngineConfig.max_num_prefill_tokens must be >= 1")
        require(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
                f"EngineConfig.seed must be an integer or None, got {self.seed!r}")
        require(self.block_size >= 1 and self.block_size <= 1024,
                "EngineConfig.block_size must be in [1, 1024]")
        require(self.kv_cache_memory > 0, "EngineConfig.kv_cache_memory must be > 0 bytes")
        require(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                "EngineConfig.num_kv_blocks must be >= 1")
        require(self.max_model_len is None or self.max_model_len >= 1,
                "EngineConfig.max_model_len must be >= 1")
        require(self.policy in POLICIES,
                f"EngineConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        require(self.sjf_aging_steps >= 1, "EngineConfig.sjf_aging_steps must be >= 1")
        require(self.dtype in DTYPES, f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        require(self.activation_passes in (1, 2), "EngineConfig.activation_passes must be 1 or 2")
        require(self.second_pass_threshold >= 0, "EngineConfig.second_pass_threshold must be >= 0")
        require(self.prompt_activations in ("auto", "int8"), "EngineConfig.prompt_activations must be auto or int8")
        require(self.quantization in QUANTIZATIONS,
                f"EngineConfig.quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        require(isinstance(self.weight_cache, str) and self.weight_cache.strip() != "",
                f"EngineConfig.weight_cache must be auto, off or a directory, got {self.weight_cache!r}")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                f"EngineConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        require(0.0 < self.gpu_memory_utilization <= 1.0,
                "EngineConfig.gpu_memory_utilization must be in (0, 1]")
        require(self.max_waiting is None or self.max_waiting >= 1,
                "EngineConfig.max_waiting must be >= 1")
        require(isinstance(self.deterministic, bool),
                f"EngineConfig.deterministic must be True or False, got {self.deterministic!r}")
