"""List a config's fields, one line each: dotted name, value and meaning.

  python -m rlver_jax.fields --config=configs/ppo.py[:variant] [--config.x=y ...]

A field's meaning is the comment on the assignment that defines it in the
config sources: its trailing `# comment`, or else the comment lines just above
it. Where a recipe sets the field again with a comment of its own (demo.py's
`c.rl.kl_coef = 0.1` and why), that comment is added after the meaning, in
brackets naming the file: the meaning says what the field is, the addition why
this recipe sets it so.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import tokenize

from absl import app, flags
import ml_collections
from ml_collections import config_flags

from rlver_jax import cli

DEFAULT_FILE = "demo.py"


@dataclasses.dataclass
class _Source:
  """One config module: its functions, the configs modules it imports, its comments."""
  file_name: str
  functions: dict[str, ast.FunctionDef]
  imported_modules: dict[str, str]  # local name -> module of the configs package
  trailing_comments: dict[int, str]  # line -> the comment after code on that line
  full_line_comments: dict[int, str]  # line -> a comment that is the whole line

  def comment(self, first_line: int, last_line: int) -> str:
    """The trailing comment of these lines, or else the comment block just above them."""
    for line in range(first_line, last_line + 1):
      if line in self.trailing_comments:
        return self.trailing_comments[line]
    block = []
    line = first_line - 1
    while line in self.full_line_comments:
      block.insert(0, self.full_line_comments[line])
      line -= 1
    return " ".join(block)


def _parse_source(path: str) -> _Source:
  with open(path, encoding="utf-8") as f:
    text = f.read()
  trailing, full_line = {}, {}
  for token in tokenize.generate_tokens(io.StringIO(text).readline):
    if token.type == tokenize.COMMENT:
      comments = trailing if token.line[:token.start[1]].strip() else full_line
      comments[token.start[0]] = token.string.lstrip("#").strip()
  tree = ast.parse(text, filename=path)
  functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
  imported = {alias.asname or alias.name: alias.name
              for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "configs"
              for alias in node.names}
  return _Source(os.path.basename(path), functions, imported, trailing, full_line)


@dataclasses.dataclass
class _Assignment:
  field: str  # dotted
  comment: str
  file_name: str


class _Resolver:
  """Follows a config's get_config through the config sources in the order Python runs
  them, recording each assignment to a field with its dotted name and comment.

  It tracks which local name holds which (sub)config: `c.policy = common.policy_config()`
  runs policy_config with the config it returns at "policy". Both branches of an `if`
  are followed (either may run, depending on the variant); other statements (a loop,
  `c.update(...)`) are not, and a field set only there is listed without a meaning.
  """

  def __init__(self, config_file: str):
    self._entry = _parse_source(config_file)
    self._modules: dict[str, _Source] = {}
    self.assignments: list[_Assignment] = []

  def run(self) -> None:
    self._run_function(self._entry, self._entry.functions["get_config"], [], {}, "")

  def _module(self, name: str) -> _Source:
    if name not in self._modules:
      self._modules[name] = _parse_source(os.path.join(cli.CONFIGS_DIR, f"{name}.py"))
    return self._modules[name]

  def _called_function(self, source: _Source, value: ast.expr):
    """(module, function) when `value` calls a function of the config sources, else None."""
    func = value.func if isinstance(value, ast.Call) else None
    if isinstance(func, ast.Name) and func.id in source.functions:
      return source, source.functions[func.id]
    if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
        and func.value.id in source.imported_modules):
      module = self._module(source.imported_modules[func.value.id])
      if func.attr in module.functions:
        return module, module.functions[func.attr]
    return None

  def _run_function(self, source, function, args, keywords, returned_at: str) -> None:
    """Runs `function`, whose returned config sits at `returned_at`; `args` and `keywords`
    give where each argument's config sits (None: not a config)."""
    params = [arg.arg for arg in function.args.args]
    scope = {name: at for name, at in [*zip(params, args), *keywords.items()] if at is not None}
    for node in ast.walk(function):
      if isinstance(node, ast.Return) and isinstance(node.value, ast.Name):
        scope.setdefault(node.value.id, returned_at)
    self._run_body(source, function.body, scope, returned_at)

  def _run_body(self, source, body, scope, returned_at) -> None:
    for statement in body:
      if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        self._assign(source, statement, scope, returned_at)
      elif isinstance(statement, ast.Return) and statement.value is not None:
        self._evaluate(source, statement.value, scope, returned_at)
      elif isinstance(statement, ast.If):
        self._run_body(source, statement.body, scope, returned_at)
        self._run_body(source, statement.orelse, scope, returned_at)

  def _assign(self, source, statement, scope, returned_at) -> None:
    target = statement.targets[0]
    if isinstance(target, ast.Name):
      # `c = ppo.base_config(arg)`: a config built in a function is the one it returns
      at = self._evaluate(source, statement.value, scope, scope.get(target.id, returned_at))
      if at is not None:
        scope[target.id] = at
      return
    field = _dotted_field(target, scope)
    if field is not None and self._evaluate(source, statement.value, scope, field) is None:
      self._record(field, source.comment(statement.lineno, statement.end_lineno), source)

  def _evaluate(self, source, value, scope, at: str) -> str | None:
    """Runs `value` as the value stored at `at`; returns where its config sits, None for a
    value that is not a config."""
    if isinstance(value, ast.Name):
      return scope.get(value.id)
    called = self._called_function(source, value)
    if called is not None and _returns_config(called[1]):
      module, function = called
      # An argument built by a call, as in `planned_memory(base_config(arg))`, is the config
      # that this call returns.
      args = [self._evaluate(source, arg, scope, at) for arg in value.args]
      keywords = {keyword.arg: self._evaluate(source, keyword.value, scope, at)
                  for keyword in value.keywords}
      self._run_function(module, function, args, keywords, at)
      return at
    if _is_config_dict(value):
      literals = [arg for arg in value.args if isinstance(arg, ast.Dict)]
      for literal in literals:  # ConfigDict({"data": 1, ...}): a field per key
        for key, item in zip(literal.keys, literal.values):
          if isinstance(key, ast.Constant):
            self._record(_join(at, key.value), source.comment(key.lineno, item.end_lineno),
                         source)
      return at
    return None

  def _record(self, field, comment, source) -> None:
    self.assignments.append(_Assignment(field, comment, source.file_name))


def _join(at: str, name: str) -> str:
  return f"{at}.{name}" if at else name


def _dotted_field(target: ast.expr, scope: dict[str, str]) -> str | None:
  """`c.rl.kl_coef` -> "rl.kl_coef" when `c` holds the whole config."""
  attributes = []
  while isinstance(target, ast.Attribute):
    attributes.insert(0, target.attr)
    target = target.value
  if not attributes or not isinstance(target, ast.Name) or target.id not in scope:
    return None
  return _join(scope[target.id], ".".join(attributes))


def _returns_config(function: ast.FunctionDef) -> bool:
  """Whether a configs function builds config (unannotated, or annotated a ConfigDict), as
  opposed to computing a value such as `common.compile_cache_dir() -> str`."""
  return function.returns is None or ast.unparse(function.returns).endswith("ConfigDict")


def _is_config_dict(value: ast.expr) -> bool:
  func = value.func if isinstance(value, ast.Call) else None
  name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
  return name == "ConfigDict"


def meanings(config_file: str) -> dict[str, str]:
  """Dotted field -> meaning, in the order the config file's get_config first sets them."""
  resolver = _Resolver(config_file)
  resolver.run()
  parts: dict[str, list[str]] = {}
  for assignment in resolver.assignments:
    field_parts = parts.setdefault(assignment.field, [])
    if not assignment.comment:
      continue
    part = (f"[{assignment.file_name}: {assignment.comment}]" if field_parts
            else assignment.comment)
    if part not in field_parts:
      field_parts.append(part)
  return {field: " ".join(field_parts) for field, field_parts in parts.items()}


def rows(config: ml_collections.ConfigDict, config_file: str) -> list[tuple[str, object, str]]:
  """(dotted field, value, meaning) for every field of `config`, loaded from `config_file`:
  each section's fields together, in the order the file defines them."""
  meaning_of = meanings(config_file)
  defined_order = {field: i for i, field in enumerate(meaning_of)}
  values = {field: value for field, value in cli.dotted_fields(config)
            if not isinstance(value, ml_collections.ConfigDict)}
  # A field the sources do not show being set goes last (its meaning is empty).
  fields = sorted(values, key=lambda field: defined_order.get(field, len(defined_order)))
  section_order = {}
  for field in fields:
    section_order.setdefault(_section(field), len(section_order))
  fields.sort(key=lambda field: section_order[_section(field)])
  return [(field, values[field], meaning_of.get(field, "")) for field in fields]


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
