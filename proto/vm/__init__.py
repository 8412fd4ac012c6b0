"""Training beyond device memory: budgeted pool, AutoVM swap schedule, demand-paging baseline.

    plan = schedule.plan(tape, budget, op_seconds=..., recompute=True)   # plain data
    schedule.validate(tape, plan)                                        # the rules, no GPU
    schedule.estimate_seconds(tape, plan, op_seconds, link)              # its step time
    with Executor(tape, plan) as ex: ex.load(init); ex.step()            # streams + events
    with PagingExecutor(tape, budget) as ex: ...                         # unified-memory baseline
"""
from proto.vm.executor import Executor
from proto.vm.liveness import BudgetError, Liveness
from proto.vm.paging import PagingExecutor, measure_link
from proto.vm.schedule import Link, Plan, PlanError, estimate_seconds, plan, validate

__all__ = ["BudgetError", "Executor", "Link", "Liveness", "PagingExecutor", "Plan", "PlanError",
           "estimate_seconds", "measure_link", "plan", "validate"]
