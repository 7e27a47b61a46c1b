"""The CuPy-only Python branches, run on the CPU: the stand-in cupy (tests/kernels/shim/standin_cupy.py:
NumPy buffers that are not np.ndarray, real NVRTC, the CPU shim behind RawModule) drives the runner,
the ops dispatch, the NVRTC compile-and-load, the start-up check and the sampler's device paths
through the public API, and must give the NumPy backend's tokens and logprobs."""
from __future__ import annotations

import numpy as np
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.engine.model_runner import resolve_dtype
from ember_cupy.engine.warmup import StartupCheckError
from ember_cupy.ops import _cuda
from ember_cupy.structured.params import StructuredOutputsParams

from kernels.shim import standin_cupy
from tiny_model import write_tiny_checkpoint

PROMPTS = ["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12", "w3 w4", "w9"]
CONFIG = dict(max_num_batched_tokens=8, block_size=4, num_kv_blocks=48, dtype="float32")


def params_suite():
    """Each sampler branch: plain greedy (device argmax), greedy with logprobs and penalties (host
    copy), seeded top-p/top-k sampling. (Constraints: test_constrained_sampling_on_the_real_model.)"""
    return [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3, repetition_penalty=1.3),
            SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=7, max_tokens=5, ignore_eos=True)]


def run_suite(path):
    llm = LLM(path, **CONFIG)
    results = []
    for params in params_suite():
        for output in llm.generate(PROMPTS, params):
            completion = output.outputs[0]
            logprobs = [(e.logprob, e.top) if hasattr(e, "logprob") else e for e in (completion.logprobs or [])]
            results.append((list(completion.token_ids), logprobs))
    return results, llm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(str(path))
    return str(path)


@pytest.fixture(scope="module")
def numpy_results(tiny):
    return run_suite(tiny)[0]


def test_every_sampler_branch_gives_the_numpy_backends_tokens(tiny, numpy_results):
    with standin_cupy.installed() as cupy:
        standin_cupy.RawModule.loaded.clear()
        results, llm = run_suite(tiny)
        runner = llm.engine.runner
        assert runner.xp is cupy and isinstance(runner.kv_caches[0][0], cupy.ndarray)
        assert not isinstance(runner.kv_caches[0][0], np.ndarray)
        # start-up compiled every kernel source through NVRTC and loaded its CUBIN
        loaded = {p.name.split("-sm")[0] + ".cu" for p in standin_cupy.RawModule.loaded}
        assert loaded == {p.name for p in _cuda.CUDA_SOURCE_DIR.glob("*.cu")}
        assert standin_cupy.compute_types["float32"] == 4   # cuBLAS: plain fp32, no TF32
        # the host copy of the weights is gone once they are on the device
        assert not [n for n, w in llm.engine.checkpoint.weights.items() if getattr(w, "ndim", 0) == 2]
    assert len(results) == len(numpy_results)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(results, numpy_results):
        assert tokens == want_tokens
        for (got, got_top), (want, want_top) in zip(logprobs, want_logprobs):
            assert got == pytest.approx(want, abs=1e-3)   # host C kernels vs the shim: both fp32
            assert [t for t, _ in got_top] == [t for t, _ in want_top]


@pytest.fixture(scope="module")
def cut_model(tmp_path_factory):
    """The default GGUF's first 2 blocks, bit-identical (tools/cut_gguf.py): its real tokenizer
    works with llguidance, unlike the tiny model's."""
    import sys
    sys.path.insert(0, str(_cuda.CUDA_SOURCE_DIR.parent / "tools"))
    from cut_gguf import cut_gguf

    from ember_cupy.model.loader import default_model_path
    path = tmp_path_factory.mktemp("cut") / "cut2.gguf"
    cut_gguf(default_model_path(), str(path), 2)
    return str(path)


def test_a_draft_model_on_the_device_keeps_the_numpy_tokens(tiny, numpy_results):
    """The tiny model drafting for itself through the device paths (its argmax on the device, a
    step of catch-up rows only)."""
    from step_cost_stand_ins import FreeDrafting, FreeVerification
    draft = {"model": tiny, "num_speculative_tokens": 3}
    with standin_cupy.installed():
        llm = LLM(tiny, speculative_config=draft, **CONFIG)
        llm.engine.speculator.costs = FreeVerification()
        llm.engine.speculator.proposer.costs = FreeDrafting()
        params = params_suite()[0]
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    assert tokens == [t for t, _ in numpy_results[:len(PROMPTS)]]
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0


def test_a_draft_model_on_the_device_shares_the_memory_left_with_the_target(tiny, monkeypatch):
    """Without num_kv_blocks the target's pool is sized from the device's free memory: with a
    draft model it leaves the draft a block beside each of its own, the draft's extra blocks and
    its step's workspace, and the two pools fit where the target's alone did."""
    from ember_cupy.engine.model_runner import device_kv_bytes, step_workspace_bytes
    config = {**CONFIG, "num_kv_blocks": None}
    with standin_cupy.installed() as cupy:
        monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: (48 << 20, 64 << 20))
        alone = LLM(tiny, **config).engine.runner
        llm = LLM(tiny, speculative_config={"model": tiny, "num_speculative_tokens": 3}, **config)
        budget = device_kv_bytes(alone.config, alone.model_config, alone.kv_dtype.itemsize)
    target, proposer = llm.engine.runner, llm.engine.speculator.proposer
    draft = proposer.runner
    assert proposer.extra_blocks == llm.engine.config.max_num_seqs   # one page of 4 for 3 drafts
    assert draft.num_blocks == target.num_blocks + proposer.extra_blocks
    used = (target.num_blocks * target.block_bytes + draft.num_blocks * draft.block_bytes
            + step_workspace_bytes(draft.config, draft.model_config, draft.kv_dtype.itemsize))
    assert alone.num_blocks * alone.block_bytes <= budget
    assert budget - (target.block_bytes + draft.block_bytes) < used <= budget
    assert target.num_blocks < alone.num_blocks // 2


def test_constrained_sampling_on_the_real_model(cut_model):
    """The grammar mask on the device (cuda/sampling.cu's bitmask kernel), greedy and seeded,
    a raw-logprobs row copied back before the mask: the NumPy backend's tokens and logprobs."""
    choice = StructuredOutputsParams(choice=["Paris", "London", "the city of Rome"])
    suite = [SamplingParams(temperature=0, max_tokens=6, structured_outputs=choice),
             SamplingParams(temperature=1.0, seed=3, max_tokens=6, structured_outputs=choice, logprobs=2)]

    def run():
        llm = LLM(cut_model, max_num_batched_tokens=16, block_size=16, num_kv_blocks=16, quantization="none")
        outs = [llm.generate(["The capital of France is"], p)[0].outputs[0] for p in suite]
        return [(o.text, list(o.token_ids), [e.logprob for e in o.logprobs or []]) for o in outs]
    want = run()
    with standin_cupy.installed():
        got = run()
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert all(text in choice.choice for text, _, _ in got)
    np.testing.assert_allclose(got[1][2], want[1][2], rtol=2e-3)   # the host C kernels (approximate exp) vs the shim


def test_device_logits_are_float32_for_16bit_weights(tiny):
    with standin_cupy.installed():
        llm = LLM(tiny, **{**CONFIG, "dtype": "bfloat16"})
        logits = llm.engine.runner.dummy_step()
        assert llm.engine.runner.model.dtype.name == "bfloat16"
        assert logits.dtype == np.float32 and bool(np.isfinite(logits.get()).all())
        # a long prompt mid-prefill: the step samples nothing and must not take argmax of (0, vocab)
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2


def test_dtype_auto_follows_the_checkpoint(tmp_path):
    with standin_cupy.installed() as cupy:
        assert resolve_dtype("auto", cupy, "bfloat16").name == "bfloat16"
        assert resolve_dtype("auto", cupy, "float16").name == "float16"
        assert resolve_dtype("auto", cupy, None).name == "bfloat16"       # GGUF
        assert resolve_dtype("auto", cupy, "float32").name == "bfloat16"
        write_tiny_checkpoint(str(tmp_path), dtype="bfloat16")
        llm = LLM(str(tmp_path), max_num_batched_tokens=8, block_size=4, num_kv_blocks=16)
        assert llm.engine.runner.model.dtype.name == "bfloat16"
        assert llm.engine.runner.kv_caches[0][0].dtype.name == "bfloat16"
    assert resolve_dtype("auto", np, "bfloat16").name == "float32"


def test_bfloat16_needs_cupy_14(monkeypatch):
    with standin_cupy.installed() as cupy:
        monkeypatch.setattr(cupy, "__version__", "13.6.0")
        with pytest.raises(ValueError, match="bfloat16 needs CuPy >= 14"):
            resolve_dtype("auto", cupy, None)
        assert resolve_dtype("float16", cupy, None).name == "float16"


def test_a_kernel_that_cannot_compile_fails_start_up(tiny, monkeypatch):
    def broken(source, arch, options=_cuda.NVRTC_OPTIONS):
        raise _cuda.KernelCompileError(f"NVRTC failed on {source}: cuda_fp16.h: No such file or directory")
    with standin_cupy.installed():
        monkeypatch.setattr(_cuda, "compile_cubin", broken)
        with pytest.raises(StartupCheckError, match="cuda_fp16.h"):
            LLM(tiny, **CONFIG)


def test_start_up_launches_the_sampling_kernels(tiny, monkeypatch):
    """A sampling kernel that fails only at launch (not at compile) still fails start-up."""
    from ember_cupy.engine import device_sampler

    def refused(logits, batch):
        raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED: sample_rows")
    with standin_cupy.installed():
        monkeypatch.setattr(device_sampler, "sample_tokens_kernel", refused)
        with pytest.raises(StartupCheckError, match="sample_rows"):
            LLM(tiny, **CONFIG)


def test_start_up_launches_every_forward_kernel_family(cut_model, monkeypatch):
    """The start-up dummy step reaches decode and prefill attention and both quantized matmul
    paths (the small-batch GEMV and the dequantize scratch of the large-batch one)."""
    launched = set()
    call = standin_cupy.RawKernel.__call__

    def recording(self, *args, **kwargs):
        launched.add(self.name)
        return call(self, *args, **kwargs)
    with standin_cupy.installed():
        monkeypatch.setattr(standin_cupy.RawKernel, "__call__", recording)
        LLM(cut_model, max_num_batched_tokens=16, block_size=4, num_kv_blocks=16, dtype="float32")
    families = ("paged_attention_decode", "paged_attention_prefill", "matmul_q", "dequantize_range",
                "sample_rows", "raw_logprobs", "apply_logit_edits", "apply_token_bitmask")
    missing = [f for f in families if not any(name.startswith(f) for name in launched)]
    assert not missing, sorted(launched)


def test_standin_refuses_what_cupy_refuses():
    with standin_cupy.installed() as cupy:
        device = cupy.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
        assert not isinstance(device, np.ndarray)
        with pytest.raises(TypeError, match="Implicit conversion"):
            np.asarray(device)
        with pytest.raises(TypeError, match="host array"):
            device + np.ones(3, np.float32)
        with pytest.raises(ValueError, match="zero-size"):
            cupy.zeros((0, 5), np.float32).argmax(axis=-1)
        assert np.isnan(cupy.empty((4,), np.float32).get()).all()      # poisoned
        norm = _cuda.load_module("norm.cu").get_function("rms_norm_f32")
        with pytest.raises(TypeError, match="host array"):
            norm((1,), (32,), (np.zeros((1, 4), np.float32), device, device, np.int32(4), np.int32(4),
                               np.float32(1e-5)))


def test_standin_names_exist_in_real_cupy():
    real = pytest.importorskip("cupy")
    assert "standin" not in real.__version__
    for name in ["asarray", "array", "asnumpy", "ascontiguousarray", "empty", "empty_like", "RawModule",
                 "RawKernel", *standin_cupy._GENERIC]:
        assert hasattr(real, name), name
    for name in ["get", "astype", "copy", "view", "fill", "argmax", "max", "sum", "reshape", "ravel", "T",
                 "data", "flags", "strides"]:
        assert hasattr(real.ndarray, name), name
    for name in ["Device", "Event", "get_elapsed_time"]:
        assert hasattr(real.cuda, name), name
    for name in ["getDeviceCount", "getDevice", "memGetInfo", "getDeviceProperties", "driverGetVersion"]:
        assert hasattr(real.cuda.runtime, name), name


def test_server_with_a_broken_cuda_toolchain_never_says_ready(tiny, monkeypatch):
    """The start-up check runs while the engine loads: /health reports the NVRTC error (503) and
    no request is ever admitted to an engine whose first kernel launch would fail."""
    import json
    import time
    import urllib.error
    import urllib.request

    from ember_cupy.config import EngineConfig
    from ember_cupy.engine.llm_engine import LLMEngine
    from ember_cupy.server import AsyncEngine, BackgroundServer, ServerSettings

    def broken(source, arch, options=_cuda.NVRTC_OPTIONS):
        raise _cuda.KernelCompileError(f"NVRTC failed on {source}: cuda_fp16.h: No such file or directory")
    with standin_cupy.installed():
        monkeypatch.setattr(_cuda, "compile_cubin", broken)
        engine = AsyncEngine(factory=lambda: LLMEngine(tiny, EngineConfig(**CONFIG)))
        server = BackgroundServer(engine, ServerSettings(host="127.0.0.1", port=0)).start(wait_ready=False)
        try:
            deadline = time.monotonic() + 60
            while engine.state.value != "dead" and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(urllib.error.HTTPError) as health:
                urllib.request.urlopen(f"{server.url}/health", timeout=10)
            assert health.value.code == 503
            assert "cuda_fp16.h" in json.loads(health.value.read())["error"]["message"]
        finally:
            server.stop()


def test_step_metadata_travels_in_one_persistent_buffer():
    """StepBuffers: int32 device views with the host arrays' values and shapes; one device buffer
    reused while it fits, grown when a step needs more."""
    from ember_cupy.engine.step_buffers import StepBuffers
    with standin_cupy.installed() as cupy:
        buffers = StepBuffers(cupy)
        small = [np.arange(5, dtype=np.int64), np.arange(6, dtype=np.int32).reshape(2, 3)]
        views = buffers.upload(small)
        first_buffer = buffers._device
        assert all(isinstance(v, cupy.ndarray) and v.dtype == np.int32 for v in views)
        assert [v.get().tolist() for v in views] == [a.tolist() for a in small]
        again = buffers.upload([np.full(7, 9)])
        assert buffers._device is first_buffer and again[0].get().tolist() == [9] * 7
        big = [np.arange(3000), np.arange(4).reshape(2, 2)]
        views = buffers.upload(big)
        assert buffers._device is not first_buffer and buffers._device.size >= 3004
        assert [v.get().tolist() for v in views] == [a.tolist() for a in big]
