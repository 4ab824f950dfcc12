"""The model presets as plain data: config, the CLI and status read them without loading torch."""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # ~1.9M parameters: the protocol's workhorse for tests and CPU demos.
    "tiny": dict(vocab_size=8000, embedding_size=128, hidden_size=256, num_hidden_layers=4,
                 num_attention_heads=4, intermediate_size=1024, max_position_embeddings=128),
    # ~5.6M parameters: demos on a CPU that still look like a language model.
    "small": dict(vocab_size=16000, embedding_size=128, hidden_size=512, num_hidden_layers=6,
                  num_attention_heads=8, intermediate_size=2048, max_position_embeddings=128),
    # ALBERT-large as sahajBERT trained it: 24 layers sharing one set of weights, ~18M parameters.
    "sahajbert": dict(vocab_size=32000, embedding_size=128, hidden_size=1024, num_hidden_layers=24,
                      num_attention_heads=16, intermediate_size=4096, max_position_embeddings=512),
}
SPECIAL_TOKENS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def seq_len_of(preset: str, seq_len: int | None = None) -> int:
    return seq_len or PRESETS[preset]["max_position_embeddings"]
