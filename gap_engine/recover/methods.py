"""The recovery methods and objectives: how a pruned model is fine-tuned after pruning and what
the training minimises (the registries).

Each method's function is a run class of ``recover.train`` built as ``(lm, settings, objective)``:
it prepares, steps, saves and finishes one run (``pipeline.recovery`` drives it). Every
objective is one ``recover.distill.Objective`` under its name (the class computes all three).
"""

from __future__ import annotations

from dataclasses import dataclass

from gap_engine.core.registry import Registry, Strategy


@dataclass(frozen=True, kw_only=True)
class RecoveryMethod(Strategy):
    """A recovery method and its price per step (the cost model)."""

    step_passes: float  # one step of the student, in forward passes of its batch
    draws_noise: bool = False  # zeroth order: each step draws a perturbation of every trained weight
    masked: bool = False  # trains the important weights only, scored on windows of their own before the first step


@dataclass(frozen=True)
class RecoveryObjective(Strategy):
    """What recovery minimises (``function``: the objective class)."""


RECOVERY_METHODS: Registry[RecoveryMethod] = Registry(
    "recovery method",
    RecoveryMethod,
    (
        RecoveryMethod("lora", "LoRA adapters (peft) on every projection, merged into the weights", "gap_engine.recover.train:LoraRun", step_passes=3.0),
        RecoveryMethod(
            "mazo", "masked zeroth-order (MaZO): forward passes only, the important weights of each row", "gap_engine.recover.train:ZORun",
            step_passes=2.0, draws_noise=True, masked=True,
        ),
        RecoveryMethod(
            "mezo", "zeroth-order (MeZO): forward passes only, every projection weight", "gap_engine.recover.train:ZORun",
            step_passes=2.0, draws_noise=True,
        ),
    ),
)  # fmt: skip
RECOVERY_OBJECTIVES: Registry[RecoveryObjective] = Registry(
    "recovery objective",
    RecoveryObjective,
    (
        RecoveryObjective(
            "kd", "distil from the dense model: KL(dense || pruned) of the next-token distributions", "gap_engine.recover.distill:Objective"
        ),
        RecoveryObjective("lm", "next-token loss on the training text", "gap_engine.recover.distill:Objective"),
        RecoveryObjective("kd+lm", "both, weighted: w * kd + (1 - w) * lm (w = 0.5 unless set)", "gap_engine.recover.distill:Objective"),
    ),
)
