"""Tokenizers: the Hugging Face and SentencePiece backends, the bundled byte tokenizer, chat templates."""
