"""Tutorial 6 - QLoRA with FSDP2: train adapters on a sharded NF4 base, save and load with DCP.

    python tutorials/06_fsdp2_qlora_nf4.py

Two CPU processes (gloo) stand in for two GPUs. `fully_shard` splits every weight by rows; a
torchq weight stays quantized in its shard, so each rank holds about half of the NF4 bytes, and
the all-gather before each block's forward/backward sends only the bit-packed codes and scales.
The adapters (plain float parameters) are sharded and trained as usual. A distributed
checkpoint (torch.distributed.checkpoint, "DCP") stores each quantized weight as plain tensors
(codes, scales, a format record) that DCP can reshard; torchq.distributed.checkpoint converts in
both directions.

Double-quantized NF4 scales (8-bit, in blocks of 256 that run across rows) cannot be cut by rows,
so a shard keeps the fp32 scales they stand for (the same values): a rank holds a little over
half of the weight's bytes.
"""

import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import torchq
import torchq.distributed.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's examples/ package
from examples.lora import LoRALinear  # the adapter of tutorial 4
from examples.mlp import ResidualMLP  # blocks of x + down(gelu(up(x)))
from examples.processes import run_local  # spawns the ranks, joins them in a gloo group

DIMS, HIDDEN, RANK, STEPS, BATCH = 256, 512, 8, 30, 64


def build_model() -> ResidualMLP:
    """Two residual blocks x + down(gelu(up(x))) of DIMS -> HIDDEN -> DIMS."""
    return ResidualMLP(DIMS, HIDDEN, depth=2)


def pretrained_and_teacher():
    """The same "pretrained" model on every rank, and a teacher that differs from it by a low-rank
    change (a task the adapters can learn)."""
    torch.manual_seed(0)
    model, teacher = build_model(), build_model()
    teacher.load_state_dict(model.state_dict())
    with torch.no_grad():
        for block in teacher.blocks:
            block.up.weight += 0.25 * torch.randn(HIDDEN, 4) @ torch.randn(4, DIMS) / DIMS**0.5
            block.down.weight += 0.25 * torch.randn(DIMS, 4) @ torch.randn(4, HIDDEN) / HIDDEN**0.5
    return model, teacher


def qlora(model: ResidualMLP) -> ResidualMLP:
    """NF4 base (frozen, bias included), an adapter around each linear."""
    torchq.quantize_(model, torchq.nf4_weight_only(block_size=64, double_quant=True))
    model.requires_grad_(False)
    for block in model.blocks:
        block.up, block.down = LoRALinear(block.up, RANK, 16.0), LoRALinear(block.down, RANK, 16.0)
    return model


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the quantized weights this process holds (its shards, under FSDP2)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor's shard on this rank
        if isinstance(local, torchq.AffineQuantizedTensor):
            total += local.nbytes_quantized()
    return total


def shard(model: ResidualMLP, mesh) -> ResidualMLP:
    """FSDP2: each block is its own unit (gathered just in time), then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, DIMS, generator=g)
    batches = [torch.randint(0, 512, (BATCH,), generator=g) for _ in range(STEPS)]
    return x, batches, torch.randn(4, DIMS, generator=g)


def train(model, teacher, rank=0, world=1):
    """AdamW on the adapters; each rank takes its own slice of every batch (data parallel), and
    FSDP2 averages the gradients, so the steps are those of the whole batch on one process."""
    x, batches, _ = data()
    target = teacher(x).detach()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for batch in batches:
        mine = batch.chunk(world)[rank]
        loss = nn.functional.mse_loss(model(x[mine]), target[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def worker(rank: int, world: int, folder: str) -> None:
    """One process of the distributed job (run_local starts it with its rank, in a gloo group)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # two processes share the CPU
    mesh = init_device_mesh("cpu", (world,))
    model, teacher = pretrained_and_teacher()
    model = qlora(model)
    whole = quantized_bytes(model)
    shard(model, mesh)
    held = [None] * world
    dist.all_gather_object(held, quantized_bytes(model))
    weight = model.blocks[0].up.base.weight  # a DTensor whose local shard is a quantized weight
    print(f"rank {rank}: blocks.0.up.base.weight {tuple(weight.shape)} -> local "
          f"{type(weight.to_local()).__name__} {tuple(weight.to_local().shape)}")

    # Train. The loss printed is the mean over both ranks' halves of the batch.
    losses = train(model, teacher, rank, world)
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)
    assert losses[-5:].mean() < 0.5 * losses[:2].mean(), f"the adapters should learn the task: {losses.tolist()}"

    # Save with DCP: every rank writes its own shards (codes, scales, adapters) into one folder.
    dcp.save(torchq.distributed.checkpoint.state_dict(model), checkpoint_id=f"{folder}/checkpoint")
    _, _, probe = data()
    with torch.no_grad():
        trained = model(probe)

    # Load into a freshly built model (other random adapters), quantized and sharded the same
    # way: its state dict is the template that dcp.load fills, then load_state_dict installs
    # the quantized weights.
    torch.manual_seed(123)
    fresh = shard(qlora(build_model()), mesh)
    with torch.no_grad():
        assert not torch.equal(fresh(probe), trained)
    template = torchq.distributed.checkpoint.state_dict(fresh)
    dcp.load(template, checkpoint_id=f"{folder}/checkpoint")
    torchq.distributed.checkpoint.load_state_dict(fresh, template)
    with torch.no_grad():
        reloaded = fresh(probe)
    assert torch.equal(reloaded, trained), "the reloaded model gives the trained model's outputs"

    if rank == 0:
        print(f"quantized base: {whole} bytes whole; held per rank: {held} "
              f"({', '.join(f'{h / whole:.0%}' for h in held)})")
        print(f"loss: {losses[0]:.6f} -> {losses[-1]:.6f} over {len(losses)} steps")
        print(f"checkpoint: {sorted(p.name for p in Path(folder, 'checkpoint').iterdir())}")
        print("reloaded model == trained model on a fixed input (bit for bit)")
        torch.save({"losses": losses, "trained": trained, "whole": whole, "held": held}, f"{folder}/result.pt")


if __name__ == "__main__":
    world = 2
    with tempfile.TemporaryDirectory() as folder:
        # Raises (with the child's traceback) if a rank fails.
        run_local(worker, world, folder)
        result = torch.load(f"{folder}/result.pt")

    # Each rank held about half of the quantized bytes.
    assert all(held < 0.6 * result["whole"] for held in result["held"]), result
    assert sum(result["held"]) >= result["whole"]

    # The same training on one process, whole batches: the same steps up to float rounding (the
    # gradients were averaged over two halves instead of summed over one batch).
    torch.set_num_threads(1)
    model, teacher = pretrained_and_teacher()
    model = qlora(model)
    losses = train(model, teacher)
    with torch.no_grad():
        single = model(data()[2])
    print(f"one process: loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    torch.testing.assert_close(losses, result["losses"], rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(single, result["trained"], rtol=1e-3, atol=1e-4)
    print("QLoRA on NF4 with FSDP2 and DCP: OK")
