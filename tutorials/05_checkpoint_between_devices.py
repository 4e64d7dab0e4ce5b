"""Tutorial 5 - move a quantized checkpoint between devices and layouts, bit for bit.

    python tutorials/05_checkpoint_between_devices.py

Packed formats are device-specific (CUDA's tensor-core tiles, PyTorch's CPU int4 blocks, XPU's
nibble order), but torchq checkpoints store the canonical form: integer codes, scales and zero
points. Loading or .to(device) repacks for the target device's best kernel without ever
re-quantizing, so the codes and scales are the same everywhere.
"""

import io
import tempfile
from pathlib import Path

import torch
from torch import nn

import torchq
from torchq.layouts.tensor_core_tiled import TensorCoreTiledLayout

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 256)).to(torch.bfloat16)

# Quantize for a CUDA GPU's tinygemm kernel. Its bytes are documented and packed by a
# pure-PyTorch packer off CUDA, so this works on a CPU-only machine too.
torchq.quantize_(model, torchq.int4_weight_only(group_size=64, layout=TensorCoreTiledLayout()))
original = model[0].weight.to_plain()
print("packed for:", model[0].weight.quant_layout, tuple(model[0].weight.tensor_impl.packed.shape))

# Save (the canonical form goes into the file) ...
folder = Path(tempfile.mkdtemp())
torchq.save_quantized(model, folder / "model.safetensors")
buffer = io.BytesIO()
torch.save(model.state_dict(), buffer)

# ... and load on this machine's CPU: the tiled layout has no CPU kernel, so the weights are
# repacked into the CPU's best layout. Same codes, same scales.
with torch.device("meta"):
    cpu_model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 256)).to(torch.bfloat16)
torchq.load_quantized(cpu_model, folder / "model.safetensors", device="cpu")
print("loaded as:", cpu_model[0].weight.quant_layout)
assert cpu_model[0].weight.to_plain().equal(original)

buffer.seek(0)
state = torch.load(buffer, weights_only=True)
assert state["0.weight"].to_plain().equal(original)

x = torch.randn(2, 512, dtype=torch.bfloat16)
with torchq.strict():  # a fast CPU kernel runs: no fallback
    y_cpu = cpu_model(x)

# Any layout that holds the format converts losslessly (to_layout), e.g. PyTorch's own CPU packing.
cpu_packed = cpu_model[0].weight.to_layout(torchq.layouts.Int4CPULayout())
assert cpu_packed.to_plain().equal(original)

if torch.cuda.is_available():
    gpu_model = cpu_model.to("cuda")  # repacked for the GPU's kernel, never re-quantized
    print("on CUDA:", gpu_model[0].weight.quant_layout)
    assert gpu_model[0].weight.to_plain().map(lambda t: t.cpu()).equal(original)
    y_gpu = gpu_model(x.cuda()).cpu()
    print(f"CPU vs GPU outputs: max |diff| {float((y_gpu.float() - y_cpu.float()).abs().max()):.4f} (summation order only)")
else:
    print("no CUDA device here: on a GPU, cpu_model.to('cuda') repacks into TensorCoreTiledLayout the same way")
print("checkpoints between devices: OK")
