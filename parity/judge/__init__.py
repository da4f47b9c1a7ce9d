"""Judging a run: comparisons and their metrics, the verdict rules and the evidence they need, what makes files one experiment.
May import the base modules, parity.results, parity.plan.entries and parity.runner.buckets; backends come down as registry data."""
