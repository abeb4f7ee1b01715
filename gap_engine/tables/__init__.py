"""The loss table: one sensitivity curve per layer and component, measured exactly, estimated
from gradients, streamed, on Ray workers or refined; its on-disk cache and the cost model that
predicts a build's time and memory.

This package imports none of its modules: import the module you need.
"""
