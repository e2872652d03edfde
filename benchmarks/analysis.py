"""Hand-written explanations, shown in docs/benchmarks.md under a table whose goal is missed.

Keyed by table id. Written from the profiles the run prints below each missed table; update
them when the core changes and a rerun shows a different picture.
"""

ANALYSIS: dict[str, str] = {}
