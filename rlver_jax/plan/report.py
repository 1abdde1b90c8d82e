"""A plan printed: its programs' memory, compile seconds, estimates and kernels, the sampler
group sizes and layouts compared, the peaks and the verdict."""

from __future__ import annotations

from rlver_jax.plan.spec import PlanSpec


def print_plan(result: dict, spec: PlanSpec) -> None:
  where = result.get("topology", result["platform"])
  print(f"{result['model']}: {result['parameters'] / 1e9:.2f}B parameters on {where} "
        f"({result['device_kind']}, {result['devices']} devices, {result['hosts']} host(s)), "
        f"mesh {result['mesh']}, micro-batch {result['micro_batch']} x {spec.seq_len} tokens "
        f"(x{spec.grad_accum} accumulated; {result['dialogues']} dialogues padded to "
        f"{result['padded_rows']} rows), {spec.dtype} compute / {spec.param_dtype} weights, "
        f"remat {spec.remat}, attention {spec.attention}")
  timed = "estimated_s" in next(iter(result["programs"].values()))
  print(f"{'per device, GiB':<44}{'phase':>8}{'args':>7}{'temps':>7}{'+resident':>10}"
        f"{'compile s':>10}" + (f"{'est. s':>9}{'x calls':>9}  bound" if timed else "") +
        "  kernels")
  for name, r in result["programs"].items():
    times = (f"{r['estimated_s']:>9.4f}{r['calls']:>9.1f}  {r['bound']:<7}" if timed else "")
    kernels = r.get("error") or ",".join(r["kernels"]) or "-"
    print(f"{name:<44}{r['phase']:>8}{r['argument_gib']:>7.2f}{r['temp_gib']:>7.2f}"
          f"{r['extra_gib']:>10.2f}{r['compile_s']:>10.1f}{times}  {kernels}")
  if "row_programs" in result:
    rows = result["row_programs"]
    print(f"row programs: {rows['compiled']} compiled of the {rows['possible']} shapes a step "
          f"can meet (--row_programs=all compiles every one)")
  copy = (f"; the sampler's {result['sampling_dtype']} copy ({result['sampling_layout']} "
          f"layout, mesh {result['sampler_mesh']}) {result['sampling_copy_gib']:.2f}" +
          (", dropped during the update" if result["release_sampler_weights"] else "")
          if result["sampling_copy_gib"] else "")
  print(f"resident          {result['resident_gib']:.2f} GiB per device (policy and critic "
        f"weights and optimizer states, reference{copy})")
  budget = result.get("budget_gib")
  verdict = lambda ok: "" if budget is None else (": fits" if ok else ": does NOT fit")
  for k, v in result["sampler_hosts"].items():
    mark = " <- planned" if k == result["hosts_per_group"] else ""
    print(f"sampler_hosts={k:<3} {v['groups']:>3} group(s) on mesh {v['sampler_mesh']}, copy "
          f"{v['copy_gib']:.2f} GiB; rollout peak {v['rollout_gib']:.2f}, update peak "
          f"{v['update_gib']:.2f} GiB{verdict(v['fits'])}{mark}")
  if result["sampler_hosts"]:
    print(f"sampler_hosts recommended: {result['recommended_hosts']} (the fewest that fit; "
          "--config.rollout.sampler_hosts=K or 'auto')")
  for layout, v in result.get("sampling_layouts", {}).items():
    if layout != "recommended":
      print(f"sampler layout {layout:<7} copy {v['copy_gib']:.2f} GiB, decode chunk "
            f"+{v['decode_extra_gib']:.2f} GiB, est. {v['decode_chunk_estimated_s']:.3f} s "
            f"({v['decode_bound']}-bound), peak {v['peak_gib']:.2f} GiB{verdict(v['fits'])}")
  if "sampling_layouts" in result:
    print(f"sampler layout recommended: {result['sampling_layouts']['recommended']}")
  print(f"estimated peak    rollout {result['rollout_peak_gib']:.2f}, update "
        f"{result['update_peak_gib']:.2f} GiB per device (resident plus the largest "
        f"'+resident' of the phase); compile {result['compile_s']:.1f} s in all")
  if "estimate" in result:
    e = result["estimate"]
    tokens = (f", decode {e['decode_tokens_per_s_per_chip']:.0f} tokens/s per chip"
              if "decode_tokens_per_s_per_chip" in e else "")
    print(f"estimated step    {e['step_s']:.1f} s (rollout {e['rollout_s']:.1f} s at "
          f"{e['dialogue_tokens']} policy tokens a dialogue, learner {e['learner_s']:.1f} s), "
          f"update MFU {e['update_mfu']:.0%}{tokens}: a roofline cost model "
          f"(rlver_jax/costs.py), not a measurement")
  if budget is not None:
    print(f"verdict: {'fits' if result['fits'] else 'does NOT fit'} in {budget:.4g} GiB per "
          f"device ({result['memory_fraction']:.0%} of {result['memory_gib']:g}; "
          f"sampler_hosts={result['hosts_per_group']})")
