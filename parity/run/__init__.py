"""Running the experiment: the run spec and its cases, the arms on a backend, the self-check, localization, stops.
May import every layer below the commands (backends, engines, models, runner, media, trust, judge, plan, results)."""
