"""`infermesh profile`'s parts: the sweep that measures a running mesh stage by
stage and writes a services/planner/profile.py Profile (the planner's only input
about the hardware), its held-out accuracy check, and its plot."""
