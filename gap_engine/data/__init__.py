"""Text in, token windows out: built-in and local text sources, calibration and held-out
windows, and where each window's counted text starts (BOS handling).

This package imports none of its modules: import the module you need.
"""
