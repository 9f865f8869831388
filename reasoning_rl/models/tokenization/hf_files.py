"""Reading and writing Hugging Face tokenizer directories.

Files read (what transformers reads, with the same precedence where it matters):
- `tokenizer.json` (HF `tokenizers`), else `tokenizer.model` (SentencePiece);
- `tokenizer_config.json`: named special tokens, `add_bos_token` / `add_eos_token`, `chat_template`;
- `special_tokens_map.json`: named special tokens the config does not name;
- `chat_template.jinja` (wins over the config's template), or `chat_template.json`;
- `generation_config.json`: `eos_token_id` (an id or a list), the model's stop ids.

BOS/EOS rule, as transformers 5 applies it: with tokenizer.json, its post-processor alone decides (the
config's `add_bos_token` / `add_eos_token` are ignored, and no post-processor means none is added). With
only tokenizer.model, BOS is added unless the config says `add_bos_token: false` (the Llama/Mistral
convention), EOS only if it says `add_eos_token: true`.
"""

from collections.abc import Sequence
import json
import os
import pathlib
from typing import Any

import tokenizers

from reasoning_rl.errors import CheckpointError
from reasoning_rl.models.tokenization import backends

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: pathlib.Path) -> dict[str, Any]:
  if not path.is_file():
    return {}
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
    raise CheckpointError(f"{path}: cannot be read as JSON ({error}); fix or delete the file") from error
  if not isinstance(data, dict):
    raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
  return data


def _token_text(value: Any, field: str, path: pathlib.Path) -> str | None:
  """A special token as configs write it: a string, or an AddedToken dict with `content`."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  raise CheckpointError(f"{path}: {field} must be a string or {{'content': ...}}, got {value!r}")


def _default_template(value: Any, path: pathlib.Path) -> str | None:
  """The template to use from a config's `chat_template` (a string, or a list of named ones)."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list):
    named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
    if isinstance(named.get("default"), str):
      return named["default"]
    raise CheckpointError(
        f"{path}: chat_template lists {sorted(map(str, named))} but no 'default' template; add one"
    )
  raise CheckpointError(f"{path}: chat_template must be a string or a list of {{name, template}}")


def _read_chat_template(directory: pathlib.Path, config: dict[str, Any]) -> str | None:
  jinja_file = directory / "chat_template.jinja"
  if jinja_file.is_file():
    return jinja_file.read_text(encoding="utf-8")
  template = _default_template(config.get("chat_template"), directory / "tokenizer_config.json")
  if template is None:
    json_file = directory / "chat_template.json"
    template = _default_template(_read_json(json_file).get("chat_template"), json_file)
  return template


def _id_list(value: Any, field: str, path: pathlib.Path) -> tuple[int, ...]:
  if value is None:
    return ()
  values = value if isinstance(value, list) else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
    raise CheckpointError(f"{path}: {field} must be an integer id or a list of them, got {value!r}")
  return tuple(values)


def read_hf_dir(directory: str | os.PathLike) -> backends.TokenizerParts:
  """Reads the tokenizer files of a Hugging Face model directory (see the module docstring)."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise CheckpointError(f"{directory}: not a directory; pass a Hugging Face model or tokenizer directory")
  config_path = directory / "tokenizer_config.json"
  config = _read_json(config_path)
  special_map_path = directory / "special_tokens_map.json"
  special_map = _read_json(special_map_path)
  texts = {}
  for field in NAMED_SPECIAL_TOKENS:
    text = _token_text(config.get(field), field, config_path)
    if text is None:
      text = _token_text(special_map.get(field), field, special_map_path)
    texts[field] = text

  json_path, model_path = directory / "tokenizer.json", directory / "tokenizer.model"
  if json_path.is_file():
    try:
      tokenizer = tokenizers.Tokenizer.from_file(str(json_path))
    except Exception as error:  # tokenizers raises a bare Exception on malformed files.
      raise CheckpointError(f"{json_path}: not a valid tokenizer.json ({error})") from error
    backend = backends.TokenizersBackend(tokenizer)
    if tokenizer.post_processor is None:
      # Made explicit so that a saved copy keeps adding nothing.
      backend.set_bos_eos(None, None, add_bos=False, add_eos=False)
  elif model_path.is_file():
    backend = _sentencepiece_backend(model_path, config, config_path)
  else:
    raise CheckpointError(
        f"{directory}: has neither tokenizer.json nor tokenizer.model; copy the tokenizer files of the"
        " model into this directory (or pass the .model / .gguf file itself)"
    )

  ids = {}
  for field, text in texts.items():
    ids[field] = None if text is None else backend.token_to_id(text)
    if text is not None and ids[field] is None:
      raise CheckpointError(
          f"{config_path}: {field} {text!r} is not in the vocabulary of {backend.vocab_size} tokens;"
          " fix the token text in tokenizer_config.json / special_tokens_map.json"
      )
  if isinstance(backend, backends.SentencePieceBackend):
    # The model file's own ids stand in for tokens the configs do not name.
    for field, own_id in (("bos_token", backend.bos_id), ("eos_token", backend.eos_id)):
      if ids[field] is None and own_id >= 0:
        ids[field] = own_id
    backend.bos_id = -1 if ids["bos_token"] is None else ids["bos_token"]
    backend.eos_id = -1 if ids["eos_token"] is None else ids["eos_token"]

  generation_path = directory / "generation_config.json"
  generation = _read_json(generation_path)
  extra_eos_ids = _id_list(generation.get("eos_token_id"), "eos_token_id", generation_path)
  for token_id in extra_eos_ids:
    if not 0 <= token_id < backend.vocab_size:
      raise CheckpointError(
          f"{generation_path}: eos_token_id {token_id} is outside the vocabulary of {backend.vocab_size}"
      )
  return backends.TokenizerParts(
      backend=backend,
      source=str(directory),
      bos_id=ids["bos_token"],
      eos_id=ids["eos_token"],
      unk_id=ids["unk_token"],
      pad_id=ids["pad_token"],
      extra_eos_ids=extra_eos_ids,
      chat_template=_read_chat_template(directory, config),
  )


def _sentencepiece_backend(
    model_path: pathlib.Path,
    config: dict[str, Any],
    config_path: pathlib.Path,
) -> backends.SentencePieceBackend:
  try:
    backend = backends.SentencePieceBackend.from_file(
        model_path,
        add_bos=bool(config.get("add_bos_token", True)),
        add_eos=bool(config.get("add_eos_token", False)),
        parse_special_text=True,
    )
  except (OSError, RuntimeError) as error:
    raise CheckpointError(f"{model_path}: not a readable SentencePiece model ({error})") from error
  # Tokens added on top of a SentencePiece model live only in tokenizer.json, which is absent here.
  for token_id, token in (config.get("added_tokens_decoder") or {}).items():
    text = _token_text(token, f"added_tokens_decoder[{token_id}]", config_path)
    if int(token_id) >= backend.vocab_size or backend.token_to_id(text) != int(token_id):
      raise CheckpointError(
          f"{config_path}: added token {text!r} (id {token_id}) is not in {model_path.name}; this"
          " tokenizer needs its tokenizer.json, copy it into the directory"
      )
  return backend


def write_hf_files(
    directory: pathlib.Path,
    *,
    backend: backends.Backend,
    special_tokens: dict[str, str],
    chat_template: str | None,
    bos_id: int | None,
    eos_ids: Sequence[int],
    pad_id: int | None,
) -> list[pathlib.Path]:
  """Writes tokenizer files transformers' `AutoTokenizer.from_pretrained(directory)` reads.

  `special_tokens` maps the declared named tokens (`bos_token`, …) to their text. generation_config.json
  (the stop ids) is written only when the directory has none, since a model writer owns that file.
  """
  directory.mkdir(parents=True, exist_ok=True)
  written = backend.save(directory)
  config: dict[str, Any] = dict(special_tokens)
  if isinstance(backend, backends.TokenizersBackend):
    # tokenizer.json carries the vocabulary, added tokens and BOS/EOS post-processor; no flags here,
    # so that transformers keeps that post-processor.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
  else:
    # transformers rebuilds a BPE from tokenizer.model; `legacy` keeps its handling of text after a
    # special token closest to sentencepiece's, and listing the control pieces makes "<s>" etc.
    # written in the text match as tokens, as `from_hf_dir` does.
    config.update(
        tokenizer_class="LlamaTokenizer",
        add_bos_token=backend.add_bos,
        add_eos_token=backend.add_eos,
        legacy=True,
        added_tokens_decoder={
            str(token_id): {
                "content": backend.id_to_token(token_id),
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token_id in sorted(backend.special_token_ids())
        },
    )
  config["clean_up_tokenization_spaces"] = False
  if chat_template is not None:
    config["chat_template"] = chat_template
  files = {
      "tokenizer_config.json": config,
      "special_tokens_map.json": dict(special_tokens),
  }
  if eos_ids and not (directory / "generation_config.json").exists():
    generation: dict[str, Any] = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else list(eos_ids)}
    if bos_id is not None:
      generation["bos_token_id"] = bos_id
    if pad_id is not None:
      generation["pad_token_id"] = pad_id
    files["generation_config.json"] = generation
  for name, content in files.items():
    path = directory / name
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    written.append(path)
  return written
