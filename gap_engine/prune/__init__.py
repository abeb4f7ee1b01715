"""Which heads and channels go (importance criteria) and physically removing them (surgery).

This package imports none of its modules: import the module you need.
"""
