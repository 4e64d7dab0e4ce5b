"""Tutorial 4 - QLoRA: fine-tune low-rank adapters on top of a frozen NF4 model.

    python tutorials/04_qlora_nf4.py

The base weights are NF4 (4 bits per weight, double-quantized scales, bitsandbytes' format) and
stay frozen; gradients flow through torchq's NF4 linear to the input, so small trainable
adapters (W + B @ A) learn the task.
"""

import sys
from pathlib import Path

import torch
from torch import nn

import torchq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's examples/ package
from examples.lora import LoRALinear  # base(x) + x @ A^T @ B^T * alpha / rank, B = 0 at first

torch.manual_seed(0)


# A "pretrained" model and a new task it does not solve yet: match a teacher that differs from it
# by a low-rank change (what adapters can learn).
dims = 256
model = nn.Sequential(nn.Linear(dims, 512), nn.GELU(), nn.Linear(512, dims))
teacher = nn.Sequential(nn.Linear(dims, 512), nn.GELU(), nn.Linear(512, dims))
teacher.load_state_dict(model.state_dict())
with torch.no_grad():
    teacher[0].weight += 0.5 * torch.randn(512, 4) @ torch.randn(4, dims) / dims**0.5
    teacher[2].weight += 0.5 * torch.randn(dims, 4) @ torch.randn(4, 512) / 512**0.5

# 1. Quantize the base to NF4 (frozen), 2. wrap each linear with an adapter.
torchq.quantize_(model, torchq.nf4_weight_only(block_size=64, double_quant=True))
print(model[0].weight)
model[0], model[2] = LoRALinear(model[0], rank=8, alpha=16.0), LoRALinear(model[2], rank=8, alpha=16.0)
trainable = [p for p in model.parameters() if p.requires_grad]
print(f"trainable parameters: {sum(p.numel() for p in trainable)} "
      f"(frozen NF4 base: {sum(m.base.weight.nbytes_quantized() for m in (model[0], model[2]))} bytes)")

# 3. Train the adapters.
optimizer = torch.optim.AdamW(trainable, lr=3e-3)
data = torch.randn(512, dims)
target = teacher(data).detach()
losses = []
for step in range(300):
    batch = torch.randint(0, 512, (64,))
    loss = nn.functional.mse_loss(model(data[batch]), target[batch])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if step % 100 == 0:
        print(f"step {step:3d}  loss {loss.item():.6f}")
print(f"loss: {losses[0]:.6f} -> {losses[-1]:.6f}")
assert losses[-1] < 0.2 * losses[0], "the adapters should learn the task"
assert isinstance(model[0].base.weight, torchq.AffineQuantizedTensor) and not model[0].base.weight.requires_grad
print("QLoRA on NF4: OK")
