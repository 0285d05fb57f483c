"""The command line on top of the trainer and the planner: recipes/train.py's entry point
(train), `--layout auto` (layout_auto: the plan, its trials in processes of their own,
trials), each run's measured-vs-predicted line (comparison) and the test hooks that plant
faults (faults). Nothing below imports it."""
