"""Data: one registry of sample sources (every one a pure function of the global sample index) and one
rank-aware, stateful loader."""
