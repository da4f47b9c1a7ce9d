"""Everything that renders a judged run for people and CI: report.md and the terminal table
(`report`), JUnit XML (`junit`), plots (`plots`), the GitHub step summary (`ci_summary`), the
before/after table (`before_after`) and the progress display (`progress`).

Nothing here runs a model; only `plots` needs matplotlib, and imports it when it draws.
"""
