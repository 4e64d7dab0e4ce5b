"""Global state: no import-time probe can fail ``import torchq``; strict mode and
``native.disabled()`` are per thread; pickling comes from the classes themselves."""

from __future__ import annotations

import pickle
import threading

import torch

import torchq
from torchq.canonical import QuantSpec
from torchq.layouts import Int4CPULayout, choose_layout, int4_cpu


def test_a_failed_int4_cpu_probe_makes_the_layout_unfit_with_the_reason(monkeypatch):
    monkeypatch.setattr(int4_cpu, "_ORDER", ["torchq: packing order unknown on this build"])
    spec = QuantSpec((1, 32), 0, 15, "float")
    fit = Int4CPULayout().fit(spec, (16, 64), torch.float32, "cpu")
    assert fit.cannot_hold == "torchq: packing order unknown on this build"
    with torchq.native.disabled():  # int4_cpu would be chosen without the native library
        assert choose_layout(spec, (16, 64), torch.float32, "cpu").name != "int4_cpu"
        reasons = torchq.layouts.layout_rejections(spec, (16, 64), torch.float32, "cpu")
    assert reasons["int4_cpu"] == "torchq: packing order unknown on this build"


def test_strict_and_native_disabled_are_per_thread():
    seen = {}

    def probe():
        seen["strict"] = torchq.is_strict()
        seen["native"] = torchq.native.status().reason

    with torchq.strict(), torchq.native.disabled():
        assert torchq.is_strict()
        t = threading.Thread(target=probe)
        t.start()
        t.join()
    assert seen["strict"] is False
    assert seen["native"] != "disabled by torchq.native.disabled()"
    assert not torchq.is_strict()


def test_objects_pickle_through_their_own_reductions():
    for obj in (torchq.int4_weight_only(32), Int4CPULayout(), QuantSpec((1, 32), 0, 15, "float"), torchq.PerTokenInt8(),
                torchq.MappingType.SYMMETRIC, torchq.ZeroPointDomain.INT):
        reduced = obj.__reduce_ex__(2)
        assert reduced[0] is torchq._rebuild_object
        assert pickle.loads(pickle.dumps(obj)) == obj
