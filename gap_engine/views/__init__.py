"""What a person looks at: Plotly figures and the self-contained HTML report. No streamlit here
either (the background jobs the explorer watches are a runtime: ``pipeline.jobs``).

This package imports none of its modules: import the module you need.
"""
