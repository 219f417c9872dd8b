"""Reports: a report's document model (sections of text, tables, charts), its sections built
from the analyses, rendered to self-contained HTML (plotly) or markdown.

May import everything below :mod:`kvdiag.agent`; one of the two places a UI library (plotly) may
be imported.
"""
