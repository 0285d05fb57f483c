"""The training engine: the Trainer and its set-up (layout, loss, step, optimizer),
checkpoints and Hugging Face weights, metrics, and the job's lifetime."""
