"""A run's plan (every planned case, recorded in every file) and its shards.
May import the base modules and parity.results (the model) only."""
