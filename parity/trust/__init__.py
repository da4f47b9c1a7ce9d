"""Reading a results file back and the rules a trustworthy file keeps (a run holds itself to them too).
May import the base modules, parity.results, parity.plan.entries, parity.judge and parity.media."""
