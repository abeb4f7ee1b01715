"""Fine-tuning after pruning: the step loop with its probe and guard (``loop``), the training steps, LoRA, the zeroth-order maths (MeZO, MaZO)
and the files a recovery run writes. The stage itself is strung together in pipeline.recovery.

This package imports none of its modules: import the module you need.
"""
