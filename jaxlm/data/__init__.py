"""Data: corpora, tokenizers and the grain input pipeline (knows nothing of models)."""
