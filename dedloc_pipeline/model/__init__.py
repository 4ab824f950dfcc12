"""What is trained and on what: presets, the ALBERT model and its flat vector, the tokenizer, the
Bengali corpus, packing text into tokenized shards, and each peer's data stream."""
