"""What makes a pruned checkpoint usable outside this tool.

- ``dtypes``: storage precision (bfloat16 by default) and the fingerprint of the stored weights;
- ``remote_code`` + ``modeling_gap_pruned``: the modeling file and ``auto_map`` with which
  ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` builds the
  per-layer widths without gap_engine;
- ``model_card``: the folder's README.md;
- ``gguf``: a llama.cpp file of its ``deci`` architecture (``gap export --format gguf``);
- ``resave``: a checkpoint written again in another precision (``gap export --format hf``).

``checkpoint`` uses the first three while it writes a folder; ``gguf`` and ``resave`` load
models and sit above ``models``. This package imports none of its modules, so importing one
never pulls in the others.
"""
