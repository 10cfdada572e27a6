"""Position encodings, by `config.model.position` name, with the arithmetic the rest of jaxlm asks of
them: the parameters they add and what they keep for the backward pass (the planner).

`rope` rotates the queries and keys (`layers.apply_rope`, in the attention); `learned` adds a row of a
[max_seq_len, d_model] table to each token's embedding (`Transformer.embed_tokens`).
"""

from __future__ import annotations

F32 = 4


class Rope:
    name = "rope"

    @staticmethod
    def params(max_seq_len: int, d_model: int) -> int:
        return 0

    @staticmethod
    def saved_bytes_per_token(head_dim: int) -> float:
        """The sines and cosines of the rotation, float32, for q and for k."""
        return 4 * F32 * head_dim / 2


class Learned:
    name = "learned"

    @staticmethod
    def params(max_seq_len: int, d_model: int) -> int:
        return max_seq_len * d_model

    @staticmethod
    def saved_bytes_per_token(head_dim: int) -> float:
        return 0.0


POSITIONS = {cls.name: cls for cls in (Rope, Learned)}
