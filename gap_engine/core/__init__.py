"""Foundations every stage stands on: typed errors, size ceilings, file validation, atomic
writes and the cache root, named defaults, progress and cancel hooks, device placement, memory
readings. Nothing here knows what a model, a table or a plan is.

This package imports none of its modules: import the module you need.
"""
