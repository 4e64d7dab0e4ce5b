"""The torchq command: inspect / quantize / explain / bench on temporary checkpoints: exit codes
and what they print."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from torchq.cli import main

FACTORY = '''
import torch.nn as nn

def mlp():
    return nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64))

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
    assert "quantized 2 layers" in capsys.readouterr().out and out.exists()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "0.weight" in text and "quantized" in text and "4-bit [0,15] block 1x64 zero=float" in text and "0.bias" in text
    assert main(["inspect", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    quant = {e["name"]: e for e in data["entries"] if e["kind"] == "quantized"}
    assert set(quant) == {"0.weight", "2.weight"}
    assert quant["0.weight"]["shape"] == [128, 256] and quant["0.weight"]["bytes"] < 128 * 256 * 4 // 4


def test_quantize_with_a_plan_and_explain(target, tmp_path, capsys):
    import torchq

    plan = tmp_path / "plan.json"
    torchq.save_plan({"0": torchq.int8_weight_only(), "2": None}, plan)
    out = tmp_path / "m.safetensors"
    assert main(["quantize", target, "--plan", str(plan), "-o", str(out)]) == 0
    assert "quantized 1 layers" in capsys.readouterr().out
    assert main(["explain", target, "--checkpoint", str(out)]) == 0
    text = capsys.readouterr().out
    assert "int8_weight_only_native" in text or "int8_weight_only_cpu" in text
    assert main(["explain", target, "--config", "nf4", "--input-shape", "3x256"]) == 0
    assert "blockwise_4bit_linear" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["inspect", "/no/such/file"], "no such file"),
    (["quantize", "{t}", "-o", "{d}/x.pt"], "pass --config"),
    (["quantize", "{t}", "--config", "int9", "-o", "{d}/x.pt"], "unknown 'int9'"),
    (["quantize", "{t}", "--config", "int8wo", "--plan", "{d}/p.json", "-o", "{d}/x.pt"], "exclude each other"),
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
