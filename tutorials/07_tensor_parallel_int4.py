"""Tutorial 7 - serve an int4 model with tensor parallelism (DTensor), across two CPU processes.

    python tutorials/07_tensor_parallel_int4.py

Megatron-style sharding of MLP blocks: each up projection is split by output features
(ColwiseParallel) and each down projection by input features (RowwiseParallel), so a block needs
one all-reduce. torchq weights shard in place: each rank keeps its rows (or columns) of the int4
codes and scales, in the CPU's packed layout, and runs the same int4 kernel on its piece.

parallelize_module's default (src_data_rank=0) scatters rank 0's quantized weight: each rank
receives its rows or columns of the codes and scales, bit-packed, bit for bit the piece it would
have cut itself. src_data_rank=None skips the scatter: every rank shards the weight it holds (the
meta-device model below has no values to send).
Sharding by input features needs whole quantization groups on each rank: here 1024 / 2 = 512
input features per rank, 4 groups of 128.

Bigger models are not built whole on every rank: build on the meta device, quantize there
(formats only, no data), parallelize, and let torchq.distributed.checkpoint.load_quantized_sharded
read each rank's own piece of a torchq.save_quantized file, in the best layout for the device it
loads onto (device=, default the CPU).
"""

import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import torchq
import torchq.distributed.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's examples/ package
from examples.mlp import ResidualMLP  # blocks of x + down(gelu(up(x)))
from examples.processes import run_local  # spawns the ranks, joins them in a gloo group

DIMS, HIDDEN = 256, 1024
CONFIG = torchq.int4_weight_only(group_size=128)


def build_model() -> ResidualMLP:
    """Three residual blocks x + down(gelu(up(x))) of DIMS -> HIDDEN -> DIMS."""
    return ResidualMLP(DIMS, HIDDEN, depth=3)


def quantized_model() -> ResidualMLP:
    """The "pretrained" model (the same on every process), quantized to int4."""
    torch.manual_seed(0)
    model = build_model()
    torchq.quantize_(model, CONFIG)
    return model.eval()


def prompt() -> torch.Tensor:
    return torch.randn(8, DIMS, generator=torch.Generator().manual_seed(1))


def tensor_parallel(model: ResidualMLP, mesh, src_data_rank: int | None = 0) -> ResidualMLP:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.up"] = ColwiseParallel()  # output features split: the GELU runs on each rank's piece
        plan[f"blocks.{i}.down"] = RowwiseParallel()  # input features split: partial sums, all-reduced
    return parallelize_module(model, mesh, plan, src_data_rank=src_data_rank)


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the quantized weights this process holds."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor's piece on this rank
        if isinstance(local, torchq.AffineQuantizedTensor):
            total += local.nbytes_quantized()
    return total


def worker(rank: int, world: int, folder: str) -> None:
    """One process of the distributed job (run_local starts it with its rank, in a gloo group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # two processes share the CPU
    mesh = init_device_mesh("cpu", (world,))
    x = prompt()

    # 1. Every rank builds the whole quantized model, takes the single-process outputs as the
    #    reference, then keeps only its pieces.
    model = quantized_model()
    whole = quantized_bytes(model)
    with torch.no_grad():
        ref_up, ref = model.blocks[0].up(x), model(x)
    tensor_parallel(model, mesh)
    up, down = model.blocks[0].up.weight, model.blocks[0].down.weight
    print(f"rank {rank}: up {tuple(up.shape)} -> {tuple(up.to_local().shape)} {up.placements}, "
          f"down {tuple(down.shape)} -> {tuple(down.to_local().shape)} {down.placements}, "
          f"{quantized_bytes(model)} of {whole} bytes, {up.to_local().quant_layout}")

    with torch.no_grad(), torchq.strict():  # strict: the int4 kernel runs on each piece, no fallback
        up_out, out = model.blocks[0].up(x), model(x)
    # A column-parallel output is this rank's slice of the output features, computed from the
    # same codes and scales by the same kernel: bit for bit.
    assert torch.equal(up_out, ref_up.chunk(world, dim=-1)[rank])
    # A row-parallel output is a sum of two partial sums: equal up to fp32 rounding.
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    held = [None] * world
    dist.all_gather_object(held, quantized_bytes(model))
    assert all(h == whole // world for h in held), (held, whole)

    # 2. Load a single-file checkpoint straight into a sharded model: built on the meta device
    #    (no memory), quantized there (formats, no data), parallelized, then each rank reads
    #    only its rows (up) or columns (down) of the file's codes and scales, into the CPU's
    #    int4 layout (strict mode below proves its kernel runs: no dequantize fallback).
    with torch.device("meta"):
        meta = build_model()
    torchq.quantize_(meta, torchq.int4_weight_only(group_size=128))
    tensor_parallel(meta.eval(), mesh, src_data_rank=None)
    torchq.distributed.checkpoint.load_quantized_sharded(meta, f"{folder}/model.safetensors")
    with torch.no_grad(), torchq.strict():
        loaded = meta(x)
    assert torch.equal(loaded, out), "the loaded model serves the same outputs"

    if rank == 0:
        diff = (out - ref).abs().max().item()
        print(f"quantized weights: {whole} bytes whole; held per rank: {held}")
        print(f"tensor parallel vs one process: column-parallel outputs equal, final max |diff| {diff:.2e}")
        print("loaded from torchq.save_quantized into a meta-built TP model: same outputs")


if __name__ == "__main__":
    world = 2
    with tempfile.TemporaryDirectory() as folder:
        # An ordinary single-process checkpoint (what the workers load in step 2).
        torchq.save_quantized(quantized_model(), f"{folder}/model.safetensors")
        # Raises (with the child's traceback) if a rank fails.
        run_local(worker, world, folder)
    print("tensor-parallel int4: OK")
