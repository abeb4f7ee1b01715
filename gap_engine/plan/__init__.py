"""Choosing per-layer rates under one budget: GAP's DP front (front.py, over ``core.knapsack``, pure numpy), the
planning problem, the DP front, the baseline allocators, evolutionary search, and the front as
the explorer shows it.

This package imports none of its modules: import the module you need.
"""
