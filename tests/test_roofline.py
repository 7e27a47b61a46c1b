"""tools/roofline.py: the decode-step floor adds up from the model's shapes."""
import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "tools" / "roofline.py"
_spec = importlib.util.spec_from_file_location("roofline", _PATH)
roofline = sys.modules["roofline"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roofline)


def test_batch_one_bf16_floor_is_the_weights_read_once():
    shape = roofline.SHAPES["smollm2-135m"]
    parts = roofline.decode_step(shape, "bf16", batch=1, context=1)
    linear = sum(p.bytes for p in parts if p.family.startswith("linear") or p.family == "lm head")
    assert linear == pytest.approx(134.5e6 * 2, rel=0.01)     # SmolLM2-135M, tied head, bf16
    assert all(p.bound == "memory" for p in parts)
    assert sum(p.seconds for p in parts) == pytest.approx(sum(p.bytes for p in parts) / 4.8e12)


def test_attention_grows_with_context_and_gemms_turn_to_tensor_cores():
    shape = roofline.SHAPES["llama3-8b"]
    short, long = (roofline.decode_step(shape, "q4_1", 16, c) for c in (512, 1024))
    attention = [next(p for p in parts if p.family == "attention decode") for parts in (short, long)]
    assert attention[1].bytes == pytest.approx(2 * attention[0].bytes, rel=0.01)
    gemv, gemm = (next(p for p in roofline.decode_step(shape, "bf16", b, 512) if p.family == "linear gate_up")
                  for b in (8, 64))
    assert gemv.flops / gemv.seconds <= roofline.H200.cuda_core_flops * 1.0001
    assert gemm.bound == "memory" and gemm.seconds < 8 * gemv.seconds


def test_markdown_section_is_rewritten_in_place(tmp_path):
    page = tmp_path / "B.md"
    page.write_text("# Benchmarks\n\nbefore\n", encoding="utf-8")
    section = roofline.markdown(roofline.table(batches=(1,), contexts=(512,)))
    roofline.write_section(page, section)
    roofline.write_section(page, section)
    text = page.read_text(encoding="utf-8")
    assert text.count(roofline.BEGIN) == 1 and text.startswith("# Benchmarks\n\nbefore\n")
    assert "| SmolLM2-135M | q4_1 | 512 | 1 |" in text
