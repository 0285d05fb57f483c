"""The cost model and what checks it: the planner (plan), its per-step
collectives (comm_model) and memory (state), the dry run on a fake process group,
and the hardware figures and their calibration."""
