"""A causal LM as the engine sees it: one adapter per model family, head and channel geometry,
slicing, block-by-block execution, the rate plan a checkpoint records, the pruned-checkpoint
format (weights, storage dtype, remote code, model card) and loading (built-ins, folders, GGUF,
hub ids).

This package imports none of its modules: import the module you need.
"""
