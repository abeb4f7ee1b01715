"""Measuring a (pruned) model: held-out perplexity, KL to dense, throughput, generations, and
the run history that keeps the results.

This package imports none of its modules: import the module you need.
"""
