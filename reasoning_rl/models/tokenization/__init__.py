"""Building blocks behind `reasoning_rl.models.tokenizers.Tokenizer`.

`backends` wraps the two tokenizer engines (HF `tokenizers`, `sentencepiece`), `gguf_vocab` turns a GGUF
file's vocabulary into one of them, `hf_files` reads and writes Hugging Face tokenizer directories, and
`chat_template` renders chat templates. Callers should use `Tokenizer` / `load_tokenizer` instead.
"""
