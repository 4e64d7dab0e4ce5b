"""Writes the v1 checkpoints of this folder. They were made with torchq at commit 74ae1d7 (before the
layering change of issue 35):

    PYTHONPATH=<that checkout> python tests/data/checkpoints/make_v1.py tests/data/checkpoints

``tests/test_committed_checkpoints.py`` loads them with today's code, and rebuilds the same model
with :func:`quantized_model` to check that today's code pickles it to the committed bytes."""

from __future__ import annotations

import json
import pathlib
import sys

import torch
from torch import nn

import torchq


def quantized_model() -> tuple[nn.Module, dict]:
    """A small bf16 MLP quantized with five configs, and picklable torchq objects of every kind."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(32, 24),
                          nn.Linear(24, 16)).to(torch.bfloat16)
    configs = {"0": torchq.int4_weight_only(group_size=32), "2": torchq.nf4_weight_only(block_size=32),
               "3": torchq.int8_weight_only(), "4": torchq.int8_dynamic_activation_int8_weight(),
               "5": torchq.Int4WeightOnlyConfig(group_size=32, zero_point_domain=torchq.ZeroPointDomain.INT,
                                                layout=torchq.layouts.Int4NativeLayout())}
    torchq.quantize_(model, configs)
    objects = {"config": torchq.int4_weight_only(group_size=64), "layout": torchq.layouts.Int4NativeLayout(),
               "spec": model[0].weight.tensor_impl.spec, "act": model[4].weight.act_quant,
               "zpd": torchq.ZeroPointDomain.FLOAT, "mapping": torchq.MappingType.ASYMMETRIC}
    return model, objects


def main(out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model, objects = quantized_model()
    sd = model.state_dict()
    torch.save({"state_dict": sd, "objects": objects}, out / "v1_torch_save.pt")
    values = {k: (v.dequantize() if isinstance(v, torchq.AffineQuantizedTensor) else v).float().clone() for k, v in sd.items()}
    torch.save(values, out / "v1_expected_values.pt")
    (out / "v1_expected_objects.json").write_text(json.dumps({k: repr(v) for k, v in objects.items()}, indent=1, sort_keys=True) + "\n")
    torchq.save_quantized(model, out / "v1_save_quantized.safetensors")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
