"""torchq.prefill's per-thread scratch buffer stays writable whichever mode made it: a first call
under torch.inference_mode() must not leave an inference tensor that a later call outside it cannot
write in place (seen in CI: a padded int4 weight's tiles after an inference-mode call)."""

from __future__ import annotations

import threading

import torch

from torchq.prefill import tiled_linear


def test_a_scratch_made_under_inference_mode_is_written_outside_it():
    torch.manual_seed(0)
    n, k = 96, 40
    weight = torch.randn(n, k)
    x = torch.randn(5, k)

    def dequant_rows(n0: int, n1: int, w: torch.Tensor) -> None:
        w.copy_(weight[n0:n1])  # in place, as the padded-K dequantizers do

    results, errors = [], []

    def calls() -> None:  # a fresh thread: its scratch is made by the first call
        try:
            with torch.inference_mode():
                results.append(tiled_linear(x, n, k, dequant_rows, torch.float32))
            results.append(tiled_linear(x, n, k, dequant_rows, torch.float32))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
    assert errors == []
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[1], x @ weight.T)
