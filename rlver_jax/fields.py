"""List a config's fields, one line each: dotted name, value and meaning.

  python -m rlver_jax.fields --config=configs/ppo.py[:variant] [--config.x=y ...]

A field's meaning is its entry in the `Attributes:` docstring of its typed
section (`rlver_jax/sections.py`, and the sections it assembles from `rl/` and
`sim_user/`). Where a recipe sets the field with a comment of its own (demo.py's
`c.rl.kl_coef = 0.1` and why), that comment is added after the meaning, in
brackets naming the file: the meaning says what the field is, the addition why
this recipe sets it so.
"""

from __future__ import annotations

import ast
import io
import os
import tokenize

from absl import app, flags
import ml_collections
from ml_collections import config_flags

from rlver_jax import cli, sections

DEFAULT_FILE = "demo.py"


def _comments(text: str) -> tuple[dict[int, str], dict[int, str]]:
  """(line -> the comment after code on it, line -> a comment that is the whole line)."""
  trailing, full_line = {}, {}
  for token in tokenize.generate_tokens(io.StringIO(text).readline):
    if token.type == tokenize.COMMENT:
      comments = trailing if token.line[:token.start[1]].strip() else full_line
      comments[token.start[0]] = token.string.lstrip("#").strip()
  return trailing, full_line


def _comment(trailing, full_line, first_line: int, last_line: int) -> str:
  """The trailing comment of these lines, or else the comment block just above them."""
  for line in range(first_line, last_line + 1):
    if line in trailing:
      return trailing[line]
  block = []
  line = first_line - 1
  while line in full_line:
    block.insert(0, full_line[line])
    line -= 1
  return " ".join(block)


def _dotted_field(target: ast.expr) -> str | None:
  """`c.rl.kl_coef` -> "rl.kl_coef": a recipe sets fields on the config it builds."""
  attributes = []
  while isinstance(target, ast.Attribute):
    attributes.insert(0, target.attr)
    target = target.value
  return ".".join(attributes) if attributes and isinstance(target, ast.Name) else None


def recipe_comments(config_file: str) -> dict[str, list[str]]:
  """Dotted field -> "[file: comment]" for each commented assignment to it in `config_file`
  and the recipes it builds on (`from configs import ppo`), the base recipe's first."""
  found: dict[str, list[str]] = {}
  seen: set[str] = set()

  def read(path: str) -> None:
    if path in seen:
      return
    seen.add(path)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    tree = ast.parse(text, filename=path)
    for node in tree.body:
      if isinstance(node, ast.ImportFrom) and node.module == "configs":
        for alias in node.names:
          read(os.path.join(cli.CONFIGS_DIR, f"{alias.name}.py"))
    trailing, full_line = _comments(text)
    for node in ast.walk(tree):
      if isinstance(node, ast.Assign) and len(node.targets) == 1:
        field = _dotted_field(node.targets[0])
        comment = _comment(trailing, full_line, node.lineno, node.end_lineno)
        if field and comment:
          part = f"[{os.path.basename(path)}: {comment}]"
          if part not in found.setdefault(field, []):
            found[field].append(part)

  read(config_file)
  return found


def rows(config: ml_collections.ConfigDict, config_file: str) -> list[tuple[str, object, str]]:
  """(dotted field, value, meaning) for every field of `config`, loaded from `config_file`,
  in the order its typed run defines them (each section's fields together)."""
  meaning_of = sections.field_meanings(sections.run_type(config))
  why = recipe_comments(config_file)
  values = dict(cli.dotted_fields(config))
  fields = [field for field in meaning_of if field in values]
  fields += [field for field, value in values.items()  # a field the sections do not define
             if field not in meaning_of and not isinstance(value, ml_collections.ConfigDict)]
  return [(field, values[field], " ".join([meaning_of.get(field, "")] + why.get(field, [])).strip())
          for field in fields]


def _section(field: str) -> str:
  return field.rpartition(".")[0]


def listing(config: ml_collections.ConfigDict, config_file: str) -> str:
  """`rows` as aligned lines, a blank line between sections."""
  table = rows(config, config_file)
  name_width = max(len(field) for field, _, _ in table)
  value_width = min(max(len(repr(value)) for _, value, _ in table), 20)
  lines = []
  for i, (field, value, meaning) in enumerate(table):
    if i and _section(field) != _section(table[i - 1][0]):
      lines.append("")
    line = f"{field:<{name_width}}  {repr(value):<{value_width}}"
    lines.append(f"{line}  # {meaning}" if meaning else line.rstrip())
  return "\n".join(lines)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config_file = config_flags.get_config_filename(flags.FLAGS["config"]).split(":", 1)[0]
  print(listing(flags.FLAGS.config, config_file))


if __name__ == "__main__":
  cli.define_config_flag(DEFAULT_FILE, "config file[:variant] whose fields to list")
  app.run(main, flags_parser=cli.parse_flags)
