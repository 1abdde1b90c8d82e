"""The sampler callers hold: one set of weights and the two engines that decode from it.

`Sampler` holds a `SamplerWeights` (`models/sampler_weights.py`: one copy of the
weights, `models/weight_copy.py`, one placement, one set of stop tokens and one
`DecodeStats`), its batch engine `batch` (a batch of dialogues in lockstep:
`models/batch_sampler.py`) and its row engine `rows` (dialogues one row at a
time: `models/row_sampler.py`). Each caller uses one engine: the lockstep
rollout's agent the batch, the continuous engine (`rl/engine.py`) the rows.
What sampling is apart from an engine (settings, drawing from logits, bucket
sizes, results) is `models/sampling.py`.
"""

from models import qwen2
from models.batch_sampler import BatchSampler
from models.row_programs import DECODE_CHUNK_STEPS, PREFILL_CHUNK
from models.row_sampler import RowSampler
from models.sampler_weights import SamplerWeights
from models.sampling import MIN_CHUNK_BUCKET


class Sampler:
  """Generation for one Qwen2 policy: `batch` (`generate`, `start`, `select`, `extend`) and
  `rows` (`start_rows`, `prefill_rows`, `decode_rows`, `compile_rows`, and a sampler group's
  `leading` and `follow`), both over `weights` (`update` gives both new weights).
  """

  def __init__(self, model: qwen2.Qwen2, *, min_chunk_bucket: int = MIN_CHUNK_BUCKET,
               decode_chunk_steps: int = DECODE_CHUNK_STEPS, prefill_chunk: int = PREFILL_CHUNK,
               **weights_kwargs):
    """`min_chunk_bucket` goes to the batch engine, `decode_chunk_steps` and `prefill_chunk`
    to the row engine, the rest (`stop_token_ids`, `pad_id`, `mesh`, ...) to `SamplerWeights`."""
    self.weights = SamplerWeights(model, **weights_kwargs)
    self.batch = BatchSampler(self.weights, min_chunk_bucket=min_chunk_bucket)
    self.rows = RowSampler(self.weights, decode_chunk_steps=decode_chunk_steps,
                           prefill_chunk=prefill_chunk)
