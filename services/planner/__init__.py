"""The planner: sizes and places every job by the cost model (docs/architecture.md), with CP-SAT."""
