"""The recovery methods and objectives: how a pruned model is fine-tuned after pruning and what
the training minimises (the registries).

Each method's function is a run class of ``recover.train`` built as ``(lm, settings, objective)``:
it prepares, steps, saves and finishes one run (``pipeline.recovery`` drives it). Every
objective is one ``recover.distill.Objective`` under its name (the class computes all three).
"""

from __future__ import annotations

from gap_engine.core.registry import Choice, Registry

RECOVERY_METHODS = Registry(
    "recovery method",
    [
        Choice("lora", "LoRA adapters (peft) on every projection, merged into the weights", "gap_engine.recover.train:LoraRun"),
        Choice(
            "mazo", "masked zeroth-order (MaZO): forward passes only, the important weights of each row", "gap_engine.recover.train:ZORun"
        ),
        Choice("mezo", "zeroth-order (MeZO): forward passes only, every projection weight", "gap_engine.recover.train:ZORun"),
    ],
)

RECOVERY_OBJECTIVES = Registry(
    "recovery objective",
    [
        Choice(
            "kd", "distil from the dense model: KL(dense || pruned) of the next-token distributions", "gap_engine.recover.distill:Objective"
        ),
        Choice("lm", "next-token loss on the training text", "gap_engine.recover.distill:Objective"),
        Choice("kd+lm", "both, weighted: w * kd + (1 - w) * lm (w = 0.5 unless set)", "gap_engine.recover.distill:Objective"),
    ],
)
