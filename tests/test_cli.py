"""The torchq command: inspect / quantize / explain / bench on temporary checkpoints: exit codes
and what they print."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from torchq.cli import load_target, main

FACTORY = '''
import torch.nn as nn

def mlp():
    return nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64))

def odd():
    return nn.Sequential(nn.Linear(200, 100), nn.ReLU(), nn.Linear(100, 36))

def deep():
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)], nn.Linear(256, 72))

not_a_model = 3
'''


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "cli_models.py"
    path.write_text(FACTORY)
    return f"{path}:mlp"


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_quantize_then_inspect(target, tmp_path, capsys, suffix):
    out = tmp_path / f"model{suffix}"
    assert main(["quantize", target, "--config", "int4-g64", "-o", str(out)]) == 0
    assert "quantized 2 weights" in capsys.readouterr().out and out.exists()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "0.weight" in text and "quantized" in text and "4-bit [0,15] block 1x64 zero=float" in text and "0.bias" in text
    assert main(["inspect", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    quant = {e["name"]: e for e in data["entries"] if e["kind"] == "quantized"}
    assert set(quant) == {"0.weight", "2.weight"}
    assert quant["0.weight"]["shape"] == [128, 256] and quant["0.weight"]["bytes"] < 128 * 256 * 4 // 4


def test_quantize_with_an_algorithm_records_it_in_the_checkpoint(target, tmp_path, capsys):
    import torch

    import torchq

    out = tmp_path / "model.safetensors"
    assert main(["quantize", target, "--config", "int4-g64", "--algorithm", "hqq", "-o", str(out)]) == 0
    assert "quantized 2 weights" in capsys.readouterr().out
    model = load_target(target)
    torchq.load_quantized(model, out)
    assert model[0].weight.config == torchq.int4_weight_only(group_size=64, algorithm="hqq")
    assert model[0].weight.dequantize(torch.float32).shape == (128, 256)
    for path in (out, tmp_path / "model.pt"):  # inspect shows it, for safetensors and torch.save files
        if path.suffix == ".pt":
            assert main(["quantize", target, "--config", "int4-g64-hqq", "-o", str(path)]) == 0
            capsys.readouterr()
        assert main(["inspect", str(path), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        configs = {e["name"]: e["config"] for e in data["entries"] if e["kind"] == "quantized"}
        assert configs == {"0.weight": "Int4WeightOnlyConfig (hqq)", "2.weight": "Int4WeightOnlyConfig (hqq)"}
    assert main(["quantize", target, "--config", "int4-g64", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {e["config"] for e in data["entries"] if e["kind"] == "quantized"} == {"Int4WeightOnlyConfig"}


def test_quantize_with_a_plan_and_explain(target, tmp_path, capsys):
    import torchq

    plan = tmp_path / "plan.json"
    torchq.save_plan({"0": torchq.int8_weight_only(), "2": None}, plan)
    out = tmp_path / "m.safetensors"
    assert main(["quantize", target, "--plan", str(plan), "-o", str(out)]) == 0
    assert "quantized 1 weights" in capsys.readouterr().out
    assert main(["explain", target, "--checkpoint", str(out)]) == 0
    text = capsys.readouterr().out
    assert "int8_weight_only_native" in text or "int8_weight_only_cpu" in text
    assert main(["explain", target, "--config", "nf4", "--input-shape", "3x256"]) == 0
    assert "blockwise_4bit_linear" in capsys.readouterr().out


@pytest.mark.parametrize("algorithm", ["gptq", "awq"])
def test_quantize_with_calibration_data(target, tmp_path, capsys, algorithm):
    import torch

    import torchq

    batches = tmp_path / "cal.pt"
    torch.save([torch.randn(8, 256) for _ in range(3)], batches)
    out = tmp_path / "model.safetensors"
    assert main(["quantize", target, "--config", "int4-g64", "--algorithm", algorithm, "--calibration", str(batches),
                 "--quiet", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rtn_error" in text and f"{algorithm}" in text and "quantized 2 weights" in text
    model = load_target(target)
    torchq.load_quantized(model, out)
    assert model[0].weight.config.algorithm == algorithm
    assert main(["inspect", str(out), "--json"]) == 0
    configs = {e["name"]: e.get("config") for e in json.loads(capsys.readouterr().out)["entries"] if e["kind"] == "quantized"}
    assert configs["0.weight"] == f"Int4WeightOnlyConfig ({algorithm})"


@pytest.mark.parametrize("argv,message", [
    (["quantize", "{t}", "--config", "int4-g64", "--algorithm", "gptq", "-o", "{d}/x.pt"], "needs calibration data"),
    (["quantize", "{t}", "--config", "int4-g64", "--calibration", "{d}/cal.pt", "-o", "{d}/x.pt"],
     "only the calibrated algorithms"),
    (["quantize", "{t}", "--config", "int4-g64", "--algorithm", "awq", "--calibration", "{d}/bad.pt", "-o", "{d}/x.pt"],
     "--calibration: "),
    (["quantize", "{t}", "--config", "int4-g64", "--algorithm", "awq", "--calibration", "{d}/str.pt", "-o", "{d}/x.pt"],
     "expected a tensor, or a non-empty list"),
])
def test_calibration_errors_exit_1_with_one_line(target, tmp_path, capsys, argv, message):
    import torch

    torch.save([torch.randn(4, 256)], tmp_path / "cal.pt")
    torch.save(["text"], tmp_path / "str.pt")
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    argv = [a.format(t=target, d=tmp_path) for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv,message", [
    (["inspect", "/no/such/file"], "no such file"),
    (["quantize", "{t}", "-o", "{d}/x.pt"], "pass --config"),
    (["quantize", "{t}", "--config", "int9", "-o", "{d}/x.pt"], "unknown 'int9'"),
    (["quantize", "{t}", "--config", "int8wo", "--plan", "{d}/p.json", "-o", "{d}/x.pt"], "exclude each other"),
    (["quantize", "{t}", "--config", "int8wo", "--algorithm", "hqq", "-o", "{d}/x.pt"],
     "--algorithm: Int8WeightOnlyConfig has no algorithm choice"),
    (["quantize", "{t}", "--config", "int4-g64", "--algorithm", "gptq9", "-o", "{d}/x.pt"], "--algorithm: algorithm: expected one of"),
    (["quantize", "{t}", "--plan", "{d}/p.json", "--algorithm", "hqq", "-o", "{d}/x.pt"], "--algorithm: applies to --config"),
    (["quantize", "{m}:nothing", "--config", "int8wo", "-o", "{d}/x.pt"], "no attribute 'nothing'"),
    (["quantize", "{m}:not_a_model", "--config", "int8wo", "-o", "{d}/x.pt"], "expected a torch.nn.Module"),
    (["quantize", "no_such_module_xyz:f", "--config", "int8wo", "-o", "{d}/x.pt"], "cannot import"),
    (["explain", "{t}"], "no quantized linear layers"),
    (["explain", "{t}", "--config", "int8wo", "--input-shape", "axb"], "--input-shape"),
    (["inspect", "{d}/garbage.pt"], "torch.load(weights_only=True) failed"),
])
def test_errors_exit_1_with_one_line(target, tmp_path, capsys, argv, message):
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    module = target.rsplit(":", 1)[0]
    argv = [a.format(t=target, d=tmp_path, m=module) for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and err.startswith("torchq ")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


@pytest.mark.slow
def test_console_entry_points(target, tmp_path):
    """``python -m torchq`` (the same main as the ``torchq`` console script) and ``torchq bench``."""
    out = tmp_path / "m.safetensors"
    run = subprocess.run([sys.executable, "-m", "torchq", "quantize", target, "--config", "int8dq", "-o", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    run = subprocess.run([sys.executable, "-m", "torchq", "inspect", str(out)], capture_output=True, text=True)
    assert run.returncode == 0 and "0.weight" in run.stdout
    run = subprocess.run([sys.executable, "-m", "torchq", "bench", "--quick", "--configs", "float,int8wo", "--shapes", "256x256",
                          "--m", "1", "--dtypes", "fp32"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "int8wo" in run.stdout


def _parsers():
    """The torchq parser, each subcommand's and torchq bench's."""
    from torchq import bench_linear
    from torchq.cli import build_parser

    top = build_parser()
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {"torchq": top, **{f"torchq {n}": p for n, p in subs.choices.items() if n != "bench"},
            "torchq bench": bench_linear.build_parser("torchq bench")}


def test_help_is_plain_text_and_every_option_has_help(capsys):
    for name, parser in _parsers().items():
        text = parser.format_help()
        assert "``" not in text and not re.search(r":(func|mod|class|meth|attr|data):", text), (name, text)
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings or action.dest}: no help"


@pytest.mark.parametrize("argv,prog", [(["bench", "--help"], "torchq bench"), (["explain", "--help"], "torchq explain"),
                                       (["--help"], "torchq")])
def test_help_names_the_command(capsys, argv, prog):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {prog} ")


SIZES = re.compile(r"quantized weights ([\d.]+ \w+) \(float: ([\d.]+ \w+)\); ([\d.]+ \w+) of tensors; file ([\d.]+ \w+)")


@pytest.mark.parametrize("factory,config,dtype,suffix", [
    ("odd", "int4-g128", None, ".safetensors"), ("odd", "int4-g128", None, ".pt"), ("mlp", "int4-g128", "bf16", ".safetensors"),
    ("mlp", "nf4", None, ".safetensors"), ("odd", "int8dq", "bf16", ".pt"),
])
def test_quantize_and_inspect_report_the_same_sizes(target, tmp_path, capsys, factory, config, dtype, suffix):
    """Both count the bytes stored in the file (odd shapes: the int4 layout pads in memory, the file does not)."""
    out = tmp_path / f"m{suffix}"
    target = target.rsplit(":", 1)[0] + ":" + factory
    assert main(["quantize", target, "--config", config, "-o", str(out)] + (["--dtype", dtype] if dtype else [])) == 0
    said = SIZES.search(capsys.readouterr().out)
    assert main(["inspect", str(out)]) == 0
    shown = SIZES.search(capsys.readouterr().out)
    assert said and shown and said.groups() == shown.groups()


def test_explain_groups_rejections_and_fits_100_columns(target, capsys):
    target = target.rsplit(":", 1)[0] + ":deep"
    assert main(["explain", target, "--config", "int4-g128"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100, text
    assert len(lines) <= 25, text  # 7 layers with the same kernel and rejections: one group, not 13 lines each
    reasons = [line for line in lines if line.startswith("    ") and ":" in line]
    assert len(reasons) == len(set(reasons)), text  # each distinct reason once (the layout's own kernels only)
    assert "7 layers" in text or "x7" in text, text


def test_bench_quick_prints_no_ratio_from_noisy_timings(capsys, tmp_path):
    """Quick mode says its timings are indicative; a ratio is shown only where neither timing is
    noisy (a wide spread, or a median far above the fastest call)."""
    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--configs", "float,int8wo,int4-g128", "--dtypes", "fp32", "--shapes", "256x256",
                 "--m", "1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "quick: timings indicative only" in out
    rows = json.loads(path.read_text())["rows"]
    table = {line.split()[3]: line.split() for line in out.splitlines() if line.startswith("256x256")}
    assert set(table) == {r["config"] for r in rows} == {"float", "int8wo", "int4-g128"}
    float_noisy = next(r["noisy"] for r in rows if r["config"] == "float")
    for r in rows:
        assert r["reps"] >= 9 and r["q1_ms"] <= r["ms"] <= r["q3_ms"]
        assert r["noisy"] == (r["spread"] > 0.25 or r["ms"] > 2 * r["min_ms"])
        assert (table[r["config"]][7] == "noisy") == (r["noisy"] or float_noisy), table[r["config"]]


TIED_FACTORY = """
import torch
from torch import nn

class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.body(self.emb(x)))

def build():
    torch.manual_seed(0)
    return Tied()
"""


def test_quantize_counts_a_tied_weight_once(tmp_path, capsys):
    """An embedding tied to lm_head holds the quantized weight too: one weight, counted once."""
    path = tmp_path / "tied_models.py"
    path.write_text(TIED_FACTORY)
    out = tmp_path / "tied.safetensors"
    with pytest.warns(UserWarning, match="tied"):
        assert main(["quantize", f"{path}:build", "--config", "int8wo", "-o", str(out)]) == 0
    assert "quantized 2 weights" in capsys.readouterr().out
