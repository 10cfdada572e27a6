"""Post-training objectives beyond SFT (issue 50): distillation from a teacher (`distill`)."""
