"""Post-training objectives beyond SFT (issue 50): distillation from a teacher (`distill`); GRPO's parts
(`grpo`, with its reward functions in `rewards`)."""
