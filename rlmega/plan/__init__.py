"""``rlmega plan``: what each rank of a run holds, phase by phase, built on the meta device (see README.md)."""

from rlmega.plan.config import GPU_PRESETS, PlanConfig
from rlmega.plan.planner import Plan, PlanError, check, make_plan
from rlmega.plan.explain import render_explain
from rlmega.plan.report import render

__all__ = ["GPU_PRESETS", "Plan", "PlanConfig", "PlanError", "check", "make_plan", "render", "render_explain"]
