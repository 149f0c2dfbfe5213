"""The schedule model of the deterministic attention backward (DASH) and its launch plan: the
registry, builders, validity checks, kernel tables, launch plan, DAG simulator, the `auto` rule
(and, imported on their own, the Gantt pictures and the `dash-schedule` CLI)."""
from . import registry
from .builders import MAX_GROUP, Segment, SequenceSchedule, Worker, default_group_size, ordered_sequence
from .geometry import SeqGeometry, make_geometry
from .schedule import Schedule, build_schedule
from .auto import choose_schedule
from .plan import AttentionShape, LaunchOptions, LaunchPlan, launch_order, launch_plan
from .simulate import SimResult, SimulationDeadlock, simulate, simulate_plan
from .tables import KernelTables, kernel_tables
from .validity import ScheduleError, sequential_safe, validate_schedule

__all__ = [
    "registry", "MAX_GROUP", "Schedule", "Segment", "SequenceSchedule", "Worker", "build_schedule",
    "default_group_size", "ordered_sequence", "SeqGeometry", "make_geometry", "KernelTables",
    "kernel_tables", "AttentionShape", "LaunchOptions", "LaunchPlan", "launch_order", "launch_plan",
    "choose_schedule", "SimResult", "SimulationDeadlock", "simulate", "simulate_plan", "ScheduleError",
    "validate_schedule", "sequential_safe",
]
