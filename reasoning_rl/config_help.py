"""What `launch/train.py --help` prints and docs/config.md holds, both from the one schema: every
section's fields (`config_schema.SECTIONS`), then what every reward part sets, then every
reward-part kind's and environment's settings (`config_groups.GROUPS`).

  python -m reasoning_rl.config_help > docs/config.md
"""

from __future__ import annotations

import textwrap

from reasoning_rl.config_groups import GROUPS, PART_KIND, PART_WEIGHT
from reasoning_rl.config_fields import Field, accepts, kind_name
from reasoning_rl.config_schema import SECTIONS


def listing() -> list[tuple[str, str, str, list[tuple[str, Field]]]]:
  """What --help and docs/config.md show, in order: (path, qualifier, doc, [(dotted name,
  field)]) for every section, then what every reward part sets, then every Group."""
  out = [(section.name, "", section.doc,
          [(f"{section.name}.{item.name}" if section.name else item.name, item)
           for item in section.fields]) for section in SECTIONS]
  out.append(("rewards.<name>", "(every kind)", "Every reward part sets its weight; its kind is "
              "its name unless given. The settings of each kind follow.",
              [(f"rewards.<name>.{item.name}", item) for item in (PART_WEIGHT, PART_KIND)]))
  for group in GROUPS:
    out.append((group.path, group.qualifier, group.doc,
                [(f"{group.path}.{item.name}", item) for item in group.fields]))
  return out


def help_text() -> str:
  """Every field, grouped by section, then every reward-part kind's and environment's settings:
  --config.NAME=DEFAULT, type, accepted values, meaning."""
  lines = ["Config fields (override any with --config.NAME=VALUE):"]
  for path, qualifier, doc, entries in listing():
    lines.append("")
    heading = (path or "run") + (f" {qualifier}" if qualifier else "")
    lines.append(textwrap.fill(f"[{heading}] {doc}", width=100))
    for dotted, item in entries:
      rule = accepts(item)
      lines.append(f"  --config.{dotted}={item.default!r}  ({kind_name(item)}"
                   f"{'; ' + rule if rule else ''})")
      lines.append(textwrap.fill(item.doc, width=100, initial_indent=" " * 6,
                                 subsequent_indent=" " * 6))
  return "\n".join(lines) + "\n"


def markdown_table() -> str:
  """docs/config.md: one table per section and Group (a test keeps the file equal to this)."""
  out = ["# Config fields", "",
         "Generated from `reasoning_rl/config_schema.py` and `reasoning_rl/config_groups.py` "
         "(`python -m reasoning_rl.config_help > docs/config.md`); `python launch/train.py --help` prints the same. Override any "
         "field with `--config.NAME=VALUE`.", ""]
  for path, qualifier, doc, entries in listing():
    out += [f"## `{path or '(top level)'}`" + (f" {qualifier}" if qualifier else ""), "", doc, ""]
    if not entries:
      continue
    out += ["| field | default | accepts | meaning |", "|---|---|---|---|"]
    for _, item in entries:
      text = item.doc.replace("|", "\\|")
      rule = accepts(item).replace("|", "\\|")
      shown = repr(item.default).replace("|", "\\|")
      out.append(f"| `{item.name}` | `{shown}` | {rule} | {text} |")
    out.append("")
  return "\n".join(out)


if __name__ == "__main__":
  print(markdown_table(), end="")
