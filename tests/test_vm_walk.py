"""One interpreter of a plan: the checker, the cost model and the executor all read the plan's
actions through `walk`, in the same order, so what is checked and timed is what runs."""
import dataclasses

import pytest

from proto.vm import Executor, Link, Liveness, estimate_seconds, plan, validate
from proto.vm.actions import Action
from proto.vm.walk import Visitor, walk
from proto.vm.synthetic import cnn_tape
from tests.helpers import spy_on_plan_visits


def _busy_plan():
    """A plan with every kind of action: evictions, releases, prefetches, discards, homed
    tensors and recomputations (a slow link makes recomputing cheap pools worth it)."""
    tape, init = cnn_tape(4096, "cpcpc")
    seconds = [1e-6 if op.name.startswith("p") or "act" in op.name else 1e-3 for op in tape.ops]
    p = plan(tape, Liveness(tape).budget_between(0.2), op_seconds=seconds,
             link=Link(1e6, 1e6), recompute=True)
    kinds = {a.kind for _, _, a in p.actions()}
    assert {"evict", "release", "prefetch", "wait", "recompute", "drop", "alloc", "free"} <= kinds
    return tape, init, seconds, p


class _Log(Visitor):
    def __init__(self):
        self.seen = []

    def op(self, i):
        self.seen.append(("op", i))

    def ops_done(self):
        self.seen.append(("ops_done",))

    def visit(self, act, at):
        self.seen.append((at.slot, at.op, act))


def test_walk_visits_each_ops_actions_around_it_then_the_end():
    tape, _, _, p = _busy_plan()
    log = _Log()
    walk(p, log)
    want = []
    for i in range(len(tape.ops)):
        want += [("before", i, a) for a in p.before[i]] + [("op", i)]
        want += [("after", i, a) for a in p.after[i]]
    want += [("ops_done",)] + [("end", len(tape.ops), a) for a in p.end]
    assert log.seen == want
    assert [s for s in log.seen if len(s) == 3] == list(p.actions())


def test_each_action_reaches_the_method_of_its_kind_and_no_other():
    calls = []

    class Kinds(Visitor):
        def op(self, i):
            calls.append(("op", i))

        def evict(self, act, at):
            calls.append(("evict", act.tensor))

    one = plan(*cnn_tape(256, "c")[:1])
    bare = dataclasses.replace(one, before=[[] for _ in one.before], after=[[] for _ in one.after],
                               end=[Action("evict", "x"), Action("free", "y")])
    walk(bare, Kinds())
    assert calls == [("op", i) for i in range(len(one.before))] + [("evict", "x")]
    # "op" names a Visitor method but is no action kind: it must not run an op
    with pytest.raises(ValueError, match="unknown action 'op'"):
        walk(dataclasses.replace(bare, end=[Action("op", "x")]), Kinds())


def test_checker_cost_model_and_executor_see_the_same_actions(monkeypatch):
    tape, init, seconds, p = _busy_plan()
    seen = spy_on_plan_visits(monkeypatch)
    validate(tape, p)
    estimate_seconds(tape, p, seconds, Link(1e6, 1e6))
    with Executor(tape, p) as ex:   # validates again: the checker's log counts twice
        ex.load(init)
        ex.step()
    want = list(p.actions())
    assert seen.pop("_Checker") == want + want
    assert seen.pop("_Clock") == want
    assert seen.pop("_Replay") == want
    assert not seen
