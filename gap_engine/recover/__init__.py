"""Fine-tuning after pruning: the training loop, LoRA, the zeroth-order maths (MeZO, MaZO)
and the files a recovery run writes. The stage itself is strung together in pipeline.recovery.

This package imports none of its modules: import the module you need.
"""
