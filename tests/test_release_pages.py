"""gguf_file.release_pages: a packed GGUF tensor leaves the resident set, keeping its values; an
array that is not a view of the file's map is never touched."""
import numpy as np

from ember_cupy.gguf_file import GGUFFile, release_pages
from ember_cupy.model.loader import default_model_path


def _rss_kib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))


def test_a_file_view_leaves_the_resident_set_and_keeps_its_values():
    tensor = max(GGUFFile(default_model_path()).tensors, key=lambda t: t.data.nbytes).data
    checksum = int(tensor.sum(dtype=np.uint64))          # every page resident now
    before = _rss_kib()
    release_pages(tensor)
    assert before - _rss_kib() > 0.9 * tensor.nbytes / 1024
    assert int(tensor.sum(dtype=np.uint64)) == checksum   # read again from the page cache


def test_other_arrays_are_left_alone():
    anonymous = np.arange(1 << 20, dtype=np.uint8)
    release_pages(anonymous)
    assert (anonymous == np.arange(1 << 20, dtype=np.uint8)).all()
    view = GGUFFile(default_model_path()).tensors[-1].data
    strided = view[::2]
    expected = strided.copy()
    release_pages(strided)
    assert (strided == expected).all()
