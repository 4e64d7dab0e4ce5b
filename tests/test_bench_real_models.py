"""benchmarks/bench_real_models.py's table and notes, on made-up rows (fast; the real run is in
test_scripts.py)."""

import argparse
import importlib.util
import pathlib

from torchq.timing import Timing

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("bench_real_models", ROOT / "benchmarks" / "bench_real_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(config: str, ppl: float, weights: int, secs: tuple) -> dict:
    t = Timing(secs)
    return dict(model="smollm", config=config, quality=f"ppl {ppl:.3f}", ppl=ppl, weights=weights, speed_unit="tok/s",
                kernel="k", timing=t, speed=16 / t.median, speed_min=16 / t.max, speed_max=16 / t.min)


def test_table_has_spread_no_memory_column_and_explains_the_float_row():
    mod = _module()
    rows = [_row("float", 20.9, 400 << 20, (1.0, 1.01, 0.99)), _row("gguf-q4_1", 20.9, 76 << 20, (0.50, 0.51, 0.49)),
            _row("int8wo", 21.0, 100 << 20, (0.98, 1.02, 1.0))]
    mod.add_ratios(rows)
    table = mod.format_table(rows)
    assert "memory" not in table.splitlines()[0] and "speed [min-max]" in table
    assert "16.0 [15.8-16.2] tok/s" in table and "19% " in table.replace(")", " ")  # 76/400 of float's weights
    assert "speed 2.00x" in table and "speed ~1.00x" in table  # int8wo's range overlaps float's: marked
    notes = mod.footnotes(rows, argparse.Namespace(rounds=3, loader="torchq"))
    assert "Q4_1 weights dequantized" in notes and "+0.000 is expected" in notes
    hf_notes = mod.footnotes(rows, argparse.Namespace(rounds=3, loader="transformers"))
    assert "from_pretrained(quantization_config=torchq.hf.TorchqConfig" in hf_notes and "lm_head" in hf_notes
    assert "+0.000 by construction" in hf_notes
    assert "note: smollm:" in notes and "float/int8wo" in notes  # cannot rank float vs int8wo
    quiet = [_row("float", 20.9, 400 << 20, (1.0, 1.01, 0.99)), _row("int8wo", 21.0, 100 << 20, (0.5, 0.51, 0.49))]
    mod.add_ratios(quiet)
    assert "note:" not in mod.footnotes(quiet, argparse.Namespace(rounds=3, loader="torchq"))
