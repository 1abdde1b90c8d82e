"""Every command of ours in the docs (README.md, docs/*.md, bench/README.md), checked against
the code without running it, so that none goes stale: the module exists, every flag given is
one the module's source defines, and its --config with the --config.FIELD=VALUE overrides
loads as the CLIs load it (`rlver_jax.cli.load_config`: field names, value types, variants).
A sweep's --sweep axes are checked as the sweep checks them before its first run
(`rlver_jax.sweep.check_runs`: every run of its grid, its sections' checks included). And
every relative link between the docs names a file that is there, and a heading of it.

Where commands are read: fenced code blocks (a line ending in a backslash goes on) and inline
code spans. A command starts at `python -m MODULE` or `./run_tpu.sh run MODULE`, MODULE in one
of this repository's packages, and ends at the shell's `&&`, `||`, `;`, `|`, `&` or a comment.

What is read as illustrative, by these rules and no others:
- `...` stands for flags left out (a command before's); it is skipped.
- `[...]` marks optional flags: the brackets are dropped and the flags inside are checked.
- An upper-case word (DIR, W, URL, NAME, S, IN.jsonl) or a `<...>` is a placeholder. As a
  --config.FIELD value, the field is checked to exist but is not set; as the FIELD itself
  (`--config.FIELD=VALUE`) the flag is skipped. Other flags' values and positional arguments
  are not checked, placeholders or not.
"""

import ast
import dataclasses
import glob
import importlib.util
import os
import re
import shlex

import pytest

from infra.errors import UserInputError
from rlver_jax import cli, sweep
from tests import ROOT

DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in
                             glob.glob(os.path.join(ROOT, "docs", "*.md"))), "bench/README.md"]
PACKAGES = ("rlver_jax", "rl", "models", "sim_user", "bench")
LAUNCHERS = (("python", "-m"), ("python3", "-m"), ("./run_tpu.sh", "run"))
SHELL_ENDS = {"&&", "||", ";", "|", "&"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.\w+)?$|<[^>]*>")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"`([^`]+)`")


@dataclasses.dataclass(frozen=True)
class Command:
  """One command of a doc: where it is, the module it runs and its arguments, as typed."""
  doc: str
  line: int
  module: str
  args: tuple[str, ...]

  def __str__(self):
    return f"{self.doc}:{self.line}: python -m {self.module} {shlex.join(self.args)}"


def shell_lines(markdown: str):
  """(line number, shell text) of every fenced block's line, continuations joined, and of every
  inline code span outside the blocks (its whitespace, a line break included, made one space)."""
  for block in FENCE.finditer(markdown):
    first = markdown.count("\n", 0, block.start(1)) + 1
    for i, line in enumerate(block.group(1).replace("\\\n", "  ").split("\n")):
      yield first + i, line  # a joined line counts as one: a later line's number is a guess
  # Blank the blocks (keeping their line breaks) so that spans are read outside them only.
  outside = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), markdown)
  for span in SPAN.finditer(outside):
    yield outside.count("\n", 0, span.start()) + 1, " ".join(span.group(1).split())


def commands_in(doc: str) -> list[Command]:
  with open(os.path.join(ROOT, doc)) as f:
    markdown = f.read()
  found = []
  for line, text in shell_lines(markdown):
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
      words = list(lexer)
    except ValueError:  # prose in a span (an apostrophe): no command of ours is like that
      continue
    for i in range(len(words) - 2):
      if tuple(words[i:i + 2]) in LAUNCHERS and words[i + 2].split(".")[0] in PACKAGES:
        end = next((j for j in range(i + 3, len(words)) if words[j] in SHELL_ENDS), len(words))
        found.append(Command(doc, line, words[i + 2], tuple(words[i + 3:end])))
  return found


COMMANDS = [command for doc in DOCS for command in commands_in(doc)]


@dataclasses.dataclass(frozen=True)
class ModuleFlags:
  """What a module's source defines on its command line."""
  names: frozenset[str]  # every flag name (absl's DEFINE_*, argparse's add_argument)
  booleans: frozenset[str]  # absl booleans, which also take --noNAME
  takes_config: bool  # --config and --config.FIELD overrides (its own or its runs')
  config_default: str | None  # the file under configs/ that --config defaults to


def module_flags(paths: list[str]) -> ModuleFlags:
  """The flags that the modules at `paths` (a module, or every module of a package run with
  `python -m`) define, read from their syntax trees: absl's flags.DEFINE_* and
  config_flags.DEFINE_config_file, argparse's add_argument, and --config by `cli.run` /
  `cli.define_config_flag` (its default file their first argument) or, for the runs it
  starts, `cli.load_config` (the second)."""
  names, booleans, takes_config, default = set(), set(), False, None
  for path in paths:
    with open(path) as f:
      tree = ast.parse(f.read())
    constants = {target.id: node.value.value for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 for target in node.targets if isinstance(target, ast.Name)}

    def text(node):
      if isinstance(node, ast.Constant):
        return node.value
      return constants.get(node.id) if isinstance(node, ast.Name) else None

    for node in ast.walk(tree):
      if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
        continue
      call, first = node.func.attr, text(node.args[0])
      if call.startswith("DEFINE_") and isinstance(first, str):
        names.add(first)
        booleans.update([first] if call in ("DEFINE_bool", "DEFINE_boolean") else [])
        takes_config |= call == "DEFINE_config_file"
      elif call == "add_argument":
        names.update(t.lstrip("-") for t in map(text, node.args) if t and t.startswith("--"))
      elif call in ("run", "define_config_flag", "load_config") and \
          isinstance(node.func.value, ast.Name) and node.func.value.id == "cli":
        takes_config, default = True, text(node.args[1 if call == "load_config" else 0])
  return ModuleFlags(frozenset(names), frozenset(booleans), takes_config, default)


def is_placeholder(text: str) -> bool:
  return bool(PLACEHOLDER.search(text))


def problems(command: Command) -> list[str]:
  """What in `command` the code no longer has; [] when it all holds."""
  try:
    spec = importlib.util.find_spec(command.module)
  except ModuleNotFoundError:
    spec = None
  if spec is None or not spec.origin:
    return [f"no module {command.module}"]
  # A package runs its __main__, which may take its flags from any module of the package.
  package = spec.submodule_search_locations
  known = module_flags(sorted(glob.glob(os.path.join(package[0], "*.py"))) if package
                       else [spec.origin])
  unwrapped = (arg.removeprefix("[").removesuffix("]") for arg in command.args)
  args = [arg for arg in unwrapped if arg != "..."]
  config_flags, others = sweep.split_config_flags(args)
  found = []
  for arg in others:
    name = arg.lstrip("-").split("=", 1)[0]
    if arg.startswith("-") and name not in known.names and not (
        name.startswith("no") and name[2:] in known.booleans):
      found.append(f"{command.module} defines no flag --{name}")
  if config_flags and not known.takes_config:
    return [*found, f"{command.module} takes no --config"]
  named = [f for f in config_flags if not is_placeholder(cli.override_field(f) or "")]
  applied = [f for f in named if not (cli.override_field(f) and is_placeholder(f.split("=")[-1]))]
  try:
    if known.takes_config and (config_flags or known.config_default):
      cli.check_override_names(["check", *named], known.config_default or "")
      if command.module == sweep.__name__:
        axes = [sweep.parse_axis(arg.split("=", 1)[1]) for arg in others
                if arg.startswith("--sweep=")]
        sweep.check_runs(applied, sweep.grid(axes, seeds=1), "/sweep")  # seeds set only seed
      elif known.config_default or any(not cli.override_field(f) for f in applied):
        cli.load_config(applied, known.config_default or "")
  except UserInputError as e:
    found.append(str(e))
  return found


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.doc}:{c.line}")
def test_every_command_in_the_docs_holds(command, monkeypatch):
  monkeypatch.chdir(ROOT)  # the docs' paths (configs/demo.py) are the repository's
  assert problems(command) == [], str(command)


def test_every_doc_with_a_command_of_ours_has_its_commands_read():
  """The reader finds commands wherever a doc has one, the README's main command first."""
  readme = [(c.module, c.args) for c in COMMANDS if c.doc == "README.md"]
  assert readme[0] == ("rlver_jax.main", ())
  for doc in DOCS:
    with open(os.path.join(ROOT, doc)) as f:
      has_one = re.search(rf"python3? -m\s+({'|'.join(PACKAGES)})\.", f.read())
    assert bool(has_one) == any(c.doc == doc for c in COMMANDS), doc


@pytest.mark.parametrize("module,args,says", [
    ("rlver_jax.gone", (), "no module rlver_jax.gone"),
    ("rlver_jax.main", ("--config=configs/demo.py", "--config.rl.kl_coeff=0.1"),
     "no field rl.kl_coeff in configs/demo.py; did you mean rl.kl_coef?"),
    ("rlver_jax.main", ("--config.policy.checkpointt=DIR",), "no field policy.checkpointt"),
    ("rlver_jax.eval", ("--config=configs/eval.py", "--config.eval.limit=many"),
     "--config.eval.limit must be of type int"),
    ("rlver_jax.main", ("--config=configs/ppo.py:bogus",), "unknown config variant 'bogus'"),
    ("rlver_jax.plan", ("--topologie=v5p-16",), "rlver_jax.plan defines no flag --topologie"),
    ("rlver_jax.generate", ("--checkpoint", "DIR", "--max-tokens", "8"), "no flag --max-tokens"),
    ("rlver_jax.compare", ("W", "--config=configs/demo.py"), "takes no --config"),
    ("rlver_jax.sweep", ("--sweep=rl.kl_coeff=0,1", "--workdir=W"), "no field rl.kl_coeff")])
def test_a_stale_module_flag_or_field_is_named(module, args, says, monkeypatch):
  monkeypatch.chdir(ROOT)
  assert any(says in problem for problem in problems(Command("doc.md", 1, module, args)))


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces '-'."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS)
def test_every_link_between_the_docs_names_a_file_and_heading_there(doc):
  with open(os.path.join(ROOT, doc)) as f:
    links = [link for link in LINK.findall(f.read()) if "://" not in link]
  for link in links:
    path, _, heading = link.partition("#")
    target = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path or doc))
    assert os.path.exists(target), (doc, link)
    if heading:
      with open(target) as f:
        headings = [anchor(line.lstrip("#")) for line in f if line.startswith("#")]
      assert heading in headings, (doc, link)


def test_the_readme_is_read_in_five_minutes_with_both_commands_first():
  """At most 150 lines, and the two set-up commands (install and run the main job; install and
  run the tests, as .ci/run runs them) in its first 40: the rest is in docs/."""
  with open(os.path.join(ROOT, "README.md")) as f:
    lines = f.read().splitlines()
  assert len(lines) <= 150
  first = "\n".join(lines[:40])
  assert "pip install -e . && python -m rlver_jax.main\n" in first
  assert 'pip install -e ".[test,tpu,gpu]" && python -m pytest -q -n 2' in first
