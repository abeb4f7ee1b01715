"""One sentence per technical term the pages show, as a help popover (the ? beside a label)."""

from __future__ import annotations

GLOSSARY = {
    "fisher": "fisher: estimates each cell's loss increase from squared gradients (a second-order Taylor term), "
    "from one forward and backward pass; fast, and an estimate.",
    "taylor": "taylor: estimates each cell from gradient times weight (a first-order Taylor term); fast, NLL only.",
    "wanda": "wanda: ranks a unit by its weights' magnitudes times the size of the activations that flow into them.",
    "criterion": "The criterion ranks the heads or channels inside one layer and the lowest-ranked go first: magnitude "
    "(weight sizes), wanda (weights times activations), flap (how much a unit's output varies), taylor (gradient times weight).",
    "split": "split: attention and MLP of a layer get their own rates; block: one rate for the whole layer.",
    "nats/token": "nats/token: the loss per predicted token in natural-log units; +0.1 nats/token multiplies perplexity by about 1.105.",
    "prunable": "Prunable parameters are those in attention heads and MLP channels; embeddings and norms are never pruned, "
    "so budgets are percentages of the prunable parameters.",
    "DP front": "The DP front: for every budget, the least predicted loss increase any per-layer plan can reach, "
    "solved exactly by dynamic programming (GAP).",
    "dense objective": "The objective (NLL or KL) of the unpruned model on the calibration windows; the table's cells "
    "are increases over it (KL to itself is 0, so a KL table shows 0.0000 here).",
    "plan hash": "A plan's content hash: 12 hex digits of SHA-256 over its rates, model, budget and predicted loss. "
    "The same plan has the same hash on every page, in the run history, the checkpoint and every export.",
    "compensation": "Compensation after the cut: what the kept heads and channels get once the cut is made, fitted block by "
    "block on the table's calibration text: FLAP's bias (a bias on each o_proj and down_proj that lost inputs), a "
    "least-squares refit of those projections, or both. The biases are parameters too: the planner's budget pays for "
    "them, so its parameters left are the pruned model's. One choice for the planner and Prune & evaluate.",
    "held-out KL": "Held-out KL: the KL divergence from the dense to the pruned model's next-token distribution on the held-out "
    "text (never used to plan), in nats/token.",
    "calibration KL": "Calibration KL: the same divergence measured on the calibration windows the table was built from; "
    "it is what the table predicts, so it is the measured counterpart of the predicted increase.",
    "speed-up spread": "Speed is timed in interleaved repeats of dense and pruned; the range is the lowest to highest "
    "repeat. Two speed-ups whose ranges overlap are within noise: neither is shown to be faster.",
    "task accuracy": "Task accuracy: the share of multiple-choice questions answered right (the choice with the highest "
    "log-likelihood), computed by EleutherAI's lm-evaluation-harness as papers report it; ± is its standard error, "
    "and two models differ beyond noise only when their accuracies are more than about two standard errors apart.",
}
