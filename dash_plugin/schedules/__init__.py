"""The schedule model of the deterministic attention backward (DASH): builders, validity
checks, kernel tables, DAG simulator, Gantt pictures, the `auto` rule and the CLI."""
from .builders import (ALL_SCHEDULES, MAX_GROUP, ORDERED_SCHEDULES, Schedule, Segment,
                       SequenceSchedule, Worker, build_schedule, default_group_size)
from .geometry import SeqGeometry, make_geometry
from .auto import choose_schedule
from .simulate import SimResult, SimulationDeadlock, simulate
from .tables import KernelTables, kernel_tables
from .validity import ScheduleError, check_schedule, sequential_safe

__all__ = [
    "ALL_SCHEDULES", "MAX_GROUP", "ORDERED_SCHEDULES", "Schedule", "Segment", "SequenceSchedule",
    "Worker", "build_schedule", "default_group_size", "SeqGeometry", "make_geometry",
    "KernelTables", "kernel_tables", "choose_schedule", "SimResult", "SimulationDeadlock",
    "simulate", "ScheduleError", "check_schedule", "sequential_safe",
]
