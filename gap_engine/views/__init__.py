"""What a person looks at: Plotly figures, the self-contained HTML report and the background
jobs the explorer watches. No streamlit here either.

This package imports none of its modules: import the module you need.
"""
