"""`python -m tests.group_member MODULE [ARGS...]` runs MODULE as `python -m MODULE ARGS...`
would, in a process of a JAX group whose compiled programs go into the test session's
compilation cache whatever its process index.

JAX writes persistent-cache entries from process 0 only (`jax._src.compiler._cache_write`:
on a pod the hosts would race on one shared bucket). A program is keyed by its devices, so
the programs of the other processes (their host-local samplers, their shares of the
collectives) have keys of their own that nobody writes, and every launch of a multi-process
test compiled them again, keeping the whole group waiting at its first collective. Each
process here has the test session's cache on a local disk, so each writes its own entries.
"""

import runpy
import sys

from jax._src import compilation_cache, compiler, distributed


def _every_process_writes(jax_write):
  """`jax_write` (JAX's `_cache_write`) with its process-0 rule lifted: another process writes
  its entry as process 0 would, and skips what JAX's rule skips (host callbacks, which are
  baked into the program, and programs faster to compile than the cache's minimum)."""
  def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
    if distributed.global_state.process_id == 0:
      return jax_write(cache_key, compile_time_secs, module_name, backend, executable,
                       host_callbacks)
    min_seconds = compiler.config.persistent_cache_min_compile_time_secs.value
    if host_callbacks or compile_time_secs < min_seconds:
      return None
    compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                              int(compile_time_secs))
    return None

  return write


if __name__ == "__main__":
  compiler._cache_write = _every_process_writes(compiler._cache_write)
  module, sys.argv = sys.argv[1], sys.argv[1:]
  runpy.run_module(module, run_name="__main__", alter_sys=True)
