"""The sampler callers hold: one object with both engines over the same weights.

`Sampler` is `BatchSampler` (a batch of dialogues in lockstep:
`models/batch_sampler.py`) and `RowSampler` (dialogues one row at a time:
`models/row_sampler.py`) on one `SamplerBase` (`models/sampler_base.py`): one copy
of the weights (`models/weight_copy.py`), one placement, one set of stop tokens
and one `DecodeStats`. What sampling is apart from an engine (settings, drawing
from logits, bucket sizes, results) is `models/sampling.py`.
"""

from models.batch_sampler import BatchSampler
from models.row_sampler import RowSampler


class Sampler(BatchSampler, RowSampler):
  """Generation engine for one Qwen2 policy: batch calls (`generate`, `start`, `select`,
  `extend`) and row calls (`start_rows`, `prefill_rows`, `decode_rows`, `compile_rows`).

  Takes the keyword arguments of `BatchSampler`, `RowSampler` and `SamplerBase`;
  `update_weights` gives both engines new weights.
  """
