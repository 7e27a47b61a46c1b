"""A machine without a C compiler: the host kernels cannot be built, so the NumPy twins run. The
default (quantized) model's matrices are dequantized once at load, not on every call, the twin
computes exactly what it computes on the packed matrices, and the load gives one warning that
says what it costs."""
import logging
import re

import numpy as np
import pytest

from ember_cupy import SamplingParams
from ember_cupy import packed_weight
from ember_cupy.ops import _host
from ember_cupy.ops.linear import matmul_q_numpy
from ember_cupy.packed_weight import LAYOUTS, DequantizedWeight, stack, to_kernel_format
from ember_cupy.quant import ActivationQuantization, QuantizedTensor
from tests.test_host_kernels import _weight_data

PROMPT = "The capital of France is"


def _reload_kernels():
    _host.load_library.cache_clear()
    _host.active.cache_clear()


@pytest.fixture
def without_compiler(monkeypatch, tmp_path):
    """Call it to run the rest of the test as on a machine without build tools: no $CC, no cc,
    gcc or clang on PATH, an empty kernel cache (a library a compiler that is gone cached would
    not be found anyway: its key holds the compiler's version)."""
    def enter():
        (tmp_path / "bin").mkdir()
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "bin"))
        monkeypatch.setenv("EMBER_KERNEL_CACHE", str(tmp_path / "cache"))
        for name in ("EMBER_HOST_KERNELS", "EMBER_HOST_ISA"):
            monkeypatch.delenv(name, raising=False)
        _reload_kernels()
    yield enter
    _reload_kernels()


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name.startswith("ember_cupy") and r.levelno >= logging.WARNING]


def test_one_warning_that_names_the_memory_cost(without_compiler, make_llm, caplog):
    without_compiler()
    with caplog.at_level(logging.INFO):
        llm = make_llm()
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings      # was one per ISA path tried: 3 here, 4 with AMX
    assert "no C compiler" in warnings[0] and "NumPy path" in warnings[0], warnings
    cost = re.search(r"(\d+) MiB of float32 instead of (\d+) MiB packed", warnings[0])
    assert cost, warnings
    floats, packed = int(cost[1]), int(cost[2])
    assert floats > 4 * packed > 0          # Q4_1 matrices and a Q8_0 embedding: ~5.6x
    # the float32 it names is what the model holds (its norms are a fraction of a MiB)
    assert abs(floats - llm.engine.runner.model.weight_bytes() / 2**20) < 1, warnings


def test_a_float_model_gets_the_warning_without_a_cost(without_compiler, make_llm, caplog):
    without_compiler()
    with caplog.at_level(logging.INFO):
        make_llm(quantization="none")
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "no C compiler" in warnings[0] and "MiB" not in warnings[0], warnings


def _greedy(llm):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    return list(llm.generate([PROMPT], params)[0].outputs[0].token_ids)


@pytest.mark.skipif(_host.active() is None, reason="host kernels unavailable here: no reference")
def test_no_matrix_is_dequantized_per_call_and_the_tokens_are_the_kernels(without_compiler, make_llm, monkeypatch):
    """The reference is the host kernels' greedy output, the path a machine with a compiler
    serves: its top token leads by over 1 nat at each step here. Bit for bit, the fallback is the
    NumPy twin on the packed matrices (the same values times the same activations: the test
    below); the kernels' integer dot products round otherwise, their logprobs differ by ~0.01."""
    kernel_tokens = _greedy(make_llm())
    without_compiler()
    llm = make_llm()
    calls = []
    original = packed_weight.dequantize_values
    monkeypatch.setattr(packed_weight, "dequantize_values", lambda *args: calls.append(1) or original(*args))
    tokens = _greedy(llm)
    assert calls == []                      # was 121 matrices a step (and an embedding row)
    assert tokens == kernel_tokens


def _tensor(rng, qtype, rows, cols):
    if qtype == "IQ4_NL":   # no kernel: requantized to Q8_0 from its values (f16 d, 16 bytes a block)
        blocks = rng.integers(0, 256, (rows, cols // 32, 18), dtype=np.uint8)
        blocks[..., :2] = np.array([0.01], np.float16).view(np.uint8)
        return QuantizedTensor(qtype, blocks.reshape(rows, -1), (rows, cols))
    return QuantizedTensor(qtype, _weight_data(rng, qtype, rows, cols), (rows, cols))


@pytest.mark.parametrize("qtype", [*LAYOUTS, "IQ4_NL"])
def test_dequantized_at_load_is_the_packed_twin_bit_for_bit(qtype):
    """Every kernel format and one without (requantized to Q8_0), 37 rows (not a multiple of
    8), alone and stacked over a Q8_0 part."""
    rng = np.random.default_rng(3)
    source, other = _tensor(rng, qtype, 37, 256), _tensor(rng, "Q8_0", 11, 256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    two_pass = ActivationQuantization(passes=2)
    for parts in ([source], [source, other]):
        packed = stack([to_kernel_format(p) for p in parts])
        once = DequantizedWeight.of(parts)
        assert once.packed_bytes == packed.nbytes
        np.testing.assert_array_equal(once.matrix, packed.dequantize())
        np.testing.assert_array_equal(matmul_q_numpy(x, once, two_pass), matmul_q_numpy(x, packed, two_pass))


def test_a_16_bit_checkpoint_is_widened_once_to_float32(without_compiler, tmp_path):
    """No kernel for its 16-bit matrices: they become float32 [in, out] at load (NumPy's GEMM),
    not the twin's emulated FMAs on every call."""
    import json

    from ember_cupy import LLM
    from tiny_model import assert_greedy_matches_reference, write_tiny_checkpoint
    without_compiler()
    weights = write_tiny_checkpoint(tmp_path, dtype="bfloat16")
    llm = LLM(str(tmp_path), kv_cache_dtype="float32")
    model = llm.engine.runner.model
    qkv = model.layers[0].qkv
    assert isinstance(qkv, np.ndarray) and qkv.dtype == np.float32 and qkv.shape == (32, 64)
    assert isinstance(model.embed, np.ndarray) and model.embed.dtype == np.float32
    assert_greedy_matches_reference(llm, weights, json.load(open(tmp_path / "config.json")))
