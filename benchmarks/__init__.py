"""txckpt benchmarks: ``python -m benchmarks run [--quick]`` (``make bench`` / ``make bench-quick``).

Every comparison is measured side by side in one run (interleaved A/B/A/B, the order rotated
each round, medians over rounds), because these machines are shared and noisy: only ratios from
the same run mean anything. The command writes ``docs/benchmarks.md`` and ``docs/benchmarks.png``.

Cases are modules named in :data:`CASES`. Each has ``run(quick: bool) -> dict`` and returns one
table, or ``{"tables": [table, ...]}``. A table is a dict::

    {
      "title": "Save, fsync on",            # section heading
      "about": "markdown: what is measured and how",
      "rows": [{
          "case": "txckpt vs raw write+fsync",  # what is compared
          "size": 67108864,                  # bytes (int) or a label (str); optional
          "txckpt": 0.41, "other": 0.39,     # medians (seconds unless "unit" says otherwise)
          "ratio": 1.05,                     # optional: txckpt / other when both are given
          "goal": 1.10,                      # met when ratio <= goal; None = report only
          "reps": 7,                         # rounds measured
          "paired": [1.02, 1.07, ...],       # optional: per-round ratios (shown as a range)
          "note": "",                        # optional
          "unit": "bytes",                   # optional: this row's columns are byte counts
      }],
      "unit": "s",                           # unit of the txckpt/other columns
      "series": {"method": [[size_bytes, seconds], ...]},  # optional: drawn in the size plot
      "notes": ["markdown paragraph", ...],  # optional: findings, profiles
      "status": "ok" | "pending" | "skipped" | "failed",    # optional, default ok
      "reason": "why pending/skipped/failed",
    }

A case whose module is missing is reported as pending, one that raises as failed: neither
stops the other cases. Cases get their settings (scratch directory, tiny mode for the smoke
test) from :func:`benchmarks.harness.settings`.
"""

#: Case modules, in the order of the report. ``ranks`` and ``s3`` are written by their issues'
#: owners; until they exist the report lists them as pending.
CASES = [
    "save",
    "load",
    "memory",
    "lookup",
    "trainer",
    "ranks",
    "s3",
    "s3load",
    "asyncsave",
    "trainer_async",
    "dcp",
    "incremental",
    "commit_scale",
    "tiered",
    "lightning",
]
#: Cases run on their own (``python -m benchmarks.tensors``, or ``run --cases tensors``), not in
#: every run: the smoke test's tiny run of CASES is at its time limit on a shared 2-core machine.
EXTRA_CASES = ["tensors", "frozen_base"]
