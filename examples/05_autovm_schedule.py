"""5. AutoVM's swap schedule as plain data, checked without a GPU.

Training a network larger than the GPU means moving activations to the host after forward
uses them and back before backward needs them. The planner reads the step's tape (every op's
reads and writes), chooses evictions and prefetches under a byte budget, places every block at
an arena offset, and returns a plan: data that `validate` replays to check the rules (every
read finds its tensor on the device, no two live blocks overlap, the budget holds).

    python examples/05_autovm_schedule.py
"""
import dataclasses

from proto.vm import Liveness, PlanError, plan, validate
from proto.vm.synthetic import cnn_tape

tape, _ = cnn_tape(4096, "ccpccp")
live = Liveness(tape)
budget = live.budget_between(0.5)
p = plan(tape, budget)
validate(tape, p)
moves = [a for _, _, a in p.actions() if a.kind in ("evict", "prefetch")]
print(f"{len(tape.ops)} ops; unconstrained peak {live.peak} bytes, budget {budget}: "
      f"arena {p.arena_bytes} bytes, {len(moves)} swaps")
for when, i, a in list(p.actions())[:8]:
    print(f"  {when:>6} op {i:2d}: {a.kind:<9} {a.tensor}" + (f" at offset {a.offset}" if a.offset >= 0 else ""))
broken = dataclasses.replace(p, budget=p.arena_bytes - 1)
try:
    validate(tape, broken)
except PlanError as e:
    print(f"validate catches a broken plan: {str(e)[:80]}")
