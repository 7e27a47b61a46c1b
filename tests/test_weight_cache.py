"""The packed-weights cache (ember_cupy/model/weight_cache.py) through the Python API on the
default model: the first load packs into a file, later loads map it and answer the same; a
changed model file, a damaged entry or an unusable directory never fails a load."""
import json
import logging
import os
import shutil
import sys

import numpy as np
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.model.loader import default_model_path
from ember_cupy.model import weight_cache
from ember_cupy.ops import _host

pytestmark = pytest.mark.skipif(_host.active() is None, reason="the cache holds the host kernels' format")

PROMPT = "The three primary colours are"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def _load(model, directory, **config) -> LLM:
    llm = LLM(model, weight_cache=str(directory), **config)
    if llm.engine.runner.weight_cache is not None:
        llm.engine.runner.weight_cache.wait_published(60)
    return llm


def _answer(llm: LLM):
    out = llm.generate([PROMPT], GREEDY)[0].outputs[0]
    return out.token_ids, [(step.token_id, step.logprob, step.top) for step in out.logprobs]


def _entries(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _file_mapped_at(address: int) -> str | None:
    """The path of the file mapped at `address` in this process (Linux's /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else None
    return None


@pytest.fixture(scope="module")
def reference():
    return _answer(LLM(default_model_path(), weight_cache="off"))


def test_second_load_maps_the_first_loads_file_and_answers_the_same(tmp_path, reference):
    first = _load(default_model_path(), tmp_path)
    assert first.engine.runner.weight_cache.reading is False
    key = first.engine.runner.weight_cache.key
    assert _entries(tmp_path) == [f"{key}.bin", f"{key}.json"]
    if os.path.exists("/proc/self/maps"):   # packed in memory, served from the file once it is written
        first_qkv = first.engine.runner.model.layers[0].qkv.data
        assert _file_mapped_at(first_qkv.ctypes.data) == str(tmp_path / f"{key}.bin")
        assert not first_qkv.flags.writeable
    assert _answer(first) == reference
    second = _load(default_model_path(), tmp_path)
    cache = second.engine.runner.weight_cache
    assert cache.reading is True and cache.key == key
    qkv = second.engine.runner.model.layers[0].qkv
    assert not qkv.data.flags.writeable      # a read-only view of the mapped file
    assert _answer(second) == reference
    assert second.engine.runner.model.weight_bytes() == first.engine.runner.model.weight_bytes()


def test_a_changed_model_file_or_setting_is_a_new_entry(tmp_path, reference):
    model = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), model)
    store = tmp_path / "cache"
    first = _load(str(model), store).engine.runner.weight_cache.key
    os.utime(model, ns=(1, 1))
    second = _load(str(model), store)
    assert second.engine.runner.weight_cache.key != first
    assert second.engine.runner.weight_cache.reading is False
    assert _answer(second) == reference
    q8 = _load(str(model), store, quantization="q8_0").engine.runner.weight_cache
    assert q8.key not in (first, second.engine.runner.weight_cache.key)


def test_a_damaged_entry_is_packed_again(tmp_path, reference):
    key = _load(default_model_path(), tmp_path).engine.runner.weight_cache.key
    data = tmp_path / f"{key}.bin"
    os.truncate(data, data.stat().st_size - 1)            # a short data file: not the entry indexed
    llm = _load(default_model_path(), tmp_path)
    assert llm.engine.runner.weight_cache.reading is False
    assert _answer(llm) == reference
    (tmp_path / f"{key}.json").write_text("{not json")
    llm = _load(default_model_path(), tmp_path)
    assert llm.engine.runner.weight_cache.reading is False
    assert _answer(llm) == reference


def test_an_entry_that_does_not_match_the_model_stops_being_read(tmp_path, reference, caplog):
    key = _load(default_model_path(), tmp_path).engine.runner.weight_cache.key
    index_path = tmp_path / f"{key}.json"
    index = json.loads(index_path.read_text())
    index["matrices"][3], index["matrices"][4] = index["matrices"][4], index["matrices"][3]
    index_path.write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING, logger="ember_cupy.weights"):
        llm = _load(default_model_path(), tmp_path)
    assert "does not hold next" in caplog.text
    assert _answer(llm) == reference


@pytest.mark.parametrize("damage", [{"offset": 1 << 40}, {"offset": -4096}, {"array": "x"}, {"kind": "Other"}])
def test_a_damaged_record_stops_being_read(tmp_path, reference, damage, caplog):
    key = _load(default_model_path(), tmp_path).engine.runner.weight_cache.key
    index_path = tmp_path / f"{key}.json"
    index = json.loads(index_path.read_text())
    index["matrices"][2]["parts"][0].update(damage)
    index_path.write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING, logger="ember_cupy.weights"):
        llm = _load(default_model_path(), tmp_path)
    assert "damaged" in caplog.text
    assert _answer(llm) == reference


def test_an_unusable_directory_packs_in_memory(tmp_path, reference, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="ember_cupy.weights"):
        llm = _load(default_model_path(), blocker / "cache")
    assert llm.engine.runner.weight_cache is None
    assert "unusable" in caplog.text
    assert _answer(llm) == reference
    assert LLM(default_model_path(), weight_cache="off").engine.runner.weight_cache is None


def test_the_most_recently_used_entries_are_kept_and_dead_writers_files_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_cache, "MAX_ENTRIES", 1)
    stale = tmp_path / "0123.bin.999999999.tmp"
    tmp_path.mkdir(exist_ok=True)
    stale.write_bytes(b"x")
    first = _load(default_model_path(), tmp_path).engine.runner.weight_cache.key
    assert not stale.exists()
    second = _load(default_model_path(), tmp_path, quantization="q8_0").engine.runner.weight_cache.key
    assert _entries(tmp_path) == [f"{second}.bin", f"{second}.json"] and first != second


def test_size_bound_covers_every_served_format():
    rows, cols = 40, 64
    weights = {"m": np.zeros((rows, cols), np.float32), "v": np.zeros(cols, np.float32)}
    assert weight_cache.size_bound(weights) == 48 * cols * 2 + weight_cache.ALIGN


def test_weight_cache_setting_is_checked():
    from ember_cupy.config import EngineConfig
    with pytest.raises(ValueError, match="weight_cache"):
        EngineConfig(weight_cache="")
    assert weight_cache.cache_dir("off") is None
    assert weight_cache.cache_dir("~/x") == weight_cache.Path(os.path.expanduser("~/x"))


def test_a_process_that_exits_right_after_loading_leaves_its_entry(tmp_path):
    import subprocess
    import sys
    code = "from ember_cupy import LLM; LLM(None)"
    env = dict(os.environ, EMBER_WEIGHT_CACHE=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    names = _entries(tmp_path)
    assert len(names) == 2 and names[0].endswith(".bin") and names[1].endswith(".json")


def test_two_engines_writing_one_entry_in_one_process_keep_their_own_files(tmp_path, reference, monkeypatch,
                                                                           caplog):
    """A second engine of the same model, built in the same process while the first's entry is
    still being made durable, writes its own temporary file: sharing the first's name truncated
    the file the first engine's weights are mapped from (zeros for weights, silently)."""
    import threading
    import time
    slow_sync, real_fsync = threading.Event(), os.fsync

    def fsync_after_the_second_load(fd):
        slow_sync.wait(60)
        real_fsync(fd)

    monkeypatch.setattr(weight_cache.os, "fsync", fsync_after_the_second_load)
    with caplog.at_level(logging.WARNING, logger="ember_cupy"):
        first = LLM(default_model_path(), weight_cache=str(tmp_path))
        second = LLM(default_model_path(), weight_cache=str(tmp_path))
        slow_sync.set()
        for llm in (first, second):
            llm.engine.runner.weight_cache.wait_published(60)
    assert _answer(first) == reference and _answer(second) == reference
    assert "not saved" not in caplog.text
    key = first.engine.runner.weight_cache.key
    assert _entries(tmp_path) == [f"{key}.bin", f"{key}.json"]
    assert _answer(_load(default_model_path(), tmp_path)) == reference


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MAP_NORESERVE is Linux's")
def test_the_pack_region_of_a_model_larger_than_memory_costs_only_address_space():
    """The region is the model's size bound (2 bytes a weight): a 30B model's on a machine with
    less memory is still made, as only what is packed into it is ever touched."""
    from ember_cupy.model.pack_region import PackRegion
    region = PackRegion(64 << 30)
    packed = region.array(4096, (3, 5), np.float32)
    packed[:] = 7
    assert region.bytes.ctypes.data % (2 << 20) == 0 and packed.sum() == 105
