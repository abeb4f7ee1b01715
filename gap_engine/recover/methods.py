"""The recovery methods: how a pruned model is fine-tuned after pruning (the registry).

Each function is a run class of ``recover.train`` built as ``(lm, settings)``: it prepares,
steps, saves and finishes one run (``pipeline.recovery`` drives it).
"""

from __future__ import annotations

from gap_engine.core.registry import Choice, Registry

RECOVERY_METHODS = Registry(
    "recovery method",
    [
        Choice("lora", "LoRA adapters (peft) on every projection, merged into the weights", "gap_engine.recover.train:LoraRun"),
        Choice("mazo", "masked zeroth-order (MaZO): forward passes only, the important weights of each row", "gap_engine.recover.train:ZORun"),
        Choice("mezo", "zeroth-order (MeZO): forward passes only, every projection weight", "gap_engine.recover.train:ZORun"),
    ],
)
