"""The model presets as plain data: config, the CLI and status read them without loading torch."""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # ~0.3M parameters: the test suite's model. In chunks of 40960 it is cut as tiny is (8 chunks,
    # 3 parts), and its in-process test cases take 2.4x less time than tiny's (219 s -> 90 s).
    "micro": dict(vocab_size=2000, embedding_size=64, hidden_size=128, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=256, max_position_embeddings=128),
    # ~1.9M parameters: the protocol's workhorse for tests and CPU demos.
    "tiny": dict(vocab_size=8000, embedding_size=128, hidden_size=256, num_hidden_layers=4,
                 num_attention_heads=4, intermediate_size=1024, max_position_embeddings=128),
    # ~5.6M parameters: demos on a CPU that still look like a language model.
    "small": dict(vocab_size=16000, embedding_size=128, hidden_size=512, num_hidden_layers=6,
                  num_attention_heads=8, intermediate_size=2048, max_position_embeddings=128),
    # ALBERT-large as sahajBERT trained it: 24 layers sharing one set of weights, ~18M parameters.
    "sahajbert": dict(vocab_size=32000, embedding_size=128, hidden_size=1024, num_hidden_layers=24,
                      num_attention_heads=16, intermediate_size=4096, max_position_embeddings=512),
    # Causal decoders (Llama, model/causal.py) for the local-steps mode: ~2.1M for tests and CPU runs,
    # then GPT-2-small-sized, TinyLlama-1.1B-sized and Llama-2-7B-sized (built for real on a GPU only).
    "causal-tiny": dict(family="causal", vocab_size=8000, hidden_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, intermediate_size=512,
                        max_position_embeddings=128, tie_word_embeddings=True),
    "causal-125m": dict(family="causal", vocab_size=32000, hidden_size=768, num_hidden_layers=12,
                        num_attention_heads=12, num_key_value_heads=12, intermediate_size=2048,
                        max_position_embeddings=1024, tie_word_embeddings=True),
    "causal-1b": dict(family="causal", vocab_size=32000, hidden_size=2048, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632,
                      max_position_embeddings=2048, tie_word_embeddings=False),
    "causal-7b": dict(family="causal", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                      max_position_embeddings=2048, tie_word_embeddings=False),
}
SPECIAL_TOKENS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def seq_len_of(preset: str, seq_len: int | None = None) -> int:
    return seq_len or PRESETS[preset]["max_position_embeddings"]


def family(preset: str) -> str:
    """``albert`` (masked LM and sentence order, model/albert.py) or ``causal`` (model/causal.py)."""
    return PRESETS[preset].get("family", "albert")


def model_kwargs(preset: str) -> dict:
    """The preset's model config, as its family's transformers config takes it."""
    return {k: v for k, v in PRESETS[preset].items() if k != "family"}
