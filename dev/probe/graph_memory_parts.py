"""Where ours' per-length graph memory goes: stages read one after another in ONE fresh
process (nothing is freed between stages, so reuse cannot hide a stage's cost).
usage: PYTHONPATH=. python3 dev/probe/graph_memory_parts.py N  (N lengths, largest first)"""
import sys, time, json
import numpy as np
from proto.device import backend
from proto.device.backend import cuda
import importlib
C = importlib.import_module("proto.graph.capture")   # (`import proto.graph.capture as C`
# binds proto.graph's exported *function* capture: setting C.Graph there changed nothing, and
# every graph was really instantiated during 'recorded+planned')
from proto.graph import cuda as gcuda
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict, KVCache
from proto.models.graphed import GraphedDecoder

N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
ctx = cuda.current_context()
mm = ctx.memory_manager

def read(label, **extra):
    free, live = backend.settled_free_memory()
    row = dict(stage=label, free_mib=free / 2**20, numba_live_mib=live / 2**20,
               numba_allocs=len(mm.allocations), modules=len(getattr(ctx, "modules", {})), **extra)
    print(json.dumps(row), flush=True)
    return row

r0 = read("start")
config = GPT2Config(12, 768, 12, 50257, 1024)
model = GPT2(config, random_state_dict(config, 0), max_batch=5, max_tokens=5)
r1 = read("model")
cache = KVCache(config, 5, 1024)
tok = cuda.to_device(np.zeros((5, 1), np.int32)); pos = cuda.to_device(np.array([7], np.int32))
for _ in range(2):
    model.step(tok, pos, cache)
backend.synchronize()
r2 = read("eager warm-up")
del cache
class Kept:
    def __init__(self, description, outputs, placeholders, **kw):
        self.description, self.outputs, self.placeholders = description, outputs, placeholders
        self.capture_s, self.memory_bytes = {}, 0
        self.plan = kw.get("plan")
    def close(self): pass
C.Graph = Kept
g = GraphedDecoder(model, batch=5, max_len=1024, binding="alias", strategy="exact")
r3 = read("GraphedDecoder (two KV sets)")
t0 = time.perf_counter()
keys = list(reversed(g.keys))[:N]
checkpoints = {1, 2, max(1, N // 4), max(1, N // 2)}   # fixed cost or per graph: the slope
for i, k in enumerate(keys, 1):
    for d in g.graphed.dispatchers:
        d.graph(k)
    if i in checkpoints and i < N:
        read(f"recorded+planned {i} lengths", graphs=2 * i)
kept = [gr for d in g.graphed.dispatchers for gr in d.graphs.values()]
nodes = sum(len(k.description.nodes) for k in kept)
r4 = read("recorded+planned", graphs=len(kept), nodes=nodes, s=time.perf_counter() - t0,
          arena_mib=g.arena_bytes / 2**20)
# what do descriptions reference that is not arena/weights/caches? distinct device allocations
ptrs = {}
for k in kept:
    for node in k.description.nodes:
        for a in node.args:
            if backend.is_device_array(a):
                own = a.gpu_data
                base = getattr(own, "_owner", None) or own
                ptrs[int(base.handle.value if hasattr(base.handle, 'value') else base.handle)] = base.size
print(json.dumps({"distinct_allocations_referenced": len(ptrs),
                  "their_mib": sum(ptrs.values()) / 2**20,
                  "sizes_hist": sorted(set(ptrs.values()))[:30]}), flush=True)
t0 = time.perf_counter()
lowered = [gcuda._Lowered(k.description) for k in kept]
r5 = read("lowered (definitions)", s=time.perf_counter() - t0)
from cuda.core import LEGACY_DEFAULT_STREAM
t0 = time.perf_counter()
exes = []
for i, l in enumerate(lowered):
    exe = l.definition.instantiate(); exes.append(exe)
    if i == len(lowered) // 2:
        read("instantiated half (no upload)")
r6 = read("instantiated (no upload)", s=time.perf_counter() - t0)
for exe in exes:
    exe.upload(LEGACY_DEFAULT_STREAM)
backend.synchronize()
r7 = read("uploaded")
for exe in exes[:4]:
    exe.launch(LEGACY_DEFAULT_STREAM)
backend.synchronize()
r8 = read("launched 4")
for exe in exes:
    exe.close()
exes = []
r9 = read("executables closed")
for l in lowered:
    l.close()
lowered = []
r10 = read("definitions closed")
kept = []
g.close()
r11 = read("GraphedDecoder closed")
def d(a, b): return round(a["free_mib"] - b["free_mib"], 1)
print(json.dumps({"N_lengths": N, "graphs": 2 * N, "nodes": nodes,
   "kv_sets": d(r2, r3), "record_plan": d(r3, r4), "definitions": d(r4, r5),
   "instantiate": d(r5, r6), "upload": d(r6, r7), "launch": d(r7, r8),
   "exe_close_returned": d(r9, r8), "def_close_returned": d(r10, r9),
   "per_graph_record_plan_kib": d(r3, r4) * 1024 / (2 * N),
   "per_node_instantiate_b": d(r5, r7) * 2**20 / max(nodes, 1)}), flush=True)
