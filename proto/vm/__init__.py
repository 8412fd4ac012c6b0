"""Training beyond device memory: budgeted pool, AutoVM swap schedule, demand-paging baseline.

    p = plan(tape, budget, op_seconds=..., recompute=True)     # plain data (schedule.py)
    validate(tape, p)                                          # the rules, no GPU (check.py)
    estimate_seconds(tape, p, op_seconds, link)                # its step time (cost.py)
    with Executor(tape, p) as ex: ex.load(init); ex.step()     # streams + events (executor.py)
    with PagingExecutor(tape, budget) as ex: ...               # unified-memory baseline
    p = plan_for_pages(tape, budget)                           # a plan that fits in 2 MiB pages
    with ManagedExecutor(tape, p, budget=budget) as ex: ...    # the plan on managed memory

The checker, the cost model and both executors (pool and managed) read a plan through one interpreter (walk.py).
"""
from proto.vm.actions import Plan, PlanError
from proto.vm.check import validate
from proto.vm.cost import estimate_seconds
from proto.vm.executor import Executor
from proto.vm.liveness import BudgetError, Liveness
from proto.vm.managed import ManagedExecutor, plan_for_pages
from proto.vm.paging import PagingExecutor, measure_link
from proto.vm.schedule import plan
from proto.vm.timeline import Link

__all__ = ["BudgetError", "Executor", "Link", "Liveness", "ManagedExecutor", "PagingExecutor", "Plan",
           "PlanError", "estimate_seconds", "measure_link", "plan", "plan_for_pages", "validate"]
