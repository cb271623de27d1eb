"""Regenerates the paper's Tables 3-4 and Figure 2 from run records (metrics.jsonl, summary.json)."""
