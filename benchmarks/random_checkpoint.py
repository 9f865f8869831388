"""A Hugging Face checkpoint with random weights at a named Llama shape, for timing on a machine
that holds no weights (a lent GPU: nothing can be downloaded there, and SmolLM2's GGUF is larger
than what travels with the source tree).

The tokenizer is SmolLM2-135M-Instruct's (49,152 tokens, its chat template): `--tokenizer` names
a directory of Hugging Face tokenizer files, which `--export_tokenizer DIR` writes here from the
installed GGUF (about 3.5 MB, small enough to carry). Speed does not depend on the weights' values,
only on the shape; both sides of `benchmarks/rl_step.py --model_dir` load the same files.

Shapes (parameters with the tied embedding):
- `tiny`: 2 layers, 64 wide (a CPU check of the scripts themselves);
- `smollm2`: SmolLM2-135M's (30 layers, 576 wide, 9 query / 3 KV heads, MLP 1536): 135 M;
- `1.5b`: 28 layers, 2048 wide, 16 query / 8 KV heads of 128, MLP 6144: 1.5 B.

Usage: python -m benchmarks.random_checkpoint --export_tokenizer DIR
       python -m benchmarks.random_checkpoint --shape smollm2 --tokenizer DIR --out DIR
"""

from __future__ import annotations

import argparse
import pathlib

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128),
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, intermediate_size=1536),
    "1.5b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, intermediate_size=6144),
}


def export_tokenizer(directory: pathlib.Path) -> None:
  """SmolLM2's tokenizer files, from the installed GGUF, into `directory`."""
  import transformers

  from benchmarks.installed import smollm2_gguf

  path = smollm2_gguf()
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  tokenizer.save_pretrained(directory)


def write_checkpoint(shape: str, tokenizer_dir: pathlib.Path, out: pathlib.Path,
                     seed: int = 0) -> None:
  """A float32 LlamaForCausalLM of `shape` with random weights, and the tokenizer, into `out`."""
  import torch
  import transformers

  tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  config = transformers.LlamaConfig(
      vocab_size=len(tokenizer), max_position_embeddings=8192, rope_theta=100_000.0,
      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
      **SHAPES[shape])
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(config).to(torch.float32)
  model.save_pretrained(out)
  tokenizer.save_pretrained(out)
  count = sum(p.numel() for p in model.parameters())
  print(f"{out}: {shape}, {count / 1e6:,.0f} M parameters, vocabulary {config.vocab_size}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--export_tokenizer", type=pathlib.Path,
                      help="write SmolLM2's tokenizer files here and stop")
  parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
  parser.add_argument("--tokenizer", type=pathlib.Path, help="a directory of tokenizer files")
  parser.add_argument("--out", type=pathlib.Path)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  if args.export_tokenizer:
    export_tokenizer(args.export_tokenizer)
    return
  if not (args.tokenizer and args.out):
    parser.error("--tokenizer and --out are needed (or --export_tokenizer DIR)")
  write_checkpoint(args.shape, args.tokenizer, args.out, args.seed)


if __name__ == "__main__":
  main()
