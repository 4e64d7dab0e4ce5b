"""Tutorial 8 - quantization-aware training: win back what round to nearest loses.

    python tutorials/08_qat_distillation.py

all-MiniLM-L6-v2 (a sentence-embedding model) in int4 with one scale per 128 weights loses a
little of its embeddings to round to nearest. Here a copy of it trains *through* the int4
quantizer (``torchq.qat.prepare``) to reproduce the float model's embeddings of sentences from
chapters 1-12 of Pride and Prejudice (distillation: no labels needed), then becomes the real int4
model (``torchq.qat.convert``) and is scored on the held-out chapters 13-16. Last, the round to
nearest model's float parameters alone (norms, biases: ``torchq.qat.prepare_float_tuning``) train
by the same distillation.
(``benchmarks/bench_accuracy.py --qat`` runs the same recipe at full scale, and on SmolLM2.)
"""

import copy
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import torchq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's examples/ package
from examples import minilm  # noqa: E402

torch.manual_seed(0)

text = (ROOT / "benchmarks" / "data" / "pride_and_prejudice_ch1-16.txt").read_text()
cut = text.index("Chapter 13")


def sentences(part: str) -> list[str]:
    return [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+", part) if len(s.strip()) > 20]


train, held_out = sentences(text[:cut]), sentences(text[cut:])[:160]
tok = minilm.load_tokenizer()
teacher = minilm.load_model()  # the float model: its embeddings are the targets
config = torchq.int4_weight_only(group_size=128)


def cosine_to_float(model) -> float:
    """Mean cosine between the model's and the float model's held-out embeddings."""
    ids, mask = minilm.batch(tok, held_out)
    with torch.no_grad():
        return float((model(ids, mask) * teacher(ids, mask)).sum(-1).mean())


# 1. Round to nearest: quantize_ the float weights as they are.
rtn = torchq.quantize_(copy.deepcopy(teacher), config)
print(f"round to nearest:            cosine {cosine_to_float(rtn):.4f}")

def distill(student, params, lr: float, steps: int = 40) -> None:
    """Train ``params`` so that ``student``'s embeddings of 16 random sentences of chapters 1-12
    a step come close to the float model's (1 - cosine)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for step in range(steps):
        pick = torch.randint(0, len(train), (16,), generator=g).tolist()
        ids, mask = minilm.batch(tok, [train[i] for i in pick])
        with torch.no_grad():
            target = teacher(ids, mask)
        loss = (1 - F.cosine_similarity(student(ids, mask), target, dim=-1)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 20 == 0:
            print(f"  step {step:3d}: 1 - cosine {float(loss.detach()):.5f}")
    print(f"  trained in {time.perf_counter() - t0:.0f} s")


# 2. QAT: the student computes with its int4 weights; gradients pass the rounding straight through.
student = torchq.qat.prepare(copy.deepcopy(teacher), config)
distill(student, student.parameters(), lr=2e-5)

# 3. Convert: quantize_ with the same config; the outputs are the prepared model's, bit for bit.
ids, mask = minilm.batch(tok, held_out[:8])
with torch.no_grad():
    before = student(ids, mask)
    torchq.qat.convert(student)
    assert torch.equal(student(ids, mask), before)
assert isinstance(student.encoder.layer[0].attention.self.query.weight, torchq.AffineQuantizedTensor)

rtn_cos, qat_cos = cosine_to_float(rtn), cosine_to_float(student)
print(f"quantization-aware training: cosine {qat_cos:.4f}")
print(f"share of round to nearest's loss recovered: {(qat_cos - rtn_cos) / (1 - rtn_cos):.0%}")
assert qat_cos > rtn_cos

# 4. The other way: keep round to nearest's codes and train only what the quantized model keeps in
#    float (its LayerNorms and biases), with the same distillation: nothing to convert after.
tuned = torchq.quantize_(copy.deepcopy(teacher), config)
params = torchq.qat.prepare_float_tuning(tuned)  # the rest is frozen
distill(tuned, params, lr=1e-3)
tuned_cos = cosine_to_float(tuned)
print(f"float parameters tuned ({sum(p.numel() for p in params)} of them): cosine {tuned_cos:.4f}")
assert tuned_cos > rtn_cos
print("OK")
