"""Exporting a pruned checkpoint for use elsewhere: a llama.cpp GGUF file of its ``deci``
architecture (``gguf``, ``gap export --format gguf``) and a checkpoint written again in another
precision (``resave``, ``gap export --format hf``). The checkpoint format itself (storage dtype,
remote code, model card) lives in ``model``, because every pruned run writes one.

This package imports none of its modules: import the module you need.
"""
