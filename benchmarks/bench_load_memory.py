"""Peak memory of loading a real model through transformers, float against quantized while loading
(``from_pretrained(quantization_config=torchq.hf.TorchqConfig(config))``), each in a fresh process.

For each model and config a child process imports everything, loads the model once (warm-up:
lazily imported modules, allocator pools), then loads it again and runs one forward pass while a
thread samples ``/proc/self/status`` every 2 ms. Columns (MiB added by the second load + forward):

* ``anon``: peak anonymous resident memory: what the process itself holds (quantized weights,
  temporaries). transformers keeps float CPU weights in the safetensors memory map, so a float
  model lives in file-backed pages instead;
* ``resident``: peak anonymous + file-backed resident memory (the float model's mapped pages; a
  quantized load also maps each float weight while it reads it);
* ``weights``: bytes of the model's parameters after loading (quantized: their packed bytes).

    python benchmarks/bench_load_memory.py                  # SmolLM2 and MiniLM, float and four configs
    python benchmarks/bench_load_memory.py --models smollm --configs int4-g32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout, whose examples/ package the child imports
sys.path.insert(0, str(REPO))

CHILD = r"""
import json, sys, threading, warnings, contextlib, io
sys.path.insert(0, sys.argv[4])
import torch, torchq

def rss():
    with open("/proc/self/status") as f:
        v = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("RssAnon:", "RssFile:"))}
    return v["RssAnon"], v["RssFile"]

class Peak:
    def __enter__(self):
        self.start = rss(); self.anon, self.total = self.start[0], sum(self.start)
        self.stop = threading.Event(); self.t = threading.Thread(target=self.run); self.t.start(); return self
    def sample(self):
        a, f = rss(); self.anon = max(self.anon, a); self.total = max(self.total, a + f)
    def run(self):
        while not self.stop.wait(0.002):
            self.sample()
    def __exit__(self, *exc):
        self.stop.set(); self.t.join(); self.sample()

from examples import hf_models
model_name, config, lm_head = sys.argv[1], sys.argv[2], sys.argv[3]
qc = None if config == "float" else torchq.hf.TorchqConfig(config, modules_to_not_convert=[] if lm_head == "same" else None)
load = hf_models.load_smollm if model_name == "smollm" else hf_models.load_minilm
ids = torch.ones(1, 8, dtype=torch.long)
warnings.simplefilter("ignore")
with contextlib.redirect_stderr(io.StringIO()):
    m = load(qc)
    with torch.no_grad():
        m(ids)
    del m
    with Peak() as p:
        m = load(qc)
        with torch.no_grad():
            m(ids)
weights = sum(t.nbytes_quantized() if isinstance(t, torchq.AffineQuantizedTensor) else t.numel() * t.element_size()
              for t in m.parameters())
print(json.dumps({"anon": p.anon - p.start[0], "resident": p.total - sum(p.start), "weights": weights}))
"""


def measure(model: str, config: str, lm_head: str = "float") -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, config, lm_head, str(REPO)], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{model} {config}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm,minilm", help="comma-separated: smollm, minilm")
    p.add_argument("--configs", default="int8wo,int4-g32,int4-g128,nf4", help="comma-separated config names (float is always run)")
    p.add_argument("--lm-head", choices=("float", "same"), default="float",
                   help="the output embedding stays float (default, transformers' convention) or takes the config too")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = p.parse_args(argv)
    from examples import hf_models

    if "smollm" in args.models:
        hf_models.smollm_folder()  # the one-time conversion, outside the measured processes
    rows = []
    for model in [m for m in args.models.split(",") if m]:
        for config in ["float"] + [c for c in args.configs.split(",") if c and c != "float"]:
            print(f"[{model} {config}]", file=sys.stderr, flush=True)
            rows.append({"model": model, "config": config, **measure(model, config, args.lm_head)})
    mib = 2**20
    head = ("model", "config", "weights MiB", "anon MiB", "resident MiB", "anon vs float weights")
    table = [head]
    for r in rows:
        fl = next(b for b in rows if b["model"] == r["model"] and b["config"] == "float")
        table.append((r["model"], r["config"], f"{r['weights'] / mib:.1f}", f"{r['anon'] / mib:.1f}", f"{r['resident'] / mib:.1f}",
                      f"{r['anon'] / fl['weights']:.2f}"))
    widths = [max(len(x[i]) for x in table) for i in range(len(head))]
    print("\n".join("  ".join(v.ljust(w) for v, w in zip(x, widths)).rstrip() for x in table))
    print("# MiB added by from_pretrained + one forward (after a warm-up load in the same process); anon: anonymous "
          "memory; resident: anon + file-backed (memory-mapped safetensors pages)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
