"""``python -m twinflow.tune``: the ratio planner's command line (the planner itself is :mod:`twinflow.plan`)."""
