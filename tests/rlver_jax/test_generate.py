"""The generation CLI, chat formatting and the tiny checkpoint we ship."""

import io
import json
import shutil

import pytest
from transformers import AutoTokenizer

from models import partitioning, qwen2
from models.chat import ChatFormatter
from models.batch_sampler import BatchSampler
from models.sampler import Sampler
from models.sampling import SamplingParams
from rlver_jax import generate


def test_tiny_checkpoint_is_a_complete_hf_directory(tiny_checkpoint):
  tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
  model = qwen2.from_pretrained(tiny_checkpoint)
  assert model.config.vocab_size >= len(tokenizer)
  assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
  text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
  assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_continuation_ids_equal_the_full_render(tiny_checkpoint):
  formatter = ChatFormatter(AutoTokenizer.from_pretrained(tiny_checkpoint))
  first = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "I am tired."}]
  reply = {"role": "assistant", "content": "I hear you."}
  second = [{"role": "user", "content": "Thanks."}]
  fed = formatter.prompt_ids(first) + formatter.encode("I hear you.<|im_end|>")
  fed += formatter.continuation_ids(first + [reply], True, second)
  assert fed == formatter.prompt_ids(first + [reply] + second)
  # A reply cut at the length limit gets its end-of-turn token fed first.
  cut = formatter.prompt_ids(first) + formatter.encode("I hear you.")
  cut += formatter.continuation_ids(first + [reply], False, second)
  assert cut == fed


def write_jsonl(path, lines):
  path.write_text("".join(line + "\n" for line in lines))
  return str(path)


def test_cli_writes_one_line_per_prompt_in_order(tiny_checkpoint, tmp_path):
  prompts = write_jsonl(tmp_path / "in.jsonl", [
      json.dumps({"messages": [{"role": "user", "content": "I failed the exam."}]}),
      json.dumps({"prompt": "Tell me more"}),
      "",
      json.dumps({"input_ids": [5, 6, 7]}),
  ])
  out = tmp_path / "out.jsonl"
  rc = generate.main(["--checkpoint", str(tiny_checkpoint), "--prompts", prompts,
                      "--output", str(out), "--max-new-tokens", "6", "--temperature", "0",
                      "--batch-size", "2"])
  assert rc == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(rows) == 3
  for row in rows:
    assert set(row) == {"output_ids", "logprobs", "text", "stop_reason"}
    assert len(row["output_ids"]) == len(row["logprobs"]) <= 6
    assert row["stop_reason"] in ("stop", "length")
  # Greedy output of line 4 is what the sampler gives for those ids alone.
  model = qwen2.from_pretrained(tiny_checkpoint)
  tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
  alone = Sampler(model, stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                         tokenizer.convert_tokens_to_ids("<|endoftext|>")])
  expected = alone.batch.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, temperature=0))
  assert rows[2]["output_ids"] == expected.tokens[0]


def test_cli_names_every_bad_line(tiny_checkpoint, tmp_path, capsys):
  prompts = write_jsonl(tmp_path / "bad.jsonl", [
      json.dumps({"prompt": "fine"}),
      "{not json",
      json.dumps({"messages": [{"role": "user"}]}),
      json.dumps({"input_ids": [1, 10**6]}),
      json.dumps({"prompt": "a", "input_ids": [1]}),
  ])
  rc = generate.main(["--checkpoint", str(tiny_checkpoint), "--prompts", prompts,
                      "--output", str(tmp_path / "out.jsonl")])
  assert rc == 2
  err = capsys.readouterr().err
  assert "4 bad input line(s)" in err
  assert f"{prompts}:2: invalid JSON" in err
  assert f"{prompts}:3: messages[0] needs string 'role' and 'content'" in err
  assert f"{prompts}:4: 'input_ids' has ids outside" in err
  assert f"{prompts}:5: expected exactly one of" in err
  assert not (tmp_path / "out.jsonl").exists()


def test_a_json_error_names_its_column_with_one_at(tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "never closed}')  # json's message: "... starting at"
  with pytest.raises(generate.InputError) as raised:
    generate.read_requests(str(prompts), formatter=None, vocab_size=0)  # JSON is read first
  assert str(raised.value).splitlines()[1] == (
      f"{prompts}:1: invalid JSON (Unterminated string starting at column 12)")


def test_chat_mode_reuses_the_dialogue_cache(tiny_checkpoint, monkeypatch):
  args = generate.parse_args(["--checkpoint", str(tiny_checkpoint), "--chat",
                              "--max-new-tokens", "5"])
  extends = []
  original = BatchSampler.extend

  def spy(self, convs, new_tokens, params, key):
    extends.append((id(convs), len(new_tokens[0])))
    return original(self, convs, new_tokens, params, key)

  monkeypatch.setattr(BatchSampler, "extend", spy)
  stdout = io.StringIO()
  generate.run_chat(args, stdin=io.StringIO("hello\nI feel sad\n\n"), stdout=stdout)
  assert stdout.getvalue().count("model> ") == 2
  assert len(extends) == 2 and extends[0][0] == extends[1][0]  # one conversation, two turns
  assert extends[1][1] < 20  # the second turn feeds only the new message


def test_mesh_flag_parsing():
  assert partitioning.parse_mesh("data=2,fsdp=-1") == {"data": 2, "fsdp": -1}
  assert partitioning.parse_mesh("") is None
  with pytest.raises(ValueError, match="--mesh"):
    partitioning.parse_mesh("data")


@pytest.fixture(scope="module")
def untemplated_checkpoint(tmp_path_factory, tiny_checkpoint):
  """The tiny checkpoint with its tokenizer's chat template removed."""
  path = tmp_path_factory.mktemp("untemplated")
  shutil.copytree(tiny_checkpoint, path, dirs_exist_ok=True)
  (path / "chat_template.jinja").unlink(missing_ok=True)
  config_file = path / "tokenizer_config.json"
  tokenizer_config = json.loads(config_file.read_text())
  tokenizer_config.pop("chat_template", None)
  config_file.write_text(json.dumps(tokenizer_config))
  assert not AutoTokenizer.from_pretrained(path).chat_template
  return path


def test_prompts_and_token_ids_need_no_chat_template(untemplated_checkpoint, tiny_checkpoint,
                                                     tmp_path):
  prompts = write_jsonl(tmp_path / "in.jsonl", [json.dumps({"prompt": "Tell me more"}),
                                                json.dumps({"input_ids": [5, 6, 7]})])
  outputs = []
  for name, checkpoint in (("untemplated", untemplated_checkpoint), ("tiny", tiny_checkpoint)):
    out = tmp_path / f"{name}.jsonl"
    rc = generate.main(["--checkpoint", str(checkpoint), "--prompts", prompts, "--output",
                        str(out), "--max-new-tokens", "4"])
    assert rc == 0
    outputs.append([json.loads(line)["output_ids"] for line in out.read_text().splitlines()])
  assert outputs[0] == outputs[1]  # same weights: the template plays no part


def test_messages_without_a_chat_template_say_what_to_give_instead(untemplated_checkpoint,
                                                                   tmp_path, capsys):
  prompts = write_jsonl(tmp_path / "in.jsonl", [
      json.dumps({"prompt": "fine"}),
      json.dumps({"messages": [{"role": "user", "content": "hi"}]})])
  rc = generate.main(["--checkpoint", str(untemplated_checkpoint), "--prompts", prompts,
                      "--output", str(tmp_path / "out.jsonl")])
  assert rc == 2
  err = capsys.readouterr().err
  assert f"{prompts}:2: 'messages' need a chat template" in err
  assert "'prompt'" in err and "'input_ids'" in err
  rc = generate.main(["--checkpoint", str(untemplated_checkpoint), "--chat"])
  assert rc == 2 and "no chat template" in capsys.readouterr().err


def test_a_cpu_machine_runs_without_libtpus_start_up_noise(tmp_path, tiny_checkpoint):
  """With libtpu installed (the test extras install `.[tpu]`), JAX on a machine without TPU
  chips used to start the TPU plugin first and print its E0000 lines on every run."""
  from tests import cli_run, processes
  prompts = tmp_path / "in.jsonl"
  prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
  env = {k: v for k, v in processes.cpu_env().items() if k != "JAX_PLATFORMS"}
  run = cli_run.run_module("rlver_jax.generate", f"--checkpoint={tiny_checkpoint}",
                           f"--prompts={prompts}", f"--output={tmp_path / 'out.jsonl'}",
                           "--max-new-tokens=2", env=env)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "E0000" not in run.stderr and "worker hostname" not in run.stderr, run.stderr[-2000:]
  assert "CpuDevice" in run.stderr  # the devices it logs
