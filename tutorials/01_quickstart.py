"""Tutorial 1 - quick start: quantize a model, run it, save it, load it back.

    python tutorials/01_quickstart.py

Every nn.Linear weight becomes an AffineQuantizedTensor; the model code does not change.
"""

import io
import tempfile
from pathlib import Path

import torch
from torch import nn

import torchq

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)).to(torch.bfloat16).eval()
x = torch.randn(4, 1024, dtype=torch.bfloat16)
reference = model(x)

# 1. Quantize in place: int4 weights, groups of 128, tinygemm numerics.
torchq.quantize_(model, torchq.int4_weight_only(group_size=128))
print(model[0].weight)  # AffineQuantizedTensor(shape=(2048, 1024), dtype=torch.bfloat16, layout=...)

# 2. Run it. explain() says which kernel each layer used (and why the others did not apply).
y = model(x)
error = (y.float() - reference.float()).norm() / reference.float().norm()
print(f"relative error vs bf16: {error:.4f}")
print(torchq.explain(model, x))

# 3. Save: torch.save of the state dict, or safetensors (plain tensors + JSON metadata).
buffer = io.BytesIO()
torch.save(model.state_dict(), buffer)
folder = Path(tempfile.mkdtemp())
torchq.save_quantized(model, folder / "model.safetensors")

# 4. Load: `import torchq` is all torch.load(weights_only=True) needs.
buffer.seek(0)
state = torch.load(buffer, weights_only=True)
fresh = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)).to(torch.bfloat16)
fresh.load_state_dict(state, assign=True)
assert torch.equal(fresh(x), y)

# ... or into a model built on the meta device (no float weights are ever allocated).
with torch.device("meta"):
    empty = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)).to(torch.bfloat16)
torchq.load_quantized(empty, folder / "model.safetensors")
assert torch.equal(empty(x), y)
size = (folder / "model.safetensors").stat().st_size
print(f"safetensors file: {size / 2**20:.2f} MiB (bf16 weights: {(1024 * 2048 * 2 * 2) / 2**20:.2f} MiB)")
print("quickstart: OK")
