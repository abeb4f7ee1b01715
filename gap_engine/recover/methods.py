"""The recovery methods and objectives: how a pruned model is fine-tuned after pruning and what
the training minimises (the registries).

Each method's function is a run class of ``recover.train`` built as ``(lm, settings, objective)``:
it prepares, steps, saves and finishes one run (``pipeline.recovery`` drives it). Every
objective is one ``recover.distill.Objective`` under its name (the class computes all three).
"""

from __future__ import annotations

from gap_engine.core.registry import Registry

RECOVERY_METHODS = Registry("recovery method", ("gap_engine.recover.train",), first=("lora",))  # declared on the run classes
RECOVERY_OBJECTIVES = Registry("recovery objective", ("gap_engine.recover.distill",))  # declared on the Objective class
