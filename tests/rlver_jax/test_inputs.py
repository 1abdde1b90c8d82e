"""A user's bad input files and flags: one line naming the file, line or field, before any work."""

import json
import os
import shutil
import struct

import numpy as np
import pytest

from infra.errors import MissingInputError, UserInputError
from models import checkpoint_io, safetensors_io
from models import pretrained
from rlver_jax import plan, retention, tiny
from sim_user import profiles
from tests.cli_run import last_line_only_error, run_main, run_module

GOOD_PROFILE = {"id": "a", "player": "p", "scene": "s", "main_cha": "m", "task": "be praised"}


# Profiles.

def test_profile_with_non_utf8_bytes_names_file_and_line(tmp_path):
  path = tmp_path / "profiles.jsonl"
  path.write_bytes(json.dumps(GOOD_PROFILE).encode() + b'\n{"id": "b\xff\xfe"}\n')
  with pytest.raises(UserInputError, match=f"{path}:2: not UTF-8 text \\(byte 0xff at byte 10"):
    profiles.load_profiles(str(path))


def test_unknown_intention_is_an_error_listing_the_known_ones(tmp_path):
  path = tmp_path / "profiles.jsonl"
  path.write_text(json.dumps(GOOD_PROFILE) + "\n" +
                  json.dumps({**GOOD_PROFILE, "id": "b", "task": "wants to be left alone"}) + "\n")
  with pytest.raises(UserInputError) as error:
    profiles.load_profiles(str(path))
  message = str(error.value)
  assert message.startswith(f"{path}:2: field 'task': names none of the eight hidden intentions")
  assert all(key in message for key in profiles.INTENTIONS)


def test_profiles_saved_with_a_utf8_byte_order_mark_load(tmp_path):
  path = tmp_path / "profiles.jsonl"
  path.write_bytes("\ufeff".encode() + json.dumps(GOOD_PROFILE).encode() + b"\n")
  assert [p.id for p in profiles.load_profiles(str(path))] == ["a"]


def test_unknown_profile_fields_are_warned_about_once_naming_their_first_line(tmp_path, caplog):
  path = tmp_path / "profiles.jsonl"
  path.write_text("".join(json.dumps(obj) + "\n" for obj in [
      {**GOOD_PROFILE, "fisrt_talk": "hi"}, {**GOOD_PROFILE, "id": "b"},
      {**GOOD_PROFILE, "id": "c", "fisrt_talk": "hi", "mood": "low"}]))
  caplog.set_level("WARNING")
  profiles.load_profiles(str(path))
  warnings = [m for m in caplog.messages if "unknown field" in m]
  assert warnings == [f"{path}: ignoring unknown field(s) 'fisrt_talk' (line 1), 'mood' (line 3); "
                      "known fields: " + ", ".join(profiles.KNOWN_FIELDS)]


def test_demo_profiles_have_no_unknown_fields(caplog):
  caplog.set_level("WARNING")
  profiles.load_profiles(profiles.DEMO_PROFILES)
  assert not [m for m in caplog.messages if "unknown field" in m]


def test_released_profiles_have_no_unknown_fields(caplog, shared_data):
  caplog.set_level("WARNING")
  for name in ("train_profile.jsonl", "test_profile.jsonl"):
    profiles.load_profiles(shared_data("rlver", name))
  assert not [m for m in caplog.messages if "unknown field" in m]


# Safetensors.

def write_weights(path):
  safetensors_io.write(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                              "b": np.ones(4, np.int32)})
  return path


def test_truncated_safetensors_is_reported_on_opening(tmp_path):
  path = write_weights(tmp_path / "model.safetensors")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 4)
  with pytest.raises(UserInputError, match=f"{path}: tensor b: data_offsets \\[24, 40\\] lie "
                                           "outside the file's 36 data bytes"):
    safetensors_io.SafetensorsFile(path)


def test_safetensors_header_longer_than_the_file(tmp_path):
  path = tmp_path / "model.safetensors"
  path.write_bytes(struct.pack("<Q", 10 ** 12) + b"{}")
  with pytest.raises(UserInputError, match=f"{path}: header claims 1000000000000 bytes but the "
                                           "file has 10"):
    safetensors_io.SafetensorsFile(path)


@pytest.mark.parametrize("entry,message", [
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]},
     "data_offsets span 8 bytes but shape [2, 2] of F32 needs 16"),
    ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, "malformed header entry"),
    ({"dtype": "F32", "shape": [2]}, "malformed header entry"),
])
def test_inconsistent_safetensors_entries(tmp_path, entry, message):
  header = json.dumps({"x": entry}).encode()
  path = tmp_path / "model.safetensors"
  path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
  with pytest.raises(UserInputError, match=f"tensor x: {message}".replace("[", "\\[")):
    safetensors_io.SafetensorsFile(path)


def test_a_sound_file_still_reads(tmp_path):
  st = safetensors_io.SafetensorsFile(write_weights(tmp_path / "model.safetensors"))
  np.testing.assert_array_equal(st.read("a"), np.arange(6).reshape(2, 3))


def test_checkpoint_directory_errors_are_user_errors(tmp_path):
  with pytest.raises(MissingInputError, match="does not exist") as error:
    checkpoint_io.read_hf_config(str(tmp_path / "nowhere"))
  assert isinstance(error.value, FileNotFoundError)  # what callers caught before
  (tmp_path / "config.json").write_bytes(b'{"vocab_size": "\xff"}')
  with pytest.raises(UserInputError, match="config.json: invalid JSON"):
    checkpoint_io.read_hf_config(str(tmp_path))


# Tokenizers.

def tokenizer_dir(tmp_path, vocab_size):
  """A checkpoint-like directory: our tiny tokenizer's files and a config.json."""
  directory = tmp_path / "ckpt"
  shutil.copytree(tiny.TOKENIZER_DIR, directory)
  (directory / "config.json").write_text(json.dumps({"model_type": "qwen2",
                                                     "vocab_size": vocab_size}))
  return str(directory)


def test_checkpoint_without_tokenizer_files(tmp_path):
  directory = tokenizer_dir(tmp_path, 1024)
  os.remove(os.path.join(directory, "tokenizer.json"))  # transformers would build a 1-token one
  with pytest.raises(MissingInputError, match=f"{directory}: no tokenizer files"):
    pretrained.load_tokenizer(directory)


def test_tokenizer_larger_than_the_model_vocabulary(tmp_path):
  directory = tokenizer_dir(tmp_path, 64)
  with pytest.raises(UserInputError, match=r"tokenizer has \d+ tokens but config.json's "
                                           "vocab_size is 64"):
    pretrained.load_tokenizer(directory)


def test_a_sound_tokenizer_loads(tmp_path):
  tokenizer = pretrained.load_tokenizer(tokenizer_dir(tmp_path, 1024))
  assert len(tokenizer) >= pretrained.MIN_TOKENIZER_SIZE and tokenizer("hello")["input_ids"]


@pytest.mark.heavy
def test_training_cli_reports_missing_tokenizer_files_in_one_line(tmp_path):
  directory = tokenizer_dir(tmp_path, 1024)
  os.remove(os.path.join(directory, "tokenizer.json"))
  done = run_main(tmp_path / "w", "--config.policy.tiny_init=False", "--config.mesh.fsdp=1",
                  f"--config.policy.checkpoint={directory}", timeout=120)
  assert done.returncode == 1
  assert last_line_only_error(done.stderr) == (
      f"error: {directory}: no tokenizer files (none of tokenizer.json, vocab.json, "
      "tokenizer.model, vocab.txt); copy them from the model the checkpoint was trained from")


# The planner and the retention data.

def test_unknown_planner_model_lists_the_presets():
  with pytest.raises(UserInputError, match="--model=qwen9: unknown preset; known: .*qwen2.5-7b"):
    plan.preset("qwen9")


def test_planner_cli_unknown_model_is_one_line():
  done = run_module("rlver_jax.plan", "--model=qwen9", timeout=120)
  assert done.returncode == 1
  assert last_line_only_error(done.stderr).startswith("error: --model=qwen9: unknown preset")


def test_ifeval_item_without_its_value(tmp_path):
  path = tmp_path / "ifeval.jsonl"
  path.write_text('{"prompt": "p", "instructions": [{"type": "lowercase"}]}\n'
                  '{"prompt": "p", "instructions": [{"type": "no_commas"}, '
                  '{"type": "max_words"}]}\n')
  with pytest.raises(UserInputError, match=f"{path}:2: instructions\\[1\\].value: max_words "
                                           "needs a 'value' of type int; the item has none"):
    retention.read_items(str(path), "ifeval")
  path.write_text('{"prompt": "p", "instructions": [{"type": "contains", "value": 3}]}\n')
  with pytest.raises(UserInputError, match="contains needs a 'value' of type str; the item has 3"):
    retention.read_items(str(path), "ifeval")
