"""Training the default model: corpus, tokenizer, Mixtral presets, training loop, routing measurements."""
